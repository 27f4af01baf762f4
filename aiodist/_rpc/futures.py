"""Handles in torch's form for plain code: ``torch.futures.Future``s that can be awaited too.

Plain code written for ``torch.distributed.rpc`` uses what ``rpc_async``
returns as a ``torch.futures.Future``: ``then``, ``wait``, ``value``,
``done``, ``add_done_callback``, ``torch.futures.wait_all`` and
``collect_all``. ``Future`` is one (a subclass), settled by the call's
``Work`` on the job's event loop, so its callbacks run on that loop's thread,
as TensorPipe runs them on the thread that completes a call: keep them short,
and do not block in them. It can also be awaited, on any event loop.

This module imports torch: the agent imports it only once plain code makes a
call.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from aiodist._errors import DistTimeoutError
from aiodist._rpc.threads import to_loop

if TYPE_CHECKING:
    from collections.abc import Generator

    from aiodist._group.work import Work

T = TypeVar("T")


class Future(torch.futures.Future[T]):
    """The result of a remote call, for plain code: a ``torch.futures.Future`` you may await.

    Example:
        >>> fut = rpc.rpc_async("worker1", torch.add, (x, y))
        >>> fut.then(lambda f: f.value() + 1).wait()
        >>> torch.futures.wait_all([fut, other])
    """

    __slots__ = ("_loop_thread",)

    def __init__(self, loop_thread: int) -> None:
        super().__init__()
        self._loop_thread = loop_thread  # the job's loop's: waiting there would deadlock

    def wait(self, timeout: float | None = None) -> T:
        """Block until the call completed; its result, or raise its error (torch's ``wait``).

        Args:
            timeout: Seconds to wait at most (aiodist's addition; None: no limit).

        Raises:
            RuntimeError: Not done, and called on the job's event-loop thread, which
                would deadlock (a callback there: chain with ``then`` instead).
            DistTimeoutError: Not done within ``timeout`` (the call goes on).
        """
        if not self.done():
            if threading.get_ident() == self._loop_thread:
                raise RuntimeError(
                    "Future.wait() on the job's event-loop thread would deadlock before the "
                    "call completed; chain with then() there, or await the future"
                )
            if timeout is not None:
                finished = threading.Event()
                self.add_done_callback(lambda _: finished.set())
                if not finished.wait(timeout):
                    raise DistTimeoutError(f"the remote call did not complete within {timeout} s")
        return super().wait()

    def __await__(self) -> Generator[Any, None, T]:
        """Wait for the result on the running event loop (any loop; nothing blocks)."""
        if not self.done():
            loop = asyncio.get_running_loop()
            here = threading.get_ident()  # the loop's thread
            waiter: asyncio.Future[None] = loop.create_future()

            def wake() -> None:
                if not waiter.done():
                    waiter.set_result(None)

            self.add_done_callback(lambda _: to_loop(loop, here, wake))
            yield from waiter.__await__()
        return super().wait()


def settle(future: torch.futures.Future[Any], work: Work[Any]) -> None:
    """Complete ``future`` with ``work``'s outcome (``work`` is done)."""
    error = work.exception()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(work.result())
