"""An async data pipeline across ranks: ``aiodist run -n 4 examples/async_pipeline.py``.

Each rank takes its share of the work items (every ``world_size``-th one), runs
them through a small asyncio pipeline (a fetch stage with I/O-like waits and a
CPU stage, connected by a bounded channel), and reports progress to the other
ranks as it goes with non-blocking object collectives. At the end the ranks
gather every result with ``await aiodist.all_gather_object`` and rank 0 prints
a summary; every rank checks it got the same complete set.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time
from typing import TYPE_CHECKING, Any

import anyio

import aiodist

if TYPE_CHECKING:
    from anyio.abc import ObjectReceiveStream, ObjectSendStream


async def fetch(items: list[int], out: ObjectSendStream[tuple[int, bytes]]) -> None:
    """Stage 1: fetch each item (simulated I/O with a random latency)."""
    rng = random.Random(aiodist.get_rank())
    async with out:
        for item in items:
            await anyio.sleep(rng.uniform(0, 0.002))
            await out.send((item, f"record-{item}".encode()))


async def process(
    inbox: ObjectReceiveStream[tuple[int, bytes]], results: dict[int, str], every: int
) -> None:
    """Stage 2: CPU work per record; every ``every`` records, share progress."""
    progress: list[aiodist.Work[list[Any]]] = []
    async with inbox:
        async for item, record in inbox:
            results[item] = hashlib.sha256(record * 100).hexdigest()[:12]
            if len(results) % every == 0:
                # Non-blocking: the gather runs while this stage keeps processing.
                progress.append(aiodist.all_gather_object(len(results)))
    for work in progress:
        counts = await work
        if aiodist.is_main_process():
            print(f"progress: {sum(counts)} records done across ranks ({counts})", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--items", type=int, default=200)
    args = parser.parse_args()

    await aiodist.init_process_group()
    rank, world = aiodist.get_dist_info()
    # Equal shares (the item count is rounded up to a multiple of the world size),
    # so every rank reports progress the same number of times: a collective needs all.
    total = -(-args.items // world) * world
    mine = list(range(rank, total, world))
    started = time.perf_counter()

    results: dict[int, str] = {}
    send, receive = anyio.create_memory_object_stream[tuple[int, bytes]](16)
    async with anyio.create_task_group() as tg:
        tg.start_soon(fetch, mine, send)
        tg.start_soon(process, receive, results, 10)

    everything: dict[int, str] = {}
    for part in await aiodist.all_gather_object(results):
        everything.update(part)
    assert sorted(everything) == list(range(total)), "an item was lost"
    if aiodist.is_main_process():
        print(
            f"pipeline: {len(everything)} items on {world} ranks in "
            f"{time.perf_counter() - started:.2f} s; item 0 -> {everything[0]}",
            flush=True,
        )
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main)
