"""Tasks that see their work through when the event loop they run on ends.

``asyncio.run`` and ``anyio.run`` end by cancelling every task still pending,
with the loop stopped, and then running the loop until those tasks are done.
For aiodist's own tasks that cancellation is the wrong end: a process group's
holder would drop its members without leaving the job (its peers would see a
crash), an embedded rendezvous server would go away under the other ranks,
and an operation in flight would stop halfway through an exchange its peers
take part in (DESIGN: cancelling the awaiting task never cancels the operation).

A ``LingeringTask`` tells that cancellation apart from every other one: it
comes while the loop is *not running* (every other cancel comes from code
running on the loop: a cancel scope, a deadline, ``wait_for``). It then calls
``on_shutdown`` (the group's holder starts leaving the job, as
``destroy_process_group`` makes it) instead of cancelling, and the loop's
shutdown waits for the task to finish. Everything such a task waits for is
bounded: an operation by its group's deadline and by the close of its
session (``CLOSE_GRACE``), the group's holder by the close itself. Should
one still run ``SHUTDOWN_LIMIT`` seconds into the shutdown, it is cancelled
after all: nothing of aiodist's holds a process's exit longer.

What this cannot protect is the loop's own tasks: asyncio's selector loop
accepts each incoming connection in a task, and the shutdown cancels those
too. A connection a peer opens in the last turns of a rank's loop (its first
message to that rank, sent just as the rank's ``asyncio.run`` ends) can be
dropped; the peer then sees the rank fail. Ranks that exchanged anything
before are connected already; uvloop accepts without tasks.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

T = TypeVar("T")

#: Seconds into its loop's shutdown after which a lingering task is cancelled after all
#: (above the longest leave: operations' close grace, leaving, an embedded server's linger).
SHUTDOWN_LIMIT: Final = 120.0


class LingeringTask(asyncio.Task[T]):
    """A task that its loop's shutdown does not cancel (see the module docstring).

    Args:
        coro: What the task runs.
        loop: Its event loop.
        name: The task's name.
        on_shutdown: Called (on the thread that shuts the loop down) instead of
            cancelling; None simply lets the task run on.
    """

    def __init__(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        loop: asyncio.AbstractEventLoop,
        name: str | None = None,
        on_shutdown: Callable[[], object] | None = None,
    ) -> None:
        super().__init__(coro, loop=loop, name=name)
        self._on_shutdown = on_shutdown
        self._lingering = False  # its loop's shutdown asked it to end

    def cancel(self, msg: Any | None = None) -> bool:
        if self.get_loop().is_running() or self.done():
            return super().cancel(msg)
        # The loop's shutdown (asyncio.run's end): finish instead; it waits for us.
        if not self._lingering:
            self._lingering = True
            self.get_loop().call_later(SHUTDOWN_LIMIT, self._give_up)
            if self._on_shutdown is not None:
                self._on_shutdown()
        return False

    def _give_up(self) -> None:
        if not self.done():
            super().cancel("still running long after its event loop began to shut down")


def linger(
    coro: Coroutine[Any, Any, T],
    *,
    name: str | None = None,
    on_shutdown: Callable[[], object] | None = None,
) -> LingeringTask[T]:
    """Run ``coro`` as a ``LingeringTask`` on the running loop (as ``asyncio.ensure_future``)."""
    return LingeringTask(coro, loop=asyncio.get_running_loop(), name=name, on_shutdown=on_shutdown)


def hand_over(started: asyncio.Future[Any], exc: BaseException) -> bool:
    """A group's holder task failed: give ``exc`` to whoever waits for ``started``.

    Returns True when the error was handed over (the holder then ends quietly:
    its caller raises it), False when the holder should raise it itself (its
    group was up already, or it was cancelled: ``started`` is cancelled too).
    """
    if started.done():
        return False
    if isinstance(exc, asyncio.CancelledError):
        started.cancel()
        return False
    started.set_exception(exc)
    return True


async def hold(
    holder: Coroutine[Any, Any, None],
    started: asyncio.Future[Any],
    *,
    name: str,
    on_shutdown: Callable[[], object],
) -> LingeringTask[None]:
    """Run a group's ``holder`` as a lingering task; return it once ``started`` is set.

    Raises:
        What kept the holder from starting (``hand_over``), the task ended first.
    """
    task = LingeringTask(
        holder, loop=asyncio.get_running_loop(), name=name, on_shutdown=on_shutdown
    )
    try:
        await started
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    return task
