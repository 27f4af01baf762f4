"""Timelines: ``aiodist.trace(DIR)`` and ``aiodist trace merge DIR -o job.json``.

Each rank writes its own trace-event file (``_group/tracefile.py``); merging
puts the ranks' files of a directory into one trace that Perfetto and
chrome://tracing open, a process per rank.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiodist._group.recorder import TRACE_DIR
from aiodist._group.tracefile import write_trace
from aiodist._group.world import get_default_group

if TYPE_CHECKING:
    from collections.abc import Iterator


@contextlib.contextmanager
def trace(directory: str | Path) -> Iterator[Path]:
    """Trace this process's operations inside the block into ``directory``.

    The default group's rank (if initialised) keeps every operation from here
    on and writes ``aiodist-trace-<job>-rank<R>.json`` when the block ends;
    a job initialised inside the block writes its trace when it is destroyed.
    ``AIODIST_TRACE=DIR`` traces a whole run the same way.

    Example:
        >>> with aiodist.trace("traces"):
        ...     await aiodist.all_reduce(t)
    """
    where = str(directory)
    TRACE_DIR.append(where)
    group = get_default_group()
    rec = group.session.recorder if group is not None else None
    started = rec is not None and rec.trace is None
    if rec is not None and started:
        rec.start_trace(where)
    try:
        yield Path(where)
    finally:
        TRACE_DIR.remove(where)
        if rec is not None and started:
            write_trace(rec, where)
            rec.stop_trace()


def merge_traces(directory: str | Path, out: str | Path) -> tuple[Path, int]:
    """Merge the ranks' trace files in ``directory`` into ``out``; return it and the rank count.

    Raises:
        ValueError: No trace file there, or one that is no trace-event JSON object.
    """
    files = sorted(Path(directory).glob("aiodist-trace-*.json"))
    if not files:
        raise ValueError(f"no aiodist-trace-*.json files in {directory}")
    events: list[Any] = []
    ranks: list[Any] = []
    for path in files:
        try:
            data = json.loads(path.read_text())
            part = data["traceEvents"]
            if not isinstance(part, list):
                raise TypeError
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a trace-event JSON object ({exc})") from None
        events.extend(part)
        ranks.append(data.get("otherData", {}))
    # Metadata first, then the slices in time order: every viewer reads that.
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    merged = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ranks": ranks}}
    target = Path(out)
    target.write_text(json.dumps(merged))
    return target, len(files)
