"""``aiodist status --job J``: one job's ranks, what each is doing, and who the others wait for.

Reads the server's status snapshot (``_server/jobs.py`` fills each member's
``op`` and ``last`` from its heartbeats, ``_server/where.py`` the job's
``waits``); this module only picks the job and writes it out.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from aiodist._group.dumps import dump_path
from aiodist._group.recorder import FORMAT
from aiodist._server.where import describe_wait
from aiodist._wire.messages import DumpRequest

if TYPE_CHECKING:
    from aiodist._control.connection import ControlConnection

__all__ = ["collect_dumps", "find_job", "format_job", "rank_state"]

# How often the command looks for the ranks' files while they write them.
_POLL = 0.05


async def collect_dumps(
    conn: ControlConnection, job: str, directory: str, timeout: float
) -> tuple[Path, list[int]]:
    """Have every rank of ``job`` write its recorder into ``directory``; collect them in one file.

    Returns the collected file (``aiodist-dump-<job>.json``: ``{"format", "job",
    "ranks": [one dump per rank]}``) and the ranks whose file did not appear within
    ``timeout``. The ranks write on their own hosts: ``directory`` must be one that
    they see (this host, or a shared filesystem).

    Raises:
        ValueError: ``directory`` is not an existing directory.
        DistError: The server refused (no such job).
    """
    where = Path(await anyio.Path(directory).resolve())
    if not await anyio.Path(where).is_dir():
        raise ValueError(f"--dump {directory}: no such directory")
    asked = time.time() - 1.0  # a file older than this is from an earlier dump
    told: list[int] = await conn.request(
        lambda r: DumpRequest(r, job, os.fspath(where)), timeout=timeout
    )
    paths = {rank: anyio.Path(dump_path(where, job, rank)) for rank in told}
    dumps: dict[int, Any] = {}
    with anyio.move_on_after(timeout):
        while len(dumps) < len(paths):
            for rank, path in paths.items():
                if rank not in dumps and await path.exists():
                    if (await path.stat()).st_mtime >= asked:
                        dumps[rank] = json.loads(await path.read_text())
            if len(dumps) < len(paths):
                await anyio.sleep(_POLL)  # files appear: nothing to await but the filesystem
    out = dump_path(where, job)
    merged = {"format": FORMAT, "job": job, "ranks": [dumps[r] for r in sorted(dumps)]}
    await anyio.Path(out).write_text(json.dumps(merged, indent=1))
    return out, sorted(set(paths) - set(dumps))


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
    if job.get("ranks_hidden"):
        lines.append(f"  ... and {job['ranks_hidden']} more ranks")
    lines.extend(
        f"  FAILED rank {f['rank']} ({f['host']}, pid {f['pid']}): {f['reason']}"
        for f in job["failures"]
    )
    waits = job.get("waits") or []
    if waits:
        lines.append("")
        lines.extend(describe_wait(call) for call in waits)
    return "\n".join(lines)
