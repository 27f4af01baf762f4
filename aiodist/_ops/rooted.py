"""Rooted data movement on aiodist's data plane: broadcast, gather, scatter.

Each public function hands its arguments (``forms``) to ``run``, which sets the
call up and starts its algorithm here on a checked ``Request``. The plans come
from ``schedules``; this module only moves bytes. Data goes one way only, so
ranks that disagree on the root might never message each other: each
operation's exchange runs the agreement beside its data (``Exchange(...,
rides=False)``), and they get ``CollectiveMismatchError`` instead of a hang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiodist._ops import forms, schedules, shared
from aiodist._ops.agreement import Signature, signature
from aiodist._ops.exchange import Exchange
from aiodist._ops.run import run
from aiodist._ops.tensors import LazyModule, contiguous, copy_into
from aiodist._wire.codec import byte_view

if TYPE_CHECKING:
    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._ops.requests import Request
else:
    torch = LazyModule("torch")


def broadcast(
    tensor: torch.Tensor,
    src: int | None = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work[torch.Tensor]:
    """Copy ``tensor`` from rank ``src`` into ``tensor`` on every rank.

    A binomial tree of messages; from 1 MiB, in a group whose ranks share one
    host, every rank copies straight from ``src``'s shared-memory segment.

    Args:
        tensor: A dense tensor: the value on ``src``, overwritten elsewhere.
        src: Global rank whose tensor is sent (torch's convention); 0 by
            default, as in mmengine.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.
        group_src: ``src`` as a rank of ``group`` (pass ``src=None`` with it).

    Returns:
        Work resolving to ``tensor``; ``tensor`` unchanged when not initialised.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``src`` is not a member of ``group``.
        CollectiveMismatchError: Ranks passed another dtype, shape or ``src``.

    Cancellation:
        Cancelling the awaiting task does not cancel the broadcast.

    Example:
        >>> await aiodist.broadcast(weights, src=0)
    """
    return run(forms.broadcast(tensor, src, group, group_src), _start_broadcast)


def _start_broadcast(g: ProcessGroup, seq: int, req: Request) -> Work[torch.Tensor]:
    t, root, shm = req.tensor, req.root, req.shm
    assert t is not None
    assert root is not None

    def mine(algorithm: str) -> Signature:
        return signature("broadcast", t, root=root, algorithm=algorithm)

    async def tree(ex: Exchange) -> None:
        links = schedules.binomial_tree(g.rank, g.world_size, root)
        buf = contiguous(t)
        if links.parent is not None:
            await ex.recv(links.parent, 1, byte_view(buf))
        for child in links.children:
            await ex.send(child, 1, byte_view(buf))
        if buf is not t:
            copy_into(t, buf)

    async def through_shared_memory(ex: Exchange) -> None:
        buf = contiguous(t)
        await shared.broadcast(ex, buf, root)
        if buf is not t:
            copy_into(t, buf)

    nbytes = t.numel() * t.element_size()
    use_shm = shm and g.world_size > 1 and nbytes >= schedules.SHM_MIN_BYTES and shared.usable(g)
    turn = shared.take_turn(g) if use_shm else None  # taken now: call order
    work: Work[torch.Tensor] = g.begin(req.description, seq=seq)

    async def run(seq: int) -> torch.Tensor:
        if turn is not None:
            async with turn:
                if await shared.agreed(g):  # else some rank has it off: all take the tree
                    async with Exchange(g, work, seq, mine("shared_memory"), rides=False) as ex:
                        await through_shared_memory(ex)
                    return t
        async with Exchange(g, work, seq, mine("tree"), rides=False) as ex:
            await tree(ex)
        return t

    return g.drive(work, run, seq, on_end=None if turn is None else turn.release)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | int | None = None,
    dst: int | ProcessGroup | None = 0,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work[list[torch.Tensor]]:
    """Collect ``tensor`` from every rank on rank ``dst``, in rank order.

    Both forms work: torch.distributed's ``gather(tensor, gather_list, dst,
    group)``, which fills ``gather_list`` on ``dst``, and mmengine's
    ``gather(data, dst, group)`` (an int second), which returns a new list.

    Args:
        tensor: A dense tensor; every rank passes the same dtype and shape.
        gather_list: On ``dst``, one tensor per rank to fill (torch's form);
            None elsewhere, or to get new tensors.
        dst: Global rank that receives the tensors (torch's convention); 0 by default.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.
        group_dst: ``dst`` as a rank of ``group``.

    Returns:
        Work resolving to one tensor per rank on ``dst`` (``gather_list`` itself
        when given), ``[]`` elsewhere; ``[tensor]`` when not initialised.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``dst`` is not a member of ``group``; ``gather_list`` given off
            ``dst``, or of the wrong length, shape or dtype.
        CollectiveMismatchError: Ranks passed another dtype, shape or ``dst``.

    Cancellation:
        Cancelling the awaiting task does not cancel the gather.

    Example:
        >>> parts = await aiodist.gather(t, dst=0)
    """
    return run(forms.gather(tensor, gather_list, dst, group, group_dst), _start_gather)


def _start_gather(g: ProcessGroup, seq: int, req: Request) -> Work[list[torch.Tensor]]:
    """Every rank sends its tensor straight to the root, which writes them into its outputs."""
    t, root, outs = req.tensor, req.root, req.outputs
    assert t is not None
    assert root is not None
    mine = signature("gather", t, root=root)

    async def direct(seq: int) -> list[torch.Tensor]:
        async with Exchange(g, work, seq, mine, rides=False) as ex:
            if g.rank != root:
                await ex.send(root, 1, byte_view(contiguous(t)))
                return []
            out = (
                [
                    o
                    if o.is_contiguous()
                    else torch.empty_like(o, memory_format=torch.contiguous_format)
                    for o in outs
                ]
                if outs is not None
                else [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in g.ranks]
            )
            futures = [ex.recv(r, 1, byte_view(out[r])) for r in range(g.world_size) if r != root]
            copy_into(out[root], t)
            for future in futures:
                await future
        return out

    work: Work[list[torch.Tensor]] = g.begin(req.description, seq=seq)
    return g.drive(work, direct, seq)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work[torch.Tensor]:
    """Send ``scatter_list[i]`` from rank ``src`` into ``tensor`` on rank ``i``.

    Args:
        tensor: A dense tensor that receives this rank's part.
        scatter_list: On ``src``, one tensor per rank, each shaped like ``tensor``;
            None (or empty) elsewhere.
        src: Global rank that scatters (torch's convention); global rank 0 when
            neither ``src`` nor ``group_src`` is given, as torch's.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.
        group_src: ``src`` as a rank of ``group``.

    Returns:
        Work resolving to ``tensor``; when not initialised, ``tensor`` holding
        ``scatter_list[0]``.

    Raises:
        TypeError: ``tensor`` or an entry of ``scatter_list`` is not a tensor.
        ValueError: Both ``src`` and ``group_src``; ``src`` not a member of ``group``;
            ``scatter_list`` missing on ``src`` or given elsewhere, or of the wrong
            length, dtype or shape.
        CollectiveMismatchError: Ranks passed another dtype, shape or ``src``.

    Cancellation:
        Cancelling the awaiting task does not cancel the scatter.

    Example:
        >>> await aiodist.scatter(part, [a, b], src=0)
    """
    return run(forms.scatter(tensor, scatter_list, src, group, group_src), _start_scatter)


def _start_scatter(g: ProcessGroup, seq: int, req: Request) -> Work[torch.Tensor]:
    """The root sends each rank its part straight; every rank's lands in its tensor."""
    t, parts, root = req.tensor, req.inputs, req.root
    assert t is not None
    assert root is not None
    mine = signature("scatter", t, root=root)

    async def direct(seq: int) -> torch.Tensor:
        async with Exchange(g, work, seq, mine, rides=False) as ex:
            if g.rank != root:
                buf = contiguous(t)
                await ex.recv(root, 1, byte_view(buf))
                if buf is not t:
                    copy_into(t, buf)
                return t
            for r, part in enumerate(parts):
                if r != root:
                    await ex.send(r, 1, byte_view(contiguous(part)))
            copy_into(t, parts[root])
        return t

    work: Work[torch.Tensor] = g.begin(req.description, seq=seq)
    return g.drive(work, direct, seq)
