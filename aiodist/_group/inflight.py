"""Operations in flight: the deadlines of a group's operations, under one timer.

An operation runs one of two ways, and ends the same way (``ProcessGroup``):

- **driven by callbacks**: ``ProcessGroup.begin`` gives its handle, the
  operation posts its receives and writes its sends at once, and the data
  plane's callbacks settle the ``Work`` when the last message is in. No task,
  no coroutine, no timer of its own. Point-to-point and small collectives run so;
- **as a task** (``ProcessGroup.drive``, the awaitable form of the same): a
  coroutine settles the handle when it returns or raises.

Either way a failure goes through ``ProcessGroup.fail``, which keeps the
group's rules: a collective that fails breaks its group on every member, and
every member reports the group's first error. Whoever settles a handle first
wins; a task driving one stops when its handle is settled by anyone else (a
deadline, a member's abort).

**Deadlines.** A group's operations all get the group's timeout, so their
deadlines come in start order: ``Deadlines`` keeps them in a deque with **one**
timer, armed for the oldest operation still running. Most operations finish
long before it fires; when it does, it drops finished entries and re-arms for
the next running one. An operation past its deadline is handed to its group's
``expired``: it fails with ``DistTimeoutError`` and breaks its group.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiodist._wire.keys import call_of

if TYPE_CHECKING:
    import asyncio

    from aiodist._group.work import Work

# Entries kept before dropping finished ones behind a long-running operation.
_COMPACT_AT: Final = 1024


class Timed(Protocol):
    """What ``Deadlines`` needs of whom it times for (``ProcessGroup``, the rpc agent)."""

    @property
    def timeout(self) -> float: ...

    def expired(self, work: Work[Any], seq: int) -> None:
        """``work`` (``seq`` as added) is past its deadline: fail it (a group breaks too)."""
        ...


class Deadlines:
    """One group's running operations in start order, with one timer for all of them."""

    __slots__ = ("_entries", "_group", "_handle", "_limit")

    def __init__(self, group: Timed) -> None:
        self._group = group
        self._entries: deque[tuple[float, Work[Any], int]] = deque()
        self._handle: asyncio.TimerHandle | None = None
        self._limit = _COMPACT_AT

    def add(self, loop: asyncio.AbstractEventLoop, work: Work[Any], seq: int) -> None:
        """Time ``work`` (operation ``seq``) out after the group's timeout."""
        entries = self._entries
        while entries and entries[0][1].is_completed():
            entries.popleft()
        deadline = loop.time() + self._group.timeout
        entries.append((deadline, work, seq))
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

    def running_call(self, call: int) -> list[Work[Any]]:
        """The operations of call ``call`` (itself and its parts) not finished yet."""
        return [w for _, w, seq in self._entries if call_of(seq) == call and not w.is_completed()]

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = None
        now = loop.time()
        while self._entries:  # re-read: expiring may start or compact
            deadline, work, seq = self._entries[0]
            if work.is_completed():
                self._entries.popleft()
                continue
            if deadline > now:
                break
            self._entries.popleft()
            self._group.expired(work, seq)
        if self._entries and self._handle is None:
            self._handle = loop.call_at(self._entries[0][0], self._sweep, loop)

    def close(self) -> None:
        """Stop the timer (the group is gone; its operations failed already)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
