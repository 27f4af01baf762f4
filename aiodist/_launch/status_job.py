"""``aiodist status --job J``: one job's ranks, what each is doing, and who the others wait for.

Reads the server's status snapshot (``_server/jobs.py`` fills each member's
``op`` and ``last`` from its heartbeats, ``_server/where.py`` the job's
``waits``); this module only picks the job and writes it out.
"""

from __future__ import annotations

from typing import Any

from aiodist._server.where import describe_wait

__all__ = ["find_job", "format_job", "rank_state"]


def find_job(snap: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The job called ``name`` in a status snapshot (the latest generation), or None."""
    found = [job for job in snap.get("jobs", []) if job.get("name") == name]
    return max(found, key=lambda job: job.get("generation", 0)) if found else None


def rank_state(member: dict[str, Any]) -> str:
    """What one rank is doing, in words: ``in all_reduce #12 on group 'g' for 3.2 s``."""
    if member["status"] != "active":
        return str(member["status"])
    op, last = member.get("op"), member.get("last")
    if op is not None:
        seq = f" #{op['seq']}" if op["seq"] else ""
        return f"in {op['name']}{seq} on group {op['group']!r} for {op['for']:.1f} s"
    if last is not None:
        return f"idle (last: {last['name']} #{last['seq']}, done {last['ago']:.1f} s ago)"
    return "idle"


def format_job(job: dict[str, Any]) -> str:
    """The text report of one job: a line per rank, then a line per collective in progress."""
    lines = [
        f"job {job['name']!r}: {job['state']}, {job['joined']}/{job['world_size']} joined",
    ]
    hosts = [m["host"] for m in job["members"]]
    width = max([len("HOST"), *(len(h) for h in hosts)])
    lines.append(f"  {'RANK':>4}  {'HOST':<{width}}  {'PID':>8}  {'HEARTBEAT':>9}  OPERATION")
    for m in job["members"]:
        rank = "?" if m["rank"] < 0 else m["rank"]
        lines.append(
            f"  {rank:>4}  {m['host']:<{width}}  {m['pid']:>8}  "
            f"{m['heartbeat_age']:>7.1f} s  {rank_state(m)}"
        )
    lines.extend(
        f"  FAILED rank {f['rank']} ({f['host']}, pid {f['pid']}): {f['reason']}"
        for f in job["failures"]
    )
    waits = job.get("waits") or []
    if waits:
        lines.append("")
        lines.extend(describe_wait(call) for call in waits)
    return "\n".join(lines)
