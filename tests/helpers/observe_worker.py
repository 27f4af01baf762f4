"""One rank of a job that hangs on purpose (test_status_job, test_recorder).

Usage: ``python tests/helpers/observe_worker.py URL RANK WORLD_SIZE JOB MODE``.

Every rank runs a barrier. Then, with MODE ``sleep``, ranks other than the
last start an all_reduce while the last rank waits for a line on stdin before
joining it; with MODE ``timeout`` the last rank never joins (it waits for
stdin EOF) and the others' all_reduce times out. Each rank prints
``{"pid": ...}`` first and a JSON report last.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import torch

import aiodist


async def main() -> None:
    url, rank, world_size, job, mode = sys.argv[1:6]
    r, n = int(rank), int(world_size)
    print(json.dumps({"pid": os.getpid(), "rank": r}), flush=True)
    timeout = 4.0 if mode == "timeout" else 60.0
    await aiodist.init_process_group(
        init_method=url, rank=r, world_size=n, group_name=job, timeout=timeout
    )
    await aiodist.barrier()
    print(json.dumps({"rank": r, "entered": True}), flush=True)
    report: dict[str, object] = {"rank": r}
    loop = asyncio.get_running_loop()
    if r == n - 1:
        await loop.run_in_executor(None, sys.stdin.readline)  # the sleeping rank
        if mode == "timeout":
            report["slept"] = True
            print(json.dumps(report), flush=True)
            os._exit(0)
    try:
        out = await aiodist.all_reduce(torch.ones(4))
        report["sum"] = out.tolist()
    except aiodist.DistError as exc:
        report["error"] = [type(exc).__name__, str(exc)]
    print(json.dumps(report), flush=True)
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
