"""One rank of a job on a daemon that is killed and started again (test_daemon_restart).

Usage: ``python tests/helpers/restart_worker.py URL JOB RANK WORLD_SIZE``. It prints one
JSON line per step. Rank 0 sets a key, every rank passes a barrier and an
all-reduce, then rank 0 starts an all-reduce that rank 1 joins only when the
test writes a line on its stdin (after the daemon was killed and restarted):
the collective spans the restart. Then the store and a barrier are used again
through the server that came back. Last, rank 0 enters a barrier; rank 1 joins
it when told (a line on stdin) or is killed by the test meanwhile.
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


async def readline() -> str:
    return await anyio.to_thread.run_sync(sys.stdin.readline)


async def main() -> None:
    url, job, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    hb = float(os.environ.get("HB_TIMEOUT", "1.5"))
    await aiodist.init_process_group(
        init_method=url,
        world_size=world,
        rank=rank,
        group_name=job,
        timeout=60,
        heartbeat_interval=0.2,
        heartbeat_timeout=hb,
    )
    store = aiodist.get_store()
    if rank == 0:
        await store.set("kept", f"value-of-{job}".encode())
    await aiodist.barrier()
    warm = torch.ones(2)
    await aiodist.all_reduce(warm)  # the data channels and the member table are up
    report(ready=True)
    t = torch.full((4,), float(rank + 1))
    try:
        if rank == 0:
            work = aiodist.all_reduce(t)
            report(in_collective=True)
            await work
        else:
            await readline()  # the test says when: the daemon was killed and came back
            await aiodist.all_reduce(t)
    except aiodist.DistError as exc:
        report(error=describe(exc))
        if os.environ.get("LINGER") == "1":
            await readline()  # stays a member (its server connection too) until told
        return
    report(reduced=t.tolist())
    kept = await store.check(["kept"])
    value = (await store.get("kept")).decode() if kept else None
    await store.set(f"after/{rank}", b"1")
    await store.wait([f"after/{r}" for r in range(world)])
    await aiodist.barrier()
    report(kept=value, after=True)
    if rank != 0:
        await readline()  # the test kills this rank meanwhile, or lets it finish
    try:
        await aiodist.barrier()
    except aiodist.DistError as exc:
        report(error=describe(exc))
        return
    report(finished=True)
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main)
