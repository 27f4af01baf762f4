"""The data plane of one session: its messaging, on ``connections.Connections``.

``core.py`` decides (peer states, matching, failures), ``channel.py`` reads
each channel (its handshake, its frames), ``bulk.py`` moves large payloads
once their receive is posted, ``connections.py`` listens, connects and
closes; ``DataPlane`` is what the operations call.

Wire use (every message declared in ``_wire/messages.py``): a channel opens
with ``PeerHello`` from the side that connected (and the token handshake,
``channel.py``); every message after it is ``Data [kind, group, a, b, meta]``
with a raw payload (or ``PeerAnnounce``, a large payload's announcement).
``(kind, group, a, b)`` is the match key (``_wire/keys.py`` has its kinds,
``MatchKind``). ``meta`` is small plain data the operation checks (dtype,
shape, op). ``PeerError`` carries an error that breaks a group on every
member (or aborts one call of it, see ``drop_call``); ``PeerAbort`` takes
the place of a message whose send failed before its data left, so the receive
it matches fails instead of taking a later message; ``PeerBye`` precedes a
clean close.

One primitive per level: ``post`` is the receive (a callback; ``recv`` its
awaitable form); ``send_now`` is the send (as far as it goes without waiting;
``send`` its awaitable form).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import AbortedError, DistError
from aiodist._plane.bulk import BULK_MIN_BYTES
from aiodist._plane.connections import Connections
from aiodist._plane.receives import Received, aborted_message
from aiodist._transport import shm
from aiodist._transport.base import start_now
from aiodist._wire.headers import MESSAGES, message_header
from aiodist._wire.keys import Key, MatchKind
from aiodist._wire.messages import Data, PeerAbort, PeerAnnounce, PeerError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Coroutine

    from aiodist._wire.frame import Buffer

logger = logging.getLogger(__name__)

_DATA: Final = Data.KIND


def _resolve(future: asyncio.Future[Received], outcome: Received | BaseException) -> None:
    # The callback of recv's receive: its future takes the outcome (unless cancelled).
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
        if isinstance(outcome, AbortedError):
            future.exception()  # retrieved: an aborted call reports the error itself
    else:
        future.set_result(outcome)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _is_bulk(key: Key, nbytes: int) -> bool:
    # A point-to-point tensor large enough to wait for its receive (``bulk.py``).
    return nbytes >= BULK_MIN_BYTES and key[0] == MatchKind.P2P


def _turn_over(
    unwritten: dict[int, asyncio.Future[None]], dst: int, written: asyncio.Future[None]
) -> None:
    # This message is in its channel (or will never be): the next one to ``dst`` may go.
    if not written.done():
        written.set_result(None)
    if unwritten.get(dst) is written:
        del unwritten[dst]


def _started(coro: Coroutine[Any, Any, None]) -> Awaitable[None] | None:
    # ``start_now``, its error raised where the rest is awaited, as every send's is.
    try:
        return start_now(coro)
    except Exception as exc:
        return _raise(exc)


async def _raise(exc: Exception) -> None:
    raise exc


async def _logged(rest: Awaitable[None], dst: int, kind: int) -> None:
    # A notice is best effort: a peer that cannot be reached learns of it otherwise.
    try:
        await rest
    except (OSError, DistError) as exc:
        logger.debug("sending %s to rank %d failed: %s", MESSAGES.name(kind), dst, exc)


class DataPlane(Connections):
    """Channels to every peer of a session, and the messages and receives on them."""

    # --- sending: send_now, and its awaitable form --------------------------------------

    def send_now(
        self, dst: int, key: Key, meta: Any, payload: Buffer | None
    ) -> Awaitable[None] | None:
        """Send one message to global rank ``dst``, as far as it goes without waiting.

        Returns None once the message is handed to the kernel (the usual case for
        a small one on a connected channel), else an awaitable that finishes the
        send: await it (in a task) before reusing ``payload``. It raises what
        stopped the send (a peer that left, a failed connection, as the session
        judged it).

        Order: messages to one peer leave in call order, whatever their sizes. A
        large tensor's announcement (or, with a credit, its payload) is written
        here like any message; a message that cannot be written yet (no channel,
        or one ahead of it still waiting for the channel) waits its turn.
        """
        if dst == self.rank:
            data = memoryview(bytes(payload) if payload is not None else b"")
            self.arrived(dst, key, Received(dst, meta, data))
            return None
        self.messages_sent += 1
        bulk = False
        if payload is not None:
            nbytes = memoryview(payload).nbytes
            self.bytes_sent += nbytes
            bulk = _is_bulk(key, nbytes)
        header = [*key, meta]
        channel = self.routes.get(dst)
        if channel is None or dst in self.left or dst in self.unwritten:
            return self._send_in_turn(dst, _DATA, header, payload, key if bulk else None)
        if bulk:
            assert payload is not None
            return _started(self._send_bulk(dst, key, meta, memoryview(payload).cast("B")))
        try:
            # Written here, in the caller: a frame the kernel took at once needs no
            # task and no loop turn.
            rest = channel.send_nowait(_DATA, header, payload)
        except OSError as exc:
            return self._raise_send_failed(dst, exc)
        return None if rest is None else self._finish_send(dst, rest)

    def sent(self) -> list[int]:
        """``[messages, bytes]`` this rank sent its peers (``Heartbeat.where`` reports them).

        Bytes count the payloads of its messages and what its shared-memory
        collectives placed in its segments for the peers to read; a message to
        itself does not count, nor what torch.distributed's own backends move.
        """
        return [self.messages_sent, self.bytes_sent + self.segments.shared_bytes]

    async def send(self, dst: int, key: Key, meta: Any, payload: Buffer | None) -> None:
        """Send one message to global rank ``dst``; returns when ``payload`` may be reused.

        Cancellation:
            Cancelling mid-payload aborts the channel (its state is unknown).
        """
        rest = self.send_now(dst, key, meta, payload)
        if rest is not None:
            await rest

    def _send_in_turn(
        self,
        dst: int,
        kind: int,
        header: list[Any],
        payload: Buffer | None,
        bulk: Key | None = None,
    ) -> Awaitable[None] | None:
        """Send once the channel is there and every message to ``dst`` before it is written.

        ``bulk``: the key of a large tensor's ``DATA`` (``header`` is then its key and meta).
        """
        ahead = self.unwritten.get(dst)
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.unwritten[dst] = written
        return _started(self._send_queued(dst, ahead, written, kind, header, payload, bulk))

    async def _send_queued(
        self,
        dst: int,
        ahead: asyncio.Future[None] | None,
        written: asyncio.Future[None],
        kind: int,
        header: list[Any],
        payload: Buffer | None,
        bulk: Key | None,
    ) -> None:
        try:
            if ahead is not None and not ahead.done():
                await asyncio.wait([ahead])  # its outcome is its own sender's to report
            if dst in self.left:
                raise self.left[dst]
            if bulk is not None and payload is not None:
                view = memoryview(payload).cast("B")
                await self._send_bulk(dst, bulk, header[-1], view, written)
            else:
                await self._send_frame(dst, kind, header, payload, written)
        finally:
            if ahead is None or ahead.done():
                _turn_over(self.unwritten, dst, written)
            else:  # cancelled while waiting: the next message still goes after ``ahead``'s
                ahead.add_done_callback(lambda _: _turn_over(self.unwritten, dst, written))

    async def _send_bulk(
        self,
        dst: int,
        key: Key,
        meta: Any,
        payload: memoryview,
        written: asyncio.Future[None] | None = None,
    ) -> None:
        """Announce ``payload``, wait until ``dst`` clears it, then send it (``bulk.py``).

        The announcement (or the payload itself, where ``dst`` posted its receive
        already) is what keeps this message's place among those to ``dst``.
        """
        bulk = self.bulk
        if bulk.take_credit(dst, key, payload.nbytes):  # its receive is posted: no need to ask
            await self._send_frame(dst, _DATA, [*key, meta], payload, written)
            return
        cleared: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        cleared.add_done_callback(_retrieve)  # a failure reaches the caller via await
        announcement, header = bulk.announce(
            dst, key, meta, payload.nbytes, functools.partial(_resolve, cleared)
        )
        await self._send_frame(dst, PeerAnnounce.KIND, message_header(announcement), None, written)
        bulk.wait_started()
        try:
            if (await cleared).meta:  # that receive had sent a credit: take it back
                bulk.take_credit(dst, key, payload.nbytes)
        finally:
            bulk.wait_ended()
        await self._send_frame(dst, _DATA, header, payload)

    async def _send_frame(
        self,
        dst: int,
        kind: int,
        header: list[Any],
        payload: Buffer | None = None,
        written: asyncio.Future[None] | None = None,
    ) -> None:
        """Send one frame to peer ``dst`` (not this rank); ``written`` is set once it is."""
        if dst in self.left:
            raise self.left[dst]
        try:
            channel = self.routes.get(dst) or await self.connect(dst)
            rest = channel.send_nowait(kind, header, payload)
            if written is not None and not written.done():
                written.set_result(None)  # in the channel: the next message may follow
            if rest is not None:
                await rest
        except OSError as exc:
            raise await self.unreachable(dst, exc) from None

    async def _finish_send(self, dst: int, rest: Awaitable[None]) -> None:
        try:
            await rest
        except OSError as exc:
            raise await self.unreachable(dst, exc) from None

    async def _raise_send_failed(self, dst: int, exc: OSError) -> None:
        raise await self.unreachable(dst, exc) from None

    async def unreachable(self, dst: int, exc: OSError) -> BaseException:
        """The error to raise for ``dst``, which this rank could not reach or send to (``exc``).

        A peer we cannot reach or whose connection broke mid-send: the session works
        out who failed (the peer, or another rank whose failure made the peer leave).
        Raise it ``from None``: the session's verdict names the rank and why; the
        broken socket behind it is not news to the user (and ``exc`` itself says it all).
        """
        if self.closing:
            return exc
        return await self.on_peer_lost(dst, f"sending to it failed ({exc})") or exc

    async def peer_segment(self, key: int, rank: int, name: str, nbytes: int) -> shm.Segment:
        """``rank``'s shared segment ``name`` mapped here (``SharedSegments.peer``).

        A file that is gone means ``rank`` died and a survivor swept it: that fails
        as a send to ``rank`` would (the session's verdict names it).
        """
        try:
            return self.segments.peer(key, rank, name, nbytes)
        except FileNotFoundError as exc:
            raise await self.unreachable(rank, exc) from None

    async def send_error(self, dst: int, error: PeerError) -> None:
        """Send ``error`` to ``dst`` (connecting first if need be)."""
        if dst != self.rank and dst not in self.left:
            channel = self.routes.get(dst) or await self.connect(dst)
            await channel.send(PeerError.KIND, message_header(error))

    def send_abort(self, dst: int, key: Key, info: list[Any]) -> None:
        """Send ``PeerAbort`` for ``key`` to ``dst``, in order with this rank's DATA to it.

        ``info`` is ``[rank, reason, what]``. Best effort: a peer that cannot be
        reached learns of the failure as it learns of any other.
        """
        rank, reason, what = info
        abort = PeerAbort(*key, rank, str(reason), str(what))
        if dst == self.rank:
            self.arrived(dst, key, aborted_message(dst, abort))
        else:
            self.send_notice(dst, PeerAbort.KIND, message_header(abort))

    def send_notice(self, dst: int, kind: int, header: list[Any]) -> None:
        """Send a header-only frame to peer ``dst`` now, in order with what follows it.

        On a connected channel it is written right here (as ``send_now`` writes
        data), so the caller's next message to ``dst`` cannot overtake it; else
        it goes once connected. Best effort: a peer that cannot be reached
        learns of what it says as it learns of any failure.
        """
        channel = self.routes.get(dst)
        if channel is not None and dst not in self.unwritten:
            self.write(channel, kind, header)
            return
        rest = self._send_in_turn(dst, kind, header, None)
        if rest is not None:
            self.spawn(_logged(rest, dst, kind))

    # --- receiving: post's awaitable form -------------------------------------------------

    def recv(
        self, src: int | None, key: Key, dest: memoryview | None = None
    ) -> asyncio.Future[Received]:
        """Post a receive (``post``); the future resolves with the matched message."""
        future: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        self.post(src, key, dest, functools.partial(_resolve, future))
        return future

    def send_to(self, rank: int, kind: int, header: list[Any]) -> None:
        self.send_notice(rank, kind, header)  # the core's action (bulk's clears and credits)

    def fail(
        self, exc: BaseException, group_id: int | None = None, *, keep_p2p: bool = False
    ) -> None:
        """Fail every posted receive (of ``group_id``, if given) with ``exc`` (``PlaneCore``)."""
        if (group_id is None or keep_p2p) and self.use_shm:  # a rank died (or the session broke)
            self.failed = True
            shm.remove_stale()  # its segments may linger
        super().fail(exc, group_id, keep_p2p=keep_p2p)
