"""The fused metric reduction: one operation of the group, in one sequence number.

``start_sync`` takes the group's next sequence number at call time (as every
collective does) and runs, inside that one operation:

1. the **fused reduction** of the buffer laid out by the key set agreed at the
   previous sync: in groups of up to ``DIRECT_MAX_RANKS`` every rank sends its
   buffer (a few hundred bytes) to every other and combines all rows in rank
   order, one round; in larger groups recursive doubling (``log2 P`` exchanges).
   The combine adds the sum segment, takes the maximum of the max segment and
   keeps the lowest rank's pair in the select segment;
2. only when that buffer's flag says some rank has a metric outside the agreed
   set (and at the first sync): the **key union**, recursive doubling of the
   ``{name: reduction}`` tables, then the fused reduction again on the new layout.

The agreed key set only grows, so a loop whose metrics do not change pays one
reduction per sync, and one that logs an extra metric every N steps pays the
union once. Each sync needs the key set its predecessor agreed on, so syncs in
flight chain on a future (set when the predecessor's values are known: syncs
resolve in call order); all of them still overlap the caller's compute.

The common case (host values, the previous key set known, a small group) runs
with no task: the buffer is packed and sent when ``sync()`` is called and the
data plane's callbacks finish the rest (``common.exchange_all``). Every other
case runs as a task with the same messages, so ranks agree whichever way each
of them took.
"""

from __future__ import annotations

import asyncio
from array import array
from typing import TYPE_CHECKING, Any

from aiodist._errors import CollectiveMismatchError
from aiodist._group.lingering import linger
from aiodist._group.work import Work
from aiodist._metrics.board import Board
from aiodist._metrics.board_setup import open_board
from aiodist._metrics.record import encode
from aiodist._metrics.results import MetricResults
from aiodist._metrics.state import Layout, Reduction, Snapshot, layout_of
from aiodist._ops import common, schedules
from aiodist._wire import codec

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import anyio

    from aiodist._group.group import ProcessGroup

__all__ = ["Schema", "reduce_locally", "start_sync"]

Schema = tuple[tuple[str, Reduction], ...]
# What a sync hands the next one: the key set it agreed on, or the shared board
# that every later sync of the aggregator on the group goes through.
Route = Schema | Board
Reduced = dict[str, tuple[float, float, int]]

# Step ranges of the three phases inside one sequence number.
_FIRST, _UNION, _SECOND = 0, 1 << 10, 2 << 10
_FOLD, _UNFOLD = 1 << 9, (1 << 9) + 1  # offsets within a phase
_limiters: dict[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = {}


def _signature(layout: Layout) -> list[Any]:
    return ["metrics.sync", "float64", [layout.numel], None, None]


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
    seq = g.take_seq()
    work: Work[MetricResults] = g.begin("metrics.sync", seq=seq)
    if work.is_completed() and (aborted := work.exception()) is not None:  # aborted by a member
        _fail_agreed(agreed, aborted)
        return work
    if previous is None or snapshot.event is not None or g.world_size > _direct_max():

        async def op(s: int) -> MetricResults:
            return await run_sync(g, s, snapshot, previous, agreed, index, work)

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
        try:
            g.check_usable()  # broken since sync() was called: receives posted now would hang
        except Exception as exc:
            g.fail(work, exc, collective=True)
            return
        route = prev.result()
        if isinstance(route, Board):
            _post(route, index, seq, snapshot, agreed, work)
            return
        schema = route
        layout = layout_of(schema)

        def done(rows: memoryview) -> None:
            vals = layout.reduce_rows(rows.cast("d"), g.world_size)
            if layout.flagged(vals):  # some rank has a new metric: agree on keys, again
                g.drive(work, lambda s: _agree(g, s, snapshot, schema, agreed), seq)
                return
            agreed.set_result(schema)
            work.set_result(MetricResults(layout.unpack(vals), layout.reductions))

        packed = layout.pack(snapshot.records(), g.rank)
        common.exchange_all(g, work, seq, _signature(layout), memoryview(packed).cast("B"), done)

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
    board_work = board.post(index, seq, encode(snapshot), work.settle_as)
    agreed.set_result(board)  # at once: later syncs need not wait for this one's values
    return board_work


def _direct_max() -> int:
    return schedules.DIRECT_MAX_RANKS


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


async def _doubling(
    g: ProcessGroup,
    base: int,
    exchange: Callable[[int, int], Awaitable[None]],
    send_only: Callable[[int, int], Awaitable[None]],
    receive: Callable[[int, int, bool], Awaitable[None]],
) -> None:
    """Recursive doubling with callbacks that move and merge one phase's state.

    ``exchange(partner, step)`` swaps states and merges; ``send_only(dst, step)``
    sends the state; ``receive(src, step, replace)`` merges (or, with
    ``replace``, adopts) a received state.
    """
    plan = schedules.recursive_doubling(g.rank, g.world_size)
    if plan.is_extra:
        assert plan.fold_partner is not None
        await send_only(plan.fold_partner, base + _FOLD)
        await receive(plan.fold_partner, base + _UNFOLD, True)
        return
    if plan.fold_partner is not None:
        await receive(plan.fold_partner, base + _FOLD, False)
    for k, partner in enumerate(plan.partners):
        await exchange(partner, base + k)
    if plan.fold_partner is not None:
        await send_only(plan.fold_partner, base + _UNFOLD)


async def _reduce(
    g: ProcessGroup, seq: int, base: int, layout: Layout, buf: array[float]
) -> list[float]:
    """All-reduce ``buf`` (laid out by ``layout``) across the group; return the values."""
    mine = _signature(layout)
    if g.world_size <= _direct_max():
        loop = asyncio.get_running_loop()
        part: Work[list[float]] = Work.pending(loop, f"metrics.sync#{seq}")

        def done(rows: memoryview) -> None:
            part.set_result(layout.reduce_rows(rows.cast("d"), g.world_size))

        common.exchange_all(g, part, seq, mine, memoryview(buf).cast("B"), done, step=base)
        return await part
    state = buf.tolist()
    scratch = memoryview(bytearray(8 * layout.numel))

    async def send_only(dst: int, step: int) -> None:
        await common.send(g, dst, seq, step, mine, memoryview(buf).cast("B"))

    async def receive(src: int, step: int, replace: bool) -> None:
        common.check_signature(g, mine, await common.recv_tensor(g, src, seq, step, scratch))
        other = scratch.cast("d").tolist()
        if replace:
            state[:] = other
        else:
            layout.merge(state, other)
        buf[:] = array("d", state)  # what send_only sends next

    async def exchange(partner: int, step: int) -> None:
        future = common.recv_tensor(g, partner, seq, step, scratch)
        await send_only(partner, step)
        common.check_signature(g, mine, await future)
        layout.merge(state, scratch.cast("d").tolist())
        buf[:] = array("d", state)

    await _doubling(g, base, exchange, send_only, receive)
    return state


async def _union(g: ProcessGroup, seq: int, table: dict[str, Reduction]) -> Schema:
    """The union of every rank's ``{name: reduction}`` table, sorted."""
    mine = common.signature("metrics.keys")
    state = dict(table)

    def merge(other: dict[str, Reduction], src: int) -> None:
        for name, red in other.items():
            have = state.setdefault(name, red)
            if have != red:
                values = {g.rank: have, src: red}
                raise CollectiveMismatchError(
                    f"ranks reduce metric {name!r} differently (rank {g.rank}: {have!r}, "
                    f"rank {src}: {red!r}); give every rank the same reductions",
                    field="reduction",
                    values_by_rank=values,
                )

    async def send_only(dst: int, step: int) -> None:
        payload = codec.dumps(sorted(state.items()))
        await common.send(g, dst, seq, step, mine, payload)

    async def get(src: int, step: int) -> dict[str, Reduction]:
        msg = await common.recv(g, src, seq, step, None)
        common.check_signature(g, mine, msg)
        return dict(codec.loads(msg.data))

    async def receive(src: int, step: int, replace: bool) -> None:
        other = await get(src, step)
        if replace:
            state.clear()
        merge(other, src)

    async def exchange(partner: int, step: int) -> None:
        future = linger(get(partner, step))  # as the sync's own task
        try:
            await send_only(partner, step)
            other = await future
        finally:
            if not future.done():
                future.cancel()
        merge(other, partner)

    g.check_usable()
    await _doubling(g, _UNION, exchange, send_only, receive)
    return tuple(sorted(state.items()))


async def _agree(
    g: ProcessGroup,
    seq: int,
    snapshot: Snapshot,
    schema: Schema | None,
    agreed: asyncio.Future[Route],
) -> MetricResults:
    """Phase 2: agree on the union of keys, then reduce on its layout."""
    try:
        records = snapshot.records()
        table: dict[str, Reduction] = {**dict(schema or ()), **snapshot.reductions}
        schema = await _union(g, seq, table)
        layout = layout_of(schema)
        vals = await _reduce(g, seq, _SECOND, layout, layout.pack(records, g.rank))
        agreed.set_result(schema)  # only now: syncs resolve in the order they were called
        return MetricResults(layout.unpack(vals), layout.reductions)
    except BaseException as exc:
        _fail_agreed(agreed, exc)
        raise


async def run_sync(
    g: ProcessGroup,
    seq: int,
    snapshot: Snapshot,
    previous: asyncio.Future[Route] | None,
    agreed: asyncio.Future[Route],
    index: int,
    work: Work[MetricResults],
) -> MetricResults:
    """One sync as a task: wait for the previous route and the device copy, then reduce.

    The first sync (no ``previous``) sets up the shared board first; when every
    rank has one, this and every later sync go through it. On the board,
    ``work`` is settled as soon as the board's handle is, so syncs still
    resolve in call order.
    """
    try:
        route = await previous if previous is not None else await open_board(g, seq)
        await wait_device_copy(snapshot)
        if isinstance(route, Board):
            return await _post(route, index, seq, snapshot, agreed, work)
        schema = route
        if schema is not None:
            layout = layout_of(schema)
            vals = await _reduce(g, seq, _FIRST, layout, layout.pack(snapshot.records(), g.rank))
            if not layout.flagged(vals):
                agreed.set_result(schema)
                return MetricResults(layout.unpack(vals), layout.reductions)
    except BaseException as exc:
        _fail_agreed(agreed, exc)
        raise
    return await _agree(g, seq, snapshot, schema, agreed)


def reduce_locally(snapshot: Snapshot) -> Reduced:
    """The single-process answer (not initialised): the snapshot's own values."""
    if snapshot.event is not None:
        snapshot.event.synchronize()
    records = snapshot.records()
    layout = Layout.of(tuple(snapshot.reductions.items()))
    return layout.unpack(layout.pack(records, 0))
