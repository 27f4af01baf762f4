"""Metric syncs between ranks of one host through shared memory: the ``Board``.

When every rank of a group runs on one host and they agreed on shared memory
(``_collectives.shared.agreed``), an aggregator's syncs go through one shared
segment instead of the data plane. Sync ``i`` of the aggregator (its place
among the aggregator's syncs, the same on every rank) has one slot per rank;
rank ``r`` writes its records into slot ``(i % DEPTH, r)`` and stamps it, and the
sync is complete once every rank's slot carries the stamp. Nothing is sent
and no thread is woken: in plain code ``sync()`` queues its records from the
training loop's own thread and returns.

Records are written in batches: a training step pays for every cold line of
Python it runs, and sixteen writes in one warm pass cost it far less than one
in each step. A rank's queued records are written

- by the sync that makes ``BATCH`` of them;
- by a look at one of its handles (``is_completed()``, ``result()``, ``wait()``,
  ``await``), which writes before it looks;
- by the poller, once they have sat queued for a whole ``POLL_QUEUED`` period
  (a rank that stopped syncing: at most twice that late);
- when the group or its session closes, before anything fails.

Completion is noticed rather than announced:

- each batch written also copies out the syncs that completed (a few loads
  from shared memory per sync, in the same warm pass). The board holds handles
  weakly: a sync whose handle nobody holds any more (a rank that only logs
  drops them) is never read, only counted as copied out. A handle with an
  ``on_done`` listener is held until it ran;
- ``is_completed()``, ``result()`` and ``wait()`` look too;
- a handle someone waits on (``await``, ``wait()``, ``on_done``) makes the poller
  on the event loop look every ``POLL_MIN``..``POLL_MAX`` seconds while such a
  handle is pending. The poller also fails pending syncs when the group breaks
  or the oldest one passes the group's timeout; with nobody waiting it looks
  every ``POLL_QUEUED`` seconds while syncs are in flight, and only writes
  what sat queued. It goes on for ``IDLE_POLLS`` looks after the last one: a
  ``sync()`` that had to start it would wake the loop's thread, and a training
  step pays for that wake-up far more than for a timer's.

The segment's layout, and writing and reading a slot, are ``_metrics.slots``'s.
The records (``_metrics.record``) are copied out when the sync completes and
decoded only when someone reads the results; the reduction is the fused
path's own (``Layout``), so both paths give bitwise the same values.

Flow control: each rank publishes how many syncs it has copied out; a slot is
written again only once every rank copied its previous sync, so a rank
``DEPTH`` syncs ahead of the slowest keeps its writes on a backlog (its next
batch or the poller writes them).

``sync()`` still takes the group's next sequence number, as every collective
does (``ProcessGroup.next_seq``): ranks whose first syncs went through the
event loop and ranks that wrote at once keep numbering the group's
operations alike. Each slot carries it; ranks that disagree get
``CollectiveMismatchError``.

Set-up is ``_metrics.board_setup``'s.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import CollectiveMismatchError, DistTimeoutError
from aiodist._metrics.board_work import BoardWork, Rows, wake
from aiodist._metrics.slots import DEPTH, MAX_RECORD_BYTES, Slots

if TYPE_CHECKING:
    from aiodist._group import ProcessGroup
    from aiodist._metrics.record import Record
    from aiodist._transport import shm

__all__ = ["BATCH", "DEPTH", "MAX_RECORD_BYTES", "Board"]

#: A sync writes its rank's queued records once this many are queued.
BATCH: Final = 16
POLL_MIN: Final = 0.0002
POLL_MAX: Final = 0.004
POLL_QUEUED: Final = 0.05  # nobody waiting: records may sit queued up to twice this
IDLE_POLLS: Final = 5  # slow looks with nothing in flight before the poller stops


class Board:
    """One aggregator's shared segment on one group, as this rank sees it."""

    def __init__(self, g: ProcessGroup, segment: shm.Segment) -> None:
        self.group = g
        self.loop = asyncio.get_running_loop()
        self.lock = threading.Lock()
        self.loop_thread = threading.get_ident()
        self.session = g.session
        self._segment = segment  # holds the mapping
        self._slots = Slots(memoryview(segment.memory), g.rank, g.world_size)
        self._queued: deque[tuple[BoardWork, Record]] = deque()  # not written yet
        # Written (or backlogged), not copied out: held weakly, so that a handle nobody
        # holds any more is not copied out at all. Handles with listeners are kept.
        self._pending: dict[int, weakref.ref[BoardWork]] = {}
        self._kept: dict[int, BoardWork] = {}
        self._backlog: list[tuple[int, int, bytes | None]] = []  # waiting for a slot
        self._copied = 0  # syncs [0, copied) are copied out here
        self._writable_below = DEPTH  # indices below this may be written (cached)
        self._polling = False  # the poller runs; ``_delay`` is its current period
        self._delay = POLL_MIN
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0  # loop time it fires at (uvloop's handles do not say)
        self._stale: BoardWork | None = None  # the queue's head at the last poll
        self._idle = 0  # slow looks in a row that found nothing in flight
        g.on_close(self.check)  # records still queued are written before the group goes
        self._to_wake: list[list[Any]] = []  # settled handles whose waiters wake next
        self._draining = False

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread

    # --- posting -----------------------------------------------------------------------------

    def queue(self, index: int, seq: int, record: Record) -> BoardWork:
        """Queue this rank's ``record`` of sync ``index``; return its handle.

        Nothing is written yet: the sync that fills a batch of ``BATCH`` writes
        them all (and copies out what completed), as do a look at a handle
        (``check``) and the poller, within ``POLL_QUEUED`` seconds.
        """
        work = BoardWork(self, index, seq)
        queued = self._queued
        queued.append((work, record))  # atomic: the poller may be taking from the other end
        if len(queued) >= BATCH:
            self.check()
        elif not self._polling:
            self.watch(soon=False)
        return work

    def post(self, index: int, seq: int, record: Record) -> BoardWork:
        """``queue`` and write at once (the loop's own syncs, which are not per step)."""
        work = self.queue(index, seq, record)
        self.check()
        return work

    def _flush_locked(self) -> None:
        """Write (or put on the backlog) every queued record, in the order they came."""
        queued = self._queued
        if not queued:
            return
        deadline = time.monotonic() + self.group.timeout
        pending, backlog, copied, ref = self._pending, self._backlog, self._copied, weakref.ref
        while queued:
            work, record = queued.popleft()
            index = work.index
            if index < copied or index in pending:
                work._settle_locked(None, RuntimeError(f"metrics sync {index} was posted twice"))
                continue
            work.deadline = deadline
            pending[index] = ref(work)
            writable = not backlog and (index < self._writable_below or self._writable(index))
            if not isinstance(record, bytes):
                single, weight, values = record
                if writable and single.nbytes <= MAX_RECORD_BYTES:
                    self._slots.write_single(index, work.seq, single, weight, values)
                    continue
                record = single.encode(weight, values)
            data = record if len(record) <= MAX_RECORD_BYTES else None
            if writable:
                self._slots.write(index, work.seq, data)
            else:
                backlog.append((index, work.seq, data))

    def _writable(self, index: int) -> bool:
        if index < self._writable_below:
            return True
        self._writable_below = self._slots.slowest_copied() + DEPTH
        return index < self._writable_below

    # --- noticing completion -----------------------------------------------------------------

    def check(self) -> None:
        """Write what may be written, copy out what completed, settle those handles."""
        with self.lock:
            drain = self.queue_wake_locked(self._check_locked())
        self.run_wake(drain)

    def _check_locked(self) -> list[list[Any]]:
        self._flush_locked()
        backlog = self._backlog
        if backlog:
            # Posts may come out of order (the loop's and the caller's thread); slots
            # free up in index order, so the backlog is written lowest index first.
            if len(backlog) > 1 and backlog[-1][0] < backlog[-2][0]:
                backlog.sort(key=lambda entry: entry[0])
            written = 0
            for entry in backlog:
                if not self._writable(entry[0]):
                    break
                self._slots.write(*entry)
                written += 1
            del backlog[:written]
        woken: list[list[Any]] = []
        pending = self._pending
        copied = start = self._copied
        while True:  # in index order: an index not posted yet stops it
            ref = pending.get(copied)
            if ref is None:
                break
            work = ref()
            if work is None:  # nobody can look at this sync any more: skip its slots
                del pending[copied]
                copied += 1
                continue
            rows = self._slots.read(copied)
            if rows is None:
                break
            del pending[copied]
            self._kept.pop(copied, None)
            copied += 1
            seqs = {seq for seq, _ in rows}
            if len(seqs) > 1:
                by_rank = {r: seq for r, (seq, _) in enumerate(rows)}
                error: BaseException | None = CollectiveMismatchError(
                    f"ranks reached metrics sync {work.index} of group {self.group.name!r} at "
                    f"different points among the group's collectives (sequence numbers "
                    f"{by_rank}); call collectives in the same order on every rank",
                    field="seq",
                    values_by_rank=by_rank,
                )
                value: Any = None
            else:
                error, value = (
                    None,
                    Rows(self.group.name, [data for _, data in rows], MAX_RECORD_BYTES),
                )
            wake = work._settle_locked(value, error)
            if wake is not None:
                woken.append(wake)
        if copied != start:
            self._copied = copied
            self._slots.publish_copied(copied)
        return woken

    def keep_locked(self, work: BoardWork) -> None:
        """Hold ``work`` until it settles (it has listeners, and maybe no other holder)."""
        self._kept[work.index] = work

    def _live_locked(self) -> list[BoardWork]:
        """The pending handles someone still holds, oldest first."""
        return [w for w in (ref() for ref in self._pending.values()) if w is not None]

    # Handles wake on the loop's thread in the order they settled (which is index
    # order), whichever thread settled them: one queue, drained by one callback.

    def queue_wake_locked(self, woken: list[list[Any]]) -> bool | None:
        """Queue ``woken``; True: drain it now (loop thread), False: soon, None: no need."""
        if not woken:
            return None
        self._to_wake.extend(woken)
        if self._draining:
            return None
        self._draining = True
        return self.on_loop_thread()

    def run_wake(self, drain: bool | None) -> None:
        if drain:
            self._drain()
        elif drain is False and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        while True:
            with self.lock:
                items, self._to_wake = self._to_wake, []
                if not items:
                    self._draining = False
                    return
            wake(items)

    # --- the poller (the loop's thread) ------------------------------------------------------

    def watch(self, *, soon: bool = True) -> None:
        """Make sure the poller runs: someone waits on a pending sync (``soon``: within
        ``POLL_MIN``), or records are queued or in flight (a slow look is enough: the
        caller's next syncs write and look too, and ranks that drift apart would
        otherwise wake the loop all the time)."""
        delay = POLL_MIN if soon else POLL_QUEUED
        with self.lock:
            if self._polling and self._delay <= delay:
                return
            self._polling = True
            self._delay = delay
        if self.on_loop_thread():
            self._arm(delay)
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._arm, delay)

    def _arm(self, delay: float) -> None:
        """Poll within ``delay`` seconds (sooner if it already would)."""
        timer, when = self._timer, self.loop.time() + delay
        if timer is not None:
            if self._timer_when <= when:
                return
            timer.cancel()
        self._timer, self._timer_when = self.loop.call_at(when, self._poll), when

    def _poll(self) -> None:
        self._timer = None
        with self.lock:
            period = self._delay
            queued = self._queued
            head = queued[0][0] if queued else None
            # Records the caller queued a whole period ago and did not write since.
            stale, self._stale = head is not None and head is self._stale, head
        before = len(self._pending)
        # Nobody waits: only write what a caller that stopped syncing left queued (one
        # that still syncs writes its own), and retry the backlog.
        if period < POLL_QUEUED or stale or self._backlog:
            self.check()
        error = self._failure()
        with self.lock:
            drain = None
            live = self._live_locked()
            if error is not None:
                woken = [w for w in (work._settle_locked(None, error) for work in live) if w]
                self._pending.clear()
                self._kept.clear()
                self._backlog.clear()
                drain = self.queue_wake_locked(woken)
                live = []
            watched = bool(self._kept) or any(w._waiters for w in live)
            # Syncs in flight keep it looking (slowly when nobody waits): it writes what
            # a caller left queued, and fails them all if the group breaks or times out.
            busy = watched or bool(self._backlog or self._queued or self._pending)
            # It goes on a while after the last sync in flight: a caller that syncs again
            # soon finds it running, rather than waking the loop to start it.
            self._idle = 0 if busy else self._idle + 1
            if self._delay < period:
                pass  # someone started waiting meanwhile (``watch``): keep their period
            elif not busy and self._idle > IDLE_POLLS:
                self._polling = False
            elif not watched:
                self._delay = POLL_QUEUED
            elif len(self._pending) < before or period >= POLL_QUEUED:
                self._delay = POLL_MIN  # progress, or someone started waiting: look soon
            else:
                self._delay = min(POLL_MAX, period * 2)
            delay, polling = self._delay, self._polling
        self.run_wake(drain)
        if polling:
            self._arm(delay)
        elif self._queued:
            # A sync queued (without the lock) after the look above may have seen the
            # poller still running and left it to us: look at its record in time.
            self.watch(soon=False)

    def _failure(self) -> BaseException | None:
        g = self.group
        try:
            g.check_usable()
        except Exception as exc:
            return exc
        with self.lock:
            live = self._live_locked()
        oldest = live[0] if live else None
        if oldest is not None and oldest.deadline <= time.monotonic():
            timed_out = DistTimeoutError(
                f"{oldest.description} on group {g.name!r} timed out after "
                f"{g.timeout:.1f} s; a rank may not have called it, or may be stuck. The "
                "group is broken."
            )
            g.break_(timed_out)
            return timed_out
        return None
