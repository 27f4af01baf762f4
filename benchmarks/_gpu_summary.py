"""Reading each ``gpu_check`` part's output, and writing the one summary (JSON and text).

The readers are plain functions of a part's output text and the result file
it was told to write, so they are tested on CPU with real outputs. The
summary is ``gpu-check.json`` (schema below) and ``gpu-check.txt`` (the same,
for people), rewritten after every part: a run cut short still leaves what it
measured.

JSON schema ``aiodist-gpu-check/1``::

    {"schema", "status": "running" | "passed" | "failed", "started", "updated",
     "wall_s", "budget_s", "command", "environment": {...}, "device": {...},
     "headline": {"tests", "overlap_share_hidden", "busbw_gbps", "lag_p99_ms"},
     "parts": [{"name", "title", "status", "returncode", "seconds", "timeout_s",
                "command", "figures", "note", "leftovers", "output_tail"}, ...]}

Only the standard library.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from benchmarks._common import format_table

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from benchmarks._gpu_parts import PartResult

__all__ = [
    "SCHEMA",
    "build_summary",
    "clean",
    "last_json_line",
    "parse_busbw",
    "parse_lag",
    "parse_overlap",
    "parse_pytest",
    "render_text",
    "write_summary",
]

SCHEMA = "aiodist-gpu-check/1"
OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_VERBOSE = re.compile(
    r"^(?P<id>\S+::\S+) (?P<outcome>" + "|".join(OUTCOMES) + r")(?: \((?P<why>.*?)\))?"
    r"\s*(?:\[\s*\d+%\])?\s*$"
)
_SHORT = re.compile(
    r"^(?P<outcome>PASSED|FAILED|ERROR|XFAIL|XPASS) (?P<id>\S+)(?: - (?P<why>.*))?$"
)
_STEP = re.compile(r"(?P<mode>overlap|blocking|none): +(?P<ms>[\d.]+) ms/step")
_FINAL = re.compile(r"^=+ (?P<counts>.*\d+ \w+.*) in (?P<secs>[\d.]+)s.* =+$")


# --- readers: one per kind of part ---------------------------------------------------------


def last_json_line(text: str, result: Path | None = None) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object (a probe's answer; ``result`` unused)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    raise ValueError("no JSON line in the output")


def parse_pytest(output: str, junit: Path | None = None) -> dict[str, Any]:
    """Each test's outcome (``-v`` lines, ``-rA`` summary, junit XML when written) and counts.

    Works on the output of a run cut short too: ``-v`` prints each outcome as it
    happens, so the tests that finished are there.
    """
    tests: dict[str, dict[str, Any]] = {}
    collection_errors: list[str] = []
    final = ""
    for line in output.splitlines():
        line = line.rstrip()
        if m := _VERBOSE.match(line):
            entry = tests.setdefault(m["id"], {"id": m["id"]})
            if m["outcome"] == "ERROR" and entry.get("outcome") == "PASSED":
                entry["outcome"] = "ERROR"  # passed, then its teardown failed
            elif entry.get("outcome") not in ("FAILED", "ERROR"):
                entry["outcome"] = m["outcome"]
            if m["why"]:
                entry["message"] = m["why"]
        elif m := _SHORT.match(line):
            if "::" not in m["id"]:
                collection_errors.append(f"{m['id']}: {m['why'] or 'collection failed'}")
                continue
            entry = tests.setdefault(m["id"], {"id": m["id"], "outcome": m["outcome"]})
            if m["outcome"] in ("FAILED", "ERROR"):
                entry["outcome"] = m["outcome"]
            if m["why"]:
                entry["message"] = m["why"][:500]
        elif m := _FINAL.match(line):
            final = m["counts"].strip() + f" in {m['secs']}s"
    if junit is not None and junit.exists():
        _merge_junit(tests, junit)
    counts: dict[str, int] = {}
    for entry in tests.values():
        key = entry.get("outcome", "UNKNOWN").lower()
        counts[key] = counts.get(key, 0) + 1
    if not tests and not collection_errors and not final:
        raise ValueError("pytest printed no test outcomes")
    return {
        "counts": counts,
        "tests": sorted(tests.values(), key=lambda e: str(e["id"])),
        "collection_errors": collection_errors,
        "pytest_summary": final,
    }


def _merge_junit(tests: dict[str, dict[str, Any]], junit: Path) -> None:
    try:
        root = ET.parse(junit).getroot()
    except (ET.ParseError, OSError):
        return
    for case in root.iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        node = f"{cls.replace('.', '/')}.py::{name}"
        entry = tests.get(node)
        if entry is None:
            continue
        entry["seconds"] = float(case.get("time", "0") or 0)
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None and found.get("message"):  # whole, where -v cut it to fit
                entry["message"] = found.get("message", "").splitlines()[0][:500]


def parse_overlap(output: str, result: Path | None = None) -> dict[str, Any]:
    """``examples/train_overlap.py``'s figures: ms per step per mode and the share hidden."""
    if result is not None and result.exists():
        data = json.loads(result.read_text())
        modes = {m: data[m] * 1e3 for m in ("overlap", "blocking", "none") if m in data}
        share = data.get("overlap_efficiency")
        world, backend = data.get("world_size"), data.get("backend")
    else:  # the printed lines: "[rank 0]  overlap:   12.3 ms/step, ..." and the share
        modes = {m["mode"]: float(m["ms"]) for m in _STEP.finditer(output)}
        found = re.search(r"overlap efficiency: (-?[\d.]+|nan)% of comm time hidden", output)
        share = float(found[1]) / 100 if found else None
        world = backend = None
    if not modes:
        raise ValueError("train_overlap.py printed no step times")
    in_sync = output.count("weights in sync")
    share = None if share is None or not math.isfinite(share) else share
    return {
        "world_size": world,
        "backend": backend,
        "ms_per_step": modes,
        "share_hidden": share,
        "modes_in_sync": in_sync,
    }


def parse_busbw(output: str, result: Path | None = None) -> dict[str, Any]:
    """``bridge_busbw.py``'s figures: ms and GB/s per size, aiodist and torch.distributed."""
    if result is None or not result.exists():
        raise ValueError("no result file: the ranks did not finish")
    data = json.loads(result.read_text())
    world = int(data["world_size"])
    kind = "busbw" if world > 1 else "algbw"
    rows = []
    for row in data["rows"]:
        out: dict[str, Any] = {"size": row["label"], "bytes": row["bytes"]}
        for system in ("aiodist", "torch"):
            got = row.get(system)
            out[f"{system}_ms"] = None if got is None else got["median_s"] * 1e3
            out[f"{system}_gbps"] = None if got is None else got[f"{kind}_gbps"]
        out["aiodist_over_torch"] = row.get("aiodist_over_torch")
        rows.append(out)
    if not any(r["aiodist_ms"] is not None for r in rows):
        raise ValueError(f"aiodist measured nothing: {data.get('errors')}")
    return {
        "world_size": world,
        "backend": data["backend"],
        "device": data["device"],
        "device_name": data.get("device_name"),
        "bandwidth": kind,
        "rows": rows,
        "errors": data.get("errors", {}),
    }


def parse_lag(output: str, result: Path | None = None) -> dict[str, Any]:
    """``bench_bridge --lag-only``'s figures: op time and loop lag, blocking vs awaited."""
    if result is None or not result.exists():
        raise ValueError("no result file: the ranks did not finish")
    data = json.loads(result.read_text())
    keys = ("op_median_ms", "lag_p50_ms", "lag_p99_ms", "lag_max_ms", "ticks")
    lag = data["loop_lag"]
    return {
        "size_mib": data["size_mib"],
        "world_size": data.get("world_size"),
        "backend": data.get("backend"),
        "busy_ms": data.get("busy_ms", 0.0),
        "blocking": {k: lag["naive"][k] for k in keys},
        "aiodist": {k: lag["bridged"][k] for k in keys},
        "blocking_error": data.get("naive_error"),
    }


# --- the summary ---------------------------------------------------------------------------


def clean(value: Any) -> Any:
    """``value`` with NaN and infinities as None, so the JSON is strict."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def build_summary(
    results: Sequence[PartResult],
    *,
    started: datetime.datetime,
    budget: float,
    command: Sequence[str],
    environment: dict[str, Any],
    device: dict[str, Any],
    finished: bool,
) -> dict[str, Any]:
    """The summary as plain data (see the module docstring for its shape)."""
    now = datetime.datetime.now(datetime.UTC)
    failed = [r.name for r in results if not r.ok and r.status != "pending"]
    status = "running" if not finished else "failed" if failed else "passed"
    summary: dict[str, Any] = clean(
        {
            "schema": SCHEMA,
            "status": status,
            "failed_parts": failed,
            "started": started.isoformat(timespec="seconds"),
            "updated": now.isoformat(timespec="seconds"),
            "wall_s": round((now - started).total_seconds(), 1),
            "budget_s": budget,
            "command": list(command),
            "environment": environment,
            "device": device,
            "headline": headline(results),
            "parts": [asdict(r) for r in results],
        }
    )
    return summary


def headline(results: Sequence[PartResult]) -> dict[str, Any]:
    """The few figures the issue asks for, from whichever parts produced them."""
    out: dict[str, Any] = {"tests": None, "overlap_share_hidden": {}, "busbw_gbps": {}}
    out["lag_p99_ms"] = {}
    for r in results:
        f = r.figures
        if not f:
            continue
        if "counts" in f:
            out["tests"] = ", ".join(f"{n} {k}" for k, n in sorted(f["counts"].items()))
        elif "share_hidden" in f:
            out["overlap_share_hidden"][r.name] = f["share_hidden"]
        elif f.get("rows"):
            last = f["rows"][-1]
            out["busbw_gbps"][r.name] = {
                "size": last["size"],
                "bandwidth": f["bandwidth"],
                "aiodist": last["aiodist_gbps"],
                "torch": last["torch_gbps"],
            }
        elif "blocking" in f:
            out["lag_p99_ms"][r.name] = {
                "blocking": f["blocking"]["lag_p99_ms"],
                "aiodist": f["aiodist"]["lag_p99_ms"],
            }
    return out


def render_text(summary: dict[str, Any]) -> str:
    """The summary for people: a header, one line per part, then each part's figures."""
    dev, env = summary.get("device") or {}, summary.get("environment") or {}
    lines = [
        f"aiodist gpu-check: {summary['status'].upper()}  (started {summary['started']}, "
        f"{summary['wall_s']:.0f} s of a {summary['budget_s']:.0f} s budget)",
        f"device: {_device_line(dev)}",
        f"python {env.get('python')} on {env.get('cpu_count')} CPUs; commit "
        f"{env.get('git_commit') or '?'}",
    ]
    if summary["failed_parts"]:
        lines.append(f"failed: {', '.join(summary['failed_parts'])}")
    rows = [
        [p["name"], p["status"], f"{p['seconds']:.1f}", f"{p['timeout_s']:.0f}"]
        for p in summary["parts"]
    ]
    table = format_table(["part", "status", "s", "limit"], rows).splitlines()
    gists = ["result", "-" * 6, *(_gist(p) for p in summary["parts"])]
    lines += ["", *(f"{row}  {gist}".rstrip() for row, gist in zip(table, gists, strict=True))]
    for p in summary["parts"]:
        lines += _details(p)
    return "\n".join(lines) + "\n"


def _device_line(dev: dict[str, Any]) -> str:
    if not dev:
        return "(not probed)"
    name = dev.get("name") or "no CUDA device"
    parts = [
        name,
        f"sm_{dev['capability']}" if dev.get("capability") else "",
        f"{dev['memory_gib']:.0f} GiB" if dev.get("memory_gib") else "",
        f"torch {dev.get('torch')} (CUDA {dev.get('torch_cuda')}, NCCL {dev.get('nccl_version')})",
        f"driver {dev['driver']}" if dev.get("driver") else "",
    ]
    return ", ".join(p for p in parts if p)


def _gist(p: dict[str, Any]) -> str:
    f = p.get("figures") or {}
    if p["status"] in ("skipped", "pending") or not f:
        return str(p.get("note", ""))[:70]
    if "counts" in f:
        return ", ".join(f"{n} {k}" for k, n in sorted(f["counts"].items()))
    if "share_hidden" in f:
        share = f["share_hidden"]
        return "share hidden: " + ("n/a" if share is None else f"{share:.0%}")
    if f.get("rows"):
        last = f["rows"][-1]
        return (
            f"{last['size']}: {f['bandwidth']} aiodist {_sig(last['aiodist_gbps'])} GB/s, "
            f"torch {_sig(last['torch_gbps'])}"
        )
    if "blocking" in f:
        return (
            f"lag p99 {_num(f['aiodist']['lag_p99_ms'])} ms awaited, "
            f"{_num(f['blocking']['lag_p99_ms'])} ms blocking"
        )
    if "cuda_available" in f:
        return "CUDA ok" if f["cuda_available"] else "no CUDA"
    return ""


def _details(p: dict[str, Any]) -> list[str]:
    f = p.get("figures") or {}
    out = ["", f"== {p['name']}: {p['title']} [{p['status']}]"]
    if p.get("note"):
        out.append(f"note: {p['note']}")
    if p.get("leftovers"):
        out.append(f"killed {len(p['leftovers'])} stray process(es): {p['leftovers'][:3]}")
    if "cuda_available" in f:
        out.append(f"  {f.get('executable')} (Python {f.get('python')}), torch {f.get('torch')}")
        keys = ("error", "cuda_warnings", "aiodist_error", "kernel_ok", "device_count")
        out.extend(f"  {key}: {f[key]}" for key in keys if f.get(key) is not None)
        versions = f.get("packages") or {}
        out.append("  packages: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    elif "tests" in f:
        for t in f["tests"]:
            secs = f"{t['seconds']:.1f} s" if t.get("seconds") is not None else ""
            why = f"  {t['message']}" if t.get("message") and t["outcome"] != "PASSED" else ""
            out.append(f"  {t['outcome']:<7} {t['id']}  {secs}{why}")
        out += [f"  collection error: {e}" for e in f.get("collection_errors", [])]
        if f.get("pytest_summary"):
            out.append(f"  pytest: {f['pytest_summary']}")
    elif "ms_per_step" in f:
        steps = ", ".join(f"{m} {ms:.2f}" for m, ms in f["ms_per_step"].items())
        share = f["share_hidden"]
        out.append(f"  ms/step: {steps}")
        out.append(
            "  share of communication hidden behind compute: "
            + ("n/a (no communication time to hide)" if share is None else f"{share:.0%}")
        )
    elif "rows" in f:
        headers = ["size", "aiodist ms", f"aiodist {f['bandwidth']} GB/s"]
        headers += ["torch ms", f"torch {f['bandwidth']} GB/s", "aiodist/torch"]
        rows = [
            [
                r["size"],
                _num(r["aiodist_ms"], 3),
                _sig(r["aiodist_gbps"]),
                _num(r["torch_ms"], 3),
                _sig(r["torch_gbps"]),
                "-" if r["aiodist_over_torch"] is None else f"{r['aiodist_over_torch']:.2f}x",
            ]
            for r in f["rows"]
        ]
        out += ["  " + line for line in format_table(headers, rows).splitlines()]
        out += [f"  error ({k}): {v}" for k, v in f.get("errors", {}).items()]
    elif "blocking" in f:
        busy = f" after {f['busy_ms']:g} ms of queued GPU work" if f.get("busy_ms") else ""
        out.append(f"  all_reduce {f['size_mib']} MiB on {f['world_size']} rank(s){busy}:")
        headers = ["variant", "op ms", "lag p50", "lag p99", "lag max", "ticks"]
        rows = [
            [
                name,
                _num(f[key]["op_median_ms"]),
                _num(f[key]["lag_p50_ms"], 2),
                _num(f[key]["lag_p99_ms"], 2),
                _num(f[key]["lag_max_ms"], 1),
                f[key]["ticks"],
            ]
            for name, key in (("blocking call", "blocking"), ("aiodist awaited", "aiodist"))
        ]
        out += ["  " + line for line in format_table(headers, rows).splitlines()]
        if f.get("blocking_error"):
            out.append(f"  the blocking call failed in torch: {f['blocking_error']}")
    if p["status"] not in ("passed", "skipped", "pending") and p.get("output_tail"):
        tail = p["output_tail"].strip().splitlines()[-12:]
        out += ["  output (last lines):", *(f"    {line[:200]}" for line in tail)]
    return out


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _sig(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def write_summary(out_dir: Path, summary: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``gpu-check.json`` and ``gpu-check.txt`` into ``out_dir`` (each replaced whole)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "gpu-check.json", out_dir / "gpu-check.txt"
    texts = json.dumps(summary, indent=2, allow_nan=False) + "\n", render_text(summary)
    for path, text in zip(paths, texts, strict=True):
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    return paths
