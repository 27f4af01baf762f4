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

from aiodist._errors import CollectiveMismatchError
from aiodist._group.work import Work
from aiodist._ops import common
from aiodist._ops.common import Slot, check_signature, resolve_group, signature
from aiodist._wire import codec

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Iterable

    from aiodist._group.group import ProcessGroup
    from aiodist._plane.peers import Received

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "broadcast_object_list_at",
    "collect_results",
    "gather_object",
    "scatter_object_list",
    "start_all_gather_object",
    "sync_random_seed",
]

# Steps of the messages one pair exchanges within an operation.
_DATA = 0
_CHECK = 1


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
    with Slot(g, "all_gather_object") as seq:
        payload = codec.dumps(data)
    return start_all_gather_object(g, seq, payload)


def start_all_gather_object(g: ProcessGroup, seq: int, payload: bytes) -> Work[list[Any]]:
    """``all_gather_object`` of the encoded ``payload`` as ``g``'s operation ``seq``."""
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

    return g.start("all_gather_object", op, seq=seq)


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
    with Slot(g, "gather_object") as seq:
        dst = _check_root(g, dst, "dst")  # from here on a group rank
        if g is None:
            return Work.completed([data])
        payload = codec.dumps(data)
    return _start_gather_object(g, seq, payload, dst)


def _start_gather_object(
    g: ProcessGroup, seq: int, payload: bytes, dst: int
) -> Work[list[Any] | None]:
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

    return g.start(f"gather_object(dst={dst})", op, seq=seq)


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
    g = resolve_group(group)
    with Slot(g, "broadcast_object_list") as seq:
        if not isinstance(data, list):
            raise TypeError(f"data must be a list, got {type(data).__name__}")
        src = _check_root(g, src, "src")  # from here on a group rank
        if g is None:
            return Work.completed(data)
        payload = codec.dumps(data) if g.rank == src else None
    return broadcast_object_list_at(g, seq, data, src, payload)


def broadcast_object_list_at(
    g: ProcessGroup, seq: int, data: list[Any], src: int, payload: bytes | None
) -> Work[list[Any]]:
    """``broadcast_object_list`` as ``g``'s operation ``seq`` (``src``: a group rank)."""
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

    return g.start(f"broadcast_object_list(src={src})", op, seq=seq)


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
    with Slot(g, "scatter_object_list") as seq:
        src = _check_root(g, src, "src")  # from here on a group rank
        size = 1 if g is None else g.world_size
        is_src = g is None or g.rank == src
        if is_src:
            if not isinstance(scatter_list, (list, tuple)):
                raise TypeError(
                    "scatter_list must be a list on the src rank, got "
                    f"{type(scatter_list).__name__}"
                )
            if len(scatter_list) != size:
                raise ValueError(
                    f"scatter_list has {len(scatter_list)} items but the group has {size} "
                    "ranks; pass one object per rank"
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

    return g.start(f"scatter_object_list(src={src})", op, seq=seq)


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
    g = resolve_group(group)
    with Slot(g, "collect_results") as seq:
        if not isinstance(results, list):
            raise TypeError(f"results must be a list, got {type(results).__name__}")
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"size must be an int, got {type(size).__name__}")
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
        if g is None:
            return Work.completed(results[:size])
        payload = codec.dumps(results)
    parts = _start_gather_object(g, seq, payload, 0)

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
    with Slot(g, "sync_random_seed") as seq:
        payload = codec.dumps([seed]) if g.rank == 0 else None
    box = broadcast_object_list_at(g, seq, [seed], 0, payload)

    async def finish(seq: int) -> int:
        (value,) = await box
        return int(value)

    return g.start("sync_random_seed", finish, collective=False)
