"""A job's notices: telling its members who left and who failed, a batch per interval.

- A member that leaves a formed job cleanly is told to the others
  (``MembersLeft``), at most one notice per ``LEAVE_NOTICE_INTERVAL``: the
  leaves in between go together with the next one.
- Failures are told the same way: the first at once (``MemberFailed``), those
  after it within ``FAILURE_NOTICE_INTERVAL`` together (``MembersFailed``).
  A failed member still connected (it missed heartbeats) is told too.
- The intervals stretch for jobs of more than ``NOTICE_FANOUT`` members (each
  notice is a send to every member), up to ``MAX_NOTICE_INTERVAL``: a job of N
  members ending or dying at once costs O(N) notices, not O(N^2).
- ``flush`` sends what is held back at once (before a newcomer's join, so that
  every member counts the epochs in the server's order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

import msgpack

from aiodist._wire.messages import MemberFailed, MembersFailed, MembersLeft, Packed

if TYPE_CHECKING:
    from collections.abc import Iterable

    from aiodist._server.parts import MemberView, Outbox

# The least time between two notices of members that left one job (the first goes at once).
LEAVE_NOTICE_INTERVAL: Final = 0.1
# The same for failures: the first is told at once, those within the interval after it
# together (a job of N dying at once costs O(N) notices, not N^2: 8.4M for 4K members).
FAILURE_NOTICE_INTERVAL: Final = 0.05
# Members a notice may go to per interval before the next one waits longer, up to a
# second (failures are told within a second).
NOTICE_FANOUT: Final = 1024
MAX_NOTICE_INTERVAL: Final = 1.0


class _Job(Protocol):
    members: dict[Any, None]


@dataclass(eq=False, slots=True)
class _Planned:
    """A notice planned for when its interval ends."""

    failures: bool
    done: bool = False


class Notices:
    """The leaves and failures of one job not told yet, and when the next notice may go."""

    def __init__(self, job: _Job, out: Outbox) -> None:
        self._job = job
        self._out = out
        # ``[rank, host, pid]`` of leaves not announced yet, the planned notice, and when
        # the next notice may go.
        self._left: list[list[Any]] = []
        self._left_planned: _Planned | None = None
        self._next_left = 0.0
        # The same for failures: ``[rank, host, pid, reason]`` (the first of an interval
        # is told at once).
        self._failed: list[list[Any]] = []
        self._failed_planned: _Planned | None = None
        self._next_failed = 0.0

    def left(self, member: MemberView, now: float) -> None:
        """Tell the other members that ``member`` left, now or with the next notice."""
        self._left.append([member.rank, member.host, member.pid])
        if self._left_planned is not None:
            return  # a notice is planned: this leave goes with it
        if now >= self._next_left:
            self._send_left(now)
        else:
            planned = self._left_planned = _Planned(failures=False)
            self._out.at(self._next_left, planned, self._fire)

    def failed(self, member: MemberView, reason: str, now: float, *, connected: bool) -> None:
        """Tell every member that ``member`` failed (each breaks only the groups that
        contain it, so a later failure matters too); ``connected``: it is still
        connected, and is told too."""
        notice = MemberFailed(member.rank, member.host, member.pid, reason)
        if self._failed_planned is None and now >= self._next_failed:
            self._next_failed = now + self._interval(FAILURE_NOTICE_INTERVAL)
            self._tell(notice)
        else:
            self._failed.append([member.rank, member.host, member.pid, reason])
            if self._failed_planned is None:
                planned = self._failed_planned = _Planned(failures=True)
                self._out.at(self._next_failed, planned, self._fire)
        if connected:
            # A stopped or starved loop: told, so that when it runs again it says that it
            # was declared failed, whichever of its peers' goodbyes and this notice it
            # reads first.
            self._out.send(member.conn, notice)

    def flush(self, now: float) -> None:
        """Send what is held back now."""
        if self._left:
            self._send_left(now)
        if self._failed:
            self._send_failed(now)

    def ended(self) -> None:
        """Nobody is left to tell."""
        for planned in (self._left_planned, self._failed_planned):
            if planned is not None:
                planned.done = True

    # --- inside ---------------------------------------------------------------------------

    def _fire(self, planned: _Planned, now: float) -> None:
        if planned.failures:
            self._send_failed(now)
        else:
            self._send_left(now)

    def _send_left(self, now: float) -> None:
        if self._left_planned is not None:
            self._left_planned.done = True
            self._left_planned = None
        entries, self._left = self._left, []
        self._next_left = now + self._interval(LEAVE_NOTICE_INTERVAL)
        # Encoded once for the whole job: every member gets the same bytes.
        self._tell(MembersLeft(cast("list[Any]", Packed(msgpack.packb(entries)))))

    def _send_failed(self, now: float) -> None:
        if self._failed_planned is not None:
            self._failed_planned.done = True
            self._failed_planned = None
        entries, self._failed = self._failed, []
        if not entries:
            return
        self._next_failed = now + self._interval(FAILURE_NOTICE_INTERVAL)
        # Encoded once for the whole job: every member gets the same bytes.
        self._tell(MembersFailed(cast("list[Any]", Packed(msgpack.packb(entries)))))

    def _tell(self, notice: Any) -> None:
        for m in self._active():
            self._out.send(m.conn, notice)

    def _active(self) -> Iterable[MemberView]:
        return (m for m in self._job.members if m.status == "active")

    def _interval(self, base: float) -> float:
        """How long after one notice the next may go: ``base``, stretched for a job of
        more than ``NOTICE_FANOUT`` members, at most ``MAX_NOTICE_INTERVAL``."""
        return min(base * max(1.0, len(self._job.members) / NOTICE_FANOUT), MAX_NOTICE_INTERVAL)
