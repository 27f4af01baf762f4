"""One rank of the drop-in differential test (``test_dropin.py``).

Usage: ``python tests/helpers/dropin_worker.py SIDE SUITE INIT RANK WORLD_SIZE``:

- SIDE ``torch``: ``torch.distributed`` on gloo (SUITE ``torch``), or
  ``mmengine.dist`` on top of it (SUITE ``mmengine``);
- SIDE ``aiodist``: ``aiodist.sync`` on aiodist's data plane, the same calls;
- SIDE ``backend``: ``torch.distributed`` itself on the ``aiodist`` backend
  (``init_process_group(backend="aiodist")`` in a plain torch script).

Every case is called the same way on every side (the script is the one a user
would port by changing its import), many calls per launch. The last line
printed is a JSON object: case name -> result (tensors as dtype, shape and
values; lists and dicts recursively) or ``{"error": [the exception's classes,
most derived first], "message": ...}``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any

import numpy as np
import torch

WORLD = 2
# The dtypes gloo reduces and moves, and those it refuses ("Invalid scalar type"),
# which aiodist carries all the same.
GLOO_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
EXTRA_DTYPES = [torch.int16, torch.uint16, torch.uint32, torch.uint64]
DTYPES = GLOO_DTYPES + EXTRA_DTYPES
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"]


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def value(
    rank: int, dtype: torch.dtype, shape: tuple[int, ...] = (5,), salt: int = 0
) -> torch.Tensor:
    """Small, rank-dependent values that no op overflows in any dtype."""
    n = math.prod(shape)
    base = (torch.arange(n, dtype=torch.int64) * (rank + 2) + 3 * rank + salt) % 4 + 1
    if dtype == torch.bool:
        return ((base + rank) % 2 == 0).reshape(shape)
    if dtype.is_complex:
        return torch.complex(base.double(), (base + rank).double()).to(dtype).reshape(shape)
    return base.to(dtype).reshape(shape)


def encode(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.is_complex():
            vals: Any = [torch.view_as_real(t).double().tolist()]
        elif t.dtype in (torch.bfloat16, torch.float16):
            vals = t.double().tolist()
        elif t.dtype in (torch.uint16, torch.uint32, torch.uint64):
            vals = t.to(torch.int64).tolist()
        else:
            vals = t.tolist()
        return {"tensor": name_of(t.dtype), "shape": list(t.shape), "values": vals}
    if isinstance(x, list | tuple):
        return [encode(v) for v in x]
    if isinstance(x, dict):
        return {str(k): encode(v) for k, v in x.items()}
    if isinstance(x, int | float | str | bool) or x is None:
        return x
    return repr(type(x).__name__)


def failed(exc: BaseException) -> dict[str, Any]:
    return {
        "error": [c.__name__ for c in type(exc).__mro__],
        "message": (str(exc).strip().splitlines() or [""])[0][:200],
    }


# --- the cases: every one runs on every rank, on the torch side and on aiodist's ------


def torch_cases(dist: Any, rank: int) -> list[tuple[str, Any]]:
    """(name, call) pairs; a call returns what to compare (the tensors it filled)."""
    peer = 1 - rank
    cases: list[tuple[str, Any]] = []

    def add(name: str, fn: Any) -> None:
        cases.append((name, fn))

    for dtype in DTYPES:
        d = name_of(dtype)
        for op in OPS:

            def reduce_all(op: str = op, dtype: torch.dtype = dtype) -> Any:
                t = value(rank, dtype)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                return t

            add(f"all_reduce/{op}/{d}", reduce_all)

        def reduce_to(dtype: torch.dtype = dtype) -> Any:
            t = value(rank, dtype)
            dist.reduce(t, dst=1, op=dist.ReduceOp.MAX)
            return t if rank == 1 else None  # torch leaves partial values elsewhere

        add(f"reduce/MAX/{d}", reduce_to)

        def bcast(dtype: torch.dtype = dtype) -> Any:
            t = value(rank, dtype, (2, 3))
            dist.broadcast(t, src=1)
            return t

        add(f"broadcast/{d}", bcast)

        def gather_all(dtype: torch.dtype = dtype) -> Any:
            out = [torch.zeros(3, dtype=dtype) for _ in range(WORLD)]
            dist.all_gather(out, value(rank, dtype, (3,)))
            return out

        add(f"all_gather/{d}", gather_all)

        def gather_into(dtype: torch.dtype = dtype) -> Any:
            out = torch.zeros(WORLD * 2, 3, dtype=dtype)
            dist.all_gather_into_tensor(out, value(rank, dtype, (2, 3)))
            return out

        add(f"all_gather_into_tensor/{d}", gather_into)

        def scatter_reduce(dtype: torch.dtype = dtype) -> Any:
            out = torch.zeros(4, dtype=dtype)
            dist.reduce_scatter(out, [value(rank, dtype, (4,), salt=i) for i in range(WORLD)])
            return out

        add(f"reduce_scatter/{d}", scatter_reduce)

        def scatter_reduce_tensor(dtype: torch.dtype = dtype) -> Any:
            out = torch.zeros(3, dtype=dtype)
            dist.reduce_scatter_tensor(out, value(rank, dtype, (WORLD * 3,)), op=dist.ReduceOp.MIN)
            return out

        add(f"reduce_scatter_tensor/MIN/{d}", scatter_reduce_tensor)

        def exchange(dtype: torch.dtype = dtype) -> Any:
            out = [torch.zeros(2, dtype=dtype) for _ in range(WORLD)]
            dist.all_to_all(out, [value(rank, dtype, (2,), salt=i) for i in range(WORLD)])
            return out

        add(f"all_to_all/{d}", exchange)

        def exchange_single(dtype: torch.dtype = dtype) -> Any:
            out = torch.zeros(3 if rank == 0 else 5, dtype=dtype)
            # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 2 to rank 0, 3 to itself
            ins = [1, 2] if rank == 0 else [2, 3]
            outs = [1, 2] if rank == 0 else [2, 3]
            dist.all_to_all_single(out, value(rank, dtype, (sum(ins),)), outs, ins)
            return out

        add(f"all_to_all_single/{d}", exchange_single)

        def gather_to(dtype: torch.dtype = dtype) -> Any:
            out = [torch.zeros(3, dtype=dtype) for _ in range(WORLD)] if rank == 0 else None
            dist.gather(value(rank, dtype, (3,)), out, dst=0)
            return out

        add(f"gather/{d}", gather_to)

        def scatter_from(dtype: torch.dtype = dtype) -> Any:
            t = torch.zeros(3, dtype=dtype)
            parts = [value(9, dtype, (3,), salt=i) for i in range(WORLD)] if rank == 1 else None
            dist.scatter(t, parts, src=1)
            return t

        add(f"scatter/{d}", scatter_from)

        def p2p(dtype: torch.dtype = dtype) -> Any:
            got = torch.zeros(4, dtype=dtype)
            if rank == 0:
                dist.send(value(rank, dtype, (4,)), dst=peer)
                sender = dist.recv(got, src=peer)
            else:
                sender = dist.recv(got, src=peer)
                dist.send(value(rank, dtype, (4,)), dst=peer)
            return [got, sender]

        add(f"send_recv/{d}", p2p)

        def batched(dtype: torch.dtype = dtype) -> Any:
            got = torch.zeros(3, dtype=dtype)
            ops = [
                dist.P2POp(dist.isend, value(rank, dtype, (3,)), peer),
                dist.P2POp(dist.irecv, got, peer),
            ]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            return got

        add(f"batch_isend_irecv/{d}", batched)

    # Edge cases: empty and non-contiguous tensors, async handles, object lists.
    def empty() -> Any:
        t = torch.zeros(0)
        dist.all_reduce(t)
        b = torch.zeros(0, 3)
        dist.broadcast(b, src=0)
        out = [torch.zeros(0) for _ in range(WORLD)]
        dist.all_gather(out, torch.zeros(0))
        return [t, b, out]

    add("empty_tensors", empty)

    def non_contiguous() -> Any:
        t = value(rank, torch.float32, (3, 4)).t()
        dist.all_reduce(t)
        return t

    add("all_reduce/non_contiguous", non_contiguous)

    def handle() -> Any:
        t = value(rank, torch.float32)
        w = dist.all_reduce(t, async_op=True)
        waited = w.wait()
        fut = dist.all_reduce(value(rank, torch.int64), async_op=True).get_future()
        return [t, w.is_completed(), waited is not None, fut.wait()]

    add("work/async_op", handle)

    def requests() -> Any:
        got = torch.zeros(2)
        recv_req = dist.irecv(got, src=peer, tag=3)  # torch's requests: running at once
        send_req = dist.isend(torch.full((2,), float(rank)), dst=peer, tag=3)
        send_req.wait()
        recv_req.wait()
        return [got, recv_req.is_completed(), send_req.is_completed()]

    add("isend_irecv", requests)
    add("barrier", lambda: dist.barrier())
    add("monitored_barrier", lambda: dist.monitored_barrier(timeout=timedelta(seconds=30)))

    def objects() -> Any:
        out: list[Any] = [None] * WORLD
        dist.all_gather_object(out, {"rank": rank, "t": (1, "x")})
        got: list[Any] | None = [None] * WORLD if rank == 1 else None
        dist.gather_object(f"from {rank}", got, dst=1)
        lst: list[Any] = [rank, {"a": rank}] if rank == 0 else [None, None]
        dist.broadcast_object_list(lst, src=0)
        mine: list[Any] = [None]
        dist.scatter_object_list(mine, [["r0"], ["r1"]] if rank == 1 else None, src=1)
        return [out, got, lst, mine]

    add("objects", objects)

    def object_p2p() -> Any:
        box: list[Any] = [None, None]
        if rank == 0:
            dist.send_object_list([{"k": 1}, "two"], dst=1)
            return None
        dist.recv_object_list(box, src=0)
        return box

    add("send_object_list", object_p2p)

    def queries() -> Any:
        world = dist.group.WORLD
        return [
            dist.get_rank(world),
            dist.get_world_size(world),
            dist.get_group_rank(world, rank),
            dist.get_global_rank(world, rank),
            dist.get_process_group_ranks(world),
            dist.is_initialized(),
            dist.get_node_local_rank(fallback_rank=7),
            dist.supports_complex(dist.ReduceOp.MAX),
            dist.supports_complex(dist.ReduceOp.SUM),
        ]

    add("queries", queries)

    def subgroups() -> Any:
        g = dist.new_group([1])
        t = value(rank, torch.float32)
        result = dist.all_reduce(t, group=g)  # skipped on rank 0, not in g
        mine, groups = dist.new_subgroups(1)
        enum_mine, _ = dist.new_subgroups_by_enumeration([[0], [1]])
        ranks_of = dist.get_process_group_ranks(mine)
        return [
            t,
            result is None or result is t,
            dist.get_world_size(g),
            dist.get_rank(g),
            len(groups),
            ranks_of,
            dist.get_world_size(enum_mine),
            dist.get_group_rank(g, 1) if rank == 1 else None,
        ]

    add("groups", subgroups)

    # Bad input, the same on every rank: the original's exception type.
    bad: list[tuple[str, Any]] = [
        ("all_reduce/not_a_tensor", lambda: dist.all_reduce([1, 2])),
        (
            "all_reduce/BAND_on_float",
            lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
        ),
        (
            "all_reduce/MAX_on_complex",
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX),
        ),
        (
            "all_gather/wrong_length",
            lambda: dist.all_gather([torch.zeros(3)] * (WORLD + 1), torch.zeros(3)),
        ),
        (
            "all_gather/wrong_dtype",
            lambda: dist.all_gather([torch.zeros(3, dtype=torch.int64)] * WORLD, torch.zeros(3)),
        ),
        (
            "all_gather_into_tensor/wrong_size",
            lambda: dist.all_gather_into_tensor(torch.zeros(WORLD * 3 + 1), torch.zeros(3)),
        ),
        ("broadcast/src_not_int", lambda: dist.broadcast(torch.zeros(3), "0")),
        ("reduce/no_dst", lambda: dist.reduce(torch.zeros(3))),
        ("scatter/list_on_src_missing", lambda: dist.scatter(torch.zeros(3), None, src=rank)),
        ("send/to_self", lambda: dist.send(torch.zeros(3), dst=rank)),
        ("broadcast_object_list/not_a_list", lambda: dist.broadcast_object_list(5, 0)),
        ("all_gather_object/not_a_list", lambda: dist.all_gather_object(5, 1)),
        ("all_gather_object/short_list", lambda: dist.all_gather_object([], 1)),
        (
            "scatter_object_list/empty_output",
            lambda: dist.scatter_object_list([], [1] * WORLD, src=rank),
        ),
        ("get_group_rank/None", lambda: dist.get_group_rank(None, 0)),
        ("new_subgroups/too_large", lambda: dist.new_subgroups(WORLD + 1)),
    ]
    cases.extend(bad)
    return cases


def mmengine_cases(dist: Any, rank: int) -> list[tuple[str, Any]]:
    """mmengine.dist's functions, called as mmengine's users call them."""
    cases: list[tuple[str, Any]] = []

    def add(name: str, fn: Any) -> None:
        cases.append((name, fn))

    for dtype in GLOO_DTYPES:
        d = name_of(dtype)
        for op in ("sum", "mean", "max", "min", "product"):
            if dtype.is_complex and op != "sum":
                continue

            def reduce_all(op: str = op, dtype: torch.dtype = dtype) -> Any:
                t = value(rank, dtype)
                dist.all_reduce(t, op)
                return t

            add(f"all_reduce/{op}/{d}", reduce_all)
        add(f"all_gather/{d}", lambda dtype=dtype: dist.all_gather(value(rank, dtype, (3,))))
        add(f"gather/{d}", lambda dtype=dtype: dist.gather(value(rank, dtype, (3,)), 1))

        def bcast(dtype: torch.dtype = dtype) -> Any:
            t = value(rank, dtype, (2, 2))
            dist.broadcast(t, 1)
            return t

        add(f"broadcast/{d}", bcast)

        def reduce_dict(dtype: torch.dtype = dtype) -> Any:
            data = {"b": value(rank, dtype, (2,)), "a": value(rank, dtype, (1, 3), salt=1)}
            dist.all_reduce_dict(data, "sum")
            return data

        add(f"all_reduce_dict/{d}", reduce_dict)

        def reduce_params(dtype: torch.dtype = dtype) -> Any:
            params = [value(rank, dtype, (3,)), value(rank, dtype, (2, 2), salt=2)]
            dist.all_reduce_params(params, coalesce=True)
            return params

        add(f"all_reduce_params/{d}", reduce_params)

    add("all_gather_object", lambda: dist.all_gather_object({"rank": rank}))
    add("gather_object", lambda: dist.gather_object([rank, "x"], 0))

    def bcast_objects() -> Any:
        data = ["foo", 12, {1: 2}] if rank == 0 else [None, None, None]
        dist.broadcast_object_list(data)
        return data

    add("broadcast_object_list", bcast_objects)

    def seed() -> Any:
        np.random.seed(100 + rank)
        drawn = dist.sync_random_seed()
        return [drawn, int(np.random.randint(1000))]  # the generator advanced as mmengine's

    add("sync_random_seed", seed)
    parts = [["r0-a", "r0-b", "r0-c"], ["r1-a", "r1-b"]]
    add("collect_results/gpu", lambda: dist.collect_results(parts[rank], 4, "gpu"))
    tmp = os.path.join(tempfile.gettempdir(), f"aiodist-dropin-{os.environ['DROPIN_RUN']}")
    add("collect_results/cpu_tmpdir", lambda: dist.collect_results(parts[rank], 5, "cpu", tmp))
    add("collect_results_gpu", lambda: dist.collect_results_gpu(parts[rank], 3))
    add("get_dist_info", lambda: list(dist.get_dist_info()))
    add("is_main_process", lambda: dist.is_main_process())
    add("get_data_device", lambda: str(dist.get_data_device({"a": torch.zeros(1)})))
    add("get_comm_device", lambda: str(dist.get_comm_device()))
    add("cast_data_device", lambda: dist.cast_data_device([torch.ones(2)], torch.device("cpu")))
    add("barrier", lambda: dist.barrier())

    def local_group() -> Any:
        dist.init_local_group(0, WORLD)  # one node of WORLD ranks
        local = dist.get_local_group()
        return [dist.get_local_rank(), dist.get_local_size(), dist.get_world_size(local)]

    add("init_local_group", local_group)
    bad: list[tuple[str, Any]] = [
        ("init_local_group/twice", lambda: dist.init_local_group(0, WORLD)),
        ("all_reduce_dict/not_a_dict", lambda: dist.all_reduce_dict([torch.ones(1)])),
        ("broadcast_object_list/not_a_list", lambda: dist.broadcast_object_list("abc")),
        ("collect_results/bad_device", lambda: dist.collect_results([1], 1, "tpu")),
        ("collect_results/gpu_tmpdir", lambda: dist.collect_results([1], 1, "gpu", "/tmp/x")),
        ("get_data_device/empty", lambda: dist.get_data_device([])),
        ("get_data_device/not_tensor", lambda: dist.get_data_device(3)),
        ("cast_data_device/set_out", lambda: dist.cast_data_device({1}, "cpu", {1})),
    ]
    cases.extend(bad)
    return cases


def main() -> int:
    side, suite, init, rank_s, world_s = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    assert world == WORLD
    torch.set_num_threads(1)
    if side in ("torch", "backend"):
        import torch.distributed as torch_dist

        if side == "backend":
            import aiodist  # registers the backend  # noqa: F401

        backend = "gloo" if side == "torch" else "aiodist"
        torch_dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        if suite == "mmengine":
            import mmengine.dist as mm_dist

            dist: Any = mm_dist
        else:
            dist = torch_dist
    else:
        import aiodist.sync as aiodist_dist

        dist = aiodist_dist
        dist.init_process_group(init_method=init, rank=rank, world_size=world, timeout=60)
    cases = torch_cases(dist, rank) if suite == "torch" else mmengine_cases(dist, rank)
    out: dict[str, Any] = {}
    for name, fn in cases:
        try:
            out[name] = encode(fn())
        except Exception as exc:
            out[name] = failed(exc)
            if os.environ.get("DROPIN_TRACE"):
                traceback.print_exc()
    if side in ("torch", "backend"):
        import torch.distributed as torch_dist

        torch_dist.destroy_process_group()
    else:
        dist.destroy_process_group()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
