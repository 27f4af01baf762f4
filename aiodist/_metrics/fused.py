"""The fused metric reduction: one operation of the group, in one sequence number.

``start_sync`` takes the group's next sequence number at call time (as every
collective does) and runs, inside that one operation:

1. the **fused reduction** of the buffer laid out by the key set agreed at the
   previous sync: recursive doubling (``log2 P`` exchanges of a few hundred
   bytes) with a combine that adds the sum segment, takes the maximum of the max
   segment and keeps the lowest rank's pair in the select segment;
2. only when that buffer's flag says some rank has a metric outside the agreed
   set (and at the first sync): the **key union**, recursive doubling of the
   ``{name: reduction}`` tables, then the fused reduction again on the new layout.

The agreed key set only grows, so a loop whose metrics do not change pays one
reduction per sync, and one that logs an extra metric every N steps pays the
union once. Each sync needs the key set its predecessor agreed on, so syncs in
flight chain on a future (set when the predecessor's values are known: syncs
resolve in call order); all of them still overlap the caller's compute.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiodist._collectives import common, schedules
from aiodist._errors import CollectiveMismatchError
from aiodist._metrics.state import Layout, Reduction, Snapshot, combine
from aiodist._wire import codec

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import anyio
    import torch

    from aiodist._group import ProcessGroup

__all__ = ["Schema", "reduce_locally", "run_sync"]

Schema = tuple[tuple[str, Reduction], ...]

# Step ranges of the three phases inside one sequence number.
_FIRST, _UNION, _SECOND = 0, 1 << 10, 2 << 10
_FOLD, _UNFOLD = 1 << 9, (1 << 9) + 1  # offsets within a phase
_limiters: dict[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = {}


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


async def _reduce_buffer(
    g: ProcessGroup, seq: int, base: int, layout: Layout, buf: torch.Tensor
) -> None:
    """All-reduce ``buf`` (laid out by ``layout``) in place across the group."""
    mine = common.signature("metrics.sync", buf)
    scratch = buf.new_empty(buf.shape)

    async def send_only(dst: int, step: int) -> None:
        await common.send(g, dst, seq, step, mine, common.byte_view(buf))

    async def receive(src: int, step: int, replace: bool) -> None:
        common.check_signature(g, mine, await common.recv_tensor(g, src, seq, step, scratch))
        if replace:
            buf.copy_(scratch)
        else:
            combine(layout, buf, buf, scratch)

    async def exchange(partner: int, step: int) -> None:
        future = common.recv_tensor(g, partner, seq, step, scratch)
        await send_only(partner, step)
        common.check_signature(g, mine, await future)
        combine(layout, buf, buf, scratch)

    await _doubling(g, base, exchange, send_only, receive)


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
        future = asyncio.ensure_future(get(partner, step))
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


async def run_sync(
    g: ProcessGroup,
    seq: int,
    snapshot: Snapshot,
    previous: asyncio.Future[Schema] | Schema | None,
    agreed: asyncio.Future[Schema],
) -> dict[str, tuple[float, float, int]]:
    """One sync: reduce ``snapshot`` across ``g``; set ``agreed`` to the key set it used.

    ``previous`` is the key set of the sync before (a future while that one
    runs, None before the first). ``agreed`` is always resolved, with an
    exception if this sync fails, so a sync chained after it never waits forever.
    """
    try:
        schema = await previous if isinstance(previous, asyncio.Future) else previous
        await wait_device_copy(snapshot)
        records = snapshot.records()
        if schema is not None:
            layout = Layout.of(schema)
            buf = layout.pack(records, g.rank)
            await _reduce_buffer(g, seq, _FIRST, layout, buf)
            if not layout.flagged(buf):
                agreed.set_result(schema)
                return layout.unpack(buf)
        table: dict[str, Reduction] = {**dict(schema or ()), **snapshot.reductions}
        schema = await _union(g, seq, table)
        layout = Layout.of(schema)
        buf = layout.pack(records, g.rank)
        await _reduce_buffer(g, seq, _SECOND, layout, buf)
        agreed.set_result(schema)  # only now: syncs resolve in the order they were called
        return layout.unpack(buf)
    except BaseException as exc:
        if not agreed.done():
            agreed.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            agreed.exception()  # retrieved: the sync's own Work reports it
        raise


def reduce_locally(snapshot: Snapshot) -> dict[str, tuple[float, float, int]]:
    """The single-process answer (not initialised): the snapshot's own values."""
    if snapshot.event is not None:
        snapshot.event.synchronize()
    records = snapshot.records()
    layout = Layout.of(tuple(snapshot.reductions.items()))
    return layout.unpack(layout.pack(records, 0))
