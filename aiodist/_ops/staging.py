"""Device tensors on aiodist's data plane: staged through pinned host memory.

The data plane moves host memory. A collective or point-to-point call on CUDA
tensors that no torch bridge carries (no NCCL, or gloo for CPU only) is
*staged*:

1. When called, on the **calling thread**: an event is recorded on the
   caller's current stream of that device (so the copy sees every kernel the
   caller queued before the call), and each input is copied into a pinned
   host buffer on a side stream that waits for that event. The call has
   already taken its place in its group's order.
2. Once the copies are done (a waiter thread blocks on their events, never
   the event loop), the same operation runs on the host buffers.
3. The results are copied back into the caller's device tensors on the
   caller's stream (so later kernels on that stream see them) and the
   handle completes once they are on the device.

The caller's stream and device come from the thread that made the call: in
async code that is the loop's thread itself; ``aiodist.sync`` captures them on
the user's thread (``capture``) and hands them to the loop thread with the
call, as a context variable.

What a device *is* stays behind ``Device`` (the CUDA one is the only real one),
so the staging logic runs in tests without a GPU (``register``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Iterable, Iterator, Sequence

    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
else:

    class _Torch:  # ``import aiodist`` stays torch-free; tensors.py imports this module
        def __getattr__(self, name: str) -> Any:
            import torch

            return getattr(torch, name)

    torch = _Torch()

logger = logging.getLogger(__name__)

R = TypeVar("R")


class Device(Protocol):
    """A kind of device whose tensors the data plane stages through host memory."""

    def claims(self, t: torch.Tensor) -> bool:
        """True if ``t`` lives on this kind of device."""
        ...

    def current_stream(self, t: torch.Tensor) -> Any:
        """The calling thread's current stream on ``t``'s device."""
        ...

    def to_host(
        self, tensors: Sequence[torch.Tensor], stream: Any
    ) -> tuple[list[torch.Tensor], Any]:
        """Start copying ``tensors`` to new pinned host buffers after the work queued on ``stream``.

        Returns the buffers and an event that fires once they hold the data.
        """
        ...

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], stream: Any) -> Any:
        """Queue ``device.copy_(host)`` for each pair on ``stream``; return an event after them."""
        ...

    def empty(self, like: torch.Tensor, device_of: torch.Tensor) -> torch.Tensor:
        """A new tensor shaped like host tensor ``like`` on ``device_of``'s device."""
        ...

    def wait(self, event: Any) -> None:
        """Block this (waiter) thread until ``event`` fired; raise the device's error."""
        ...


class CudaDevice:
    """CUDA: pinned host buffers, a side stream per device for the copies out."""

    def __init__(self) -> None:
        self._copy_streams: dict[int, Any] = {}

    def claims(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def current_stream(self, t: torch.Tensor) -> Any:
        return torch.cuda.current_stream(t.device)

    def _copy_stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._copy_streams.get(index)
        if stream is None:
            stream = self._copy_streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
        return stream

    def to_host(
        self, tensors: Sequence[torch.Tensor], stream: Any
    ) -> tuple[list[torch.Tensor], Any]:
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(stream)  # everything the caller queued before the call
        side = self._copy_stream(tensors[0].device)
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        with torch.cuda.stream(side):
            side.wait_event(ready)
            for host, t in zip(hosts, tensors, strict=True):
                host.copy_(t, non_blocking=True)
                # The caller may free ``t`` once the call returns: keep its memory
                # from being reused before the side stream has read it.
                t.record_stream(side)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        return hosts, done

    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], stream: Any) -> Any:
        with torch.cuda.stream(stream):
            for device_tensor, host in pairs:
                device_tensor.copy_(host, non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        return done

    def empty(self, like: torch.Tensor, device_of: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, device=device_of.device)

    def wait(self, event: Any) -> None:
        event.synchronize()


_devices: list[Device] = [CudaDevice()]


def register(device: Device) -> Callable[[], None]:
    """Stage the tensors ``device`` claims (tests register a CPU stand-in); returns the undo."""
    _devices.insert(0, device)
    return lambda: _devices.remove(device)


def device_of(t: object) -> Device | None:
    """The ``Device`` that stages ``t``, or None for host (CPU) tensors and non-tensors."""
    if len(_devices) == 1 and getattr(t, "is_cpu", False):
        return None  # the usual case, without making a torch.device
    dev = getattr(t, "device", None)
    if dev is None or (getattr(dev, "type", "cpu") == "cpu" and len(_devices) == 1):
        return None
    for device in _devices:
        if device.claims(t):  # type: ignore[arg-type]
            return device
    return None


def on_device(t: object) -> bool:
    """True if ``t`` is a tensor the data plane must stage through host memory."""
    return device_of(t) is not None


# --- the caller's streams, from the thread that made the call -------------------------------

# Streams captured on the thread that called the blocking facade, for the loop thread
# that runs the call: ``{device key: stream}``. Unset in async code, where the loop's
# thread is the caller.
_caller: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar(
    "aiodist_caller_streams", default=None
)


def _tensors_in(values: Iterable[object], depth: int = -1) -> Iterator[torch.Tensor]:
    """The tensors in ``values``, looking ``depth`` levels into lists and dicts (-1: all)."""
    for value in values:
        if isinstance(value, list | tuple | dict):
            if depth != 0:
                inner = value.values() if isinstance(value, dict) else value
                yield from _tensors_in(inner, depth - 1)
        elif type(value).__name__ in ("Tensor", "Parameter"):
            yield value  # type: ignore[misc]


def _key(t: torch.Tensor) -> Any:
    return (t.device.type, t.device.index)


def capture(args: Sequence[object], kwargs: dict[str, object]) -> dict[Any, Any] | None:
    """The calling thread's current streams for the device tensors among the arguments.

    Called by the blocking facade on the user's thread; None (nothing to hand
    over) when no argument holds a device tensor, or torch was never imported.
    """
    import sys

    if "torch" not in sys.modules:
        return None
    found: dict[Any, Any] = {}
    # The arguments and the lists in them (tensor lists, P2POps' tensors): an object's
    # tensors deeper down are pickled on the loop, after its stream is synchronised.
    for t in _tensors_in([*args, *kwargs.values(), *_p2p_tensors(args)], depth=2):
        device = device_of(t)
        if device is not None and _key(t) not in found:
            found[_key(t)] = device.current_stream(t)
    return found or None


def _p2p_tensors(args: Sequence[object]) -> list[object]:
    ops = args[0] if args and isinstance(args[0], list) else []
    return [getattr(op, "tensor", None) for op in ops]


@contextlib.contextmanager
def caller_context(captured: dict[Any, Any] | None) -> Iterator[None]:
    """Make ``captured`` (from ``capture``) the streams of calls made inside, on any thread.

    The facade enters it on the user's thread around handing the call to the
    loop: asyncio copies the context into the callback that makes the call.
    """
    token = _caller.set(captured)
    try:
        yield
    finally:
        _caller.reset(token)


def caller_stream(t: torch.Tensor, device: Device) -> Any:
    """The caller's current stream on ``t``'s device: captured by the facade, else this thread's."""
    captured = _caller.get()
    if captured is not None and _key(t) in captured:
        return captured[_key(t)]
    return device.current_stream(t)


# --- waiting for events off the loop --------------------------------------------------------


class _Waiter:
    """One thread that waits for device events in order and wakes the loop for each."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[
            tuple[Device, Any, asyncio.AbstractEventLoop, asyncio.Future[None]]
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="aiodist-device-waiter", daemon=True)
        self._thread.start()

    def wait(self, device: Device, event: Any) -> asyncio.Future[None]:
        import asyncio

        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._queue.put((device, event, loop, future))
        return future

    def _run(self) -> None:
        while True:
            device, event, loop, future = self._queue.get()
            error: BaseException | None = None
            try:
                device.wait(event)
            except BaseException as exc:  # the device's error goes to the operation
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, error)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


_waiter: _Waiter | None = None
_waiter_lock = threading.Lock()


def _wait(device: Device, event: Any) -> asyncio.Future[None]:
    global _waiter
    with _waiter_lock:
        if _waiter is None:
            _waiter = _Waiter()
    return _waiter.wait(device, event)


# --- a staged call ---------------------------------------------------------------------------


def staged(
    g: ProcessGroup,
    seq: int,
    description: str,
    inputs: Sequence[torch.Tensor],
    start: Callable[[list[torch.Tensor]], Work[R]],
    finish: Callable[[list[torch.Tensor], R], tuple[list[tuple[torch.Tensor, torch.Tensor]], Any]],
    *,
    device_tensor: torch.Tensor | None = None,
) -> Work[Any]:
    """Run call ``seq`` of ``g`` on host copies of its device tensors ``inputs``.

    ``start(hosts)`` starts the operation on the host buffers (as operation
    ``seq``) once they hold the data; ``finish(hosts, result)`` returns the
    ``(device tensor, host tensor)`` pairs to copy back and the value the
    handle resolves to. ``device_tensor`` names the device (and stream) when
    ``inputs`` is empty (a receive). The copies out are queued now, on the
    caller's stream; the handle completes once the copies back are on the device.

    If the copy out fails, the call is aborted on every member (it never sent).
    """
    first = inputs[0] if inputs else device_tensor
    assert first is not None
    device = device_of(first)
    assert device is not None
    stream = caller_stream(first, device)
    hosts, copied = device.to_host(inputs, stream) if inputs else ([], None)

    async def run(_seq: int) -> Any:
        try:
            if copied is not None:
                await _wait(device, copied)
            work = start(hosts)
        except BaseException as exc:
            g.abort(seq, description, exc)
            raise
        result = await work
        pairs, value = finish(hosts, result)
        if pairs:
            await _wait(device, device.to_device(pairs, stream))
        return value

    return g.start(f"{description} (staged)", run, collective=False, seq=seq)


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """A host tensor for receiving into ``like`` (a device tensor), pinned where possible."""
    pin = like.device.type == "cuda"
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)


def in_place(
    g: ProcessGroup,
    seq: int,
    description: str,
    t: torch.Tensor,
    start: Callable[[torch.Tensor], Work[Any]],
) -> Work[torch.Tensor]:
    """``staged`` for an operation that works on one tensor in place and resolves to it."""
    return staged(
        g,
        seq,
        description,
        [t],
        lambda hosts: start(hosts[0]),
        lambda hosts, _result: ([(t, hosts[0])], t),
    )


def new_on_device(
    hosts: Sequence[torch.Tensor], like: torch.Tensor
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """New device tensors (on ``like``'s device) for host results ``hosts``, and the copies."""
    device = device_of(like)
    assert device is not None
    outs = [device.empty(h, like) for h in hosts]
    return list(zip(outs, hosts, strict=True)), outs


def copy_out(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], asyncio.Future[None]]:
    """Start copying device ``tensors`` to host buffers now (after the caller's queued work).

    Returns the buffers and a future (on the running loop) done once they hold the data.
    """
    device = device_of(tensors[0])
    assert device is not None
    hosts, event = device.to_host(tensors, caller_stream(tensors[0], device))
    return hosts, _wait(device, event)


def copy_back_later(
    t: torch.Tensor,
) -> Callable[[torch.Tensor, Callable[[BaseException | None], None]], None]:
    """Capture the caller's stream for ``t`` now; return ``back(host, done)`` for later.

    ``back`` queues ``t.copy_(host)`` on that stream and calls ``done(error)``
    on the loop once the data is on the device.
    """
    device = device_of(t)
    assert device is not None
    stream = caller_stream(t, device)

    def back(host: torch.Tensor, done: Callable[[BaseException | None], None]) -> None:
        try:
            event = device.to_device([(t, host)], stream)
        except BaseException as exc:
            done(exc)
            return
        _wait(device, event).add_done_callback(
            lambda f: done(None if f.cancelled() else f.exception())
        )

    return back


def settle_streams(obj: object) -> None:
    """Wait for the caller's queued work on the device tensors inside ``obj`` (before pickling).

    An object's device tensors travel pickled, and pickling copies them on the
    pickling thread's stream: first let the caller's stream finish writing them.
    A no-op unless some device is in use.
    """
    import sys

    torch_module = sys.modules.get("torch")
    if torch_module is None or (len(_devices) == 1 and not torch_module.cuda.is_initialized()):
        return
    done: set[Any] = set()
    for t in _tensors_in([obj]):
        device = device_of(t)
        if device is not None and _key(t) not in done:
            done.add(_key(t))
            stream = caller_stream(t, device)
            if hasattr(stream, "synchronize"):
                stream.synchronize()
