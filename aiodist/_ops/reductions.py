"""Reductions on aiodist's data plane: all_reduce, reduce, reduce_scatter.

Each public function hands its arguments (``forms``) to ``run``, which sets the
call up and starts its algorithm here on a checked ``Request``. The plans
(ring, recursive doubling, binomial tree) come from ``schedules``; this module
only moves bytes and reduces them with torch ops, in place. Every message
carries the sender's signature, so ranks that disagree get
``CollectiveMismatchError`` (``agreement``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiodist._ops import forms, reduce_ops, schedules, shared
from aiodist._ops.agreement import OPEN, Signature, signature
from aiodist._ops.exchange import Exchange, exchange_rows
from aiodist._ops.outputs import new_outputs
from aiodist._ops.run import run
from aiodist._ops.tensors import LazyModule, contiguous, copy_into, divide_
from aiodist._wire import codec
from aiodist._wire.codec import byte_view

if TYPE_CHECKING:
    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._ops.reduce_ops import ReduceOp
    from aiodist._ops.requests import Request
else:
    torch = LazyModule("torch")

# Recursive doubling's fold and unfold messages, apart from its rounds (steps 1, 2, ...).
_FOLD, _UNFOLD = 1 << 19, (1 << 19) + 1
# --- all_reduce ----------------------------------------------------------------------------


def _direct_all_reduce(ex: Exchange, t: torch.Tensor, op: str) -> None:
    """``t``'s part to every rank (``exchange_rows``), reduced in rank order.

    Whoever reduces combines the parts in rank order: through group rank 0,
    rank 0 alone, and the others take its bytes; else every rank, the same
    parts in the same order. Either way results are bitwise identical
    everywhere. The parts land in one staging buffer viewed as ``size``
    tensors shaped like ``t``: a few torch calls whatever the group size, and
    the op's kernel called straight, once per part (the tensors are below
    ``combine``'s slices). Driven by the data plane's callbacks: no task, no
    coroutine.
    """
    buf = contiguous(t)
    mine = byte_view(buf)
    p = ex.g.world_size

    def fold(staging: memoryview) -> memoryview:
        numel = buf.numel()
        if p > 1 and numel:
            fn = reduce_ops.kernel(op, buf.dtype)
            dtype, n = buf.dtype, mine.nbytes
            # Each part viewed flat where it lies (``frombuffer``: one cheap call each, where
            # ``view(p, *shape).unbind(0)`` cost two dearer ones), into ``buf`` seen flat.
            out = buf if buf.dim() == 1 else buf.view(-1)
            first = torch.frombuffer(staging, dtype=dtype, count=numel)
            second = torch.frombuffer(staging, dtype=dtype, count=numel, offset=n)
            fn(first, second, out=out)
            for r in range(2, p):
                fn(out, torch.frombuffer(staging, dtype=dtype, count=numel, offset=r * n), out=out)
            if op == "mean":
                divide_(buf, p)
        return mine

    def done(result: memoryview) -> None:
        if result is not mine:  # group rank 0 folded the rows: its bytes, as it sent them
            mine[:] = result
        if buf is not t:
            copy_into(t, buf)
        ex.work.set_result(t)

    exchange_rows(ex, mine, done, fold=fold)


async def _recursive_doubling(ex: Exchange, buf: torch.Tensor, op: str) -> None:
    g = ex.g
    plan = schedules.recursive_doubling(g.rank, g.world_size)
    me = g.rank
    scratch = torch.empty_like(buf)
    into = byte_view(scratch)
    if plan.is_extra:
        assert plan.fold_partner is not None
        future = ex.recv(plan.fold_partner, _UNFOLD, into)
        await ex.send(plan.fold_partner, _FOLD, byte_view(buf))
        await future
        copy_into(buf, scratch)
        return
    if plan.fold_partner is not None:
        await ex.recv(plan.fold_partner, _FOLD, into)
        reduce_ops.combine(op, buf, buf, scratch)  # the extra rank is higher: it goes second
    for k, partner in enumerate(plan.partners, start=1):  # step 0 is the opening's
        future = ex.recv(partner, k, into)
        await ex.send(partner, k, byte_view(buf))
        await future
        # Lower rank first on both sides, so both compute bitwise the same value.
        if partner < me:
            reduce_ops.combine(op, buf, scratch, buf)
        else:
            reduce_ops.combine(op, buf, buf, scratch)
    if plan.fold_partner is not None:
        await ex.send(plan.fold_partner, _UNFOLD, byte_view(buf))


async def _ring_all_reduce(ex: Exchange, buf: torch.Tensor, op: str) -> None:
    """Ring reduce-scatter then ring all-gather, every receive posted up front.

    Parts move to the left: rank ``r`` sends to ``r - 1`` and receives from
    ``r + 1``. Every receive is posted before the first send, and each rank
    tells the rank that sends to it so (a header-only "clear to send", which is
    also the opening: it goes to ``r + 1`` at step ``OPEN``) before that rank
    sends: no payload ever arrives unexpected, which would cost a tensor-sized
    buffer and a copy. Reduce-scatter parts land in their own slice of one
    scratch buffer of ``size - 1`` chunks (less than the tensor), all-gather
    parts straight in their final place in ``buf``. An all-gather part can only
    arrive after this rank sent its last use of that chunk round the ring, so
    the early receive never overwrites live data.
    """
    g = ex.g
    p, me = g.world_size, g.rank
    to, frm = (me - 1) % p, (me + 1) % p
    v = (-me) % p  # the schedules' rank: their ring runs to v + 1, which is rank r - 1
    flat = buf.view(-1)
    bounds = schedules.chunk_bounds(flat.numel(), p)
    chunks = [flat[a:b] for a, b in bounds]
    rs_steps = schedules.ring_reduce_scatter_steps(v, p)
    ag_steps = schedules.ring_all_gather_steps(v, p)
    width = bounds[0][1] - bounds[0][0]
    scratch = torch.empty((p - 1) * width, dtype=buf.dtype)
    parts = [
        scratch[s * width : s * width + chunks[c].numel()] for s, (_, c) in enumerate(rs_steps)
    ]
    rs_recvs = [ex.recv(frm, 1 + s, byte_view(part)) for s, part in enumerate(parts)]
    ag_recvs = [ex.recv(frm, p + s, byte_view(chunks[c])) for s, (_, c) in enumerate(ag_steps)]
    ready = ex.recv(to, OPEN)
    await ex.send(frm, OPEN, None)  # clear to send: every receive of ours is posted
    await ready
    for s, (out_c, in_c) in enumerate(rs_steps):
        await ex.send(to, 1 + s, byte_view(chunks[out_c]))
        await rs_recvs[s]
        reduce_ops.combine(op, chunks[in_c], parts[s], chunks[in_c])
    for s, (out_c, _) in enumerate(ag_steps):
        await ex.send(to, p + s, byte_view(chunks[out_c]))
        await ag_recvs[s]


def all_reduce(
    tensor: torch.Tensor,
    op: str | ReduceOp = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work[torch.Tensor]:
    """Reduce ``tensor`` across all ranks, in place: every rank ends with the same result.

    Small tensors (up to 16 KiB, in groups of up to 8) go straight to every
    rank in one round; others under 64 KiB use recursive doubling; larger ones a
    ring reduce-scatter then ring all-gather, or, from 1 MiB in a group whose
    ranks share one host, a reduction in shared memory (``/dev/shm``; set
    ``AIODIST_SHM=0`` on every rank to turn it off). The result is bitwise
    identical on every rank.

    Args:
        tensor: A dense tensor, overwritten with the result (mmengine calls it ``data``).
        op: ``sum``, ``mean``, ``product``, ``min``, ``max``, ``band``, ``bor`` or
            ``bxor`` (any case), ``ReduceOp.SUM`` and the like, or torch's own
            ``torch.distributed.ReduceOp`` (``AVG`` is ``mean``). ``mean`` on an
            integer tensor is mmengine's: sum, true divide, copy back (truncated).
            On bool tensors ``sum``/``max`` are logical or, ``product``/``min``
            logical and. The bitwise ops need integer or bool tensors, and
            complex tensors take ``sum`` and ``mean`` only, as in torch.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.

    Returns:
        Work resolving to ``tensor``; already done with ``tensor`` unchanged when
        not initialised, or on a process outside ``group``.

    Raises:
        TypeError: ``tensor`` is not a tensor, or ``op`` does not suit its dtype.
        ValueError: Unknown ``op``.
        CollectiveMismatchError: Ranks passed another dtype, shape or op (on every rank).

    Cancellation:
        Cancelling the awaiting task does not cancel the reduction; it completes
        for every rank. A timeout marks ``group`` broken on all members.

    Example:
        >>> t = torch.ones(4)
        >>> await aiodist.all_reduce(t, op="mean")
    """
    return run(forms.all_reduce(tensor, op, group), start_all_reduce)


def start_all_reduce(
    g: ProcessGroup, seq: int, req: Request, *, label: str = "all_reduce"
) -> Work[torch.Tensor]:
    """``all_reduce`` of ``req.tensor`` as ``g``'s operation ``seq``.

    ``label`` is the name in its signature: a call that reduces several tensors
    puts what every rank must agree on there (see ``tensor_groups``). Without
    ``req.shm`` it never takes a turn on shared memory (a call staged from a
    device starts after its copy, too late to take its turn in call order).
    """
    t, reduce_op, shm = req.tensor, req.reduce_op, req.shm
    assert t is not None
    assert reduce_op is not None
    if t.is_sparse:
        return _start_sparse_all_reduce(g, seq, req.description, t, label)
    p = g.world_size
    numel = t.numel()
    nbytes = numel * t.element_size()
    # Only a tensor large enough for shared memory asks whether this group may use it.
    use_shm = shm and p > 1 and nbytes >= schedules.SHM_MIN_BYTES and shared.usable(g)
    algorithm = schedules.all_reduce_algorithm(nbytes, numel, p, shared_memory=use_shm)
    work: Work[torch.Tensor] = g.begin(req.description, seq=seq)
    if algorithm == "direct":
        if not work.is_completed():  # else a member aborted this call: send and post nothing
            agreed = signature(label, t, reduce_op=reduce_op, algorithm="direct")
            _direct_all_reduce(Exchange(g, work, seq, agreed, rides=True), t, reduce_op)
        return work
    turn = shared.take_turn(g) if algorithm == "shared_memory" else None  # now: call order

    def mine(algorithm: str) -> Signature:
        return signature(label, t, reduce_op=reduce_op, algorithm=algorithm)

    # Where shared memory turns out off for some rank, every rank takes the sockets.
    fallback = schedules.all_reduce_algorithm(nbytes, numel, p)

    async def run(seq: int) -> torch.Tensor:
        buf = contiguous(t)
        if turn is not None:
            async with turn:
                if await shared.agreed(g):
                    async with Exchange(g, work, seq, mine(algorithm), rides=True) as ex:
                        await shared.all_reduce(ex, buf, reduce_op, reduce_ops.combine)
                else:
                    await _socket_all_reduce(g, work, seq, buf, reduce_op, mine(fallback))
        elif p > 1:
            await _socket_all_reduce(g, work, seq, buf, reduce_op, mine(algorithm))
        if reduce_op == "mean" and p > 1:
            divide_(buf, p)
        if buf is not t:
            copy_into(t, buf)
        return t

    return g.drive(work, run, seq, on_end=None if turn is None else turn.release)


def _start_sparse_all_reduce(
    g: ProcessGroup, seq: int, description: str, t: torch.Tensor, label: str
) -> Work[torch.Tensor]:
    """The sum of sparse COO ``t`` over ``g``, into ``t`` (gloo's sparse all_reduce).

    Every rank sends its coalesced indices and values to every other one
    (``r + 1`` first: the opening), and every rank adds all of them in rank
    order, so results are bitwise identical everywhere. ``t`` then holds the sum
    (``copy_``: the number of its entries may change).
    """
    work: Work[torch.Tensor] = g.begin(description, seq=seq)
    mine = t.coalesce()
    payload = codec.dumps((mine.indices(), mine.values()))

    async def op(seq: int) -> torch.Tensor:
        peers = schedules.direct_peers(g.rank, g.world_size)
        agreed = signature(label, t, reduce_op="sum", algorithm="sparse")
        async with Exchange(g, work, seq, agreed, rides=True) as ex:
            futures = [ex.recv(r, OPEN) for r in peers]
            for r in peers:
                await ex.send(r, OPEN, payload)
            parts = {r: codec.loads((await f).data) for r, f in zip(peers, futures, strict=True)}
        parts[g.rank] = (mine.indices(), mine.values())
        indices, values = zip(*(parts[r] for r in range(g.world_size)), strict=True)
        total = torch.sparse_coo_tensor(
            torch.cat(indices, 1), torch.cat(values), t.shape, check_invariants=True
        )
        t.copy_(total.coalesce())
        return t

    return g.drive(work, op, seq)


async def _socket_all_reduce(
    g: ProcessGroup, work: Work[Any], seq: int, buf: torch.Tensor, op: str, mine: Signature
) -> None:
    # Only tensors too large for the direct exchange come here; ``mine`` names the algorithm.
    if mine[-1] == "recursive_doubling":
        async with Exchange(g, work, seq, mine, rides=False) as ex:
            await _recursive_doubling(ex, buf, op)
    else:
        async with Exchange(g, work, seq, mine, rides=True) as ex:
            await _ring_all_reduce(ex, buf, op)


# --- rooted operations ---------------------------------------------------------------------


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: str | ReduceOp = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work[torch.Tensor]:
    """Reduce ``tensor`` from all ranks into ``tensor`` on rank ``dst`` (binomial tree).

    Args:
        tensor: A dense tensor; overwritten with the result on ``dst`` only.
        dst: Global rank that receives the result (torch's convention).
        op: As for ``all_reduce``.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.
        group_dst: ``dst`` as a rank of ``group`` (instead of ``dst``).

    Returns:
        Work resolving to ``tensor`` (the result on ``dst``, unchanged elsewhere).

    Raises:
        TypeError: ``tensor`` is not a tensor, or ``op`` does not suit its dtype.
        ValueError: Unknown ``op``; neither (or both of) ``dst`` and ``group_dst``;
            ``dst`` not a member of ``group``.
        CollectiveMismatchError: Ranks passed another dtype, shape, op or ``dst``.

    Cancellation:
        Cancelling the awaiting task does not cancel the reduction.

    Example:
        >>> await aiodist.reduce(t, dst=0, op="max")
    """
    return run(forms.reduce(tensor, dst, op, group, group_dst), _start_reduce)


def _start_reduce(g: ProcessGroup, seq: int, req: Request) -> Work[torch.Tensor]:
    t, root, reduce_op = req.tensor, req.root, req.reduce_op
    assert t is not None
    assert root is not None
    assert reduce_op is not None
    mine = signature("reduce", t, reduce_op=reduce_op, root=root)

    async def tree(seq: int) -> torch.Tensor:
        links = schedules.binomial_tree(g.rank, g.world_size, root)
        src = contiguous(t)
        acc = src
        if g.rank != root and links.children:
            acc = torch.empty_like(src)
            copy_into(acc, src)
        scratch = torch.empty_like(src) if links.children else src
        async with Exchange(g, work, seq, mine, rides=False) as ex:
            for child in reversed(links.children):  # smallest subtrees arrive first
                await ex.recv(child, 1, byte_view(scratch))
                reduce_ops.combine(reduce_op, acc, acc, scratch)
            if links.parent is not None:
                await ex.send(links.parent, 1, byte_view(acc))
        if links.parent is not None:
            return t
        if reduce_op == "mean" and g.world_size > 1:
            divide_(acc, g.world_size)
        if acc is not t:
            copy_into(t, acc)
        return t

    work: Work[torch.Tensor] = g.begin(req.description, seq=seq)
    return g.drive(work, tree, seq)


def reduce_scatter(
    output: torch.Tensor | list[torch.Tensor],
    input_list: list[torch.Tensor] | str | ReduceOp | None = None,
    op: str | ReduceOp | ProcessGroup = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work[torch.Tensor]:
    """Reduce ``input_list[i]`` over all ranks and leave the result on rank ``i``.

    torch.distributed's form, ``reduce_scatter(output, input_list, op, group)``,
    writes the result into ``output``. aiodist's older form,
    ``reduce_scatter(inputs, op, group)`` (a list first), returns a new tensor.
    Every rank sends ``input_list[i]`` straight to rank ``i``, which reduces
    what it receives in rank order; from 1 MiB of inputs, in a group whose ranks
    share one host, rank ``i`` reduces straight out of the others' shared segments.

    Args:
        output: The tensor that receives this rank's result (torch's form).
        input_list: One tensor per rank, all of ``output``'s dtype and shape.
        op: As for ``all_reduce``.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.

    Returns:
        Work resolving to ``output`` (a new tensor in the older form); when not
        initialised, ``input_list[0]``'s values.

    Raises:
        TypeError: A list that is not all tensors, or ``op`` does not suit the dtype.
        ValueError: Wrong number of tensors, tensors that differ, or unknown ``op``.
        CollectiveMismatchError: Ranks passed another dtype, shape or op.

    Cancellation:
        Cancelling the awaiting task does not cancel the operation.

    Example:
        >>> await aiodist.reduce_scatter(out, [a, b], op="sum")
    """
    return run(forms.reduce_scatter(output, input_list, op, group), start_reduce_scatter)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str | ReduceOp = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work[torch.Tensor]:
    """Reduce ``input`` (one slice per rank) over all ranks; rank ``i`` gets slice ``i``.

    ``input`` holds ``world_size`` slices shaped like ``output``: concatenated
    along the first dimension (``world_size * n`` rows for ``n`` rows of
    ``output``) or stacked (``(world_size, *output.shape)``).

    Args:
        output: Receives this rank's reduced slice.
        input: ``world_size`` times ``output``'s elements, of its dtype.
        op: As for ``all_reduce``.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.

    Returns:
        Work resolving to ``output``.

    Raises:
        TypeError: Not tensors, or ``op`` does not suit the dtype.
        ValueError: Sizes or dtypes that do not fit, or an unknown ``op``.
        CollectiveMismatchError: Ranks passed another dtype, shape or op.

    Cancellation:
        Cancelling the awaiting task does not cancel the operation.

    Example:
        >>> await aiodist.reduce_scatter_tensor(out, torch.ones(2 * n))
    """
    return run(forms.reduce_scatter_tensor(output, input, op, group), start_reduce_scatter)


def start_reduce_scatter(g: ProcessGroup, seq: int, req: Request) -> Work[torch.Tensor]:
    """``reduce_scatter`` of ``req.inputs`` (one per rank) as ``g``'s operation ``seq``.

    The result lands in ``req.outputs[0]`` when given (and contiguous), else in a
    new tensor. Both algorithms open with their first round (step ``OPEN`` to
    every rank).
    """
    tensors, reduce_op, shm = req.inputs, req.reduce_op, req.shm
    assert reduce_op is not None
    out = None if req.outputs is None else req.outputs[0]
    first = tensors[0]
    nbytes = first.numel() * first.element_size() * g.world_size
    use_shm = shm and g.world_size > 1 and nbytes >= schedules.SHM_MIN_BYTES and shared.usable(g)
    turn = shared.take_turn(g) if use_shm else None  # taken now: call order
    work: Work[torch.Tensor] = g.begin(req.description, seq=seq)

    def mine(algorithm: str) -> Signature:
        return signature("reduce_scatter", first, reduce_op=reduce_op, algorithm=algorithm)

    def result(made: torch.Tensor) -> torch.Tensor:
        if out is None:
            return made
        if made is not out:
            copy_into(out, made)
        return out

    async def run(seq: int) -> torch.Tensor:
        if turn is not None:
            async with turn:
                if await shared.agreed(g):  # else some rank has it off: all take the sockets
                    made = new_outputs(g, first, 1, "reduce_scatter")[0]
                    parts = [contiguous(x) for x in tensors]
                    async with Exchange(g, work, seq, mine("shared_memory"), rides=True) as ex:
                        await shared.reduce_scatter(ex, parts, made, reduce_op, reduce_ops.combine)
                    if reduce_op == "mean":
                        divide_(made, g.world_size)
                    return result(made)
        p, me = g.world_size, g.rank
        got = [tensors[me] if r == me else torch.empty_like(first) for r in range(p)]
        async with Exchange(g, work, seq, mine("direct"), rides=True) as ex:
            futures = [None if r == me else ex.recv(r, OPEN, byte_view(got[r])) for r in range(p)]
            for k in range(1, p):  # start with the next rank: not everyone sends to rank 0 first
                r = (me + k) % p
                await ex.send(r, OPEN, byte_view(contiguous(tensors[r])))
            made = (
                out
                if out is not None and out.is_contiguous()
                else torch.empty_like(first, memory_format=torch.contiguous_format)
            )
            for r, future in enumerate(futures):
                if future is not None:
                    await future
                if r == 0:
                    copy_into(made, got[0])
                else:
                    reduce_ops.combine(reduce_op, made, made, got[r])
        if reduce_op == "mean":
            divide_(made, p)
        return result(made)

    return g.drive(work, run, seq, on_end=None if turn is None else turn.release)
