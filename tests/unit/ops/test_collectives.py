"""Tensor collectives with the real in-process server and N real clients on 127.0.0.1."""

from __future__ import annotations

import functools
import glob
import random
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

from aiodist import CollectiveMismatchError, GroupBrokenError, ProcessGroup, RendezvousServer
from aiodist._ops import schedules
from aiodist._ops.agreement import signature
from aiodist._ops.exchange import (
    ONE_ROUND_MAX_RANKS,
    STAR_MAX_RANKS,
    Exchange,
    exchange_rows,
)
from aiodist._ops.movement import all_gather, all_to_all, barrier
from aiodist._ops.reductions import all_reduce, reduce, reduce_scatter
from aiodist._ops.rooted import broadcast, gather, scatter
from aiodist._transport import shm
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._group.work import Work

SMALL, LARGE = 37, 70_001  # LARGE is over the 64 KiB ring threshold for every dtype
OPS = ["sum", "mean", "product", "min", "max", "band", "bor", "bxor"]
DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bool, torch.bfloat16]


def _valid(op: str, dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return op in ("sum", "max")
    if op == "mean":
        return dtype.is_floating_point
    if op in ("band", "bor", "bxor"):
        return not dtype.is_floating_point
    return True


CASES = [(op, dtype) for op in OPS for dtype in DTYPES if _valid(op, dtype)]


def _input(rank: int, numel: int, dtype: torch.dtype, op: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen).bool()
    low, high = (-1, 3) if op == "product" else (-50, 50)  # integer values: exact in bf16
    return torch.randint(low, high, (numel,), generator=gen).to(dtype)


def _reference(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    dtype = xs[0].dtype
    stack = torch.stack(xs)
    if dtype == torch.bool:
        if op in ("sum", "max", "bor"):
            return stack.any(0)
        if op in ("product", "min", "band"):
            return stack.all(0)
    if op in ("band", "bor", "bxor"):
        fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
        return functools.reduce(fn, xs)
    result = {
        "sum": lambda: stack.sum(0),
        "mean": lambda: stack.mean(0),
        "product": lambda: stack.prod(0),
        "min": lambda: stack.amin(0),
        "max": lambda: stack.amax(0),
    }[op]()
    return result.to(dtype)


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
async def test_all_reduce_every_op_and_dtype_matches_torch(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for numel in (SMALL, LARGE):
            for op, dtype in CASES:
                t = _input(g.rank, numel, dtype, op)
                assert await all_reduce(t, op=op, group=g) is t
                outs.append(t)
        return outs

    with anyio.fail_after(60):
        results = await run_ranks(server.address, world_size, body)
    i = 0
    for numel in (SMALL, LARGE):
        for op, dtype in CASES:
            expected = _reference(op, [_input(r, numel, dtype, op) for r in range(world_size)])
            torch.testing.assert_close(results[0][i], expected, msg=f"{op} {dtype} {numel}")
            for r in range(1, world_size):
                assert torch.equal(results[r][i], results[0][i]), f"rank {r}: {op} {dtype}"
            i += 1


@pytest.mark.parametrize("world_size", [2, 3])
async def test_all_reduce_float_sums_are_bitwise_identical_on_every_rank(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(g.rank)
        xs = [torch.randn(n, generator=gen) * 1e3 for n in (SMALL, LARGE)]
        for x in xs:
            await all_reduce(x, op="SUM", group=g)
        return xs

    with anyio.fail_after(30):
        results = await run_ranks(server.address, world_size, body)
    for r in range(1, world_size):
        for a, b in zip(results[0], results[r], strict=True):
            assert torch.equal(a, b)


def _odd_shapes(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(shape, generator=gen) * 1e3 for shape in [(), (2, 3), (4, 1, 2)]]
    # Contiguous to torch, with a stride of 7 on its dimension of size 1.
    xs.append(torch.randn(5, generator=gen).as_strided((1, 5), (7, 1)))
    return xs


@pytest.mark.parametrize("world_size", [2, 4])  # one round; through group rank 0
async def test_small_all_reduce_keeps_shapes_and_sums_in_rank_order(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        xs = _odd_shapes(g.rank)
        for x in xs:
            assert x.is_contiguous()
            assert await all_reduce(x, group=g) is x
        return xs

    with anyio.fail_after(30):
        results = await run_ranks(server.address, world_size, body)
    inputs = [_odd_shapes(r) for r in range(world_size)]
    for i in range(len(inputs[0])):
        expected = functools.reduce(torch.add, [xs[i] for xs in inputs])  # rank 0 first
        for r in range(world_size):
            assert results[r][i].shape == inputs[0][i].shape
            assert torch.equal(results[r][i], expected), f"rank {r}, tensor {i}"


ALGORITHM_CASES = [
    ("sum", torch.float32),
    ("max", torch.int64),
    ("product", torch.float64),
    ("bor", torch.bool),
    ("mean", torch.bfloat16),
]


def _hosts(world_size: int, same_host: bool) -> list[str]:
    # Ranks that claim different hosts cannot share memory: they use the ring over TCP.
    return ["node"] * world_size if same_host else [f"node-{r}" for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(
    ("numel", "same_host", "algorithm"),
    [
        (6_000, True, "recursive_doubling"),  # float32: 24 KB, between direct and ring
        (300_001, True, "shared_memory"),  # float32: 1.2 MB, chunks of unequal size
        (300_001, False, "ring"),
    ],
)
async def test_all_reduce_each_algorithm_matches_torch(
    server: RendezvousServer, world_size: int, numel: int, same_host: bool, algorithm: str
) -> None:
    if world_size > 1:
        chosen = schedules.all_reduce_algorithm(
            4 * numel, numel, world_size, shared_memory=same_host
        )
        assert chosen == algorithm

    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for op, dtype in ALGORITHM_CASES:
            t = _input(g.rank, numel, dtype, op, seed=1)
            assert await all_reduce(t, op=op, group=g) is t
            outs.append(t)
        return outs

    with anyio.fail_after(60):
        results = await run_ranks(
            server.address, world_size, body, hostnames=_hosts(world_size, same_host)
        )
    for i, (op, dtype) in enumerate(ALGORITHM_CASES):
        expected = _reference(op, [_input(r, numel, dtype, op, seed=1) for r in range(world_size)])
        torch.testing.assert_close(results[0][i], expected, msg=f"{op} {dtype}")
        for r in range(1, world_size):
            assert torch.equal(results[r][i], results[0][i]), f"rank {r}: {op} {dtype}"
    assert not glob.glob(f"/dev/shm/{shm.segment_prefix()}*"), "shared segments left behind"


@pytest.mark.parametrize("same_host", [True, False], ids=["shared_memory", "ring"])
async def test_all_reduce_64_mib_float32(server: RendezvousServer, same_host: bool) -> None:
    numel = 16 * 1024 * 1024

    async def body(g: ProcessGroup) -> bool:
        t = torch.full((numel,), float(g.rank + 1))
        t[g.rank] = 100.0
        await all_reduce(t, group=g)
        expected = torch.full((numel,), 3.0)
        expected[0] = 102.0
        expected[1] = 101.0
        return torch.equal(t, expected)

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body, hostnames=_hosts(2, same_host))
    assert outs == [True, True]


async def test_all_reduce_shared_memory_reuses_and_grows_its_segment(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for numel in (300_000, 300_000, 700_000, 300_000):  # reuse, grow, reuse the larger
            t = torch.full((numel,), float(g.rank + 1), dtype=torch.float64)
            await all_reduce(t, group=g)
            outs.append(t)
        return outs

    with anyio.fail_after(30):
        results = await run_ranks(server.address, 3, body, hostnames=_hosts(3, True))
    for outs in results:
        assert [t.numel() for t in outs] == [300_000, 300_000, 700_000, 300_000]
        assert all(torch.equal(t, torch.full_like(t, 6.0)) for t in outs)
    assert not glob.glob(f"/dev/shm/{shm.segment_prefix()}*"), "shared segments left behind"


async def test_all_gather_outputs_reused_once_dropped_never_while_held(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> tuple[bool, bool]:
        t = torch.full((1 << 17,), float(g.rank))  # 512 KiB: 1 MiB of outputs, kept
        held = await all_gather(t, group=g)
        second = await all_gather(t, group=g)  # the first are held: new memory
        fresh = second[0].data_ptr() != held[0].data_ptr()
        ptr = second[0].data_ptr()
        del second
        third = await all_gather(t, group=g)  # the second were dropped: their memory again
        right = all(torch.equal(x, torch.full_like(x, float(r))) for r, x in enumerate(third))
        return fresh, third[0].data_ptr() == ptr and right

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [(True, True)] * 2


async def test_all_reduce_non_contiguous_is_copied_back(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> torch.Tensor:
        base = torch.arange(12, dtype=torch.float64).reshape(3, 4) * (g.rank + 1)
        t = base.t()
        assert not t.is_contiguous()
        assert await all_reduce(t, op="max", group=g) is t
        return base

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 3, body)
    for out in outs:
        torch.testing.assert_close(out, torch.arange(12, dtype=torch.float64).reshape(3, 4) * 3)


async def test_tensors_that_require_grad_are_reduced_and_moved_in_place(
    server: RendezvousServer,
) -> None:
    # Parameters, and DDP's buckets under create_graph. Before: "add(): functions with
    # out=... arguments don't support automatic differentiation", and the group broke.
    async def body(g: ProcessGroup) -> list[Any]:
        def param(value: float, n: int = 2) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.full((n,), value))

        summed, big = param(g.rank + 1.0), param(g.rank + 1.0, 100_000)
        await all_reduce(summed, group=g)
        await all_reduce(big, op="max", group=g)  # the socket algorithms' kernels too
        root = param(g.rank + 1.0)
        await broadcast(root, src=1, group=g)
        gathered: list[torch.Tensor] = [param(0.0) for _ in range(g.world_size)]
        await all_gather(gathered, param(g.rank + 1.0), group=g)
        return [
            summed.tolist(),
            big[:2].tolist(),
            root.tolist(),
            [x.tolist() for x in gathered],
            summed.requires_grad,  # still the parameter it was
        ]

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 2, body)
    for out in outs:
        assert out == [[3.0, 3.0], [2.0, 2.0], [2.0, 2.0], [[1.0, 1.0], [2.0, 2.0]], True]


async def test_sparse_all_reduce_sums_into_the_tensor_alike_on_every_rank(
    server: RendezvousServer,
) -> None:
    # DDP's gradients of a sparse embedding on the aiodist backend. Before: refused ("must
    # be a dense (strided) tensor") unless gloo carried the group's CPU tensors.
    async def body(g: ProcessGroup) -> list[Any]:
        rows = torch.tensor([[g.rank, 5, 5 + g.rank]])  # ranks overlap on row 5
        values = torch.tensor([1.0, 2.0, 0.5]) * (g.rank + 1)
        t = torch.sparse_coo_tensor(rows, values, (9,), check_invariants=True)
        same = await all_reduce(t, group=g)
        return [same is t, t.is_sparse, t.to_dense().tolist()]

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 3, body)
    dense = torch.zeros(9)
    for r in range(3):
        for row, value in zip([r, 5, 5 + r], [1.0, 2.0, 0.5], strict=True):
            dense[row] += value * (r + 1)
    assert outs == [[True, True, dense.tolist()]] * 3


async def test_many_all_reduces_in_flight_complete_in_any_await_order(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        tensors = [torch.full((i % 7 + 1,), float(i * (g.rank + 1))) for i in range(50)]
        tensors[10] = torch.full((20_000,), float(g.rank))  # one on the ring path
        works = [all_reduce(t, group=g) for t in tensors]
        order = list(range(50))
        random.Random(g.rank).shuffle(order)
        for i in order:
            assert await works[i] is tensors[i]
        return tensors

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 3, body)
    for out in outs:
        for i, t in enumerate(out):
            expected = 3.0 if i == 10 else float(i * 6)
            assert torch.equal(t, torch.full_like(t, expected)), i


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
async def test_broadcast_from_every_root(server: RendezvousServer, world_size: int) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for root in range(g.world_size):
            t = torch.full((5, 3), float(g.rank * 10 + root))
            assert await broadcast(t, src=root, group=g) is t
            outs.append(t)
        big = torch.arange(LARGE, dtype=torch.int64) * (g.rank + 1)
        await broadcast(big, src=g.world_size - 1, group=g)
        outs.append(big)
        return outs

    with anyio.fail_after(20):
        results = await run_ranks(server.address, world_size, body)
    for out in results:
        for root in range(world_size):
            assert torch.equal(out[root], torch.full((5, 3), float(root * 10 + root)))
        assert torch.equal(out[-1], torch.arange(LARGE, dtype=torch.int64) * world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
async def test_reduce_to_every_root_leaves_others_unchanged(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for root in range(g.world_size):
            for op in ("sum", "max", "mean"):
                t = _input(g.rank, SMALL, torch.float64, op, seed=root)
                await reduce(t, dst=root, op=op, group=g)
                outs.append(t)
        return outs

    with anyio.fail_after(20):
        results = await run_ranks(server.address, world_size, body)
    for rank, out in enumerate(results):
        i = 0
        for root in range(world_size):
            for op in ("sum", "max", "mean"):
                xs = [_input(r, SMALL, torch.float64, op, seed=root) for r in range(world_size)]
                expected = _reference(op, xs) if rank == root else xs[rank]
                torch.testing.assert_close(out[i], expected)
                i += 1


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
async def test_all_gather_and_gather_in_rank_order(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        t = torch.arange(6, dtype=torch.int32).reshape(2, 3) + 100 * g.rank
        everyone = await all_gather(t, group=g)
        gathered = [await gather(t, dst=root, group=g) for root in range(g.world_size)]
        return everyone, gathered

    with anyio.fail_after(20):
        results = await run_ranks(server.address, world_size, body)
    expected = [
        torch.arange(6, dtype=torch.int32).reshape(2, 3) + 100 * r for r in range(world_size)
    ]
    for rank, (everyone, gathered) in enumerate(results):
        assert len(everyone) == world_size
        assert all(torch.equal(a, b) for a, b in zip(everyone, expected, strict=True))
        for root in range(world_size):
            if rank == root:
                assert len(gathered[root]) == world_size
                assert all(torch.equal(a, b) for a, b in zip(gathered[root], expected, strict=True))
            else:
                assert gathered[root] == []


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
async def test_scatter_from_every_root(server: RendezvousServer, world_size: int) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for root in range(g.world_size):
            parts = [torch.full((4,), float(root * 100 + i)) for i in range(g.world_size)]
            t = torch.zeros(4)
            await scatter(t, parts if g.rank == root else None, src=root, group=g)
            outs.append(t)
        return outs

    with anyio.fail_after(20):
        results = await run_ranks(server.address, world_size, body)
    for rank, out in enumerate(results):
        for root in range(world_size):
            assert torch.equal(out[root], torch.full((4,), float(root * 100 + rank)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
async def test_reduce_scatter_reduces_each_slot(server: RendezvousServer, world_size: int) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for op in ("sum", "min", "bxor"):
            inputs = [_input(g.rank, SMALL, torch.int64, op, seed=i) for i in range(g.world_size)]
            outs.append(await reduce_scatter(inputs, op=op, group=g))
        return outs

    with anyio.fail_after(20):
        results = await run_ranks(server.address, world_size, body)
    for rank, out in enumerate(results):
        for i, op in enumerate(("sum", "min", "bxor")):
            xs = [_input(r, SMALL, torch.int64, op, seed=rank) for r in range(world_size)]
            assert torch.equal(out[i], _reference(op, xs)), op


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
async def test_all_to_all_with_sizes_per_pair(server: RendezvousServer, world_size: int) -> None:
    def block(src: int, dst: int) -> torch.Tensor:
        return torch.full((src + dst, 2), float(src * 10 + dst))  # (0, 2) for 0 -> 0

    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        return await all_to_all([block(g.rank, d) for d in range(g.world_size)], group=g)

    with anyio.fail_after(20):
        results = await run_ranks(server.address, world_size, body)
    for rank, out in enumerate(results):
        assert len(out) == world_size
        for src in range(world_size):
            assert torch.equal(out[src], block(src, rank))


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
async def test_barrier_waits_for_the_last_rank(server: RendezvousServer, world_size: int) -> None:
    arrived: list[int] = []
    passed: list[int] = []

    async def body(g: ProcessGroup) -> None:
        if g.rank == g.world_size - 1:
            for _ in range(20):
                await anyio.lowlevel.checkpoint()  # let the others reach the barrier first
        arrived.append(g.rank)
        await barrier(group=g)
        passed.append(len(arrived))
        await barrier(group=g)

    with anyio.fail_after(20):
        await run_ranks(server.address, world_size, body)
    assert passed == [world_size] * world_size


MISMATCHES: list[tuple[str, Callable[[ProcessGroup], Any]]] = [
    (
        "dtype",
        lambda g: all_reduce(
            torch.ones(4, dtype=torch.float64 if g.rank else torch.float32), group=g
        ),
    ),
    ("shape", lambda g: all_reduce(torch.ones(4 + (g.rank == 1)), group=g)),
    ("reduce_op", lambda g: all_reduce(torch.ones(4), op="max" if g.rank == 1 else "sum", group=g)),
    ("shape", lambda g: all_reduce(torch.ones(100_000 + (g.rank == 1)), group=g)),
    ("shape", lambda g: all_reduce(torch.ones(300_000 + (g.rank == 1)), group=g)),  # shared memory
    (  # 800 KB and 1.6 MB: one side of the shared-memory threshold each, two algorithms
        "dtype",
        lambda g: all_reduce(
            torch.ones(200_000, dtype=torch.float64 if g.rank else torch.float32), group=g
        ),
    ),
    (
        "dtype",
        lambda g: all_gather(
            torch.ones(100_000, dtype=torch.float64 if g.rank else torch.float32), group=g
        ),
    ),
    ("root", lambda g: broadcast(torch.ones(4), src=min(g.rank, 1), group=g)),
    # 1.2 MB on rank 0 (shared memory), 800 KB elsewhere (the tree)
    ("shape", lambda g: broadcast(torch.ones(200_000 if g.rank else 300_000), src=0, group=g)),
    ("root", lambda g: reduce(torch.ones(4), dst=min(g.rank, 1), group=g)),
    ("root", lambda g: gather(torch.ones(4), dst=min(g.rank, 1), group=g)),
    (
        "dtype",
        lambda g: all_gather(torch.ones(4, dtype=torch.int32 if g.rank else torch.int64), group=g),
    ),
    ("op", lambda g: barrier(group=g) if g.rank == 1 else all_reduce(torch.ones(1), group=g)),
]


# 2 and 3 ranks swap in one round; 5 go through rank 0 (exchange_rows' star).
@pytest.mark.parametrize("world_size", [2, 3, 5])
@pytest.mark.parametrize(("field", "call"), MISMATCHES)
async def test_mismatch_raises_on_every_rank_and_breaks_group(
    server: RendezvousServer, world_size: int, field: str, call: Callable[[ProcessGroup], Any]
) -> None:
    async def body(g: ProcessGroup) -> str:
        with pytest.raises(CollectiveMismatchError) as info:
            await call(g)
        with pytest.raises(CollectiveMismatchError):
            await all_reduce(torch.ones(1), group=g)  # the group stays broken
        return info.value.field

    with anyio.fail_after(20):
        fields = await run_ranks(server.address, world_size, body)
    assert fields == [field] * world_size


async def test_bad_arguments_on_a_broken_group_are_said_before_the_break(
    server: RendezvousServer,
) -> None:
    # torch raises a bad argument whatever the group's state; the break comes after.
    async def body(g: ProcessGroup) -> None:
        g.break_(GroupBrokenError("broken for the test"), notify=False)
        with pytest.raises(ValueError, match="does not support max on complex"):
            all_reduce(torch.ones(2, dtype=torch.complex64), op="max", group=g)
        with pytest.raises(GroupBrokenError, match="broken for the test"):
            all_reduce(torch.ones(2), group=g)

    with anyio.fail_after(10):
        await run_ranks(server.address, 2, body)


async def test_bad_arguments_raise_before_sending(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> torch.Tensor:
        with pytest.raises(TypeError, match=r"torch\.Tensor"):
            all_reduce([1.0, 2.0], group=g)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unsupported reduce op"):
            all_reduce(torch.ones(2), op="median", group=g)
        with pytest.raises(TypeError, match="op must be"):
            all_reduce(torch.ones(2), op=3, group=g)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="integer or bool"):
            all_reduce(torch.ones(2), op="bxor", group=g)
        with pytest.raises(ValueError, match=r"dst=\d+ is not a member"):
            reduce(torch.ones(2), dst=g.world_size, group=g)
        with pytest.raises(TypeError, match="src must be an int"):
            broadcast(torch.ones(2), src="0", group=g)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="must be specified on source rank"):
            scatter(torch.ones(2), None, src=g.rank, group=g)
        with pytest.raises(ValueError, match="must NOT be specified on non-source"):
            scatter(torch.ones(2), [torch.ones(2)] * 2, src=1 - g.rank, group=g)
        with pytest.raises(ValueError, match="scatter_list\\[1\\]"):
            scatter(torch.ones(2), [torch.ones(2), torch.ones(3)], src=g.rank, group=g)
        with pytest.raises(ValueError, match="one tensor per rank"):
            reduce_scatter([torch.ones(2)] * 3, group=g)
        with pytest.raises(ValueError, match="one dtype"):
            all_to_all([torch.ones(1), torch.ones(1, dtype=torch.int32)], group=g)
        with pytest.raises(TypeError, match="list of tensors"):
            all_to_all(torch.ones(2), group=g)  # type: ignore[arg-type]
        sparse = torch.sparse_coo_tensor(
            torch.tensor([[0]]), torch.ones(1), (2,), check_invariants=True
        )
        with pytest.raises(ValueError, match=r"sparse tensor sums CPU tensors only .*op=max"):
            all_reduce(sparse, op="max", group=g)  # gloo's sparse all_reduce sums only
        with pytest.raises(ValueError, match=r"sparse_coo .*only all_reduce takes sparse"):
            broadcast(sparse, src=0, group=g)
        # Nothing was sent and no sequence number was used: the group still works.
        t = torch.ones(2)
        return await all_reduce(t, group=g)

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 2, body)
    for out in outs:
        assert torch.equal(out, torch.full((2,), 2.0))


def test_not_initialised_returns_mmengine_non_distributed_results() -> None:
    t = torch.arange(3.0)
    assert all_reduce(t, op="mean").result() is t
    assert torch.equal(t, torch.arange(3.0))
    assert reduce(t, dst=0).result() is t
    assert broadcast(t, src=0).result() is t
    assert all_gather(t).result() == [t]
    assert gather(t).result() == [t]
    data = torch.zeros(3)
    assert scatter(data, [torch.ones(3)], src=0).result() is data
    assert torch.equal(data, torch.ones(3))
    with pytest.raises(ValueError, match="must be specified on source rank"):
        scatter(data, src=0)  # as torch.distributed
    inputs = [torch.ones(1), torch.zeros(1)]
    assert reduce_scatter(inputs).result() is inputs[0]
    assert all_to_all(inputs).result() == inputs
    assert barrier().result() is None
    ints = torch.tensor([3, -3], dtype=torch.int32)
    assert all_reduce(ints, op="mean").result() is ints  # mmengine's: world size 1 does nothing
    assert ints.tolist() == [3, -3]


async def test_barrier_and_small_all_reduce_beyond_the_direct_group_size(
    server: RendezvousServer,
) -> None:
    world_size = schedules.DIRECT_MAX_RANKS + 1  # dissemination and folded recursive doubling
    assert schedules.all_reduce_algorithm(4, 1, world_size) == "recursive_doubling"

    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for i in range(3):
            await barrier(group=g)
            t = torch.tensor([float(g.rank + i)])
            await all_reduce(t, op="max" if i else "sum", group=g)
            outs.append(t)
        return outs

    with anyio.fail_after(60):
        results = await run_ranks(server.address, world_size, body)
    total = float(sum(range(world_size)))
    for outs in results:
        assert [float(t) for t in outs] == [total, world_size, world_size + 1.0]


def _settle_with_bytes(work: Work[bytes], staging: memoryview) -> None:
    work.set_result(bytes(staging))


@pytest.mark.parametrize(
    "world_size",
    [
        ONE_ROUND_MAX_RANKS,  # everyone with everyone
        ONE_ROUND_MAX_RANKS + 1,  # through rank 0
        7,
        STAR_MAX_RANKS,
        STAR_MAX_RANKS + 1,  # in log2(size) rounds
        STAR_MAX_RANKS + 3,
    ],
)
async def test_exchange_rows_puts_every_rank_row_in_its_place(
    server: RendezvousServer, world_size: int
) -> None:
    # In one round, through rank 0 or forwarded in rounds: each row must land in its
    # sender's place on every rank, whatever the size, call after call.
    async def body(g: ProcessGroup) -> list[bytes]:
        rows = []
        for call in range(3):
            seq = g.take_seq()
            work = g.begin(f"rows#{call}", seq=seq)
            mine = bytes([g.rank, call, 7 * g.rank % 256])
            done = functools.partial(_settle_with_bytes, work)
            ex = Exchange(g, work, seq, signature("rows"), rides=True)
            exchange_rows(ex, memoryview(mine), done)
            rows.append(await work)
        return rows

    with anyio.fail_after(30):
        results = await run_ranks(server.address, world_size, body)
    for call in range(3):
        expected = b"".join(bytes([r, call, 7 * r % 256]) for r in range(world_size))
        assert [rows[call] for rows in results] == [expected] * world_size


@pytest.mark.parametrize("world_size", [4, 6, 7, 8])
async def test_small_all_reduce_and_barrier_in_rounds_match_torch(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for op in ("sum", "max", "min", "product", "mean"):
            await barrier(group=g)
            t = torch.tensor([2.0**g.rank, -float(g.rank), 1.0 + g.rank / 8])
            await all_reduce(t, op=op, group=g)
            outs.append(t)
        return outs

    with anyio.fail_after(30):
        results = await run_ranks(server.address, world_size, body)
    inputs = torch.stack(
        [torch.tensor([2.0**r, -float(r), 1.0 + r / 8]) for r in range(world_size)]
    )
    expected = [inputs.sum(0), inputs.amax(0), inputs.amin(0), inputs.prod(0), inputs.mean(0)]
    for outs in results:
        for got, want in zip(outs, expected, strict=True):
            torch.testing.assert_close(got, want)
    for outs in results[1:]:  # the same bits everywhere
        assert all(torch.equal(a, b) for a, b in zip(outs, results[0], strict=True))


async def test_shared_memory_all_reduces_in_flight_together(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        tensors = [torch.full((300_000,), float((g.rank + 1) * (i + 1))) for i in range(4)]
        works = [all_reduce(t, group=g) for t in tensors]  # all started before any await
        for w in reversed(works):
            await w
        return tensors

    with anyio.fail_after(30):
        results = await run_ranks(server.address, 3, body, hostnames=_hosts(3, True))
    for outs in results:
        for i, t in enumerate(outs):
            assert torch.equal(t, torch.full_like(t, 6.0 * (i + 1))), i


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("same_host", [True, False], ids=["shared_memory", "tree"])
async def test_large_broadcast_from_every_root(
    server: RendezvousServer, world_size: int, same_host: bool
) -> None:
    numel = 300_001  # float64: 2.4 MB, over the shared-memory threshold

    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for root in range(world_size):
            t = torch.full((numel,), float(g.rank), dtype=torch.float64)
            t[-1] = -1.0 - g.rank
            assert await broadcast(t, src=root, group=g) is t
            outs.append(t)
        return outs

    with anyio.fail_after(60):
        results = await run_ranks(
            server.address, world_size, body, hostnames=_hosts(world_size, same_host)
        )
    for outs in results:
        for root, t in enumerate(outs):
            assert torch.equal(t[:-1], torch.full((numel - 1,), float(root), dtype=torch.float64))
            assert float(t[-1]) == -1.0 - root
    assert not glob.glob(f"/dev/shm/{shm.segment_prefix()}*"), "shared segments left behind"


async def test_shared_memory_broadcasts_and_all_reduces_take_turns(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        a = torch.full((400_000,), float(g.rank))
        b = torch.full((300_000,), float(g.rank + 1))
        c = torch.full((500_000,), float(g.rank) * 10)
        # Broadcasts run a task inside their operation, all_reduce does not: turns are
        # still taken in call order, the same on every rank.
        works = [broadcast(a, src=1, group=g), all_reduce(b, group=g), broadcast(c, src=2, group=g)]
        for w in reversed(works):
            await w
        return [a, b, c]

    with anyio.fail_after(30):
        results = await run_ranks(server.address, 3, body, hostnames=_hosts(3, True))
    for a, b, c in results:
        assert torch.equal(a, torch.full_like(a, 1.0))
        assert torch.equal(b, torch.full_like(b, 6.0))
        assert torch.equal(c, torch.full_like(c, 20.0))
