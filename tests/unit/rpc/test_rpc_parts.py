"""The parts of ``aiodist.rpc`` that need no second process.

Encoding with tensors set aside (``codec.dumps_split``), rebuilding remote
errors, the owner's weighted reference counts, and the threads that run
plain functions. The calls themselves are tested in real processes in
test_rpc.py.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
from fractions import Fraction
from typing import Any

import pytest
import torch
from anyio import fail_after as anyio_fail_after

from aiodist import DistError, RankFailedError
from aiodist._errors import RemoteError
from aiodist._rpc.rref import OwnedTable
from aiodist._rpc.threads import Job, Threads
from aiodist._rpc.wire import encode_error, rebuild_error
from aiodist._wire import codec

BIG = 1 << 16  # float32 elements: 256 KiB, above codec.SPLIT_MIN_BYTES


class Holder:
    """Not plain data: makes the whole object go through pickle."""

    def __init__(self, t: torch.Tensor, label: str) -> None:
        self.t, self.label = t, label


def test_split_sets_large_tensors_aside_without_copying_them() -> None:
    big = torch.arange(BIG, dtype=torch.float32)
    small = torch.ones(3)
    tensors: list[Any] = []
    data = codec.dumps_split({"big": big, "small": small, "t": (1, big)}, tensors)
    assert data[:1] == b"M"  # msgpack: plain data
    assert tensors == [big]  # the very tensor, not a copy; once, though it appears twice
    assert tensors[0] is big
    assert len(data) < 200  # small tensors inline, large ones only referred to
    out = codec.loads_split(data, tensors)
    assert out["big"] is big
    assert isinstance(out["t"], tuple)
    assert out["t"][1] is big
    torch.testing.assert_close(out["small"], small)


def test_split_falls_back_to_pickle_and_still_sets_tensors_aside() -> None:
    big = torch.arange(BIG, dtype=torch.float32)
    tensors: list[Any] = []
    # The msgpack attempt sets `big` aside before it meets Holder: pickle starts afresh.
    data = codec.dumps_split([big, Holder(big, "h")], tensors)
    assert data[:1] == b"P"
    assert len(tensors) == 1  # one tensor, referred to twice
    assert len(data) < 500
    first, holder = codec.loads_split(data, [big.clone()])
    assert first is holder.t
    torch.testing.assert_close(first, big)
    assert holder.label == "h"


def test_split_keeps_autograd_tensors_whole_and_parameters_data_apart() -> None:
    grad = torch.ones(BIG, requires_grad=True)
    param = torch.nn.Parameter(torch.full((BIG,), 2.0))
    tensors: list[Any] = []
    data = codec.dumps_split([grad, param], tensors)
    assert len(tensors) == 1  # the parameter's data; the autograd tensor is pickled whole
    assert len(data) > BIG * 4
    out = codec.loads_split(data, [t.clone() for t in tensors])
    assert out[0].requires_grad
    torch.testing.assert_close(out[0], grad)
    assert isinstance(out[1], torch.nn.Parameter)
    torch.testing.assert_close(out[1].data, param.data)


def test_loads_split_refuses_a_reference_to_a_missing_tensor() -> None:
    tensors: list[Any] = []
    data = codec.dumps_split([torch.zeros(BIG)], tensors)
    with pytest.raises(ValueError, match="refers to tensor 0 of 0"):
        codec.loads_split(data, [])
    plain = codec.dumps([1, 2])  # dumps' output reads the same through loads_split
    assert codec.loads_split(plain, []) == [1, 2]


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


class KeywordError(Exception):
    """Rebuilt from its pickle: its constructor takes more than a message."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


def test_rebuilt_error_has_the_remote_type_rank_and_traceback() -> None:
    data = encode_error(_raised(ValueError("bad value")))
    exc = rebuild_error(data, 3, "rpc_async(to=3, f)")
    assert type(exc) is ValueError
    assert str(exc).startswith("bad value\n")
    assert "rpc_async(to=3, f) raised ValueError on rank 3" in str(exc)
    assert "Traceback (most recent call last)" in str(exc)
    cause = exc.__cause__
    assert isinstance(cause, RemoteError)
    assert (cause.rank, cause.exc_type) == (3, "ValueError")
    assert "ValueError: bad value" in cause.remote_traceback


def test_rebuilt_error_keeps_attributes_of_types_that_take_keywords() -> None:
    exc = rebuild_error(encode_error(_raised(KeywordError("k", code=7))), 1, "f")
    assert type(exc) is KeywordError
    assert exc.code == 7
    failed = RankFailedError("rank 4 died", rank=4, host="h", pid=9)
    again = rebuild_error(encode_error(_raised(failed)), 2, "f")
    assert isinstance(again, RankFailedError)
    assert again.rank == 4  # the remote error's own attribute; the caller is rank 2
    assert isinstance(again.__cause__, RemoteError)
    assert again.__cause__.rank == 2


def test_errors_that_cannot_be_rebuilt_become_remote_errors() -> None:
    class Local(Exception):
        pass

    exc = rebuild_error(encode_error(_raised(Local("nope"))), 5, "f")
    assert type(exc) is RemoteError
    assert exc.rank == 5
    assert exc.exc_type.endswith("Local")
    assert "nope" in str(exc)
    # SystemExit must not stop the caller.
    stop = rebuild_error(encode_error(_raised(SystemExit(3))), 1, "f")
    assert type(stop) is RemoteError
    unreadable = rebuild_error(b"garbage", 6, "f")
    assert isinstance(unreadable, RemoteError)
    assert unreadable.rank == 6


def test_remote_error_is_a_dist_error_with_wire_details() -> None:
    exc = RemoteError("m", rank=1, exc_type="x.Y", remote_traceback="tb")
    assert isinstance(exc, DistError)
    assert exc.wire_details() == {"rank": 1, "exc_type": "x.Y"}


async def test_owned_object_is_dropped_when_every_weight_came_back() -> None:
    table = OwnedTable(asyncio.get_running_loop())
    rid = (0, 1)
    value = table.created(rid)
    value.set_result("obj")
    # The creator's reference (weight 1) was copied twice: 1/2, 1/4, 1/4.
    table.release(rid, 2)
    table.release(rid, 1)
    assert len(table) == 1
    table.release(rid, 2)
    assert len(table) == 0


async def test_releases_that_overtake_the_creation_do_not_drop_it() -> None:
    table = OwnedTable(asyncio.get_running_loop())
    rid = (1, 7)
    asked = table.value(rid)  # a copy's holder asked for it before the creation came
    table.release(rid, 1)  # and dropped its half
    assert len(table) == 1
    made = table.created(rid)
    assert made is asked
    assert table._entries[rid].weight == Fraction(1, 2)
    table.release(rid, 1)  # the creator's half
    assert len(table) == 0
    assert asked.cancelled()  # nobody can ask for it any more


async def test_clear_fails_waiters_of_objects_not_made_yet() -> None:
    table = OwnedTable(asyncio.get_running_loop())
    pending = table.created((0, 1))
    table.clear(DistError("rpc shut down"))
    assert len(table) == 0
    with pytest.raises(DistError, match="shut down"):
        pending.result()


async def test_threads_run_jobs_concurrently_and_report_on_the_loop() -> None:
    loop = asyncio.get_running_loop()
    threads = Threads(loop, 4, "test-rpc")
    barrier = threading.Barrier(4)
    done: asyncio.Queue[tuple[bool, Any, bool]] = asyncio.Queue()

    def report(ok: bool, value: Any) -> None:
        done.put_nowait((ok, value, threading.current_thread() is threading.main_thread()))

    def meet(i: int) -> int:
        barrier.wait(timeout=10)  # only returns if four run at once
        return i

    def boom() -> None:
        raise KeyError("k")

    try:
        for i in range(4):
            threads.submit(Job(meet, (i,), {}, report))
        results = [await asyncio.wait_for(done.get(), 10) for _ in range(4)]
        assert sorted(r[1] for r in results) == [0, 1, 2, 3]
        assert all(r[0] and r[2] for r in results)  # reported on the loop's thread
        threads.submit(Job(boom, (), {}, report))
        ok, error, _ = await asyncio.wait_for(done.get(), 10)
        assert not ok
        assert isinstance(error, KeyError)
        skipped = Job(boom, (), {}, report)
        skipped.cancelled = True  # cancelled before it ran: never runs
        threads.submit(skipped)
        assert await asyncio.wait_for(done.get(), 10) == (True, None, True)
    finally:
        threads.close()


def test_rref_cannot_be_unpickled_outside_a_job() -> None:
    from aiodist._rpc.rref import _rebuild

    with pytest.raises(RuntimeError, match="only be unpickled in a rank"):
        pickle.loads(pickle.dumps((_rebuild, (1, (0, 1), 1))))[0](1, (0, 1), 1)


_SLEEPERS_CANCELLED: list[str] = []


async def sleep_forever() -> None:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        _SLEEPERS_CANCELLED.append("sleep_forever")
        raise


async def test_default_timeout_is_the_jobs_and_cancels_on_the_callee(server: Any) -> None:
    # Two ranks as tasks of this loop (one process): the job's timeout is 1 s, and a call
    # without its own timeout gets that one (one timer for all such calls).
    from aiodist._rpc.agent import agent_for
    from aiodist._rpc.calls import prepare
    from aiodist._rpc.wire import Op
    from aiodist.testing import run_ranks

    _SLEEPERS_CANCELLED.clear()

    async def body(g: Any) -> Any:
        agent = agent_for(g.session)
        out: Any = None
        if g.rank == 0:
            request = prepare(agent, Op.CALL, 1, sleep_forever, (), None, None, "f({fn})")
            assert request.timeout == 1.0
            started = asyncio.get_running_loop().time()
            try:
                await agent.start(request)
            except DistError as exc:
                out = [type(exc).__name__, asyncio.get_running_loop().time() - started, str(exc)]
        await agent.shutdown(True, 10.0)  # after the cancelled call was answered
        return out if g.rank == 0 else list(_SLEEPERS_CANCELLED)

    with anyio_fail_after(20):
        outs = await run_ranks(server.address, 2, body, ranks=[0, 1], timeout=1.0)
    kind, elapsed, message = outs[0]
    assert outs[1] == ["sleep_forever"]  # cancelled on rank 1, the callee
    assert kind == "DistTimeoutError"
    assert 0.95 <= elapsed < 3.0
    assert f"f({__name__}.sleep_forever) did not complete within 1.0 s" in message
