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

    aiodist run -n 4 --replace-failed examples/elastic_pipeline.py --kill --expect-replacements 2

Under ``--replace-failed`` the launcher starts a replacement for each killed
worker; it joins the running job with the next free rank, and its whole
program is ``rpc.shutdown()`` too. The producer watches the membership
(``aiodist.watch_membership``) and hands items to each newcomer as it comes,
and reports how long after each death the pipeline had its full count of
workers again, with the items per second before the first death and after
the last join.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import anyio
import anyio.abc

import aiodist
import aiodist.rpc as rpc

_done = 0
_leave = anyio.Event()


def process(item: int, fail_after: int, kill: bool, cost: float) -> int:
    """A worker's part: the item's result (``cost`` seconds of work)."""
    global _done
    _done += 1
    if fail_after and _done > fail_after:
        if kill:
            os.kill(os.getpid(), signal.SIGKILL)  # dies in the middle of this call
        _leave.set()  # leaves once the calls it is serving are answered
    if cost:
        time.sleep(cost)  # the work (rpc runs it in a thread: the loop goes on)
    return item * item


def fail_now(kill: bool) -> None:
    """A failing worker's end, when the items ran out before it reached its count."""
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    _leave.set()


async def produce(
    items: int,
    per_worker: int,
    failing: set[int],
    fail_after: int,
    kill: bool,
    cost: float,
    expect: int,
) -> None:
    workers = list(range(1, aiodist.get_world_size()))
    full = len(workers)
    todo = list(range(items))
    results: dict[int, int] = {}
    by_worker = dict.fromkeys(workers, 0)
    deaths: list[tuple[int, float]] = []
    joins: list[tuple[int, float]] = []
    done_at: list[float] = []  # when each item's result came back
    started = time.monotonic()
    seen = 0  # the latest membership epoch the producer looked at

    async def worker_loop(w: int) -> None:
        while todo:
            item = todo.pop()
            limit = fail_after if w in failing else 0
            try:
                value = await rpc.rpc_async(w, process, (item, limit, kill, cost))
            except (aiodist.RankFailedError, aiodist.ClosedError):
                todo.append(item)  # not processed: another worker takes it
                if w not in {d for d, _ in deaths}:
                    deaths.append((w, time.monotonic() - started))
                return  # this worker is gone: only the calls to it failed
            assert item not in results, f"item {item} processed twice"
            results[item] = value
            by_worker[w] += 1
            done_at.append(time.monotonic() - started)

    async def watch_joins(tg: anyio.abc.TaskGroup) -> None:
        nonlocal seen
        async for view in aiodist.watch_membership():  # newcomers: replacements
            seen = max(seen, view.epoch)
            for w in view.joined:
                joins.append((w, time.monotonic() - started))
                by_worker[w] = 0
                for _ in range(per_worker):
                    tg.start_soon(worker_loop, w)

    async with anyio.create_task_group() as tg:
        async with anyio.create_task_group() as loops:
            for w in workers:
                for _ in range(per_worker):
                    loops.start_soon(worker_loop, w)
            tg.start_soon(watch_joins, loops)
        tg.cancel_scope.cancel()
    # A task whose worker died leaves its last item to the others: run what is left.
    gone = {d for d, _ in deaths}
    alive = [w for w in by_worker if w not in gone]
    while todo:
        item = todo.pop()
        w = alive[item % len(alive)]
        results[item] = await rpc.rpc_async(w, process, (item, 0, False, cost))
        by_worker[w] += 1
    # A failing worker that got fewer items than its count (a slow start) goes now.
    for w in sorted(failing - gone):
        try:
            await rpc.rpc_async(w, fail_now, (kill,))
        except (aiodist.RankFailedError, aiodist.ClosedError):
            pass  # killed in the call, as planned
        gone.add(w)
    assert sorted(results) == list(range(items)), "an item was lost"
    assert all(results[i] == i * i for i in results), "a wrong result"
    joined = f"joined: {[w for w, _ in joins]}; " if joins else ""  # replacements, if any
    print(
        f"elastic pipeline: {len(results)} of {items} items, each processed exactly once; "
        f"workers gone: {sorted(gone)}; {joined}items per worker: {by_worker}"
    )
    if joins:
        report_recovery(deaths, joins, done_at, full)
    # Replacements that come after the last item still take part in rpc.shutdown.
    if len(joins) < expect:
        with anyio.fail_after(60):
            async for view in aiodist.watch_membership():
                if view.epoch > seen:
                    joins.extend((w, time.monotonic() - started) for w in view.joined)
                if len(joins) >= expect:
                    break


def report_recovery(
    deaths: list[tuple[int, float]], joins: list[tuple[int, float]], done: list[float], full: int
) -> None:
    """When the pipeline had its full count of workers again, and its rate before and after."""

    def rate(t0: float, t1: float) -> float:
        n = sum(1 for t in done if t0 <= t < t1)
        return n / (t1 - t0) if t1 > t0 else 0.0

    for (w, died), (n, came) in zip(deaths, joins, strict=False):
        print(
            f"worker {w} died at {died:.2f} s; rank {n} joined at {came:.2f} s: "
            f"{full} workers again after {came - died:.2f} s"
        )
    first, last = deaths[0][1], joins[-1][1]
    print(
        f"rate: {rate(0.0, first):.0f} items/s before the first death, "
        f"{rate(first, last):.0f} items/s until the last join, "
        f"{rate(last, done[-1]):.0f} items/s after it"
    )


async def main(
    items: int, per_worker: int, fail: int, fail_after: int, kill: bool, cost: float, expect: int
) -> None:
    await aiodist.init_process_group()
    rank, world = aiodist.get_rank(), aiodist.get_world_size()
    failing = set() if aiodist.joined_late() else set(range(world - fail, world))
    if aiodist.joined_late():
        pass  # a replacement: it serves the producer's calls until rpc.shutdown
    elif rank == 0:
        await produce(items, per_worker, failing, fail_after, kill, cost, expect)
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
    parser.add_argument("--cost", type=float, default=0.0, help="seconds of work per item")
    parser.add_argument(
        "--expect-replacements",
        type=int,
        default=0,
        help="replacements the producer waits for (aiodist run --replace-failed)",
    )
    args = parser.parse_args()
    anyio.run(
        main,
        *(args.items, args.per_worker, args.fail, args.fail_after, args.kill),
        *(args.cost, args.expect_replacements),
    )
