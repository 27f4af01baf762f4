"""Object collectives with the real in-process server and several real clients."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest
import torch

from aiodist import CollectiveMismatchError, ProcessGroup, RendezvousServer
from aiodist._ops.collect import collect_results, sync_random_seed
from aiodist._ops.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from aiodist._ops.tensor_groups import all_reduce_dict, all_reduce_params
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from aiodist._group.work import Work


class Point:
    """A custom class: travels by pickle."""

    def __init__(self, x: int, label: str) -> None:
        self.x = x
        self.label = label

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.label) == (other.x, other.label)

    __hash__ = None  # type: ignore[assignment]


BLOB = bytes(range(256)) * 4096  # 1 MiB


def _obj(rank: int) -> Any:
    """A different kind (and size) of object per rank."""
    kinds: list[Any] = [
        {"rank": rank, "name": "r" * rank, "nested": [1, (2, 3), {"k": None}]},
        "x" * (rank * 1000 + 1),
        [(rank, "a"), [rank, [rank, (rank,)]]],
        np.arange(rank * 7, dtype=np.float32).reshape(-1, 7) if rank else np.zeros(3),
        torch.arange(rank * 5 + 1, dtype=torch.int64),
        Point(rank, f"p{rank}"),
        None,
        BLOB + bytes([rank]),
    ]
    return kinds[rank % len(kinds)]


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        assert a == b


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
async def test_all_gather_object_returns_every_rank_in_order(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> list[Any]:
        return await all_gather_object(_obj(g.rank), group=g)

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, world_size, body)
    for out in outs:
        assert len(out) == world_size
        for r, item in enumerate(out):
            _assert_same(item, _obj(r))


async def test_all_gather_object_many_kinds_on_one_rank(server: RendezvousServer) -> None:
    # Eight ranks cover every kind of _obj, including the 1 MiB blob, in one gather.
    async def body(g: ProcessGroup) -> list[Any]:
        return await all_gather_object(_obj(g.rank), group=g)

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 8, body)
    for out in outs:
        for r, item in enumerate(out):
            _assert_same(item, _obj(r))


async def test_many_gathers_in_flight_awaited_in_random_order(server: RendezvousServer) -> None:
    count = 20

    async def body(g: ProcessGroup) -> list[list[Any]]:
        works = [
            all_gather_object({"i": i, "r": g.rank, "pad": "z" * i * g.rank}, group=g)
            for i in range(count)
        ]
        order = list(range(count))
        random.Random(g.rank).shuffle(order)
        outs: dict[int, list[Any]] = {}
        for i in order:
            outs[i] = await works[i]
        return [outs[i] for i in range(count)]

    with anyio.fail_after(20):
        results = await run_ranks(server.address, 3, body)
    for per_rank in results:
        for i, out in enumerate(per_rank):
            assert out == [{"i": i, "r": r, "pad": "z" * i * r} for r in range(3)]


@pytest.mark.parametrize(("world_size", "dst"), [(1, 0), (3, 0), (3, 2), (5, 3)])
async def test_gather_object_list_on_dst_none_elsewhere(
    server: RendezvousServer, world_size: int, dst: int
) -> None:
    async def body(g: ProcessGroup) -> list[Any] | None:
        return await gather_object(_obj(g.rank), dst=dst, group=g)

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, world_size, body)
    for rank, out in enumerate(outs):
        if rank != dst:
            assert out is None
            continue
        assert out is not None
        assert len(out) == world_size
        for r, item in enumerate(out):
            _assert_same(item, _obj(r))


@pytest.mark.parametrize(("world_size", "src"), [(1, 0), (2, 1), (5, 0), (5, 3)])
async def test_broadcast_object_list_in_place(
    server: RendezvousServer, world_size: int, src: int
) -> None:
    expected = [{"cfg": [1, 2]}, Point(7, "seven"), BLOB, (1, "a")]

    async def body(g: ProcessGroup) -> tuple[bool, list[Any]]:
        data: list[Any] = list(expected) if g.rank == src else [None, g.rank, "junk", 0]
        out = await broadcast_object_list(data, src=src, group=g)
        return out is data, data

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, world_size, body)
    for same, data in outs:
        assert same
        assert data == expected
        assert type(data[3]) is tuple


@pytest.mark.parametrize(("world_size", "src"), [(1, 0), (3, 1), (5, 4)])
async def test_scatter_object_list_gives_rank_its_item(
    server: RendezvousServer, world_size: int, src: int
) -> None:
    async def body(g: ProcessGroup) -> Any:
        items = [_obj(r) for r in range(world_size)] if g.rank == src else None
        out: list[Any] = [None]
        got = await scatter_object_list(out, items, src=src, group=g)  # torch's form
        assert got is out[0]
        return got

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, world_size, body)
    for r, out in enumerate(outs):
        _assert_same(out, _obj(r))


@pytest.mark.parametrize(("world_size", "size"), [(1, 4), (3, 10), (3, 12), (5, 7), (4, 0)])
async def test_collect_results_interleaves_and_truncates(
    server: RendezvousServer, world_size: int, size: int
) -> None:
    # A distributed sampler pads to a multiple of world_size; rank r holds r, r+n, ...
    padded = -(-size // world_size) * world_size if size else world_size
    per_rank = [
        [f"s{i % max(size, 1)}" for i in range(r, padded, world_size)] for r in range(world_size)
    ]

    async def body(g: ProcessGroup) -> list[Any] | None:
        device = "gpu" if g.rank % 2 else "cpu"
        return await collect_results(per_rank[g.rank], size, device=device, group=g)

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, world_size, body)
    reference: list[Any] = []
    for res in zip(*per_rank, strict=False):
        reference.extend(res)
    assert outs[0] == reference[:size]
    assert outs[0] == [f"s{i}" for i in range(size)]
    assert all(out is None for out in outs[1:])


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("world_size", [2, 3])
async def test_all_reduce_dict_matches_reference(
    server: RendezvousServer, world_size: int, op: str
) -> None:
    def make(rank: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(rank)
        data = {
            "loss": torch.rand((), generator=gen),
            "acc": torch.rand(2, 3, generator=gen, dtype=torch.float64),
            "b": torch.rand(4, generator=gen),
        }
        if op == "sum":  # mean needs floating dtypes
            data["count"] = torch.tensor([rank + 1, 10 * rank], dtype=torch.int64)
        return data

    async def body(g: ProcessGroup) -> tuple[bool, dict[str, torch.Tensor]]:
        data = make(g.rank)
        originals = dict(data)
        out = await all_reduce_dict(data, op=op, group=g)
        # In place: the same dict, the same tensor objects.
        return out is data and all(data[k] is originals[k] for k in data), data

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, world_size, body)
    inputs = [make(r) for r in range(world_size)]
    for same, data in outs:
        assert same
        assert sorted(data) == sorted(inputs[0])
        for k in ("loss", "acc", "b"):
            ref = torch.stack([d[k] for d in inputs]).sum(0)
            if op == "mean":
                ref = ref / world_size
            torch.testing.assert_close(data[k], ref)
        if op == "sum":
            ref_count = sum(d["count"] for d in inputs)
            torch.testing.assert_close(data["count"], ref_count)


@pytest.mark.parametrize(
    ("coalesce", "bucket_size_mb", "op"),
    [(True, -1, "sum"), (True, 1, "mean"), (False, -1, "max")],
)
async def test_all_reduce_params_matches_reference(
    server: RendezvousServer,
    coalesce: bool,
    bucket_size_mb: int,
    op: str,
) -> None:
    world_size = 3

    def make(rank: int) -> list[torch.nn.Parameter]:
        gen = torch.Generator().manual_seed(100 + rank)
        shapes = [(3, 4), (300_000,), (5,), (2, 2)]  # the big one crosses a 1 MiB bucket
        return [torch.nn.Parameter(torch.rand(s, generator=gen)) for s in shapes]

    async def body(g: ProcessGroup) -> list[torch.Tensor]:
        params = make(g.rank)
        work: Work[Any] = all_reduce_params(
            iter(params), coalesce=coalesce, bucket_size_mb=bucket_size_mb, op=op, group=g
        )
        result = await work
        assert result is None
        return [p.detach().clone() for p in params]

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, world_size, body)
    inputs = [make(r) for r in range(world_size)]
    for i in range(4):
        stacked = torch.stack([ps[i].detach() for ps in inputs])
        if op == "sum":
            ref = stacked.sum(0)
        elif op == "mean":
            ref = stacked.sum(0) / world_size
        else:
            ref = stacked.max(0).values
        for out in outs:
            torch.testing.assert_close(out[i], ref)


@pytest.mark.parametrize("world_size", [2, 5])
async def test_sync_random_seed_is_equal_on_all_ranks(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> list[int]:
        return [await sync_random_seed(group=g) for _ in range(3)]

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, world_size, body)
    assert all(out == outs[0] for out in outs)
    for seed in outs[0]:
        assert isinstance(seed, int)
        assert 0 <= seed < 2**31
    assert len(set(outs[0])) > 1  # fresh draws, not a constant


@pytest.mark.parametrize(
    "start",
    [
        lambda g: gather_object(g.rank, dst=0 if g.rank == 0 else 1, group=g),
        lambda g: broadcast_object_list([g.rank], src=0 if g.rank == 0 else 1, group=g),
        lambda g: scatter_object_list(
            [None], list(range(g.world_size)), src=0 if g.rank == 0 else 1, group=g
        ),
        lambda g: broadcast_object_list([1] * (1 + (g.rank == 2)), src=0, group=g),
        lambda g: all_gather_object(1, group=g) if g.rank else gather_object(1, dst=0, group=g),
    ],
    ids=["gather-dst", "broadcast-src", "scatter-src", "broadcast-len", "op"],
)
# At 5 ranks the opening of a one-way call goes through group rank 0: the others learn
# of the disagreement from its notice, and a rank that raised it and left at once must
# not be what a rank still waiting hears instead ("rank r left the job").
@pytest.mark.parametrize("world_size", [3, 5])
async def test_disagreement_raises_mismatch_on_every_rank(
    server: RendezvousServer, start: Any, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> tuple[str, CollectiveMismatchError | None]:
        work: Work[Any] = start(g)
        try:
            await work
        except CollectiveMismatchError as exc:
            return "op", exc
        # This rank's peers agreed with it, so its part finished before the error
        # reached it; the group is broken all the same, for its next call.
        try:
            await all_gather_object(None, group=g)
        except CollectiveMismatchError as exc:
            return "next", exc
        return "none", None

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, world_size, body, timeout=10)
    assert all(isinstance(exc, CollectiveMismatchError) for _, exc in outs), outs
    assert sum(where == "op" for where, _ in outs) >= 2, outs  # both sides of a disagreement
    assert {exc.field for _, exc in outs if exc is not None} <= {"root", "shape", "op"}


async def test_bad_arguments_raise_before_sending(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> list[str]:
        caught = []
        with pytest.raises(ValueError, match="3 ranks"):
            scatter_object_list([None], [1, 2], src=g.rank, group=g)
        caught.append("scatter-len")
        # mmengine asserts, torch raises TypeError: the error is both.
        with pytest.raises(AssertionError, match="must be a list") as info:
            broadcast_object_list((1, 2), src=0, group=g)  # type: ignore[arg-type]
        assert isinstance(info.value, TypeError)
        caught.append("broadcast-tuple")
        with pytest.raises(ValueError, match="is not a member"):
            gather_object(1, dst=3, group=g)
        with pytest.raises(TypeError, match="int rank"):
            gather_object(1, dst="0", group=g)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="unsupported reduce op 'median'"):
            all_reduce_dict({"a": torch.ones(1)}, op="median", group=g)
        with pytest.raises(AssertionError):  # as mmengine asserts
            all_reduce_dict([torch.ones(1)], group=g)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"torch\.Tensor"):
            all_reduce_dict({"a": 1.0}, group=g)  # type: ignore[dict-item]
        with pytest.raises(NotImplementedError, match="device"):  # as mmengine raises
            collect_results([], 0, device="tpu", group=g)
        # Nothing was sent: the next collective still pairs up on every rank.
        caught.extend(await all_gather_object(f"ok{g.rank}", group=g))
        return caught

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 3, body)
    for out in outs:
        assert out == ["scatter-len", "broadcast-tuple", "ok0", "ok1", "ok2"]


async def test_non_distributed_results() -> None:
    with anyio.fail_after(5):
        obj = {"a": [1, 2]}
        assert await all_gather_object(obj) == [obj]
        assert await gather_object(obj, dst=0) == [obj]
        data = [1, "b"]
        assert await broadcast_object_list(data) is data
        assert data == [1, "b"]
        slot: list[Any] = [None]
        assert await scatter_object_list(slot, [Point(1, "x")]) == Point(1, "x")
        assert slot == [Point(1, "x")]
        with pytest.raises(ValueError, match="the group has 1 rank;"):
            scatter_object_list([None], [1, 2])
        assert await collect_results([1, 2, 3, 4], 3) == [1, 2, 3]
        with pytest.raises(AssertionError, match="tmpdir should be None"):  # as mmengine
            collect_results([1, 2], 5, device="gpu", tmpdir="/nowhere")
        seeds = {await sync_random_seed() for _ in range(4)}
        assert all(isinstance(s, int) and 0 <= s < 2**31 for s in seeds)
        assert len(seeds) > 1
        tensors = {"x": torch.tensor([1.0, 2.0])}
        out = await all_reduce_dict(tensors, op="mean")
        assert out is tensors
        torch.testing.assert_close(tensors["x"], torch.tensor([1.0, 2.0]))
        param = torch.nn.Parameter(torch.ones(2))
        work: Work[Any] = all_reduce_params([param])
        assert await work is None
        torch.testing.assert_close(param.detach(), torch.ones(2))
