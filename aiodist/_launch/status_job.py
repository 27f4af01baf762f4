"""``aiodist status --job J``: one job's ranks, what each is doing, and who the others wait for.

Reads the server's status snapshot (``_server/jobs.py`` fills each member's
``op`` and ``last`` from its heartbeats, ``_server/where.py`` the job's
``waits``); this module only picks the job and writes it out.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from aiodist._control.status import describe_wait
from aiodist._errors import ProtocolError
from aiodist._group.dumps import dump_dir, dump_path, make_dump_dir, write_atomic
from aiodist._group.recorder import FORMAT
from aiodist._wire.messages import DumpRequest

if TYPE_CHECKING:
    from aiodist._control.connection import ControlConnection

# How often the command looks for the ranks' files while they write them.
_POLL = 0.05


async def collect_dumps(
    conn: ControlConnection, job: str, directory: str | None, timeout: float
) -> tuple[Path, list[int]]:
    """Have every rank of ``job`` write its recorder; collect the files in one.

    Each rank writes into its own dump directory (``AIODIST_DUMP_DIR``, else a
    private one of its user's, ``dumps.dump_dir``); ``directory`` is where this
    host sees it (a shared filesystem, or this host), by default this process's
    own dump directory: the ranks' on this host, for the same user and
    ``AIODIST_DUMP_DIR``. A rank's file counts once it answers this request (its
    ``request`` field). Returns the collected file (``aiodist-dump-<job>.json`` in
    ``directory``: ``{"format", "job", "ranks": [one dump per rank]}``, written
    without following a link at its name) and the ranks whose file did not
    appear within ``timeout``.

    Raises:
        ValueError: ``directory`` is not a directory and cannot be made one (it is
            made, mode 0700, if it is not there yet).
        DistError: The server refused (no such job).
    """
    where = Path(directory) if directory else dump_dir()
    what = f"--dump {directory}" if directory else "this user's dump directory"
    if where is None:
        raise ValueError(f"{what}: no such directory")
    try:  # made (0700) if not there yet, as the ranks make theirs
        await anyio.to_thread.run_sync(make_dump_dir, where)
    except OSError as exc:
        raise ValueError(f"{what}: {exc}") from None
    reply = await conn.request(lambda r: DumpRequest(r, job), timeout=timeout)
    try:
        ranks, request = reply["ranks"], reply["request"]
        if not all(type(r) is int for r in ranks) or type(request) is not int:
            raise TypeError
    except (TypeError, KeyError):
        raise ProtocolError(f"the server answered a dump request with {reply!r:.200}") from None
    dumps: dict[int, Any] = {}
    with anyio.move_on_after(timeout):
        while len(dumps) < len(ranks):
            for rank in ranks:
                if rank not in dumps:
                    found = await anyio.to_thread.run_sync(read_dump, where, job, rank)
                    if found is not None and found.get("request") == request:
                        dumps[rank] = found
            if len(dumps) < len(ranks):
                await anyio.sleep(_POLL)  # files appear: nothing to await but the filesystem
    out = dump_path(where, job)
    merged = {"format": FORMAT, "job": job, "ranks": [dumps[r] for r in sorted(dumps)]}
    await anyio.to_thread.run_sync(write_atomic, out, json.dumps(merged, indent=1))
    return out, sorted(set(ranks) - set(dumps))


def read_dump(directory: Path, job: str, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s dump of ``job`` in ``directory``; None if there is none (yet).

    Only a regular file counts: a link or a FIFO at its name is not opened.
    """
    path = dump_path(directory, job, rank)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # not there yet, or a link
        return None
    with contextlib.closing(os.fdopen(fd, "rb")) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            found = json.loads(f.read())
        except ValueError:
            return None
    ok = isinstance(found, dict) and found.get("job") == job and found.get("rank") == rank
    return found if ok else None


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
        rank = "?" if m["rank"] is None else m["rank"]
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
