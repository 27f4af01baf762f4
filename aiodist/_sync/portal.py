"""The background event-loop thread that ``aiodist.sync`` drives the async core on.

One loop thread per process (anyio's ``start_blocking_portal`` is the model;
uvloop's loop factory when installed) runs the one async implementation: the
default group's reader and heartbeat tasks live there, so they keep running
while user code computes between calls. Plain code reaches it through three
doors, each used by the generated ``aiodist/sync.py``:

- ``call(fn, ...)`` runs an ``async def`` operation on the loop and blocks for
  its result (``init_process_group``, ``send``, ...).
- ``submit(fn, ..., async_op=...)`` starts a Work-returning operation on the
  loop (so its sequence number is taken in call order) and either blocks for
  its result or returns the running ``Work``.
- ``stop()`` ends the thread; it also runs at the program's end
  (``_group.ending``: interpreter exit, or a multiprocessing child's end), after
  tearing down a default group that is still initialised (failing it if the
  program failed).

The thread starts on first use and stops once a blocking call leaves nothing
on it (``destroy_process_group``; ``rpc.shutdown`` of an rpc world of its
own), so a non-distributed script never has
one running for long: Work-returning operations with nothing initialised run
in the caller's thread, since they complete at once without a loop.

Blocking on the loop's own thread would deadlock; every door raises
``RuntimeError`` there instead, as anyio's portal does.

**Interrupts.** Signals are handled by the main thread, so Ctrl-C interrupts a
blocking call at once. The operation it waited for may never complete (its
peers never come), and waiting for it at exit would hold the program for the
close grace: so a blocking call interrupted by ``KeyboardInterrupt`` (or any
other exception that is not an ``Exception``, such as a signal handler's
``SystemExit``) closes the default group at once, failing the operations in
flight instead of waiting for them, and then re-raises. Its peers learn that
this rank left the job. The same happens at exit after an uncaught
``KeyboardInterrupt`` (a ``Work.wait()`` that was interrupted).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from anyio.from_thread import BlockingPortal

from aiodist._errors import ArgumentError
from aiodist._group import ending
from aiodist._group.ending import failure_of, interrupted
from aiodist._group.group import ProcessGroup
from aiodist._group.work import Work, running_loop, wait_future
from aiodist._group.world import default_group_loop, get_default_group, is_initialized
from aiodist._launch.cli import run_async
from aiodist._launch.init import destroy_process_group
from aiodist._ops.movement import monitored_barrier
from aiodist._ops.reductions import all_reduce
from aiodist._rpc import world as rpc_world
from aiodist._sync import profiling
from aiodist._torch import handoff
from aiodist._torch.ops import options_op

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator
    from datetime import timedelta


logger = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

THREAD_NAME = "aiodist-loop"
_ASYNC_SIGNALS = {
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGALRM,
    signal.SIGUSR1,
    signal.SIGUSR2,
}


class _LoopThread:
    """A started loop thread: the thread, its loop, and the anyio portal into it."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.portal: BlockingPortal | None = None
        self.pid = os.getpid()
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError("aiodist.sync could not start its event loop") from self._error

    def _run(self) -> None:
        # Keep signals for the main thread, where they interrupt a blocked call
        # (Ctrl-C, pytest-timeout's SIGALRM): POSIX lets the kernel deliver them to
        # any thread that does not block them, and Python handles them in the main one.
        signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNC_SIGNALS)
        try:
            run_async(self._main)
        except BaseException as exc:  # pragma: no cover - only if the loop cannot start
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        async with BlockingPortal() as portal:
            self.loop = asyncio.get_running_loop()
            self.portal = portal
            self._ready.set()
            await portal.sleep_until_stopped()

    def close(self) -> None:
        assert self.portal is not None
        if self.thread is not threading.current_thread():
            # Cancel what is left (a call interrupted by Ctrl-C, say) rather than wait for it.
            self.portal.call(self.portal.stop, True)
            self.thread.join()


_lock = threading.Lock()
_current: _LoopThread | None = None
_calls = 0  # ``call``s under way, from any thread


def _running() -> _LoopThread:
    """The loop thread, started if needed, after checking that this call can use it."""
    global _current
    with _lock:
        if _current is None:
            _current = _LoopThread()
            ending.at_exit(_at_exit)  # before an rpc world's: it ends after them
        return _current


def _check_thread(name: str) -> None:
    current = _current
    if current is not None and threading.current_thread() is current.thread:
        raise RuntimeError(
            f"aiodist.sync.{name}() blocks, and was called on aiodist's event-loop thread where "
            f"it would deadlock; use the async API there (`await aiodist.{name}(...)`)"
        )


def _check_group_loop() -> None:
    loop, current = default_group_loop(), _current
    if loop is not None and (current is None or loop is not current.loop):
        raise RuntimeError(
            "the default process group belongs to another event loop (it was initialised with "
            "`await aiodist.init_process_group()`, or in the parent of this forked process); "
            "use the async API on that loop, or initialise with aiodist.sync.init_process_group()"
        )


def call(fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run the async operation ``fn(*args, **kwargs)`` on the loop thread; block for its result.

    Once it returns or raises, if no default group is initialised (it was
    destroyed, or never formed) and no other call is under way, the loop thread
    stops; the next call starts it.

    Raises:
        RuntimeError: Called on the loop thread, or the default group belongs to
            another event loop.
    """
    _check_thread(fn.__name__)
    _check_group_loop()
    lt = _running()
    assert lt.portal is not None

    end_event = profiling.begin(fn, args, kwargs, tensors_only=True)

    async def run() -> T:
        try:
            return await fn(*args, **kwargs)
        finally:
            if end_event is not None:
                end_event()

    future: Future[T] | None = None
    try:
        with _under_way():
            future = lt.portal.start_task_soon(run)
            return wait_future(future)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # interrupted while it waited (Ctrl-C)
            if future is not None:
                future.cancel()  # a join still under way is abandoned
            _abandon(lt, exc)
        raise
    finally:
        if not _calls and not _in_use():
            stop(lt)


@contextlib.contextmanager
def _under_way() -> Iterator[None]:
    """Counts a blocking call into the loop: the loop thread stops under none.

    torch's ``destroy_process_group``, run inside aiodist's (the group torch's
    ``init_process_group`` joined leaves the job through a call of its own),
    would otherwise stop the loop under the outer call.
    """
    global _calls
    with _lock:
        _calls += 1
    try:
        yield
    finally:
        with _lock:
            _calls -= 1


def _in_use() -> bool:
    """True while something lives on the loop thread: the default group, an rpc world."""
    return is_initialized() or rpc_world.is_open()


def submit(
    fn: Callable[..., Work[T]], /, *args: Any, async_op: bool = False, **kwargs: Any
) -> Work[T] | T:
    """Start the operation ``fn(*args, **kwargs)`` on the loop thread.

    It starts there in call order (its sequence number is taken at once), then
    this returns the running ``Work`` (``async_op=True``) or blocks for its result.

    Raises:
        RuntimeError: Called on the loop thread, or the default group belongs to
            another event loop.
    """
    _check_thread(fn.__name__)
    if not is_initialized():
        # Nothing to talk to: the operation completes at once (the non-distributed
        # answer) or raises, without a loop; no thread needs to start for it.
        work = fn(*args, **kwargs)
        return work if async_op else work.wait()
    _check_group_loop()
    lt = _running()
    assert lt.loop is not None
    box: Future[Any] = Future()
    end_event = profiling.begin(fn, args, kwargs)

    def start() -> None:
        try:
            started = fn(*args, **kwargs)
        except BaseException as exc:
            if end_event is not None:
                end_event()
            box.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        if end_event is not None:
            started.when_done(lambda _: end_event())
        if async_op:
            box.set_result(started)
        else:
            started.add_done_callback(lambda w: _transfer(w, box))

    try:
        lt.loop.call_soon_threadsafe(start)
        return wait_future(box)  # type: ignore[no-any-return]
    except BaseException as exc:
        if not isinstance(exc, Exception):  # interrupted while it waited (Ctrl-C)
            _abandon(lt, exc)
            if not _in_use():
                stop(lt)
        raise


def run_sync(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run the plain function ``fn(*args, **kwargs)`` on the loop thread; return its result.

    For code that must touch what the loop owns (its futures, its tasks). The
    loop thread starts if needed and keeps running afterwards.

    Raises:
        RuntimeError: Called on the loop thread.
    """
    _check_thread(fn.__name__)
    lt = _running()
    assert lt.portal is not None
    return lt.portal.call(functools.partial(fn, *args, **kwargs))


def start_soon(fn: Callable[..., Work[T]], /, *args: Any) -> Work[T]:
    """Start the operation ``fn(*args)`` on the loop thread; return its handle at once.

    ``submit(..., async_op=True)`` without the round trip to the loop thread, for
    callers that start an operation every training step: the loop runs starts
    in call order, so sequence numbers still follow call order. An error raised
    while starting (bad arguments) is the handle's error instead of raised here.

    Raises:
        RuntimeError: Called on the loop thread, or the default group belongs to
            another event loop.
    """
    _check_thread(fn.__name__)
    if not is_initialized():
        return fn(*args)  # the non-distributed answer: no loop needed
    _check_group_loop()
    lt = _running()
    loop = lt.loop
    assert loop is not None
    # Made here, but only ever settled (and its callbacks run) on the loop's thread.
    work: Work[T] = Work.pending(loop, fn.__name__)

    def start() -> None:
        try:
            started = fn(*args)
        except Exception as exc:
            work.set_exception(exc)  # the caller sees it through the handle
            return
        started.when_done(work.settle_as)  # at once: no extra loop turn

    # Counted until it started (``handoff.quiet``): metrics take their number after it.
    handoff.call_soon(loop, start)
    return work


def _transfer(work: Work[Any], box: Future[Any]) -> None:
    try:
        result = work.result()
    except BaseException as exc:  # the operation's error (or cancellation) goes to the caller
        box.set_exception(exc)
    else:
        box.set_result(result)


def is_running() -> bool:
    """True while this process has the loop thread running."""
    current = _current
    return current is not None and current.thread.is_alive()


def loop_thread() -> threading.Thread | None:
    """The loop thread, or None when it is not running."""
    current = _current
    return None if current is None else current.thread


def stop(only: _LoopThread | None = None) -> None:
    """Stop the loop thread (only ``only``, if given and still current); a no-op when stopped.

    Blocking calls still running on the loop are cancelled. Call
    ``destroy_process_group`` first: the default group lives on this loop.
    """
    global _current
    with _lock:
        lt = _current
        if lt is None or (only is not None and lt is not only):
            return
        _current = None
    lt.close()


async def _destroy_abandoned(exc: BaseException | None) -> None:
    group = get_default_group()
    if group is not None:
        group.session.abandon()
        group.session.end_with(exc)
    await destroy_process_group()


def _abandon(lt: _LoopThread, exc: BaseException | None = None) -> None:
    """Close the default group at once, failing what is in flight (the caller was interrupted).

    ``exc``: the exception ending the program, if it is ending (the peers hear why).
    """
    if default_group_loop() is not lt.loop or lt.portal is None:
        return
    try:
        with _under_way():
            lt.portal.call(_destroy_abandoned, exc)
    except Exception:
        logger.exception("closing the default process group after an interrupt failed")


def _at_exit(last: BaseException | None) -> None:
    """The program ends (``last``: the exception it ends with, see ``_group.ending``)."""
    lt = _current
    if lt is None or lt.pid != os.getpid():
        return
    try:
        if isinstance(last, BaseException) and (interrupted(last) or failure_of(last)):
            # Ctrl-C in a Work.wait(), or an exception: do not wait for what is in flight,
            # and tell the peers that this rank failed (``_group.ending``).
            _abandon(lt, last)
        if default_group_loop() is lt.loop:
            call(destroy_process_group)
    except Exception:
        logger.exception("destroying the default process group at exit failed")
    finally:
        stop()


def _forget_after_fork() -> None:
    # Threads do not survive fork: the child starts its own loop thread on first use.
    global _current, _lock
    _current = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


class GroupMethods:
    """torch's ``ProcessGroup`` methods on aiodist's groups (``_group.group.Methods``).

    On an event loop's thread (async code) a method starts its operation
    there; from any other thread it starts it on the loop thread, as
    ``aiodist.sync``'s functions do. It returns the running ``Work``, except
    where torch's method blocks: then plain code waits for it first.
    """

    def monitored_barrier(
        self, group: ProcessGroup, timeout: float | timedelta | None, wait_all_ranks: bool
    ) -> Work[None]:
        work = _start(monitored_barrier, group, timeout, wait_all_ranks)
        if not _on_a_loop():
            work.wait()  # torch's blocks
        return work

    def allreduce(self, group: ProcessGroup, tensors: Any, opts: Any) -> Work[Any]:
        if isinstance(tensors, list | tuple):
            if len(tensors) != 1:
                raise ArgumentError(
                    f"ProcessGroup.allreduce takes one tensor (or a list of one), got "
                    f"{len(tensors)}; call it once per tensor, or all_reduce_coalesced"
                )
            (tensors,) = tensors
        return _start(all_reduce, tensors, options_op(opts), group)


def _start(fn: Callable[..., Work[T]], /, *args: Any) -> Work[T]:
    """``fn(*args)``, started here in async code, else on the loop thread: its ``Work``."""
    if _on_a_loop():
        return fn(*args)
    work = submit(fn, *args, async_op=True)
    assert isinstance(work, Work)
    return work


def _on_a_loop() -> bool:
    return running_loop() is not None


ProcessGroup.methods = GroupMethods()
