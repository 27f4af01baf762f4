"""The data plane of one session: its messaging, on ``connections.Connections``.

``core.py`` decides (peer states, matching, failures), ``channel.py`` reads
each channel (its handshake, its frames), ``bulk.py`` moves large payloads
once their receive is posted, ``connections.py`` listens, connects and
closes; ``DataPlane`` is what the operations call.

Wire use: a channel opens with ``PEER_HELLO [job, rank, pid, member]`` from
the side that connected (and the token handshake, ``channel.py``); every
message after it is ``DATA [kind, group, a, b, meta]`` with a raw payload.
``(kind, group, a, b)`` is the match key (``_wire/keys.py`` has its kinds,
``MatchKind``). ``meta`` is small plain data the operation checks (dtype,
shape, op). ``PEER_ERROR`` carries an error that breaks a group on every
member (or aborts one call of it, see ``drop_call``); ``PEER_ABORT`` takes
the place of a message whose send failed before its data left, so the receive
it matches fails instead of taking a later message; ``PEER_BYE`` precedes a
clean close.

One primitive per level: ``post`` is the receive (a callback; ``recv`` its
awaitable form); ``send_now`` is the send (as far as it goes without waiting;
``send`` its awaitable form).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, Any

from aiodist._errors import AbortedError, DistError
from aiodist._plane.bulk import BULK_MIN_BYTES
from aiodist._plane.connections import Connections
from aiodist._plane.receives import Received, aborted_message
from aiodist._transport import shm
from aiodist._wire.keys import Key, MatchKind
from aiodist._wire.messages import MessageKind

if TYPE_CHECKING:
    from collections.abc import Awaitable, Coroutine

    from aiodist._wire.frame import Buffer

__all__ = ["DataPlane", "Key", "Received"]

logger = logging.getLogger(__name__)


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


class DataPlane(Connections):
    """Channels to every peer of a session, and the messages and receives on them."""

    # --- sending: send_now, and its awaitable form --------------------------------------

    def send_now(
        self, dst: int, key: Key, meta: Any, payload: Buffer | None
    ) -> Coroutine[Any, Any, None] | None:
        """Send one message to global rank ``dst``, as far as it goes without waiting.

        Returns None once the message is handed to the kernel (the usual case for
        a small one on a connected channel), else a coroutine that finishes the
        send: await it (in a task) before reusing ``payload``. It raises what
        stopped the send (a peer that left, a failed connection, as the session
        judged it).
        """
        if dst == self.rank:
            data = memoryview(bytes(payload) if payload is not None else b"")
            self.arrived(dst, key, Received(dst, meta, data))
            return None
        channel = self.routes.get(dst)
        if (
            channel is None
            or dst in self.left
            or (
                key[0] == MatchKind.P2P
                and payload is not None
                and memoryview(payload).nbytes >= BULK_MIN_BYTES
            )
        ):
            return self._send_later(dst, key, meta, payload)  # connect, or announce: no shortcut
        try:
            # Written here, in the caller: a frame the kernel took at once needs no
            # task and no loop turn.
            rest = channel.send_nowait(MessageKind.DATA, [*key, meta], payload)
        except OSError as exc:
            return self._raise_send_failed(dst, exc)
        return None if rest is None else self._finish_send(dst, rest)

    async def send(self, dst: int, key: Key, meta: Any, payload: Buffer | None) -> None:
        """Send one message to global rank ``dst``; returns when ``payload`` may be reused.

        Cancellation:
            Cancelling mid-payload aborts the channel (its state is unknown).
        """
        rest = self.send_now(dst, key, meta, payload)
        if rest is not None:
            await rest

    async def _send_later(self, dst: int, key: Key, meta: Any, payload: Buffer | None) -> None:
        if dst in self.left:
            raise self.left[dst]
        if key[0] == MatchKind.P2P and payload is not None:
            view = memoryview(payload).cast("B")
            if view.nbytes >= BULK_MIN_BYTES:
                await self._send_bulk(dst, key, meta, view)
                return
        await self._send_data(dst, [*key, meta], payload)

    async def _send_bulk(self, dst: int, key: Key, meta: Any, payload: memoryview) -> None:
        """Announce ``payload``, wait until ``dst`` clears it, then send it (``bulk.py``)."""
        bulk = self.bulk
        if bulk.take_credit(dst, key, payload.nbytes):  # its receive is posted: no need to ask
            await self._send_data(dst, [*key, meta], payload)
            return
        cleared: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        cleared.add_done_callback(_retrieve)  # a failure reaches the caller via await
        announcement, header = bulk.announce(
            dst, key, meta, payload.nbytes, functools.partial(_resolve, cleared)
        )
        await self._send_data(dst, announcement)
        bulk.wait_started()
        try:
            if (await cleared).meta:  # that receive had sent a credit: take it back
                bulk.take_credit(dst, key, payload.nbytes)
        finally:
            bulk.wait_ended()
        await self._send_data(dst, header, payload)

    async def _send_data(self, dst: int, header: list[Any], payload: Buffer | None = None) -> None:
        """Send one DATA frame with ``header`` to peer ``dst`` (not this rank)."""
        if dst in self.left:
            raise self.left[dst]
        try:
            channel = self.routes.get(dst) or await self.connect(dst)
            await channel.send(MessageKind.DATA, header, payload)
        except OSError as exc:
            raise await self._send_failed(dst, exc) from None

    async def _finish_send(self, dst: int, rest: Awaitable[None]) -> None:
        try:
            await rest
        except OSError as exc:
            raise await self._send_failed(dst, exc) from None

    async def _raise_send_failed(self, dst: int, exc: OSError) -> None:
        raise await self._send_failed(dst, exc) from None

    async def _send_failed(self, dst: int, exc: OSError) -> BaseException:
        # Raised ``from None``: the session's verdict names the rank and why; the broken
        # socket behind it is not news to the user (and ``exc`` itself says it all).
        # A peer we cannot reach or whose connection broke mid-send: the session works
        # out who failed (the peer, or another rank whose failure made the peer leave).
        if self.closing:
            return exc
        return await self.on_peer_lost(dst, f"sending to it failed ({exc})") or exc

    async def send_error(self, dst: int, header: Any) -> None:
        """Send ``PEER_ERROR`` with ``header`` to ``dst`` (connecting first if need be)."""
        if dst != self.rank and dst not in self.left:
            channel = self.routes.get(dst) or await self.connect(dst)
            await channel.send(MessageKind.PEER_ERROR, header)

    def send_abort(self, dst: int, key: Key, info: list[Any]) -> None:
        """Send ``PEER_ABORT`` for ``key`` to ``dst``, in order with this rank's DATA to it.

        ``info`` is ``[rank, reason, what]``. Best effort: a peer that cannot be
        reached learns of the failure as it learns of any other.
        """
        header: list[Any] = [*key, info]
        if dst == self.rank:
            self.arrived(dst, key, aborted_message(dst, header))
        else:
            self.send_notice(dst, MessageKind.PEER_ABORT, header)

    def send_notice(self, dst: int, kind: MessageKind, header: list[Any]) -> None:
        """Send a header-only frame to peer ``dst`` now, in order with what follows it.

        On a connected channel it is written right here (as ``send_now`` writes
        data), so the caller's next message to ``dst`` cannot overtake it; else
        it goes once connected. Best effort: a peer that cannot be reached
        learns of what it says as it learns of any failure.
        """
        channel = self.routes.get(dst)
        if channel is None:
            self.spawn(self._send_notice_later(dst, kind, header))
        else:
            self.write(channel, kind, header)

    async def _send_notice_later(self, dst: int, kind: MessageKind, header: list[Any]) -> None:
        try:
            channel = self.routes.get(dst) or await self.connect(dst)
            await channel.send(kind, header)
        except (OSError, DistError) as exc:
            logger.debug("sending %s to rank %d failed: %s", kind.name, dst, exc)

    # --- receiving: post's awaitable form -------------------------------------------------

    def recv(
        self, src: int | None, key: Key, dest: memoryview | None = None
    ) -> asyncio.Future[Received]:
        """Post a receive (``post``); the future resolves with the matched message."""
        future: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        self.post(src, key, dest, functools.partial(_resolve, future))
        return future

    def send_to(self, rank: int, kind: MessageKind, header: list[Any]) -> None:
        self.send_notice(rank, kind, header)  # the core's action (bulk's clears and credits)

    def fail(
        self, exc: BaseException, group_id: int | None = None, *, keep_p2p: bool = False
    ) -> None:
        """Fail every posted receive (of ``group_id``, if given) with ``exc`` (``PlaneCore``)."""
        if (group_id is None or keep_p2p) and self.use_shm:  # a rank died (or the session broke)
            self.failed = True
            shm.remove_stale()  # its segments may linger
        super().fail(exc, group_id, keep_p2p=keep_p2p)
