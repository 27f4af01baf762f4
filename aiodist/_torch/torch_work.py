"""The torch ``Work`` of a call on the aiodist backend: settled from aiodist's loop.

torch's callers wait on it in two ways: its ``wait()`` (torch's Python API,
which gets aiodist's error itself) and its future (DDP's reducer and its
communication hooks, in C++). The future must fail for both kinds of caller,
which torch's ``Future.set_exception`` does not do (see ``AiodistWork``).

The future's callbacks (``then``) run on the thread that completes it, and
torch's may block there: PowerSGD's hook starts the next all_reduce in one and
waits for it. So a future is never completed on aiodist's loop thread (whose
loop would then wait for itself) but on a ``Completer`` thread, one more of
which starts whenever every one is busy, as gloo's own threads run its callbacks.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import TYPE_CHECKING, Any

import torch
from torch._C._distributed_c10d import Work as TorchWork

from aiodist._errors import DistTimeoutError
from aiodist._group.work import running_loop, wait_event

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable
    from datetime import timedelta

    from aiodist._group.work import Work

logger = logging.getLogger(__name__)


class Completer:
    """Runs what completes torch futures, off aiodist's loop, on threads of its own.

    A thread starts whenever no thread of its is idle (callbacks may block, waiting
    for a later future), and stays for the next; daemon threads never hold the exit.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, fn: Callable[[], object]) -> None:
        with self._lock:
            start = not self._idle
            if not start:
                self._idle -= 1  # an idle thread takes it
        self._queue.put(fn)
        if start:
            threading.Thread(target=self._run, name="aiodist-torch-future", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                fn()
            except Exception:  # a torch callback's error: its future holds it already
                logger.debug("completing a torch future failed", exc_info=True)
            with self._lock:
                self._idle += 1


_completer = Completer()


def _forget_after_fork() -> None:
    # Threads do not survive fork: the child's idle count would name threads it lacks.
    global _completer
    _completer = Completer()


os.register_at_fork(after_in_child=_forget_after_fork)


class AiodistWork(TorchWork):
    """A torch ``Work`` for one aiodist operation (or several, for a coalesced call).

    Settled on aiodist's loop; waited for from any other thread. A call on a device
    part (``parts.py``) settles it from torch's work (``follow``), or from the loop
    with the group's error when the group breaks first, whichever comes first.
    """

    def __init__(self, value: Any, description: str, count: int = 1) -> None:
        super().__init__()
        self._value = value
        self._description = description
        # torch's Future.set_exception only marks the error for Python callers (it sets the
        # exception as the result); C++ ones (DDP's reducer) would take it for a value. A
        # callback that raises marks the future it returns failed for both: torch's ``Work``
        # future is that one, completed from ``_settled``.
        self._settled: Any = torch.futures.Future()
        self._future: Any = self._settled.then(self._outcome)
        self._done = threading.Event()
        self._left = count
        self._error: BaseException | None = None
        self._source = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._once = threading.Lock()
        self._inner: Any = None  # a device part's own torch Work, when it is one

    def __repr__(self) -> str:
        return f"<AiodistWork {self._description}>"

    # --- aiodist's side: on the loop's thread ------------------------------------------------

    def _part_done(self, work: Work[Any]) -> None:
        error = work.exception()
        if error is not None and self._error is None:
            self._error = error
        elif error is None and self._source < 0:
            value = work.result()
            if isinstance(value, int) and not isinstance(value, bool):
                self._source = value
        self._left -= 1
        if self._left == 0 or error is not None:
            self._finish()

    def _fail(self, error: BaseException) -> None:
        with self._once:
            if self._done.is_set():
                return
            if self._error is None:
                self._error = error
        self._finish()

    def _finish(self) -> None:
        with self._once:  # a device part's work and its group's break may race
            if self._done.is_set():
                return
            self._done.set()
        loop = self._loop
        if loop is not None and on_loop(loop):
            _completer.submit(lambda: self._settled.set_result(None))  # see the module's doc
        else:
            self._settled.set_result(None)

    def follow(
        self, torch_work: Any, failed: Callable[[Exception], BaseException] | None = None
    ) -> None:
        """Settle as ``torch_work`` (of a device part) does: its value, or its error.

        ``failed(exc)``, on torch's thread, gives the error to fail with instead of torch's.
        """

        def settled(fut: Any) -> None:  # on torch's thread
            try:
                value = fut.value()
            except Exception as exc:
                self._fail(exc if failed is None else failed(exc))
            else:
                with self._once:
                    if not self._done.is_set():
                        self._value = value
                self._finish()

        torch_work.get_future().add_done_callback(settled)

    def _outcome(self, _: Any) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    # --- torch's side -------------------------------------------------------------------------

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done; raise the operation's error (aiodist's, naming what failed)."""
        loop = self._loop
        if loop is not None and on_loop(loop):
            raise RuntimeError(ON_LOOP.format(what=f"waiting for {self._description}"))
        seconds = None
        if timeout is not None and timeout.total_seconds() > 0:
            seconds = timeout.total_seconds()
        if not wait_event(self._done, seconds):  # Ctrl-C interrupts it
            raise DistTimeoutError(f"{self._description} did not complete within {seconds} s")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Any:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source

    def synchronize(self) -> None:
        pass  # CPU tensors: nothing is left on a stream once done


ON_LOOP = (
    "{what} on aiodist's event-loop thread would wait for the loop itself: torch's calls on "
    "the aiodist backend block the calling thread. Make them from another thread (in async "
    "code, `await anyio.to_thread.run_sync(step)`), or use aiodist's async API on the loop"
)


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    return running_loop() is loop
