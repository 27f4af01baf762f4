"""Data movement between all ranks on aiodist's data plane: all_gather, all_to_all, barrier.

Each public function validates its arguments, then starts the operation with
``ProcessGroup.start`` and returns its ``Work``. The plans (ring,
dissemination) come from ``schedules``; this module only moves bytes. Every
message carries the sender's signature, so ranks that disagree get
``CollectiveMismatchError``. The rooted operations live in ``rooted.py``.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from aiodist._errors import (
    ArgumentError,
    ArgumentTypeError,
    BarrierTimeoutError,
    CollectiveMismatchError,
)
from aiodist._group.group import ProcessGroup
from aiodist._group.work import Work
from aiodist._ops import schedules, shared, staging
from aiodist._ops.common import (
    LazyModule,
    Slot,
    bridged,
    byte_view,
    chain,
    check_signature,
    check_tensor,
    check_tensor_list,
    clear_to_send,
    contiguous,
    copy_into,
    exchange_all,
    outside,
    recv_tensor,
    resolve_group,
    send,
    signature,
)
from aiodist._ops.outputs import new_outputs
from aiodist._ops.reductions import slices
from aiodist._plane.peers import Received
from aiodist._wire import codec

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

__all__ = [
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "check_outputs",
    "meet",
    "monitored_barrier",
    "start_all_gather",
    "start_all_to_all",
]


def all_gather(
    tensor_list: list[torch.Tensor] | torch.Tensor,
    tensor: torch.Tensor | ProcessGroup | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work[list[torch.Tensor]]:
    """Gather a tensor from every rank onto every rank, in rank order.

    Both forms work: torch.distributed's ``all_gather(tensor_list, tensor,
    group)``, which fills ``tensor_list``, and mmengine's ``all_gather(data,
    group)`` (a tensor first), which returns new tensors. A ring of messages;
    from 1 MiB gathered, in a group whose ranks share one host, every rank
    copies the others' parts straight from their shared segments.

    Args:
        tensor_list: torch's form: one tensor per rank to fill. mmengine's form:
            the tensor to gather (``data``).
        tensor: torch's form: the tensor to gather. mmengine's form: the group.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.

    Returns:
        Work resolving to one tensor per rank (``tensor_list`` itself in torch's
        form); ``[data]`` when not initialised (mmengine's form).

    Raises:
        TypeError: Not tensors.
        ValueError: ``tensor_list`` of the wrong length, shape or dtype.
        CollectiveMismatchError: Ranks passed another dtype or shape.

    Cancellation:
        Cancelling the awaiting task does not cancel the gather.

    Example:
        >>> parts = await aiodist.all_gather(torch.tensor([rank]))
    """
    outs: object = None
    if isinstance(tensor_list, list | tuple):
        outs, data = tensor_list, tensor
    else:  # mmengine's form, all_gather(data, group)
        data = tensor_list
        if isinstance(tensor, ProcessGroup):
            group = tensor
    if (w := bridged(group, "all_gather", data)) is not None:
        return w if outs is None else chain(w, lambda got: _fill(outs, got))
    g = resolve_group(group)
    with Slot(g, "all_gather") as seq:
        t = check_tensor(data, "tensor")
        out_list = None
        if outs is not None:
            size = 1 if g is None or g.rank < 0 else g.world_size
            out_list = check_outputs(outs, "tensor_list", t, size)
        if outside(g):
            return Work.completed(out_list or [])
        if g is None:
            if out_list is None:
                return Work.completed([t])
            out_list[0].copy_(t)
            return Work.completed(out_list)
    if staging.on_device(t):

        def finish(hosts: list[torch.Tensor], got: list[torch.Tensor]) -> Any:
            if out_list is not None:
                return list(zip(out_list, got, strict=True)), out_list
            return staging.new_on_device(got, t)

        return staging.staged(
            g,
            seq,
            "all_gather",
            [t],
            lambda hosts: start_all_gather(g, seq, hosts[0], shm=False),
            finish,
        )
    return start_all_gather(g, seq, t, out_list)


def check_outputs(outs: object, name: str, like: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Check ``outs`` holds ``size`` tensors of ``like``'s dtype and shape (torch's errors)."""
    out = check_tensor_list(outs, name, None)
    if len(out) != size:
        raise ArgumentError(f"{name} must hold one tensor per rank ({size}), got {len(out)}")
    for i, x in enumerate(out):
        if x.dtype != like.dtype:
            raise ArgumentError(
                f"Invalid usage of tensors with different dtypes: {name}[{i}] is {x.dtype}, "
                f"the input {like.dtype}"
            )
        if x.shape != like.shape:
            raise ArgumentError(
                f"{name}[{i}] has shape {list(x.shape)}, the input {list(like.shape)}"
            )
    return out


def _fill(outs: object, got: list[torch.Tensor]) -> list[torch.Tensor]:
    assert isinstance(outs, list | tuple)
    for o, x in zip(outs, got, strict=True):
        if o is not x:
            o.copy_(x)
    return list(outs)


def start_all_gather(
    g: ProcessGroup,
    seq: int,
    t: torch.Tensor,
    outs: list[torch.Tensor] | None = None,
    *,
    shm: bool = True,
) -> Work[list[torch.Tensor]]:
    """``all_gather`` of checked ``t`` as ``g``'s operation ``seq``, into ``outs`` if given."""
    mine = signature("all_gather", t)
    nbytes = t.numel() * t.element_size() * g.world_size
    use_shm = shm and g.world_size > 1 and nbytes >= schedules.SHM_MIN_BYTES and shared.usable(g)
    turn = shared.take_turn(g) if use_shm else None  # taken now: call order
    direct = outs is not None and all(o.is_contiguous() for o in outs)

    async def run(seq: int) -> list[torch.Tensor]:
        out = outs if direct and outs is not None else new_outputs(g, t, g.world_size, "all_gather")
        if turn is not None:
            async with turn:
                if await shared.agreed(g):  # else some rank has it off: all take the ring
                    await shared.shared_memory_all_gather(g, seq, contiguous(t), out, mine)
                    return out if outs is None else _fill(outs, out)
        await _ring_all_gather(g, seq, t, out, mine)
        return out if outs is None else _fill(outs, out)

    return g.start("all_gather", run, seq=seq, on_end=None if turn is None else turn.release)


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work[torch.Tensor]:
    """Gather ``input_tensor`` from every rank into ``output_tensor``, in rank order.

    ``output_tensor`` holds ``world_size`` slices shaped like ``input_tensor``:
    concatenated along the first dimension or stacked (``(world_size, *shape)``).

    Args:
        output_tensor: Receives every rank's tensor.
        input_tensor: This rank's tensor, of ``output_tensor``'s dtype.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.

    Returns:
        Work resolving to ``output_tensor``.

    Raises:
        TypeError: Not tensors.
        ValueError: Sizes or dtypes that do not fit.
        CollectiveMismatchError: Ranks passed another dtype or shape.

    Cancellation:
        Cancelling the awaiting task does not cancel the gather.

    Example:
        >>> await aiodist.all_gather_into_tensor(out, torch.tensor([rank]))
    """
    g = resolve_group(group)
    size = 1 if g is None or g.rank < 0 else g.world_size
    parts = None
    if isinstance(output_tensor, torch.Tensor) and isinstance(input_tensor, torch.Tensor):
        parts = slices(output_tensor, input_tensor, size)
    if parts is not None and (w := bridged(group, "all_gather", input_tensor)) is not None:
        return chain(w, lambda got: _into(output_tensor, parts or [], got))
    with Slot(g, "all_gather_into_tensor") as seq:
        out = check_tensor(output_tensor, "output_tensor")
        t = check_tensor(input_tensor, "input_tensor")
        if parts is None or out.dtype != t.dtype:
            raise ArgumentError(
                f"output_tensor ({out.dtype} {list(out.shape)}) must hold {size} tensors like "
                f"input_tensor ({t.dtype} {list(t.shape)})"
            )
        if outside(g):
            return Work.completed(out)
        if g is None:
            out.copy_(t.reshape(out.shape))
            return Work.completed(out)
    if staging.on_device(t):
        return staging.staged(
            g,
            seq,
            "all_gather_into_tensor",
            [t],
            lambda hosts: start_all_gather(g, seq, hosts[0], shm=False),
            lambda hosts, got: ([(out, torch.stack(got).reshape(out.shape))], out),
        )
    return chain(start_all_gather(g, seq, t, parts), lambda got: _into(out, parts or [], got))


def _into(out: torch.Tensor, parts: list[torch.Tensor], got: list[torch.Tensor]) -> torch.Tensor:
    for part, x in zip(parts, got, strict=True):
        if part is not x:
            part.copy_(x)
    return out


def all_gather_coalesced(
    output_tensor_lists: list[list[torch.Tensor]],
    input_tensor_list: list[torch.Tensor],
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work[list[list[torch.Tensor]]]:
    """Gather several tensors from every rank in one operation (torch's, deprecated there).

    Args:
        output_tensor_lists: One list per rank, each shaped like ``input_tensor_list``.
        input_tensor_list: This rank's tensors (any dtypes and shapes).
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.

    Returns:
        Work resolving to ``output_tensor_lists``, filled.

    Raises:
        TypeError: Not lists of tensors.
        ValueError: Output lists that do not match the inputs.
        CollectiveMismatchError: Ranks passed other tensors.

    Example:
        >>> await aiodist.all_gather_coalesced([[a0, b0], [a1, b1]], [a, b])
    """
    g = resolve_group(group)
    with Slot(g, "all_gather_coalesced") as seq:
        inputs = check_tensor_list(input_tensor_list, "input_tensor_list", None)
        if not isinstance(output_tensor_lists, list | tuple):
            raise ArgumentTypeError("output_tensor_lists must be a list of lists of tensors")
        size = 1 if g is None or g.rank < 0 else g.world_size
        if len(output_tensor_lists) != size:
            raise ArgumentError(f"output_tensor_lists must hold {size} lists, one per rank")
        outs = []
        for r, row in enumerate(output_tensor_lists):
            got = check_tensor_list(row, f"output_tensor_lists[{r}]", len(inputs))
            for i, (o, x) in enumerate(zip(got, inputs, strict=True)):
                if o.dtype != x.dtype or o.numel() != x.numel():
                    raise ArgumentError(
                        f"output_tensor_lists[{r}][{i}] does not match input_tensor_list[{i}]"
                    )
            outs.append(got)
        if any(staging.on_device(x) for x in inputs):
            raise ArgumentError("all_gather_coalesced takes host (CPU) tensors only")
        if outside(g):
            return Work.completed(list(output_tensor_lists))
        packed = _pack(inputs)
        if g is None:
            _unpack(packed, outs[0])
            return Work.completed(list(output_tensor_lists))
    return chain(
        start_all_gather(g, seq, packed),
        lambda got: [_unpack(x, row) for x, row in zip(got, outs, strict=True)],
    )


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors``, one after the other, as one uint8 tensor."""
    flat = [codec.flat_view(t.contiguous()) for t in tensors]
    return (
        torch.cat([x.view(torch.uint8) for x in flat])
        if flat
        else torch.empty(0, dtype=torch.uint8)
    )


def _unpack(packed: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    offset = 0
    for o in outs:
        n = o.numel() * o.element_size()
        o.copy_(packed[offset : offset + n].clone().view(o.dtype).view(o.shape))
        offset += n
    return outs


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
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor] | ProcessGroup | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work[list[torch.Tensor]]:
    """Send ``input_tensor_list[i]`` to rank ``i``; receive one tensor from every rank.

    Both forms work: torch.distributed's ``all_to_all(output_tensor_list,
    input_tensor_list, group)``, which fills ``output_tensor_list``, and
    aiodist's ``all_to_all(inputs, group)``, which returns new tensors (shapes
    may then differ from pair to pair; the dtype must be the same everywhere).

    Args:
        output_tensor_list: torch's form: one tensor per rank to fill, shaped like
            what that rank sends here. aiodist's form: the inputs.
        input_tensor_list: torch's form: one tensor per rank, all of one dtype.
            aiodist's form: the group (or None).
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.

    Returns:
        Work resolving to a list whose entry ``i`` is rank ``i``'s tensor for this
        rank (``output_tensor_list`` itself in torch's form); the inputs when
        not initialised.

    Raises:
        TypeError: Not lists of tensors.
        ValueError: Wrong number of tensors, or mixed dtypes.
        CollectiveMismatchError: Ranks passed another dtype, or a tensor that does
            not fit the output meant for it.

    Cancellation:
        Cancelling the awaiting task does not cancel the exchange.

    Example:
        >>> outs = await aiodist.all_to_all([torch.tensor([rank, i]) for i in range(n)])
    """
    outs: object = None
    if isinstance(input_tensor_list, list | tuple):
        outs, inputs = output_tensor_list, input_tensor_list
    else:  # aiodist's form, all_to_all(inputs, group)
        inputs = output_tensor_list
        if isinstance(input_tensor_list, ProcessGroup):
            group = input_tensor_list
    if (w := bridged(group, "all_to_all", inputs)) is not None:
        return w if outs is None else chain(w, lambda got: _fill(outs, got))
    g = resolve_group(group)
    with Slot(g, "all_to_all") as seq:
        tensors = check_tensor_list(inputs, "input_tensor_list", None)
        dtypes = {x.dtype for x in tensors}
        if len(dtypes) > 1:
            raise ArgumentError(f"inputs must share one dtype, got {sorted(map(str, dtypes))}")
        out_list = None
        size = 1 if g is None or g.rank < 0 else g.world_size
        if outs is not None:
            out_list = check_tensor_list(outs, "output_tensor_list", size)
            for i, o in enumerate(out_list):
                if tensors and o.dtype != tensors[0].dtype:
                    raise ArgumentError(
                        f"output_tensor_list[{i}] is {o.dtype}, the inputs {tensors[0].dtype}"
                    )
        if outside(g):
            return Work.completed(out_list or [])
        if g is None and out_list is None:
            return Work.completed(tensors)  # aiodist's form, not initialised: the inputs
        if len(tensors) != size:
            raise ArgumentError(
                f"input_tensor_list must hold one tensor per rank ({size}), got {len(tensors)}"
            )
        if g is None:
            assert out_list is not None
            if out_list[0].numel() != tensors[0].numel():
                raise ArgumentError("output_tensor_list[0] does not fit input_tensor_list[0]")
            out_list[0].copy_(tensors[0].reshape(out_list[0].shape))
            return Work.completed(out_list)
    if staging.on_device(tensors[0]):

        def finish(hosts: list[torch.Tensor], got: list[torch.Tensor]) -> Any:
            if out_list is not None:
                return [
                    (o, x.reshape(o.shape)) for o, x in zip(out_list, got, strict=True)
                ], out_list
            return staging.new_on_device(got, tensors[0])

        return staging.staged(
            g, seq, "all_to_all", tensors, lambda hosts: start_all_to_all(g, seq, hosts), finish
        )
    work = start_all_to_all(g, seq, tensors)
    if out_list is None:
        return work
    return chain(work, lambda got: _fill_reshaped(out_list, got))


def _fill_reshaped(outs: list[torch.Tensor], got: list[torch.Tensor]) -> list[torch.Tensor]:
    for r, (o, x) in enumerate(zip(outs, got, strict=True)):
        if o.numel() != x.numel():
            raise CollectiveMismatchError(
                f"rank {r} sent {x.numel()} elements for an output of {o.numel()}",
                field="shape",
                values_by_rank={r: list(x.shape)},
            )
        o.copy_(x.reshape(o.shape))
    return outs


def start_all_to_all(
    g: ProcessGroup, seq: int, tensors: list[torch.Tensor]
) -> Work[list[torch.Tensor]]:
    """``all_to_all`` of checked ``tensors`` as ``g``'s operation ``seq``; new outputs."""
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


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work[torch.Tensor]:
    """Send slice ``i`` of ``input`` (first dimension) to rank ``i``; gather into ``output``.

    Args:
        output: Receives rank ``i``'s part for this rank at slice ``i``.
        input: This rank's parts, one after the other.
        output_split_sizes: Rows of ``output`` per rank; equal parts if None.
        input_split_sizes: Rows of ``input`` per rank; equal parts if None.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.

    Returns:
        Work resolving to ``output``.

    Raises:
        TypeError: Not tensors.
        ValueError: Split sizes that do not fit the tensors, or mixed dtypes.
        CollectiveMismatchError: A rank sent a part that does not fit its slice.

    Cancellation:
        Cancelling the awaiting task does not cancel the exchange.

    Example:
        >>> await aiodist.all_to_all_single(out, torch.arange(world_size) + rank)
    """
    g = resolve_group(group)
    with Slot(g, "all_to_all_single") as seq:
        out = check_tensor(output, "output")
        t = check_tensor(input, "input")
        if out.dtype != t.dtype:
            raise ArgumentError(f"output is {out.dtype} but input is {t.dtype}")
        if outside(g):
            return Work.completed(out)
        size = 1 if g is None else g.world_size
        sends = _split(t, input_split_sizes, size, "input")
        recvs = _split(out, output_split_sizes, size, "output")
        if g is None:
            if recvs[0].shape != sends[0].shape:
                raise ArgumentError("output and input must have the same size at world size 1")
            recvs[0].copy_(sends[0])
            return Work.completed(out)
    if staging.on_device(t):
        return staging.staged(
            g,
            seq,
            "all_to_all_single",
            [t],
            lambda hosts: start_all_to_all(
                g, seq, _split(hosts[0], input_split_sizes, size, "input")
            ),
            lambda hosts, got: (
                [(out, torch.cat([x.reshape(-1) for x in got]).reshape(out.shape))],
                out,
            ),
        )
    return chain(start_all_to_all(g, seq, sends), lambda got: _fill_exact(out, recvs, got))


def _split(t: torch.Tensor, sizes: list[int] | None, n: int, name: str) -> list[torch.Tensor]:
    rows = t.shape[0] if t.dim() else 1
    if sizes is None:
        if rows % n:
            raise ArgumentError(f"{name} has {rows} rows, not divisible by the group size {n}")
        sizes = [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows or any(s < 0 for s in sizes):
        raise ArgumentError(
            f"{name}_split_sizes {sizes} must hold {n} sizes that add up to {name}'s {rows} rows"
        )
    whole = t if t.dim() else t.reshape(1)
    return list(torch.split(whole, sizes))


def _fill_exact(
    out: torch.Tensor, recvs: list[torch.Tensor], got: list[torch.Tensor]
) -> torch.Tensor:
    for r, (o, x) in enumerate(zip(recvs, got, strict=True)):
        if o.shape != x.shape:
            raise CollectiveMismatchError(
                f"rank {r} sent a part of shape {list(x.shape)} for a slice of "
                f"{list(o.shape)}; check the split sizes on both ranks",
                field="shape",
                values_by_rank={r: list(x.shape)},
            )
        o.copy_(x)
    return out


def _came(future: asyncio.Future[Received]) -> bool:
    """True if the peer's message arrived (not still awaited, nor failed by a notice)."""
    return future.done() and not future.cancelled() and future.exception() is None


def barrier(
    group: ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    timeout: float | timedelta | None = None,
) -> Work[None]:
    """Wait until every rank of ``group`` reached this barrier (on the data plane).

    Dissemination: ``log2 size`` rounds of one message in and one out per rank.
    With ``timeout``, every rank hears from every other one instead (one round),
    so a rank that gives up can say which ranks never arrived (as torch's
    ``monitored_barrier`` does).

    Args:
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.
        device_ids: torch's NCCL hint; accepted and not needed.
        timeout: Seconds (or a ``timedelta``) to wait for the others; the
            group's timeout if None.

    Returns:
        Work resolving to None; already done when not initialised.

    Raises:
        BarrierTimeoutError: ``timeout`` passed; ``.ranks`` (global) never arrived,
            and the group is broken on every member.
        CollectiveMismatchError: Another rank called a different collective here.

    Cancellation:
        Cancelling the awaiting task does not cancel the barrier.

    Example:
        >>> await aiodist.barrier(timeout=30)   # names the ranks that never came
    """
    return _barrier(group, timeout, "barrier")


def monitored_barrier(
    group: ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    wait_all_ranks: bool = False,
) -> Work[None]:
    """A barrier that names the ranks that never arrived (torch's ``monitored_barrier``).

    Every rank hears from every other one (on any backend), so whichever rank
    gives up names all the missing ranks, whatever ``wait_all_ranks`` says.

    Args:
        group: Defaults to the world group.
        timeout: Seconds (or a ``timedelta``); the group's timeout if None.
        wait_all_ranks: Accepted for torch's signature; every missing rank is named.

    Returns:
        Work resolving to None.

    Raises:
        BarrierTimeoutError: ``timeout`` passed (a ``RuntimeError``, as torch raises);
            ``.ranks`` lists the ranks that never arrived.

    Cancellation:
        Cancelling the awaiting task does not cancel the barrier.

    Example:
        >>> await aiodist.monitored_barrier(timeout=timedelta(seconds=30))
    """
    g = resolve_group(group)
    if timeout is None and g is not None:
        timeout = g.timeout
    return _barrier(group, timeout, "monitored_barrier")


def _barrier(
    group: ProcessGroup | None, timeout: float | timedelta | None, name: str
) -> Work[None]:
    g = resolve_group(group)
    with Slot(g, name) as seq:
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise ArgumentError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if g is None or outside(g):
            return Work.completed(None)
        if timeout is None:
            return _barrier_now(g, seq, name)
    seconds = timeout

    async def run(seq: int) -> None:
        await meet(g, seq, seconds, name)

    return g.start(name, run, seq=seq)


def _barrier_now(g: ProcessGroup, seq: int, name: str) -> Work[None]:
    """A barrier with no timeout of its own: an ``exchange_all`` of no bytes, with no task.

    From 4 ranks on, that is the dissemination barrier (``log2 size`` rounds of
    one message each way). The group's timeout still applies.
    """
    _, work, seq = g.begin(name, seq=seq)
    if work.is_completed():
        return work  # a member aborted this call: send and post nothing

    def done(_: memoryview) -> None:
        work._set_result(None)

    exchange_all(g, work, seq, signature("barrier"), memoryview(b""), done)
    return work


async def meet(g: ProcessGroup, seq: int, timeout: float | None, name: str) -> None:
    """The barrier itself, as ``g``'s operation ``seq``: every rank arrives, or ``timeout``."""
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
            raise BarrierTimeoutError(
                f"{name} on group {g.name!r} timed out after {seconds:g} s: ranks {missing} "
                f"never arrived (rank {g.ranks[me]} waited); the group is broken. Check "
                f"that every rank calls {name}, and why those ranks are late.",
                ranks=missing,
            ) from None

    p, me = g.world_size, g.rank
    if timeout is not None or p <= schedules.DIRECT_MAX_RANKS:
        await direct(seq, timeout)
        return
    for k, (to, frm) in enumerate(schedules.dissemination_partners(me, p)):
        future = recv_tensor(g, frm, seq, k)
        await send(g, to, seq, k, mine, None)
        check_signature(g, mine, await future)
