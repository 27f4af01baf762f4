"""One rank of an elastic job that grew, on a daemon killed and started again.

Usage: ``python tests/helpers/grown_restart_worker.py URL ROLE`` (ROLE: ``member``
or ``newcomer``). The job forms with two members (at most three); the
newcomer joins it once it formed, and every rank regroups over the view with
the newcomer. Each rank prints one JSON line per step and waits for a line on
its stdin between the steps the test puts a restart of the daemon between:

1. ``joined``: in the grown group; a key of its own set in the store, an
   all-reduce over the three ranks done.
2. (a line) ``after``: an all-reduce again, every rank's key read back from
   the store, a key set and waited for by every rank, a barrier passed.
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


async def readline() -> str:
    return await anyio.to_thread.run_sync(sys.stdin.readline)


async def main() -> None:
    url, role = sys.argv[1], sys.argv[2]
    hb = float(os.environ.get("HB_TIMEOUT", "1.5"))
    await aiodist.init_process_group(
        init_method=url,
        world_size=2,
        max_world_size=3,
        group_name="grown",
        timeout=60,
        heartbeat_interval=0.2,
        heartbeat_timeout=hb,
    )
    first = await aiodist.membership()
    report(formed=True, epoch=first.epoch)
    # Everyone regroups over the view with the newcomer in it (its own first view).
    view = first if role == "newcomer" else await aiodist.membership(1, timeout=60)
    await aiodist.regroup(view)
    group = aiodist.get_default_group()
    assert group is not None
    job_rank = group.ranks[aiodist.get_rank()]
    store = aiodist.get_store()
    await store.set(f"before/{job_rank}", f"value-of-{job_rank}".encode())
    t = torch.full((2,), float(job_rank + 1))
    await aiodist.all_reduce(t)
    report(joined=True, job_rank=job_rank, reduced=t.tolist())
    await readline()  # the daemon was killed and started again meanwhile
    try:
        t = torch.full((2,), float(job_rank + 1))
        await aiodist.all_reduce(t)
        kept = {r: (await store.get(f"before/{r}")).decode() for r in view.ranks}
        await store.set(f"after/{job_rank}", b"1")
        await store.wait([f"after/{r}" for r in view.ranks])
        await aiodist.barrier()
    except aiodist.DistError as exc:
        report(error={"type": type(exc).__name__, "message": str(exc)})
        return
    report(after=True, reduced=t.tolist(), kept=kept)
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main)
