"""A rank's timeline as Chrome trace-event JSON (Perfetto, chrome://tracing).

With ``AIODIST_TRACE=DIR`` (or ``aiodist.trace(DIR)``) a rank's recorder keeps
every operation, not only the last ones, and the rank writes
``DIR/aiodist-trace-<job>-rank<R>.json`` when its session closes. The file
is a trace-event JSON object: one process per rank (``pid`` is the rank),
each operation a complete event (``ph: "X"``) named ``<op> #<seq>`` with its
sequence number, group, bytes, dtype, shape, peer and state in ``args``, and
each time the program waited on an operation's handle a slice of its own on
the ``waits`` threads. Operations that overlap go on separate threads
(lanes) of the ``operations`` kind, so slices never cross.
``aiodist trace merge`` concatenates the ranks' files into one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from aiodist._group.dumps import dump_path, write_atomic

if TYPE_CHECKING:
    from aiodist._group.recorder import Entry, Recorder

#: Thread ids from here on hold the waits (below: the operations' lanes).
WAIT_LANES: Final = 1000


def _lanes(spans: list[tuple[int, int]]) -> list[int]:
    """A lane per span (in start order) such that spans in one lane never overlap."""
    ends: list[int] = []
    out = []
    for start, end in spans:
        for lane, busy_until in enumerate(ends):
            if busy_until <= start:
                ends[lane] = end
                out.append(lane)
                break
        else:
            ends.append(end)
            out.append(len(ends) - 1)
    return out


def trace_events(recorder: Recorder) -> dict[str, Any]:
    """The recorder's operations (all kept) as a trace-event JSON object."""
    now = time.perf_counter_ns()
    entries: list[Entry] = sorted(recorder.entries(), key=lambda e: e.started)
    pid = recorder.rank

    def us(perf_ns: int) -> float:
        return recorder.wall(perf_ns) * 1e6

    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"rank {pid}"}},
        {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}},
    ]
    spans = [(e.started, e.ended or now) for e in entries]
    lanes = _lanes(spans)
    waits = [(e.wait_start, e.wait_end or now) for e in entries if e.wait_start]
    wait_lanes = iter(_lanes(waits))
    seen: set[int] = set()
    for e, lane, (start, end) in zip(entries, lanes, spans, strict=True):
        title = f"{e.name} #{e.seq}" if e.seq else e.name
        if lane not in seen:
            seen.add(lane)
            events.append(_thread(pid, lane, f"operations {lane}"))
        args = {
            "seq": e.seq,
            "group": e.group,
            "bytes": e.nbytes,
            "dtype": str(e.dtype).removeprefix("torch.") if e.dtype is not None else None,
            "shape": list(e.shape) if e.shape is not None else None,
            "peer": e.peer,
            "state": e.state,
        }
        if e.error is not None:
            args["error"] = f"{type(e.error).__name__}: {e.error}"
        events.append(
            {
                "ph": "X",
                "pid": pid,
                "tid": lane,
                "name": title,
                "cat": "collective" if e.seq else "p2p",
                "ts": us(start),
                "dur": max(0.0, (end - start) / 1e3),
                "args": args,
            }
        )
        if e.wait_start:
            wlane = WAIT_LANES + next(wait_lanes)
            if wlane not in seen:
                seen.add(wlane)
                events.append(_thread(pid, wlane, f"waits {wlane - WAIT_LANES}"))
            events.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": wlane,
                    "name": f"wait {title}",
                    "cat": "wait",
                    "ts": us(e.wait_start),
                    "dur": max(0.0, ((e.wait_end or now) - e.wait_start) / 1e3),
                    "args": {"seq": e.seq, "group": e.group},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"job": recorder.job, "rank": pid, "pid": recorder.pid},
    }


def _thread(pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def write_trace(recorder: Recorder, directory: str | Path) -> Path:
    """Write the recorder's trace into ``directory`` (made if missing); return the file."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = dump_path(directory, recorder.job, recorder.rank, kind="trace")
    write_atomic(path, json.dumps(trace_events(recorder)))
    return path
