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
    ", " + job.messages_per_second.toFixed(1) + " msg/s, " + (job.bytes_per_second / 1024).toFixed(1) + " KiB/s", "muted"));
  box.appendChild(title);
  const table = el("table", null, "ranks");
  const head = el("tr");
  for (const h of ["rank", "host", "pid", "state", "heartbeat", "operation"]) head.appendChild(el("th", h));
  table.appendChild(head);
  for (const m of job.members) {
    const tr = row([[m.rank, "num"], [m.host], [m.pid, "num"], [m.status, m.status],
      [age(m.heartbeat_age) + " ago", "num"], [operation(m)]]);
    tr.dataset.rank = m.rank;
    table.appendChild(tr);
  }
  box.appendChild(table);
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
    const { time, job, event, generation, ...rest } = e;
    body.appendChild(row([[new Date(time * 1000).toLocaleTimeString()], [job], [event, event.replace(/_/g, "-")],
      [JSON.stringify(rest)]]));
  }
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
