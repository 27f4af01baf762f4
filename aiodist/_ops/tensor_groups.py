"""mmengine's reductions of many tensors at once: a dict of them, or a model's parameters.

Both flatten the tensors into one buffer per dtype (or per bucket of
``bucket_size_mb``), start one in-place all-reduce per buffer when called, and
copy the results back.

How many buffers there are depends on each rank's tensors, so the buffers'
reductions are the *parts* of one call: the call takes one place in the
group's order, and part ``i`` runs as ``sub_seq(call, i)``. Every part's
signature carries a digest of what all ranks must agree on (keys, dtypes,
shapes, op, buckets): ranks that disagree get ``CollectiveMismatchError`` on
the first part, which every rank has, instead of numbering later calls apart.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from aiodist._errors import ArgumentTypeError, AssertedArgumentError
from aiodist._ops import reduce_ops, staging
from aiodist._ops.reductions import all_reduce, start_all_reduce
from aiodist._ops.requests import Call, Op, Request
from aiodist._ops.run import chain, run
from aiodist._ops.tensors import check_tensor
from aiodist._wire.keys import sub_seq

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._ops.reduce_ops import ReduceOp


def _check_reduce_op(op: object, tensors: Iterable[torch.Tensor]) -> str:
    """Validate ``op`` against every tensor now: a failure after some reductions
    started would leave ranks numbering their operations differently."""
    key = reduce_ops.reduce_op(op)
    for t in tensors:
        reduce_ops.check_op_dtype(key, t.dtype)
    return key


def _digest(name: str, *facts: object) -> str:
    """``name`` and a short digest of ``facts``: equal on ranks that agree on them."""
    return f"{name}:{hashlib.blake2b(repr(facts).encode(), digest_size=8).hexdigest()}"


def _check_flats(g: ProcessGroup, flats: list[torch.Tensor]) -> None:
    """Every buffer must go somewhere: aiodist's data plane (CPU) or the group's torch bridge."""
    for i, flat in enumerate(flats):
        if g.bridge is None or not g.bridge.crosses(flat):
            check_tensor(flat, f"tensors of buffer {i}")


def _parts(
    reduce_op: str, flats: list[torch.Tensor], label: str, copy_back: Callable[[None], Any]
) -> Request:
    """The request of a call that reduces ``flats`` in place, then copies them back."""
    name = label.partition(":")[0]
    return Request(
        op=Op.ALL_REDUCE_PARTS,
        description=name,
        reduce_op=reduce_op,
        data=(flats, label),
        resolve=copy_back,
    )


def _start_parts(g: ProcessGroup, call: int, req: Request) -> Work[None]:
    """Start one in-place all-reduce per flat tensor now, as parts of ``call``.

    Buffers on the torch bridge's device go to torch.distributed (which orders
    them itself); the others run on aiodist's data plane as ``sub_seq(call, i)``.
    The handle completes once every part did (``req.resolve`` copies back).
    """
    import torch

    flats, label = req.data
    if not flats:  # still one part: the signature every rank must check
        flats = [torch.empty(0)]
    reduces = [_start_part(flat, req, g, sub_seq(call, i), label) for i, flat in enumerate(flats)]

    async def wait_all(seq: int) -> None:
        for w in reduces:
            await w

    return g.start(req.description, wait_all, collective=False, seq=call)


def _start_part(
    flat: torch.Tensor, req: Request, g: ProcessGroup, part: int, label: str
) -> Work[Any]:
    if g.bridge is not None and g.bridge.crosses(flat):
        return all_reduce(flat, op=req.reduce_op or "sum", group=g)
    one = Request(op=Op.ALL_REDUCE, description="all_reduce", tensor=flat, reduce_op=req.reduce_op)
    if staging.on_device(flat):
        one.shm = False
        return staging.in_place(
            g, part, "all_reduce", flat, lambda host: _start_one(g, part, one, host, label)
        )
    return start_all_reduce(g, part, one, label=label)


def _start_one(
    g: ProcessGroup, part: int, one: Request, host: torch.Tensor, label: str
) -> Work[Any]:
    one.tensor = host
    return start_all_reduce(g, part, one, label=label)


def all_reduce_dict(
    data: dict[str, torch.Tensor], op: str | ReduceOp = "sum", group: ProcessGroup | None = None
) -> Work[dict[str, torch.Tensor]]:
    """Reduce every tensor of ``data`` across ranks, in place, with one all-reduce per dtype.

    As ``mmengine.dist.all_reduce_dict``: keys are sorted, tensors are
    flattened and concatenated (per dtype) into one buffer that is reduced,
    and the results are copied back into the tensors of ``data``. Every rank
    must pass the same keys with tensors of the same shapes and dtypes.

    Args:
        data: Tensors by name.
        op: ``"sum"``, ``"mean"`` (floating dtypes only), ``"product"``, ``"min"``,
            ``"max"``, or ``"band"``/``"bor"``/``"bxor"`` (integer and bool dtypes).
        group: Defaults to the world group.

    Returns:
        Work resolving to ``data`` once its tensors hold the reduced values;
        ``data`` unchanged when not initialised.

    Raises:
        AssertionError: ``data`` is not a dict (as mmengine asserts; also a ``TypeError``).
        TypeError: A value is not a tensor, or ``op`` does not suit a tensor's dtype.
        ValueError: ``op`` is unknown.
        CollectiveMismatchError: Ranks disagree on dtypes or sizes.
        RankFailedError: A member died first.

    Cancellation:
        Cancelling the awaiting task does not cancel the reduction; ``data`` is
        still updated when it completes. A timeout marks ``group`` broken.

    Example:
        >>> losses = {"loss": torch.tensor(0.5), "acc": torch.tensor(0.9)}
        >>> await aiodist.all_reduce_dict(losses, op="mean")
    """
    import torch

    def check(g: ProcessGroup | None) -> Request:
        if not isinstance(data, dict):  # mmengine asserts it
            raise AssertedArgumentError(f"data must be a dict, got {type(data).__name__}")
        for key, value in data.items():
            if not isinstance(value, torch.Tensor):
                raise ArgumentTypeError(
                    f"data[{key!r}] must be a torch.Tensor, got {type(value).__name__}"
                )
        reduce_op = _check_reduce_op(op, data.values())
        if g is None or g.world_size == 1 or g.rank < 0:
            return Request.done(data)
        keys = sorted(data)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for key in keys:
            by_dtype.setdefault(data[key].dtype, []).append(key)
        flats = {
            dtype: torch.cat([data[k].detach().reshape(-1) for k in ks])
            for dtype, ks in sorted(by_dtype.items(), key=lambda kv: str(kv[0]))
        }
        _check_flats(g, list(flats.values()))
        label = _digest(
            "all_reduce_dict",
            reduce_op,
            [(k, str(data[k].dtype), tuple(data[k].shape)) for k in keys],
        )

        def copy_back(_: None) -> dict[str, torch.Tensor]:
            for dtype, flat in flats.items():
                ks = by_dtype[dtype]
                parts = torch.split(flat, [data[k].numel() for k in ks])
                for k, part in zip(ks, parts, strict=True):
                    data[k].copy_(part.view(data[k].shape))
            return data

        return _parts(reduce_op, list(flats.values()), label, copy_back)

    return run(Call("all_reduce_dict", group, check, torch=True), _start_parts)


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Split ``tensors`` into same-type buckets of at most ``limit`` bytes (``_take_tensors``)."""
    done: list[list[torch.Tensor]] = []
    open_: dict[tuple[Any, ...], tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        kind = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        bucket, used = open_.get(kind, ([], 0))
        if limit > 0 and used > 0 and used + nbytes > limit:
            done.append(bucket)
            bucket, used = [], 0
        bucket.append(t)
        open_[kind] = (bucket, used + nbytes)
    done.extend(bucket for bucket, _ in open_.values() if bucket)
    return done


def all_reduce_params(
    params: Iterable[torch.Tensor],
    coalesce: bool = True,
    bucket_size_mb: int = -1,
    op: str | ReduceOp = "sum",
    group: ProcessGroup | None = None,
) -> Work[None]:
    """Reduce parameters (or any tensors) across ranks in place, as mmengine's helper.

    With ``coalesce``, tensors are flattened into buckets (one per dtype, or
    split every ``bucket_size_mb`` MiB when positive), each bucket is reduced
    with one all-reduce and copied back; otherwise each tensor is reduced alone.

    Args:
        params: Tensors or ``nn.Parameter``s; their ``.data`` is updated.
        coalesce: Reduce in buckets rather than one tensor at a time.
        bucket_size_mb: Bucket size in MiB; -1 for one bucket per dtype.
        op: ``"sum"``, ``"mean"`` (floating dtypes only), ``"product"``, ``"min"``,
            ``"max"``, or ``"band"``/``"bor"``/``"bxor"`` (integer and bool dtypes).
        group: Defaults to the world group.

    Returns:
        Work resolving to None once every tensor holds the reduced values.

    Raises:
        TypeError: An item of ``params`` is not a tensor, or ``op`` does not
            suit a tensor's dtype.
        ValueError: ``op`` is unknown.
        CollectiveMismatchError: Ranks disagree on dtypes or sizes.
        RankFailedError: A member died first.

    Cancellation:
        Cancelling the awaiting task does not cancel the reduction; the tensors
        are still updated when it completes. A timeout marks ``group`` broken.

    Example:
        >>> await aiodist.all_reduce_params(model.parameters(), op="mean")
    """
    import torch

    def check(g: ProcessGroup | None) -> Request:
        tensors: list[torch.Tensor] = []
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise ArgumentTypeError(f"params must hold tensors, got {type(p).__name__}")
            tensors.append(p.data)
        reduce_op = _check_reduce_op(op, tensors)
        if g is None or g.world_size == 1 or g.rank < 0:
            return Request.done(None)
        if not coalesce:
            buckets = [[t] for t in tensors]
        else:
            limit = bucket_size_mb * 1024 * 1024 if bucket_size_mb > 0 else -1
            buckets = _buckets(tensors, limit)
        flats = [torch.cat([t.reshape(-1) for t in bucket]) for bucket in buckets]
        _check_flats(g, flats)
        label = _digest(
            "all_reduce_params",
            reduce_op,
            [(str(f.dtype), f.numel(), len(b)) for f, b in zip(flats, buckets, strict=True)],
        )

        def copy_back(_: None) -> None:
            for bucket, flat in zip(buckets, flats, strict=True):
                parts = torch.split(flat, [t.numel() for t in bucket])
                for t, part in zip(bucket, parts, strict=True):
                    t.copy_(part.view(t.shape))

        return _parts(reduce_op, flats, label, copy_back)

    return run(Call("all_reduce_params", group, check, torch=True), _start_parts)


def all_reduce_coalesced(
    tensors: list[torch.Tensor],
    op: str | ReduceOp = "sum",
    group: ProcessGroup | None = None,
    async_op: bool = False,
) -> Work[list[torch.Tensor]]:
    """Reduce every tensor of ``tensors`` across ranks in place, as one call (torch's).

    The tensors are flattened into one buffer per dtype and each buffer is
    reduced, as ``all_reduce_params`` does (torch deprecates this name).

    Args:
        tensors: The tensors, overwritten with the results.
        op: As for ``all_reduce``.
        group: Defaults to the world group.
        async_op: torch.distributed's flag; the handle is returned either way.

    Returns:
        Work resolving to ``tensors``.

    Raises:
        TypeError: An item is not a tensor, or ``op`` does not suit its dtype.
        CollectiveMismatchError: Ranks disagree on dtypes or sizes.

    Example:
        >>> await aiodist.all_reduce_coalesced([a, b])
    """
    if not isinstance(tensors, list | tuple):
        tensors = [tensors]  # torch accepts one tensor
    items = list(tensors)
    return chain(all_reduce_params(items, True, -1, op, group), lambda _: items)
