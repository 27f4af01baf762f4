"""One rank of a job that keeps running collectives (test_status_job's dump tests).

Usage: ``python tests/helpers/busy_worker.py URL RANK WORLD_SIZE JOB``.

The rank fills its flight recorder (more operations than its ring holds, so a
dump is as large as it gets), prints ``{"ready": RANK}``, then runs all_reduces
until a line has arrived on any rank's stdin, checking each result. Each
all_reduce carries a stop flag, so that every rank leaves the loop after the same
one (a rank that stopped alone would call barrier while another calls all_reduce:
a mismatch). Its last line is a JSON report: how many it ran, how many were
wrong, and the error that stopped it.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

import aiodist
from aiodist._group.recorder import DEFAULT_CAPACITY


async def main() -> None:
    url, rank, world_size, job = sys.argv[1:5]
    r, n = int(rank), int(world_size)
    await aiodist.init_process_group(init_method=url, rank=r, world_size=n, group_name=job)
    for _ in range(DEFAULT_CAPACITY + 64):
        await aiodist.all_reduce(torch.ones(1))
    print(json.dumps({"ready": r}), flush=True)
    stop = asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    count, wrong, error = 0, 0, None
    try:
        while True:
            out = await aiodist.all_reduce(torch.tensor([1.0] * 4 + [float(stop.done())]))
            count += 1
            wrong += out[:4].tolist() != [float(n)] * 4
            if out[4] > 0:
                break
            await asyncio.sleep(0.01)
        await aiodist.barrier()
    except aiodist.DistError as exc:
        error = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"rank": r, "count": count, "wrong": wrong, "error": error}), flush=True)
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
