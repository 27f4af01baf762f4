"""Rooted data movement on aiodist's data plane: broadcast, gather, scatter.

Each public function validates its arguments, then starts the operation with
``ProcessGroup.start`` and returns its ``Work``. The plans come from
``schedules``; this module only moves bytes. Every message carries the
sender's signature, and a dissemination check of the signature runs beside
the data, because ranks that disagree on the root may never message each
other: they get ``CollectiveMismatchError`` instead of a hang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiodist._group.work import Work
from aiodist._ops import schedules, shared
from aiodist._ops.common import (
    LazyModule,
    Slot,
    agreed,
    bridged,
    byte_view,
    check_rank,
    check_signature,
    check_tensor,
    check_tensor_list,
    contiguous,
    copy_into,
    recv_tensor,
    resolve_group,
    send,
    signature,
)

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

if TYPE_CHECKING:
    from aiodist._group.group import ProcessGroup

__all__ = ["broadcast", "gather", "scatter"]


def broadcast(
    data: torch.Tensor, src: int = 0, group: ProcessGroup | None = None
) -> Work[torch.Tensor]:
    """Copy ``data`` from rank ``src`` into ``data`` on every rank.

    A binomial tree of messages; from 1 MiB, in a group whose ranks share one
    host, every rank copies straight from ``src``'s shared-memory segment.

    Args:
        data: A CPU tensor: the value on ``src``, overwritten elsewhere.
        src: Global rank whose tensor is sent (torch's convention).
        group: Defaults to the world group.

    Returns:
        Work resolving to ``data``; ``data`` unchanged when not initialised.

    Raises:
        TypeError: ``data`` is not a tensor.
        ValueError: ``src`` is not a member of ``group``.
        CollectiveMismatchError: Ranks passed another dtype, shape or ``src``.

    Cancellation:
        Cancelling the awaiting task does not cancel the broadcast.

    Example:
        >>> await aiodist.broadcast(weights, src=0)
    """
    if (w := bridged(group, "broadcast", data, src)) is not None:
        return w
    g = resolve_group(group)
    with Slot(g, "broadcast") as seq:
        t = check_tensor(data, "data")
        if g is None:
            return Work.completed(t)
        root = check_rank(g, src, "src")
    mine = signature("broadcast", t, root=root)

    async def tree(seq: int) -> torch.Tensor:
        links = schedules.binomial_tree(g.rank, g.world_size, root)
        buf = contiguous(t)
        if links.parent is not None:
            check_signature(g, mine, await recv_tensor(g, links.parent, seq, 0, buf))
        for child in links.children:
            await send(g, child, seq, 0, mine, byte_view(buf))
        if buf is not t:
            copy_into(t, buf)
        return t

    async def through_shared_memory(seq: int) -> torch.Tensor:
        buf = contiguous(t)
        await shared.shared_memory_broadcast(g, seq, buf, root, mine)
        if buf is not t:
            copy_into(t, buf)
        return t

    nbytes = t.numel() * t.element_size()
    use_shm = g.world_size > 1 and nbytes >= schedules.SHM_MIN_BYTES and shared.usable(g)
    turn = shared.take_turn(g) if use_shm else None  # taken now: call order

    async def run(seq: int) -> torch.Tensor:
        if turn is not None:
            async with turn:
                if await shared.agreed(g):  # else some rank has it off: all take the tree
                    return await agreed(g, seq, mine, through_shared_memory(seq))
        return await agreed(g, seq, mine, tree(seq))

    return g.start(
        f"broadcast(src={root})", run, seq=seq, on_end=None if turn is None else turn.release
    )


def gather(
    data: torch.Tensor, dst: int = 0, group: ProcessGroup | None = None
) -> Work[list[torch.Tensor]]:
    """Collect ``data`` from every rank on rank ``dst``, in rank order.

    Args:
        data: A CPU tensor; every rank passes the same dtype and shape.
        dst: Global rank that receives the tensors (torch's convention).
        group: Defaults to the world group.

    Returns:
        Work resolving to one tensor per rank on ``dst``, ``[]`` elsewhere;
        ``[data]`` when not initialised.

    Raises:
        TypeError: ``data`` is not a tensor.
        ValueError: ``dst`` is not a member of ``group``.
        CollectiveMismatchError: Ranks passed another dtype, shape or ``dst``.

    Cancellation:
        Cancelling the awaiting task does not cancel the gather.

    Example:
        >>> parts = await aiodist.gather(t, dst=0)
    """
    if (w := bridged(group, "gather", data, dst)) is not None:
        return w
    g = resolve_group(group)
    with Slot(g, "gather") as seq:
        t = check_tensor(data, "data")
        if g is None:
            return Work.completed([t])
        root = check_rank(g, dst, "dst")
    mine = signature("gather", t, root=root)

    async def direct(seq: int) -> list[torch.Tensor]:
        if g.rank != root:
            await send(g, root, seq, 0, mine, byte_view(contiguous(t)))
            return []
        out = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in g.ranks]
        futures = {r: recv_tensor(g, r, seq, 0, out[r]) for r in range(g.world_size) if r != root}
        copy_into(out[root], t)
        for future in futures.values():
            check_signature(g, mine, await future)
        return out

    async def run(seq: int) -> list[torch.Tensor]:
        return await agreed(g, seq, mine, direct(seq))

    return g.start(f"gather(dst={root})", run, seq=seq)


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
        src: Global rank that scatters (torch's convention).
        group: Defaults to the world group.

    Returns:
        Work resolving to ``data``; when not initialised, ``data`` holding
        ``scatter_list[0]`` (or unchanged without a list).

    Raises:
        TypeError: ``data`` or an entry of ``scatter_list`` is not a tensor.
        ValueError: ``src`` not a member of ``group``, ``scatter_list`` missing on ``src``,
            or of the wrong length, dtype or shape.
        CollectiveMismatchError: Ranks passed another dtype, shape or ``src``.

    Cancellation:
        Cancelling the awaiting task does not cancel the scatter.

    Example:
        >>> await aiodist.scatter(part, [a, b], src=0)
    """
    if (w := bridged(group, "scatter", data, scatter_list, src)) is not None:
        return w
    g = resolve_group(group)
    with Slot(g, "scatter") as seq:
        t = check_tensor(data, "data")
        if g is None:
            if scatter_list:
                t.copy_(check_tensor(scatter_list[0], "scatter_list[0]"))
            return Work.completed(t)
        root = check_rank(g, src, "src")
        parts: list[torch.Tensor] = []
        if g.rank == root:
            if scatter_list is None:
                raise ValueError(f"scatter_list is required on the source rank {root}")
            parts = check_tensor_list(scatter_list, "scatter_list", g.world_size)
            for i, part in enumerate(parts):
                if part.dtype != t.dtype or part.shape != t.shape:
                    raise ValueError(
                        f"scatter_list[{i}] is {part.dtype} {list(part.shape)}, but data is "
                        f"{t.dtype} {list(t.shape)}"
                    )
    mine = signature("scatter", t, root=root)

    async def direct(seq: int) -> torch.Tensor:
        if g.rank != root:
            buf = contiguous(t)
            check_signature(g, mine, await recv_tensor(g, root, seq, 0, buf))
            if buf is not t:
                copy_into(t, buf)
            return t
        for r, part in enumerate(parts):
            if r != root:
                await send(g, r, seq, 0, mine, byte_view(contiguous(part)))
        copy_into(t, parts[root])
        return t

    async def run(seq: int) -> torch.Tensor:
        return await agreed(g, seq, mine, direct(seq))

    return g.start(f"scatter(src={root})", run, seq=seq)
