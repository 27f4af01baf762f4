"""The flight recorder: every rank's last operations, in a bounded ring.

Each session owns one ``Recorder``. Every collective (``_ops.run``) and every
point-to-point call records one ``Entry``: its name, group, sequence number,
peer, dtype and shape, when it was called, started and ended, and how it
ended. The ring holds the last ``capacity`` entries (``AIODIST_RECORDER_SIZE``,
by default 2,048); it is always on, so its hot path is a few attribute stores
into a preallocated entry and one ``Work.when_done`` listener, with
``time.perf_counter_ns`` for the clock. Sizes are derived only when read.

An entry still running when the ring wraps is kept aside (``_held``), also
once it ended: the oldest unfinished operation (``oldest``, what each heartbeat
carries, see ``where``) is never lost to the ring's bound.

``dumps.dump`` is the recorder as plain data (the documented dump format,
``FORMAT``); ``tracefile.trace_events`` the same operations as Chrome trace
events.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiodist import _settings

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable


class Work(Protocol):
    """What the recorder needs of a handle (``work.Work``, which imports this module)."""

    def is_completed(self) -> bool: ...
    def exception(self) -> BaseException | None: ...
    def when_done(self, fn: Callable[[Any], object]) -> None: ...


#: How many operations a rank's recorder keeps, unless ``AIODIST_RECORDER_SIZE`` says.
DEFAULT_CAPACITY: Final = _settings.RECORDER_SIZE.default
#: The ``format`` field of a dump (bumped when a field changes meaning).
FORMAT: Final = "aiodist.flight-recorder/1"
# Wire bounds (``_wire/bounds.py`` checks them again on the server).
_NAME_CHARS: Final = 64


def capacity_from_env() -> int:
    """``AIODIST_RECORDER_SIZE`` as a ring size, else ``DEFAULT_CAPACITY``; 0 turns it off."""
    size = _settings.RECORDER_SIZE.read()
    return 0 if size <= 0 else max(16, size)


def new_recorder(rank: int, job: str) -> Recorder | None:
    """A session's recorder, sized by ``AIODIST_RECORDER_SIZE`` (None when that is 0).

    With ``AIODIST_TRACE=DIR`` (or inside ``aiodist.trace(DIR)``) it keeps every
    operation for the rank's trace, written into DIR when the session closes.
    """
    capacity = capacity_from_env()
    if not capacity:
        return None
    rec = Recorder(rank, job, capacity)
    directory = TRACE_DIR[0] if TRACE_DIR else _settings.TRACE.read()
    if directory:
        rec.start_trace(directory)
    return rec


_clock = time.perf_counter_ns  # read once per operation's start and end: no lookup of it

#: ``aiodist.trace(DIR)``: the directory that sessions made inside it trace into.
TRACE_DIR: list[str] = []


class Entry:
    """One recorded operation (a slot of the ring, reused once it ended)."""

    __slots__ = (
        "dtype",
        "ended",
        "enqueued",
        "error",
        "group",
        "id",
        "name",
        "peer",
        "seq",
        "shape",
        "started",
        "wait_end",
        "wait_start",
        "work",
    )

    def __init__(self) -> None:
        self.id = -1  # the how-many-th operation of its recorder (-1: slot never used)
        self.name = ""
        self.group = ""
        self.seq = 0  # the group's sequence number; 0 for point-to-point
        self.peer = -1  # point-to-point: the other rank (-1: any, or a collective)
        self.dtype: Any = None
        self.shape: Any = None
        self.enqueued = 0  # perf_counter_ns when the call was made
        self.started = 0  # ... when the operation was handed to its algorithm
        self.ended = 0  # ... when its handle settled; 0 while running
        self.error: BaseException | None = None
        self.work: Work | None = None  # while running (its result is not kept)
        self.wait_start = 0  # tracing: when the program first awaited it (0: never)
        self.wait_end = 0

    def finish(self, work: Work) -> None:
        """``Work.when_done`` listener: the operation ended."""
        self.ended = _clock()
        self.error = work.exception()
        self.work = None
        if TRACED:
            TRACED.pop(id(work), None)

    @property
    def state(self) -> str:
        return state_of(self.ended, self.error)

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


def state_of(ended: int, error: BaseException | None) -> str:
    """An operation's state (a trace's and a dump's): pending, done or failed."""
    if ended == 0:
        return "pending"
    return "done" if error is None else "failed"


def nbytes_of(shape: Any, dtype: Any) -> int:
    """The bytes an operation moved: its tensor's (``shape``, ``dtype``); 0 for none."""
    if shape is None or dtype is None:
        return 0
    try:
        return int(shape.numel()) * int(dtype.itemsize)
    except (AttributeError, TypeError):
        return 0


#: Tracing only: running handles (by id) -> their entries, for the waits on them.
TRACED: dict[int, Entry] = {}


def wait_started(work: Work) -> Entry | None:
    """The program awaits running ``work``: its entry, if traced (the wait's start noted)."""
    e = TRACED.get(id(work))
    if e is None or e.work is not work:
        return None
    if not e.wait_start:
        e.wait_start = time.perf_counter_ns()
    return e


def wait_ended(e: Entry) -> None:
    """The wait that ``wait_started`` noted is over."""
    e.wait_end = time.perf_counter_ns()


class Recorder:
    """One rank's ring of its last operations (see the module docstring)."""

    __slots__ = (
        "__weakref__",  # dumps.py keeps the live ones for SIGUSR1, weakly
        "_count",
        "_held",
        "_ring",
        "_scan",
        "capacity",
        "job",
        "last",
        "perf0",
        "pid",
        "rank",
        "trace",
        "trace_dir",
        "wall0",
    )

    def __init__(self, rank: int, job: str, capacity: int | None = None) -> None:
        self.capacity = capacity_from_env() if capacity is None else max(1, capacity)
        # Slots get their entry on first use: a process of many members (ranks as tasks)
        # pays for the operations it makes, not for capacity x members up front.
        self._ring: list[Entry | None] = [None] * self.capacity
        self._count = 0  # operations recorded so far
        self._scan = 0  # no operation before this one is still running (but the held ones)
        # Entries the ring wrapped over while they ran: kept (the last ``capacity`` of
        # them, ended or not) so that a dump still shows the operation that hung.
        self._held: list[Entry] = []
        self.rank = rank
        self.job = job
        self.pid = os.getpid()
        self.last: Entry | None = None  # the last collective that ended (``where``)
        # One clock for all: perf_counter_ns, with the wall-clock time of its zero.
        self.perf0 = time.perf_counter_ns()
        self.wall0 = time.time_ns()
        self.trace: list[Entry] | None = None  # AIODIST_TRACE: every entry, unbounded
        self.trace_dir: str | None = None  # where the trace goes when the session closes

    def record(
        self,
        work: Work,
        name: str,
        group: str,
        seq: int,
        peer: int,
        dtype: Any,
        shape: Any,
        enqueued: int,
    ) -> None:
        """Record operation ``work`` (running or done), called at ``enqueued`` (perf ns)."""
        count = self._count
        ring = self._ring
        i = count % self.capacity
        e = ring[i]
        if e is None:
            e = ring[i] = Entry()
        elif e.work is not None:  # still running: keep it aside, take a fresh slot
            self._held.append(e)
            if len(self._held) > self.capacity:
                self._held = [h for h in self._held if h.ended == 0] or self._held[1:]
            e = ring[i] = Entry()
        e.id = count
        e.name = name
        e.group = group
        e.seq = seq
        e.peer = peer
        e.dtype = dtype
        e.shape = shape
        e.enqueued = enqueued
        e.started = _clock()
        e.ended = 0
        e.error = None
        self._count = count + 1
        done = work.is_completed()
        if self.trace is not None:
            self.trace.append(e)
            ring[i] = None  # the trace keeps this one: the ring takes another
            e.wait_start = e.wait_end = 0
            if not done:
                TRACED[id(work)] = e
        if done:
            e.finish(work)
        else:
            e.work = work
            work.when_done(e.finish)

    def start_trace(self, directory: str) -> None:
        """Keep every operation from now on, for a trace written into ``directory``."""
        if self.trace is None:
            # Operations running now stay findable (``oldest``) beside the trace's.
            for i, e in enumerate(self._ring):
                if e is not None and e.work is not None:
                    self._held.append(e)
                    self._ring[i] = None
            self._held.sort(key=_by_id)
            self.trace = []
            self._scan = 0  # an index into the trace from now on
        self.trace_dir = directory

    def stop_trace(self) -> None:
        """Keep only the ring again (the trace was written)."""
        if self.trace is not None:
            for k, e in enumerate(self.trace[-self.capacity :]):
                self._ring[(e.id if e.id >= 0 else k) % self.capacity] = e
            self.trace = None
            self._scan = max(0, self._count - self.capacity)
        self.trace_dir = None

    # --- reading -------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """The entries kept, oldest first (the held ones included)."""
        count, cap = self._count, self.capacity
        first = max(0, count - cap)
        if self.trace is not None:
            kept = [e for e in self.trace if e.id >= first]
        else:
            ring = [self._ring[k % cap] for k in range(first, count)]
            kept = [e for e in ring if e is not None and e.id >= first]
        lowest = kept[0].id if kept else count
        return sorted((e for e in self._held if e.id < lowest), key=_by_id) + kept

    def oldest(self) -> Entry | None:
        """The oldest operation still running (None: none)."""
        running = [e for e in self._held if e.ended == 0]
        count, cap = self._count, self.capacity
        k = max(self._scan, count - cap)
        found: Entry | None = None
        if self.trace is not None:
            trace = self.trace
            k = self._scan
            while k < len(trace) and trace[k].ended:
                k += 1
            self._scan = k
            found = trace[k] if k < len(trace) else None
        else:
            ring = self._ring
            while k < count:
                e = ring[k % cap]
                if e is not None and e.id == k and e.ended == 0:
                    found = e
                    break
                k += 1
            self._scan = k
        if running and (found is None or running[0].id < found.id):
            return running[0]
        return found

    def last_ended(self) -> Entry | None:
        """The latest collective (sequence number > 0) that has ended, among those kept.

        Scans back from the newest operation: each heartbeat asks, and it usually
        stops at once.
        """
        if self.trace is not None:
            newest: Iterable[Entry | None] = reversed(self.trace)
        else:
            count, cap, ring = self._count, self.capacity, self._ring
            newest = (ring[k % cap] for k in range(count - 1, max(0, count - cap) - 1, -1))
        for e in newest:
            if e is not None and e.seq and e.ended:
                return e
        return None

    def where(self, now_ns: int | None = None) -> list[Any]:
        """``[current, last]`` for a heartbeat: each ``[group, seq, name, age_s]`` or None.

        ``current`` is the oldest running operation and how long it has run;
        ``last`` the collective that ended last and how long ago.
        """
        now = time.perf_counter_ns() if now_ns is None else now_ns
        current = self.oldest()
        last = self.last_ended()
        return [
            _pos(current, now, current.enqueued) if current is not None else None,
            _pos(last, now, last.ended) if last is not None else None,
        ]

    @property
    def recorded(self) -> int:
        """How many operations were recorded in all."""
        return self._count

    def wall(self, perf_ns: int) -> float:
        """``perf_ns`` (a perf_counter_ns reading) as seconds since the epoch."""
        return (self.wall0 + (perf_ns - self.perf0)) / 1e9


def _by_id(e: Entry) -> int:
    return e.id


def _pos(e: Entry, now: int, since: int) -> list[Any]:
    return [e.group[:256], e.seq, e.name[:_NAME_CHARS], max(0.0, (now - since) / 1e9)]
