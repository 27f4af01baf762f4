"""Point-to-point on tensors: ``isend``, ``irecv``, ``batch_isend_irecv``.

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

Objects travel by ``p2p_objects``. Point-to-point takes no place in its
group's order (``ProcessGroup.begin`` numbers it apart): its set-up is
``run.run_p2p`` (the group, the answer outside it, the tag, the peer, the
flight recorder), shared with objects; here are the tensor's checks and, for
a device tensor, a host copy (``staging``).
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import ArgumentError, CollectiveMismatchError
from aiodist._group.world import resolve_group
from aiodist._ops import staging
from aiodist._ops.agreement import dtype_name
from aiodist._ops.run import run_p2p
from aiodist._ops.tensors import check_tensor
from aiodist._wire.codec import byte_view
from aiodist._wire.keys import MatchKind

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._plane.receives import Received
    from aiodist._wire.frame import Buffer
    from aiodist._wire.keys import Key


# Read once: an enum member's lookup costs every small message (~75 ns on Python 3.11).
_P2P: Final = MatchKind.P2P


def _meta(t: torch.Tensor) -> list[Any]:
    return [dtype_name(t), list(t.shape)]


def abort_send(g: ProcessGroup, dst: int, key: Key, description: str, exc: BaseException) -> None:
    # The message will never come: send what fails its receive in its place.
    if g.error is None and not g.closed and g.rank >= 0 and dst != g.session.rank:
        reason = f"{type(exc).__name__}: {exc}"
        g.session.plane.send_abort(dst, key, [g.session.rank, reason, description])


def _drop_next(g: ProcessGroup, src: int | None, key: Key) -> None:
    # This receive failed here: it still takes the message it would have matched.
    if g.error is None and not g.closed and g.rank >= 0:
        g.session.plane.post(src, key, None, _dropped)


def _dropped(msg: Received | BaseException) -> None:
    pass


def isend(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> Work[None]:
    """Start sending ``tensor`` to rank ``dst``.

    Args:
        tensor: A dense tensor; do not modify it until the send completes. A CUDA
            tensor is copied to host memory after the work queued on the caller's
            current stream.
        dst: Global rank of the destination, a member of ``group`` (as in torch).
        group: Defaults to the world group.
        tag: Matches the receive's tag.
        group_dst: ``dst`` as a rank of ``group``.

    Returns:
        Work that completes once ``tensor``'s memory may be reused. A small tensor
        is handed to the kernel at once; one of 1 MiB or more moves only when
        ``dst`` has posted the matching receive, straight into the receiving
        tensor (as MPI's rendezvous protocol). So awaiting a large send before
        ``dst`` can reach its receive (say, both ranks then enter a barrier)
        waits until the group's timeout: start the send, do the rest, await it
        later, or post the receive first.

    Raises:
        ValueError: ``dst`` is this rank, not a member, or missing.

    Cancellation:
        Cancelling the awaiting task does not cancel the send.

    Example:
        >>> await aiodist.isend(torch.ones(4), dst=1)
    """
    start = functools.partial(_start_send, tensor, tag)
    return run_p2p("isend", group, dst, group_dst, tag, start, sends=True)


def _start_send(
    tensor: torch.Tensor, tag: int, g: ProcessGroup, dst: int | None
) -> tuple[Work[None], torch.Tensor]:
    assert dst is not None
    description, key = f"isend(dst={dst}, tag={tag})", (_P2P, g.group_id, tag, 0)
    try:
        t = check_tensor(tensor)
        device = staging.device_of(t)
        src = t if device is not None or t.is_contiguous() else t.contiguous()
        if device is not None:
            return _staged_send(g, description, dst, key, src), t
        meta, payload = _meta(src), byte_view(src)
    except BaseException as exc:
        abort_send(g, dst, key, description, exc)
        raise
    return send_message(g, description, dst, key, meta, payload), t


def send_message(
    g: ProcessGroup, description: str, dst: int, key: Key, meta: Any, payload: Buffer
) -> Work[None]:
    # Most sends are handed to the kernel right here: the handle is done at once, with
    # no task and no timer. The rest (a first connection, a full socket) finish in a task.
    work = g.begin(description, collective=False, timed=False)
    # A send still being staged from a device to the same place goes first (call order).
    staging_sends = g.staging_sends
    before = staging_sends.get((dst, key)) if staging_sends else None
    if before is not None and not before.done():

        async def after_staged(_seq: int) -> None:
            await before
            await g.session.plane.send(dst, key, meta, payload)

        return _drive_timed(g, work, after_staged)
    rest = g.session.plane.send_now(dst, key, meta, payload)
    if rest is None:
        work.set_result(None)
    else:
        _drive_timed(g, work, lambda _seq: rest)
    return work


def _drive_timed(
    g: ProcessGroup, work: Work[None], op: Callable[[int], Awaitable[None]]
) -> Work[None]:
    # A send that could not finish at once: now it runs under the group's timeout.
    assert work.loop is not None
    g.deadlines.add(work.loop, work, 0)
    return g.drive(work, op, 0, collective=False)


def _staged_send(
    g: ProcessGroup, description: str, dst: int, key: Key, t: torch.Tensor
) -> Work[None]:
    """Send device tensor ``t`` once its host copy is ready, before any later send there."""
    work = g.begin(description, collective=False)
    loop = work.loop
    assert loop is not None
    place = (dst, key)
    before = g.staging_sends.get(place)
    issued: asyncio.Future[None] = loop.create_future()
    g.staging_sends[place] = issued
    hosts, copied = staging.copy_out([t])

    async def run(_seq: int) -> None:
        try:
            if before is not None:
                await asyncio.shield(before)
            try:
                await copied
            except BaseException as exc:
                abort_send(g, dst, key, description, exc)
                raise
            host = hosts[0]
            sending = g.session.plane.send(dst, key, _meta(host), byte_view(host))
        finally:
            if not issued.done():
                issued.set_result(None)
            if g.staging_sends.get(place) is issued:
                del g.staging_sends[place]
        await sending

    return g.drive(work, run, 0, collective=False)


def irecv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> Work[int]:
    """Start receiving into ``tensor`` from rank ``src`` (any rank when None).

    A CUDA ``tensor`` receives into a host buffer, then is copied on the
    caller's current stream; the handle completes once the data is on the device.

    Returns:
        Work resolving to the sender's global rank (as torch's ``recv`` returns).

    Raises:
        CollectiveMismatchError: The sender's tensor has another dtype or shape.

    Cancellation:
        Cancelling the awaiting task does not cancel the receive.
    """
    start = functools.partial(_start_receive, tensor, tag)
    return run_p2p("irecv", group, src, group_src, tag, start, sends=False, outside=-1)


def _start_receive(
    tensor: torch.Tensor, tag: int, g: ProcessGroup, src: int | None
) -> tuple[Work[int], torch.Tensor]:
    key = (_P2P, g.group_id, tag, 0)
    try:
        t = check_tensor(tensor)
    except BaseException:
        _drop_next(g, src, key)
        raise
    work = g.begin(f"irecv(src={src}, tag={tag})", collective=False)
    device = staging.device_of(t)
    if device is not None:
        dest = staging.host_buffer(t)
        back = staging.copy_back_later(t)
    else:
        dest = t if t.is_contiguous() else t.contiguous()
        back = None
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
            if back is not None:
                back(dest, lambda error: _received(g, work, sender, error))
                return
            if dest is not t:
                t.copy_(dest)
        except Exception as exc:
            g.fail(work, exc, collective=False)
        else:
            work.set_result(sender)

    plane = g.session.plane
    posted = plane.post(src, key, byte_view(dest), arrived)
    work.withdrawable(functools.partial(plane.withdraw, src, posted))
    return work, t


def _received(g: ProcessGroup, work: Work[int], sender: int, error: BaseException | None) -> None:
    if error is not None:
        g.fail(work, error, collective=False)
    else:
        work.set_result(sender)


async def send(
    tensor: torch.Tensor,
    dst: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_dst: int | None = None,
) -> None:
    """Send ``tensor`` to ``dst`` and wait until its memory may be reused (see ``isend``)."""
    await isend(tensor, dst, group, tag, group_dst)


async def recv(
    tensor: torch.Tensor,
    src: int | None = None,
    group: ProcessGroup | None = None,
    tag: int = 0,
    group_src: int | None = None,
) -> int:
    """Receive into ``tensor``; return the sender's rank (see ``irecv``)."""
    return await irecv(tensor, src, group, tag, group_src)


class P2POp:
    """One point-to-point operation for ``batch_isend_irecv`` (torch's ``P2POp``).

    Args:
        op: ``isend`` or ``irecv`` (aiodist's, aiodist.sync's or torch.distributed's).
        tensor: The tensor to send or receive into.
        peer: The other side's global rank.
        group: Defaults to the world group.
        tag: Matches sends with receives.
        group_peer: ``peer`` as a rank of ``group``.

    Example:
        >>> ops = [P2POp(aiodist.isend, t, 1), P2POp(aiodist.irecv, r, 1)]
    """

    def __init__(
        self,
        op: Any,
        tensor: torch.Tensor,
        peer: int | None = None,
        group: ProcessGroup | None = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        name = getattr(op, "__name__", None)
        if name not in ("isend", "irecv"):
            raise ArgumentError(
                "Invalid ``op``. Expected ``op`` to be of type ``isend`` or ``irecv``."
            )
        self.op = name
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work[Any]]:
    """Start every send and receive of ``p2p_op_list``, in order; return their handles.

    As torch's ``batch_isend_irecv``: each operation is started as its
    ``isend``/``irecv`` would be, in list order, so pairs match in that order.

    Raises:
        ValueError: An empty list, something that is not a ``P2POp``, or
            operations on different groups.

    Example:
        >>> for w in aiodist.batch_isend_irecv(ops): await w
    """
    if not isinstance(p2p_op_list, list | tuple) or not p2p_op_list:
        raise ArgumentError("batch_isend_irecv expects a non-empty list of P2POp")
    if not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ArgumentError("Invalid ``p2p_op_list``. Each op is expected to be a P2POp.")
    if len({id(resolve_group(p.group)) for p in p2p_op_list}) > 1:
        raise ArgumentError("All ops need to use the same group.")
    works: list[Work[Any]] = []
    for p in p2p_op_list:
        if p.op == "isend":
            works.append(isend(p.tensor, p.peer, p.group, p.tag, p.group_peer))
        else:
            works.append(irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer))
    return works
