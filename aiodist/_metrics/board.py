"""Metric syncs between ranks of one host through shared memory: the ``Board``.

When every rank of a group runs on one host and they agreed on shared memory
(``_ops.shared.agreed``), an aggregator's syncs go through one shared
segment instead of the data plane. Sync ``i`` of the aggregator (its place
among the aggregator's syncs, the same on every rank) has one record per rank;
each rank writes its records into its own region and then counts them
written, and sync ``i`` is complete once every rank's count is past ``i``.
Nothing is sent and no thread is woken: in plain code ``sync()`` queues its
record from the training loop's own thread and returns.

Records are written in batches: a training step pays for every cold line of
Python it runs, and a bucket of ``GROUP`` records written side by side in one
warm pass costs it far less than one record in each step. A rank's queued
records are written

- by the sync that ends a bucket (or makes ``GROUP`` of them queued);
- by a look at one of its handles (``is_completed()``, ``result()``, ``wait()``,
  ``await``), which writes before it looks;
- by the poller, once they have sat queued for a whole ``POLL_QUEUED`` period
  (a rank that stopped syncing: at most twice that late);
- by ``drain`` (``MetricAggregator.flush()``);
- when the group or its session closes, before anything fails: leaving the
  job then waits (bounded) until every sync posted here is complete on every
  rank and its waiters and callbacks are woken (``drain(complete=True)``).

Completion is noticed rather than announced, and handles are settled lazily:

- each batch written also copies out the buckets every rank finished at least
  ``LAG`` buckets ago (a few copies per rank and bucket, whatever the number of
  syncs). A bucket whose handles nobody holds any more is not copied at all,
  only counted as copied out; a loop that keeps only its latest handle (or
  none: a rank that only logs) has dropped them all by then;
- a look at a handle (``is_completed()``, ``result()``, ``wait()``,
  ``await``) copies out everything complete and settles it, so a handle
  nobody looks at costs nothing after ``sync()`` made it;
- handles someone waits on (``await``, ``wait()``, ``on_done``) are *watched*:
  the board holds them and settles them, in index order, once copied out, and
  the poller on the event loop looks every ``POLL_MIN``..``POLL_MAX`` seconds
  while one is pending. The poller also fails pending syncs when the group
  breaks or the oldest written one passes the group's timeout (when a member
  failed, only those it did not write: a rank that flushed and then went away
  handed its syncs over, and they complete once the live ranks wrote theirs);
  with nobody
  waiting it looks every ``POLL_QUEUED`` seconds while syncs are in flight,
  and only writes what sat queued. It goes on for ``IDLE_POLLS`` looks after
  the last one: a ``sync()`` that had to start it would wake the loop's
  thread, and a training step pays for that wake-up far more than for a
  timer's.

The segment's layout, and writing and copying records, are ``_metrics.slots``'s.
The records (``_metrics.record``) are decoded only when someone reads the
results; the reduction is the fused path's own (``Layout``), so both paths
give bitwise the same values.

Flow control: each rank publishes how many syncs it has copied out; a bucket
slot is written again only once every rank copied the bucket it held, so a
rank ``DEPTH`` syncs ahead of the slowest keeps its writes on a backlog (its
next batch or the poller writes them).

``sync()`` still takes the group's next sequence number, as every collective
does (``ProcessGroup.next_seq``): ranks whose first syncs went through the
event loop and ranks that wrote at once keep numbering the group's
operations alike. Each record carries it; ranks that disagree get
``CollectiveMismatchError``.

Set-up is ``_metrics.board_setup``'s.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import deque
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from aiodist._errors import DistTimeoutError
from aiodist._group.lingering import linger
from aiodist._metrics.board_work import BoardWork, Bucket, Waker
from aiodist._metrics.slots import (
    BUCKETS,
    GROUP,
    Slots,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._metrics.record import Record, Single
    from aiodist._metrics.results import MetricResults
    from aiodist._transport import shm

#: A sync writes its rank's queued records once this many are queued (or a bucket ends).
BATCH: Final = GROUP
POLL_MIN: Final = 0.0002
POLL_MAX: Final = 0.004
POLL_QUEUED: Final = 0.05  # nobody waiting: records may sit queued up to twice this
IDLE_POLLS: Final = 5  # slow looks with nothing in flight before the poller stops
LAG: Final = 2  # buckets a batch leaves complete before copying them out

#: A queued record: (sync index, sequence number, record).
Entry: TypeAlias = "tuple[int, int, Record]"
_index = itemgetter(0)


class Board:
    """One aggregator's shared segment on one group, as this rank sees it."""

    def __init__(self, g: ProcessGroup, segment: shm.Segment) -> None:
        self.group = g
        self.loop = asyncio.get_running_loop()
        self.lock = threading.Lock()
        self.loop_thread = threading.get_ident()
        self.session = g.session
        #: The aggregator's encoding of one update's key set (``record.Single``).
        self.single_encoding: Callable[[tuple[str, ...]], Single] | None = None
        self._segment = segment  # holds the mapping
        self._slots = Slots(memoryview(segment.memory), g.rank, g.world_size)
        self._queued: deque[Entry] = deque()  # not written yet
        self._backlog: list[Entry] = []  # waiting for their bucket slot, in index order
        self._written = 0  # this rank wrote syncs [0, written) (and published it) ...
        self._written_above: set[int] = set()  # ... and these, ahead of a gap
        self._free_below = BUCKETS  # buckets below this may be written (cached)
        self._complete = 0  # every rank wrote syncs [0, complete), at the last look
        self._copied = 0  # syncs [0, copied) are copied out here
        # The buckets handles hold, weakly: one nobody holds is not copied out.
        self._buckets: dict[int, weakref.ref[Bucket]] = {}
        self._bucket = Bucket(-1)  # the latest one handed out
        self._watched: dict[int, BoardWork] = {}  # waited on: held until settled
        self._deadlines: deque[tuple[int, float]] = deque()  # (last index, deadline) a write
        # Syncs from ``fail_from`` on that are not copied out fail with ``failure``: all of
        # them when the group broke, those a failed member did not write when one failed.
        self._failure: BaseException | None = None
        self._fail_from = 0
        self._polling = False  # the poller runs; ``_delay`` is its current period
        self._delay = POLL_MIN
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0  # loop time it fires at (uvloop's handles do not say)
        self._stale: Entry | None = None  # the queue's head at the last poll
        self._idle = 0  # slow looks in a row that found nothing in flight
        g.on_close(self._closing)  # queued records reach every rank before the group goes
        self.waker = Waker(self.loop, self.lock, self.loop_thread)

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread

    # --- posting -----------------------------------------------------------------------------

    def queue(self, index: int, seq: int, record: Record) -> BoardWork:
        """Queue this rank's ``record`` of sync ``index``; return its handle.

        Nothing is written yet: the sync that ends a bucket writes the queue (and
        copies out what completed), as do a look at a handle (``check``) and the
        poller, within ``POLL_QUEUED`` seconds.
        """
        # Every step, so no helper calls (each costs a cold step more than its work).
        bucket = self._bucket
        if bucket.number != index // GROUP:
            bucket = self._bucket_for(index // GROUP)
        work = BoardWork(self, index, seq, bucket)
        queued = self._queued
        queued.append((index, seq, record))  # atomic: the poller may be taking from the other end
        if index % GROUP == GROUP - 1 or len(queued) >= BATCH:
            self.check(eager=False)
        elif not self._polling:
            self.watch(soon=False)
        return work

    def post(
        self,
        index: int,
        seq: int,
        record: Record,
        listener: Callable[[Work[MetricResults]], object],
    ) -> BoardWork:
        """Queue and write at once (the loop's own syncs, which are not per step).

        ``listener`` listens from the start (``Work.when_done``): a sync posted after
        later ones were queued must not settle after them, or listeners would run
        out of call order.
        """
        work = BoardWork(self, index, seq, self._bucket_for(index // GROUP))
        work.when_done(listener)
        self._queued.append((index, seq, record))
        self.check()
        return work

    def _bucket_for(self, number: int) -> Bucket:
        with self.lock:
            ref = self._buckets.get(number)
            bucket = ref() if ref is not None else None
            if bucket is None:
                bucket = Bucket(number)
                self._buckets[number] = weakref.ref(bucket)
            if number > self._bucket.number:
                self._bucket = bucket
            return bucket

    def _flush_locked(self) -> None:
        """Write (or put on the backlog) every queued record, a bucket's run at a time."""
        queued, backlog = self._queued, self._backlog
        n = len(queued)
        if not n and not backlog:
            return
        popleft = queued.popleft
        entries = [popleft() for _ in range(n)]
        if backlog:
            entries = backlog + entries
            self._backlog = []
        n = len(entries)
        contiguous = entries[-1][0] - entries[0][0] == n - 1
        if not contiguous:
            # Posts may come out of order (the loop's and the caller's thread); slots free
            # up in index order, so records are written lowest index first.
            entries.sort(key=_index)
        slots, written = self._slots, self._written
        i = 0
        while i < n:
            first = entries[i][0]
            number = first // GROUP
            if number >= self._free_below:
                self._free_below = slots.slowest_copied() // GROUP + BUCKETS
                if number >= self._free_below:  # a rank has not copied out its slot's last bucket
                    self._backlog = entries[i:]
                    break
            j = min(n, i + (number + 1) * GROUP - first)  # the run: to the bucket's end ...
            if not contiguous:
                k = i + 1
                while k < j and entries[k][0] == first + k - i:
                    k += 1
                j = k  # ... or to the first gap
            self._write(first, entries[i:j])
            if first == self._written:
                self._written = first + j - i
            else:
                self._written_above.update(range(first, first + j - i))
            i = j
        above = self._written_above
        while above and self._written in above:
            above.discard(self._written)
            self._written += 1
        if self._written != written:
            slots.publish_written(self._written)
        if i:
            self._deadlines.append((entries[i - 1][0], time.monotonic() + self.group.timeout))

    def _write(self, first: int, run: list[Entry]) -> None:
        """Write the records of ``run`` (syncs ``first, first + 1, ...``, one bucket)."""
        _, seqs, records = zip(*run, strict=True)
        self._slots.write_run(first, seqs, records, self.single_encoding)

    # --- noticing completion -----------------------------------------------------------------

    def check(self, *, eager: bool = True) -> None:
        """Write what may be written, copy out what completed, settle watched handles.

        Not ``eager`` (a batch of syncs writing), completed buckets are copied out
        only once they are ``LAG`` buckets old, or while someone waits: by then
        the handles of a loop that keeps only its latest are gone, and their
        bucket is skipped.
        """
        with self.lock:
            self._flush_locked()
            drain = self.waker.queue_locked(self._copy_locked(eager))
        self.waker.run(drain)

    def _copy_locked(self, eager: bool) -> list[list[Any]]:
        """Copy out the syncs every rank wrote since the last look (buckets someone holds)."""
        complete = self._slots.complete()
        if complete != self._complete:
            self._complete = complete
            deadlines = self._deadlines
            while deadlines and deadlines[0][0] < complete:
                deadlines.popleft()
        if not (eager or self._watched or self._backlog):
            complete = (complete // GROUP - LAG) * GROUP
        copied = start = self._copied
        buckets = self._buckets
        while copied < complete:
            number = copied // GROUP
            stop = min(complete, (number + 1) * GROUP)
            ref = buckets.get(number)
            bucket = ref() if ref is not None else None
            if bucket is not None:
                chunks = self._slots.copy(copied, stop)
                if chunks is None:
                    break  # not all visible yet (``CHECKSUM``): again later
                bucket.add(copied, stop, chunks)
            if stop == (number + 1) * GROUP:
                buckets.pop(number, None)
            copied = stop
        if copied <= start:
            return []
        self._copied = copied
        self._slots.publish_copied(copied)
        watched = self._watched
        if not watched:
            return []
        woken = []
        for index in sorted(i for i in watched if i < copied):
            settled = self.settle_locked(watched[index])
            if settled is not None:
                woken.append(settled)
        return woken

    def settle_locked(self, work: BoardWork) -> list[Any] | None:
        """Settle ``work`` if its sync is copied out or failed; return what to wake, if anything."""
        if work._done:
            return None
        index = work.index
        if index < self._copied:
            value, error = work.bucket.outcome(index, self.group.name)
        elif self._failure is not None and index >= self._fail_from:
            value, error = None, self._failure
        else:
            return None
        self._watched.pop(index, None)
        return work._settle_locked(value, error)

    def watch_locked(self, work: BoardWork) -> None:
        """Hold ``work`` and settle it once its sync is copied out (someone waits for it)."""
        self._watched[work.index] = work

    def _fail_locked(self, error: BaseException, fail_from: int) -> list[list[Any]]:
        """Fail every sync from ``fail_from`` on that is not complete yet.

        What this rank queued is written first, and records are still written
        after: a sync every failed member wrote before it went away (``flush``
        and then exit) completes here once the live ranks wrote it too.
        """
        self._flush_locked()
        woken = self._copy_locked(eager=True)
        if self._failure is not None and self._fail_from <= fail_from:
            return woken
        self._failure, self._fail_from = error, fail_from
        watched = self._watched
        for index in sorted(i for i in watched if i >= fail_from):
            settled = self.settle_locked(watched[index])
            if settled is not None:
                woken.append(settled)
        return woken

    def _can_complete_locked(self) -> int:
        """Syncs below this may still complete (every failed member wrote them)."""
        return self._written if self._failure is None else min(self._written, self._fail_from)

    # --- draining (the loop's thread) --------------------------------------------------------

    async def drain(self, *, complete: bool = False) -> None:
        """Write every record queued here; with ``complete``, wait until every rank wrote them.

        Returns once none is left queued (a full bucket slot may hold records
        back until the slowest rank copied it out); with ``complete``, once every
        sync posted here is complete on every rank and copied out, its watched
        handles settled. Returns early if they fail (the group broke, or the
        oldest timed out): they then hold the error.

        Cancellation:
            Cancelling the caller stops the wait; what was written stays written.
        """
        delay = POLL_MIN
        while True:
            self.check()
            failure = self._failure_now()
            with self.lock:
                drain = None
                if failure is not None:
                    drain = self.waker.queue_locked(self._fail_locked(*failure))
                if self._failure is None:
                    pending = bool(self._queued or self._backlog or self._written_above)
                else:  # what a failed member did not write is failed, not waited for
                    pending = False
                if complete and not pending:
                    pending = self._copied < self._can_complete_locked()
            self.waker.run(drain)
            if not pending:
                return
            await asyncio.sleep(delay)  # the other ranks' progress is only seen by looking
            delay = min(POLL_MAX, delay * 2)

    def _closing(self) -> asyncio.Task[None] | None:
        """Close hook: write what is queued; return a task draining the rest, if any is left."""
        self.check()
        with self.lock:
            done = not (self._queued or self._backlog or self._written_above) and (
                self._copied >= self._can_complete_locked()
            )
        if done:
            return None
        task = linger(self.drain(complete=True), name="aiodist-metrics-drain")
        self.group.spawn(task)  # the session's close waits for it too
        return task

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
            head = queued[0] if queued else None
            # Records the caller queued a whole period ago and did not write since.
            stale, self._stale = head is not None and head is self._stale, head
            before = self._copied
        # Nobody waits: only write what a caller that stopped syncing left queued (one
        # that still syncs writes its own), and retry the backlog; copy out what is done.
        if period < POLL_QUEUED or stale or self._backlog or self._complete > self._copied:
            self.check()
        failure = self._failure_now()
        with self.lock:
            drain = None
            if failure is not None:
                drain = self.waker.queue_locked(self._fail_locked(*failure))
            watched = bool(self._watched)
            # Syncs in flight keep it looking (slowly when nobody waits): it writes what
            # a caller left queued, and fails them if the group breaks or times out.
            busy = (self._failure is None or self._fail_from > self._copied) and (
                watched
                or bool(self._backlog or self._queued or self._written_above)
                or self._can_complete_locked() > self._complete
            )
            # It goes on a while after the last sync in flight: a caller that syncs again
            # soon finds it running, rather than waking the loop to start it.
            self._idle = 0 if busy else self._idle + 1
            if self._delay < period:
                pass  # someone started waiting meanwhile (``watch``): keep their period
            elif not busy and self._idle > IDLE_POLLS:
                self._polling = False
            elif not watched:
                self._delay = POLL_QUEUED
            elif self._copied > before or period >= POLL_QUEUED:
                self._delay = POLL_MIN  # progress, or someone started waiting: look soon
            else:
                self._delay = min(POLL_MAX, period * 2)
            delay, polling = self._delay, self._polling
        self.waker.run(drain)
        if polling:
            self._arm(delay)
        elif self._queued:
            # A sync queued (without the lock) after the look above may have seen the
            # poller still running and left it to us: look at its record in time.
            self.watch(soon=False)

    def _failure_now(self) -> tuple[BaseException, int] | None:
        """The error pending syncs fail with and the first sync it fails: all of them when
        the group broke or the oldest timed out; when members failed (or left), those
        that one of them did not write."""
        g = self.group
        try:
            g.check_usable(p2p=True)
        except Exception as exc:
            return exc, 0
        if g.error is not None:
            session = g.session
            gone = session.failed_ranks.keys() | session.plane.left.keys()
            members = [r for r, rank in enumerate(g.ranks) if rank in gone]
            failure = g.error, self._slots.written_by(members) if members else 0
            if self._failure is None or failure[1] < self._fail_from:
                return failure
        with self.lock:
            deadlines = self._deadlines
            if not deadlines or deadlines[0][1] > time.monotonic():
                return None
            index = self._complete
            what = (
                f"metrics.sync#{self._slots.seq(index)}"
                if index < self._written
                else f"metrics sync {index}"
            )
        timed_out = DistTimeoutError(
            f"{what} on group {g.name!r} timed out after {g.timeout:.1f} s; a rank may not "
            "have called it, or may be stuck. The group is broken."
        )
        g.break_(timed_out)
        return timed_out, 0
