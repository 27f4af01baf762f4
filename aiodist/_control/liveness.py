"""When a rank counts its server as gone, and how long its loop stalled.

The control connection sends a heartbeat at least every ``interval``
seconds and the server echoes each; ``Liveness`` keeps the rules, sans-IO
(the caller gives the time), and ``Heartbeats`` is the timer that drives
them for one connection:

- A server that has echoed a heartbeat, and then leaves one unanswered for
  ``silence_limit`` seconds, is gone. Silence is counted from a heartbeat,
  not from the last thing heard: a loop that was busy sent none, and the
  server had nothing to answer. A server that never echoes is never counted
  as gone for silence.
- A loop that stops (SIGSTOP, a debugger, a blocking call) sends no heartbeat
  meanwhile: how late each one ran is the stall this process can report
  (``Heartbeats.stalled_for``, asked before every operation: no call more).
- A server heard again after a silence of ``SERVER_STALL`` s or more may have
  stood still (``resumed_at``): the server then counts a member whose
  connection dropped meanwhile as away, not failed, for its re-attach window
  (``_server/reattach.py``), and its verdict on that member comes that late.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

from aiodist._wire.timing import STALL_GAP

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable


# Below the server's own threshold: a stall it counts shows here as a silence a little
# shorter (its last word came before it stopped); a server that echoes each heartbeat
# (every interval, 1 s by default) is never this silent otherwise.
SERVER_STALL: Final = STALL_GAP / 2


class Liveness:
    """One connection's heartbeats: the server's silence and the loop's stalls."""

    __slots__ = (
        "beat_due",
        "echoed",
        "interval",
        "last_heard",
        "longest_stall",
        "resumed_at",
        "silence_limit",
        "unanswered_since",
    )

    def __init__(self, now: float) -> None:
        self.interval = 0.0  # 0: no heartbeats yet
        self.silence_limit = math.inf  # the shortest heartbeat timeout of the members
        self.echoed = False  # the server echoed one: from now on its silence counts
        self.last_heard = now
        self.resumed_at = -math.inf  # when the server was last heard after SERVER_STALL s
        # When the oldest heartbeat that nothing was heard after went out (None: none such).
        self.unanswered_since: float | None = None
        self.beat_due = 0.0  # when the next heartbeat is due
        self.longest_stall = 0.0  # the longest this loop ever ran one late

    def watch(self, timeout: float) -> bool:
        """A member asks that a silence of ``timeout`` seconds count as the server gone.

        Returns True the first time: send a heartbeat at once, so that the echo
        comes back before the join's reply and the watch starts with the membership.
        """
        first = self.silence_limit == math.inf
        self.silence_limit = min(self.silence_limit, timeout)
        return first

    def heard(self, now: float) -> None:
        """The server sent something."""
        if now - self.last_heard >= SERVER_STALL:
            self.resumed_at = now
        self.last_heard = now

    def scheduled(self, now: float) -> None:
        """The next heartbeat's timer was set, ``interval`` from ``now``."""
        self.beat_due = now + self.interval

    def sent(self, now: float) -> None:
        """A heartbeat went out."""
        if self.unanswered_since is None:
            self.unanswered_since = now

    def beat(self, now: float) -> float | None:
        """The heartbeat's timer fired: the server's silence if it is gone, else None (send one)."""
        self.longest_stall = max(self.longest_stall, now - self.beat_due)
        since = self.unanswered_since
        if since is not None and self.last_heard >= since:
            since = self.unanswered_since = None  # answered
        silent = 0.0 if since is None else now - since
        return silent if self.echoed and silent > self.silence_limit else None


class Heartbeats:
    """The heartbeat timer of one connection, on its ``Liveness`` (``rules``).

    A timer, not a task: a process with many members pays no task per member,
    and one heartbeat keeps every member of the connection alive. ``send``
    sends one; ``silent(seconds)`` reports the server gone; ``closed()`` says
    the connection is.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        send: Callable[[], None],
        silent: Callable[[float], None],
        closed: Callable[[], bool],
    ) -> None:
        self.loop = loop
        self.rules = Liveness(loop.time())
        self._send, self._silent, self._closed = send, silent, closed
        self._timer: asyncio.TimerHandle | None = None

    def start(self, interval: float, timeout: float | None) -> None:
        """Beat at least every ``interval`` s; with ``timeout``, watch the server's silence.

        The first heartbeat goes one interval from now (the server counts any
        message as one), except that the first call with a ``timeout`` sends one
        at once (see ``Liveness.watch``).
        """
        rules = self.rules
        if timeout is not None and rules.watch(timeout) and not self._closed():
            self.send_one()
        if self._timer is not None and rules.interval <= interval:
            return
        self.stop()
        rules.interval = interval
        self._schedule()

    def send_one(self) -> None:
        self._send()
        self.rules.sent(self.loop.time())

    def stalled_for(self) -> float:
        """The longest this process's loop has run its heartbeat late, in seconds.

        Counted now too (a heartbeat overdue right now): after a stop, the loop may
        handle what arrived meanwhile before it runs its timers. The process sent
        nothing for at least that long: a stall well past the heartbeat timeout means
        the server declared its members failed meanwhile.
        """
        rules = self.rules
        overdue = self.loop.time() - rules.beat_due if self._timer is not None else 0.0
        return max(rules.longest_stall, overdue)

    def stop(self) -> None:
        if self._timer is not None:
            # A heartbeat overdue now still counts: a loop resumed after a stop may see
            # its connection go (and this timer stop) before the timer ever runs.
            rules = self.rules
            rules.longest_stall = max(rules.longest_stall, self.loop.time() - rules.beat_due)
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        self.rules.scheduled(self.loop.time())
        self._timer = self.loop.call_later(self.rules.interval, self._beat)

    def _beat(self) -> None:
        silent = self.rules.beat(self.loop.time())
        if self._closed():
            self._timer = None
        elif silent is not None:
            self._timer = None
            self._silent(silent)
        else:
            self.send_one()
            self._schedule()
