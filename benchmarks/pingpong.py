"""An 8-byte round trip between ranks 0 and 1, to time and profile the small-message path.

Run it under the launcher users run::

    aiodist run -n 2 benchmarks/pingpong.py [--iters 5000] [--repeats 3] [--profile]

Rank 0 posts its receive, sends and awaits the reply; rank 1 receives and
answers (the ``p2p_round_trip`` case of ``bench_collectives``, without gloo
beside it). Every rank prints its time per round trip for each repeat;
``--profile`` prints rank 0's ``cProfile`` top entries (by own time) for the
last repeat. More ranks may run: the others wait in the barriers between repeats.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import TYPE_CHECKING

import anyio
import torch
import uvloop

import aiodist

if TYPE_CHECKING:
    from collections.abc import Sequence


async def _round_trip(rank: int, data: torch.Tensor, reply: torch.Tensor) -> None:
    if rank == 0:
        w = aiodist.irecv(reply, 1)
        await aiodist.isend(data, 1)
        await w
    elif rank == 1:
        await aiodist.irecv(reply, 0)
        await aiodist.isend(data, 0)


async def run(iters: int, repeats: int, profile: bool, top: int) -> list[float]:
    """Time ``repeats`` batches of ``iters`` round trips; return µs per round trip."""
    await aiodist.init_process_group()
    rank = aiodist.get_rank()
    if aiodist.get_world_size() < 2:
        raise SystemExit("pingpong needs 2 ranks or more: aiodist run -n 2 benchmarks/pingpong.py")
    data, reply = torch.zeros(2), torch.empty(2)
    for _ in range(min(300, iters)):  # warm: connections up, code paths hot
        await _round_trip(rank, data, reply)
    profiler = cProfile.Profile() if profile and rank == 0 else None
    times = []
    for repeat in range(repeats):
        await aiodist.barrier()
        watched = profiler if repeat == repeats - 1 else None
        if watched is not None:
            watched.enable()
        start = time.perf_counter()
        if rank < 2:
            for _ in range(iters):
                await _round_trip(rank, data, reply)
        times.append((time.perf_counter() - start) / iters * 1e6)
        if watched is not None:
            watched.disable()
    if rank < 2:
        shown = " ".join(f"{t:.1f}" for t in times)
        print(f"rank {rank}: 8-byte round trip, µs per call: {shown}", flush=True)
    if profiler is not None:
        stats = pstats.Stats(profiler)
        print(f"rank 0 profile: {stats.total_calls} calls for {iters} round trips", flush=True)  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(top)
    await aiodist.destroy_process_group()
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=5000, help="round trips per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0's last repeat")
    parser.add_argument("--top", type=int, default=25, help="profile entries shown")
    args = parser.parse_args(argv)
    anyio.run(
        run,
        args.iters,
        args.repeats,
        args.profile,
        args.top,
        backend_options={"loop_factory": uvloop.new_event_loop},
    )


if __name__ == "__main__":
    main()
