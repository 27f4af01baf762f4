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
  what sat queued.

A slot is ``[stamp u64 | seq u64 | nbytes u32 | crc u32 | records]``, the stamp
written last. x86 keeps stores in program order, so a stamp seen means the bytes
it stamps are there. Elsewhere the CRC (of the sync's index and the records)
catches a stamp seen before its bytes, and the slot is read again later. The
records (``_metrics.record``) are copied out when the sync completes and
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
import os
import platform
import struct
import threading
import time
import weakref
import zlib
from collections import deque
from typing import TYPE_CHECKING, Any, Final

from aiodist._collectives import common, shared
from aiodist._errors import CollectiveMismatchError, DistTimeoutError
from aiodist._metrics.board_work import BoardWork, Rows, wake
from aiodist._transport import shm

if TYPE_CHECKING:
    from collections.abc import Sequence

    from aiodist._group import ProcessGroup
    from aiodist._metrics.record import Record, Single

__all__ = ["DEPTH", "MAX_RECORD_BYTES", "Board", "enabled", "open_board"]

logger = logging.getLogger(__name__)

#: Syncs a rank may be ahead of the slowest before its writes queue.
DEPTH: Final = 64
SLOT_BYTES: Final = 16 * 1024
_HEAD: Final = struct.Struct("<QQII")  # stamp (index + 1), seq, nbytes, crc
_TAIL: Final = struct.Struct("<QII")  # the head without its stamp: written first
_STAMP: Final = struct.Struct("<Q")
_COUNTER_BYTES: Final = 64  # each rank's "copied out" count, alone on a cache line
#: The largest encoded record a rank may write per sync (about five hundred metrics).
MAX_RECORD_BYTES: Final = SLOT_BYTES - _HEAD.size
_OVERSIZE: Final = 0xFFFFFFFF
#: A sync writes its rank's queued records once this many are queued.
BATCH: Final = 16
POLL_MIN: Final = 0.0002
POLL_MAX: Final = 0.004
POLL_QUEUED: Final = 0.05  # nobody waiting: records may sit queued up to twice this
_STEP: Final = 3 << 10  # set-up messages: after the fused path's three phases
# Total store order: no checksum needed to trust a stamped slot.
_CHECKSUM: Final = platform.machine().lower() not in {"x86_64", "amd64", "i386", "i686"}


def enabled() -> bool:
    """``AIODIST_METRICS_SHM`` (default on): whether this rank offers the shared board."""
    return os.environ.get("AIODIST_METRICS_SHM", "1") != "0"


class Board:
    """One aggregator's shared segment on one group, as this rank sees it."""

    def __init__(self, g: ProcessGroup, segment: shm.Segment) -> None:
        self.group = g
        self.loop = asyncio.get_running_loop()
        self.lock = threading.Lock()
        self.loop_thread = threading.get_ident()
        self.session = g.session
        self._segment = segment  # holds the mapping
        self._mem = memoryview(segment.memory)
        self._rank, self._size = g.rank, g.world_size
        self._slots_at = self._size * _COUNTER_BYTES
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
        g.on_close(self.check)  # records still queued are written before the group goes
        self._to_wake: list[list[Any]] = []  # settled handles whose waiters wake next
        self._draining = False

    @staticmethod
    def nbytes(world_size: int) -> int:
        return world_size * (_COUNTER_BYTES + DEPTH * SLOT_BYTES)

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
                if writable and single.nbytes <= MAX_RECORD_BYTES and not _CHECKSUM:
                    self._write_single_locked(index, work.seq, single, weight, values)
                    continue
                record = single.encode(weight, values)
            data = record if len(record) <= MAX_RECORD_BYTES else None
            if writable:
                self._write_locked(index, work.seq, data)
            else:
                backlog.append((index, work.seq, data))

    def _write_locked(self, index: int, seq: int, data: bytes | None) -> None:
        off = self._slots_at + ((index % DEPTH) * self._size + self._rank) * SLOT_BYTES
        mem = self._mem
        if data is None:
            nbytes, crc = _OVERSIZE, 0
        else:
            nbytes = len(data)
            mem[off + _HEAD.size : off + _HEAD.size + nbytes] = data
            crc = zlib.crc32(data, index & 0xFFFFFFFF) if _CHECKSUM else 0
        _TAIL.pack_into(mem, off + _STAMP.size, seq, nbytes, crc)
        _STAMP.pack_into(mem, off, index + 1)  # last: the slot is whole once stamped

    def _write_single_locked(
        self, index: int, seq: int, single: Single, weight: float, values: Sequence[float]
    ) -> None:
        """``_write_locked`` of ``single.encode(weight, values)``, in one packing."""
        off = self._slots_at + ((index % DEPTH) * self._size + self._rank) * SLOT_BYTES
        packer = single.slot
        if packer is None:  # the slot's head after the stamp, then the record
            packer = single.slot = struct.Struct(
                f"{_TAIL.format}{len(single.prefix)}s{single.count + 1}d"
            )
        packer.pack_into(
            self._mem, off + _STAMP.size, seq, single.nbytes, 0, single.prefix, weight, *values
        )
        _STAMP.pack_into(self._mem, off, index + 1)  # last: the slot is whole once stamped

    def _writable(self, index: int) -> bool:
        if index < self._writable_below:
            return True
        mem = self._mem
        copied = min(_STAMP.unpack_from(mem, r * _COUNTER_BYTES)[0] for r in range(self._size))
        self._writable_below = copied + DEPTH
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
                self._write_locked(*entry)
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
            rows = self._read(copied)
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
            _STAMP.pack_into(self._mem, self._rank * _COUNTER_BYTES, copied)
        return woken

    def keep_locked(self, work: BoardWork) -> None:
        """Hold ``work`` until it settles (it has listeners, and maybe no other holder)."""
        self._kept[work.index] = work

    def _live_locked(self) -> list[BoardWork]:
        """The pending handles someone still holds, oldest first."""
        return [w for w in (ref() for ref in self._pending.values()) if w is not None]

    def _read(self, index: int) -> list[tuple[int, bytes | None]] | None:
        """Every rank's (seq, record) of sync ``index``, or None while one is missing."""
        mem = self._mem
        stamp = index + 1
        base = self._slots_at + (index % DEPTH) * self._size * SLOT_BYTES
        offsets = range(base, base + self._size * SLOT_BYTES, SLOT_BYTES)
        for off in offsets:
            if _STAMP.unpack_from(mem, off)[0] != stamp:
                return None
        rows: list[tuple[int, bytes | None]] = []
        for off in offsets:
            _, seq, nbytes, crc = _HEAD.unpack_from(mem, off)
            if nbytes == _OVERSIZE:
                rows.append((seq, None))
                continue
            if nbytes > MAX_RECORD_BYTES:
                return None  # a torn head: read again later
            data = bytes(mem[off + _HEAD.size : off + _HEAD.size + nbytes])
            if _CHECKSUM and zlib.crc32(data, index & 0xFFFFFFFF) != crc:
                return None  # being written, or not visible yet: read again later
            rows.append((seq, data))
        return rows

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
            keep = watched or bool(self._backlog or self._queued or self._pending)
            if self._delay < period:
                pass  # someone started waiting meanwhile (``watch``): keep their period
            elif not keep:
                self._polling = False
            elif not watched:
                self._delay = POLL_QUEUED
            elif len(self._pending) < before or period >= POLL_QUEUED:
                self._delay = POLL_MIN  # progress, or someone started waiting: look soon
            else:
                self._delay = min(POLL_MAX, period * 2)
            delay = self._delay
        self.run_wake(drain)
        if keep:
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


async def open_board(g: ProcessGroup, seq: int) -> Board | None:
    """Set up the shared board inside sync ``seq`` (the aggregator's first on ``g``).

    Returns the same kind of answer on every rank: a board each, or None each.
    """
    if g.world_size < 2 or not await shared.agreed(g):
        return None
    mine = common.signature("metrics.board")
    nbytes = Board.nbytes(g.world_size)
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
                await common.send(g, r, seq, _STEP, mine, offer)
            answers = [await common.recv(g, r, seq, _STEP + 1) for r in others]
            for msg in answers:
                common.check_signature(g, mine, msg)
            ok = segment is not None and all(bytes(m.data) == b"1" for m in answers)
            if segment is not None:
                segment.unlink()  # every rank mapped it, or none will use it
            for r in others:
                await common.send(g, r, seq, _STEP + 2, mine, b"1" if ok else b"0")
        else:
            msg = await common.recv(g, 0, seq, _STEP)
            common.check_signature(g, mine, msg)
            name = bytes(msg.data).decode()
            if name and enabled():
                try:
                    segment = shm.map_segment(name, nbytes)
                except (OSError, ValueError) as exc:
                    logger.warning("metrics sync falls back to sockets: %s", exc)
            await common.send(g, 0, seq, _STEP + 1, mine, b"1" if segment is not None else b"0")
            go = await common.recv(g, 0, seq, _STEP + 2)
            common.check_signature(g, mine, go)
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
