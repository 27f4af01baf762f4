"""A job's data-plane traffic, as its ranks report it, and a bounded history of its rates.

Ranks move their data between themselves, never through the server; each
heartbeat of a member carries the ``[messages, bytes]`` its data plane sent
its peers since it joined (``Heartbeat.where``, bounded in ``_wire/bounds.py``).
``Traffic.heard`` adds what a member sent since its previous report to its
job's totals, and, at most once every ``HISTORY_INTERVAL`` seconds, keeps a
point ``(time, messages, bytes)`` of the totals: the last ``HISTORY_POINTS``
of them make the rates the dashboard shows and plots.

What it costs: a few float operations per heartbeat, and at most
``HISTORY_POINTS + 1`` points of three floats per job (about 3.6 KiB), kept
in one preallocated array.

Sans-IO, like the job table: the caller gives the time.
"""

from __future__ import annotations

from array import array
from typing import Any, Final, Protocol

#: The least time between two points of a job's history, in seconds.
HISTORY_INTERVAL: Final = 2.0
#: Intervals a job's history holds: five minutes of them.
HISTORY_POINTS: Final = 150
_SLOTS: Final = HISTORY_POINTS + 1  # points; the rates are between neighbours


class Reporter(Protocol):
    """A member as this module reads it (``jobs.Member``): what it reported last."""

    sent: tuple[int, int] | None


class Traffic:
    """One job's totals of what its members sent each other, and their recent history."""

    __slots__ = ("_count", "_points", "bytes", "messages")

    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0
        self._points = array("d", bytes(8 * 3 * _SLOTS))  # a ring of (time, messages, bytes)
        self._count = 0  # points kept in all; the newest is at (count - 1) % _SLOTS

    def heard(self, member: Reporter, sent: list[int], now: float) -> None:
        """``member`` reported ``sent`` (``[messages, bytes]`` since it joined) at ``now``.

        A member's first report after it re-attached to a server that came back
        sets where it counts from: what it sent before is not counted twice.
        """
        messages, nbytes = sent
        before = member.sent
        member.sent = (messages, nbytes)
        if before is not None:
            self.messages += max(0, messages - before[0])
            self.bytes += max(0, nbytes - before[1])
        if self._count == 0 or now - self._point(self._count - 1)[0] >= HISTORY_INTERVAL:
            i = 3 * (self._count % _SLOTS)
            self._points[i : i + 3] = array("d", (now, self.messages, self.bytes))
            self._count += 1

    def _point(self, k: int) -> tuple[float, float, float]:
        i = 3 * (k % _SLOTS)
        p = self._points
        return p[i], p[i + 1], p[i + 2]

    def _rate(self, k: int) -> tuple[float, float]:
        # Messages and bytes per second from point k - 1 to point k.
        t0, m0, b0 = self._point(k - 1)
        t1, m1, b1 = self._point(k)
        span = t1 - t0
        return (m1 - m0) / span, (b1 - b0) / span

    def summary(self) -> dict[str, Any]:
        """The totals, and the rates over the latest interval of the history (0 before one)."""
        rates = self._rate(self._count - 1) if self._count >= 2 else (0.0, 0.0)
        return {
            "messages": self.messages,
            "bytes": self.bytes,
            "messages_per_second": rates[0],
            "bytes_per_second": rates[1],
        }

    def history(self, now: float) -> list[list[float]]:
        """``[seconds ago, messages/s, bytes/s]`` per interval kept, oldest first (at most
        ``HISTORY_POINTS``); each interval is dated by its end."""
        first = max(1, self._count - HISTORY_POINTS)
        out = []
        for k in range(first, self._count):
            messages, nbytes = self._rate(k)
            ago = max(0.0, now - self._point(k)[0])
            out.append([round(ago, 1), round(messages, 1), round(nbytes)])
        return out
