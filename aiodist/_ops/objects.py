"""Collectives on Python objects: all_gather, gather, broadcast and scatter of objects.

Each public function hands its arguments (``object_forms``, which encodes the
objects once, when the call is made) to ``run``, which sets the call up and
starts its algorithm here. The same bytes go to every peer; frames carry their
own length, so there is no size pre-exchange. Objects never touch CUDA.

Every message carries the sender's signature (``agreement``). The rooted
operations send data one way only, so their exchange runs the agreement beside
their data (``Exchange(..., rides=False)``): ranks that disagree on the root or
the operation meet there; ``all_gather_object``'s one round carries it itself.
mmengine's helpers built on these live in ``collect``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiodist._ops import object_forms, schedules
from aiodist._ops.agreement import OPEN, signature
from aiodist._ops.exchange import Exchange
from aiodist._ops.run import run
from aiodist._wire import codec

if TYPE_CHECKING:
    from collections.abc import Iterable

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._ops.requests import Request


# The step of the data of rooted operations (step 0 is their exchange's opening).
_DATA = 1


async def _exchange(
    ex: Exchange,
    sends: Iterable[tuple[int, bytes | None]],
    recvs: Iterable[int],
    step: int,
) -> list[memoryview]:
    """Post the receives from ``recvs``, then send ``sends`` (dst, payload), all as ``step``.

    Returns the received payloads in ``recvs`` order; each message is checked
    the moment it arrives (``Exchange.post``), so a mismatch never waits for the
    others.
    """
    futures = [ex.recv(src, step) for src in recvs]
    for dst, payload in sends:
        await ex.send(dst, step, payload)
    return [(await future).data for future in futures]


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
    return run(object_forms.all_gather_object(object_list, obj, group), start_all_gather_object)


def start_all_gather_object(
    g: ProcessGroup, seq: int, req: Request, *, name: str = "all_gather_object"
) -> Work[list[Any]]:
    """``all_gather_object`` of the encoded ``req.payload`` as ``g``'s operation ``seq``.

    One round: every rank sends to every other at step ``OPEN``, ``r + 1`` first.
    ``name`` is the call the user made (``new_group`` gathers its members' lists):
    the signature the ranks agree on, and so what a mismatch names, is that call's.
    """

    payload = req.payload

    async def op(seq: int) -> list[Any]:
        peers = schedules.direct_peers(g.rank, g.world_size)
        async with Exchange(g, work, seq, signature(name), rides=True) as ex:
            got = await _exchange(ex, [(r, payload) for r in peers], peers, OPEN)
        out: list[Any] = [None] * g.world_size
        out[g.rank] = codec.loads(payload)
        for r, buf in zip(peers, got, strict=True):
            out[r] = codec.loads(buf)
        return out

    work: Work[list[Any]] = g.begin(name, seq=seq)
    return g.drive(work, op, seq)


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
    return run(
        object_forms.gather_object(obj, object_gather_list, dst, group, group_dst),
        start_gather_object,
    )


def start_gather_object(g: ProcessGroup, seq: int, req: Request) -> Work[list[Any] | None]:
    """Every rank sends its encoded object straight to the root (``req.root``)."""
    payload, dst = req.payload, req.root
    assert dst is not None

    async def op(seq: int) -> list[Any] | None:
        async with Exchange(g, work, seq, signature("gather_object", root=dst), rides=False) as ex:
            if g.rank != dst:
                await _exchange(ex, [(dst, payload)], [], _DATA)
                return None
            peers = [r for r in range(g.world_size) if r != dst]
            got = await _exchange(ex, [], peers, _DATA)
        out: list[Any] = [None] * g.world_size
        out[dst] = codec.loads(payload)
        for r, buf in zip(peers, got, strict=True):
            out[r] = codec.loads(buf)
        return out

    work: Work[list[Any] | None] = g.begin(req.description, seq=seq)
    return g.drive(work, op, seq)


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
    return run(
        object_forms.broadcast_object_list(object_list, src, group, group_src),
        start_broadcast_object_list,
    )


def start_broadcast_object_list(g: ProcessGroup, seq: int, req: Request) -> Work[list[Any]]:
    """The root sends its encoded list to every rank, which replaces its list's items."""
    data: list[Any] = req.data
    src, payload = req.root, req.payload
    assert src is not None
    # The length must match on every rank: it rides in the signature's shape field.
    mine = signature("broadcast_object_list", shape=[len(data)], root=src)

    async def op(seq: int) -> list[Any]:
        async with Exchange(g, work, seq, mine, rides=False) as ex:
            if g.rank == src:
                peers = [r for r in range(g.world_size) if r != src]
                await _exchange(ex, [(r, payload) for r in peers], [], _DATA)
                return data
            (buf,) = await _exchange(ex, [], [src], _DATA)
        data[:] = codec.loads(buf)
        return data

    work: Work[list[Any]] = g.begin(req.description, seq=seq)
    return g.drive(work, op, seq)


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
    return run(
        object_forms.scatter_object_list(
            scatter_object_output_list, scatter_object_input_list, src, group, group_src
        ),
        _start_scatter_object_list,
    )


def _start_scatter_object_list(g: ProcessGroup, seq: int, req: Request) -> Work[Any]:
    root, payloads = req.root, req.payload
    assert root is not None
    mine = signature("scatter_object_list", root=root)

    async def op(seq: int) -> Any:
        async with Exchange(g, work, seq, mine, rides=False) as ex:
            if g.rank == root:
                sends = [(r, payloads[r]) for r in range(g.world_size) if r != root]
                await _exchange(ex, sends, [], _DATA)
                return codec.loads(payloads[root])
            (buf,) = await _exchange(ex, [], [root], _DATA)
        return codec.loads(buf)

    work: Work[Any] = g.begin(req.description, seq=seq)
    return g.drive(work, op, seq)
