"""The data plane of one session: the asyncio around ``core.PlaneCore``.

``core.py`` decides (peer states, matching, failures), ``channel.py`` reads
each channel (its handshake, its frames), ``bulk.py`` moves large payloads
once their receive is posted; this module listens, connects, writes, waits,
and does the actions they ask for.

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

One primitive per level: ``post`` is the receive (a callback, ``recv`` its
awaitable form); ``send_now`` is the send (as far as it goes without waiting,
``send`` its awaitable form).

A plane that closes says ``PEER_BYE`` on every channel and waits (briefly) for
each peer to answer with its own before it closes them: once answered, a peer
has read everything this rank sent it, so the server's word that this rank
left (sent after the close) cannot overtake any of it.

The data planes of one process share one Unix-socket listener (per event loop):
each publishes ``uds:NAME#MEMBER``, and ``member`` in the hello says which
plane an accepted channel belongs to (0 on a plane's own listeners). Which
transports a plane listens on, and which one reaches a peer: ``routes.py``.

With a job token (``$AIODIST_TOKEN``) both ends prove it before either
accepts a frame from the other. A rank with a token refuses a peer that cannot
prove it, whichever side connected: as the connecting side at once; as the
accepting side by connecting to the rank the refused hello claimed to be (a
stranger may claim any rank, so the claim alone breaks nothing). A refused
rank stays refused: ``AuthenticationError`` (naming it) goes to
``on_peer_refused``, which breaks the groups that need it, and later sends to
it and receives from it fail at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import AbortedError, DistError
from aiodist._plane import routes
from aiodist._plane.bulk import BULK_MIN_BYTES
from aiodist._plane.channel import ChannelState
from aiodist._plane.core import PlaneCore
from aiodist._plane.listener import SharedListener, preauth_limits, shared_listener
from aiodist._plane.receives import Received, aborted_message
from aiodist._plane.routes import Selection
from aiodist._transport import registry, shm
from aiodist._wire.keys import Key, MatchKind
from aiodist._wire.messages import HostIds, MessageKind

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Sequence

    from aiodist._errors import AuthenticationError
    from aiodist._transport.base import DataChannel, Listener
    from aiodist._wire.frame import Buffer

__all__ = ["DataPlane", "Key", "Received"]

logger = logging.getLogger(__name__)

# Each rank's data-plane addresses.
PeerTable = dict[int, tuple[str, ...]]
# How long a connecting rank waits for the accepting rank's proof of the token.
HANDSHAKE_TIMEOUT: Final = 30.0
# How long a closing plane waits for its peers to answer its goodbyes.
BYE_TIMEOUT: Final = 1.0


async def _no_verdict(rank: int, reason: str) -> BaseException | None:
    return None  # until a session takes over the plane's peer failures


async def _left_alone(rank: int) -> BaseException:
    return ConnectionResetError(f"rank {rank} left")  # until a session names it better


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


class DataPlane(PlaneCore):
    """Channels to every peer of a session, and the receives waiting on them."""

    def __init__(
        self,
        job: str,
        *,
        on_peer_lost: Callable[[int, str], Awaitable[BaseException | None]] | None = None,
        on_peer_error: Callable[[int, Any], None] | None = None,
        on_peer_refused: Callable[[AuthenticationError], None] | None = None,
        token: str | None = None,
        on_peer_left: Callable[[int], Awaitable[BaseException]] | None = None,
        transport: str | Sequence[str] | Selection | None = None,
    ) -> None:
        """``token`` defaults to ``$AIODIST_TOKEN``; without one, peers are not authenticated.

        ``on_peer_refused`` hears of a peer that failed the token handshake
        (default: fail every posted receive with the error). ``transport``
        names the transports to listen on (default ``$AIODIST_TRANSPORT``, see
        ``routes.py``); ``ValueError`` if one is unknown.
        """
        super().__init__(job, token or os.environ.get("AIODIST_TOKEN") or None)
        self.selection = (
            transport if isinstance(transport, Selection) else routes.selection(transport)
        )
        self.on_peer_refused = on_peer_refused or self.fail
        self.on_peer_lost = on_peer_lost or _no_verdict
        self.on_peer_left = on_peer_left or _left_alone  # the error for a peer that said bye
        self.on_peer_error = on_peer_error or (lambda src, header: None)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._bye_news: asyncio.Event | None = None  # set when a goodbye or a close comes
        self._listeners: list[Listener] = []  # this plane's own (TCP, registered ones)
        self._shared: SharedListener | None = None  # the process's Unix-socket listener
        self._member = 0  # this plane's number on it
        self._lookup: Callable[[], Awaitable[PeerTable]] | None = None
        self._table: PeerTable | None = None
        self._host_ids: Sequence[int] = ()
        self._connecting: dict[int, asyncio.Future[DataChannel]] = {}
        self._handshakes: dict[DataChannel, asyncio.Future[None]] = {}  # this rank's, running
        self.use_uds = self.selection.use_uds
        self.use_shm = self.selection.use_shm
        self.shm_agreement: dict[int, bool] = {}  # group id -> shared_memory_agreed(its ranks)
        self.segments = shm.SharedSegments()
        self._failed = False  # a session-wide failure happened
        if self.use_shm:
            shm.remove_stale(if_changed=True)  # left by earlier jobs' ranks that crashed

    async def listen(self, host: str) -> list[str]:
        """Start listening; return the addresses to publish, in the order peers should try them.

        ``host`` is the numeric address this rank reaches the rendezvous server
        from. A loopback address means that every member is on this host (no other
        host reaches the server there), so a Unix socket is then all a rank listens
        on of the built-in transports. That socket is the process's, shared by all
        its data planes: this one publishes it with its own member number.
        """
        addresses = []
        for name in self.selection.order:
            if name in ("uds", "shm"):
                if self.use_uds and self._shared is None:
                    # With shared memory on, the Unix socket channels carry rings.
                    shared = await shared_listener(self.use_shm)
                    self._member, address = shared.add(self)
                    self._shared = shared
                    addresses.append(address)
                continue
            if name == "tcp" and self.use_uds and routes.is_loopback(host):
                continue  # every member is on this host: the Unix socket reaches them
            transport = registry.get_transport(name)
            listener = await transport.listen(
                host, functools.partial(ChannelState, self), preauth=preauth_limits()
            )
            self._listeners.append(listener)
            addresses.append(listener.address)
        if self.use_shm:  # not an address: the promise to use shared memory with peers that agree
            addresses.append(shm.capability())
        return addresses

    def set_members(
        self,
        rank: int,
        world_size: int,
        lookup: Callable[[], Awaitable[PeerTable]],
        host_ids: Sequence[int],
    ) -> None:
        """Join the job as ``rank``; ``lookup`` fetches the peers' addresses on first connect.

        ``host_ids[r]`` tells apart the hosts of the ranks: equal ids, same host.
        """
        self._lookup = lookup
        self._host_ids = host_ids
        self.set_rank(rank, world_size)

    def all_local(self, ranks: Sequence[int]) -> bool:
        """True if every one of ``ranks`` (global) runs on this host."""
        ids = self._host_ids
        if isinstance(ids, HostIds) and ids.runs == 1:
            return True  # the usual case: one host for the whole job
        mine = ids[self.rank]
        return all(ids[r] == mine for r in ranks)

    async def shared_memory_agreed(self, ranks: Sequence[int]) -> bool:
        """True if every one of ``ranks`` runs on this host and published ``shm.capability()``.

        Every rank reads the same member table from the server, so every rank of
        a group gets the same answer, whatever ``AIODIST_SHM`` says on each.
        """
        if not self.use_shm or not self.all_local(ranks):
            return False
        mine = shm.capability()
        table = await self._addresses()
        return all(mine in table.get(r, ()) for r in ranks)

    async def _addresses(self) -> PeerTable:
        if self._table is None:
            assert self._lookup is not None, "set_members() first"
            self._table = await self._lookup()
        return self._table

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
            channel = self.routes.get(dst) or await self._connect(dst)
            await channel.send(MessageKind.DATA, header, payload)
        except OSError as exc:
            raise await self._send_failed(dst, exc) from exc

    async def _finish_send(self, dst: int, rest: Awaitable[None]) -> None:
        try:
            await rest
        except OSError as exc:
            raise await self._send_failed(dst, exc) from exc

    async def _raise_send_failed(self, dst: int, exc: OSError) -> None:
        raise await self._send_failed(dst, exc) from exc

    async def _send_failed(self, dst: int, exc: OSError) -> BaseException:
        # A peer we cannot reach or whose connection broke mid-send: the session works
        # out who failed (the peer, or another rank whose failure made the peer leave).
        if self.closing:
            return exc
        return await self.on_peer_lost(dst, f"sending to it failed ({exc})") or exc

    async def send_error(self, dst: int, header: Any) -> None:
        """Send ``PEER_ERROR`` with ``header`` to ``dst`` (connecting first if need be)."""
        if dst != self.rank and dst not in self.left:
            channel = self.routes.get(dst) or await self._connect(dst)
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
            self._spawn(self._send_notice_later(dst, kind, header))
        else:
            self.write(channel, kind, header)

    async def _send_notice_later(self, dst: int, kind: MessageKind, header: list[Any]) -> None:
        try:
            channel = self.routes.get(dst) or await self._connect(dst)
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

    # --- connecting ---------------------------------------------------------------------

    async def _connect(self, dst: int) -> DataChannel:
        """The channel to ``dst``: the one there is, or one attempt shared by every caller.

        The attempt runs in a task of its own: a caller cancelled while it waits
        (an operation that was aborted) leaves it to the others, which would
        otherwise fail with that caller's cancellation.
        """
        pending = self._connecting.get(dst)
        if pending is None:
            refused = self.refused.get(dst)
            if refused is not None:
                raise refused  # never retried: it would be refused again
            pending = asyncio.ensure_future(self._open_channel(dst))
            self._connecting[dst] = pending
            self._tasks.add(pending)
            self.connect_started(dst)
            pending.add_done_callback(functools.partial(self._attempt_done, dst))
        return await asyncio.shield(pending)

    def _attempt_done(self, dst: int, task: asyncio.Future[DataChannel]) -> None:
        self._tasks.discard(task)
        if self._connecting.get(dst) is task:
            del self._connecting[dst]
            self.connect_ended(dst)
        if not task.cancelled():
            task.exception()  # retrieved: every caller re-raises it

    async def _open_channel(self, dst: int) -> DataChannel:
        side = ChannelState(self)
        addresses = (await self._addresses()).get(dst, ())
        local = self.all_local([dst])
        channel = await routes.connect(
            dst, addresses, side, local=local, use_uds=self.use_uds, use_shm=self.use_shm
        )
        proved: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._handshakes[channel] = proved
        try:
            side.connect(channel, dst)
            if not proved.done():
                try:
                    await asyncio.wait_for(asyncio.shield(proved), HANDSHAKE_TIMEOUT)
                except TimeoutError:
                    raise ConnectionError(
                        f"rank {dst} did not answer the token handshake within "
                        f"{HANDSHAKE_TIMEOUT:.0f} s"
                    ) from None
            proved.result()  # the handshake's error, if it failed
        except BaseException:
            channel.abort()
            raise
        finally:
            self._handshakes.pop(channel, None)
        return self.routes.get(dst, channel)  # a channel it opened to us may be the route

    async def _probe(self, rank: int) -> None:
        try:
            await self._connect(rank)
        except (OSError, DistError) as exc:
            # A refusal was reported by _connect; a rank that cannot be reached is for
            # liveness (the server's heartbeats) to judge, not this probe.
            logger.debug("checking rank %d's token: %s", rank, exc)

    def _spawn(self, coro: Awaitable[object]) -> None:
        # Work started from a frame or close callback (which cannot await).
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("data-plane background task failed: %s", task.exception())

    # --- PlaneCore's actions, done ---------------------------------------------------------

    def write(self, channel: DataChannel, kind: MessageKind, header: list[Any]) -> None:
        try:
            rest = channel.send_nowait(kind, header)  # a frame the kernel took needs no task
        except OSError as exc:
            logger.debug("sending %s to %s failed: %s", kind.name, channel.peer, exc)
            return
        if rest is not None:
            self._spawn(rest)

    def proved(self, channel: DataChannel) -> None:
        channel.handshake_done()

    def abort(self, channel: DataChannel) -> None:
        channel.abort()

    def send_to(self, rank: int, kind: MessageKind, header: list[Any]) -> None:
        self.send_notice(rank, kind, header)

    def connected(self, channel: DataChannel, error: BaseException | None) -> None:
        proved = self._handshakes.get(channel)
        if proved is None or proved.done():
            return
        if error is None:
            proved.set_result(None)
        else:
            proved.set_exception(error)

    def probe(self, rank: int) -> None:
        self._spawn(self._probe(rank))

    def lost(self, rank: int, reason: str) -> None:
        self._spawn(self.on_peer_lost(rank, reason))

    def bye_heard(self, rank: int) -> None:
        self._spawn(self._said_bye(rank))

    async def _said_bye(self, src: int) -> None:
        self.peer_left(src, await self.on_peer_left(src))

    def refused_peer(self, exc: AuthenticationError) -> None:
        self.on_peer_refused(exc)

    def peer_error(self, src: int, header: Any) -> None:
        self.on_peer_error(src, header)

    def news(self) -> None:
        if self._bye_news is not None:
            self._bye_news.set()

    def fail(self, exc: BaseException, group_id: int | None = None) -> None:
        """Fail every posted receive (of ``group_id``, if given) with ``exc`` (``PlaneCore``)."""
        if group_id is None and self.use_shm:  # a rank died (or the session broke)
            self._failed = True
            shm.remove_stale()  # its segments may linger
        super().fail(exc, group_id)

    # --- closing ------------------------------------------------------------------------

    async def aclose(self, *, bye: bool = True) -> None:
        """Say goodbye to every peer (unless not ``bye``), then close channels and listeners.

        A goodbye tells a peer that this rank left the job cleanly; without one, a
        peer finds out why the channel closed some other way (from the server).
        """
        self.closing = True
        # Goodbyes first: closing a listener may close its accepted channels too (uvloop).
        channels = list(self.channels)
        if bye:
            self._bye_news = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(BYE_TIMEOUT):
                    for channel in channels:
                        with contextlib.suppress(OSError):
                            await channel.send(MessageKind.PEER_BYE, [])
                    # Each peer answers once it read all this rank sent it (see above).
                    while any(c in self.channels and c not in self.byes for c in channels):
                        self._bye_news.clear()
                        await self._bye_news.wait()
        for channel in channels:
            channel.close()
        for listener in self._listeners:
            listener.close()
        if self._shared is not None:
            self._shared.remove(self._member)
            self._shared = None
        for task in list(self._tasks):
            task.cancel()
        self.forget_channels()
        self.segments.close(sweep=self._failed)  # a dead peer's may outlive the sweep at fail
