"""Point-to-point on Python objects: ``isend_object``/``irecv_object``, and torch's
``send_object_list``/``recv_object_list``.

An object is encoded once when the send is called (msgpack when plain, else
pickle) and travels as one message of its own kind (``MatchKind.OBJECT_P2P``):
its receive does not know its size in advance. The rules of ``p2p`` hold:
messages match by (group, source, tag) in send order, and a send that fails
(an object that cannot be pickled) sends ``PEER_ABORT`` in its message's place.
"""

from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING, Any

from aiodist._errors import ArgumentTypeError, CollectiveMismatchError
from aiodist._ops import staging
from aiodist._ops.p2p import abort_send, send_message
from aiodist._ops.run import chain, run_p2p
from aiodist._wire import codec
from aiodist._wire.keys import MatchKind

if TYPE_CHECKING:
    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._plane.receives import Received


class Tag(enum.IntEnum):
    """aiodist's own tags of object messages: apart from every tag users can pass (>= 0)."""

    OBJECT_LIST = -1  # send_object_list's messages
    REMOTE_ORDERS = -2  # master-worker mode: the master's orders to a worker
    REMOTE_REPLIES = -3  # ... a worker's answers to the master
    REMOTE_TRANSFERS = -4  # ... tensors and event notices between workers


_OBJECT_LIST_TAG = Tag.OBJECT_LIST


def isend_object(
    obj: object, dst: int, group: ProcessGroup | None = None, tag: int = 0
) -> Work[None]:
    """Start sending a Python object to rank ``dst`` (msgpack when plain, else pickle).

    Example:
        >>> await aiodist.isend_object({"step": 3}, dst=1)
    """
    return run_p2p(
        "isend_object",
        group,
        dst,
        None,
        tag,
        lambda g, peer: (send_object(g, _given(peer), tag, obj), None),
        sends=True,
    )


def send_object(g: ProcessGroup, dst: int, tag: int, obj: object) -> Work[None]:
    """Send ``obj`` to global rank ``dst`` with ``tag`` (checked; negative tags are aiodist's)."""
    description, key = (
        f"isend_object(dst={dst}, tag={tag})",
        (MatchKind.OBJECT_P2P, g.group_id, tag, 0),
    )
    try:
        data = codec.dumps(obj)  # encoded now: later changes to obj do not travel
    except BaseException as exc:
        abort_send(g, dst, key, description, exc)
        raise
    return send_message(g, description, dst, key, None, data)


def irecv_object(
    src: int | None = None, group: ProcessGroup | None = None, tag: int = 0
) -> Work[Any]:
    """Start receiving a Python object from ``src`` (any rank when None).

    Returns:
        Work resolving to the object (None on a process outside ``group``).
    """
    return run_p2p(
        "irecv_object",
        group,
        src,
        None,
        tag,
        lambda g, peer: (receive_object(g, peer, tag, with_sender=False), None),
        sends=False,
    )


def _given(peer: int | None) -> int:
    assert peer is not None  # a send's peer is always given (``run_p2p``)
    return peer


def receive_object(
    g: ProcessGroup, src: int | None, tag: int, *, with_sender: bool, timed: bool = True
) -> Work[Any]:
    """Receive an object from ``src`` (None: any) with ``tag``; ``(obj, sender)`` if asked.

    Not ``timed``: no deadline (a worker waiting for its next order).
    """
    work = g.begin(f"irecv_object(src={src}, tag={tag})", collective=False, timed=timed)

    def arrived(msg: Received | BaseException) -> None:
        try:
            if isinstance(msg, BaseException):
                raise msg
            obj = codec.loads(msg.data)
        except Exception as exc:
            g.fail(work, exc, collective=False)
        else:
            work.set_result((obj, msg.src) if with_sender else obj)

    plane = g.session.plane
    posted = plane.post(src, (MatchKind.OBJECT_P2P, g.group_id, tag, 0), None, arrived)
    work.withdrawable(functools.partial(plane.withdraw, src, posted))
    return work


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

    def start(g: ProcessGroup, peer: int | None) -> tuple[Work[None], None]:
        if not isinstance(object_list, list):
            raise ArgumentTypeError(f"object_list must be a list, got {type(object_list).__name__}")
        staging.settle_streams(object_list)
        return send_object(g, _given(peer), _OBJECT_LIST_TAG, object_list), None

    return run_p2p(
        "send_object_list",
        group,
        dst,
        group_dst,
        _OBJECT_LIST_TAG,
        start,
        sends=True,
        user_tag=False,
    )


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

    def start(g: ProcessGroup, peer: int | None) -> tuple[Work[int], None]:
        if not isinstance(object_list, list):
            raise ArgumentTypeError(f"object_list must be a list, got {type(object_list).__name__}")
        got = receive_object(g, peer, _OBJECT_LIST_TAG, with_sender=True)
        return chain(got, functools.partial(_place, object_list, g.session.rank)), None

    return run_p2p(
        "recv_object_list",
        group,
        src,
        group_src,
        _OBJECT_LIST_TAG,
        start,
        sends=False,
        outside=-1,
        user_tag=False,
    )


def _place(object_list: list[Any], me: int, pair: tuple[Any, int]) -> int:
    """Put the objects of ``pair`` (from its sender) into ``object_list``; the sender."""
    items, sender = pair
    if len(items) != len(object_list):
        raise CollectiveMismatchError(
            f"recv_object_list got {len(items)} objects from rank {sender} for a list of "
            f"{len(object_list)}; pass lists of the same length on both sides",
            field="shape",
            values_by_rank={me: len(object_list), sender: len(items)},
        )
    object_list[:] = items
    return sender
