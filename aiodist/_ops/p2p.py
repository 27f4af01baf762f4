"""Point-to-point: ``isend``/``irecv`` on tensors, ``isend_object``/``irecv_object`` on objects.

Messages are matched by (group, source, tag) in send order, as MPI matches
them. A receive is posted when ``irecv`` is called; a payload that arrives
after that lands straight in the receiving tensor's memory.

Neither side runs a task per message: ``isend`` writes the frame when called
(its handle is done once the kernel took it), and ``irecv``'s handle is
settled by the data plane's callback when the message is in.

Sends and receives pair call for call, even when one fails on its own rank.
A send that fails once its destination and tag are known (a tensor it cannot
send, an object it cannot pickle) sends ``PEER_ABORT`` in its message's place,
so the receive it would have matched fails with ``AbortedError`` instead of
taking this rank's next message. A receive that fails its checks likewise
still takes (and drops) the message it would have matched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiodist._errors import CollectiveMismatchError
from aiodist._group.inflight import fail, start_task
from aiodist._ops.common import byte_view, check_tensor, resolve_group
from aiodist._plane.peers import OBJECT_P2P, P2P
from aiodist._wire import codec

if TYPE_CHECKING:
    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._plane.peers import Key, Received
    from aiodist._wire.frame import Buffer

__all__ = ["irecv", "irecv_object", "isend", "isend_object", "recv", "send"]


def _p2p_group(group: ProcessGroup | None, what: str) -> ProcessGroup:
    g = resolve_group(group)
    if g is None:
        raise RuntimeError(f"{what} needs a process group: call init_process_group() first")
    return g


def _check_peer(g: ProcessGroup, peer: int | None, name: str, tag: int) -> None:
    # Peers are global ranks that must belong to the group, as in torch.distributed.
    if peer is not None:
        g.group_rank_of(peer, name)
    if not isinstance(tag, int) or tag < 0:
        raise ValueError(f"tag must be an int >= 0, got {tag!r}")


def _meta(t: torch.Tensor) -> list[Any]:
    return [str(t.dtype).removeprefix("torch."), list(t.shape)]


def _abort_send(g: ProcessGroup, dst: int, key: Key, description: str, exc: BaseException) -> None:
    # The message will never come: send what fails its receive in its place.
    if g.error is None and not g.closed and g.rank >= 0:
        reason = f"{type(exc).__name__}: {exc}"
        g.session.plane.send_abort(dst, key, [g.session.rank, reason, description])


def _drop_next(g: ProcessGroup, src: int | None, key: Key) -> None:
    # This receive failed here: it still takes the message it would have matched.
    if g.error is None and not g.closed and g.rank >= 0:
        g.session.plane.post(src, key, None, _dropped)


def _dropped(msg: Received | BaseException) -> None:
    pass


def isend(
    tensor: torch.Tensor, dst: int, tag: int = 0, group: ProcessGroup | None = None
) -> Work[None]:
    """Start sending ``tensor`` to rank ``dst``.

    Args:
        tensor: A CPU tensor; do not modify it until the send completes.
        dst: Global rank of the destination, a member of ``group`` (as in torch).
        tag: Matches the receive's tag.
        group: Defaults to the world group.

    Returns:
        Work that completes once ``tensor``'s memory may be reused. A small tensor
        is handed to the kernel at once; one of 1 MiB or more moves only when
        ``dst`` has posted the matching receive, straight into the receiving
        tensor (as MPI's rendezvous protocol). So awaiting a large send before
        ``dst`` can reach its receive (say, both ranks then enter a barrier)
        waits until the group's timeout: start the send, do the rest, await it
        later, or post the receive first.

    Cancellation:
        Cancelling the awaiting task does not cancel the send.

    Example:
        >>> await aiodist.isend(torch.ones(4), dst=1)
    """
    g = _p2p_group(group, "isend")
    _check_peer(g, dst, "dst", tag)
    description, key = f"isend(dst={dst}, tag={tag})", (P2P, g.group_id, tag, 0)
    try:
        t = check_tensor(tensor)
        src = t if t.is_contiguous() else t.contiguous()
    except BaseException as exc:
        _abort_send(g, dst, key, description, exc)
        raise
    return _send(g, description, dst, key, _meta(src), byte_view(src))


def _send(
    g: ProcessGroup, description: str, dst: int, key: Key, meta: Any, payload: Buffer
) -> Work[None]:
    # Most sends are handed to the kernel right here: the handle is done at once, with
    # no task and no timer. The rest (a first connection, a full socket) finish in a task.
    loop, work, _ = g.begin(description, collective=False, timed=False)
    rest = g.session.plane.send_now(dst, key, meta, payload)
    if rest is None:
        work._set_result(None)
    else:
        start_task(g, loop, work, lambda _seq: rest, 0, False)
    return work


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    tag: int = 0,
    group: ProcessGroup | None = None,
) -> Work[int]:
    """Start receiving into ``tensor`` from rank ``src`` (any rank when None).

    Returns:
        Work resolving to the sender's global rank (as torch's ``recv`` returns).

    Raises:
        CollectiveMismatchError: The sender's tensor has another dtype or shape.

    Cancellation:
        Cancelling the awaiting task does not cancel the receive.
    """
    g = _p2p_group(group, "irecv")
    _check_peer(g, src, "src", tag)
    key = (P2P, g.group_id, tag, 0)
    try:
        t = check_tensor(tensor)
    except BaseException:
        _drop_next(g, src, key)
        raise
    _, work, _ = g.begin(f"irecv(src={src}, tag={tag})", collective=False)
    dest = t if t.is_contiguous() else t.contiguous()
    mine = _meta(dest)

    def arrived(msg: Received | BaseException) -> None:
        # Called by the data plane (never raises into it): settle the handle here.
        try:
            if isinstance(msg, BaseException):
                raise msg
            sender = msg.src  # a global rank, as torch's recv returns
            if msg.meta != mine:
                field = "dtype" if msg.meta[0] != mine[0] else "shape"
                index = 0 if field == "dtype" else 1
                raise CollectiveMismatchError(
                    f"irecv(tag={tag}) got {field} {msg.meta[index]!r} from rank {sender} but "
                    f"the receiving tensor has {mine[index]!r}; send and receive matching tensors",
                    field=field,
                    values_by_rank={g.session.rank: mine[index], sender: msg.meta[index]},
                )
            if dest is not t:
                t.copy_(dest)
        except Exception as exc:
            fail(g, work, exc, collective=False)
        else:
            work._set_result(sender)

    g.session.plane.post(src, key, byte_view(dest), arrived)
    return work


async def send(
    tensor: torch.Tensor, dst: int, tag: int = 0, group: ProcessGroup | None = None
) -> None:
    """Send ``tensor`` to ``dst`` and wait until its memory may be reused (see ``isend``)."""
    await isend(tensor, dst, tag, group)


async def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    tag: int = 0,
    group: ProcessGroup | None = None,
) -> int:
    """Receive into ``tensor``; return the sender's rank (see ``irecv``)."""
    return await irecv(tensor, src, tag, group)


def isend_object(
    obj: object, dst: int, tag: int = 0, group: ProcessGroup | None = None
) -> Work[None]:
    """Start sending a Python object to rank ``dst`` (msgpack when plain, else pickle).

    Example:
        >>> await aiodist.isend_object({"step": 3}, dst=1)
    """
    g = _p2p_group(group, "isend_object")
    _check_peer(g, dst, "dst", tag)
    description, key = f"isend_object(dst={dst}, tag={tag})", (OBJECT_P2P, g.group_id, tag, 0)
    try:
        data = codec.dumps(obj)  # encoded now: later changes to obj do not travel
    except BaseException as exc:
        _abort_send(g, dst, key, description, exc)
        raise
    return _send(g, description, dst, key, None, data)


def irecv_object(
    src: int | None = None, tag: int = 0, group: ProcessGroup | None = None
) -> Work[Any]:
    """Start receiving a Python object from ``src`` (any rank when None).

    Returns:
        Work resolving to the object.
    """
    g = _p2p_group(group, "irecv_object")
    _check_peer(g, src, "src", tag)
    _, work, _ = g.begin(f"irecv_object(src={src}, tag={tag})", collective=False)

    def arrived(msg: Received | BaseException) -> None:
        try:
            if isinstance(msg, BaseException):
                raise msg
            obj = codec.loads(msg.data)
        except Exception as exc:
            fail(g, work, exc, collective=False)
        else:
            work._set_result(obj)

    g.session.plane.post(src, (OBJECT_P2P, g.group_id, tag, 0), None, arrived)
    return work
