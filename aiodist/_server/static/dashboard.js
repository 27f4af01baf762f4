// The aiodist dashboard: polls /api/state every second and renders it as text only.
"use strict";

const POLL_MS = 1000;
const PAGE = 20;
let token = sessionStorage.getItem("aiodist-token") || "";
let offset = 0;

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function age(seconds) {
  if (seconds < 60) return seconds.toFixed(1) + " s";
  if (seconds < 3600) return Math.floor(seconds / 60) + "m" + String(Math.floor(seconds % 60)).padStart(2, "0") + "s";
  return Math.floor(seconds / 3600) + "h" + String(Math.floor((seconds % 3600) / 60)).padStart(2, "0") + "m";
}

function operation(m) {
  if (m.status !== "active") return "";
  if (m.op) return (m.op.seq ? m.op.name + " #" + m.op.seq : m.op.name) + " for " + age(m.op["for"]);
  if (m.last) return "idle (last: " + m.last.name + " #" + m.last.seq + ", " + age(m.last.ago) + " ago)";
  return "idle";
}

// A collective its waiting ranks have been in this long marks the ranks it waits for
// (not entered) as the ones holding the job up.
const STUCK_AFTER_S = 2;
const SVG = "http://www.w3.org/2000/svg";

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : String(Math.round(n))) + " " + units[i];
}

function rates(t) {
  return t.messages_per_second.toFixed(1) + " msg/s, " + bytes(t.bytes_per_second) + "/s";
}

// The ranks some collective has waited for for a while: rank -> that collective.
function holdingUp(job) {
  const found = new Map();
  for (const call of job.waits || []) {
    const longest = Math.max(0, ...call.waiting.map((w) => w["for"]));
    if (longest < STUCK_AFTER_S) continue;
    for (const n of call.not_entered) if (!found.has(n.rank)) found.set(n.rank, { call, longest });
  }
  return found;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
}

// A small plot of the job's data-plane throughput (bytes/s) over its history.
function plot(history) {
  const width = 360, height = 64, pad = 2;
  const figure = el("figure", null, "throughput");
  const points = history.points;
  // The time the history covers (the server keeps 150 intervals), at least a minute.
  const span = Math.min(history.interval * 150, Math.max(60, points.length ? points[0][0] + history.interval : 0));
  const peak = Math.max(0, ...points.map((p) => p[2]));
  const chart = svg("svg", { width, height, viewBox: "0 0 " + width + " " + height, role: "img" });
  chart.appendChild(svg("rect", { x: 0, y: 0, width, height, fill: "#f7f7f7", stroke: "#ddd" }));
  const x = (ago) => pad + (width - 2 * pad) * (1 - Math.min(ago, span) / span);
  const y = (v) => height - pad - (height - 2 * pad) * (peak > 0 ? v / peak : 0);
  if (points.length) {
    const line = points.map((p) => x(p[0]).toFixed(1) + "," + y(p[2]).toFixed(1)).join(" ");
    chart.appendChild(svg("polyline", { points: line, fill: "none", stroke: "#2a6fb0", "stroke-width": 1.5 }));
  }
  const title = svg("title", {});
  title.textContent = "bytes per second sent between ranks, last " + age(span);
  chart.appendChild(title);
  figure.appendChild(chart);
  figure.appendChild(el("figcaption", points.length
    ? "data sent between ranks, last " + age(span) + ": peak " + bytes(peak) + "/s"
    : "data sent between ranks: no report yet", "muted"));
  return figure;
}

function waitLine(call) {
  const ranks = call.waiting.map((w) => w.rank).join(", ");
  const longest = Math.max(...call.waiting.map((w) => w["for"]));
  const who = call.waiting.length > 1 ? "ranks " : "rank ";
  let text = call.name + " #" + call.seq + " on group '" + call.group + "': " + who + ranks + " waiting " + age(longest);
  for (const n of call.not_entered) {
    text += "; rank " + n.rank + " not entered";
    if (n.last) text += " (last: " + n.last.name + " #" + n.last.seq + ", done " + age(n.last.ago) + " ago)";
  }
  return text;
}

function row(cells) {
  const tr = el("tr");
  for (const [text, cls] of cells) tr.appendChild(el("td", text, cls));
  return tr;
}

function renderJob(job) {
  const box = el("div", null, "job");
  box.dataset.job = job.name;
  const title = el("h3");
  title.appendChild(el("span", "job " + job.name + " "));
  title.appendChild(el("span", job.state, job.state));
  title.appendChild(el("span", "  " + job.joined + "/" + job.world_size + " joined, age " + age(job.age) +
    ", " + rates(job.traffic) + " between ranks", "muted traffic"));
  box.appendChild(title);
  const body = el("div", null, "job-body");
  const table = el("table", null, "ranks");
  const head = el("tr");
  for (const h of ["rank", "host", "pid", "state", "heartbeat", "operation"]) head.appendChild(el("th", h));
  table.appendChild(head);
  const stuck = holdingUp(job);
  for (const m of job.members) {
    // A member that joined a forming job has no rank until the job forms.
    const rank = m.rank === null ? "–" : m.rank;
    let op = operation(m);
    const held = m.rank === null ? undefined : stuck.get(m.rank);
    if (held) {
      const c = held.call;
      op = "not in " + c.name + " #" + c.seq + ", which others wait in for " + age(held.longest) +
        (op ? "; " + op : "");
    }
    const tr = row([[rank, "num"], [m.host], [m.pid, "num"], [m.status, m.status],
      [age(m.heartbeat_age) + " ago", "num"], [op]]);
    if (m.rank === null) tr.title = "its rank is assigned when the job forms";
    tr.dataset.rank = m.rank === null ? "" : m.rank;
    if (held) {
      tr.classList.add("stuck");
      tr.title = "the others wait for this rank";
    }
    table.appendChild(tr);
  }
  body.appendChild(table);
  if (job.history) body.appendChild(plot(job.history));
  box.appendChild(body);
  if (job.ranks_hidden) box.appendChild(el("p", "and " + job.ranks_hidden + " more ranks", "muted"));
  for (const f of job.failures) {
    box.appendChild(el("p", "rank " + f.rank + " (" + f.host + ", pid " + f.pid + ") failed: " + f.reason, "bad failure"));
  }
  for (const call of job.waits || []) box.appendChild(el("p", waitLine(call), "wait"));
  return box;
}

function render(state) {
  document.getElementById("server").textContent =
    "version " + state.version + ", up " + age(state.uptime) + ", " + state.connections + " connections";
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  const jobs = document.getElementById("jobs");
  jobs.replaceChildren();
  if (state.offset > 0 && state.offset >= state.jobs_total) offset = Math.max(0, state.jobs_total - PAGE);
  const last = state.offset + state.jobs.length;
  document.getElementById("page").textContent = state.jobs_total
    ? "jobs " + (state.offset + 1) + "-" + last + " of " + state.jobs_total : "";
  document.getElementById("previous").disabled = state.offset === 0;
  document.getElementById("next").disabled = last >= state.jobs_total;
  if (!state.jobs.length) jobs.appendChild(el("p", "no jobs", "muted"));
  for (const job of state.jobs) jobs.appendChild(renderJob(job));
  for (const f of state.finished || []) {
    jobs.appendChild(el("p", "finished: job " + f.job + " " + f.state + " after " + age(f.seconds) + ", " + age(f.ago) + " ago", "muted"));
  }
  const body = document.querySelector("#events tbody");
  body.replaceChildren();
  for (const e of state.events.slice().reverse()) {
    body.appendChild(row([[new Date(e.time * 1000).toLocaleTimeString(), "time"], [e.job],
      [e.event, e.event.replace(/_/g, "-")], [describe(e)]]));
  }
}

function plural(n, one, many) {
  return n + " " + (n === 1 ? one : many);
}

function who(e) {
  return (e.rank === null || e.rank === undefined ? "a rank" : "rank " + e.rank) +
    (e.host ? " on " + e.host : "") + (e.pid ? " (pid " + e.pid + ")" : "");
}

function ended(e) {
  if (e.state === "succeeded") return "every rank left: succeeded after " + age(e.seconds);
  if (e.state === "not_formed") {
    return "never formed (" + (e.reason || "its members left before all " + e.world_size + " joined") + ")";
  }
  let text = "failed after " + age(e.seconds);
  if (e.ran !== null && e.ran !== undefined) text += " (ran " + age(e.ran) + ")";
  if (e.first_failure) {
    text += "; rank " + e.first_failure.rank + " failed first: " + e.first_failure.reason;
    const left = e.first_failure.after_leaves;
    if (left && left.length) text += " (after " + (left.length > 1 ? "ranks " : "rank ") + left.join(", ") + " left)";
  } else if (e.reason) {
    text += ": " + e.reason;
  }
  return text;
}

// Each event in words; an event this page does not know is shown as its fields.
const DESCRIBE = {
  job_created: (e) => "new job of " + plural(e.world_size, "rank", "ranks"),
  generation_restarted: (e) => "generation " + e.generation + " starts" + (e.previous_generation === undefined ? ""
    : " after generation " + e.previous_generation + " " + e.previous_state +
      (e.previous_seconds === undefined ? "" : " (after " + age(e.previous_seconds) + ")")),
  rank_joined: (e) => who(e) + " joined: " + e.joined + " of " + e.world_size,
  job_formed: (e) => "all " + plural(e.world_size, "rank", "ranks") + " joined from " +
    plural(e.hosts, "host", "hosts") + " in " + age(e.seconds),
  rank_failed: (e) => who(e) + " failed" + (e.ran === null || e.ran === undefined ? "" : " after " + age(e.ran)) +
    ": " + e.reason,
  job_finished: ended,
  rank_reattached: (e) => who(e) + " re-attached to the server that came back",
  job_restored: (e) => "restored from the state directory: " + plural(e.away, "rank", "ranks") +
    " to re-attach, " + plural(e.keys, "key", "keys"),
};

function describe(e) {
  const words = DESCRIBE[e.event];
  if (words) return words(e);
  const { time, job, event, generation, ...rest } = e;
  return Object.entries(rest).map(([k, v]) => k.replace(/_/g, " ") + ": " +
    (typeof v === "object" && v !== null ? JSON.stringify(v) : v)).join(", ");
}

async function poll() {
  try {
    const headers = token ? { Authorization: "Bearer " + token } : {};
    const query = "?offset=" + offset + "&limit=" + PAGE;
    const response = await fetch("/api/state" + query, { headers, cache: "no-store" });
    const form = document.getElementById("token-form");
    if (response.status === 401) {
      form.hidden = false;
      document.getElementById("token-error").textContent = token ? "that token was refused" : "";
      document.getElementById("jobs").replaceChildren(el("p", "enter the server's token to see its jobs", "muted"));
    } else if (response.ok) {
      form.hidden = true;
      render(await response.json());
    }
  } catch (err) {
    document.getElementById("updated").textContent = "the server does not answer (" + err + ")";
  }
  setTimeout(poll, POLL_MS);
}

document.getElementById("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  token = document.getElementById("token").value;
  sessionStorage.setItem("aiodist-token", token);
});

document.getElementById("previous").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); });
document.getElementById("next").addEventListener("click", () => { offset += PAGE; });

poll();
