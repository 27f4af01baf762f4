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
A sync's handle (``BoardWork``) is a ``Work`` settled as above, on whichever
thread looked: its waiters and listeners register under the board's lock, and
``Waker`` wakes them on the loop's thread, in the order they settled. The
handles of one bucket share a ``Bucket``, which receives every rank's raw
records of the bucket's syncs when they are copied out. A sync's records
(``_metrics.record``) are decoded (``Rows``) only when someone reads the
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

Set-up (``open_board``) runs inside the aggregator's first sync on the group:
group rank 0 creates the segment (``shm.create_segment``: ``0600``, named after
its pid, so a crashed creator's file is removed by the others) and sends its
name; each rank maps it and answers whether it could (and whether
``AIODIST_METRICS_SHM`` lets it); rank 0 unlinks the file and tells everyone
the outcome. Any "no" sends every rank down the socket path, together.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from array import array
from collections import deque
from datetime import timedelta
from operator import itemgetter
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from aiodist import _settings
from aiodist._errors import CollectiveMismatchError, DistError, DistTimeoutError
from aiodist._group.lingering import linger
from aiodist._group.work import Work
from aiodist._metrics import record, slots
from aiodist._metrics.results import MetricResults
from aiodist._metrics.slots import BUCKETS, GROUP, MAX_RECORD_BYTES, Slots
from aiodist._metrics.state import layout_of, union_of
from aiodist._ops import shared
from aiodist._transport import shm

if TYPE_CHECKING:
    from collections.abc import Callable, Generator

    from aiodist._group.group import ProcessGroup
    from aiodist._metrics.record import Record, Single
    from aiodist._metrics.slots import Chunk
    from aiodist._ops.exchange import Exchange

logger = logging.getLogger(__name__)

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

_STEP: Final = 3 << 10  # set-up messages: after the fused path's three phases
# Seconds wait() gives the loop to deliver earlier callbacks when the sync is done already.
_DELIVERY_WAIT: Final = 5.0


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


def enabled() -> bool:
    """``AIODIST_METRICS_SHM`` (default on): whether this rank offers the shared board."""
    return _settings.METRICS_SHM.read()


async def open_board(ex: Exchange) -> Board | None:
    """Set up the shared board inside ``ex``, the aggregator's first sync on its group.

    Returns the same kind of answer on every rank: a board each, or None each.
    """
    g = ex.g
    if g.world_size < 2 or not await shared.agreed(g):
        return None
    nbytes = slots.nbytes(g.world_size)
    others = range(1, g.world_size)
    segment: shm.Segment | None = None
    try:
        if g.rank == 0:
            if enabled():
                try:
                    segment = shm.create_segment(nbytes)
                except OSError as exc:
                    logger.warning("metrics sync falls back to sockets: %s", exc)
            offer = segment.name.encode() if segment is not None else b""
            for r in others:
                await ex.send(r, _STEP, offer)
            answers = [await ex.recv(r, _STEP + 1) for r in others]
            ok = segment is not None and all(bytes(m.data) == b"1" for m in answers)
            if segment is not None:
                segment.unlink()  # every rank mapped it, or none will use it
            for r in others:
                await ex.send(r, _STEP + 2, b"1" if ok else b"0")
        else:
            msg = await ex.recv(0, _STEP)
            name = bytes(msg.data).decode()
            if name and enabled():
                try:
                    segment = shm.map_segment(name, nbytes)
                except (OSError, ValueError) as exc:
                    logger.warning("metrics sync falls back to sockets: %s", exc)
            await ex.send(0, _STEP + 1, b"1" if segment is not None else b"0")
            go = await ex.recv(0, _STEP + 2)
            ok = segment is not None and bytes(go.data) == b"1"
    except BaseException:
        if segment is not None:
            segment.close()
        raise
    if not ok:
        if segment is not None:
            segment.close()
        return None
    assert segment is not None
    return Board(g, segment)


class BoardWork(Work[MetricResults]):
    """A sync on the board: settled by whoever looks at it once it is copied out."""

    __slots__ = ("_board", "bucket", "index", "seq")

    def __init__(self, board: Board, index: int, seq: int, bucket: Bucket) -> None:
        # Work.pending(), spelled out (one per training step); the description is
        # made when someone reads it.
        self._loop = board.loop
        self._value = self._error = self._waiters = self._listeners = self._withdraw = None
        self._done = False
        self._board = board
        self.index = index
        self.seq = seq
        self.bucket = bucket  # holding it keeps the bucket's records copied out

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"metrics.sync#{self.seq}"

    def _look(self) -> None:
        """Write what this rank queued, copy out what completed; settle if it can."""
        board = self._board
        board.check()  # settles the watched handles first: they run in index order
        if not self._done:
            with board.lock:
                board.settle_locked(self)  # not watched: nobody to wake

    # Waiters and listeners register under the board's lock: another thread may settle.

    def when_done(self, fn: Callable[[Work[MetricResults]], object]) -> None:
        # Even a handle done already goes through the board's queue: listeners run in
        # the order handles settled (call order), whichever thread settled them.
        board = self._board
        with board.lock:
            woken = board.settle_locked(self)
            if not self._done:
                if self._listeners is None:
                    self._listeners = [fn]
                    board.watch_locked(self)
                else:
                    self._listeners.append(fn)
                drain = None
            else:
                items = [woken] if woken is not None else []
                items.append([self, None, [fn]])
                drain = board.waker.queue_locked(items)
        if not self._done:
            board.watch()
        else:
            board.waker.run(drain)

    def add_done_callback(self, fn: Callable[[Work[MetricResults]], object]) -> None:
        """Call ``fn(self)`` on the event loop once the sync finished, in call order."""
        loop = self._loop
        assert loop is not None
        self.when_done(lambda w: loop.call_soon(fn, w))

    def __await__(self) -> Generator[Any, None, MetricResults]:
        if not self._done:
            self._look()
        if not self._done:
            assert self._loop is not None
            waiter: asyncio.Future[None] = self._loop.create_future()
            board = self._board
            with board.lock:
                woken = board.settle_locked(self)
                pending = not self._done
                if pending:
                    if self._waiters is None:
                        self._waiters = [waiter]
                    else:
                        self._waiters.append(waiter)
                    board.watch_locked(self)
                drain = board.waker.queue_locked([woken] if woken is not None else [])
            board.waker.run(drain)
            if pending:
                board.watch()
                yield from waiter.__await__()
        return self.result()

    def is_completed(self) -> bool:
        if not self._done:
            self._look()
        return self._done

    def result(self) -> MetricResults:
        if not self._done:
            self._look()
        self._materialize()
        return super().result()

    def exception(self) -> BaseException | None:
        if not self._done:
            self._look()
        self._materialize()
        return super().exception()

    def wait(self, timeout: float | timedelta | None = None) -> MetricResults:
        """Block until done; callbacks of syncs that finished before this one have run.

        A sync this thread found complete is done before the loop has run the
        callbacks of the syncs before it: the loop gets one turn to deliver them.
        """
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        loop = self._loop
        assert loop is not None
        if not self._done:
            self._look()
        if self._done and loop.is_running() and not self._board.on_loop_thread():
            self._done_on_loop(_DELIVERY_WAIT if timeout is None else timeout)
            return self.result()
        return super().wait(timeout)

    def _materialize(self) -> None:
        value = self._value
        if type(value) is Rows:
            try:
                self._value = value.decode()
            except (DistError, ValueError) as exc:
                self._value, self._error = None, exc

    def _settle_locked(self, value: Any, error: BaseException | None) -> list[Any] | None:
        """Settle under the board's lock; return what to wake (outside it), if anything."""
        if self._done:
            return None
        self._value, self._error, self._done = value, error, True
        waiters, listeners = self._waiters, self._listeners
        self._waiters = self._listeners = None
        if waiters is None and listeners is None:
            return None
        return [self, waiters, listeners]


class Bucket:
    """The records of one bucket's syncs, copied out for the handles that share it."""

    __slots__ = ("__weakref__", "_chunks", "number")

    def __init__(self, number: int) -> None:
        self.number = number
        self._chunks: list[tuple[int, int, list[Chunk]]] = []  # (start, stop, one per rank)

    def add(self, start: int, stop: int, chunks: list[Chunk]) -> None:
        self._chunks.append((start, stop, chunks))

    def outcome(self, index: int, group: str) -> tuple[Rows | None, BaseException | None]:
        """Sync ``index``'s every-rank records, or the error they make (not one sequence)."""
        chunks = next((c for start, stop, c in self._chunks if start <= index < stop), None)
        if chunks is None:  # the board copies out every bucket a handle holds: not expected
            return None, RuntimeError(f"metrics sync {index} was not copied out")
        rows = [chunk.record(index) for chunk in chunks]
        seqs = {seq for seq, _ in rows}
        if len(seqs) > 1:
            by_rank = {r: seq for r, (seq, _) in enumerate(rows)}
            return None, CollectiveMismatchError(
                f"ranks reached metrics sync {index} of group {group!r} at different points "
                f"among the group's collectives (sequence numbers {by_rank}); call "
                "collectives in the same order on every rank",
                field="seq",
                values_by_rank=by_rank,
            )
        return Rows(group, [data for _, data in rows], MAX_RECORD_BYTES), None


class Rows:
    """Every rank's slot of one completed sync, copied out; decoded on first read."""

    __slots__ = ("group", "limit", "rows")

    def __init__(self, group: str, rows: list[bytes | None], limit: int) -> None:
        self.group = group
        self.rows = rows  # None: that rank's records did not fit in ``limit`` bytes
        self.limit = limit

    def decode(self) -> MetricResults:
        """Reduce the ranks' records as the fused path does (same layout, same order)."""
        decoded: list[list[list[Any]]] = []
        for r, row in enumerate(self.rows):
            if row is None:
                raise ValueError(
                    f"rank {r} synced more metrics than fit in one shared-memory sync "
                    f"({self.limit} bytes encoded); sync fewer metrics at a time, or "
                    "set AIODIST_METRICS_SHM=0 on every rank"
                )
            decoded.append(record.decode(row))
        tables = [{name: red for name, red, *_ in records} for records in decoded]
        layout = layout_of(union_of(tables, self.group))
        buf: array[float] = array("d")
        for r, records in enumerate(decoded):
            buf.extend(layout.pack({rec[0]: rec[2:] for rec in records}, r))
        vals = layout.reduce_rows(memoryview(buf), len(decoded))
        return MetricResults(layout.unpack(vals), layout.reductions)


class Waker:
    """Wakes settled handles on the loop's thread, in the order they settled.

    Handles settle in index order, on whichever thread looked (the training
    loop's, the event loop's): one queue, drained by one callback on the loop.
    """

    __slots__ = ("_draining", "_items", "_lock", "_loop", "_loop_thread")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, lock: threading.Lock, loop_thread: int
    ) -> None:
        self._loop, self._lock, self._loop_thread = loop, lock, loop_thread
        self._items: list[list[Any]] = []  # settled handles whose waiters wake next
        self._draining = False

    def queue_locked(self, woken: list[list[Any]]) -> bool | None:
        """Queue ``woken`` (under the lock); True: drain it now (loop thread), False: soon,
        None: no need."""
        if not woken:
            return None
        self._items.extend(woken)
        if self._draining:
            return None
        self._draining = True
        return threading.get_ident() == self._loop_thread

    def run(self, drain: bool | None) -> None:
        """Act on ``queue_locked``'s answer, outside the lock."""
        if drain:
            self._drain()
        elif drain is False and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                items, self._items = self._items, []
                if not items:
                    self._draining = False
                    return
            wake(items)


def wake(items: list[list[Any]]) -> None:
    for work, waiters, listeners in items:
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)
        for fn in listeners or ():
            fn(work)
