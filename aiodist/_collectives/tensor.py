"""Tensor collectives on aiodist's data plane: all_reduce, broadcast, all_gather, ...

Each public function validates its arguments, then starts the operation with
``ProcessGroup.start`` and returns its ``Work``. The plans (ring, recursive
doubling, binomial tree, dissemination) come from ``schedules``; this module
only moves bytes and reduces them with torch ops. Every message carries the
sender's signature, so ranks that disagree get ``CollectiveMismatchError``.
Rooted operations also run a dissemination check of the signature beside the
data, because ranks that disagree on the root may never message each other.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, TypeVar

from aiodist._collectives import schedules
from aiodist._collectives.common import (
    LazyModule,
    byte_view,
    check_signature,
    check_tensor,
    resolve_group,
    send,
    signature,
)
from aiodist._collectives.common import recv as _post_recv
from aiodist._peers import Received
from aiodist._work import Work

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from aiodist._group import ProcessGroup

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]

T = TypeVar("T")

#: Below this many bytes all_reduce uses recursive doubling (latency-bound), above it a ring.
RING_THRESHOLD_BYTES = 64 * 1024
_AGREE_STEP = 1 << 20  # steps of the root-agreement check, apart from the data's steps
_FOLD_STEP = 1 << 19  # recursive doubling's fold and unfold messages
_OPS = ("sum", "mean", "product", "min", "max", "band", "bor", "bxor")
_ALIASES = {"prod": "product", "avg": "mean", "average": "mean"}


def _reduce_op(op: object) -> str:
    name = op if isinstance(op, str) else getattr(op, "name", None)
    if name is None and op is not None and type(op).__name__ in ("ReduceOp", "RedOpType"):
        name = str(op)
    if not isinstance(name, str):
        raise TypeError(f"op must be a string such as 'sum', got {type(op).__name__}")
    key = name.rsplit(".", 1)[-1].lower()
    key = _ALIASES.get(key, key)
    if key not in _OPS:
        raise ValueError(f"unsupported reduce op {op!r}; use one of {', '.join(_OPS)}")
    return key


def _check_op_dtype(op: str, dtype: torch.dtype) -> None:
    if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"op 'mean' needs a floating-point tensor, got {dtype}")
    if op in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"op {op!r} needs an integer or bool tensor, got {dtype}")


def _combine(op: str, out: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> None:
    """``out = first <op> second`` with torch kernels; ``out`` may alias either input."""
    if out.dtype == torch.bool and op in ("sum", "mean", "max"):
        torch.logical_or(first, second, out=out)
    elif out.dtype == torch.bool and op in ("product", "min"):
        torch.logical_and(first, second, out=out)
    elif op in ("sum", "mean"):
        torch.add(first, second, out=out)
    elif op == "product":
        torch.mul(first, second, out=out)
    elif op == "min":
        torch.minimum(first, second, out=out)
    elif op == "max":
        torch.maximum(first, second, out=out)
    elif op == "band":
        torch.bitwise_and(first, second, out=out)
    elif op == "bor":
        torch.bitwise_or(first, second, out=out)
    else:
        torch.bitwise_xor(first, second, out=out)


def _check_rank(g: ProcessGroup, rank: object, name: str) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"{name} must be an int rank, got {type(rank).__name__}")
    if not 0 <= rank < g.world_size:
        raise ValueError(f"{name} must be a rank in [0, {g.world_size}), got {rank}")
    return rank


def _check_tensor_list(tensors: object, name: str, length: int | None) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    out = [check_tensor(t, f"{name}[{i}]") for i, t in enumerate(tensors)]
    if length is not None and len(out) != length:
        raise ValueError(f"{name} must hold one tensor per rank ({length}), got {len(out)}")
    return out


def _recv(
    g: ProcessGroup, src: int, seq: int, step: int, dest: torch.Tensor | None = None
) -> asyncio.Future[Received]:
    # A receive posted after the group broke would never be failed: check first.
    g.check_usable()
    future = _post_recv(g, src, seq, step, None if dest is None else byte_view(dest))
    # A broken group fails every posted receive, including ones an aborted operation no
    # longer awaits; the operation reports the error, so mark it retrieved here.
    future.add_done_callback(_retrieve)
    return future


def _retrieve(future: asyncio.Future[Received]) -> None:
    if not future.cancelled():
        future.exception()


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


async def _agree(g: ProcessGroup, seq: int, mine: list[Any]) -> None:
    """Dissemination exchange of signatures: every rank checks ``log2(size)`` others."""
    for k, (to, frm) in enumerate(schedules.dissemination_partners(g.rank, g.world_size)):
        future = _recv(g, frm, seq, _AGREE_STEP + k)
        await send(g, to, seq, _AGREE_STEP + k, mine, None)
        check_signature(g, mine, await future)


async def _agreed(g: ProcessGroup, seq: int, mine: list[Any], body: Coroutine[Any, Any, T]) -> T:
    """Run ``body`` beside the signature check; the first error wins."""
    agree = asyncio.ensure_future(_agree(g, seq, mine))
    main = asyncio.ensure_future(body)
    try:
        await asyncio.wait({agree, main}, return_when=asyncio.FIRST_EXCEPTION)
        for task in (agree, main):
            if task.done() and task.exception() is not None:
                task.result()
        await agree
        return await main
    finally:
        for task in (agree, main):
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


# --- all_reduce ----------------------------------------------------------------------------


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
        future = _recv(g, plan.fold_partner, seq, unfold, scratch)
        await send(g, plan.fold_partner, seq, fold, mine, byte_view(buf))
        msg = await future
        check_signature(g, mine, msg)
        buf.copy_(scratch)
        return
    if plan.fold_partner is not None:
        msg = await _recv(g, plan.fold_partner, seq, fold, scratch)
        check_signature(g, mine, msg)
        _combine(op, buf, buf, scratch)  # the extra rank is higher: it goes second
    for k, partner in enumerate(plan.partners):
        future = _recv(g, partner, seq, k, scratch)
        await send(g, partner, seq, k, mine, byte_view(buf))
        check_signature(g, mine, await future)
        # Lower rank first on both sides, so both compute bitwise the same value.
        if partner < me:
            _combine(op, buf, scratch, buf)
        else:
            _combine(op, buf, buf, scratch)
    if plan.fold_partner is not None:
        await send(g, plan.fold_partner, seq, unfold, mine, byte_view(buf))


async def _ring_all_reduce(
    g: ProcessGroup, seq: int, buf: torch.Tensor, op: str, mine: list[Any]
) -> None:
    p, me = g.world_size, g.rank
    left, right = schedules.ring_neighbours(me, p)
    flat = buf.view(-1)
    bounds = schedules.chunk_bounds(flat.numel(), p)
    chunks = [flat[a:b] for a, b in bounds]
    scratch = torch.empty(bounds[0][1] - bounds[0][0], dtype=buf.dtype)
    for s, (out_c, in_c) in enumerate(schedules.ring_reduce_scatter_steps(me, p)):
        part = scratch[: chunks[in_c].numel()]
        future = _recv(g, left, seq, s, part)
        await send(g, right, seq, s, mine, byte_view(chunks[out_c]))
        check_signature(g, mine, await future)
        _combine(op, chunks[in_c], part, chunks[in_c])
    for s, (out_c, in_c) in enumerate(schedules.ring_all_gather_steps(me, p)):
        future = _recv(g, left, seq, p + s, chunks[in_c])
        await send(g, right, seq, p + s, mine, byte_view(chunks[out_c]))
        check_signature(g, mine, await future)


def all_reduce(
    data: torch.Tensor, op: str = "sum", group: ProcessGroup | None = None
) -> Work[torch.Tensor]:
    """Reduce ``data`` across all ranks, in place: every rank ends with the same result.

    Small tensors (under 64 KiB) use recursive doubling; larger ones a ring
    reduce-scatter then ring all-gather. The result is bitwise identical on
    every rank.

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
    t = check_tensor(data, "data")
    reduce_op = _reduce_op(op)
    _check_op_dtype(reduce_op, t.dtype)
    g = resolve_group(group)
    if g is None:
        return Work.completed(t)
    mine = signature("all_reduce", t, reduce_op=reduce_op)

    async def run(seq: int) -> torch.Tensor:
        p = g.world_size
        buf = _contiguous(t)
        if p > 1:
            nbytes = buf.numel() * buf.element_size()
            if nbytes < RING_THRESHOLD_BYTES or buf.numel() < p:
                await _recursive_doubling(g, seq, buf, reduce_op, mine)
            else:
                await _ring_all_reduce(g, seq, buf, reduce_op, mine)
        if reduce_op == "mean" and p > 1:
            buf.div_(p)
        if buf is not t:
            t.copy_(buf)
        return t

    return g.start(f"all_reduce(op={reduce_op})", run)


# --- rooted operations ---------------------------------------------------------------------


def reduce(
    data: torch.Tensor, dst: int = 0, op: str = "sum", group: ProcessGroup | None = None
) -> Work[torch.Tensor]:
    """Reduce ``data`` from all ranks into ``data`` on rank ``dst`` (binomial tree).

    Args:
        data: A CPU tensor; overwritten with the result on ``dst`` only.
        dst: The rank that receives the result.
        op: As for ``all_reduce``.
        group: Defaults to the world group.

    Returns:
        Work resolving to ``data`` (the result on ``dst``, unchanged elsewhere).

    Raises:
        TypeError: ``data`` is not a tensor, or ``op`` does not suit its dtype.
        ValueError: Unknown ``op`` or ``dst`` out of range.
        CollectiveMismatchError: Ranks passed another dtype, shape, op or ``dst``.

    Cancellation:
        Cancelling the awaiting task does not cancel the reduction.

    Example:
        >>> await aiodist.reduce(t, dst=0, op="max")
    """
    t = check_tensor(data, "data")
    reduce_op = _reduce_op(op)
    _check_op_dtype(reduce_op, t.dtype)
    g = resolve_group(group)
    if g is None:
        return Work.completed(t)
    root = _check_rank(g, dst, "dst")
    mine = signature("reduce", t, reduce_op=reduce_op, root=root)

    async def tree(seq: int) -> torch.Tensor:
        links = schedules.binomial_tree(g.rank, g.world_size, root)
        src = _contiguous(t)
        acc = src if g.rank == root or not links.children else src.clone()
        scratch = torch.empty_like(src) if links.children else src
        for child in reversed(links.children):  # smallest subtrees arrive first
            msg = await _recv(g, child, seq, 0, scratch)
            check_signature(g, mine, msg)
            _combine(reduce_op, acc, acc, scratch)
        if links.parent is not None:
            await send(g, links.parent, seq, 0, mine, byte_view(acc))
            return t
        if reduce_op == "mean" and g.world_size > 1:
            acc.div_(g.world_size)
        if acc is not t:
            t.copy_(acc)
        return t

    async def run(seq: int) -> torch.Tensor:
        return await _agreed(g, seq, mine, tree(seq))

    return g.start(f"reduce(dst={root}, op={reduce_op})", run)


def broadcast(
    data: torch.Tensor, src: int = 0, group: ProcessGroup | None = None
) -> Work[torch.Tensor]:
    """Copy ``data`` from rank ``src`` into ``data`` on every rank (binomial tree).

    Args:
        data: A CPU tensor: the value on ``src``, overwritten elsewhere.
        src: The rank whose tensor is sent.
        group: Defaults to the world group.

    Returns:
        Work resolving to ``data``; ``data`` unchanged when not initialised.

    Raises:
        TypeError: ``data`` is not a tensor.
        ValueError: ``src`` out of range.
        CollectiveMismatchError: Ranks passed another dtype, shape or ``src``.

    Cancellation:
        Cancelling the awaiting task does not cancel the broadcast.

    Example:
        >>> await aiodist.broadcast(weights, src=0)
    """
    t = check_tensor(data, "data")
    g = resolve_group(group)
    if g is None:
        return Work.completed(t)
    root = _check_rank(g, src, "src")
    mine = signature("broadcast", t, root=root)

    async def tree(seq: int) -> torch.Tensor:
        links = schedules.binomial_tree(g.rank, g.world_size, root)
        buf = _contiguous(t)
        if links.parent is not None:
            check_signature(g, mine, await _recv(g, links.parent, seq, 0, buf))
        for child in links.children:
            await send(g, child, seq, 0, mine, byte_view(buf))
        if buf is not t:
            t.copy_(buf)
        return t

    async def run(seq: int) -> torch.Tensor:
        return await _agreed(g, seq, mine, tree(seq))

    return g.start(f"broadcast(src={root})", run)


def gather(
    data: torch.Tensor, dst: int = 0, group: ProcessGroup | None = None
) -> Work[list[torch.Tensor]]:
    """Collect ``data`` from every rank on rank ``dst``, in rank order.

    Args:
        data: A CPU tensor; every rank passes the same dtype and shape.
        dst: The rank that receives the tensors.
        group: Defaults to the world group.

    Returns:
        Work resolving to one tensor per rank on ``dst``, ``[]`` elsewhere;
        ``[data]`` when not initialised.

    Raises:
        TypeError: ``data`` is not a tensor.
        ValueError: ``dst`` out of range.
        CollectiveMismatchError: Ranks passed another dtype, shape or ``dst``.

    Cancellation:
        Cancelling the awaiting task does not cancel the gather.

    Example:
        >>> parts = await aiodist.gather(t, dst=0)
    """
    t = check_tensor(data, "data")
    g = resolve_group(group)
    if g is None:
        return Work.completed([t])
    root = _check_rank(g, dst, "dst")
    mine = signature("gather", t, root=root)

    async def direct(seq: int) -> list[torch.Tensor]:
        if g.rank != root:
            await send(g, root, seq, 0, mine, byte_view(_contiguous(t)))
            return []
        out = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in g.ranks]
        futures = {r: _recv(g, r, seq, 0, out[r]) for r in range(g.world_size) if r != root}
        out[root].copy_(t)
        for future in futures.values():
            check_signature(g, mine, await future)
        return out

    async def run(seq: int) -> list[torch.Tensor]:
        return await _agreed(g, seq, mine, direct(seq))

    return g.start(f"gather(dst={root})", run)


def scatter(
    data: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: ProcessGroup | None = None,
) -> Work[torch.Tensor]:
    """Send ``scatter_list[i]`` from rank ``src`` into ``data`` on rank ``i``.

    Args:
        data: A CPU tensor that receives this rank's part.
        scatter_list: On ``src``, one tensor per rank, each shaped like ``data``;
            ignored elsewhere.
        src: The rank that scatters.
        group: Defaults to the world group.

    Returns:
        Work resolving to ``data``; when not initialised, ``data`` holding
        ``scatter_list[0]`` (or unchanged without a list).

    Raises:
        TypeError: ``data`` or an entry of ``scatter_list`` is not a tensor.
        ValueError: ``src`` out of range, ``scatter_list`` missing on ``src``,
            or of the wrong length, dtype or shape.
        CollectiveMismatchError: Ranks passed another dtype, shape or ``src``.

    Cancellation:
        Cancelling the awaiting task does not cancel the scatter.

    Example:
        >>> await aiodist.scatter(part, [a, b], src=0)
    """
    t = check_tensor(data, "data")
    g = resolve_group(group)
    if g is None:
        if scatter_list:
            t.copy_(check_tensor(scatter_list[0], "scatter_list[0]"))
        return Work.completed(t)
    root = _check_rank(g, src, "src")
    parts: list[torch.Tensor] = []
    if g.rank == root:
        if scatter_list is None:
            raise ValueError(f"scatter_list is required on the source rank {root}")
        parts = _check_tensor_list(scatter_list, "scatter_list", g.world_size)
        for i, part in enumerate(parts):
            if part.dtype != t.dtype or part.shape != t.shape:
                raise ValueError(
                    f"scatter_list[{i}] is {part.dtype} {list(part.shape)}, but data is "
                    f"{t.dtype} {list(t.shape)}"
                )
    mine = signature("scatter", t, root=root)

    async def direct(seq: int) -> torch.Tensor:
        if g.rank != root:
            buf = _contiguous(t)
            check_signature(g, mine, await _recv(g, root, seq, 0, buf))
            if buf is not t:
                t.copy_(buf)
            return t
        for r, part in enumerate(parts):
            if r != root:
                await send(g, r, seq, 0, mine, byte_view(_contiguous(part)))
        t.copy_(parts[root])
        return t

    async def run(seq: int) -> torch.Tensor:
        return await _agreed(g, seq, mine, direct(seq))

    return g.start(f"scatter(src={root})", run)


# --- all-to-all patterns -------------------------------------------------------------------


def all_gather(data: torch.Tensor, group: ProcessGroup | None = None) -> Work[list[torch.Tensor]]:
    """Gather ``data`` from every rank onto every rank, in rank order (ring).

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
    t = check_tensor(data, "data")
    g = resolve_group(group)
    if g is None:
        return Work.completed([t])
    mine = signature("all_gather", t)

    async def run(seq: int) -> list[torch.Tensor]:
        p, me = g.world_size, g.rank
        left, right = schedules.ring_neighbours(me, p)
        out = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in range(p)]
        out[me].copy_(t)
        for s in range(p - 1):
            future = _recv(g, left, seq, s, out[(me - s - 1) % p])
            await send(g, right, seq, s, mine, byte_view(out[(me - s) % p]))
            check_signature(g, mine, await future)
        return out

    return g.start("all_gather", run)


def reduce_scatter(
    inputs: list[torch.Tensor], op: str = "sum", group: ProcessGroup | None = None
) -> Work[torch.Tensor]:
    """Reduce ``inputs[i]`` over all ranks and leave the result on rank ``i``.

    Every rank sends ``inputs[i]`` straight to rank ``i``, which reduces what
    it receives in rank order.

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
    tensors = _check_tensor_list(inputs, "inputs", None)
    if not tensors:
        raise ValueError("inputs must hold one tensor per rank, got an empty list")
    reduce_op = _reduce_op(op)
    first = tensors[0]
    for i, x in enumerate(tensors):
        if x.dtype != first.dtype or x.shape != first.shape:
            raise ValueError(f"inputs[{i}] differs from inputs[0] in dtype or shape")
    _check_op_dtype(reduce_op, first.dtype)
    g = resolve_group(group)
    if g is None:
        return Work.completed(first)
    if len(tensors) != g.world_size:
        raise ValueError(
            f"inputs must hold one tensor per rank ({g.world_size}), got {len(tensors)}"
        )
    mine = signature("reduce_scatter", first, reduce_op=reduce_op)

    async def run(seq: int) -> torch.Tensor:
        p, me = g.world_size, g.rank
        got = [tensors[me] if r == me else torch.empty_like(first) for r in range(p)]
        futures = [None if r == me else _recv(g, r, seq, 0, got[r]) for r in range(p)]
        for k in range(1, p):  # start with the next rank: not everyone sends to rank 0 first
            r = (me + k) % p
            await send(g, r, seq, 0, mine, byte_view(_contiguous(tensors[r])))
        out = torch.empty_like(first, memory_format=torch.contiguous_format)
        for r, future in enumerate(futures):
            if future is not None:
                check_signature(g, mine, await future)
            if r == 0:
                out.copy_(got[0])
            else:
                _combine(reduce_op, out, out, got[r])
        if reduce_op == "mean":
            out.div_(p)
        return out

    return g.start(f"reduce_scatter(op={reduce_op})", run)


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
    tensors = _check_tensor_list(inputs, "inputs", None)
    dtypes = {x.dtype for x in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"inputs must share one dtype, got {sorted(map(str, dtypes))}")
    g = resolve_group(group)
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
        futures = {r: _recv(g, r, seq, 0) for r in range(p) if r != me}
        for k in range(1, p):
            r = (me + k) % p
            x = _contiguous(tensors[r])
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

    return g.start("all_to_all", run)


def barrier(group: ProcessGroup | None = None) -> Work[None]:
    """Wait until every rank of ``group`` reached this barrier (dissemination, data plane).

    Args:
        group: Defaults to the world group.

    Returns:
        Work resolving to None; already done when not initialised.

    Raises:
        CollectiveMismatchError: Another rank called a different collective here.

    Cancellation:
        Cancelling the awaiting task does not cancel the barrier.

    Example:
        >>> await aiodist.barrier()
    """
    g = resolve_group(group)
    if g is None:
        return Work.completed(None)
    mine = signature("barrier")

    async def run(seq: int) -> None:
        for k, (to, frm) in enumerate(schedules.dissemination_partners(g.rank, g.world_size)):
            future = _recv(g, frm, seq, k)
            await send(g, to, seq, k, mine, None)
            check_signature(g, mine, await future)

    return g.start("barrier", run)
