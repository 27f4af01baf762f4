"""Reductions on aiodist's data plane: all_reduce, reduce, reduce_scatter.

Each public function validates its arguments, then starts the operation with
``ProcessGroup.start`` and returns its ``Work``. The plans (ring, recursive
doubling, binomial tree) come from ``schedules``; this module only moves bytes
and reduces them with torch ops, in place. Every message carries the sender's
signature, so ranks that disagree get ``CollectiveMismatchError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiodist._group.work import Work
from aiodist._ops import reduce_ops, schedules, shared
from aiodist._ops.common import (
    LazyModule,
    Slot,
    agreed,
    bridged,
    byte_view,
    check_alike,
    check_rank,
    check_signature,
    check_tensor,
    check_tensor_list,
    clear_to_send,
    contiguous,
    copy_into,
    divide_,
    exchange_all,
    recv_tensor,
    resolve_group,
    send,
    signature,
)
from aiodist._ops.outputs import new_outputs

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

if TYPE_CHECKING:
    from aiodist._group.group import ProcessGroup

__all__ = ["all_reduce", "reduce", "reduce_scatter", "start_all_reduce"]

_FOLD_STEP = 1 << 19  # recursive doubling's fold and unfold messages
# --- all_reduce ----------------------------------------------------------------------------


def _direct_all_reduce_now(
    g: ProcessGroup, seq: int, t: torch.Tensor, op: str, mine: list[Any]
) -> Work[torch.Tensor]:
    """Send ``t`` to every rank, then reduce all parts in rank order (one round).

    Every rank combines the same parts in the same order, so results are
    bitwise identical everywhere. The parts land in one staging buffer viewed
    as a ``(size, numel)`` tensor: a few torch calls whatever the group size.
    Driven by the data plane's callbacks: no task, no coroutine.
    """
    _, work, seq = g.begin(f"all_reduce(op={op})", seq=seq)
    if work.is_completed():
        return work  # a member aborted this call: send and post nothing
    buf = contiguous(t)
    flat = buf.view(-1)
    p = g.world_size

    def done(staging: memoryview) -> None:
        if p > 1 and flat.numel():
            parts = torch.frombuffer(staging, dtype=buf.dtype).view(p, -1)
            reduce_ops.combine(op, flat, parts[0], parts[1])
            for r in range(2, p):
                reduce_ops.combine(op, flat, flat, parts[r])
            if op == "mean":
                divide_(buf, p)
        if buf is not t:
            copy_into(t, buf)
        work._set_result(t)

    exchange_all(g, work, seq, mine, byte_view(flat), done)
    return work


async def _recursive_doubling(
    g: ProcessGroup, seq: int, buf: torch.Tensor, op: str, mine: list[Any]
) -> None:
    plan = schedules.recursive_doubling(g.rank, g.world_size)
    me = g.rank
    scratch = torch.empty_like(buf)
    # Exchanges use steps 0, 1, ... so the first message of any pair has step 0, as in
    # every other operation: a rank that called another collective then gets a mismatch.
    fold, unfold = _FOLD_STEP, _FOLD_STEP + 1
    if plan.is_extra:
        assert plan.fold_partner is not None
        future = recv_tensor(g, plan.fold_partner, seq, unfold, scratch)
        await send(g, plan.fold_partner, seq, fold, mine, byte_view(buf))
        msg = await future
        check_signature(g, mine, msg)
        copy_into(buf, scratch)
        return
    if plan.fold_partner is not None:
        msg = await recv_tensor(g, plan.fold_partner, seq, fold, scratch)
        check_signature(g, mine, msg)
        reduce_ops.combine(op, buf, buf, scratch)  # the extra rank is higher: it goes second
    for k, partner in enumerate(plan.partners):
        future = recv_tensor(g, partner, seq, k, scratch)
        await send(g, partner, seq, k, mine, byte_view(buf))
        check_signature(g, mine, await future)
        # Lower rank first on both sides, so both compute bitwise the same value.
        if partner < me:
            reduce_ops.combine(op, buf, scratch, buf)
        else:
            reduce_ops.combine(op, buf, buf, scratch)
    if plan.fold_partner is not None:
        await send(g, plan.fold_partner, seq, unfold, mine, byte_view(buf))


async def _ring_all_reduce(
    g: ProcessGroup, seq: int, buf: torch.Tensor, op: str, mine: list[Any]
) -> None:
    """Ring reduce-scatter then ring all-gather, every receive posted up front.

    Every receive is posted before the first send, and each rank tells its left
    neighbour so (a header-only "ready") before that neighbour sends: no payload
    ever arrives unexpected, which would cost a tensor-sized buffer and a copy
    (a rank that finished the previous operation first would otherwise start
    sending before this one posted). Reduce-scatter parts land in their own
    slice of one scratch buffer of ``size - 1`` chunks (less than the tensor),
    all-gather parts straight in their final place in ``buf``. An all-gather
    part can only arrive after this rank sent its last use of that chunk round
    the ring, so the early receive never overwrites live data.
    """
    p, me = g.world_size, g.rank
    left, right = schedules.ring_neighbours(me, p)
    flat = buf.view(-1)
    bounds = schedules.chunk_bounds(flat.numel(), p)
    chunks = [flat[a:b] for a, b in bounds]
    rs_steps = schedules.ring_reduce_scatter_steps(me, p)
    ag_steps = schedules.ring_all_gather_steps(me, p)
    width = bounds[0][1] - bounds[0][0]
    scratch = torch.empty((p - 1) * width, dtype=buf.dtype)
    parts = [
        scratch[s * width : s * width + chunks[c].numel()] for s, (_, c) in enumerate(rs_steps)
    ]
    rs_recvs = [recv_tensor(g, left, seq, s, part) for s, part in enumerate(parts)]
    ag_recvs = [recv_tensor(g, left, seq, p + s, chunks[c]) for s, (_, c) in enumerate(ag_steps)]
    # Clear to send: the right neighbour has posted every receive of this operation.
    ready = await clear_to_send(g, seq, mine)
    check_signature(g, mine, await ready)
    for s, (out_c, in_c) in enumerate(rs_steps):
        await send(g, right, seq, s, mine, byte_view(chunks[out_c]))
        check_signature(g, mine, await rs_recvs[s])
        reduce_ops.combine(op, chunks[in_c], parts[s], chunks[in_c])
    for s, (out_c, _) in enumerate(ag_steps):
        await send(g, right, seq, p + s, mine, byte_view(chunks[out_c]))
        check_signature(g, mine, await ag_recvs[s])


async def _socket_all_reduce(
    g: ProcessGroup, seq: int, buf: torch.Tensor, op: str, mine: list[Any]
) -> None:
    flat = buf.view(-1)
    algorithm = schedules.all_reduce_algorithm(
        flat.numel() * flat.element_size(), flat.numel(), g.world_size
    )
    # Only large tensors come here (the shared-memory path's fallback): never "direct".
    if algorithm == "recursive_doubling":
        await _recursive_doubling(g, seq, buf, op, mine)
    else:
        await _ring_all_reduce(g, seq, buf, op, mine)


def all_reduce(
    data: torch.Tensor, op: str = "sum", group: ProcessGroup | None = None
) -> Work[torch.Tensor]:
    """Reduce ``data`` across all ranks, in place: every rank ends with the same result.

    Small tensors (up to 16 KiB, in groups of up to 8) go straight to every
    rank in one round; others under 64 KiB use recursive doubling; larger ones a
    ring reduce-scatter then ring all-gather, or, from 1 MiB in a group whose
    ranks share one host, a reduction in shared memory (``/dev/shm``; set
    ``AIODIST_SHM=0`` on every rank to turn it off). The result is bitwise
    identical on every rank.

    Args:
        data: A CPU tensor, overwritten with the result.
        op: ``sum``, ``mean``, ``product``, ``min``, ``max``, ``band``, ``bor`` or
            ``bxor`` (any case; ``ReduceOp.SUM``-style names work too). ``mean``
            needs a floating dtype, the bitwise ops integer or bool ones. On bool
            tensors ``sum``/``max`` are logical or, ``product``/``min`` logical and.
        group: Defaults to the world group.

    Returns:
        Work resolving to ``data``; already done with ``data`` unchanged when
        not initialised.

    Raises:
        TypeError: ``data`` is not a tensor, or ``op`` does not suit its dtype.
        ValueError: Unknown ``op``, or ``data`` is not a dense CPU tensor.
        CollectiveMismatchError: Ranks passed another dtype, shape or op (on every rank).

    Cancellation:
        Cancelling the awaiting task does not cancel the reduction; it completes
        for every rank. A timeout marks ``group`` broken on all members.

    Example:
        >>> t = torch.ones(4)
        >>> await aiodist.all_reduce(t, op="mean")
    """
    if (w := bridged(group, "all_reduce", data, op)) is not None:
        return w
    g = resolve_group(group)
    with Slot(g, "all_reduce") as seq:
        t = check_tensor(data, "data")
        reduce_op = reduce_ops.reduce_op(op)
        reduce_ops.check_op_dtype(reduce_op, t.dtype)
        if g is None:
            return Work.completed(t)
    return start_all_reduce(g, seq, t, reduce_op)


def start_all_reduce(
    g: ProcessGroup, seq: int, t: torch.Tensor, reduce_op: str, *, label: str = "all_reduce"
) -> Work[torch.Tensor]:
    """``all_reduce`` of checked ``t`` as ``g``'s operation ``seq``.

    ``label`` is the name in its signature: a call that reduces several tensors
    puts what every rank must agree on there (see ``tensor_groups``).
    """
    mine = signature(label, t, reduce_op=reduce_op)
    p = g.world_size
    algorithm = schedules.all_reduce_algorithm(
        t.numel() * t.element_size(), t.numel(), p, shared_memory=p > 1 and shared.usable(g)
    )
    if algorithm == "direct":
        return _direct_all_reduce_now(g, seq, t, reduce_op, mine)
    turn = shared.take_turn(g) if algorithm == "shared_memory" else None  # now: call order

    async def run(seq: int) -> torch.Tensor:
        buf = contiguous(t)
        if turn is not None:
            async with turn:
                if await shared.agreed(g):
                    await shared.shared_memory_all_reduce(
                        g, seq, buf, reduce_op, mine, reduce_ops.combine
                    )
                else:  # some rank has shared memory off: every rank takes the sockets
                    await _socket_all_reduce(g, seq, buf, reduce_op, mine)
        elif p > 1:
            await _socket_all_reduce(g, seq, buf, reduce_op, mine)
        if reduce_op == "mean" and p > 1:
            divide_(buf, p)
        if buf is not t:
            copy_into(t, buf)
        return t

    return g.start(
        f"all_reduce(op={reduce_op})", run, seq=seq, on_end=None if turn is None else turn.release
    )


# --- rooted operations ---------------------------------------------------------------------


def reduce(
    data: torch.Tensor, dst: int = 0, op: str = "sum", group: ProcessGroup | None = None
) -> Work[torch.Tensor]:
    """Reduce ``data`` from all ranks into ``data`` on rank ``dst`` (binomial tree).

    Args:
        data: A CPU tensor; overwritten with the result on ``dst`` only.
        dst: Global rank that receives the result (torch's convention).
        op: As for ``all_reduce``.
        group: Defaults to the world group.

    Returns:
        Work resolving to ``data`` (the result on ``dst``, unchanged elsewhere).

    Raises:
        TypeError: ``data`` is not a tensor, or ``op`` does not suit its dtype.
        ValueError: Unknown ``op``, or ``dst`` not a member of ``group``.
        CollectiveMismatchError: Ranks passed another dtype, shape, op or ``dst``.

    Cancellation:
        Cancelling the awaiting task does not cancel the reduction.

    Example:
        >>> await aiodist.reduce(t, dst=0, op="max")
    """
    if (w := bridged(group, "reduce", data, dst, op)) is not None:
        return w
    g = resolve_group(group)
    with Slot(g, "reduce") as seq:
        t = check_tensor(data, "data")
        reduce_op = reduce_ops.reduce_op(op)
        reduce_ops.check_op_dtype(reduce_op, t.dtype)
        if g is None:
            return Work.completed(t)
        root = check_rank(g, dst, "dst")
    mine = signature("reduce", t, reduce_op=reduce_op, root=root)

    async def tree(seq: int) -> torch.Tensor:
        links = schedules.binomial_tree(g.rank, g.world_size, root)
        src = contiguous(t)
        acc = src
        if g.rank != root and links.children:
            acc = torch.empty_like(src)
            copy_into(acc, src)
        scratch = torch.empty_like(src) if links.children else src
        for child in reversed(links.children):  # smallest subtrees arrive first
            msg = await recv_tensor(g, child, seq, 0, scratch)
            check_signature(g, mine, msg)
            reduce_ops.combine(reduce_op, acc, acc, scratch)
        if links.parent is not None:
            await send(g, links.parent, seq, 0, mine, byte_view(acc))
            return t
        if reduce_op == "mean" and g.world_size > 1:
            divide_(acc, g.world_size)
        if acc is not t:
            copy_into(t, acc)
        return t

    async def run(seq: int) -> torch.Tensor:
        return await agreed(g, seq, mine, tree(seq))

    return g.start(f"reduce(dst={root}, op={reduce_op})", run, seq=seq)


def reduce_scatter(
    inputs: list[torch.Tensor], op: str = "sum", group: ProcessGroup | None = None
) -> Work[torch.Tensor]:
    """Reduce ``inputs[i]`` over all ranks and leave the result on rank ``i``.

    Every rank sends ``inputs[i]`` straight to rank ``i``, which reduces what
    it receives in rank order; from 1 MiB of inputs, in a group whose ranks
    share one host, rank ``i`` reduces straight out of the others' shared segments.

    Args:
        inputs: One CPU tensor per rank, all of the same dtype and shape.
        op: As for ``all_reduce``.
        group: Defaults to the world group.

    Returns:
        Work resolving to a new tensor; ``inputs[0]`` when not initialised.

    Raises:
        TypeError: ``inputs`` is not a list of tensors, or ``op`` does not suit the dtype.
        ValueError: Wrong number of tensors, tensors that differ, or unknown ``op``.
        CollectiveMismatchError: Ranks passed another dtype, shape or op.

    Cancellation:
        Cancelling the awaiting task does not cancel the operation.

    Example:
        >>> mine = await aiodist.reduce_scatter([a, b], op="sum")
    """
    if (w := bridged(group, "reduce_scatter", inputs, op)) is not None:
        return w
    g = resolve_group(group)
    with Slot(g, "reduce_scatter") as seq:
        tensors = check_tensor_list(inputs, "inputs", None)
        if not tensors:
            raise ValueError("inputs must hold one tensor per rank, got an empty list")
        reduce_op = reduce_ops.reduce_op(op)
        check_alike(tensors, "inputs")
        first = tensors[0]
        reduce_ops.check_op_dtype(reduce_op, first.dtype)
        if g is None:
            return Work.completed(first)
        if len(tensors) != g.world_size:
            raise ValueError(
                f"inputs must hold one tensor per rank ({g.world_size}), got {len(tensors)}"
            )
    mine = signature("reduce_scatter", first, reduce_op=reduce_op)
    nbytes = first.numel() * first.element_size() * g.world_size
    use_shm = g.world_size > 1 and nbytes >= schedules.SHM_MIN_BYTES and shared.usable(g)
    turn = shared.take_turn(g) if use_shm else None  # taken now: call order

    async def run(seq: int) -> torch.Tensor:
        if turn is not None:
            async with turn:
                if await shared.agreed(g):  # else some rank has it off: all take the sockets
                    out = new_outputs(g, first, 1, "reduce_scatter")[0]
                    parts = [contiguous(x) for x in tensors]
                    await shared.shared_memory_reduce_scatter(
                        g, seq, parts, out, reduce_op, mine, reduce_ops.combine
                    )
                    if reduce_op == "mean":
                        divide_(out, g.world_size)
                    return out
        p, me = g.world_size, g.rank
        got = [tensors[me] if r == me else torch.empty_like(first) for r in range(p)]
        futures = [None if r == me else recv_tensor(g, r, seq, 0, got[r]) for r in range(p)]
        for k in range(1, p):  # start with the next rank: not everyone sends to rank 0 first
            r = (me + k) % p
            await send(g, r, seq, 0, mine, byte_view(contiguous(tensors[r])))
        out = torch.empty_like(first, memory_format=torch.contiguous_format)
        for r, future in enumerate(futures):
            if future is not None:
                check_signature(g, mine, await future)
            if r == 0:
                copy_into(out, got[0])
            else:
                reduce_ops.combine(reduce_op, out, out, got[r])
        if reduce_op == "mean":
            divide_(out, p)
        return out

    return g.start(
        f"reduce_scatter(op={reduce_op})",
        run,
        seq=seq,
        on_end=None if turn is None else turn.release,
    )
