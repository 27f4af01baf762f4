"""The data plane's channels, in asyncio: listening, connecting, the actions of the core.

``core.PlaneCore`` decides and ``channel.ChannelState`` reads each channel,
sans-IO; ``Connections`` is the I/O around them: it listens on the
transports the job names (``routes.py``), connects to a peer once per
attempt shared by every caller and waits for the handshake, does the actions
the core asks for (writes, the session's verdicts in tasks), and closes with
goodbyes. ``DataPlane`` (``peers.py``) adds the messaging on top.

A plane that closes says ``PEER_BYE`` on every channel and waits (briefly) for
each peer to answer with its own before it closes them: once answered, a peer
has read everything this rank sent it, so the server's word that this rank
left (sent after the close) cannot overtake any of it.

The data planes of one process share one Unix-socket listener (per event loop):
each publishes ``uds:NAME#MEMBER``, and ``member`` in the hello says which
plane an accepted channel belongs to (0 on a plane's own listeners).

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
from typing import TYPE_CHECKING, Any, Final

from aiodist import _settings
from aiodist._errors import DistError
from aiodist._plane import routes
from aiodist._plane.channel import ChannelState
from aiodist._plane.core import PlaneCore
from aiodist._plane.listener import SharedListener, preauth_limits, shared_listener
from aiodist._plane.routes import Selection
from aiodist._transport import registry, shm, shmrows
from aiodist._wire.headers import MESSAGES
from aiodist._wire.messages import HostIds, PeerBye

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from aiodist._errors import AuthenticationError
    from aiodist._transport.base import DataChannel, Listener
    from aiodist._wire.messages import PeerError

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


class Connections(PlaneCore):
    """The channels of one data plane: listening, connecting, closing."""

    def __init__(
        self,
        job: str,
        *,
        on_peer_lost: Callable[[int, str], Awaitable[BaseException | None]] | None = None,
        on_peer_error: Callable[[int, PeerError], None] | None = None,
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
        super().__init__(job, token or _settings.TOKEN.read())
        self.selection = (
            transport if isinstance(transport, Selection) else routes.selection(transport)
        )
        self.on_peer_refused = on_peer_refused or self.fail
        self.on_peer_lost = on_peer_lost or _no_verdict
        self.on_peer_left = on_peer_left or _left_alone  # the error for a peer that said bye
        self.on_peer_error = on_peer_error or (lambda src, error: None)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._bye_news: asyncio.Event | None = None  # set when a goodbye or a close comes
        self._listeners: list[Listener] = []  # this plane's own (TCP, registered ones)
        self._shared: SharedListener | None = None  # the process's Unix-socket listener
        self._member = 0  # this plane's number on it
        self._lookup: Callable[[], Awaitable[PeerTable]] | None = None
        self._table: PeerTable | None = None
        self._host_ids: Sequence[int] = ()
        self._connecting: dict[int, asyncio.Future[DataChannel]] = {}
        # Per peer, the last message to it not yet in its channel: the next waits for it.
        self.unwritten: dict[int, asyncio.Future[None]] = {}
        self._handshakes: dict[DataChannel, asyncio.Future[None]] = {}  # this rank's, running
        self.use_uds = self.selection.use_uds
        self.use_shm = self.selection.use_shm
        self.shm_agreement: dict[int, bool] = {}  # group id -> shared_memory_agreed(its ranks)
        self.segments = shm.SharedSegments()  # the shared-memory collectives' (``_ops``)
        # This rank's rows segment (``shmrows``, ``_ops.board``; peers' are in ``segments``).
        self.rows: shm.Segment | None = None
        self.on_bell: Callable[[], None] | None = None  # a peer's bell: its board looks
        self.failed = False  # a session-wide failure happened: sweep the segments at close
        # What this rank sent its peers: messages and their payloads' bytes (``send_now``).
        self.messages_sent = 0
        self.bytes_sent = 0
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
            if name in ("tcp", "tls") and self.use_uds and routes.is_loopback(host):
                continue  # every member is on this host: the Unix socket reaches them
            transport = registry.get_transport(name)
            listener = await transport.listen(
                host, functools.partial(ChannelState, self), preauth=preauth_limits()
            )
            self._listeners.append(listener)
            addresses.append(listener.address)
        if self.use_shm:  # not an address: the promise to use shared memory with peers that agree
            addresses.append(shm.capability())
            if self.rows is None and shmrows.supported():
                try:
                    self.rows = shmrows.create()
                except OSError as exc:
                    logger.warning("small collectives keep to sockets: %s", exc)
            if self.rows is not None:
                addresses.append(shmrows.address(self.rows))
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

    @property
    def host_ids(self) -> Sequence[int]:
        """The host id of every rank (equal ids, same host)."""
        return self._host_ids

    def grow(self, world_size: int, host_ids: Sequence[int]) -> None:
        """The job grew to ``world_size`` ranks (an elastic job admitted newcomers).

        The peer table is fetched again on the next connect; hellos of newcomers
        that came before this news are answered now.
        """
        self._host_ids = host_ids
        self._table = None
        self.set_rank(self.rank, world_size)

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
        table = await self.addresses()
        return all(mine in table.get(r, ()) for r in ranks)

    async def shares_memory(self, group_id: int, ranks: Sequence[int]) -> bool:
        """``shared_memory_agreed(ranks)`` for group ``group_id``, asked once per group."""
        known = self.shm_agreement.get(group_id)
        if known is None:
            known = self.shm_agreement[group_id] = await self.shared_memory_agreed(ranks)
        return known

    async def addresses(self) -> PeerTable:
        if self._table is not None:
            return self._table
        assert self._lookup is not None, "set_members() first"
        size = self.world_size
        table = await self._lookup()
        if self.world_size == size:  # not a table the job outgrew while it came (``grow``)
            self._table = table
        return table

    # --- connecting ---------------------------------------------------------------------

    async def connect(self, dst: int) -> DataChannel:
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
        addresses = (await self.addresses()).get(dst, ())
        if not addresses and dst < self.world_size:
            self._table = None  # fetched before the job grew: fetch it again
            addresses = (await self.addresses()).get(dst, ())
        local = self.all_local([dst])
        try:
            channel = await routes.connect(
                dst, addresses, side, local=local, use_uds=self.use_uds, use_shm=self.use_shm
            )
        except routes.TlsMismatch as exc:
            raise self.refuse(dst, str(exc)) from None  # for good: it would be refused again
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
            await self.connect(rank)
        except (OSError, DistError) as exc:
            # A refusal was reported by _connect; a rank that cannot be reached is for
            # liveness (the server's heartbeats) to judge, not this probe.
            logger.debug("checking rank %d's token: %s", rank, exc)

    def spawn(self, coro: Awaitable[object]) -> None:
        # Work started from a frame or close callback (which cannot await).
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("data-plane background task failed: %s", task.exception())

    # --- PlaneCore's actions, done ---------------------------------------------------------

    def write(self, channel: DataChannel, kind: int, header: list[Any]) -> None:
        try:
            rest = channel.send_nowait(kind, header)  # a frame the kernel took needs no task
        except OSError as exc:
            logger.debug("sending %s to %s failed: %s", MESSAGES.name(kind), channel.peer, exc)
            return
        if rest is not None:
            self.spawn(rest)

    def proved(self, channel: DataChannel) -> None:
        channel.handshake_done()

    def abort(self, channel: DataChannel) -> None:
        channel.abort()

    def connected(self, channel: DataChannel, error: BaseException | None) -> None:
        proved = self._handshakes.get(channel)
        if proved is None or proved.done():
            return
        if error is None:
            proved.set_result(None)
        else:
            proved.set_exception(error)

    def probe(self, rank: int) -> None:
        self.spawn(self._probe(rank))

    def lost(self, rank: int, reason: str) -> None:
        self.spawn(self.on_peer_lost(rank, reason))

    def bye_heard(self, rank: int) -> None:
        self.spawn(self._said_bye(rank))

    async def _said_bye(self, src: int) -> None:
        self.peer_left(src, await self.on_peer_left(src))

    def refused_peer(self, exc: AuthenticationError) -> None:
        self.on_peer_refused(exc)

    def peer_error(self, src: int, error: PeerError) -> None:
        self.on_peer_error(src, error)

    def rang(self) -> None:
        if self.on_bell is not None:
            self.on_bell()

    def news(self) -> None:
        if self._bye_news is not None:
            self._bye_news.set()

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
                            await channel.send(PeerBye.KIND, [])
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
        self.segments.close(sweep=self.failed)  # a dead peer's may outlive the sweep at fail
        if self.rows is not None:
            self.rows.close()
            self.rows = None
