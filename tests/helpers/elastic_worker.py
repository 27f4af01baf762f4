"""A rank of the elastic tests (``test_elastic.py``): one JSON report line on stdout.

    python elastic_worker.py URL RANK WORLD MODE

Modes:
    shrink   rank 2 is killed (SIGKILL) in the middle of an all_reduce; the survivors
             check what still works, shrink the default group and run 100 steps.
    second   rank 3 is killed in an all_reduce; rank 1 is killed while ranks 0 and 2
             are inside shrink_group; the survivors end in one group of two.
    metrics  a MetricAggregator syncs on the shared-memory board of 3 ranks; rank 2 is
             killed, the others shrink and sync again with the same aggregator.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import anyio
import anyio.lowlevel
import torch

import aiodist
from aiodist.metrics import MetricAggregator

HEARTBEAT_TIMEOUT = 2.0


def report(out: dict[str, Any]) -> None:
    print(json.dumps(out), flush=True)


def die(out: dict[str, Any]) -> None:
    out["killed_at"] = time.time()
    report(out)
    os.kill(os.getpid(), signal.SIGKILL)


async def steps(n: int) -> list[float]:
    """``n`` all_reduce steps on the default group; the sums (each checked by the caller)."""
    sums = []
    for step in range(n):
        t = torch.full((4,), float((step + 1) * (aiodist.get_rank() + 1)))
        await aiodist.all_reduce(t)
        sums.append(float(t[0]))
    return sums


async def until_failure(out: dict[str, Any], victim: int) -> aiodist.RankFailedError:
    """Run all_reduce until one fails (the victim kills itself inside one)."""
    rank = aiodist.get_rank()
    for i in range(10_000):
        t = torch.ones(4)
        if rank == victim and i == 3:
            work = aiodist.all_reduce(t)  # started: its part is on the way
            await anyio.lowlevel.checkpoint()
            del work
            die(out)
        try:
            await aiodist.all_reduce(t)
        except aiodist.RankFailedError as exc:
            out["told_at"] = time.time()
            out["error"] = [type(exc).__name__, exc.rank, str(exc)]
            return exc
    raise AssertionError("no failure")


async def main() -> None:
    url, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    await aiodist.init_process_group(
        init_method=url,
        world_size=world,
        rank=rank,
        group_name=f"elastic-{mode}",
        heartbeat_interval=0.1,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )
    out: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    pair = await aiodist.new_group([0, 1])  # without the victims of either mode
    store = aiodist.get_store()
    await aiodist.barrier()
    if mode == "metrics":
        await metrics_after_shrink(out)
        return
    if mode == "shrink":
        exc = await until_failure(out, victim=2)
        # Failure isolation: what does not need rank 2 still works.
        if rank in (0, 1):
            t = torch.full((2,), float(rank + 1))
            await aiodist.all_reduce(t, group=pair)
            out["pair_sum"] = float(t[0])
        if rank == 0:
            await aiodist.send_object_list([{"to": 3}], dst=3)
        elif rank == 3:
            got: list[Any] = [None]
            await aiodist.recv_object_list(got, src=0)
            out["p2p"] = got[0]
        await store.set(f"alive/{rank}", str(rank))
        nxt = {0: 1, 1: 3, 3: 0}[rank]  # the next survivor
        out["store"] = (await store.get(f"alive/{nxt}")).decode()
        try:
            await aiodist.all_reduce(torch.ones(1))
        except aiodist.GroupBrokenError as broken:
            out["world_broken"] = [type(broken).__name__, getattr(broken, "rank", None)]
        new = await aiodist.shrink_group([exc.rank])
        out["new"] = [aiodist.get_rank(), aiodist.get_world_size(), list(new.ranks)]
        out["default_is_new"] = aiodist.group.WORLD is new
        out["sums"] = await steps(100)
        # aiodist.metrics follows the new default group.
        agg = MetricAggregator({"ranks": "sum"})
        agg.update(1, ranks=1.0)
        out["metrics_ranks"] = (await agg.sync())["ranks"]
        # A global rank now means a rank of the new default group: 2 is the old rank 3.
        if aiodist.get_rank() == 0:
            await aiodist.send_object_list(["renumbered"], dst=2)
        elif aiodist.get_rank() == 2:
            box: list[Any] = [None]
            await aiodist.recv_object_list(box, src=0)
            out["renumbered_p2p"] = box[0]
    elif mode == "second":
        exc = await until_failure(out, victim=3)
        if rank == 1:
            # Dies while ranks 0 and 2 wait inside shrink_group.
            await store.wait(["in_shrink/0", "in_shrink/2"])
            die(out)
        await store.set(f"in_shrink/{rank}", "1")
        try:
            new = await aiodist.shrink_group([exc.rank])
        except aiodist.DistError as failed:
            out["shrink_error"] = [type(failed).__name__, str(failed)]
        else:
            out["new"] = [aiodist.get_rank(), aiodist.get_world_size(), list(new.ranks)]
            out["sums"] = await steps(20)
    report(out)
    await aiodist.destroy_process_group()


async def metrics_after_shrink(out: dict[str, Any]) -> None:
    """Mode ``metrics``: an aggregator made before a shrink syncs among the survivors."""
    rank = aiodist.get_rank()
    agg = MetricAggregator({"tokens": "sum"})
    for _ in range(3):  # on the board (three ranks of one host) from the second on
        agg.update(tokens=rank + 1)
        out.setdefault("before", []).append((await agg.sync())["tokens"])
    out["on_board"] = agg._board is not None
    if rank == 2:
        die(out)
    try:
        await aiodist.barrier()
    except aiodist.RankFailedError as exc:
        out["error"] = [type(exc).__name__, exc.rank]
        await aiodist.shrink_group([exc.rank])
    after: list[float | str] = []
    for _ in range(3):
        agg.update(tokens=10 * (rank + 1))
        try:
            with anyio.fail_after(20):
                after.append((await agg.sync())["tokens"])
        except Exception as exc:
            after.append(f"{type(exc).__name__}: {exc}")
    out["after"] = after
    report(out)
    await aiodist.destroy_process_group()


def sync_main() -> None:
    """Mode ``sync``: plain code on ``aiodist.sync``; rank 1 of 3 is killed, the others shrink."""
    import aiodist.sync as dist

    url, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group(
        init_method=url,
        world_size=world,
        rank=rank,
        group_name="elastic-sync",
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
    )
    out: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    try:
        # Rank 1 dies once its barrier returned; a peer may still be waiting for rank 1's
        # last barrier message then (a failed rank's data is not awaited), so either call
        # may be the one that names it.
        dist.barrier()
        if rank == 1:
            die(out)
        dist.all_reduce(torch.ones(1))
    except aiodist.RankFailedError as exc:
        out["error"] = [type(exc).__name__, exc.rank]
        dist.shrink_group([exc.rank])
    out["new"] = [dist.get_rank(), dist.get_world_size()]
    t = torch.ones(3)
    dist.all_reduce(t)  # no group: the new default group
    out["sum"] = t.tolist()
    report(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[4] == "sync":
        sync_main()
    else:
        anyio.run(main)
