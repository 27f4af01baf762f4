"""Rooted data movement on aiodist's data plane: broadcast, gather, scatter.

Each public function validates its arguments, then starts the operation with
``ProcessGroup.start`` and returns its ``Work``. The plans come from
``schedules``; this module only moves bytes. Every message carries the
sender's signature, and a dissemination check of the signature runs beside
the data, because ranks that disagree on the root may never message each
other: they get ``CollectiveMismatchError`` instead of a hang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from aiodist._errors import ArgumentError, ArgumentTypeError
from aiodist._group.group import ProcessGroup
from aiodist._group.work import Work
from aiodist._ops import schedules, shared, staging
from aiodist._ops.agreement import Signature, signature
from aiodist._ops.common import (
    LazyModule,
    Slot,
    bridged,
    chain,
    check_tensor,
    check_tensor_list,
    contiguous,
    copy_into,
    outside,
    resolve_group,
    root_of,
)
from aiodist._ops.exchange import Exchange
from aiodist._wire.codec import byte_view

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

__all__ = ["broadcast", "gather", "scatter"]


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
    if group_src is not None and src == 0:
        src = None  # torch: one of the two
    if (w := bridged(group, "broadcast", tensor, src, group_src)) is not None:
        return w
    g = resolve_group(group)
    with Slot(g, "broadcast") as seq:
        t = check_tensor(tensor, "tensor")
        if outside(g):
            return Work.completed(t)
        root = root_of(g, src, group_src, "src")
        if g is None:
            return Work.completed(t)
    if staging.on_device(t):
        description = f"broadcast(src={g.global_rank(root)})"
        return staging.in_place(
            g, seq, description, t, lambda host: _start_broadcast(g, seq, host, root, shm=False)
        )
    return _start_broadcast(g, seq, t, root)


def _start_broadcast(
    g: ProcessGroup, seq: int, t: torch.Tensor, root: int, *, shm: bool = True
) -> Work[torch.Tensor]:
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
    work: Work[torch.Tensor] = g.begin(f"broadcast(src={g.global_rank(root)})", seq=seq)

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
    if isinstance(gather_list, int) and not isinstance(gather_list, bool):
        # mmengine's form, gather(data, dst, group): shift the arguments by one.
        if isinstance(dst, ProcessGroup):
            group = dst
        gather_list, dst = None, gather_list
    if isinstance(dst, ProcessGroup):
        raise ArgumentTypeError("dst must be an int rank, got a ProcessGroup")
    if group_dst is not None and dst == 0:
        dst = None
    if (w := bridged(group, "gather", tensor, dst, group_dst)) is not None:
        outs_given = cast("list[torch.Tensor] | None", gather_list)
        return w if outs_given is None else chain(w, lambda r: _fill(outs_given, r))
    g = resolve_group(group)
    with Slot(g, "gather") as seq:
        t = check_tensor(tensor, "tensor")
        if outside(g):
            return Work.completed([])
        root = root_of(g, dst, group_dst, "dst")
        me = 0 if g is None else g.rank
        outs = None
        if gather_list is not None and me == root:
            outs = check_tensor_list(gather_list, "gather_list", 1 if g is None else g.world_size)
            for i, x in enumerate(outs):
                if x.dtype != t.dtype:
                    raise ArgumentError(f"gather_list[{i}] is {x.dtype}, but tensor is {t.dtype}")
                if x.shape != t.shape:
                    raise ArgumentError(
                        f"gather_list[{i}] has shape {list(x.shape)}, tensor {list(t.shape)}"
                    )
        elif gather_list:
            raise ArgumentError(
                "Argument ``gather_list`` must NOT be specified on non-destination ranks."
            )
        if g is None:
            if outs is None:
                return Work.completed([t])
            outs[0].copy_(t)
            return Work.completed(outs)
    if staging.on_device(t):

        def finish(hosts: list[torch.Tensor], result: list[torch.Tensor]) -> Any:
            if not result:
                return [], []
            if outs is not None:
                return list(zip(outs, result, strict=True)), outs
            return staging.new_on_device(result, t)

        return staging.staged(
            g,
            seq,
            f"gather(dst={g.global_rank(root)})",
            [t],
            lambda hosts: _start_gather(g, seq, hosts[0], root, None),
            finish,
        )
    return _start_gather(g, seq, t, root, outs)


def _fill(outs: list[torch.Tensor], got: list[torch.Tensor]) -> list[torch.Tensor]:
    for o, x in zip(outs, got, strict=False):
        if o is not x:
            o.copy_(x)
    return outs if got else got


def _start_gather(
    g: ProcessGroup, seq: int, t: torch.Tensor, root: int, outs: list[torch.Tensor] | None
) -> Work[list[torch.Tensor]]:
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
        return out if outs is None else _fill(outs, out)

    work: Work[list[torch.Tensor]] = g.begin(f"gather(dst={g.global_rank(root)})", seq=seq)
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
        src: Global rank that scatters (torch's convention).
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.
        group_src: ``src`` as a rank of ``group``.

    Returns:
        Work resolving to ``tensor``; when not initialised, ``tensor`` holding
        ``scatter_list[0]``.

    Raises:
        TypeError: ``tensor`` or an entry of ``scatter_list`` is not a tensor.
        ValueError: Neither ``src`` nor ``group_src``; ``src`` not a member of ``group``;
            ``scatter_list`` missing on ``src`` or given elsewhere, or of the wrong
            length, dtype or shape.
        CollectiveMismatchError: Ranks passed another dtype, shape or ``src``.

    Cancellation:
        Cancelling the awaiting task does not cancel the scatter.

    Example:
        >>> await aiodist.scatter(part, [a, b], src=0)
    """
    if (w := bridged(group, "scatter", tensor, scatter_list, src, group_src)) is not None:
        return w
    g = resolve_group(group)
    with Slot(g, "scatter") as seq:
        t = check_tensor(tensor, "tensor")
        if outside(g):
            return Work.completed(t)
        root = root_of(g, src, group_src, "src")
        parts: list[torch.Tensor] = []
        if (0 if g is None else g.rank) == root:
            if not scatter_list:
                raise ArgumentError("Argument ``scatter_list`` must be specified on source rank.")
            parts = check_tensor_list(
                scatter_list, "scatter_list", 1 if g is None else g.world_size
            )
            for i, part in enumerate(parts):
                if part.dtype != t.dtype or part.shape != t.shape:
                    raise ArgumentError(
                        f"scatter_list[{i}] is {part.dtype} {list(part.shape)}, but tensor is "
                        f"{t.dtype} {list(t.shape)}"
                    )
        elif scatter_list:
            raise ArgumentError(
                "Argument ``scatter_list`` must NOT be specified on non-source ranks."
            )
        if g is None:
            t.copy_(parts[0])
            return Work.completed(t)
    description = f"scatter(src={g.global_rank(root)})"
    if staging.on_device(t):
        return staging.staged(
            g,
            seq,
            description,
            [t, *parts],
            lambda hosts: _start_scatter(g, seq, hosts[0], hosts[1:], root),
            lambda hosts, _r: ([(t, hosts[0])], t),
        )
    return _start_scatter(g, seq, t, parts, root)


def _start_scatter(
    g: ProcessGroup, seq: int, t: torch.Tensor, parts: list[torch.Tensor], root: int
) -> Work[torch.Tensor]:
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

    work: Work[torch.Tensor] = g.begin(f"scatter(src={g.global_rank(root)})", seq=seq)
    return g.drive(work, direct, seq)
