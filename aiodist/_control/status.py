"""A server's status snapshot in words: where each rank of a job is, and who a call waits on.

The rendezvous server reports, for each collective some rank of a job is in,
the ranks inside it and those that have not entered it (``_server/where.py``);
a rank whose operation stalls (``_group/stalls.py``) and ``aiodist status
--job`` (``_launch/status_job.py``) say it with these.
"""

from __future__ import annotations

from typing import Any


def describe_wait(call: dict[str, Any]) -> str:
    """One collective's line: ``all_reduce #1042 on group 'g': ranks 0, 1 waiting 12.3 s; ...``."""
    waiting = call["waiting"]
    ranks = ", ".join(str(w["rank"]) for w in waiting)
    longest = max((w["for"] for w in waiting), default=0.0)
    plural = "ranks" if len(waiting) > 1 else "rank"
    text = f"{call['name']} #{call['seq']} on group {call['group']!r}: {plural} {ranks} "
    text += f"waiting {longest:.1f} s"
    if (more := call.get("waiting_count", len(waiting)) - len(waiting)) > 0:
        text += f" (and {more} more ranks)"
    for n in call["not_entered"]:
        text += f"; rank {n['rank']} not entered"
        op, last = n.get("op"), n.get("last")
        if op is not None:
            text += (
                f" (in {op['name']} #{op['seq']} on group {op['group']!r} for {op['for']:.1f} s)"
            )
        elif last is not None:
            text += f" (last: {last['name']} #{last['seq']}, done {last['ago']:.1f} s ago)"
        else:
            text += " (no operation reported)"
    if (more := call.get("not_entered_count", 0) - len(call["not_entered"])) > 0:
        text += f"; {more} more ranks not entered"
    return text


def positions_line(job: dict[str, Any]) -> str:
    """Where each rank of a job's status snapshot is, in one line (no collective known)."""
    parts = []
    for m in job.get("members", []):
        op, last = m.get("op"), m.get("last")
        if op is not None:
            parts.append(f"rank {m['rank']} in {op['name']} #{op['seq']} for {op['for']:.1f} s")
        elif last is not None:
            parts.append(
                f"rank {m['rank']} idle (last: {last['name']} #{last['seq']}, "
                f"done {last['ago']:.1f} s ago)"
            )
        else:
            parts.append(f"rank {m['rank']} {m.get('status', '?')}")
    return "; ".join(parts)
