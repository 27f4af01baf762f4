"""Each tensor collective as torch.distributed calls, for the torch bridge.

Every function checks its arguments as the data-plane version does (same
errors, before anything is issued), then hands the bridge an ``issue`` (the
torch call, ``async_op=True``) and a ``finish`` (the value the ``Work``
resolves to), keeping aiodist's semantics: ``all_reduce`` works in place and
resolves to its input, ``gather`` resolves to ``[]`` off the root, ``all_to_all``
accepts shapes that differ from pair to pair.

gloo's ``reduce_scatter`` work has no future, so on gloo it is an
``all_to_all_single`` followed by a local reduction in rank order (what the
data plane does too).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiodist._errors import ArgumentError, ArgumentTypeError
from aiodist._ops import reduce_ops
from aiodist._ops.common import LazyModule, check_alike, divide_, root_of
from aiodist._ops.objects import all_gather_object

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.distributed as dist

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work

else:  # the bridge imports this module: ``import aiodist`` stays torch-free
    torch = LazyModule("torch")
    dist = LazyModule("torch.distributed")

__all__ = ["Issuer", "start"]

T = TypeVar("T")


class Issuer(Protocol):
    """What the torch calls need of their group's bridge (``bridge.GroupBridge``)."""

    devices: dict[str, str]
    torch_group: Any

    def crosses(self, tensor: object) -> bool: ...

    def start(
        self,
        description: str,
        issue: Callable[[], Any],
        finish: Callable[[], T],
        stream_of: torch.Tensor,
    ) -> Work[T]: ...


_TORCH_OPS = {
    "sum": "SUM",
    "product": "PRODUCT",
    "min": "MIN",
    "max": "MAX",
    "band": "BAND",
    "bor": "BOR",
    "bxor": "BXOR",
}


def start(g: ProcessGroup, bridge: Issuer, name: str, args: tuple[Any, ...]) -> Work[Any]:
    """Start collective ``name`` with ``args`` (the collective's arguments but ``group``)."""
    return _STARTERS[name](g, bridge, *args)


def _tensor(t: object, name: str, bridge: Issuer) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not bridge.crosses(t):
        raise ArgumentError(
            f"{name} is on {t.device}, but the other tensors of this collective are on "
            f"{', '.join(bridge.devices)}; put them on one device"
        )
    if t.layout != torch.strided:
        raise ArgumentError(f"{name} must be a dense (strided) tensor, got {t.layout}")
    return t


def _tensors(ts: object, name: str, bridge: Issuer, length: int | None) -> list[torch.Tensor]:
    if not isinstance(ts, list | tuple):
        raise ArgumentTypeError(f"{name} must be a list of tensors, got {type(ts).__name__}")
    out = [_tensor(t, f"{name}[{i}]", bridge) for i, t in enumerate(ts)]
    if length is not None and len(out) != length:
        raise ArgumentError(f"{name} must hold one tensor per rank ({length}), got {len(out)}")
    return out


def _torch_op(op: str) -> Any:
    return getattr(dist.ReduceOp, _TORCH_OPS[op])


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _copy_back(t: torch.Tensor, buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    def finish() -> torch.Tensor:
        if buf is not t:
            t.copy_(buf)
        return t

    return finish


def _all_reduce(g: ProcessGroup, bridge: Issuer, data: object, op: object) -> Work[Any]:
    t = _tensor(data, "tensor", bridge)
    reduce_op = reduce_ops.reduce_op(op)
    reduce_ops.check_op_dtype(reduce_op, t.dtype)
    buf = _dense(t)
    pg = bridge.torch_group
    # NCCL averages natively; gloo sums, and the mean is taken on its completion thread.
    native_mean = reduce_op == "mean" and buf.device.type == "cuda" and buf.dtype.is_floating_point
    torch_op = dist.ReduceOp.AVG if native_mean else _torch_op(reduce_op.replace("mean", "sum"))
    copy_back = _copy_back(t, buf)

    def finish() -> torch.Tensor:
        if reduce_op == "mean" and not native_mean:
            divide_(buf, g.world_size)
        return copy_back()

    return bridge.start(
        f"all_reduce(op={reduce_op})",
        lambda: dist.all_reduce(buf, op=torch_op, group=pg, async_op=True),
        finish,
        buf,
    )


def _reduce(
    g: ProcessGroup, bridge: Issuer, data: object, dst: object, op: object, group_dst: object
) -> Any:
    t = _tensor(data, "tensor", bridge)
    reduce_op = reduce_ops.reduce_op(op)
    reduce_ops.check_op_dtype(reduce_op, t.dtype)
    root = root_of(g, dst, group_dst, "dst")
    buf = _dense(t)
    pg = bridge.torch_group
    torch_op = _torch_op(reduce_op.replace("mean", "sum"))
    copy_back = _copy_back(t, buf)

    def finish() -> torch.Tensor:
        if g.rank == root:
            if reduce_op == "mean":
                divide_(buf, g.world_size)
            return copy_back()
        return t

    # torch may leave partial sums in a non-root's buffer; aiodist leaves it unchanged.
    scratch = buf if g.rank == root else buf.clone()

    def issue() -> Any:
        return dist.reduce(scratch, dst=g.global_rank(root), op=torch_op, group=pg, async_op=True)

    return bridge.start(f"reduce(dst={root}, op={reduce_op})", issue, finish, buf)


def _reduce_scatter(g: ProcessGroup, bridge: Issuer, inputs: object, op: object) -> Any:
    tensors = [_dense(x) for x in _tensors(inputs, "inputs", bridge, g.world_size)]
    reduce_op = reduce_ops.reduce_op(op)
    check_alike(tensors, "inputs")
    first = tensors[0]
    reduce_ops.check_op_dtype(reduce_op, first.dtype)
    pg, p = bridge.torch_group, g.world_size
    description = f"reduce_scatter(op={reduce_op})"
    if first.device.type == "cuda":
        out = torch.empty_like(first, memory_format=torch.contiguous_format)
        native_mean = reduce_op == "mean" and first.dtype.is_floating_point
        torch_op = dist.ReduceOp.AVG if native_mean else _torch_op(reduce_op.replace("mean", "sum"))

        def finish_cuda() -> torch.Tensor:
            if reduce_op == "mean" and not native_mean:
                divide_(out, p)
            return out

        return bridge.start(
            description,
            lambda: dist.reduce_scatter(out, tensors, op=torch_op, group=pg, async_op=True),
            finish_cuda,
            out,
        )
    sent = torch.cat([x.reshape(-1) for x in tensors])
    got = torch.empty_like(sent)

    def finish() -> torch.Tensor:
        parts = got.view(p, -1)
        out = parts[0].clone()
        for r in range(1, p):
            reduce_ops.combine(reduce_op, out, out, parts[r])
        if reduce_op == "mean":
            divide_(out, p)
        return out.view(first.shape)

    return bridge.start(
        description,
        lambda: dist.all_to_all_single(got, sent, group=pg, async_op=True),
        finish,
        sent,
    )


def _broadcast(
    g: ProcessGroup, bridge: Issuer, data: object, src: object, group_src: object
) -> Any:
    t = _tensor(data, "tensor", bridge)
    root = root_of(g, src, group_src, "src")
    buf = _dense(t)
    pg = bridge.torch_group
    return bridge.start(
        f"broadcast(src={root})",
        lambda: dist.broadcast(buf, src=g.global_rank(root), group=pg, async_op=True),
        _copy_back(t, buf),
        buf,
    )


def _gather(g: ProcessGroup, bridge: Issuer, data: object, dst: object, group_dst: object) -> Any:
    t = _tensor(data, "tensor", bridge)
    root = root_of(g, dst, group_dst, "dst")
    buf = _dense(t)
    pg = bridge.torch_group
    out = (
        [torch.empty_like(buf, memory_format=torch.contiguous_format) for _ in g.ranks]
        if g.rank == root
        else None
    )

    def issue() -> Any:
        return dist.gather(buf, out, dst=g.global_rank(root), group=pg, async_op=True)

    return bridge.start(f"gather(dst={root})", issue, lambda: out or [], buf)


def _scatter(
    g: ProcessGroup,
    bridge: Issuer,
    data: object,
    scatter_list: object,
    src: object,
    group_src: object,
) -> Any:
    t = _tensor(data, "tensor", bridge)
    root = root_of(g, src, group_src, "src")
    parts: list[torch.Tensor] | None = None
    if g.rank == root:
        if not scatter_list:
            raise ArgumentError("Argument ``scatter_list`` must be specified on source rank.")
        parts = [_dense(x) for x in _tensors(scatter_list, "scatter_list", bridge, g.world_size)]
        for i, part in enumerate(parts):
            if part.dtype != t.dtype or part.shape != t.shape:
                raise ArgumentError(
                    f"scatter_list[{i}] is {part.dtype} {list(part.shape)}, but data is "
                    f"{t.dtype} {list(t.shape)}"
                )
    buf = _dense(t)
    pg = bridge.torch_group

    def issue() -> Any:
        return dist.scatter(buf, parts, src=g.global_rank(root), group=pg, async_op=True)

    return bridge.start(f"scatter(src={root})", issue, _copy_back(t, buf), buf)


def _all_gather(g: ProcessGroup, bridge: Issuer, data: object) -> Any:
    t = _dense(_tensor(data, "data", bridge))
    pg = bridge.torch_group
    out = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in g.ranks]
    return bridge.start(
        "all_gather", lambda: dist.all_gather(out, t, group=pg, async_op=True), lambda: out, t
    )


def _all_to_all(g: ProcessGroup, bridge: Issuer, inputs: object) -> Any:
    tensors = _tensors(inputs, "inputs", bridge, g.world_size)
    dtypes = {x.dtype for x in tensors}
    if len(dtypes) > 1:
        raise ArgumentError(f"inputs must share one dtype, got {sorted(map(str, dtypes))}")
    pg = bridge.torch_group
    # Shapes may differ from pair to pair: agree on them first (on the data plane, taking
    # the group's sequence number now), then exchange one flat buffer with split sizes.
    shapes = all_gather_object([list(x.shape) for x in tensors], group=g)
    sent = torch.cat([x.reshape(-1) for x in tensors])
    me = g.rank
    state: dict[str, Any] = {}

    def issue() -> Any:
        table = shapes.wait(g.timeout)  # in the group's thread: later issues wait behind it
        incoming = [table[r][me] for r in range(g.world_size)]
        sizes = [math.prod(shape) for shape in incoming]
        got = torch.empty(sum(sizes), dtype=sent.dtype, device=sent.device)
        state.update(got=got, sizes=sizes, incoming=incoming)
        in_sizes = [x.numel() for x in tensors]
        return dist.all_to_all_single(got, sent, sizes, in_sizes, group=pg, async_op=True)

    def finish() -> list[torch.Tensor]:
        pieces = state["got"].split(state["sizes"])
        return [p.view(shape) for p, shape in zip(pieces, state["incoming"], strict=True)]

    return bridge.start("all_to_all", issue, finish, sent)


_STARTERS: dict[str, Callable[..., Work[Any]]] = {
    "all_reduce": _all_reduce,
    "reduce": _reduce,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "gather": _gather,
    "scatter": _scatter,
    "all_gather": _all_gather,
    "all_to_all": _all_to_all,
}
