"""A producer and workers that die: ``aiodist run -n 4 examples/elastic_pipeline.py``.

Rank 0 produces items and hands each to a worker with ``rpc.rpc_async``,
a few in flight per worker; every other rank is a worker whose whole program
is ``init_process_group()`` then ``await rpc.shutdown()``: it serves the
producer's calls meanwhile. ``--fail`` workers go away after
``--fail-after`` items each: under ``aiodist run`` they leave (it stops every
rank once one fails); with ``--kill`` they kill themselves with SIGKILL in the
middle of a call. A dead worker fails only the calls to it: the producer
hands their items to the workers left, and keeps calling those. At the end
it checks that every item was processed exactly once, and ``rpc.shutdown()``
completes among the ranks still alive.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import anyio

import aiodist
import aiodist.rpc as rpc

_done = 0
_leave = anyio.Event()


def process(item: int, fail_after: int, kill: bool) -> tuple[int, int]:
    """A worker's part: the item's result and who computed it."""
    global _done
    _done += 1
    if fail_after and _done > fail_after:
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)  # dies in the middle of this call
        _leave.set()  # leaves once the calls it is serving are answered
    return item * item, aiodist.get_rank()


async def produce(
    items: int, per_worker: int, failing: set[int], fail_after: int, kill: bool
) -> None:
    workers = list(range(1, aiodist.get_world_size()))
    todo = list(range(items))
    results: dict[int, int] = {}
    by_worker = dict.fromkeys(workers, 0)
    deaths: list[tuple[int, float]] = []
    started = time.monotonic()

    async def worker_loop(w: int) -> None:
        while todo:
            item = todo.pop()
            limit = fail_after if w in failing else 0
            try:
                value, who = await rpc.rpc_async(w, process, (item, limit, kill))
            except (aiodist.RankFailedError, aiodist.ClosedError):
                todo.append(item)  # not processed: another worker takes it
                deaths.append((w, time.monotonic() - started))
                return  # this worker is gone: only the calls to it failed
            assert item not in results, f"item {item} processed twice"
            results[item] = value
            by_worker[who] += 1

    async with anyio.create_task_group() as tg:
        for w in workers:
            for _ in range(per_worker):
                tg.start_soon(worker_loop, w)
    # A task whose worker died leaves its last item to the others: run what is left.
    alive = [w for w in workers if w not in {d for d, _ in deaths}]
    while todo:
        item = todo.pop()
        value, who = await rpc.rpc_async(alive[item % len(alive)], process, (item, 0, False))
        results[item] = value
        by_worker[who] += 1
    assert sorted(results) == list(range(items)), "an item was lost"
    assert all(results[i] == i * i for i in results), "a wrong result"
    gone = sorted({w for w, _ in deaths})
    print(
        f"elastic pipeline: {len(results)} of {items} items, each processed exactly once; "
        f"workers gone: {gone}; items per worker: {by_worker}"
    )


async def main(items: int, per_worker: int, fail: int, fail_after: int, kill: bool) -> None:
    await aiodist.init_process_group()
    rank, world = aiodist.get_rank(), aiodist.get_world_size()
    failing = set(range(world - fail, world))
    if rank == 0:
        await produce(items, per_worker, failing, fail_after, kill)
    elif rank in failing:
        await _leave.wait()  # (or killed first, with --kill)
        await aiodist.destroy_process_group()
        return
    await rpc.shutdown()  # completes among the ranks still alive
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--per-worker", type=int, default=4, help="calls in flight per worker")
    parser.add_argument("--fail", type=int, default=2, help="workers that go away")
    parser.add_argument("--fail-after", type=int, default=40, help="items before they go")
    parser.add_argument("--kill", action="store_true", help="SIGKILL instead of leaving")
    args = parser.parse_args()
    anyio.run(main, args.items, args.per_worker, args.fail, args.fail_after, args.kill)
