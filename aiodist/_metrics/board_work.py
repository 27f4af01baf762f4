"""The shared board's handles and records (see ``_metrics.board``).

``BoardWork`` is a ``Work`` that settles lazily: when someone looks at it and
its sync is copied out, or, once someone waits on it, when the board copies
it out (the training loop's thread in its next batch, or the event loop's
poller). Waiters and listeners register under the board's lock, and whoever
settles wakes them on the loop's thread. The handles of one bucket share a
``Bucket``, which receives every rank's raw records of the bucket's syncs
when they are copied out; a sync's records (``Rows``) are decoded on first read.
"""

from __future__ import annotations

import threading
from array import array
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiodist._errors import CollectiveMismatchError, DistError
from aiodist._group.work import Work
from aiodist._metrics import record
from aiodist._metrics.results import MetricResults
from aiodist._metrics.slots import MAX_RECORD_BYTES
from aiodist._metrics.state import layout_of, union_of

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Generator

    from aiodist._metrics.slots import Chunk

# Seconds wait() gives the loop to deliver earlier callbacks when the sync is done already.
_DELIVERY_WAIT: Final = 5.0


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


class Settler(Protocol):
    """What a handle needs of the board that settles it (``board.Board``)."""

    loop: asyncio.AbstractEventLoop
    lock: threading.Lock
    waker: Waker

    def check(self, *, eager: bool = True) -> None: ...

    def on_loop_thread(self) -> bool: ...

    def settle_locked(self, work: BoardWork) -> list[Any] | None: ...

    def watch_locked(self, work: BoardWork) -> None: ...

    def watch(self, *, soon: bool = True) -> None: ...


class BoardWork(Work[MetricResults]):
    """A sync on the board: settled by whoever looks at it once it is copied out."""

    __slots__ = ("_board", "bucket", "index", "seq")

    def __init__(self, board: Settler, index: int, seq: int, bucket: Bucket) -> None:
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
