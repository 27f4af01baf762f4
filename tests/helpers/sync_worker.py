"""One rank of plain, blocking code on ``aiodist.sync``, run as a subprocess by test_sync_mp.py.

Usage: ``python tests/helpers/sync_worker.py MODE RANK WORLD_SIZE``. The rendezvous
comes from ``MASTER_ADDR``/``MASTER_PORT`` (and, for mode ``mmengine``, the
rest of torchrun's variables). The last line printed is a JSON report.
"""

from __future__ import annotations

import atexit
import json
import sys
import threading
from typing import Any, cast

import torch

import aiodist.sync as dist


def _loop_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "aiodist-loop"]


def workload(rank: int, world: int) -> dict[str, Any]:
    """A training-loop-shaped script: collectives, handles overlapped with compute, p2p."""
    dist.init_process_group(backend="gloo", rank=rank, world_size=world, timeout=60)
    out: dict[str, Any] = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "is_main": dist.is_main_process(),
        "loop_threads": _loop_threads(),
    }
    small = torch.full((3,), float(rank))
    large = torch.full((100_000,), float(rank + 1))  # above 64 KiB: the ring path
    handles: list[dist.Work[Any]] = [
        dist.all_reduce(small, async_op=True),
        dist.all_reduce(large, op="mean", async_op=True),
        dist.all_gather_object({"rank": rank}, async_op=True),
    ]
    m = torch.eye(64) + rank
    for _ in range(20):  # compute while the collectives run
        m = (m @ m.T) / m.norm()
    out["results"] = [handles[0].wait(timeout=60).tolist()]
    out["results"].append(handles[1].wait(timeout=60)[:2].tolist())
    out["results"].append(handles[2].wait(timeout=60))
    out["all_completed"] = all(h.is_completed() for h in handles)

    data: list[Any] = ["cfg", {"lr": 0.1}] if rank == 0 else [None, None]
    dist.broadcast_object_list(data)
    out["broadcast_object_list"] = data
    # A distributed sampler gives rank r the samples r, r + world, ...; 10 samples in all.
    mine = [f"s{i}" for i in range(rank, 12, world)]
    out["collect_results"] = dist.collect_results(mine, 10)
    out["seed"] = dist.sync_random_seed()

    store = dist.get_store()  # blocking methods, like TCPStore's
    store.set(f"ready/{rank}", str(rank))
    store.wait([f"ready/{r}" for r in range(world)], timeout=60)
    out["store"] = [store.get("ready/0").decode(), store.add("count", 1) >= 1]

    right, left = (rank + 1) % world, (rank - 1) % world
    send = dist.isend(torch.full((4,), float(rank)), dst=right)  # running, as torch's
    buf = torch.zeros(4)
    out["recv_from"] = dist.recv(buf, src=left)
    send.wait(timeout=60)
    out["recv"] = buf.tolist()
    # A sparse tensor: gloo (which carries this group's CPU tensors) sums it in place.
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[rank, world]]), torch.ones(2), (world + 1,), check_invariants=True
    )
    dist.all_reduce(sparse)
    out["sparse"] = [sparse.is_sparse, sparse.to_dense().tolist()]
    # Roots named by group rank (``group_src``, ``group_dst``, keywords after torch's
    # ``async_op``): group rank g of ``top`` is global rank g + 1.
    top = dist.new_group([1, 2, 3])
    if rank > 0:
        b = torch.full((2,), float(rank))
        dist.broadcast(b, group=top, group_src=2)
        r = torch.full((2,), float(rank))
        dist.reduce(r, group=top, group_dst=0)
        gathered = [torch.zeros(1) for _ in range(3)] if rank == 1 else None
        dist.gather(torch.full((1,), float(rank)), gathered, group=top, group_dst=0)
        pieces = [torch.full((1,), 10.0 + g) for g in range(3)] if rank == 3 else None
        piece = torch.zeros(1)
        dist.scatter(piece, pieces, group=top, group_src=2)
        out["group_roots"] = [
            b.tolist(),
            r.tolist() if rank == 1 else None,
            [t.item() for t in gathered] if gathered is not None else None,
            piece.item(),
        ]
    # torch's methods of a group: allreduce starts it (a future to chain, as DDP's hooks do).
    method = torch.full((2,), float(rank))
    everyone = dist.group.WORLD
    assert everyone is not None
    fut = everyone.allreduce([method]).get_future()
    out["method"] = fut.then(lambda f: [t * 3 for t in f.wait()]).wait()[0].tolist()
    dist.barrier(timeout=60)
    dist.destroy_process_group()
    out["loop_threads_after"] = _loop_threads()
    out["initialized_after"] = dist.is_initialized()
    return out


def mmengine(rank: int, world: int) -> dict[str, Any]:
    """The examples of mmengine.dist's docstrings (world size 2), through init_dist."""
    dist.init_dist("pytorch", backend="gloo", timeout=60)
    out: dict[str, Any] = {"rank": dist.get_rank(), "local_rank": dist.get_local_rank()}

    data = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.all_reduce(data)
    out["all_reduce"] = data.tolist()

    data = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    out["all_gather"] = [t.tolist() for t in dist.all_gather(data)]
    out["gather"] = [t.tolist() for t in dist.gather(data)]

    data = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.broadcast(data)
    out["broadcast"] = data.tolist()

    out["sync_random_seed"] = dist.sync_random_seed()

    objs: list[Any] = ["foo", 12, {1: 2}] if rank == 0 else [None, None, None]
    dist.broadcast_object_list(objs)
    out["broadcast_object_list"] = repr(objs)

    tensors = {
        "key1": torch.arange(2, dtype=torch.int64) + 2 * rank,
        "key2": torch.arange(3, dtype=torch.int64) + 3 * rank,
    }
    dist.all_reduce_dict(tensors)
    out["all_reduce_dict"] = {k: v.tolist() for k, v in tensors.items()}
    means = {"loss": torch.tensor([1.0 + rank])}
    dist.all_reduce_dict(means, op="mean")
    out["all_reduce_dict_mean"] = means["loss"].tolist()

    picklable = ["foo", 12, {1: 2}]
    out["all_gather_object"] = repr(dist.all_gather_object(picklable[rank]))
    out["gather_object"] = repr(dist.gather_object(picklable[rank]))

    results: list[Any] = ["foo", {1: 2}] if rank == 0 else [24, {"a": "b"}]
    out["collect_results"] = repr(dist.collect_results(results, 4, device="cpu"))

    params = [torch.ones(2) * (rank + 1), torch.ones(3, dtype=torch.float64) * (rank + 1)]
    dist.all_reduce_params(params, op="mean")
    out["all_reduce_params"] = [p.tolist() for p in params]

    saved: list[int] = []
    dist.master_only(saved.append)(rank)
    out["master_only"] = saved
    dist.barrier()
    dist.destroy_process_group()
    return out


def torch_groups(rank: int, world: int) -> dict[str, Any]:
    """torch's groups and aiodist.sync's, each where the other is expected (default backend)."""
    import torch.distributed as torch_dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(rank=rank, world_size=world, timeout=60)
    out: dict[str, Any] = {"world_type": type(dist.group.WORLD).__name__}
    # dist.group.WORLD is torch's group over the job: DDP takes it, as under torch.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    ddp = DistributedDataParallel(model, process_group=dist.group.WORLD)
    ddp(torch.full((1, 3), float(rank + 1))).sum().backward()
    grad = model.weight.grad
    assert grad is not None
    out["grad"] = grad.tolist()  # the mean of (rank + 1) over ranks
    # ... and aiodist.sync takes torch's groups: the default, a DDP's, one torch made,
    # also where mmengine's forms take a group in another argument's place.
    pair = torch_dist.new_group([0, 1])
    out["queries"] = [
        dist.get_rank(cast("Any", torch_dist.group.WORLD)),
        dist.get_world_size(cast("Any", ddp.process_group)),
    ]
    if rank < 2:
        t = torch.ones(1)
        dist.all_reduce(t, group=pair)
        gathered = dist.all_gather(torch.full((1,), float(rank)), pair)  # mmengine's form
        objects = dist.all_gather_object(rank, pair)  # mmengine's form
        out["pair"] = [
            dist.get_process_group_ranks(pair),
            t.item(),
            [x.item() for x in gathered],
            objects,
        ]
    try:
        dist.get_rank([0, 1])  # type: ignore[arg-type]
    except TypeError as exc:
        out["not_a_group"] = str(exc)
    dist.destroy_process_group()
    return out


def no_destroy(rank: int, world: int) -> dict[str, Any]:
    """Leave without destroy_process_group: interpreter exit tears the group down.

    The report is printed at exit, by a handler registered before aiodist.sync
    starts its loop thread, so it runs after aiodist's own exit handler.
    """
    out: dict[str, Any] = {"rank": rank}

    def report_at_exit() -> None:
        out["at_exit"] = {"initialized": dist.is_initialized(), "loop_threads": _loop_threads()}
        print(json.dumps(out), flush=True)

    atexit.register(report_at_exit)
    dist.init_process_group(backend="gloo", rank=rank, world_size=world, timeout=60)
    t = torch.ones(2)
    dist.all_reduce(t)
    out.update(all_reduce=t.tolist(), loop_threads=_loop_threads())
    return out


def main() -> None:
    mode, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    modes = {
        "workload": workload,
        "mmengine": mmengine,
        "no_destroy": no_destroy,
        "torch_groups": torch_groups,
    }
    print(json.dumps(modes[mode](rank, world)), flush=True)


if __name__ == "__main__":
    main()
