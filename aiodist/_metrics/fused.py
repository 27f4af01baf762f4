"""The fused metric reduction: one operation of the group, in one sequence number.

``start_sync`` takes the group's next sequence number at call time (as every
collective does) and runs, inside that one operation:

1. the **fused reduction** of the buffer laid out by the key set agreed at the
   previous sync: every rank's buffer (a few hundred bytes) reaches every other
   (``exchange_rows``: one round in small groups, ``log2 P`` in larger ones),
   which combines all rows in rank order, so every rank gets bitwise the same
   values. The combine adds the sum segment, takes the maximum of the max segment and
   keeps the lowest rank's pair in the select segment;
2. only when that buffer's flag says some rank has a metric outside the agreed
   set (and at the first sync): the **key union** of every rank's
   ``{name: reduction}`` table (two ``exchange_rows``: the tables' lengths, then
   the tables), then the fused reduction again on the new layout.

The agreed key set only grows, so a loop whose metrics do not change pays one
reduction per sync, and one that logs an extra metric every N steps pays the
union once. Each sync needs the key set its predecessor agreed on, so syncs in
flight chain on a future (set when the predecessor's values are known: syncs
resolve in call order); all of them still overlap the caller's compute.

The common case (host values, the previous key set known) runs with no task:
the buffer is packed and sent when ``sync()`` is called and the data plane's
callbacks finish the rest (``_ops.exchange.exchange_rows``). Every
other case runs as a task with the same messages, so ranks agree whichever way
each of them took. A sync's exchange opens with its first round's messages
(the fused reduction, at step 0), except the first sync's, which sets up the
shared board or agrees on keys first and so opens on its own (``Exchange``).
"""

from __future__ import annotations

import asyncio
import struct
from typing import TYPE_CHECKING, Any

from aiodist._metrics.board import Board, open_board
from aiodist._metrics.record import encode
from aiodist._metrics.results import MetricResults
from aiodist._metrics.state import Layout, Reduction, Snapshot, layout_of, union_of
from aiodist._ops.agreement import signature
from aiodist._ops.exchange import Exchange, exchange_rows
from aiodist._wire import codec

if TYPE_CHECKING:
    from array import array

    import anyio

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work

Schema = tuple[tuple[str, Reduction], ...]
# What a sync hands the next one: the key set it agreed on, or the shared board
# that every later sync of the aggregator on the group goes through.
Route = Schema | Board
Reduced = dict[str, tuple[float, float, int]]

# Step ranges of the three phases inside one sequence number.
_FIRST, _UNION, _SECOND = 0, 1 << 10, 2 << 10
_TABLES = 1 << 9  # the union's second exchange, within its phase
_SIZE = struct.Struct("=Q")  # native, as ``cast("Q")`` reads it
_limiters: dict[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = {}


def _signature(layout: Layout | None) -> list[Any]:
    """What every rank of a sync agrees on: the buffer laid out by the previous sync's keys."""
    if layout is None:  # the first sync: no key set yet
        return signature("metrics.sync")
    return signature("metrics.sync", None, shape=[layout.numel], algorithm="fused")


def start_sync(
    g: ProcessGroup,
    snapshot: Snapshot,
    previous: asyncio.Future[Route] | None,
    agreed: asyncio.Future[Route],
    index: int,
) -> Work[MetricResults]:
    """Start sync ``index`` of ``snapshot`` across ``g``; set ``agreed`` to the route it took.

    ``previous`` is the route of the sync before (a future, None before the
    first, which also sets up the shared board when it can). ``agreed`` is
    always resolved, with an exception if this sync fails, so a sync chained
    after it never waits forever.
    """
    # On the shared board, a member's failure fails only the syncs it did not write.
    g.check_usable(p2p=previous is not None and _on_board(previous))
    seq = g.next_seq()
    work: Work[MetricResults] = g.begin("metrics.sync", seq=seq)
    if work.is_completed() and (aborted := work.exception()) is not None:  # aborted by a member
        _fail_agreed(agreed, aborted)
        return work
    if previous is None or snapshot.event is not None:

        async def op(s: int) -> MetricResults:
            return await run_sync(g, work, s, snapshot, previous, agreed, index)

        return g.drive(work, op, seq)

    def failed(w: Work[Any]) -> None:
        if (exc := w.exception()) is not None:
            _fail_agreed(agreed, exc)

    work.when_done(failed)

    def exchange(prev: asyncio.Future[Route]) -> None:
        # The key set the previous sync agreed on is known: pack and send (no task).
        if work.is_completed():
            return  # timed out, or the group broke, while waiting for the previous sync
        if prev.cancelled() or prev.exception() is not None:
            g.fail(work, prev.exception() or asyncio.CancelledError(), collective=True)
            return
        route = prev.result()
        try:
            # Broken since sync() was called: receives posted now would hang (the board
            # fails what a failed member did not write).
            g.check_usable(p2p=isinstance(route, Board))
        except Exception as exc:
            g.fail(work, exc, collective=True)
            return
        if isinstance(route, Board):
            _post(route, index, seq, snapshot, agreed, work)
            return
        schema = route
        layout = layout_of(schema)

        def done(rows: memoryview) -> None:
            vals = layout.reduce_rows(rows.cast("d"), g.world_size)
            if layout.flagged(vals):  # some rank has a new metric: agree on keys, again
                g.drive(work, lambda s: _agree(ex, snapshot, schema, agreed), seq)
                return
            agreed.set_result(schema)
            work.set_result(MetricResults(layout.unpack(vals), layout.reductions))

        packed = layout.pack(snapshot.records(), g.rank)
        ex = Exchange(g, work, seq, _signature(layout), rides=True)
        exchange_rows(ex, memoryview(packed).cast("B"), done)

    if previous.done():
        exchange(previous)
    else:  # syncs resolve in call order: this one goes once its predecessor agreed
        previous.add_done_callback(exchange)
    return work


def _post(
    board: Board,
    index: int,
    seq: int,
    snapshot: Snapshot,
    agreed: asyncio.Future[Route],
    work: Work[MetricResults],
) -> Work[MetricResults]:
    """Sync ``index`` goes onto the board; ``work`` settles with it, in call order."""
    record = encode(snapshot)
    # Its route at once: later syncs need not wait for this one's values. And before
    # posting: a sync the board fails at once (one a failed member never wrote) fails
    # ``work`` inside ``post``, and ``work``'s listener fails ``agreed`` with it.
    agreed.set_result(board)
    return board.post(index, seq, record, work.settle_as)


def _on_board(route: asyncio.Future[Route]) -> bool:
    return (
        route.done()
        and not route.cancelled()
        and route.exception() is None
        and isinstance(route.result(), Board)
    )


def _fail_agreed(agreed: asyncio.Future[Route], exc: BaseException) -> None:
    if not agreed.done():
        agreed.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
        agreed.exception()  # retrieved: the sync's own Work reports it


async def wait_device_copy(snapshot: Snapshot) -> None:
    """Wait for the snapshot's GPU-to-host copy without blocking the loop.

    A worker thread waits on the CUDA event; we wait that thread out (the copy
    of a few hundred bytes finishes soon after the work queued before it).
    """
    if snapshot.event is None or snapshot.event.query():
        return
    import anyio

    loop = asyncio.get_running_loop()
    limiter = _limiters.get(loop)
    if limiter is None:
        limiter = _limiters[loop] = anyio.CapacityLimiter(1)
    await anyio.to_thread.run_sync(snapshot.event.synchronize, limiter=limiter)


async def _rows(ex: Exchange, step: int, data: memoryview) -> memoryview:
    """Every rank's ``data`` (as long as this rank's), in rank order (``exchange_rows``)."""
    rows: asyncio.Future[memoryview] = asyncio.get_running_loop().create_future()
    exchange_rows(ex, data, rows.set_result, step=step)
    return await rows


async def _reduce(ex: Exchange, base: int, layout: Layout, buf: array[float]) -> list[float]:
    """All-reduce ``buf`` (laid out by ``layout``) across the group; return the values."""
    rows = await _rows(ex, base, memoryview(buf).cast("B"))
    return layout.reduce_rows(rows.cast("d"), ex.g.world_size)


async def _union(ex: Exchange, table: dict[str, Reduction]) -> Schema:
    """The union of every rank's ``{name: reduction}`` table, sorted (``state.union_of``).

    Two exchanges: the encoded tables' lengths, then the tables, each padded to the longest.
    """
    mine = codec.dumps(sorted(table.items()))
    sizes = (await _rows(ex, _UNION, memoryview(_SIZE.pack(len(mine))))).cast("Q")
    n = max(sizes)
    rows = await _rows(ex, _UNION + _TABLES, memoryview(mine.ljust(n, b"\0")))
    tables = [dict(codec.loads(rows[r * n : r * n + size])) for r, size in enumerate(sizes)]
    return union_of(tables, ex.g.name)


async def _agree(
    ex: Exchange,
    snapshot: Snapshot,
    schema: Schema | None,
    agreed: asyncio.Future[Route],
) -> MetricResults:
    """Phase 2: agree on the union of keys, then reduce on its layout."""
    try:
        records = snapshot.records()
        table: dict[str, Reduction] = {**dict(schema or ()), **snapshot.reductions}
        schema = await _union(ex, table)
        layout = layout_of(schema)
        vals = await _reduce(ex, _SECOND, layout, layout.pack(records, ex.g.rank))
        agreed.set_result(schema)  # only now: syncs resolve in the order they were called
        return MetricResults(layout.unpack(vals), layout.reductions)
    except BaseException as exc:
        _fail_agreed(agreed, exc)
        raise


async def run_sync(
    g: ProcessGroup,
    work: Work[MetricResults],
    seq: int,
    snapshot: Snapshot,
    previous: asyncio.Future[Route] | None,
    agreed: asyncio.Future[Route],
    index: int,
) -> MetricResults:
    """One sync as a task: wait for the previous route and the device copy, then reduce.

    The first sync (no ``previous``) sets up the shared board first; when every
    rank has one, this and every later sync go through it. On the board,
    ``work`` is settled as soon as the board's handle is, so syncs still
    resolve in call order.
    """
    try:
        if previous is None:  # every rank's first sync: it opens on its own
            ex = Exchange(g, work, seq, _signature(None), rides=False)
            route: Route | None = await open_board(ex)
            await ex.agreed()
        else:
            route = await previous
        await wait_device_copy(snapshot)
        if isinstance(route, Board):
            return await _post(route, index, seq, snapshot, agreed, work)
        if route is not None:
            layout = layout_of(route)
            ex = Exchange(g, work, seq, _signature(layout), rides=True)  # its rows open it
            vals = await _reduce(ex, _FIRST, layout, layout.pack(snapshot.records(), g.rank))
            if not layout.flagged(vals):
                agreed.set_result(route)
                return MetricResults(layout.unpack(vals), layout.reductions)
    except BaseException as exc:
        _fail_agreed(agreed, exc)
        raise
    return await _agree(ex, snapshot, route, agreed)


def reduce_locally(snapshot: Snapshot) -> Reduced:
    """The single-process answer (not initialised): the snapshot's own values."""
    if snapshot.event is not None:
        snapshot.event.synchronize()
    records = snapshot.records()
    layout = Layout.of(tuple(snapshot.reductions.items()))
    return layout.unpack(layout.pack(records, 0))
