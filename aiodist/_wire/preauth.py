"""What a connection may cost before it proved itself (sans-IO: the caller gives the time).

Every listener of aiodist (the rendezvous server's, each rank's data-plane
listeners) admits its connections through a ``Gate``. A connection enters it
when accepted and leaves it once its handshake is done: the job's token
proved or, where there is no token, its hello accepted. Until then:

- its frames are decoded under ``PREAUTH_FRAME_LIMITS`` (a small header, no
  payload), and it may send ``max_bytes`` bytes in all;
- it is closed ``deadline`` seconds after it connected;
- it is one of at most ``max_pending`` such connections of that listener: a
  newcomer beyond that sheds the oldest (a real peer's handshake takes
  milliseconds, so the oldest is the likeliest stranger), and first the
  oldest that has said nothing yet (a real peer speaks as soon as it
  connects: its first frame is in flight before the accept; the I/O layer
  reports it with ``spoke``). So a stranger who holds silent connections,
  and reopens each one shed, never sheds a peer in the middle of its
  handshake, however many connections it holds;
- nothing else reads what it sends: no transport frame, no job table.

What it costs is then bounded by ``max_pending`` times ``max_bytes`` of memory
and ``max_pending`` file descriptors, however many strangers connect.

Refusals are logged through a ``LogBudget``: the first ``burst`` lines of each
interval in full, then one summary line per interval with counts by reason, so
a flood of strangers cannot fill a disk or block a rank on its stderr pipe.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from aiodist._wire.frame import KiB, Limits

#: Frames before the handshake: hellos, challenges and proofs are a few hundred bytes.
PREAUTH_FRAME_LIMITS: Final = Limits(max_header_bytes=4 * KiB, max_payload_bytes=0)

C = TypeVar("C")

#: The least cap on unproved connections, whatever the limit of open files.
MIN_PENDING: Final = 128


@dataclass(frozen=True, slots=True)
class PreAuthLimits:
    """What one listener's unproved connections may cost."""

    max_bytes: int = 16 * KiB  # per connection, before its handshake is done
    deadline: float = 10.0  # seconds from accept to a finished handshake
    max_pending: int = MIN_PENDING  # unproved connections at once; a newcomer sheds the oldest

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_pending <= 0 or not 0 < self.deadline < 3600:
            raise ValueError(f"pre-authentication limits out of range: {self}")

    @classmethod
    def for_open_files(
        cls, open_files: int | None, *, share: int, most: int, deadline: float
    ) -> PreAuthLimits:
        """Limits whose cap grows with the files a process may open: ``1/share`` of them.

        A burst of real clients connecting at once (a job of thousands of ranks
        joining) must not be shed, and strangers must never take the descriptors
        the process needs for itself: the cap is ``open_files // share``, at least
        the default and at most ``most``. ``open_files`` None means no limit known.
        """
        pending = most if open_files is None else max(MIN_PENDING, min(most, open_files // share))
        return cls(deadline=deadline, max_pending=pending)


def open_files_limit() -> int | None:
    """This process's soft limit of open files (``RLIMIT_NOFILE``); None if it has none."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no such limit on this platform
        return None
    return None if soft == resource.RLIM_INFINITY else soft


class Gate(Generic[C]):
    """The connections of one listener that have not finished their handshake.

    ``C`` is whatever identifies a connection to the I/O layer (its protocol
    object). The I/O layer closes what ``admit`` sheds, what ``charge`` refuses
    and what ``expired`` returns, and arms one timer for ``next_deadline``.

    Example:
        >>> gate: Gate[str] = Gate(PreAuthLimits(max_pending=1, deadline=5.0))
        >>> gate.admit("a", now=0.0), gate.admit("b", now=1.0)
        ([], ['a'])
        >>> gate.charge("b", 100), gate.expired(now=6.0)
        (True, ['b'])
        >>> gate = Gate(PreAuthLimits(max_pending=2))
        >>> gate.admit("a", now=0.0), gate.admit("b", now=1.0), gate.spoke("a")
        ([], [], None)
        >>> gate.admit("c", now=2.0)  # "a" is older, but "b" said nothing yet
        ['b']
    """

    __slots__ = ("_pending", "_silent", "limits")

    def __init__(self, limits: PreAuthLimits | None = None) -> None:
        self.limits = limits or PreAuthLimits()
        # conn -> [deadline, bytes so far]; insertion order is age order.
        self._pending: dict[C, list[float]] = {}
        # Those of them that have not spoken yet, as an ordered set (age order too).
        self._silent: dict[C, None] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, conn: object) -> bool:
        return conn in self._pending

    def admit(self, conn: C, now: float) -> list[C]:
        """Let ``conn`` in; return the oldest connections to close to make room for it."""
        shed: list[C] = []
        pending, silent = self._pending, self._silent
        while len(pending) >= self.limits.max_pending:
            oldest = next(iter(silent or pending))
            del pending[oldest]
            silent.pop(oldest, None)
            shed.append(oldest)
        pending[conn] = [now + self.limits.deadline, 0.0]
        silent[conn] = None
        return shed

    def spoke(self, conn: C) -> None:
        """``conn`` sent its first whole frame: shed the connections that said nothing first."""
        self._silent.pop(conn, None)

    def charge(self, conn: C, nbytes: int) -> bool:
        """Count ``nbytes`` received from ``conn``; False once it is over its budget.

        A connection that passed the gate (or was never in it) is not counted.
        """
        entry = self._pending.get(conn)
        if entry is None:
            return True
        entry[1] += nbytes
        return entry[1] <= self.limits.max_bytes

    def passed(self, conn: C) -> None:
        """``conn`` finished its handshake: no limit of the gate applies to it any more."""
        self._pending.pop(conn, None)
        self._silent.pop(conn, None)

    left = passed  # closed before (or after) its handshake: forget it either way

    def expired(self, now: float) -> list[C]:
        """Remove and return the connections past their deadline, oldest first."""
        out: list[C] = []
        pending = self._pending
        for conn, (deadline, _) in list(pending.items()):
            if deadline > now:
                break  # deadlines grow with age: the rest are later
            del pending[conn]
            self._silent.pop(conn, None)
            out.append(conn)
        return out

    def next_deadline(self) -> float | None:
        """When the oldest connection's time is up; None with none inside."""
        for deadline, _ in self._pending.values():
            return deadline
        return None


class LogBudget:
    """Lines about refused connections: ``burst`` an interval in full, the rest as counts.

    Example:
        >>> log = LogBudget(burst=1, interval=10.0)
        >>> log.note(0.0, "bad magic"), log.note(1.0, "bad magic")
        ((True, None), (False, None))
        >>> log.note(11.0, "deadline")
        (True, '1 more refused connection in the last 10.0 s not logged one by one (bad magic: 1)')
    """

    __slots__ = ("_counts", "_shown", "_start", "burst", "interval")

    # Distinct reasons counted in one summary; the rest are counted as "other".
    MAX_REASONS: Final = 8

    def __init__(self, burst: int = 5, interval: float = 10.0) -> None:
        self.burst = burst
        self.interval = interval
        self._start: float | None = None
        self._shown = 0
        self._counts: Counter[str] = Counter()

    def note(self, now: float, reason: str) -> tuple[bool, str | None]:
        """Count one refusal for ``reason`` (a short fixed phrase, not peer data).

        Returns:
            Whether to log this one in full, and the summary line of the interval
            that just ended (None when it has nothing to say).
        """
        summary = self.flush(now)
        if self._start is None:
            self._start = now
        if self._shown < self.burst:
            self._shown += 1
            return True, summary
        key = reason if reason in self._counts or len(self._counts) < self.MAX_REASONS else "other"
        self._counts[key] += 1
        return False, summary

    def due(self) -> float | None:
        """When ``flush`` will have a summary: the interval's end, if a line was held back.

        The I/O layer arms a timer for it, so the summary of a burst is logged
        even when no refusal comes after it.
        """
        if self._start is None or not self._counts:
            return None
        return self._start + self.interval

    def flush(self, now: float) -> str | None:
        """The summary of the interval if it ended by ``now`` (then a new one starts)."""
        if self._start is None or now - self._start < self.interval:
            return None
        counts, self._counts = self._counts, Counter()
        self._start, self._shown = None, 0
        total = sum(counts.values())
        if not total:
            return None
        by_reason = ", ".join(f"{r}: {n}" for r, n in counts.most_common())
        noun = "connection" if total == 1 else "connections"
        return (
            f"{total} more refused {noun} in the last {self.interval:.1f} s not logged "
            f"one by one ({by_reason})"
        )
