"""The aiodist demo: run with ``aiodist run -n 4 examples/demo.py`` (or ``make demo``).

Every rank joins the job and uses its key-value store, then the ranks go
through point-to-point messages and every collective, on tensors and on plain
Python objects. Rank 0 prints what it got.
"""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import torch

import aiodist


def show(what: str, value: object) -> None:
    """Print one result line on rank 0 (tensors as plain lists)."""
    if aiodist.is_main_process():
        print(f"  {what:<34} {_plain(value)}", flush=True)


def _plain(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def section(title: str) -> None:
    if aiodist.is_main_process():
        print(f"\n{title}", flush=True)


async def main() -> None:
    started = time.perf_counter()
    await aiodist.init_process_group()
    rank, n = aiodist.get_dist_info()
    print(
        f"joined: rank {rank} of {n}, local rank {aiodist.get_local_rank()} of "
        f"{aiodist.get_local_size()}, pid {os.getpid()}",
        flush=True,
    )

    # --- the job's key-value store (what TCPStore offers) --------------------------------
    store = aiodist.get_store()
    await store.set(f"greeting/{rank}", f"hello from rank {rank}")
    await store.add("arrivals", 1)
    await store.wait([f"greeting/{r}" for r in range(n)])
    await aiodist.barrier()
    section("store")
    show("get('greeting/1')", (await store.get("greeting/1")).decode())
    show("add('arrivals', 1) on every rank", await store.add("arrivals", 0))

    # --- point to point -------------------------------------------------------------------
    section("point to point (each rank sends to the next one, around a ring)")
    right, left = (rank + 1) % n, (rank - 1) % n
    inbox = torch.zeros(3)
    sent = aiodist.isend(torch.full((3,), float(rank)), dst=right)
    sender = await aiodist.irecv(inbox, src=left)
    await sent
    show("rank 0 received from rank", f"{sender}: {inbox.tolist()}")
    sent = aiodist.isend_object({"note": f"hi from {rank}"}, dst=right)
    show("rank 0 received object", await aiodist.irecv_object(src=left))
    await sent

    # --- tensor collectives -----------------------------------------------------------------
    section("tensor collectives (rank r contributes tensors filled with r)")
    mine = torch.full((2,), float(rank))

    t = mine.clone()
    await aiodist.all_reduce(t)
    show("all_reduce(sum)", t)
    t = mine.clone()
    await aiodist.all_reduce(t, op="max")
    show("all_reduce(max)", t)
    t = mine.clone()
    await aiodist.reduce(t, dst=0, op="sum")
    show("reduce(sum) to rank 0", t)
    t = torch.tensor([42.0, 43.0]) if rank == 0 else torch.zeros(2)
    await aiodist.broadcast(t, src=0)
    show("broadcast from rank 0", t)
    show("all_gather", await aiodist.all_gather(mine))
    show("gather to rank 0", await aiodist.gather(mine, dst=0))
    t = torch.zeros(2)
    pieces = [torch.full((2,), 10.0 * r) for r in range(n)] if rank == 0 else None
    await aiodist.scatter(t, pieces, src=0)
    show("scatter from rank 0 (rank 0 gets)", t)
    inputs = [torch.full((2,), float(rank * 10 + r)) for r in range(n)]
    show("reduce_scatter(sum) (rank 0 gets)", await aiodist.reduce_scatter(inputs))
    show("all_to_all (rank 0 gets)", await aiodist.all_to_all(inputs))
    await aiodist.barrier()
    show("barrier", "passed")

    # --- handles: start several operations, compute, then wait ------------------------------
    section("handles (operations start when called; await them later)")
    works = [aiodist.all_reduce(torch.full((1000,), float(i))) for i in range(8)]
    sum(i * i for i in range(20_000))  # compute here overlaps the communication
    show("8 all_reduces started, then awaited", [float((await w)[0]) for w in works])

    # --- object collectives ----------------------------------------------------------------
    section("object collectives")
    show("all_gather_object", await aiodist.all_gather_object({"rank": rank}))
    show("gather_object to rank 0", await aiodist.gather_object(f"r{rank}", dst=0))
    cfg: list[Any] = [{"lr": 0.1, "layers": (64, 64)}] if rank == 0 else [None]
    await aiodist.broadcast_object_list(cfg, src=0)
    show("broadcast_object_list from rank 0", cfg)
    shards = [list(range(r * 3, r * 3 + 3)) for r in range(n)] if rank == 0 else None
    show("scatter_object_list (rank 0 gets)", await aiodist.scatter_object_list(shards, src=0))
    # A sampler hands rank r samples r, r+n, ... padded to equal parts; collect_results
    # puts them back in dataset order and drops the padding.
    part = [f"s{i % 10}" for i in range(rank, 12, n)]
    show("collect_results(size=10)", await aiodist.collect_results(part, 10))
    seed = await aiodist.sync_random_seed()
    seeds = await aiodist.all_gather_object(seed)
    show("sync_random_seed (same everywhere)", f"{seed} {len(set(seeds)) == 1}")
    metrics = {"loss": torch.tensor(float(rank)), "acc": torch.tensor(0.5 + rank)}
    await aiodist.all_reduce_dict(metrics, op="mean")
    show("all_reduce_dict(mean)", {k: float(v) for k, v in metrics.items()})

    # --- subgroups ---------------------------------------------------------------------------
    section("subgroups")
    evens = await aiodist.new_group(list(range(0, n, 2)))
    if evens.rank >= 0:
        t = mine.clone()
        await aiodist.all_reduce(t, group=evens)
        show(f"all_reduce on ranks {evens.ranks}", t)

    await aiodist.barrier()
    if aiodist.is_main_process():
        print(f"\ndone in {time.perf_counter() - started:.2f} s", flush=True)
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main)
