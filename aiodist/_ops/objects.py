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

import asyncio
import itertools
import os
import pickle
import shutil
from typing import TYPE_CHECKING, Any, cast

from aiodist._errors import (
    ArgumentError,
    ArgumentTypeError,
    AssertedArgumentError,
    AssertedValueError,
    CollectiveMismatchError,
)
from aiodist._group.group import ProcessGroup
from aiodist._group.work import Work
from aiodist._ops import common, movement, p2p, staging
from aiodist._ops.common import (
    Slot,
    chain,
    check_signature,
    outside,
    resolve_group,
    root_of,
    signature,
)
from aiodist._wire import codec

if TYPE_CHECKING:
    from collections.abc import Iterable

    from aiodist._plane.peers import Received

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "broadcast_object_list_at",
    "collect_results",
    "collect_results_cpu",
    "collect_results_gpu",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
    "start_all_gather_object",
    "sync_random_seed",
    "write_private",
]

# The tag of send_object_list's messages: apart from every tag users can pass (>= 0).
_OBJECT_LIST_TAG = -1

# Steps of the messages one pair exchanges within an operation.
_DATA = 0
_CHECK = 1


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


def all_gather_object(
    object_list: Any,
    obj: Any = ...,
    group: ProcessGroup | None = None,
) -> Work[list[Any]]:
    """Gather one object from every rank, in rank order.

    Both forms work: torch.distributed's ``all_gather_object(object_list, obj,
    group)``, which fills ``object_list``, and mmengine's
    ``all_gather_object(data, group)``, which returns a new list. Each rank
    sends its encoded object straight to every other rank.

    Args:
        object_list: torch's form: a list of at least one item per rank to fill.
            mmengine's form: this rank's object (``data``).
        obj: torch's form: this rank's object. Plain data travels as msgpack;
            anything else is pickled (tensors on a GPU too, after the caller's
            stream has finished with them). It is encoded now: later changes to
            it do not travel. Leave it out for mmengine's form.
        group: Defaults to the world group.

    Returns:
        Work resolving to one object per rank (decoded copies, own included;
        ``object_list`` itself in torch's form); ``[data]`` when not initialised.

    Raises:
        TypeError: torch's form with an ``object_list`` that is not a list.
        IndexError: torch's form with an ``object_list`` shorter than the group.
        CollectiveMismatchError: Another rank called a different collective.
        RankFailedError: A member died before contributing.

    Cancellation:
        Cancelling the awaiting task does not cancel the gather; it completes
        for every rank. A timeout marks ``group`` broken on all members.

    Example:
        >>> objs = await aiodist.all_gather_object({"loss": 0.5})
    """
    out: list[Any] | None = None
    if obj is ... or isinstance(obj, ProcessGroup):  # mmengine's form: (data, group)
        data = object_list
        if isinstance(obj, ProcessGroup):
            group = obj
    else:
        data, out = obj, object_list
    g = resolve_group(group)
    if g is None or outside(g):
        if out is None:
            return Work.completed([data] if g is None else [])
        if g is not None:
            return Work.completed(out)
        _fill_objects(out, [data])
        return Work.completed(out)
    with Slot(g, "all_gather_object") as seq:
        if out is not None:
            _fill_objects(out, [None] * g.world_size)  # torch's errors, before anything is sent
        staging.settle_streams(data)
        payload = codec.dumps(data)
    work = start_all_gather_object(g, seq, payload)
    return work if out is None else chain(work, lambda got: _fill_objects(out, got))


def _fill_objects(out: Any, got: list[Any]) -> list[Any]:
    """``out[i] = got[i]``, raising what torch raises for a list that cannot take them."""
    if not isinstance(out, list):
        raise ArgumentTypeError(f"object_list must be a list, got {type(out).__name__}")
    if len(out) < len(got):
        raise IndexError(
            f"object_list has {len(out)} items but the group has {len(got)} ranks: list "
            "assignment index out of range"
        )
    for i, x in enumerate(got):
        out[i] = x
    return out


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
    obj: Any,
    object_gather_list: list[Any] | int | None = None,
    dst: int | ProcessGroup | None = 0,
    group: ProcessGroup | None = None,
    group_dst: int | None = None,
) -> Work[list[Any] | None]:
    """Gather one object from every rank on rank ``dst``, in rank order.

    Both forms work: torch.distributed's ``gather_object(obj,
    object_gather_list, dst, group)``, which fills ``object_gather_list`` on
    ``dst``, and mmengine's ``gather_object(data, dst, group)`` (an int second).

    Args:
        obj: The object this rank contributes (encoded now).
        object_gather_list: On ``dst``, a list of one item per rank to fill
            (torch's form); None elsewhere, or for a new list.
        dst: The global rank that receives the list (torch's convention); 0 by default.
        group: Defaults to the world group.
        group_dst: ``dst`` as a rank of ``group``.

    Returns:
        Work resolving to the list on ``dst`` and to None elsewhere; ``[obj]``
        when not initialised.

    Raises:
        TypeError: ``dst`` is not an int.
        ValueError: ``dst`` is not a rank of ``group``; ``object_gather_list``
            given off ``dst``, or too short on it.
        CollectiveMismatchError: Ranks disagree on ``dst`` or on the operation.
        RankFailedError: A member died before contributing.

    Cancellation:
        Cancelling the awaiting task does not cancel the gather; it completes
        for every rank. A timeout marks ``group`` broken on all members.

    Example:
        >>> objs = await aiodist.gather_object(len(my_shard), dst=0)
    """
    if isinstance(object_gather_list, int) and not isinstance(object_gather_list, bool):
        # mmengine's form, gather_object(data, dst, group): shift the arguments by one.
        if isinstance(dst, ProcessGroup):
            group = dst
        object_gather_list, dst = None, object_gather_list
    if isinstance(dst, ProcessGroup):
        raise ArgumentTypeError("dst must be an int rank, got a ProcessGroup")
    if group_dst is not None and dst == 0:
        dst = None
    g = resolve_group(group)
    if outside(g):
        return Work.completed(None)
    with Slot(g, "gather_object") as seq:
        root = root_of(g, dst, group_dst, "dst")  # from here on a group rank
        size = 1 if g is None else g.world_size
        out = cast("list[Any] | None", object_gather_list)
        if (0 if g is None else g.rank) == root:
            if out is not None and len(out) < size:
                raise ArgumentError(
                    f"object_gather_list has {len(out)} items; the group has {size} ranks"
                )
        elif out:
            raise ArgumentError(
                "Argument ``gather_list`` must NOT be specified on non-destination ranks."
            )
        if g is None:
            return Work.completed([obj] if out is None else _fill_objects(out, [obj]))
        staging.settle_streams(obj)
        payload = codec.dumps(obj)
    work = _start_gather_object(g, seq, payload, root)
    if out is None or g.rank != root:
        return work
    return chain(work, lambda got: _fill_objects(out, got or []))


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
    object_list: list[Any],
    src: int | None = 0,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
) -> Work[list[Any]]:
    """Replace the items of ``object_list`` on every rank with those of rank ``src``'s list.

    torch.distributed's and mmengine's signature alike. Rank ``src`` encodes its
    list once and sends the bytes straight to every other rank. Every rank must
    pass a list of the same length.

    Args:
        object_list: A list; read on ``src`` (encoded now), overwritten in place
            elsewhere (mmengine calls it ``data``).
        src: The global rank whose items are broadcast (torch's convention); 0 by default.
        group: Defaults to the world group.
        device: torch's device for its staging tensors; accepted and not needed.
        group_src: ``src`` as a rank of ``group``.

    Returns:
        Work resolving to ``object_list`` itself, once its items are ``src``'s.

    Raises:
        AssertionError: ``object_list`` is not a list (as mmengine asserts; also a
            ``TypeError``, as torch raises).
        TypeError: ``src`` not an int.
        ValueError: ``src`` is not a rank of ``group``.
        CollectiveMismatchError: Ranks disagree on ``src``, on the list's length
            (``field == "shape"``) or on the operation.
        RankFailedError: A member died first.

    Cancellation:
        Cancelling the awaiting task does not cancel the broadcast; the list is
        still updated when it completes. A timeout marks ``group`` broken.

    Example:
        >>> cfg = [load_config() if rank == 0 else None]
        >>> await aiodist.broadcast_object_list(cfg, src=0)
    """
    if group_src is not None and src == 0:
        src = None
    g = resolve_group(group)
    if outside(g):
        return Work.completed(object_list)
    with Slot(g, "broadcast_object_list") as seq:
        if not isinstance(object_list, list):
            raise AssertedArgumentError(
                f"object_list must be a list, got {type(object_list).__name__}"
            )
        root = root_of(g, src, group_src, "src")  # from here on a group rank
        if g is None:
            return Work.completed(object_list)
        if g.rank == root:
            staging.settle_streams(object_list)
        payload = codec.dumps(object_list) if g.rank == root else None
    return broadcast_object_list_at(g, seq, object_list, root, payload)


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
    scatter_object_output_list: list[Any] | None,
    scatter_object_input_list: list[Any] | int | None = None,
    src: int | ProcessGroup | None = 0,
    group: ProcessGroup | None = None,
    group_src: int | None = None,
) -> Work[Any]:
    """Send ``scatter_object_input_list[i]`` from rank ``src`` to rank ``i``.

    torch.distributed's form: this rank's object lands in
    ``scatter_object_output_list[0]``. aiodist's older form,
    ``scatter_object_list(objects, src, group)`` (an int second), is accepted too.

    Args:
        scatter_object_output_list: A list of at least one item; its first
            receives this rank's object.
        scatter_object_input_list: On ``src``, a list with one object per rank
            (each encoded now); ignored elsewhere.
        src: The global rank that holds the objects (torch's convention); 0 by default.
        group: Defaults to the world group.
        group_src: ``src`` as a rank of ``group``.

    Returns:
        Work resolving to this rank's object (a decoded copy).

    Raises:
        TypeError: The input list is not a list on ``src``, or ``src`` is not an int.
        ValueError: The output list is empty, the input list's length is not the
            group's size on ``src``, or ``src`` is not a rank of ``group``.
        CollectiveMismatchError: Ranks disagree on ``src`` or on the operation.
        RankFailedError: A member died first.

    Cancellation:
        Cancelling the awaiting task does not cancel the scatter; it completes
        for every rank. A timeout marks ``group`` broken on all members.

    Example:
        >>> out = [None]
        >>> await aiodist.scatter_object_list(out, shards if rank == 0 else None, src=0)
    """
    out: list[Any] | None = scatter_object_output_list
    inputs: Any = scatter_object_input_list
    if isinstance(inputs, int) and not isinstance(inputs, bool):
        # aiodist's older form, (objects, src, group): shift the arguments by one.
        if isinstance(src, ProcessGroup):
            group = src
        out, inputs, src = None, scatter_object_output_list, inputs
    if isinstance(src, ProcessGroup):
        raise ArgumentTypeError("src must be an int rank, got a ProcessGroup")
    if group_src is not None and src == 0:
        src = None
    g = resolve_group(group)
    if outside(g):
        return Work.completed(None)
    with Slot(g, "scatter_object_list") as seq:
        root = root_of(g, src, group_src, "src")  # from here on a group rank
        size = 1 if g is None else g.world_size
        is_src = g is None or g.rank == root
        if is_src and inputs is None and isinstance(out, list | tuple) and len(out) == size > 1:
            # aiodist's older form with src= given by name: the objects first, no output
            # list (torch's form would raise here: its source passes the objects second).
            out, inputs = None, out
        if out is not None and (not isinstance(out, list) or len(out) < 1):
            raise ArgumentError(
                "Expected argument scatter_object_output_list to be a list of size at least 1."
            )
        if is_src:
            if not isinstance(inputs, (list, tuple)):
                raise ArgumentTypeError(
                    "scatter_object_input_list must be a list on the src rank, got "
                    f"{type(inputs).__name__}"
                )
            if len(inputs) != size:
                raise ArgumentError(
                    f"scatter_object_input_list has {len(inputs)} items but the group has "
                    f"{size} ranks; pass one object per rank"
                )
        if g is None:
            assert isinstance(inputs, list | tuple)
            return Work.completed(_first_into(out, inputs[0]))
        if is_src:
            staging.settle_streams(inputs)
        payloads = [codec.dumps(x) for x in inputs] if is_src and inputs else []
    mine = signature("scatter_object_list", root=root)

    async def op(seq: int) -> Any:
        if g.rank == root:
            sends = [(r, _DATA, payloads[r]) for r in range(g.world_size) if r != root]
            await _exchange(g, seq, mine, sends, [], ring_check=True)
            return _first_into(out, codec.loads(payloads[root]))
        (buf,) = await _exchange(g, seq, mine, [], [(root, _DATA)], ring_check=True)
        return _first_into(out, codec.loads(buf))

    return g.start(f"scatter_object_list(src={g.global_rank(root)})", op, seq=seq)


def _first_into(out: list[Any] | None, value: Any) -> Any:
    if out is not None:
        out[0] = value
    return value


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> Work[None]:
    """Send the objects of ``object_list`` to rank ``dst`` (torch's ``send_object_list``).

    The list travels as one message (msgpack when plain, else pickle); the
    receiver's ``recv_object_list`` replaces the items of its list.

    Args:
        object_list: The objects (encoded now).
        dst: Global rank of the receiver.
        group: Defaults to the world group.
        device: torch's device for its staging tensors; accepted and not needed.
        group_dst: ``dst`` as a rank of ``group``.
        use_batch: torch's batching flag; accepted.

    Returns:
        Work that completes once the message is handed over.

    Raises:
        ValueError: ``dst`` is this rank, not a member, or missing.
        TypeError: ``object_list`` is not a list.

    Example:
        >>> await aiodist.send_object_list([{"step": 3}], dst=1)
    """
    g = _p2p_group(group, "send_object_list")
    if outside(g):
        return Work.completed(None)
    dst = p2p.peer_of(g, dst, group_dst, "dst")
    if dst == g.session.rank:
        raise ArgumentError(
            "Invalid destination rank: destination rank should not be the same as the rank "
            "of the current process."
        )
    if not isinstance(object_list, list):
        raise ArgumentTypeError(f"object_list must be a list, got {type(object_list).__name__}")
    staging.settle_streams(object_list)
    return p2p.send_object(g, dst, _OBJECT_LIST_TAG, object_list)


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: ProcessGroup | None = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> Work[int]:
    """Receive objects sent by ``send_object_list`` into ``object_list`` (torch's).

    Args:
        object_list: A list as long as the sender's; its items are replaced.
        src: Global rank of the sender; any rank when None.
        group: Defaults to the world group.
        device: Accepted for torch's signature.
        group_src: ``src`` as a rank of ``group``.
        use_batch: torch's batching flag; accepted.

    Returns:
        Work resolving to the sender's global rank.

    Raises:
        TypeError: ``object_list`` is not a list.
        CollectiveMismatchError: The sender's list has another length.

    Example:
        >>> objs = [None]
        >>> await aiodist.recv_object_list(objs, src=0)
    """
    g = _p2p_group(group, "recv_object_list")
    if outside(g):
        return Work.completed(-1)
    if src is not None or group_src is not None:
        src = p2p.peer_of(g, src, group_src, "src")
    if not isinstance(object_list, list):
        raise ArgumentTypeError(f"object_list must be a list, got {type(object_list).__name__}")
    got = p2p.receive_object(g, src, _OBJECT_LIST_TAG, with_sender=True)

    def place(pair: tuple[Any, int]) -> int:
        items, sender = pair
        if len(items) != len(object_list):
            raise CollectiveMismatchError(
                f"recv_object_list got {len(items)} objects from rank {sender} for a list of "
                f"{len(object_list)}; pass lists of the same length on both sides",
                field="shape",
                values_by_rank={g.session.rank: len(object_list), sender: len(items)},
            )
        object_list[:] = items
        return sender

    return chain(got, place)


def _p2p_group(group: ProcessGroup | None, what: str) -> ProcessGroup:
    g = resolve_group(group)
    if g is None:
        raise RuntimeError(f"{what} needs a process group: call init_process_group() first")
    return g


def collect_results(
    results: list[Any],
    size: int,
    device: str = "cpu",
    tmpdir: str | None = None,
    group: ProcessGroup | None = None,
) -> Work[list[Any] | None]:
    """Collect every rank's results on rank 0, ordered as a distributed sampler split them.

    As ``mmengine.dist.collect_results``: rank ``r`` holds samples ``r, r + n,
    r + 2n, ...``, so the lists are interleaved (``zip_longest``, dropping
    ``None``, as mmengine does) and the sampler's padding is cut off at
    ``size``. ``device="cpu"`` is ``collect_results_cpu`` (files in ``tmpdir``
    when given, else the data plane: no shared filesystem needed);
    ``"gpu"``/``"npu"`` is ``collect_results_gpu``.

    Args:
        results: This rank's results (encoded now).
        size: Length of the whole dataset.
        device: ``"cpu"``, ``"gpu"`` or ``"npu"``.
        tmpdir: A directory every rank can reach (``device="cpu"`` only).
        group: Defaults to the world group.

    Returns:
        Work resolving to the ordered results on rank 0, None elsewhere;
        ``results[:size]`` when not initialised.

    Raises:
        NotImplementedError: ``device`` is none of those (as mmengine raises).
        AssertionError: ``tmpdir`` with ``device="gpu"`` (as mmengine asserts).
        TypeError: ``results`` is not a list or ``size`` not an int.
        FileNotFoundError: On rank 0, ``tmpdir`` is not shared by every rank.
        CollectiveMismatchError: Another rank called a different collective.

    Cancellation:
        Cancelling the awaiting task does not cancel the collection; it
        completes for every rank. A timeout marks ``group`` broken.

    Example:
        >>> ordered = await aiodist.collect_results(preds, len(dataset))
    """
    if device not in ("gpu", "cpu", "npu"):
        raise NotImplementedError(f"device must be 'cpu' , 'gpu' or 'npu', but got {device}")
    if device != "cpu":
        if tmpdir is not None:
            raise AssertedValueError(f"tmpdir should be None when device is {device}")
        return collect_results_gpu(results, size, group)
    return collect_results_cpu(results, size, tmpdir, group)


def collect_results_cpu(
    result_part: list[Any],
    size: int,
    tmpdir: str | None = None,
    group: ProcessGroup | None = None,
) -> Work[list[Any] | None]:
    """Collect every rank's results on rank 0 (mmengine's ``collect_results_cpu``).

    With ``tmpdir``, as mmengine: every rank pickles its part to
    ``tmpdir/part_{rank}.pkl``, the ranks meet at a barrier, rank 0 reads every
    part back, orders them and removes ``tmpdir``. Without it, the parts travel
    over the data plane (mmengine would make a directory under ``.dist_test``).

    Args:
        result_part: This rank's results.
        size: Length of the whole dataset.
        tmpdir: A directory every rank can reach, or None.
        group: Defaults to the world group.

    Returns:
        Work resolving to the ordered results on rank 0, None elsewhere.

    Raises:
        TypeError: ``result_part`` is not a list or ``size`` not an int.
        FileNotFoundError: On rank 0, a part is missing from ``tmpdir``.

    Example:
        >>> ordered = await aiodist.collect_results_cpu(preds, len(dataset), "/shared/tmp")
    """
    g = resolve_group(group)
    if tmpdir is None:
        return _collect_by_gather(result_part, size, g, "collect_results_cpu")
    with Slot(g, "collect_results_cpu") as seq:
        _check_results(result_part, size)
        if g is None or outside(g):
            return Work.completed(result_part[:size] if g is None else None)
        payload = pickle.dumps(result_part, protocol=2)
    rank, n = g.rank, g.world_size
    path = os.path.join(tmpdir, f"part_{rank}.pkl")

    async def written_then_met(seq: int) -> None:
        await asyncio.to_thread(write_private, path, payload)
        await movement.meet(g, seq, None, "collect_results_cpu")

    met = g.start("collect_results_cpu", written_then_met, seq=seq)

    def read() -> list[Any]:
        parts = []
        for i in range(n):
            part = os.path.join(tmpdir, f"part_{i}.pkl")
            if not os.path.exists(part):
                raise FileNotFoundError(
                    f"{tmpdir} is not a shared directory for rank {i}, please make sure "
                    f"{tmpdir} is a shared directory for all ranks!"
                )
            with open(part, "rb") as f:
                parts.append(pickle.load(f))
        shutil.rmtree(tmpdir)
        return _ordered(parts, size)

    async def finish(seq: int) -> list[Any] | None:
        await met
        if rank != 0:
            return None
        return await asyncio.to_thread(read)

    return g.start("collect_results_cpu", finish, collective=False, seq=seq)


def collect_results_gpu(
    result_part: list[Any], size: int, group: ProcessGroup | None = None
) -> Work[list[Any] | None]:
    """Collect every rank's results on rank 0 (mmengine's ``collect_results_gpu``).

    mmengine gathers the parts to every rank with ``all_gather_object``; aiodist
    sends them to rank 0 only, over the data plane. Tensors in the results
    travel pickled (CUDA ones arrive on the device they left).

    Args:
        result_part: This rank's results.
        size: Length of the whole dataset.
        group: Defaults to the world group.

    Returns:
        Work resolving to the ordered results on rank 0, None elsewhere.

    Example:
        >>> ordered = await aiodist.collect_results_gpu(preds, len(dataset))
    """
    return _collect_by_gather(result_part, size, resolve_group(group), "collect_results_gpu")


def write_private(path: str, payload: bytes) -> None:
    """Write ``payload`` to ``path``, readable by this user only (a part of collect_results).

    The results are the user's (mmengine leaves them to the umask): the folder is
    made 0700, the file 0600, and never written through a link planted in its place.
    """
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as f:
        os.fchmod(fd, 0o600)  # a part left by an earlier run keeps its mode otherwise
        f.write(payload)


def _check_results(results: object, size: object) -> None:
    if not isinstance(results, list):
        raise ArgumentTypeError(f"results must be a list, got {type(results).__name__}")
    if isinstance(size, bool) or not isinstance(size, int):
        raise ArgumentTypeError(f"size must be an int, got {type(size).__name__}")
    if size < 0:
        raise ArgumentError(f"size must be >= 0, got {size}")


def _ordered(parts: list[list[Any]], size: int) -> list[Any]:
    """mmengine's order: interleave the parts, drop the ``None`` padding, cut at ``size``."""
    return [
        x for x in itertools.chain.from_iterable(itertools.zip_longest(*parts)) if x is not None
    ][:size]


def _collect_by_gather(
    results: list[Any], size: int, g: ProcessGroup | None, name: str
) -> Work[list[Any] | None]:
    with Slot(g, name) as seq:
        _check_results(results, size)
        if g is None or outside(g):
            return Work.completed(results[:size] if g is None else None)
        staging.settle_streams(results)
        payload = codec.dumps(results)
    parts = _start_gather_object(g, seq, payload, 0)

    async def finish(seq: int) -> list[Any] | None:
        part_list = await parts
        return None if part_list is None else _ordered(part_list, size)

    return g.start(name, finish, collective=False, seq=seq)


def sync_random_seed(group: ProcessGroup | None = None) -> Work[int]:
    """Draw a random seed on every rank and give every rank rank 0's (as mmengine).

    Every rank draws ``np.random.randint(2**31)`` (so numpy's global generator
    advances on every rank, as in mmengine), then rank 0's draw is broadcast.

    Args:
        group: Defaults to the world group.

    Returns:
        Work resolving to the same int in ``[0, 2**31)`` on every rank; this
        rank's draw when not initialised.

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
    seed = int(np.random.randint(2**31))
    if g is None or outside(g):
        return Work.completed(seed)
    with Slot(g, "sync_random_seed") as seq:
        payload = codec.dumps([seed]) if g.rank == 0 else None
    box = broadcast_object_list_at(g, seq, [seed], 0, payload)

    async def finish(seq: int) -> int:
        (value,) = await box
        return int(value)

    return g.start("sync_random_seed", finish, collective=False, seq=seq)
