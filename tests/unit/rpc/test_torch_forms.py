"""The parts of torch's rpc forms that need no second process.

Backend options read and refused, tensors that require grad set aside,
distributed autograd's send/recv records and local passes (two "ranks" of
one process, gradients checked against plain autograd), the plain-code
future, and the program-end hook in multiprocessing children.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import threading
from typing import Any

import pytest
import torch

from aiodist import DistTimeoutError
from aiodist._group import ending
from aiodist._rpc import contexts
from aiodist._rpc.futures import Future
from aiodist._rpc.options import (
    BackendType,
    TensorPipeRpcBackendOptions,
    check_backend,
    settings_of,
)
from aiodist._wire import codec

# --- backend and options ------------------------------------------------------------------


def test_options_give_init_method_timeout_and_threads() -> None:
    opts = TensorPipeRpcBackendOptions(
        init_method="tcp://h:1", rpc_timeout=12, num_worker_threads=3
    )
    got = settings_of(opts)
    assert (got.init_method, got.timeout, got.threads) == ("tcp://h:1", 12.0, 3)
    assert settings_of(None).init_method is None


def test_torchs_own_options_are_read_the_same_way() -> None:
    import torch.distributed.rpc as torch_rpc

    opts = torch_rpc.TensorPipeRpcBackendOptions(init_method="tcp://h:2", rpc_timeout=7)
    got = settings_of(opts)
    assert (got.init_method, got.timeout, got.threads) == ("tcp://h:2", 7.0, 16)
    check_backend(torch_rpc.BackendType.TENSORPIPE)  # type: ignore[attr-defined]
    check_backend(BackendType.TENSORPIPE)
    check_backend(None)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("device_maps", {"w1": {0: 1}}),
        ("devices", ["cuda:0"]),
        ("_transports", ["uv"]),
        ("_channels", ["basic"]),
    ],
)
def test_options_aiodist_cannot_honour_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"rpc_backend_options\.{field} is not supported"):
        TensorPipeRpcBackendOptions(**{field: value})
    with pytest.raises(ValueError, match="device_maps"):
        TensorPipeRpcBackendOptions().set_device_map("w1", {0: 0})


def test_bad_option_values_and_backends_are_refused() -> None:
    with pytest.raises(ValueError, match="rpc_timeout must be >= 0"):
        TensorPipeRpcBackendOptions(rpc_timeout=-1)
    with pytest.raises(ValueError, match="num_worker_threads must be >= 1"):
        TensorPipeRpcBackendOptions(num_worker_threads=0)
    with pytest.raises(TypeError, match="init_method must be a str"):
        TensorPipeRpcBackendOptions(init_method=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"BackendType\.TENSORPIPE"):
        check_backend("PROCESS_GROUP")


# --- tensors that require grad travel set aside --------------------------------------------


def test_small_tensors_that_require_grad_are_set_aside_only_when_asked() -> None:
    w = torch.ones(3, requires_grad=True)
    h = w * 2  # not a leaf
    plain = torch.ones(2)
    tensors: list[Any] = []
    data = codec.dumps_split({"h": h, "x": plain}, tensors, grad=True)
    assert tensors == [h]
    assert tensors[0] is h
    out = codec.loads_split(data, [torch.zeros(3)])
    torch.testing.assert_close(out["x"], plain)
    tensors = []
    codec.dumps_split({"h": h, "x": plain}, tensors)  # pickled with the rest
    assert tensors == []


# --- distributed autograd: two "ranks" in one process ---------------------------------------


def _send(ctx: contexts.Context, tensors: list[torch.Tensor], dst: int) -> tuple[Any, list[Any]]:
    """What a message carries from the context's rank: its autograd part, fresh tensors."""
    meta = contexts.outgoing(ctx, tensors, dst, force=True)
    return meta, [t.detach().clone() for t in tensors]


def test_gradients_flow_back_through_send_and_recv_as_plain_autograds_do() -> None:
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)
    x = torch.randn(5, 4)
    reference = lin2(torch.tanh(lin1(x))).sum()
    reference.backward()
    expected = [p.grad.clone() for p in (*lin1.parameters(), *lin2.parameters())]  # type: ignore[union-attr]
    for p in (*lin1.parameters(), *lin2.parameters()):
        p.grad = torch.full_like(p, 7.0)  # what a program keeps in .grad: left alone

    a = contexts.Context(1 << 48 | 1)  # rank 0's context (the id travels)
    b_id = a.id
    h = torch.tanh(lin1(x))  # rank 0 computes, then sends h to rank 1
    meta, wire = _send(a, [h], dst=1)
    assert meta[0] == a.id
    assert meta[1] > 0
    assert meta[2] == [0]
    b = contexts.incoming(meta, 0, wire)  # rank 1: h joins its graph behind a recv
    assert b.id == b_id
    assert wire[0].grad_fn is not None
    assert not wire[0].is_leaf
    wire[0].mul_(1.0)  # an in-place op on a received tensor is allowed, as under torch
    loss = lin2(wire[0]).sum()
    onward = contexts.local_pass(b, [loss], [torch.ones_like(loss)])  # rank 1's part
    assert [(rank, send) for rank, send, _ in onward] == [(0, meta[1])]
    sent = a.sends[meta[1]]
    grads = [g for g in onward[0][2] if g is not None]
    more = contexts.local_pass(a, sent, grads)  # rank 0's part, from its send
    assert more == []
    got = [*(a.grads[p] for p in lin1.parameters()), *(b.grads[p] for p in lin2.parameters())]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for p in (*lin1.parameters(), *lin2.parameters()):
        torch.testing.assert_close(p.grad, torch.full_like(p, 7.0))  # untouched
    contexts.drop(b_id)


def test_a_second_pass_accumulates_in_the_context() -> None:
    w = torch.ones(2, requires_grad=True)
    ctx = contexts.Context(5)
    for _ in range(2):
        loss = (w * 3).sum()
        assert contexts.local_pass(ctx, [loss], [torch.ones_like(loss)]) == []
    torch.testing.assert_close(ctx.grads[w], torch.full((2,), 6.0))
    assert w.grad is None


@pytest.mark.parametrize(
    "meta",
    [None, [1, 2], ["1", 2, []], [1, 0, [0]], [1, 2, [5]], [1, 2, ["0"]], [1, 2, "0"]],
)
def test_malformed_autograd_metadata_is_refused(meta: Any) -> None:
    with pytest.raises(ValueError, match="autograd"):
        contexts.parse_meta(meta, 2)


def test_only_one_context_is_current_at_a_time() -> None:
    ctx = contexts.enter(0)
    try:
        with pytest.raises(RuntimeError, match="current already"):
            contexts.enter(0)
        assert contexts.context_of(ctx.id) is ctx
    finally:
        contexts.CURRENT.set(None)
        contexts.drop(ctx.id)
    with pytest.raises(RuntimeError, match="Could not find autograd context"):
        contexts.context_of(ctx.id)


# --- the plain-code future ----------------------------------------------------------------


def test_future_is_torchs_awaitable_and_waits_with_a_timeout() -> None:
    fut: Future[int] = Future(loop_thread=-1)
    assert isinstance(fut, torch.futures.Future)
    with pytest.raises(DistTimeoutError):
        fut.wait(timeout=0.05)
    threading.Timer(0.05, fut.set_result, (5,)).start()

    async def main() -> int:
        return await fut

    assert asyncio.run(main()) == 5
    assert torch.futures.wait_all([fut]) == [5]
    assert fut.then(lambda f: f.value() + 1).wait() == 6


def test_future_wait_on_its_loop_thread_refuses_before_it_is_done() -> None:
    fut: Future[int] = Future(loop_thread=threading.get_ident())
    with pytest.raises(RuntimeError, match="would deadlock"):
        fut.wait()
    fut.set_result(1)
    assert fut.wait() == 1  # done: a callback may read it there


# --- the end of a multiprocessing child ----------------------------------------------------


def _child(path: str, how: str) -> None:
    def record(exc: BaseException | None) -> None:
        with open(path, "w") as f:
            f.write(repr(exc))

    ending.at_exit(record)
    if how == "raise":
        raise ValueError("the target broke")
    if how == "exit":
        sys.exit(3)


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize(
    ("how", "seen"),
    [("raise", "ValueError('the target broke')"), ("exit", "SystemExit(3)"), ("ok", "None")],
)
def test_exit_handlers_see_how_a_multiprocessing_child_ended(
    tmp_path: Any, method: str, how: str, seen: str
) -> None:
    path = str(tmp_path / "seen")
    ctx: Any = multiprocessing.get_context(method)
    proc = ctx.Process(target=_child, args=(path, how))
    proc.start()
    proc.join(60)
    assert proc.exitcode == {"raise": 1, "exit": 3, "ok": 0}[how]
    with open(path) as f:
        assert f.read() == seen
