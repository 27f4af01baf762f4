"""A rank of the new-user failure tests (``test_new_user.py``): one mode per argv[1].

Every rank prints ``{"pid": ..., "rank": ...}`` first (the test kills it by pid
should it outlive the test), then runs its mode:

- ``hang``: rank 0 awaits an ``all_reduce`` that rank 1 never joins; rank 1 sleeps.
  The test sends SIGINT to rank 0 alone.
- ``crash``: rank 1 raises an uncaught ``ValueError``; rank 0 awaits an ``all_reduce``.
- ``exit1``: rank 1 calls ``sys.exit(1)``; rank 0 awaits an ``all_reduce``.
- ``sync_crash``: as ``crash``, on ``aiodist.sync``.
- ``join``: only joins (``timeout`` from ``$NEWUSER_TIMEOUT``); reports the error and
  how long it took.

argv: MODE [INIT_METHOD RANK WORLD]; without an init method, env:// (``aiodist run``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import torch

import aiodist

MODE = sys.argv[1]
KWARGS: dict[str, Any] = {}
if len(sys.argv) > 2:
    KWARGS = {"init_method": sys.argv[2], "rank": int(sys.argv[3]), "world_size": int(sys.argv[4])}
RANK = int(os.environ.get("RANK", KWARGS.get("rank", -1)))


def report(**fields: object) -> None:
    print(json.dumps({"pid": os.getpid(), "rank": RANK, **fields}), flush=True)


async def join() -> None:
    t0 = time.monotonic()
    try:
        await aiodist.init_process_group(**KWARGS, timeout=float(os.environ["NEWUSER_TIMEOUT"]))
    except Exception as exc:
        report(error=type(exc).__name__, message=str(exc), after=time.monotonic() - t0)
        return
    report(joined=True)
    await aiodist.destroy_process_group()


async def main() -> None:
    await aiodist.init_process_group(**KWARGS)
    rank = aiodist.get_rank()
    await aiodist.barrier()
    report(ready=True)
    if rank == 1:
        if MODE == "crash":
            raise ValueError("boom in rank 1")
        if MODE == "exit1":
            sys.exit(1)
        await asyncio.sleep(300)
        return
    t0 = time.monotonic()
    try:
        await aiodist.all_reduce(torch.ones(2))
    except BaseException as exc:
        report(error=type(exc).__name__, message=str(exc), after=time.monotonic() - t0)
        raise


def sync_main() -> None:
    from aiodist import sync as dist

    dist.init_process_group(**KWARGS)
    rank = dist.get_rank()
    dist.barrier()
    report(ready=True)
    if rank == 1:
        raise ValueError("boom in rank 1")
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
    except BaseException as exc:
        report(error=type(exc).__name__, message=str(exc), after=time.monotonic() - t0)
        raise


if __name__ == "__main__":
    if MODE.startswith("sync_"):
        sync_main()
    elif MODE == "join":
        asyncio.run(join())
    else:
        asyncio.run(main())
