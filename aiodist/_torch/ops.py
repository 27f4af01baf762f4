"""Each tensor collective as torch.distributed calls, for the torch bridge.

Every function takes the call's canonical ``Request`` (its arguments checked
by ``_ops.forms``, as for the data plane: same errors, before anything is
issued), checks that its tensors are on the bridge's device, then hands the
bridge an ``issue`` (the torch call, ``async_op=True``) and a ``finish`` (the
value the ``Work`` resolves to), keeping aiodist's semantics: ``all_reduce``
works in place and resolves to its input, ``gather`` resolves to ``[]`` off
the root, ``all_to_all`` accepts shapes that differ from pair to pair. The
request's ``deliver`` (``_ops.run``) fills torch's output lists from there.

gloo's ``reduce_scatter`` work has no future, so on gloo it is an
``all_to_all_single`` followed by a local reduction in rank order (what the
data plane does too).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiodist._errors import ArgumentError
from aiodist._ops import reduce_ops
from aiodist._ops.objects import start_all_gather_object
from aiodist._ops.requests import Op, Request
from aiodist._ops.tensors import LazyModule, divide_
from aiodist._wire import codec
from aiodist._wire.keys import sub_seq

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    import torch.distributed as dist

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work

else:  # the bridge imports this module: ``import aiodist`` stays torch-free
    torch = LazyModule("torch")
    dist = LazyModule("torch.distributed")

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
        seq: int,
    ) -> Work[T]: ...


def start(g: ProcessGroup, bridge: Issuer, req: Request, seq: int) -> Work[Any]:
    """Start ``req`` (checked: ``_ops.forms``; ``req.op.torch``) on torch.distributed as
    ``g``'s operation ``seq``."""
    return _STARTERS[req.op](g, bridge, req, seq)


def _on_bridge(t: torch.Tensor | None, name: str, bridge: Issuer) -> torch.Tensor:
    assert t is not None
    if not bridge.crosses(t):
        raise ArgumentError(
            f"{name} is on {t.device}, but the other tensors of this collective are on "
            f"{', '.join(bridge.devices)}; put them on one device"
        )
    return t


def _rooted(req: Request, bridge: Issuer) -> tuple[torch.Tensor, int, torch.Tensor, Any]:
    """A rooted call's tensor, root, its dense buffer and torch's group."""
    t = _on_bridge(req.tensor, "tensor", bridge)
    assert req.root is not None
    return t, req.root, _dense(t), bridge.torch_group


def options_op(opts: Any) -> Any:
    """The reduce op of torch's options (or a bare ``ReduceOp``, as some callers pass); sum if None.

    torch's options hold a ``ReduceOp`` instance; its ``op`` is the ``RedOpType``
    (``ReduceOp.SUM``) that aiodist's operations take.
    """
    if opts is None:
        return "sum"
    op = getattr(opts, "reduceOp", opts)
    return getattr(op, "op", op)


def _torch_op(op: str) -> Any:
    """torch's ``ReduceOp`` of a canonical reduce op (``_ops.reduce_ops.OPS``) but ``mean``."""
    return getattr(dist.ReduceOp, op.upper())


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` in one block (a sparse tensor as it is: gloo reduces it, in place)."""
    return t if t.is_sparse or t.is_contiguous() else t.contiguous()


def _copy_back(t: torch.Tensor, buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    def finish() -> torch.Tensor:
        if buf is not t:
            t.copy_(buf)
        return t

    return finish


def _all_reduce(g: ProcessGroup, bridge: Issuer, req: Request, seq: int) -> Work[Any]:
    t = _on_bridge(req.tensor, "tensor", bridge)
    reduce_op = req.reduce_op
    assert reduce_op is not None
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
        req.description,
        lambda: dist.all_reduce(buf, op=torch_op, group=pg, async_op=True),
        finish,
        buf,
        seq,
    )


def _reduce(g: ProcessGroup, bridge: Issuer, req: Request, seq: int) -> Work[Any]:
    t, root, buf, pg = _rooted(req, bridge)
    reduce_op = req.reduce_op
    assert reduce_op is not None
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

    return bridge.start(req.description, issue, finish, buf, seq)


def _reduce_scatter(g: ProcessGroup, bridge: Issuer, req: Request, seq: int) -> Work[Any]:
    tensors = [_dense(_on_bridge(x, f"inputs[{i}]", bridge)) for i, x in enumerate(req.inputs)]
    reduce_op = req.reduce_op
    assert reduce_op is not None
    first = tensors[0]
    pg, p = bridge.torch_group, g.world_size
    if first.device.type == "cuda":
        out = torch.empty_like(first, memory_format=torch.contiguous_format)
        native_mean = reduce_op == "mean" and first.dtype.is_floating_point
        torch_op = dist.ReduceOp.AVG if native_mean else _torch_op(reduce_op.replace("mean", "sum"))

        def finish_cuda() -> torch.Tensor:
            if reduce_op == "mean" and not native_mean:
                divide_(out, p)
            return out

        return bridge.start(
            req.description,
            lambda: dist.reduce_scatter(out, tensors, op=torch_op, group=pg, async_op=True),
            finish_cuda,
            out,
            seq,
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
        req.description,
        lambda: dist.all_to_all_single(got, sent, group=pg, async_op=True),
        finish,
        sent,
        seq,
    )


def _broadcast(g: ProcessGroup, bridge: Issuer, req: Request, seq: int) -> Work[Any]:
    t, root, buf, pg = _rooted(req, bridge)
    return bridge.start(
        req.description,
        lambda: dist.broadcast(buf, src=g.global_rank(root), group=pg, async_op=True),
        _copy_back(t, buf),
        buf,
        seq,
    )


def _gather(g: ProcessGroup, bridge: Issuer, req: Request, seq: int) -> Work[Any]:
    _, root, buf, pg = _rooted(req, bridge)
    out = (
        [torch.empty_like(buf, memory_format=torch.contiguous_format) for _ in g.ranks]
        if g.rank == root
        else None
    )

    def issue() -> Any:
        return dist.gather(buf, out, dst=g.global_rank(root), group=pg, async_op=True)

    return bridge.start(req.description, issue, lambda: out or [], buf, seq)


def _scatter(g: ProcessGroup, bridge: Issuer, req: Request, seq: int) -> Work[Any]:
    t, root, buf, pg = _rooted(req, bridge)
    parts = None
    if g.rank == root:
        parts = [
            _dense(_on_bridge(x, f"scatter_list[{i}]", bridge)) for i, x in enumerate(req.inputs)
        ]

    def issue() -> Any:
        return dist.scatter(buf, parts, src=g.global_rank(root), group=pg, async_op=True)

    return bridge.start(req.description, issue, _copy_back(t, buf), buf, seq)


def _all_gather(g: ProcessGroup, bridge: Issuer, req: Request, seq: int) -> Work[Any]:
    t = _dense(_on_bridge(req.tensor, "tensor", bridge))
    pg = bridge.torch_group
    out = [torch.empty_like(t, memory_format=torch.contiguous_format) for _ in g.ranks]
    return bridge.start(
        req.description,
        lambda: dist.all_gather(out, t, group=pg, async_op=True),
        lambda: out,
        t,
        seq,
    )


def _all_to_all(g: ProcessGroup, bridge: Issuer, req: Request, seq: int) -> Work[Any]:
    tensors = [_on_bridge(x, f"inputs[{i}]", bridge) for i, x in enumerate(req.inputs)]
    pg = bridge.torch_group
    # Shapes may differ from pair to pair: agree on them first (on the data plane, as a
    # part of this call), then exchange one flat buffer with split sizes.
    shapes = start_all_gather_object(
        g,
        sub_seq(seq, 0),
        Request(
            op=Op.ALL_GATHER_OBJECT,
            description="all_to_all.shapes",
            payload=codec.dumps([list(x.shape) for x in tensors]),
        ),
    )
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

    return bridge.start(req.description, issue, finish, sent, seq)


_STARTERS: dict[Op, Callable[[ProcessGroup, Issuer, Request, int], Work[Any]]] = {
    Op.ALL_REDUCE: _all_reduce,
    Op.REDUCE: _reduce,
    Op.REDUCE_SCATTER: _reduce_scatter,
    Op.BROADCAST: _broadcast,
    Op.GATHER: _gather,
    Op.SCATTER: _scatter,
    Op.ALL_GATHER: _all_gather,
    Op.ALL_TO_ALL: _all_to_all,
}
# Every operation declared ``torch`` (``_ops/requests.py``) has its start here, and no other.
_MISSING = {op for op in Op if op.torch} ^ _STARTERS.keys()
if _MISSING:  # pragma: no cover - caught by the import itself, in every test run
    raise ImportError(
        f"torch starts and Op.torch disagree on {sorted(op.label for op in _MISSING)}"
    )
