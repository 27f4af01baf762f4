"""The threads that run the plain functions remote calls name.

Not a ``ThreadPoolExecutor`` behind ``run_in_executor``: a call there costs
two futures chained across threads and one wake-up of the loop per result.
Here a job is handed to a thread through one queue, and its outcome comes
back in a deque that the loop drains: a wake-up for the first result of a
burst only, and the call's own callback (no task, no future) on the loop.

A thread starts when a job finds none free (up to ``max_threads``), so a slow
function never holds up another call while threads remain; threads are
daemons, so one stuck in a function does not keep the process from exiting.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable


def to_loop(
    loop: asyncio.AbstractEventLoop, loop_thread: int, fn: Callable[..., object], *args: Any
) -> None:
    """``fn(*args)`` on ``loop``'s thread: now if this is it, else soon (not once it closed)."""
    if threading.get_ident() == loop_thread:
        fn(*args)
        return
    with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for it any more
        loop.call_soon_threadsafe(fn, *args)


class Job:
    """One plain function to run; ``done(ok, value)`` is called on the loop with its outcome."""

    __slots__ = ("args", "cancelled", "done", "fn", "kwargs")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
        done: Callable[[bool, Any], None],
    ) -> None:
        self.fn, self.args, self.kwargs, self.done = fn, args, kwargs, done
        self.cancelled = False  # set on the loop: a job not started yet is skipped

    def run(self) -> tuple[bool, Any]:
        try:
            return True, self.fn(*self.args, **self.kwargs)
        except BaseException as exc:
            return False, exc


class Threads:
    """Daemon threads running ``Job``s, outcomes delivered to ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_threads: int, name: str) -> None:
        self._loop = loop
        self._max = max(1, max_threads)
        self._name = name
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._busy = 0  # jobs handed out and not drained yet (loop thread only)
        self._outcomes: collections.deque[tuple[Job, bool, Any]] = collections.deque()
        self._signalled = False
        self._closed = False

    def submit(self, job: Job) -> None:
        """Run ``job`` in a thread (on the loop's thread)."""
        self._busy += 1
        if len(self._threads) < min(self._busy, self._max):
            thread = threading.Thread(
                target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        self._jobs.put(job)

    def _work(self) -> None:
        jobs, outcomes = self._jobs, self._outcomes
        while True:
            job = jobs.get()
            if job is None:
                return
            ok, value = (True, None) if job.cancelled else job.run()
            outcomes.append((job, ok, value))
            # Waiting for the next job must not keep this one's arguments or result alive
            # (an RRef among them would keep its object alive on its owner).
            del job, value
            if not self._signalled:
                self._signalled = True
                try:
                    self._loop.call_soon_threadsafe(self._drain)
                except RuntimeError:  # the loop closed: nobody waits for outcomes
                    return

    def _drain(self) -> None:
        self._signalled = False  # first: an outcome appended from now on signals again
        outcomes = self._outcomes
        while outcomes:
            job, ok, value = outcomes.popleft()
            self._busy -= 1
            if not self._closed:
                job.done(ok, value)

    def close(self) -> None:
        """Stop the threads once their jobs end; outcomes after this are dropped."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        self._threads = []
