"""Operations in flight: how a group runs one, times it out, and reports how it ended.

An operation runs one of two ways, and ends the same way:

- as a **task** (``run_task``): ``op(seq)`` is a coroutine; anything goes;
- **driven by callbacks** (``ProcessGroup.begin``): point-to-point and small
  collectives post their receives and write their sends at once, and the
  data plane's callbacks settle the ``Work`` when the last message is in.
  No task, no coroutine, no timer of their own.

Either way a failure goes through ``fail``, which keeps the group's rules: a
collective that fails breaks its group on every member, and every member
reports the group's first error.

**Deadlines.** A group's operations all get the group's timeout, so their
deadlines come in start order: ``Deadlines`` keeps them in a deque with **one**
timer, armed for the oldest operation still running. Most operations finish
long before it fires; when it does, it drops finished entries and re-arms for
the next running one. An operation past its deadline fails with
``DistTimeoutError`` and breaks its group, as before; its task, if it has one,
is cancelled.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, Final, TypeVar

from aiodist._errors import AbortedError, DistError, DistTimeoutError, GroupBrokenError
from aiodist._group.lingering import LingeringTask
from aiodist._wire.keys import call_of

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work

__all__ = ["Deadlines", "fail", "run_task"]

T = TypeVar("T")

# Entries kept before dropping finished ones behind a long-running operation.
_COMPACT_AT: Final = 1024


class Deadlines:
    """One group's running operations in start order, with one timer for all of them."""

    __slots__ = ("_entries", "_group", "_handle", "_limit")

    def __init__(self, group: ProcessGroup) -> None:
        self._group = group
        self._entries: deque[tuple[float, Work[Any], asyncio.Task[None] | None, int]] = deque()
        self._handle: asyncio.TimerHandle | None = None
        self._limit = _COMPACT_AT

    def add(
        self,
        loop: asyncio.AbstractEventLoop,
        work: Work[Any],
        task: asyncio.Task[None] | None,
        seq: int,
    ) -> None:
        """Time ``work`` (operation ``seq``) out after the group's timeout, cancelling ``task``."""
        entries = self._entries
        while entries and entries[0][1].is_completed():
            entries.popleft()
        deadline = loop.time() + self._group.timeout
        entries.append((deadline, work, task, seq))
        if len(entries) > self._limit:
            # A long-running operation holds finished ones behind it: drop those.
            kept = [e for e in entries if not e[1].is_completed()]
            self._entries = deque(kept)
            self._limit = max(_COMPACT_AT, 2 * len(kept))
        if self._handle is None:
            self._handle = loop.call_at(deadline, self._sweep, loop)

    def running(self) -> list[Work[Any]]:
        """The operations not finished yet, in start order."""
        return [e[1] for e in self._entries if not e[1].is_completed()]

    def running_call(self, call: int) -> list[tuple[Work[Any], asyncio.Task[None] | None]]:
        """The operations of call ``call`` (itself and its parts) not finished yet."""
        return [
            (w, task)
            for _, w, task, seq in self._entries
            if call_of(seq) == call and not w.is_completed()
        ]

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = None
        now = loop.time()
        while self._entries:  # re-read: expiring may start or compact
            deadline, work, task, _ = self._entries[0]
            if work.is_completed():
                self._entries.popleft()
                continue
            if deadline > now:
                break
            self._entries.popleft()
            _expire(self._group, work, task)
        if self._entries and self._handle is None:
            self._handle = loop.call_at(self._entries[0][0], self._sweep, loop)

    def close(self) -> None:
        """Stop the timer (the group is gone; its operations failed already)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def _expire(g: ProcessGroup, work: Work[Any], task: asyncio.Task[None] | None) -> None:
    timed_out = DistTimeoutError(
        f"{work.description} on group {g.name!r} timed out after {g.timeout:.1f} s; a rank "
        "may not have called it, or may be stuck. The group is broken."
    )
    work._set_exception(timed_out)
    g.break_(timed_out)
    if task is not None:
        task.cancel()


def fail(g: ProcessGroup, work: Work[Any], exc: BaseException, *, collective: bool) -> None:
    """End ``work`` with ``exc`` by the group's rules (a failed collective breaks the group)."""
    if work.is_completed():
        return  # timed out, or failed by the group's error already
    if isinstance(exc, AbortedError):  # a member aborted this call: the group stays usable
        work._set_exception(exc)
        return
    if isinstance(exc, DistError):  # before TimeoutError: DistTimeoutError is one too
        if collective:
            # Tell the group's members why (a rank dying breaks a ring in several
            # places; the first cause should reach everyone, not a later symptom).
            g.break_(exc)
            if isinstance(exc, GroupBrokenError) and g.error is not None:
                exc = g.error  # the group's first error: the same on every member
    elif isinstance(exc, TimeoutError):  # an op's own wait ran out: the group's timeout rules
        exc = DistTimeoutError(
            f"{work.description} on group {g.name!r} timed out ({exc or 'no answer'}); a rank "
            "may not have called it, or may be stuck. The group is broken."
        )
        g.break_(exc)
    elif collective and isinstance(exc, Exception) and g.error is None:
        # Peers wait on this rank's part: tell them instead of letting them hang.
        g.break_(
            GroupBrokenError(
                f"{work.description} on group {g.name!r} failed on rank "
                f"{g.session.rank}: {type(exc).__name__}: {exc}; the group is "
                "broken. Restart the job."
            )
        )
    work._set_exception(exc)


async def run_task(
    g: ProcessGroup, work: Work[T], op: Callable[[int], Awaitable[T]], seq: int, collective: bool
) -> None:
    """Run ``op(seq)`` and settle ``work`` with how it ended."""
    try:
        result = await op(seq)
    except asyncio.CancelledError:
        if work.is_completed():
            return  # its deadline passed: _expire reported it and cancelled us
        work._set_exception(asyncio.CancelledError(f"{work.description} was cancelled"))
        raise
    except BaseException as exc:
        fail(g, work, exc, collective=collective)
        if not isinstance(exc, Exception):
            raise
    else:
        work._set_result(result)


def start_task(
    g: ProcessGroup,
    loop: asyncio.AbstractEventLoop,
    work: Work[T],
    op: Callable[[int], Awaitable[T]],
    seq: int,
    collective: bool,
    on_end: Callable[[], object] | None = None,
) -> None:
    """Run ``op(seq)`` as a task that settles ``work``, under the group's deadline.

    ``on_end()`` runs when the task is done, also when it was cancelled before
    ``op`` ever ran (an aborted call): the task's end, not the handle's, since
    ``op`` may still be unwinding when its handle fails.
    """
    # Lingering: the end of asyncio.run does not stop it halfway through (peers take part).
    task = LingeringTask(run_task(g, work, op, seq, collective), loop=loop)
    inflight = g.session.inflight
    inflight.add(task)
    task.add_done_callback(inflight.discard)
    if on_end is not None:
        task.add_done_callback(lambda _: on_end())
    g.deadlines.add(loop, work, task, seq)
