"""One rank of a job whose ranks call two collectives in swapped order.

Usage: ``aiodist run -n N tests/helpers/swapped_worker.py CASE``. Rank 0 calls the
case's first operation, then its second; every other rank calls them the other
way round, so the group's first call is a different collective on rank 0 than
on its neighbours. Each rank awaits its first call and prints one JSON line:
what it raised (the type, ``field`` of a ``CollectiveMismatchError``) and after
how many seconds. The group's timeout is 60 s: a rank that only learns of the
mismatch from its timeout reports ``DistTimeoutError`` after a minute.

Cases: ``tensor-16`` (16-byte tensors), ``tensor-256k`` (256 KiB: the socket
ring), ``tensor-4m`` (4 MiB: shared memory where ranks share a host),
``objects`` (all_gather_object and broadcast_object_list), ``mixed`` (a 4 MiB
all_reduce and an all_gather_object), ``rooted`` (a 256 KiB reduce to rank 0
and a scatter from the last rank).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import torch

import aiodist

_FLOATS = {"tensor-16": 4, "tensor-256k": 65536, "tensor-4m": 1 << 20, "mixed": 1 << 20}


def _calls(case: str, rank: int, world: int) -> tuple[Any, Any]:
    """The case's two operations, not started yet."""
    n = _FLOATS.get(case, 65536)
    a, b = torch.ones(n), torch.full((n,), float(rank))
    if case == "objects":
        return (
            lambda: aiodist.all_gather_object({"rank": rank}),
            lambda: aiodist.broadcast_object_list([rank, "x"], src=0),
        )
    if case == "mixed":
        return (lambda: aiodist.all_reduce(a), lambda: aiodist.all_gather_object(rank))
    if case == "rooted":
        parts = [torch.zeros(n) for _ in range(world)] if rank == world - 1 else None
        return (
            lambda: aiodist.reduce(a, dst=0),
            lambda: aiodist.scatter(b, parts, src=world - 1),
        )
    return (lambda: aiodist.all_reduce(a), lambda: aiodist.broadcast(b, src=0))


async def main() -> None:
    case = sys.argv[1]
    await aiodist.init_process_group(timeout=60)
    rank, world = aiodist.get_rank(), aiodist.get_world_size()
    await aiodist.barrier()
    first, second = _calls(case, rank, world)
    if rank != 0:
        first, second = second, first
    start = time.monotonic()
    report: dict[str, Any] = {"rank": rank, "case": case}
    try:
        await first()
        report["raised"] = None
    except aiodist.DistError as exc:
        report["raised"] = type(exc).__name__
        report["field"] = getattr(exc, "field", None)
        report["message"] = str(exc)[:300]
    report["seconds"] = round(time.monotonic() - start, 3)
    print(json.dumps(report), flush=True)
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
