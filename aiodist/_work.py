"""``Work``: the handle every operation returns.

An operation starts when its function is called; the handle reports on it.
Awaiting a handle never cancels the operation: peers take part in it, so it
runs its course (``await`` is shielded, as anyio's worker threads are).
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from aiodist._errors import DistTimeoutError

if TYPE_CHECKING:
    from collections.abc import Callable, Generator

__all__ = ["Work"]

T = TypeVar("T")
_UNSET: Any = object()


class Work(Generic[T]):
    """A running (or finished) operation.

    Example:
        >>> w = aiodist.all_reduce(t)      # already running
        >>> ...                            # overlap compute here
        >>> await w                        # or w.wait() from another thread
    """

    __slots__ = ("_future", "_loop", "_value", "description")

    def __init__(self, future: asyncio.Future[T] | None, description: str, value: Any = _UNSET):
        self._future = future
        self._loop = future.get_loop() if future is not None else None
        self._value = value
        self.description = description

    @classmethod
    def completed(cls, value: T, description: str = "completed") -> Work[T]:
        """A handle that is already done with ``value`` (the non-distributed answer)."""
        return cls(None, description, value)

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "running"
        return f"<Work {self.description} {state}>"

    def __await__(self) -> Generator[Any, None, T]:
        """Wait for the result.

        Cancellation:
            Cancelling the awaiting task leaves the operation running to completion.
        """
        if self._future is None:
            return self._value  # type: ignore[no-any-return]
            yield  # pragma: no cover - makes this a generator
        return (yield from asyncio.shield(self._future).__await__())

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not. Never blocks."""
        return self._future is None or self._future.done()

    def result(self) -> T:
        """The result of a completed operation.

        Raises:
            RuntimeError: Still running.
            DistError: The operation's error.
        """
        if self._future is None:
            return cast("T", self._value)
        if not self._future.done():
            raise RuntimeError(f"{self.description} has not completed; await it or call wait()")
        return self._future.result()

    def exception(self) -> BaseException | None:
        """The operation's error, or None. Raises ``RuntimeError`` while running."""
        if self._future is None:
            return None
        if not self._future.done():
            raise RuntimeError(f"{self.description} has not completed")
        return self._future.exception()

    def add_done_callback(self, fn: Callable[[Work[T]], object]) -> None:
        """Call ``fn(self)`` on the event loop once the operation finished."""
        if self._future is None:
            fn(self)
        else:
            self._future.add_done_callback(lambda _: fn(self))

    def wait(self, timeout: float | None = None) -> T:
        """Block this thread until done and return the result (from any thread but the loop's).

        Raises:
            RuntimeError: Called on the event loop's own thread (it would deadlock;
                ``await`` the handle there instead), even once done; or the loop
                closed before the operation completed.
            DistTimeoutError: Not done within ``timeout`` seconds (the operation goes on).
        """
        future, loop = self._future, self._loop
        # Raise on the loop's thread even when already done, so that whether it
        # raises does not depend on timing (anyio's portal does the same).
        if loop is not None and loop.is_running() and _running_loop() is loop:
            raise RuntimeError(
                f"Work.wait() on the event loop's thread would deadlock; use `await` on "
                f"{self.description}"
            )
        if future is None or future.done():
            return self.result()
        assert loop is not None
        if loop.is_closed():
            raise RuntimeError(
                f"{self.description} can never complete: its event loop was closed first"
            )
        done = threading.Event()
        loop.call_soon_threadsafe(future.add_done_callback, lambda _: done.set())
        if not done.wait(timeout):
            raise DistTimeoutError(f"{self.description} did not complete within {timeout} s")
        return self.result()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
