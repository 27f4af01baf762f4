"""``Work``: the handle every operation returns.

An operation starts when its function is called; the handle reports on it.
Awaiting a handle never cancels the operation: peers take part in it, so it
runs its course (as anyio's worker threads do).

A handle is its own promise rather than a wrapper of an ``asyncio.Future``.
It has two sides:

- **the caller's**: ``await``, ``is_completed``, ``result``, ``wait``,
  ``add_done_callback`` (what torch's ``Work`` offers);
- **the operation's** (the producer: a collective, a receive, an rpc call):
  ``Work.pending(loop, description)`` makes a running handle, and the operation
  settles it once, on the loop's thread, with ``set_result`` or
  ``set_exception`` (or ``settle_as``, the way another handle ended);
  ``when_done`` runs a listener inside whatever settles it (bookkeeping that
  must not wait a loop turn). Settling a settled handle changes nothing and
  returns False: a deadline and a late reply may both try.

Settling wakes the tasks awaiting the handle directly. Each ``await`` of a
running handle waits on a future of its own, so cancelling one awaiting task
cancels that future only (what ``asyncio.shield`` gives, without its extra
future and loop turn). A handle that is already done when awaited returns
without suspending.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from aiodist._errors import DistTimeoutError
from aiodist._group.polling import poller
from aiodist._group.recorder import TRACED, wait_ended, wait_started

if TYPE_CHECKING:
    from collections.abc import Callable, Generator
    from concurrent.futures import Future

T = TypeVar("T")
_UNSET: Any = object()


class Work(Generic[T]):
    """A running (or finished) operation.

    Example:
        >>> w = aiodist.all_reduce(t)      # already running
        >>> ...                            # overlap compute here
        >>> await w                        # or w.wait() from another thread
    """

    __slots__ = (
        "_done",
        "_error",
        "_listeners",
        "_loop",
        "_value",
        "_waiters",
        "_withdraw",
        "description",
    )

    def __init__(
        self,
        future: asyncio.Future[T] | None,
        description: str,
        value: Any = _UNSET,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        """Follow ``future``; with None, a handle done with ``value`` or (``loop``) a pending one.

        aiodist's operations make pending handles with ``Work.pending`` and settle
        them; a handle that follows a future settles when the future does.
        """
        self.description = description
        self._loop = future.get_loop() if future is not None else loop
        self._value: Any = None
        self._error: BaseException | None = None
        self._done = future is None and loop is None
        if self._done:
            self._value = None if value is _UNSET else value
        self._waiters: list[asyncio.Future[None]] | None = None
        self._listeners: list[Callable[[Work[T]], object]] | None = None
        self._withdraw: Callable[[], bool] | None = None
        if future is not None:
            future.add_done_callback(self._follow)

    @classmethod
    def completed(cls, value: T, description: str = "completed") -> Work[T]:
        """A handle that is already done with ``value`` (the non-distributed answer).

        :meta private:
        """
        return cls(None, description, value)

    @classmethod
    def failed(cls, exc: BaseException, description: str = "failed") -> Work[T]:
        """A handle that is already done with the error ``exc``.

        :meta private:
        """
        work: Work[T] = cls(None, description)
        work._value = None
        work._error = exc
        return work

    @classmethod
    def pending(cls, loop: asyncio.AbstractEventLoop, description: str) -> Work[T]:
        """A running handle that the operation settles on ``loop``'s thread.

        :meta private:
        """
        return cls(None, description, loop=loop)

    def __repr__(self) -> str:
        state = "done" if self._done else "running"
        return f"<Work {self.description} {state}>"

    # --- the operation's side: settling, on the loop's thread ---------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the operation settles this handle on (None: made done).

        :meta private:
        """
        return self._loop

    def set_result(self, value: T) -> bool:
        """Settle with ``value``; False (and no change) if already done.

        For the operation that made the handle (``Work.pending``), on its loop's thread.

        :meta private:
        """
        if self._done:
            return False
        self._value = value
        self._done = True
        self._wake()
        return True

    def set_exception(self, exc: BaseException) -> bool:
        """Settle with the error ``exc``; False (and no change) if already done.

        For the operation that made the handle, on its loop's thread.

        :meta private:
        """
        if self._done:
            return False
        self._error = exc
        self._done = True
        self._wake()
        return True

    def settle_as(self, done: Work[T]) -> None:
        """Settle the way ``done`` (another handle, finished) ended: a ``when_done`` listener.

        :meta private:
        """
        error = done.exception()
        if error is not None:
            self.set_exception(error)
        else:
            self.set_result(done.result())

    def withdrawable(self, withdraw: Callable[[], bool]) -> None:
        """Let ``cancel`` take the operation back with ``withdraw()`` (True: taken back).

        For an operation that can be withdrawn before it matched (a receive).

        :meta private:
        """
        self._withdraw = withdraw

    def _follow(self, future: asyncio.Future[T]) -> None:
        if future.cancelled():
            self.set_exception(asyncio.CancelledError(f"{self.description} was cancelled"))
        elif (exc := future.exception()) is not None:
            self.set_exception(exc)
        else:
            self.set_result(future.result())

    def _wake(self) -> None:
        waiters, listeners = self._waiters, self._listeners
        self._waiters = self._listeners = None
        if waiters is not None:
            for waiter in waiters:
                if not waiter.done():  # a cancelled awaiter's future is done already
                    waiter.set_result(None)
        if listeners is not None:
            for fn in listeners:
                fn(self)

    def when_done(self, fn: Callable[[Work[T]], object]) -> None:
        """Call ``fn(self)`` as soon as the operation finished, inside whatever settles it.

        For the operations' own bookkeeping: ``fn`` runs on the loop's thread (at
        once if already done) and must not raise. Users want ``add_done_callback``.

        :meta private:
        """
        if self._done:
            fn(self)
        elif self._listeners is None:
            self._listeners = [fn]
        else:
            self._listeners.append(fn)

    # --- the public handle --------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, T]:
        """Wait for the result.

        Cancellation:
            Cancelling the awaiting task leaves the operation running to completion.
        """
        if not self._done:
            assert self._loop is not None
            waiter: asyncio.Future[None] = self._loop.create_future()
            if self._waiters is None:
                self._waiters = [waiter]
            else:
                self._waiters.append(waiter)
            polling = poller(self._loop)
            polling.wait_started()
            traced = wait_started(self) if TRACED else None  # a trace shows the wait
            try:
                yield from waiter.__await__()
            finally:
                polling.wait_ended()
                if traced is not None:
                    wait_ended(traced)
        return self.result()

    def cancel(self) -> bool:
        """Withdraw an operation that has not started to complete (``MPI_Cancel``).

        Only a receive (``irecv``, ``irecv_object``, ``recv_object``) that no
        message has matched yet can be withdrawn: a message sent to it later goes
        to the next matching receive instead. The handle then fails with
        ``asyncio.CancelledError``. Anything else (a send, a collective, a receive
        that matched) runs its course, since peers take part in it. Callable from
        any thread.

        Returns:
            True if the operation was withdrawn; False if it could not be (or ended).

        Example:
            >>> w = aiodist.irecv_object(src=0, tag=9)
            >>> try:
            ...     obj = await asyncio.wait_for(w, 0.3)
            ... except TimeoutError:
            ...     w.cancel()      # the next message with tag 9 is not lost to it
        """
        loop = self._loop
        if self._done or self._withdraw is None or loop is None:
            return False
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if not on_loop:
            return bool(asyncio.run_coroutine_threadsafe(self._cancel_async(), loop).result())
        return self._cancel_now()

    async def _cancel_async(self) -> bool:
        return self._cancel_now()

    def _cancel_now(self) -> bool:
        if self._done or self._withdraw is None or not self._withdraw():
            return False
        self._withdraw = None
        return self.set_exception(asyncio.CancelledError(f"{self.description} was withdrawn"))

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not. Never blocks."""
        return self._done

    def result(self) -> T:
        """The result of a completed operation.

        Raises:
            RuntimeError: Still running.
            DistError: The operation's error.
        """
        if not self._done:
            raise RuntimeError(f"{self.description} has not completed; await it or call wait()")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]  # not cast(): a call on every await

    def exception(self) -> BaseException | None:
        """The operation's error, or None. Raises ``RuntimeError`` while running."""
        if not self._done:
            raise RuntimeError(f"{self.description} has not completed")
        return self._error

    def add_done_callback(self, fn: Callable[[Work[T]], object]) -> None:
        """Call ``fn(self)`` on the event loop once the operation finished.

        A handle that is already done calls ``fn`` at once.
        """
        if self._done:
            fn(self)
            return
        loop = self._loop
        assert loop is not None
        self.when_done(lambda w: loop.call_soon(fn, w))

    def is_success(self) -> bool:
        """True once the operation completed without an error (torch's ``Work.is_success``)."""
        return self._done and self._error is None

    def source_rank(self) -> int:
        """The sender's global rank of a completed receive (torch's ``Work.source_rank``).

        Raises:
            RuntimeError: Not a completed receive.
        """
        value = self._value if self._done and self._error is None else None
        if not isinstance(value, int) or isinstance(value, bool):
            raise RuntimeError(f"{self.description} is not a completed receive")
        return value

    #: torch's other name of ``source_rank``, the one its own code calls.
    _source_rank = source_rank

    def synchronize(self) -> None:
        """Block until done (torch's ``Work.synchronize``); raises the operation's error."""
        self.wait()

    def get_future(self) -> Any:
        """A ``torch.futures.Future`` completed with this operation's tensors (as torch's).

        Its value is a list of the output tensors (``[tensor]`` for an
        all_reduce, ``[]`` for a barrier, the gathered list for a gather), or
        the result itself when it holds no tensor; an error completes it with
        that error. ``.then()`` callbacks run on the thread that completes it
        (aiodist's loop thread): keep them short.
        """
        import torch

        future: Any = torch.futures.Future()

        def settle(work: Work[T]) -> None:
            if work._error is not None:
                future.set_exception(work._error)
            else:
                future.set_result(_torch_value(work._value))

        if self._done:
            settle(self)
        else:
            assert self._loop is not None
            loop = self._loop
            loop.call_soon_threadsafe(self.when_done, settle)
        return future

    def wait(self, timeout: float | timedelta | None = None) -> T:
        """Block this thread until done and return the result (from any thread but the loop's).

        ``timeout`` is in seconds, or a ``timedelta`` (torch's ``Work.wait``).

        Raises:
            RuntimeError: Called on the event loop's own thread (it would deadlock;
                ``await`` the handle there instead), even once done; or the loop
                closed before the operation completed.
            DistTimeoutError: Not done within ``timeout`` seconds (the operation goes on).
        """
        loop = self._loop
        # Raise on the loop's thread even when already done, so that whether it
        # raises does not depend on timing (anyio's portal does the same).
        if loop is not None and loop.is_running() and running_loop() is loop:
            raise RuntimeError(
                f"Work.wait() on the event loop's thread would deadlock; use `await` on "
                f"{self.description}"
            )
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        if self._done:
            return self.result()
        assert loop is not None
        if loop.is_closed():
            raise RuntimeError(
                f"{self.description} can never complete: its event loop was closed first"
            )
        if not self._done_on_loop(timeout):
            raise DistTimeoutError(f"{self.description} did not complete within {timeout} s")
        return self.result()

    def _done_on_loop(self, timeout: float | None) -> bool:
        """Block until the loop saw this handle done (False: not within ``timeout``).

        One loop turn after it settled: callbacks of handles that settled before
        it (scheduled with call_soon) have run by then.
        """
        loop = self._loop
        assert loop is not None
        done = threading.Event()
        loop.call_soon_threadsafe(self.when_done, lambda _: loop.call_soon(done.set))
        return wait_event(done, timeout)


def _torch_value(value: Any) -> Any:
    """A result as torch's futures carry it: the output tensors, in a list."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    if type(value).__name__ in ("Tensor", "Parameter"):
        return [value]
    return value


def running_loop() -> asyncio.AbstractEventLoop | None:
    """This thread's running event loop, or None (``asyncio.get_running_loop`` raises)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# How long a blocked thread sleeps at most before it looks for signals: the kernel may hand
# a process's SIGINT to any thread that does not block it (torch's, the program's own), and
# Python's handler then only marks it for the main thread, which a lock wait does not see.
SIGNAL_SLICE = 0.1


def wait_event(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)`` in slices, so that Ctrl-C interrupts it within one slice."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not event.is_set():
        left = SIGNAL_SLICE if deadline is None else min(SIGNAL_SLICE, deadline - time.monotonic())
        if left <= 0:
            return False
        event.wait(left)
    return True


def wait_future(future: Future[T]) -> T:
    """``future.result()``, looking for signals every ``SIGNAL_SLICE`` (see ``wait_event``)."""
    while True:
        try:
            return future.result(SIGNAL_SLICE)
        except TimeoutError:
            if future.done():  # the operation's own TimeoutError
                raise
