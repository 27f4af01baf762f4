"""Collectives on Python objects, and mmengine's helpers built on collectives.

Every object is encoded once with ``codec.dumps`` (msgpack when plain, else
pickle) when the operation is called, and the same bytes go to every peer;
frames carry their own length, so there is no size pre-exchange. Objects never
touch CUDA.

Rooted operations (gather, scatter, broadcast) send data one way only, so two
ranks that disagree on the root might never exchange a message. Each of them
also passes its signature around a ring (rank ``r`` to ``r + 1``, a header-only
message sent alongside the data): any disagreement shows up on at least one
pair, which breaks the group with ``CollectiveMismatchError`` on every member
instead of hanging until the timeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiodist._collectives import common
from aiodist._collectives.common import check_signature, resolve_group, signature
from aiodist._errors import CollectiveMismatchError
from aiodist._wire import codec
from aiodist._work import Work

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Awaitable, Callable, Iterable

    import torch

    from aiodist._group import ProcessGroup
    from aiodist._peers import Received

__all__ = [
    "all_gather_object",
    "all_reduce_dict",
    "all_reduce_params",
    "broadcast_object_list",
    "collect_results",
    "gather_object",
    "scatter_object_list",
    "sync_random_seed",
]

# Steps of the messages one pair exchanges within an operation.
_DATA = 0
_CHECK = 1

_REDUCE_OPS = ("sum", "mean", "product", "min", "max", "band", "bor", "bxor")
_ALIASES = {"prod": "product", "avg": "mean", "average": "mean"}


def _check_root(g: ProcessGroup | None, root: object, name: str) -> int:
    """The group rank of global rank ``root`` (torch's convention for src/dst)."""
    if g is not None:
        return g.group_rank_of(root, name)
    if isinstance(root, bool) or not isinstance(root, int):
        raise TypeError(f"{name} must be an int rank, got {type(root).__name__}")
    if root != 0:
        raise ValueError(f"{name} must be 0 when not initialised (world size 1), got {root}")
    return root


async def _exchange(
    g: ProcessGroup,
    seq: int,
    mine: list[Any],
    sends: Iterable[tuple[int, int, bytes | None]],
    recvs: Iterable[tuple[int, int]],
    *,
    ring_check: bool = False,
) -> list[memoryview]:
    """Post ``recvs`` (src, step), then send ``sends`` (dst, step, payload).

    Returns the received payloads in ``recvs`` order, each from a sender whose
    signature equals ``mine``. Each message is checked the moment it arrives:
    a disagreeing rank breaks the group at once (which fails the receives
    still waiting), so a mismatch never waits for the timeout. No task is
    made per message: on small objects those tasks cost more than the rest.
    """
    recvs = list(recvs)
    sends = list(sends)
    n = g.world_size
    if ring_check and n > 1:
        recvs.append(((g.rank - 1) % n, _CHECK))
        sends.append(((g.rank + 1) % n, _CHECK, None))
    # The group may have broken between start() and now; a receive posted after
    # that would never be failed and could only time out.
    g.check_usable()

    def check_on_arrival(future: asyncio.Future[Received]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # the group broke: the operation reports that error
        try:
            check_signature(g, mine, future.result())
        except CollectiveMismatchError as exc:
            g.break_(exc)

    futures = [common.recv(g, src, seq, step, None) for src, step in recvs]
    for future in futures:
        future.add_done_callback(check_on_arrival)
    for dst, step, payload in sends:
        await common.send(g, dst, seq, step, mine, payload)
    received = []
    for future in futures:
        msg = await future
        check_signature(g, mine, msg)
        received.append(msg.data)
    if ring_check and n > 1:
        received.pop()
    return received


def all_gather_object(data: object, group: ProcessGroup | None = None) -> Work[list[Any]]:
    """Gather one object from every rank, in rank order.

    Each rank sends its encoded object straight to every other rank.

    Args:
        data: Plain data travels as msgpack; anything else is pickled. It is
            encoded now: later changes to ``data`` do not travel.
        group: Defaults to the world group.

    Returns:
        Work resolving to one object per rank (decoded copies, own included);
        ``[data]`` when not initialised.

    Raises:
        CollectiveMismatchError: Another rank called a different collective.
        RankFailedError: A member died before contributing.

    Cancellation:
        Cancelling the awaiting task does not cancel the gather; it completes
        for every rank. A timeout marks ``group`` broken on all members.

    Example:
        >>> objs = await aiodist.all_gather_object({"loss": 0.5})
    """
    g = resolve_group(group)
    if g is None:
        return Work.completed([data])
    payload = codec.dumps(data)
    mine = signature("all_gather_object")

    async def op(seq: int) -> list[Any]:
        peers = [r for r in range(g.world_size) if r != g.rank]
        got = await _exchange(
            g, seq, mine, [(r, _DATA, payload) for r in peers], [(r, _DATA) for r in peers]
        )
        out: list[Any] = [None] * g.world_size
        out[g.rank] = codec.loads(payload)
        for r, buf in zip(peers, got, strict=True):
            out[r] = codec.loads(buf)
        return out

    return g.start("all_gather_object", op)


def gather_object(
    data: object, dst: int = 0, group: ProcessGroup | None = None
) -> Work[list[Any] | None]:
    """Gather one object from every rank on rank ``dst``, in rank order.

    Args:
        data: The object this rank contributes (encoded now).
        dst: The global rank that receives the list (torch's convention).
        group: Defaults to the world group.

    Returns:
        Work resolving to the list on ``dst`` and to None elsewhere; ``[data]``
        when not initialised.

    Raises:
        TypeError: ``dst`` is not an int.
        ValueError: ``dst`` is not a rank of ``group``.
        CollectiveMismatchError: Ranks disagree on ``dst`` or on the operation.
        RankFailedError: A member died before contributing.

    Cancellation:
        Cancelling the awaiting task does not cancel the gather; it completes
        for every rank. A timeout marks ``group`` broken on all members.

    Example:
        >>> objs = await aiodist.gather_object(len(my_shard), dst=0)
    """
    g = resolve_group(group)
    dst = _check_root(g, dst, "dst")  # from here on a group rank
    if g is None:
        return Work.completed([data])
    payload = codec.dumps(data)
    mine = signature("gather_object", root=dst)

    async def op(seq: int) -> list[Any] | None:
        if g.rank != dst:
            await _exchange(g, seq, mine, [(dst, _DATA, payload)], [], ring_check=True)
            return None
        peers = [r for r in range(g.world_size) if r != dst]
        got = await _exchange(g, seq, mine, [], [(r, _DATA) for r in peers], ring_check=True)
        out: list[Any] = [None] * g.world_size
        out[dst] = codec.loads(payload)
        for r, buf in zip(peers, got, strict=True):
            out[r] = codec.loads(buf)
        return out

    return g.start(f"gather_object(dst={dst})", op)


def broadcast_object_list(
    data: list[Any], src: int = 0, group: ProcessGroup | None = None
) -> Work[list[Any]]:
    """Replace the items of ``data`` on every rank with those of rank ``src``'s list.

    Rank ``src`` encodes its list once and sends the bytes straight to every
    other rank. Every rank must pass a list of the same length.

    Args:
        data: A list; read on ``src`` (encoded now), overwritten in place elsewhere.
        src: The global rank whose items are broadcast (torch's convention).
        group: Defaults to the world group.

    Returns:
        Work resolving to ``data`` itself, once its items are ``src``'s.

    Raises:
        TypeError: ``data`` is not a list, or ``src`` not an int.
        ValueError: ``src`` is not a rank of ``group``.
        CollectiveMismatchError: Ranks disagree on ``src``, on the list's length
            (``field == "shape"``) or on the operation.
        RankFailedError: A member died first.

    Cancellation:
        Cancelling the awaiting task does not cancel the broadcast; ``data`` is
        still updated when it completes. A timeout marks ``group`` broken.

    Example:
        >>> cfg = [load_config() if rank == 0 else None]
        >>> await aiodist.broadcast_object_list(cfg, src=0)
    """
    if not isinstance(data, list):
        raise TypeError(f"data must be a list, got {type(data).__name__}")
    g = resolve_group(group)
    src = _check_root(g, src, "src")  # from here on a group rank
    if g is None:
        return Work.completed(data)
    payload = codec.dumps(data) if g.rank == src else None
    # The length must match on every rank: it rides in the signature's shape field.
    mine = ["broadcast_object_list", None, [len(data)], None, src]

    async def op(seq: int) -> list[Any]:
        if g.rank == src:
            peers = [r for r in range(g.world_size) if r != src]
            await _exchange(g, seq, mine, [(r, _DATA, payload) for r in peers], [], ring_check=True)
            return data
        (buf,) = await _exchange(g, seq, mine, [], [(src, _DATA)], ring_check=True)
        data[:] = codec.loads(buf)
        return data

    return g.start(f"broadcast_object_list(src={src})", op)


def scatter_object_list(
    scatter_list: list[Any] | None, src: int = 0, group: ProcessGroup | None = None
) -> Work[Any]:
    """Send ``scatter_list[i]`` from rank ``src`` to rank ``i``.

    Args:
        scatter_list: On ``src``, a list or tuple with one object per rank
            (each encoded now); ignored elsewhere (None is fine).
        src: The global rank that holds the objects (torch's convention).
        group: Defaults to the world group.

    Returns:
        Work resolving to this rank's object (a decoded copy); ``scatter_list[0]``
        when not initialised.

    Raises:
        TypeError: ``scatter_list`` is not a list or tuple on ``src``, or
            ``src`` is not an int.
        ValueError: ``scatter_list``'s length is not the group's size on
            ``src``, or ``src`` is not a rank of ``group``.
        CollectiveMismatchError: Ranks disagree on ``src`` or on the operation.
        RankFailedError: A member died first.

    Cancellation:
        Cancelling the awaiting task does not cancel the scatter; it completes
        for every rank. A timeout marks ``group`` broken on all members.

    Example:
        >>> shard = await aiodist.scatter_object_list(shards if rank == 0 else None)
    """
    g = resolve_group(group)
    src = _check_root(g, src, "src")  # from here on a group rank
    size = 1 if g is None else g.world_size
    is_src = g is None or g.rank == src
    if is_src:
        if not isinstance(scatter_list, (list, tuple)):
            raise TypeError(
                f"scatter_list must be a list on the src rank, got {type(scatter_list).__name__}"
            )
        if len(scatter_list) != size:
            raise ValueError(
                f"scatter_list has {len(scatter_list)} items but the group has {size} ranks; "
                "pass one object per rank"
            )
    if g is None:
        assert scatter_list is not None
        return Work.completed(scatter_list[0])
    payloads = [codec.dumps(x) for x in scatter_list] if is_src and scatter_list else []
    mine = signature("scatter_object_list", root=src)

    async def op(seq: int) -> Any:
        if g.rank == src:
            sends = [(r, _DATA, payloads[r]) for r in range(g.world_size) if r != src]
            await _exchange(g, seq, mine, sends, [], ring_check=True)
            return codec.loads(payloads[src])
        (buf,) = await _exchange(g, seq, mine, [], [(src, _DATA)], ring_check=True)
        return codec.loads(buf)

    return g.start(f"scatter_object_list(src={src})", op)


def collect_results(
    results: list[Any],
    size: int,
    device: str = "cpu",
    tmpdir: str | None = None,
    group: ProcessGroup | None = None,
) -> Work[list[Any] | None]:
    """Collect every rank's results on rank 0, ordered as a distributed sampler split them.

    As ``mmengine.dist.collect_results``: rank ``r`` holds samples ``r, r + n,
    r + 2n, ...``, so the lists are interleaved (``zip(*parts)``) and the
    sampler's padding is cut off at ``size``. Results travel through the data
    plane whatever ``device`` says: no shared filesystem is needed.

    Args:
        results: This rank's results (encoded now).
        size: Length of the whole dataset.
        device: ``"cpu"`` or ``"gpu"``; accepted for compatibility.
        tmpdir: Accepted for compatibility and ignored.
        group: Defaults to the world group.

    Returns:
        Work resolving to the ordered results on rank 0, None elsewhere;
        ``results[:size]`` when not initialised.

    Raises:
        TypeError: ``results`` is not a list or ``size`` not an int.
        ValueError: ``size`` is negative or ``device`` unknown.
        CollectiveMismatchError: Another rank called a different collective.
        RankFailedError: A member died before contributing.

    Cancellation:
        Cancelling the awaiting task does not cancel the collection; it
        completes for every rank. A timeout marks ``group`` broken.

    Example:
        >>> ordered = await aiodist.collect_results(preds, len(dataset))
    """
    if not isinstance(results, list):
        raise TypeError(f"results must be a list, got {type(results).__name__}")
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"size must be an int, got {type(size).__name__}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    g = resolve_group(group)
    if g is None:
        return Work.completed(results[:size])
    parts = gather_object(results, dst=0, group=g)

    async def finish(seq: int) -> list[Any] | None:
        part_list = await parts
        if part_list is None:
            return None
        ordered: list[Any] = []
        for res in zip(*part_list, strict=False):
            ordered.extend(res)
        return ordered[:size]

    return g.start("collect_results", finish, collective=False)


def sync_random_seed(group: ProcessGroup | None = None) -> Work[int]:
    """Draw a random seed on rank 0 and give it to every rank.

    Args:
        group: Defaults to the world group.

    Returns:
        Work resolving to the same int in ``[0, 2**31)`` on every rank; a fresh
        random int when not initialised.

    Raises:
        CollectiveMismatchError: Another rank called a different collective.
        RankFailedError: A member died first.

    Cancellation:
        Cancelling the awaiting task does not cancel the broadcast. A timeout
        marks ``group`` broken on all members.

    Example:
        >>> seed = await aiodist.sync_random_seed()
    """
    import numpy as np

    g = resolve_group(group)
    seed = int(np.random.randint(2**31)) if g is None or g.rank == 0 else 0
    if g is None:
        return Work.completed(seed)
    box = broadcast_object_list([seed], src=0, group=g)

    async def finish(seq: int) -> int:
        (value,) = await box
        return int(value)

    return g.start("sync_random_seed", finish, collective=False)


def _check_reduce_op(op: object, tensors: Iterable[torch.Tensor]) -> str:
    """Validate ``op`` against every tensor now: a failure after some reductions
    started would leave ranks numbering their operations differently."""
    if not isinstance(op, str):
        raise TypeError(f"op must be a str such as 'sum', got {type(op).__name__}")
    key = _ALIASES.get(op.lower(), op.lower())
    if key not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(_REDUCE_OPS)}; got {op!r}")
    for t in tensors:
        floating = t.dtype.is_floating_point or t.dtype.is_complex
        if key == "mean" and not floating:
            raise TypeError(f"op 'mean' needs floating-point tensors, got {t.dtype}")
        if key in ("band", "bor", "bxor") and floating:
            raise TypeError(f"op {key!r} needs integer or bool tensors, got {t.dtype}")
    return key


def _start_reduce(
    flats: list[torch.Tensor], op: str, g: ProcessGroup
) -> Callable[[], Awaitable[None]]:
    """Start one all-reduce per flat tensor now; return what waits for them.

    They start at call time, in order, so that every rank numbers them alike.
    Uses ``aiodist._collectives.reductions.all_reduce`` (in place) when it exists;
    otherwise gathers the flat tensors as objects and reduces them locally in
    rank order, which gives bit-identical results on every rank.
    """
    try:
        from aiodist._collectives import reductions
    except ImportError:
        return _start_gather_reduce(flats, op, g)
    reduces = [reductions.all_reduce(flat, op=op, group=g) for flat in flats]

    async def wait_all() -> None:
        for w in reduces:
            await w

    return wait_all


def _start_gather_reduce(
    flats: list[torch.Tensor], op: str, g: ProcessGroup
) -> Callable[[], Awaitable[None]]:
    gathers = [all_gather_object(flat.detach().cpu(), group=g) for flat in flats]

    async def reduce_all() -> None:
        import torch

        for flat, w in zip(flats, gathers, strict=True):
            parts: list[torch.Tensor] = await w
            total = parts[0].clone()
            for part in parts[1:]:
                if op in ("sum", "mean"):
                    total.add_(part)
                elif op == "product":
                    total.mul_(part)
                elif op == "min":
                    torch.minimum(total, part, out=total)
                elif op == "max":
                    torch.maximum(total, part, out=total)
                elif op == "band":
                    total.bitwise_and_(part)
                elif op == "bor":
                    total.bitwise_or_(part)
                else:
                    total.bitwise_xor_(part)
            if op == "mean":
                total = total / g.world_size
            flat.copy_(total)

    return reduce_all


def all_reduce_dict(
    data: dict[str, torch.Tensor], op: str = "sum", group: ProcessGroup | None = None
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
        TypeError: ``data`` is not a dict of tensors, or ``op`` does not suit a
            tensor's dtype.
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

    if not isinstance(data, dict):
        raise TypeError(f"data must be a dict, got {type(data).__name__}")
    for key, value in data.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"data[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    op = _check_reduce_op(op, data.values())
    g = resolve_group(group)
    if g is None or g.world_size == 1:
        return Work.completed(data)
    keys = sorted(data)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key in keys:
        by_dtype.setdefault(data[key].dtype, []).append(key)
    flats = {
        dtype: torch.cat([data[k].detach().reshape(-1) for k in ks])
        for dtype, ks in sorted(by_dtype.items(), key=lambda kv: str(kv[0]))
    }
    wait_reduced = _start_reduce(list(flats.values()), op, g)

    async def finish(seq: int) -> dict[str, torch.Tensor]:
        await wait_reduced()
        for dtype, flat in flats.items():
            ks = by_dtype[dtype]
            parts = torch.split(flat, [data[k].numel() for k in ks])
            for k, part in zip(ks, parts, strict=True):
                data[k].copy_(part.view(data[k].shape))
        return data

    return g.start("all_reduce_dict", finish, collective=False)


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
    op: str = "sum",
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

    tensors: list[torch.Tensor] = []
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params must hold tensors, got {type(p).__name__}")
        tensors.append(p.data)
    op = _check_reduce_op(op, tensors)
    g = resolve_group(group)
    if g is None or g.world_size == 1:
        return Work.completed(None)
    if not coalesce:
        buckets = [[t] for t in tensors]
    else:
        limit = bucket_size_mb * 1024 * 1024 if bucket_size_mb > 0 else -1
        buckets = _buckets(tensors, limit)
    flats = [torch.cat([t.reshape(-1) for t in bucket]) for bucket in buckets]
    wait_reduced = _start_reduce(flats, op, g)

    async def finish(seq: int) -> None:
        await wait_reduced()
        for bucket, flat in zip(buckets, flats, strict=True):
            parts = torch.split(flat, [t.numel() for t in bucket])
            for t, part in zip(bucket, parts, strict=True):
                t.copy_(part.view(t.shape))

    return g.start("all_reduce_params", finish, collective=False)
