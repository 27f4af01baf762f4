"""The torch bridge: tensor collectives on torch.distributed (gloo, NCCL), awaitable.

``init_process_group(backend="gloo" | "nccl")`` also brings up torch's default
process group, through the job's own store (``LoopStore``): one ``init_method``,
one port. Each aiodist group then has a ``GroupBridge``: its torch group and
**one ordered thread** that issues its collectives with ``async_op=True`` in
call order (NCCL hangs when one group's collectives are issued from several
threads). Completion comes back without a thread parked per operation: the
torch work's future calls back (on gloo's or NCCL's thread), which hands the
result to the loop with ``call_soon_threadsafe``.

Which tensors cross: those on the backend's device (``cuda`` for NCCL, ``cpu``
for gloo; ``"cpu:gloo,cuda:nccl"`` names both). Objects, point-to-point
messages and other tensors ride aiodist's data plane.

Torch's blocking calls (``init_process_group``, ``new_group``,
``destroy_process_group``) run in the group's thread; the loop awaits them
and keeps serving the store they use. A thread stuck in torch is waited out
on teardown for at most the group's timeout, then abandoned (daemon thread).
The thread is a daemon of our own, not a ``ThreadPoolExecutor``'s: the
interpreter joins those before its exit handlers run and refuses them work
from then on, so torch's group could not be destroyed at exit (torch warns
about a group never destroyed), and a call stuck in torch would hang the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from concurrent.futures import Executor, Future
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from aiodist._errors import (
    ClosedError,
    DistError,
    DistTimeoutError,
    GroupBrokenError,
    first_line,
    timeout_in_torch,
)
from aiodist._group.group import ProcessGroup
from aiodist._ops import staging
from aiodist._torch import ops
from aiodist._torch.agree import agree, checking, signature_of
from aiodist._torch.default import is_aiodist

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from aiodist._group.work import Work
    from aiodist._ops.agreement import Signature
    from aiodist._ops.requests import Request

logger = logging.getLogger(__name__)

T = TypeVar("T")

_DEVICE_OF = {"gloo": "cpu", "nccl": "cuda"}


def parse_backend(backend: str | None) -> dict[str, str] | None:
    """Map device type to torch backend, or None when ``backend`` asks for no bridge.

    ``"gloo"`` bridges CPU tensors, ``"nccl"`` CUDA tensors, and torch's
    ``"cpu:gloo,cuda:nccl"`` both. Other names are recorded only.

    Raises:
        RuntimeError: A torch backend this process cannot run (NCCL without CUDA).
    """
    if is_aiodist(backend):
        return None  # aiodist's own (``default.py``): nothing of aiodist's goes to torch
    assert backend is not None
    if backend.lower() not in _DEVICE_OF and ":" not in backend:
        return None
    pairs: dict[str, str] = {}
    for part in backend.lower().split(","):
        device, _, name = part.strip().rpartition(":")
        if name not in _DEVICE_OF or device not in ("", _DEVICE_OF[name]):
            raise ValueError(
                f"cannot bridge backend {backend!r}; use 'gloo', 'nccl' or 'cpu:gloo,cuda:nccl'"
            )
        pairs[_DEVICE_OF[name]] = name
    if "cuda" in pairs:
        import torch
        import torch.distributed as dist

        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise RuntimeError(
                f"backend={backend!r} needs CUDA and a torch build with NCCL, and this process "
                "has neither; use backend='gloo' (CPU tensors) or None (aiodist's data plane)"
            )
    return pairs


class IssuingThread(Executor):
    """One daemon thread that runs the calls submitted to it, in order.

    Usable until ``shutdown``, at interpreter exit included (see the module
    docstring for why it is not a ``ThreadPoolExecutor``).
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._calls.put((future, lambda: fn(*args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._calls.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, call, item  # nothing of a finished call stays alive here


class GroupBridge:
    """One process group's torch.distributed counterpart and its ordered issuing thread."""

    def __init__(self, group: ProcessGroup, devices: dict[str, str], backend: str) -> None:
        self.group = group
        self.devices = devices
        self.backend = backend
        self.torch_group: Any = None  # torch's ProcessGroup; None until brought up
        # torch holds only the C++ half of a Python store: the Python object must live on.
        self.store: Any = None
        self.closed = False
        self._pending: set[asyncio.Future[Any]] = set()
        self.cuda_device: int | None = None  # the GPU bring_up put this rank on (NCCL)
        self.stuck: str | None = None  # the operation the group broke under, if it did
        self._executor = IssuingThread(f"aiodist-torch-{group.name}")
        # AIODIST_CHECK_SIGNATURES: each call meets its peers with its signature first
        # (``agree.py``); its turn to go to torch comes after the call before it went.
        self._checking = checking()
        self._signature: Signature | None = None
        self._last_turn: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        return f"<GroupBridge {self.group.name!r} {self.backend}>"

    def crosses(self, tensor: object) -> bool:
        """True if ``tensor`` lives on a device this bridge carries."""
        device = getattr(tensor, "device", None)
        return device is not None and getattr(device, "type", None) in self.devices

    def start_collective(self, request: Request, seq: int) -> Work[Any]:
        """Start the checked ``request`` on torch as the group's operation ``seq``.

        Called in the call's slot (``_ops.run``): a call that fails here breaks
        the group on every member, since the others may have issued their part
        to torch already.
        """
        self._signature = signature_of(request) if self._checking else None
        try:
            return ops.start(self.group, self, request, seq)
        finally:
            self._signature = None

    async def new_group(self, group: ProcessGroup, backend: str | None) -> None:
        """Bring up torch's side of ``group`` (made by ``new_group`` on every rank of ours)."""
        await _bridge_new_group(self, group, backend)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking torch call in this group's thread, in order with its collectives.

        Cancellation:
            Cancelling the caller abandons the wait; the call runs to its end.
        """
        loop = asyncio.get_running_loop()
        return await asyncio.shield(
            loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
        )

    def start(
        self,
        description: str,
        issue: Callable[[], Any],
        finish: Callable[[], T],
        stream_of: torch.Tensor,
        seq: int,
    ) -> Work[T]:
        """Issue ``issue()`` (a torch call with ``async_op=True``) as the group's operation ``seq``.

        ``finish()`` turns the finished torch work into the result (copies back,
        splits outputs); for CPU tensors it runs on torch's completion thread,
        never on the loop.
        """
        if self.closed:
            raise ClosedError(f"{self.group!r} was destroyed; create a new group with new_group")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        cuda = stream_of.device.type == "cuda"
        stream = _current_stream(stream_of) if cuda else None
        mine, self._signature = self._signature, None
        previous, turn = self._last_turn, loop.create_future() if mine is not None else None
        if turn is not None:
            self._last_turn = turn

        async def op(seq: int) -> T:
            try:
                if mine is not None and turn is not None:
                    try:  # agree with the peers first; then go to torch in call order
                        await agree(self.group, work, seq, mine)
                        if previous is not None:
                            await asyncio.shield(previous)
                        self._executor.submit(issue_in_thread)
                    except BaseException:
                        done.cancel()  # never issued: nothing of torch's to wait for
                        raise
                    finally:
                        if not turn.done():
                            turn.set_result(None)
                return await done
            except asyncio.CancelledError:
                if self.group.error is not None:  # timed out, or a peer broke the group
                    self._abort(description)
                raise
            except DistError:
                raise
            except Exception as exc:
                error = self._translate(description, exc)
                if isinstance(error, DistTimeoutError):
                    self._abort(description)
                raise error from exc

        # Raises here, before issuing, if unusable.
        work = self.group.start(description, op, seq=seq)
        # Timed out (or failed by the group's error): abort before anyone hears of it.
        work.when_done(lambda w: self._abort(description) if _given_up(w) else None)
        self._pending.add(done)
        done.add_done_callback(self._retire)

        def settle(result: Any = None, exc: BaseException | None = None) -> None:
            if done.done():
                return
            if exc is not None:
                done.set_exception(exc)
            elif cuda:  # on the loop: make the caller's stream wait for the collective
                # (NCCL's Work.wait() only enqueues that wait; the loop does not block).
                try:
                    with _stream_context(stream):
                        result.wait()
                        done.set_result(finish())
                except Exception as error:
                    done.set_exception(error)
            else:
                done.set_result(result)

        def to_loop(result: Any = None, exc: BaseException | None = None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting
                loop.call_soon_threadsafe(settle, result, exc)

        def issue_in_thread() -> None:  # the group's ordered thread
            try:
                with _stream_context(stream):
                    torch_work = issue()
                future = torch_work.get_future()
            except Exception as exc:
                to_loop(exc=exc)
                return

            def completed(fut: Any) -> None:  # gloo's or NCCL's thread
                try:
                    fut.wait()  # raises torch's error; never blocks once done
                    result = torch_work if cuda else finish()
                except Exception as exc:
                    to_loop(exc=exc)
                else:
                    to_loop(result)

            future.add_done_callback(completed)

        if mine is None:
            self._executor.submit(issue_in_thread)
        return work

    def _abort(self, description: str) -> None:
        """The group broke while ``description`` ran in torch: abort NCCL's communicator.

        A collective stuck in NCCL holds its kernels and the issuing thread
        forever; aborting the communicator (in a thread of its own: abort may
        block) frees them, so the group's ``DistTimeoutError`` is the end of it.
        gloo's operations end on their own timeout (the group's), so only the
        record is kept there.
        """
        if self.stuck is not None:
            return
        self.stuck = description
        if self.devices.get("cuda") != "nccl" or self.torch_group is None:
            return
        logger.error(
            "aborting the NCCL communicator of group %r: %s did not complete (%s)",
            self.group.name,
            description,
            self.group.error,
        )
        pg = self.torch_group

        def abort() -> None:
            import torch

            try:
                pg._get_backend(torch.device("cuda")).abort()
            except Exception:
                logger.exception("aborting NCCL's communicator of group %r failed", self.group)

        threading.Thread(target=abort, name=f"aiodist-abort-{self.group.name}", daemon=True).start()

    def _retire(self, done: asyncio.Future[Any]) -> None:
        self._pending.discard(done)
        if not done.cancelled():
            done.exception()  # torch may fail after our own timeout: never "unretrieved"

    def _translate(self, description: str, exc: Exception) -> DistError:
        where = (
            f"{description} on group {self.group.name!r} failed in torch.distributed "
            f"({self.backend})"
        )
        return timeout_in_torch(where, exc) or GroupBrokenError(
            f"{where}: {first_line(exc)}; the group is broken on every rank. "
            "Check the other ranks' logs, then restart the job."
        )

    async def aclose(self, destroy: Callable[[], None] | None) -> None:
        """Wait for operations in flight (bounded), run ``destroy`` in the thread, stop it.

        Cancellation:
            Shielded: the thread finishes its work even if the caller is cancelled.
        """
        if self.closed:
            return
        self.closed = True
        timeout = self.group.timeout
        if self._pending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(asyncio.gather(*self._pending, return_exceptions=True)),
                    timeout,
                )
        if destroy is not None and self.torch_group is not None:
            try:
                await asyncio.wait_for(self.call(destroy), timeout)
            except Exception:
                logger.exception("tearing down torch's group for %r failed", self.group)
        self.torch_group = None
        self._executor.shutdown(wait=False)


def _given_up(work: Work[Any]) -> bool:
    error = work.exception()
    return isinstance(error, DistTimeoutError | GroupBrokenError)


def backstop(seconds: float) -> timedelta:
    """torch's own timeout for a group whose aiodist timeout is ``seconds``: later.

    aiodist's deadline must end a stuck collective first, so that it names the
    operation, breaks the group on every rank and aborts NCCL's communicator
    (``_abort``); torch's (NCCL's watchdog may end the process) stays a backstop.
    """
    return timedelta(seconds=2 * seconds + 10)


def _current_stream(t: torch.Tensor) -> Any:
    """The caller's current stream on ``t``'s device (captured on its thread by aiodist.sync)."""
    device = staging.device_of(t)
    if device is not None:
        return staging.caller_stream(t, device)
    import torch

    return torch.cuda.current_stream(t.device)


def _stream_context(stream: Any) -> contextlib.AbstractContextManager[Any]:
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


# --- bring-up and teardown -----------------------------------------------------------------


async def bring_up(
    world: ProcessGroup, backend: str, devices: dict[str, str], *, device_id: Any = None
) -> None:
    """Bring up torch.distributed's default group for ``world``, through the job's store.

    Raises:
        RuntimeError: torch.distributed is already initialised in this process.
        GroupBrokenError: torch could not bring its group up (``__cause__`` says why).
    """
    import torch
    import torch.distributed as dist

    from aiodist._torch.store import LoopStore

    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process; call "
            "torch.distributed.destroy_process_group() first, or pass backend=None"
        )
    if "gloo" in devices.values():
        await _warn_if_gloo_in_clear(world)
    loop = asyncio.get_running_loop()
    store = LoopStore(world, loop)
    bridge = GroupBridge(world, devices, backend)
    bridge.store = store
    if "cuda" in devices:
        if device_id is not None:  # init_process_group(device_id=...), as torch takes it
            device = device_id if isinstance(device_id, int) else torch.device(device_id).index
            device = 0 if device is None else device
        else:
            device = world.session.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(device)  # on the loop's thread, as mmengine's init_dist does
        await bridge.call(torch.cuda.set_device, device)  # and on the issuing thread
        bridge.cuda_device = device  # and aiodist.sync puts the caller's thread there
    try:
        await bridge.call(
            dist.init_process_group,
            backend=backend,
            store=store,
            rank=world.rank,
            world_size=world.world_size,
            timeout=backstop(world.timeout),
        )
    except Exception as exc:
        await bridge.aclose(None)
        raise GroupBrokenError(
            f"torch.distributed.init_process_group({backend!r}) failed: {exc}"
        ) from exc
    bridge.torch_group = dist.group.WORLD
    world.bridge = bridge
    # No rank returns before every rank's group is up: one that returned and destroyed
    # its group at once would cut a peer's gloo mesh short ("Connection closed by peer").
    await world.session.barrier()


async def _warn_if_gloo_in_clear(world: ProcessGroup) -> None:
    """Warn when a TLS job's ranks on several hosts talk gloo, which is never encrypted."""
    from aiodist._transport import tls

    if tls.from_env() is None:
        return
    hosts = {member.host for member in await world.session.members()}
    if len(hosts) > 1:
        logger.warning(
            "backend='gloo' in a TLS job across %d hosts: gloo's traffic between them is not "
            "encrypted (aiodist's is); start the job without a backend, so that torch's calls "
            "ride aiodist's TLS data plane (torch's default group is then on the 'aiodist' "
            "backend)",
            len(hosts),
        )


async def _bridge_new_group(pbridge: GroupBridge, group: ProcessGroup, backend: str | None) -> None:
    """Create torch's group for ``group`` (made by ``new_group`` on every rank of ``parent``).

    torch's ``new_group`` is called in ``parent``'s thread, so every rank calls
    it in the same order as its other operations on ``parent``.
    """
    import torch.distributed as dist

    parent = pbridge.group
    devices = pbridge.devices
    name = pbridge.backend
    if backend is not None:
        asked = parse_backend(backend)
        if asked is None:
            raise ValueError(f"cannot bridge a group with backend {backend!r}")
        devices, name = asked, backend
    bridge = GroupBridge(group, devices, name)
    bridge.store = pbridge.store
    from_world = parent.group_id == 0
    # Every rank of the world calls torch's new_group, as torch wants; for a subgroup of
    # a subgroup, only its members call torch.
    if from_world or group.rank >= 0:
        bridge.torch_group = await pbridge.call(
            dist.new_group,
            ranks=list(group.ranks),
            timeout=backstop(group.timeout),
            backend=name,
            use_local_synchronization=not from_world,
        )
    if group.rank < 0:  # not a member: nothing to issue on
        await bridge.aclose(None)
        return
    group.bridge = bridge


async def tear_down(group: ProcessGroup) -> None:
    """Tear down ``group``'s torch group; for the world group, every torch group and torch.

    Cancellation:
        Shielded: torch is torn down even if the caller is cancelled.
    """
    bridge = _bridge_of(group)
    if bridge is None:
        return
    import torch.distributed as dist

    if group.group_id != 0:
        pg = bridge.torch_group
        await asyncio.shield(bridge.aclose(lambda: dist.destroy_process_group(pg)))
        group.bridge = None
        return
    for other in list(group.session.groups.values()):
        # Every group of a session is a ProcessGroup; the session types them by what it uses.
        if not isinstance(other, ProcessGroup) or other is group:
            continue
        other_bridge = _bridge_of(other)
        if other_bridge is not None:
            await asyncio.shield(other_bridge.aclose(None))
            other.bridge = None
    await asyncio.shield(bridge.aclose(dist.destroy_process_group))
    group.bridge = None


def _bridge_of(group: ProcessGroup) -> GroupBridge | None:
    bridge = group.bridge
    assert bridge is None or isinstance(bridge, GroupBridge)  # the only Bridge there is
    return bridge
