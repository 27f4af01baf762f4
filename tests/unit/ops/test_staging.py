"""Device tensors on the data plane, staged through host memory, without a GPU.

``staging.register`` puts a stand-in device in front of CUDA: it claims some
CPU tensors, and each of its streams is one ordered worker thread, as a CUDA
stream runs its work in order. The real staging code then runs: it asks the
*caller's* stream (recording which thread asked), queues the copy out behind
the caller's queued work, runs the collective on host buffers, queues the
copy back on the caller's stream and completes the handle once it ran. What
needs a GPU (pinned memory, events, the copy kernels) is in ``test_cuda.py``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
import aiodist.sync as dist
from aiodist._ops import staging
from aiodist._sync import portal
from aiodist.testing import run_ranks
from tests.helpers.procs import free_port

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from aiodist import ProcessGroup, RendezvousServer


class FakeStream:
    """An ordered queue of work, as a CUDA stream is; remembers the thread that asked for it."""

    def __init__(self, asked_on: str) -> None:
        self.asked_on = asked_on
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fake-stream")

    def submit(self, fn: Callable[[], object]) -> Future[object]:
        return self._pool.submit(fn)


class FakeDevice:
    """Claims the tensors made by ``tensor``; one stream per thread, as CUDA's current stream."""

    def __init__(self) -> None:
        # Claimed tensors by id, kept alive: a freed tensor's id is reused by later ones
        # (aiodist's own host buffers), which would then be taken for device tensors.
        self._claimed: dict[int, torch.Tensor] = {}
        self.streams: dict[str, FakeStream] = {}
        self.copies: list[str] = []  # "out"/"back", in the order they ran
        self._lock = threading.Lock()

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        self._claimed[id(t)] = t
        return t

    def claims(self, t: torch.Tensor) -> bool:
        return self._claimed.get(id(t)) is t

    def current_stream(self, t: torch.Tensor) -> FakeStream:
        name = threading.current_thread().name
        with self._lock:
            if name not in self.streams:
                self.streams[name] = FakeStream(name)
            return self.streams[name]

    def current_device(self) -> Any:
        return None

    def to_host(self, tensors: Sequence[torch.Tensor], stream: FakeStream) -> tuple[Any, Any]:
        hosts = [torch.empty_like(t) for t in tensors]

        def copy() -> None:  # behind everything the caller queued on its stream
            for host, t in zip(hosts, tensors, strict=True):
                host.copy_(t)
            self.copies.append("out")

        return hosts, stream.submit(copy)

    def to_device(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], stream: FakeStream
    ) -> Any:
        def copy() -> None:
            time.sleep(0.02)  # the handle must wait for this, not for its queueing
            for device_tensor, host in pairs:
                device_tensor.copy_(host)
            self.copies.append("back")

        return stream.submit(copy)

    def empty(self, like: torch.Tensor, device_of: torch.Tensor) -> torch.Tensor:
        return self.tensor(torch.empty_like(like))

    def wait(self, event: Future[object]) -> None:
        event.result()


@pytest.fixture
def device() -> Iterator[FakeDevice]:
    fake = FakeDevice()
    undo = staging.register(fake)
    try:
        yield fake
    finally:
        undo()


async def test_all_reduce_copies_out_behind_the_callers_queued_work(
    server: RendezvousServer, device: FakeDevice
) -> None:
    async def body(g: ProcessGroup) -> Any:
        t = device.tensor(torch.zeros(4))
        stream = device.current_stream(t)

        def late_kernel() -> None:  # queued before the call, still running when it is made
            time.sleep(0.05)
            t.fill_(float(g.rank + 1))

        stream.submit(late_kernel)
        w = aiodist.all_reduce(t, group=g)
        assert w.result() is t if w.is_completed() else True
        out = await w
        return out is t, t.tolist()

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    # 1 + 2 on both ranks: the copy out waited for the late kernel on the caller's stream.
    assert outs == [(True, [3.0] * 4)] * 2
    assert device.copies.count("out") == 2
    assert device.copies.count("back") == 2


async def test_staged_collectives_and_p2p_match_their_host_results(
    server: RendezvousServer, device: FakeDevice
) -> None:
    async def body(g: ProcessGroup) -> dict[str, Any]:
        r = g.rank
        dev = device.tensor
        out: dict[str, Any] = {}
        b = dev(torch.full((3,), float(r)))
        await aiodist.broadcast(b, src=1, group=g)
        out["broadcast"] = b.tolist()
        parts = await aiodist.all_gather(dev(torch.tensor([r, 10 + r])), group=g)
        out["all_gather"] = [p.tolist() for p in parts]
        out["all_gather_on_device"] = all(device.claims(p) for p in parts)
        torch_form = [dev(torch.zeros(2, dtype=torch.int64)) for _ in range(2)]
        await aiodist.all_gather(torch_form, dev(torch.tensor([r, 10 + r])), group=g)
        out["all_gather_torch_form"] = [p.tolist() for p in torch_form]
        rs = dev(torch.zeros(2))
        await aiodist.reduce_scatter(
            rs, [dev(torch.full((2,), float(r + i))) for i in range(2)], group=g
        )
        out["reduce_scatter"] = rs.tolist()
        big = dev(torch.zeros(4))
        await aiodist.all_gather_into_tensor(big, dev(torch.full((2,), float(r))), group=g)
        out["all_gather_into_tensor"] = big.tolist()
        got = await aiodist.all_to_all([dev(torch.tensor([r * 10 + i])) for i in range(2)], group=g)
        out["all_to_all"] = [x.tolist() for x in got]
        single = dev(torch.zeros(2))
        await aiodist.all_to_all_single(
            single, dev(torch.tensor([r * 10.0, r * 10.0 + 1])), group=g
        )
        out["all_to_all_single"] = single.tolist()
        gathered = await aiodist.gather(dev(torch.tensor([r])), dst=0, group=g)
        out["gather"] = [x.tolist() for x in gathered]
        s = dev(torch.zeros(2))
        src_parts = [dev(torch.full((2,), 5.0 + i)) for i in range(2)] if r == 1 else None
        await aiodist.scatter(s, src_parts, src=1, group=g)
        out["scatter"] = s.tolist()
        m = dev(torch.full((2,), float(r + 1)))
        await aiodist.reduce(m, dst=0, op="max", group=g)
        out["reduce"] = m.tolist() if r == 0 else None
        d = {"x": dev(torch.full((2,), float(r)))}
        await aiodist.all_reduce_dict(d, op="sum", group=g)
        out["all_reduce_dict"] = d["x"].tolist()
        # Point to point: a staged send, then a host one to the same rank and tag, in order.
        if r == 0:
            w1 = aiodist.isend(dev(torch.full((3,), 7.0)), dst=1, group=g)
            w2 = aiodist.isend(torch.full((3,), 8.0), dst=1, group=g)
            await w1
            await w2
        else:
            first, second = dev(torch.zeros(3)), torch.zeros(3)
            assert await aiodist.irecv(first, src=0, group=g) == 0
            await aiodist.irecv(second, src=0, group=g)
            out["p2p"] = [first.tolist(), second.tolist()]
        return out

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 2, body)
    for r, out in enumerate(outs):
        assert out["broadcast"] == [1.0] * 3
        assert out["all_gather"] == [[0, 10], [1, 11]]
        assert out["all_gather_on_device"]
        assert out["all_gather_torch_form"] == [[0, 10], [1, 11]]
        assert out["reduce_scatter"] == [float(r) + float(r + 1)] * 2  # slot r: (0 + r) + (1 + r)
        assert out["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert out["all_to_all"] == [[r], [10 + r]]
        assert out["all_to_all_single"] == [float(r), 10.0 + r]
        assert out["gather"] == ([[0], [1]] if r == 0 else [])
        assert out["scatter"] == [5.0 + r] * 2
        assert out["all_reduce_dict"] == [1.0, 1.0]
    assert outs[0]["reduce"] == [2.0, 2.0]
    assert outs[1]["p2p"] == [[7.0] * 3, [8.0] * 3]
    # Every call above went through host memory (both ranks): out, then back where needed.
    # 11 calls copy out on each rank, but for two: the receiving side of scatter (its
    # tensor is output only) and all_reduce_dict, whose buffers torch.cat makes on the
    # host here (on a GPU they stay on it); rank 0's staged isend is one more.
    assert device.copies.count("out") == 2 * 11 - 2 + 1
    assert device.copies.count("back") == 20


def test_sync_facade_stages_on_the_callers_stream_not_the_loops(device: FakeDevice) -> None:
    assert not portal.is_running()
    dist.init_process_group(
        init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0, timeout=30
    )
    try:
        t = device.tensor(torch.full((3,), 2.0))
        caller = threading.current_thread().name

        def from_a_thread() -> None:
            u = device.tensor(torch.ones(2))
            w = dist.all_reduce(u, async_op=True)
            w.wait(10)

        worker = threading.Thread(target=from_a_thread, name="user-thread")
        out = dist.all_reduce(t, op="mean")
        worker.start()
        worker.join(20)
        assert out is t
        assert t.tolist() == [2.0] * 3
        loop_thread = portal.loop_thread()
        assert loop_thread is not None
        # Every stream staging used was the calling thread's: never the loop thread's.
        assert set(device.streams) == {caller, "user-thread"}
        assert loop_thread.name not in device.streams
    finally:
        dist.destroy_process_group()
        portal.stop()
