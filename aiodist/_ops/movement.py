"""Data movement between all ranks on aiodist's data plane: all_gather, all_to_all, barrier.

Each public function hands its arguments (``forms``) to ``run``, which sets the
call up and starts its algorithm here on a checked ``Request``: the torch-form
variants (``all_gather_into_tensor``, ``all_to_all_single``,
``all_gather_coalesced``) are the same algorithms with other outputs. The
plans (ring, dissemination) come from ``schedules``; this module only moves
bytes. Every message carries the sender's signature, so ranks that disagree
get ``CollectiveMismatchError``. The rooted operations live in ``rooted.py``.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import TYPE_CHECKING

from aiodist._errors import BarrierTimeoutError
from aiodist._ops import forms, schedules, shared
from aiodist._ops.agreement import OPEN, Signature, signature
from aiodist._ops.exchange import Exchange, exchange_rows
from aiodist._ops.outputs import new_outputs
from aiodist._ops.run import run
from aiodist._ops.tensors import LazyModule, contiguous, copy_into
from aiodist._wire.codec import byte_view

if TYPE_CHECKING:
    from datetime import timedelta

    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._ops.requests import Request
else:
    torch = LazyModule("torch")


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
    return run(forms.all_gather(tensor_list, tensor, group), start_all_gather)


def start_all_gather(g: ProcessGroup, seq: int, req: Request) -> Work[list[torch.Tensor]]:
    """``all_gather`` of ``req.tensor`` as ``g``'s operation ``seq``.

    Every rank's part lands in ``req.outputs`` where they are contiguous (else
    in new tensors that ``Request.deliver`` copies over).
    """
    t, outs, shm = req.tensor, req.outputs, req.shm
    assert t is not None
    nbytes = t.numel() * t.element_size() * g.world_size
    use_shm = shm and g.world_size > 1 and nbytes >= schedules.SHM_MIN_BYTES and shared.usable(g)
    turn = shared.take_turn(g) if use_shm else None  # taken now: call order
    direct = outs is not None and all(o.is_contiguous() for o in outs)
    work: Work[list[torch.Tensor]] = g.begin(req.description, seq=seq)

    def mine(algorithm: str) -> Signature:
        return signature("all_gather", t, algorithm=algorithm)

    async def run(seq: int) -> list[torch.Tensor]:
        out = outs if direct and outs is not None else new_outputs(g, t, g.world_size, "all_gather")
        if turn is not None:
            async with turn:
                if await shared.agreed(g):  # else some rank has it off: all take the ring
                    async with Exchange(g, work, seq, mine("shared_memory"), rides=True) as ex:
                        await shared.all_gather(ex, contiguous(t), out)
                    return out
        async with Exchange(g, work, seq, mine("ring"), rides=True) as ex:
            await _ring_all_gather(ex, t, out)
        return out

    return g.drive(work, run, seq, on_end=None if turn is None else turn.release)


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
    return run(forms.all_gather_into_tensor(output_tensor, input_tensor, group), start_all_gather)


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
    return run(
        forms.all_gather_coalesced(output_tensor_lists, input_tensor_list, group),
        start_all_gather,
    )


async def _ring_all_gather(ex: Exchange, t: torch.Tensor, out: list[torch.Tensor]) -> None:
    """Pass every rank's part to the left round the ring: ``r`` sends to ``r - 1``.

    Every receive lands in its own output tensor, so all are posted up front,
    and the rank that sends to this one (``r + 1``) waits for its "clear to
    send" (the opening: step ``OPEN`` to ``r + 1``) before it sends: no part
    arrives unexpected (a rank still in the previous operation would buffer
    and copy it).
    """
    g = ex.g
    p, me = g.world_size, g.rank
    copy_into(out[me], t)
    if p == 1:
        return
    to, frm = (me - 1) % p, (me + 1) % p
    # At step s (from 1), rank r passes on rank r + s - 1's part and gets rank r + s's.
    futures = [ex.recv(frm, s, byte_view(out[(me + s) % p])) for s in range(1, p)]
    ready = ex.recv(to, OPEN)
    await ex.send(frm, OPEN, None)
    await ready
    for s in range(1, p):
        await ex.send(to, s, byte_view(out[(me + s - 1) % p]))
        await futures[s - 1]


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
    return run(forms.all_to_all(output_tensor_list, input_tensor_list, group), start_all_to_all)


def start_all_to_all(g: ProcessGroup, seq: int, req: Request) -> Work[list[torch.Tensor]]:
    """``all_to_all`` of ``req.inputs`` as ``g``'s operation ``seq``; new outputs.

    Every pair exchanges one message at step ``OPEN`` (the opening rides on the
    one to ``r + 1``); the dtype is in the signature, each part's shape rides
    after it.
    """
    tensors = req.inputs
    dtype = tensors[0].dtype
    mine = signature("all_to_all", tensors[0])
    mine[2] = None  # shapes may differ from pair to pair: each message says its own

    async def run(seq: int) -> list[torch.Tensor]:
        p, me = g.world_size, g.rank
        out = [tensors[me].clone() if r == me else tensors[me] for r in range(p)]
        async with Exchange(g, work, seq, mine, rides=True) as ex:
            futures = {r: ex.recv(r, OPEN) for r in range(p) if r != me}
            for k in range(1, p):
                r = (me + k) % p
                x = contiguous(tensors[r])
                await ex.send(r, OPEN, byte_view(x), extra=list(x.shape))
            for r, future in futures.items():
                msg = await future
                received = torch.empty(msg.meta[-1], dtype=dtype)
                byte_view(received)[:] = msg.data
                out[r] = received
        return out

    work: Work[list[torch.Tensor]] = g.begin(req.description, seq=seq)
    return g.drive(work, run, seq)


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
    return run(
        forms.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group),
        start_all_to_all,
    )


def barrier(
    group: ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
    timeout: float | timedelta | None = None,
) -> Work[None]:
    """Wait until every rank of ``group`` reached this barrier (on the data plane).

    An ``exchange_rows`` of no bytes: 2 ranks tell each other; from 3 to 16,
    every rank tells group rank 0, which tells every rank once all came;
    beyond, the dissemination barrier (``log2 size`` rounds). With
    ``timeout``, every rank hears from every other one instead (one round),
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
    return run(forms.barrier("barrier", group, timeout), _start_barrier)


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
    return run(forms.barrier("monitored_barrier", group, timeout, monitored=True), _start_barrier)


def _start_barrier(g: ProcessGroup, seq: int, req: Request) -> Work[None]:
    name, seconds = req.description, req.timeout
    if seconds is None:
        return _barrier_now(g, seq, name)
    work: Work[None] = g.begin(name, seq=seq)

    async def run(seq: int) -> None:
        async with Exchange(g, work, seq, signature("barrier"), rides=True) as ex:
            await meet(ex, seconds, name)

    return g.drive(work, run, seq)


def _barrier_now(g: ProcessGroup, seq: int, name: str) -> Work[None]:
    """A barrier with no timeout of its own: an ``exchange_rows`` of no bytes, with no task.

    Its messages are ``exchange_rows``' (through group rank 0 from 3 ranks to 16,
    dissemination beyond). The group's timeout still applies.
    """
    work: Work[None] = g.begin(name, seq=seq)
    if not work.is_completed():  # else a member aborted this call: send and post nothing
        ex = Exchange(g, work, seq, signature("barrier"), rides=True)
        exchange_rows(ex, memoryview(b""), lambda _: _settle(work))
    return work


def _settle(work: Work[None]) -> None:
    work.set_result(None)


async def meet(ex: Exchange, timeout: float | None, name: str) -> None:
    """The barrier itself, on ``ex``: every rank arrives, or ``timeout``.

    Its first round opens the exchange (``ex`` rides on it). With no timeout, it is
    the barrier's one algorithm: an ``exchange_rows`` of no bytes.
    """
    g = ex.g
    p, me = g.world_size, g.rank
    if timeout is None:
        arrived: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        exchange_rows(ex, memoryview(b""), lambda _: arrived.set_result(None))
        await arrived
        return
    # One round: everyone tells everyone, so a rank that gives up knows who is late.
    peers = [r for r in range(p) if r != me]
    futures = [ex.recv(r, OPEN) for r in peers]
    deadline = asyncio.timeout(timeout)
    try:
        async with deadline:
            for r in schedules.direct_peers(me, p):
                await ex.send(r, OPEN, None)
            for future in futures:
                await asyncio.shield(future)
    except TimeoutError:
        if not deadline.expired():  # not ours: e.g. a peer's timeout, as a notice
            raise
        assert timeout is not None  # only a deadline expires
        missing = [g.ranks[r] for r, f in zip(peers, futures, strict=True) if not f.done()]
        # torch's words lead ("Rank 1 failed to pass monitoredBarrier in 300 ms", "Rank 0
        # timed out in monitoredBarrier", "Timed out"), so that code and tests written
        # against torch's message still match.
        ms = f"{timeout * 1000:.0f} ms"
        torch_words = (
            "; ".join(f"Rank {r} failed to pass monitoredBarrier in {ms}" for r in missing)
            + f" (Rank {g.ranks[me]} timed out in monitoredBarrier after {ms})"
            if name == "monitored_barrier"
            else "Timed out"
        )
        raise BarrierTimeoutError(
            f"{torch_words}: {name} on group {g.name!r} timed out after {timeout:g} s: ranks "
            f"{missing} never arrived (rank {g.ranks[me]} waited); the group is broken. Check "
            f"that every rank calls {name}, and why those ranks are late.",
            ranks=missing,
        ) from None
