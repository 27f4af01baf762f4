"""Data movement between all ranks on aiodist's data plane: all_gather, all_to_all, barrier.

Each public function validates its arguments, then starts the operation with
``ProcessGroup.start`` and returns its ``Work``. The plans (ring,
dissemination) come from ``schedules``; this module only moves bytes. Every
message carries the sender's signature, so ranks that disagree get
``CollectiveMismatchError``. The rooted operations live in ``rooted.py``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiodist._errors import DistTimeoutError
from aiodist._group.work import Work
from aiodist._ops import schedules, shared
from aiodist._ops.common import (
    LazyModule,
    Slot,
    bridged,
    byte_view,
    check_signature,
    check_tensor,
    check_tensor_list,
    clear_to_send,
    contiguous,
    copy_into,
    recv_tensor,
    resolve_group,
    send,
    signature,
)
from aiodist._ops.outputs import new_outputs
from aiodist._plane.peers import Received

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

if TYPE_CHECKING:
    from aiodist._group.group import ProcessGroup

__all__ = ["all_gather", "all_to_all", "barrier"]


def all_gather(data: torch.Tensor, group: ProcessGroup | None = None) -> Work[list[torch.Tensor]]:
    """Gather ``data`` from every rank onto every rank, in rank order.

    A ring of messages; from 1 MiB gathered, in a group whose ranks share one
    host, every rank copies the others' parts straight from their shared segments.

    Args:
        data: A CPU tensor; every rank passes the same dtype and shape.
        group: Defaults to the world group.

    Returns:
        Work resolving to one new tensor per rank; ``[data]`` when not initialised.

    Raises:
        TypeError: ``data`` is not a tensor.
        CollectiveMismatchError: Ranks passed another dtype or shape.

    Cancellation:
        Cancelling the awaiting task does not cancel the gather.

    Example:
        >>> parts = await aiodist.all_gather(torch.tensor([rank]))
    """
    if (w := bridged(group, "all_gather", data)) is not None:
        return w
    g = resolve_group(group)
    with Slot(g, "all_gather") as seq:
        t = check_tensor(data, "data")
        if g is None:
            return Work.completed([t])
    mine = signature("all_gather", t)

    nbytes = t.numel() * t.element_size() * g.world_size
    use_shm = g.world_size > 1 and nbytes >= schedules.SHM_MIN_BYTES and shared.usable(g)
    turn = shared.take_turn(g) if use_shm else None  # taken now: call order

    async def run(seq: int) -> list[torch.Tensor]:
        out = new_outputs(g, t, g.world_size, "all_gather")
        if turn is not None:
            async with turn:
                if await shared.agreed(g):  # else some rank has it off: all take the ring
                    await shared.shared_memory_all_gather(g, seq, contiguous(t), out, mine)
                    return out
        await _ring_all_gather(g, seq, t, out, mine)
        return out

    return g.start("all_gather", run, seq=seq, on_end=None if turn is None else turn.release)


async def _ring_all_gather(
    g: ProcessGroup, seq: int, t: torch.Tensor, out: list[torch.Tensor], mine: list[Any]
) -> None:
    p, me = g.world_size, g.rank
    left, right = schedules.ring_neighbours(me, p)
    # Every receive lands in its own output tensor, so all are posted up front, and
    # the left neighbour waits for our "ready" before it sends: no part arrives
    # unexpected (a rank still in the previous operation would buffer and copy it).
    futures = [recv_tensor(g, left, seq, s, out[(me - s - 1) % p]) for s in range(p - 1)]
    if p > 1:
        ready = await clear_to_send(g, seq, mine)
    copy_into(out[me], t)
    if p > 1:
        check_signature(g, mine, await ready)
    for s in range(p - 1):
        await send(g, right, seq, s, mine, byte_view(out[(me - s) % p]))
        check_signature(g, mine, await futures[s])


def all_to_all(
    inputs: list[torch.Tensor], group: ProcessGroup | None = None
) -> Work[list[torch.Tensor]]:
    """Send ``inputs[i]`` to rank ``i``; receive one tensor from every rank.

    Shapes may differ from pair to pair; the dtype must be the same everywhere.

    Args:
        inputs: One CPU tensor per rank, all of one dtype.
        group: Defaults to the world group.

    Returns:
        Work resolving to a list whose entry ``i`` is rank ``i``'s
        ``inputs[my rank]``; ``inputs`` when not initialised.

    Raises:
        TypeError: ``inputs`` is not a list of tensors.
        ValueError: Wrong number of tensors, or mixed dtypes.
        CollectiveMismatchError: Ranks passed another dtype.

    Cancellation:
        Cancelling the awaiting task does not cancel the exchange.

    Example:
        >>> outs = await aiodist.all_to_all([torch.tensor([rank, i]) for i in range(n)])
    """
    if (w := bridged(group, "all_to_all", inputs)) is not None:
        return w
    g = resolve_group(group)
    with Slot(g, "all_to_all") as seq:
        tensors = check_tensor_list(inputs, "inputs", None)
        dtypes = {x.dtype for x in tensors}
        if len(dtypes) > 1:
            raise ValueError(f"inputs must share one dtype, got {sorted(map(str, dtypes))}")
        if g is None:
            return Work.completed(tensors)
        if len(tensors) != g.world_size:
            raise ValueError(
                f"inputs must hold one tensor per rank ({g.world_size}), got {len(tensors)}"
            )
    dtype = tensors[0].dtype
    mine = ["all_to_all", str(dtype).removeprefix("torch."), None, None, None]

    async def run(seq: int) -> list[torch.Tensor]:
        p, me = g.world_size, g.rank
        futures = {r: recv_tensor(g, r, seq, 0) for r in range(p) if r != me}
        for k in range(1, p):
            r = (me + k) % p
            x = contiguous(tensors[r])
            await send(g, r, seq, 0, [mine, list(x.shape)], byte_view(x))
        out = [tensors[me].clone() if r == me else tensors[me] for r in range(p)]
        for r, future in futures.items():
            msg = await future
            theirs, shape = msg.meta
            check_signature(g, mine, Received(msg.src, theirs, msg.data))
            received = torch.empty(shape, dtype=dtype)
            byte_view(received)[:] = msg.data
            out[r] = received
        return out

    return g.start("all_to_all", run, seq=seq)


def _came(future: asyncio.Future[Received]) -> bool:
    """True if the peer's message arrived (not still awaited, nor failed by a notice)."""
    return future.done() and not future.cancelled() and future.exception() is None


def barrier(group: ProcessGroup | None = None, timeout: float | None = None) -> Work[None]:
    """Wait until every rank of ``group`` reached this barrier (on the data plane).

    Groups of up to 8 ranks exchange one message with every rank (one round);
    larger ones use dissemination (``log2 size`` rounds). With ``timeout``, every
    rank hears from every other one, so a rank that gives up can say which
    ranks never arrived (as torch's ``monitored_barrier`` does).

    Args:
        group: Defaults to the world group.
        timeout: Seconds to wait for the others; the group's timeout if None.

    Returns:
        Work resolving to None; already done when not initialised.

    Raises:
        DistTimeoutError: ``timeout`` passed; the message names the ranks (global)
            that never arrived, and the group is broken on every member.
        CollectiveMismatchError: Another rank called a different collective here.

    Cancellation:
        Cancelling the awaiting task does not cancel the barrier.

    Example:
        >>> await aiodist.barrier(timeout=30)   # names the ranks that never came
    """
    g = resolve_group(group)
    with Slot(g, "barrier") as seq:
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if g is None:
            return Work.completed(None)
    mine = signature("barrier")

    async def direct(seq: int, seconds: float | None) -> None:
        # One round: everyone tells everyone, so a rank that gives up knows who is late.
        me = g.rank
        peers = [r for r in range(g.world_size) if r != me]
        futures = [recv_tensor(g, r, seq, 0) for r in peers]
        deadline = asyncio.timeout(seconds)
        try:
            async with deadline:
                for r in schedules.direct_peers(me, g.world_size):
                    await send(g, r, seq, 0, mine, None)
                for future in futures:
                    check_signature(g, mine, await asyncio.shield(future))
        except TimeoutError:
            if not deadline.expired():  # not ours: e.g. a peer's timeout, as a notice
                raise
            assert seconds is not None  # only a deadline expires
            missing = [g.ranks[r] for r, f in zip(peers, futures, strict=True) if not _came(f)]
            raise DistTimeoutError(
                f"barrier on group {g.name!r} timed out after {seconds:g} s: ranks {missing} "
                f"never arrived (rank {g.ranks[me]} waited); the group is broken. Check "
                "that every rank calls barrier, and why those ranks are late."
            ) from None

    async def run(seq: int) -> None:
        p, me = g.world_size, g.rank
        if timeout is not None or p <= schedules.DIRECT_MAX_RANKS:
            await direct(seq, timeout)
            return
        for k, (to, frm) in enumerate(schedules.dissemination_partners(me, p)):
            future = recv_tensor(g, frm, seq, k)
            await send(g, to, seq, k, mine, None)
            check_signature(g, mine, await future)

    return g.start("barrier", run, seq=seq)
