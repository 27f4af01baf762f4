"""A call that fails on one rank fails on every rank, at once, and never pairs with another call.

Real processes (``local_failure_worker.py``), the in-loop server: in each kind of
operation rank 1 fails on its own rank (an object that cannot be pickled, a bad
argument) while the other ranks are inside the same call, then every rank
makes a second call. The failed call must raise on every rank within seconds
(``AbortedError`` naming rank 1 on the others) and the second call must return
the second call's data only. The in-loop tests below pin down the mechanics.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
from aiodist import AbortedError, CollectiveMismatchError
from aiodist.testing import run_ranks
from tests.helpers import HELPERS
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from aiodist import ProcessGroup, RendezvousServer

WORKER = HELPERS / "local_failure_worker.py"
WORLD = 3
BOUND = 5.0  # seconds a scenario may take: the group's own timeout is 30 minutes


async def _run_job(
    server: RendezvousServer, mode: str, backend: tuple[str, dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    # The ranks run the loop the test runs (asyncio or uvloop), not both every time.
    loop = "uvloop" if "loop_factory" in backend[1] else "asyncio"
    outs: dict[int, dict[str, Any]] = {}

    async def one(rank: int) -> None:
        async with await open_process(
            [sys.executable, str(WORKER), mode, url, str(rank), str(WORLD)],
            env={**os.environ, "PYTHONPATH": str(WORKER.parent.parent), "WORKER_LOOP": loop},
        ) as proc:
            try:
                stdout = b"".join([chunk async for chunk in proc.stdout])  # type: ignore[union-attr]
                stderr = b"".join([chunk async for chunk in proc.stderr])  # type: ignore[union-attr]
                code = await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        lines = stdout.decode().strip().splitlines()
        assert code == 0, stderr.decode()
        assert lines, stderr.decode()
        outs[rank] = json.loads(lines[-1])

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for rank in range(WORLD):
                tg.start_soon(one, rank)
    return outs


# Bad arguments raise aiodist's subclasses of ValueError/TypeError (also the types
# torch and mmengine raise for them): a record names the class itself.
_KINDS = {
    "ValueError": ("ValueError", "ArgumentError"),
    "TypeError": ("TypeError", "ArgumentTypeError", "AssertedArgumentError"),
}


def _aborted_by_rank_1(record: list[Any], reason: str) -> None:
    kind, name, rank, message = record
    assert (kind, name, rank) == ("error", "AbortedError", 1), record
    assert "failed on rank 1" in message
    if reason in _KINDS:
        assert any(f"{r}:" in message for r in _KINDS[reason]), message
    else:
        assert reason in message, message


def _local(record: list[Any], name: str) -> None:
    assert record[0] == "error", record
    assert record[1] in _KINDS.get(name, (name,)), record


def _check_async(outs: dict[int, dict[str, Any]]) -> None:
    for rank, report in outs.items():
        for scenario, out in report.items():
            if out:
                assert out["seconds"] < BOUND, (rank, scenario, out)
    for rank in range(WORLD):
        obj = outs[rank]["object"]
        assert obj["second"] == ["ok", ["second-0", "second-1", "second-2"]]
        late = outs[rank]["object_late"]
        assert late["second"] == ["ok", ["second-0", "second-1", "second-2"]]
        assert outs[rank]["broadcast_object"]["second"] == ["ok", ["second-1"]]
        assert outs[rank]["tensor_small"]["second"] == ["ok", [303.0] * 4]
        assert outs[rank]["tensor_large"]["second"] == ["ok", float((10 + 11 + 12) * (1 << 20))]
        assert outs[rank]["tensor_rooted"]["second"] == ["ok", [21.0] * 3]
        assert outs[rank]["composite"]["second"] == ["ok", {"a": [6.0, 6.0]}]
        cancelled = outs[rank]["cancelled"]
        assert cancelled["second"] == ["ok", ["second-0", "second-1", "second-2"]]
        mismatch = outs[rank]["composite_mismatch"]
        assert mismatch["first"][1] == "CollectiveMismatchError", mismatch
        assert mismatch["seconds"] < BOUND
        new_group = outs[rank]["new_group"]
        assert new_group["group_id"] == outs[0]["new_group"]["group_id"]
        if rank != 1:
            assert new_group["second"] == ["ok", [4.0]]  # ranks 0 and 2: 1 + 3
            _aborted_by_rank_1(new_group["first"], "ValueError")
    for rank in (0, 2):
        report = outs[rank]
        _aborted_by_rank_1(report["object"]["first"], "cannot pickle")
        _aborted_by_rank_1(report["object_late"]["first"], "cannot pickle")
        _aborted_by_rank_1(report["broadcast_object"]["first"], "cannot pickle")
        _aborted_by_rank_1(report["tensor_small"]["first"], "TypeError")
        _aborted_by_rank_1(report["tensor_large"]["first"], "TypeError")
        _aborted_by_rank_1(report["tensor_rooted"]["first"], "ValueError")
        _aborted_by_rank_1(report["composite"]["first"], "TypeError")
        # Rank 1's cancelled wait did not cancel its call: the others got its part.
        assert report["cancelled"]["first"] == ["ok", ["first-0", "first-1", "first-2"]]
    one = outs[1]
    for scenario in ("object", "object_late", "broadcast_object"):
        _local(one[scenario]["first"], "TypeError")
    _local(one["tensor_small"]["first"], "TypeError")
    _local(one["tensor_large"]["first"], "TypeError")
    _local(one["tensor_rooted"]["first"], "ValueError")
    _local(one["composite"]["first"], "TypeError")
    _local(one["new_group"]["first"], "ValueError")
    _local(one["p2p_object"]["first"], "TypeError")
    _local(one["p2p_tensor"]["first"], "TypeError")
    _local(one["subgroup"]["first"], "TypeError")
    assert one["cancelled"]["first"] == ["cancelled", True, False]  # mid-call
    # Point-to-point: the receive that matched the failed send fails; the next one
    # gets the next send, and a receive that failed on its own rank still took its
    # message, so the one after it gets the second.
    zero = outs[0]
    _aborted_by_rank_1(zero["p2p_object"]["first"], "cannot pickle")
    assert zero["p2p_object"]["second"] == ["ok", "second"]
    _aborted_by_rank_1(zero["p2p_tensor"]["first"], "TypeError")
    assert zero["p2p_tensor"]["second_tensor"] == [7.0] * 3
    _local(zero["p2p_receive_fails"]["first"], "TypeError")
    assert zero["p2p_receive_fails"]["second_tensor"] == [2.0, 2.0]
    # A subgroup: its own members only.
    _aborted_by_rank_1(outs[2]["subgroup"]["first"], "cannot pickle")
    for rank in (1, 2):
        assert outs[rank]["subgroup"]["second"] == ["ok", ["second-1", "second-2"]]
    assert outs[0]["subgroup"] == {"seconds": outs[0]["subgroup"]["seconds"]}


@pytest.mark.slow
async def test_local_failure_in_every_kind_of_call_fails_it_everywhere_and_pairs_nothing(
    server: RendezvousServer, anyio_backend: tuple[str, dict[str, Any]]
) -> None:
    _check_async(await _run_job(server, "async", anyio_backend))


@pytest.mark.slow
async def test_local_failure_through_the_sync_facade(
    server: RendezvousServer, anyio_backend: tuple[str, dict[str, Any]]
) -> None:
    outs = await _run_job(server, "sync", anyio_backend)
    for rank in range(WORLD):
        for scenario, out in outs[rank].items():
            assert out["seconds"] < BOUND, (rank, scenario, out)
        both = ["ok", ["second-0", "second-1", "second-2"]]
        assert outs[rank]["object"]["second"] == both
        assert outs[rank]["object_async_op"]["second"] == both
        assert outs[rank]["tensor_small"]["second"] == ["ok", [303.0] * 4]
    for rank in (0, 2):
        for scenario in ("object", "object_async_op"):
            _aborted_by_rank_1(outs[rank][scenario]["first"], "cannot pickle")
        _aborted_by_rank_1(outs[rank]["tensor_small"]["first"], "TypeError")
    _local(outs[1]["object"]["first"], "TypeError")
    _local(outs[1]["object_async_op"]["first"], "TypeError")
    _aborted_by_rank_1(outs[0]["p2p_object"]["first"], "cannot pickle")
    assert outs[0]["p2p_object"]["second"] == ["ok", "second"]
    _aborted_by_rank_1(outs[2]["subgroup"]["first"], "cannot pickle")
    assert outs[2]["subgroup"]["second"] == ["ok", ["second-1", "second-2"]]


# --- the mechanics, in one loop ---------------------------------------------------------------


async def test_abort_that_arrives_before_the_call_fails_it_when_made(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> Any:
        await aiodist.barrier(group=g)  # connected: notices go out in order with data
        if g.rank == 1:
            with pytest.raises(TypeError, match="pickle"):
                aiodist.all_gather_object(threading.Lock(), group=g)
            await aiodist.isend_object("aborted", dst=0, group=g)  # after the notice
        else:
            assert await aiodist.irecv_object(src=1, group=g) == "aborted"
            with pytest.raises(AbortedError) as info:
                await aiodist.all_gather_object("first", group=g)
            assert info.value.rank == 1
            assert "cannot pickle" in info.value.reason
        return await aiodist.all_gather_object(f"second-{g.rank}", group=g)

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [["second-0", "second-1"]] * 2


async def test_messages_of_an_aborted_call_are_dropped_not_kept(server: RendezvousServer) -> None:
    # Rank 0's part of a call reaches rank 1 before rank 1 makes (and aborts) that
    # call: rank 1 drops it at the abort, and nothing stays buffered.
    async def body(g: ProcessGroup) -> int:
        await aiodist.barrier(group=g)
        if g.rank == 1:
            assert await aiodist.irecv_object(src=0, group=g) == "sent"  # after rank 0's part
            assert g.session.plane.matcher.num_unexpected == 1  # rank 0's part, waiting
            with pytest.raises(TypeError):
                aiodist.all_gather_object(threading.Lock(), group=g)
        else:
            w = aiodist.all_gather_object("part", group=g)
            await anyio.wait_all_tasks_blocked()  # its task wrote its part to rank 1...
            await aiodist.isend_object("sent", dst=1, group=g)  # ...before this, on one channel
            with pytest.raises(AbortedError):
                await w
        await aiodist.barrier(group=g)
        return g.session.plane.matcher.num_unexpected

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [0, 0]


async def test_ranks_disagreeing_on_a_many_tensor_call_get_a_mismatch(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> Any:
        data = {"a": torch.ones(2)}
        if g.rank == 1:
            data["n"] = torch.ones(3, dtype=torch.int64)  # one more buffer than rank 0
        with pytest.raises(CollectiveMismatchError):
            await aiodist.all_reduce_dict(data, group=g)
        return g.error is not None

    with anyio.fail_after(20):
        assert await run_ranks(server.address, 2, body) == [True, True]


async def test_many_tensor_call_takes_one_place_in_the_order(server: RendezvousServer) -> None:
    # Two dtypes: two buffers, still one call; then a call on rank 1 that fails its checks.
    async def body(g: ProcessGroup) -> Any:
        data = {"f": torch.full((2,), float(g.rank)), "i": torch.full((1,), g.rank + 1)}
        await aiodist.all_reduce_dict(data, group=g)
        seq_after = g._seq
        if g.rank == 1:
            with pytest.raises(TypeError):
                aiodist.all_reduce_params(["not a tensor"], group=g)  # type: ignore[list-item]
            out = torch.full((1,), 5.0)
            await aiodist.all_reduce(out, group=g)
        else:
            with pytest.raises(AbortedError):
                await aiodist.all_reduce_params([torch.ones(4)], group=g)
            out = torch.full((1,), 5.0)
            await aiodist.all_reduce(out, group=g)
        return [data["f"].tolist(), data["i"].tolist(), seq_after, out.tolist()]

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [[[1.0, 1.0], [3], 1, [10.0]]] * 2


@pytest.mark.parametrize("kind", ["object", "tensor"])
async def test_send_that_fails_fails_the_receive_it_would_have_matched(
    server: RendezvousServer, kind: str
) -> None:
    def bad_send(g: ProcessGroup) -> Any:
        if kind == "object":
            return aiodist.isend_object(threading.Lock(), dst=0, group=g)
        return aiodist.isend([1, 2], dst=0, group=g)  # type: ignore[arg-type]

    def good_send(g: ProcessGroup) -> Any:
        if kind == "object":
            return aiodist.isend_object("next", dst=0, group=g)
        return aiodist.isend(torch.full((2,), 3.0), dst=0, group=g)

    async def receive(g: ProcessGroup) -> Any:
        if kind == "object":
            return await aiodist.irecv_object(src=1, group=g)
        t = torch.zeros(2)
        await aiodist.irecv(t, src=1, group=g)
        return t.tolist()

    async def body(g: ProcessGroup) -> Any:
        if g.rank == 1:
            with pytest.raises(TypeError):
                bad_send(g)
            await good_send(g)
            return None
        with pytest.raises(AbortedError) as info:
            await receive(g)
        assert info.value.rank == 1
        return await receive(g)

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs[0] == ("next" if kind == "object" else [3.0, 3.0])
