"""One rank of the flight recorder's cost benchmark (``bench_recorder``).

Usage: ``aiodist run -n 2 benchmarks/_recorder_ranks.py OUT PAIRS ITERS``.

Both ranks time the same blocks in lockstep (a barrier before each): per case
(a 4-byte all_reduce, an 8-byte point-to-point round trip), ``PAIRS``
alternating pairs of blocks with the recorder on and off, in the order
on, off, off, on, each ``ITERS`` calls long. Off is a session without a
recorder (what ``AIODIST_RECORDER_SIZE=0`` gives), swapped in and out between
blocks. Rank 0 writes the seconds per call of every block to ``OUT`` (JSON).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import aiodist
from aiodist._group.world import get_default_group

ORDER = ("on", "off", "off", "on")


async def _all_reduce(rank: int, t: torch.Tensor, _: torch.Tensor) -> None:
    await aiodist.all_reduce(t)


async def _round_trip(rank: int, data: torch.Tensor, reply: torch.Tensor) -> None:
    if rank == 0:
        w = aiodist.irecv(reply, 1)
        await aiodist.isend(data, 1)
        await w
    elif rank == 1:
        await aiodist.irecv(reply, 0)
        await aiodist.isend(data, 0)


CASES = {"all_reduce 4 B": (_all_reduce, 1), "p2p_round_trip 8 B": (_round_trip, 2)}


async def main(out: Path, pairs: int, iters: int) -> None:
    await aiodist.init_process_group()
    rank = aiodist.get_rank()
    group = get_default_group()
    assert group is not None
    session = group.session
    recorder = session.recorder
    assert recorder is not None, "run it without AIODIST_RECORDER_SIZE=0"
    results: dict[str, Any] = {}
    for case, (op, numel) in CASES.items():
        a, b = torch.ones(numel), torch.empty(numel)
        for _ in range(min(500, iters)):  # warm: connections up, the ring wrapped
            await op(rank, a, b)
        blocks: list[list[Any]] = []
        for _ in range(pairs):
            for mode in ORDER:
                session.recorder = recorder if mode == "on" else None
                await aiodist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    await op(rank, a, b)
                blocks.append([mode, (time.perf_counter() - start) / iters])
        session.recorder = recorder
        results[case] = blocks
    await aiodist.destroy_process_group()
    if rank == 0:  # after the loop's work: nothing else runs on it now
        text = json.dumps({"iters": iters, "pairs": pairs, "blocks": results})
        await asyncio.to_thread(out.write_text, text)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
