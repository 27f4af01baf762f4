"""One rank of a job whose last rank dies while its daemon is away (test_daemon_away).

Usage: ``python tests/helpers/away_worker.py URL JOB RANK WORLD_SIZE``. It prints one
JSON line per step. Every rank passes a barrier and an all-reduce; then the
last rank waits to be killed, and the others start an all-reduce it never
joins. The test kills the daemon, then the last rank. A survivor whose
all-reduce fails with ``RankFailedError`` shrinks the default group without
the rank named and all-reduces again in the new group, then passes a barrier
and leaves; with another error it reports it and leaves.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import anyio
import torch

import aiodist


def report(**fields: Any) -> None:
    print(json.dumps({"t": time.monotonic(), "pid": os.getpid(), **fields}), flush=True)


def describe(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "rank": getattr(exc, "rank", None), "message": str(exc)}


async def main() -> None:
    url, job, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    await aiodist.init_process_group(
        init_method=url,
        world_size=world,
        rank=rank,
        group_name=job,
        backend="aiodist",  # shrink_group cannot shrink torch's default group
        timeout=60,
        heartbeat_interval=0.2,
        heartbeat_timeout=float(os.environ["HB_TIMEOUT"]),
    )
    await aiodist.barrier()
    await aiodist.all_reduce(torch.ones(2))  # the data channels and the member table are up
    report(ready=True)
    if rank == world - 1:
        await anyio.to_thread.run_sync(sys.stdin.readline)  # killed meanwhile
        return
    work = aiodist.all_reduce(torch.ones(4))
    report(in_collective=True)
    try:
        await work
    except aiodist.RankFailedError as exc:
        report(error=describe(exc))
        failed = exc.rank
    except aiodist.DistError as exc:
        report(error=describe(exc))
        return
    else:
        report(error=None)
        return
    try:
        await aiodist.shrink_group([failed])
        t = torch.full((4,), float(rank + 1))
        await aiodist.all_reduce(t)
        report(reduced=t.tolist(), world=aiodist.get_world_size())
        await aiodist.barrier()
    except aiodist.DistError as exc:
        report(after_error=describe(exc))
        return
    report(finished=True)
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main)
