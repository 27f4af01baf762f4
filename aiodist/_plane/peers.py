"""The data plane of one session: listeners, lazy peer channels, matching.

Wire use: a channel opens with ``PEER_HELLO [job, rank, pid, member]`` from
the side that connected; every message after it is ``DATA [kind, group, a, b, meta]``
with a raw payload. ``(kind, group, a, b)`` is the match key (``_wire/keys.py``
has its kinds, ``MatchKind``). ``meta`` is small plain
data the operation checks (dtype, shape, op). ``PEER_ERROR`` carries an error
that breaks a group on every member (or aborts one call of it, see
``drop_call``); ``PEER_ABORT`` takes the place of a message whose send failed
before its data left, so the receive it matches fails instead of taking a later
message; ``PEER_BYE`` precedes a clean close.

A plane that closes says ``PEER_BYE`` on every channel and waits (briefly) for
each peer to answer with its own before it closes them: once answered, a peer
has read everything this rank sent it, so the server's word that this rank
left (sent after the close) cannot overtake any of it. A peer that said
goodbye, or that the server says left the job (``peer_left``), has *left*:
once no channel from it is open, the receives waiting on it fail, and so does
every later receive from it that nothing already delivered matches, and every
send to it.

The data planes of one process share one Unix-socket listener (per event loop):
each publishes ``uds:NAME#MEMBER``, and ``member`` in the hello says which
plane an accepted channel belongs to (0 on a plane's own TCP listener).

With a job token (``$AIODIST_TOKEN``), ``PEER_HELLO`` carries a fresh nonce
and both ends prove the token with ``PEER_AUTH`` before either accepts a
frame from the other (``auth.py`` has the exchange): a process that is not a
member of the job cannot deliver data, claim a rank, or make a rank unpickle.
A rank with a token refuses a peer that cannot prove it, whichever side
connected: as the connecting side at once; as the accepting side by
connecting to the rank the refused hello claimed to be (a stranger may claim
any rank, so the claim alone breaks nothing). A refused rank stays refused:
``AuthenticationError`` (naming it) goes to ``on_peer_refused``, which
breaks the groups that need it, and later sends to it and receives from it
fail at once.

Each direction of a peer pair uses one channel, so messages from one source
with one key arrive in send order. A payload whose receive is already posted
is read straight into the receiver's memory; otherwise it is buffered once.
Point-to-point tensors from ``_bulk.BULK_MIN_BYTES`` move only once their
receive is posted (``bulk.py``): announced first (a DATA header of seven
fields, ``[..., meta, id, nbytes]``), unless the receiver already sent a
credit for them (a DATA message of kind ``CREDIT``, handled on arrival).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import AuthenticationError, DistError, ProtocolError
from aiodist._plane.bulk import BULK_MIN_BYTES, BulkTransfers
from aiodist._plane.link import Link, Posted, Received, aborted_message
from aiodist._plane.listener import SharedListener, preauth_limits, shared_listener
from aiodist._plane.matching import Matcher
from aiodist._transport import shm, shmring, tcp, uds
from aiodist._wire import auth
from aiodist._wire.keys import Key, MatchKind, call_of
from aiodist._wire.messages import HostIds, MessageKind

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Sequence

    from aiodist._transport.base import DataChannel, Listener
    from aiodist._wire.frame import Buffer

__all__ = ["DataPlane", "Key", "Received"]

logger = logging.getLogger(__name__)

# Each rank's data-plane addresses.
PeerTable = dict[int, tuple[str, ...]]
# How long a connecting rank waits for the accepting rank's proof of the token.
HANDSHAKE_TIMEOUT: Final = 30.0
# Aborted calls whose late messages are still dropped (see drop_call).
_DEAD_CALLS_KEPT: Final = 4096


# How long a closing plane waits for its peers to answer its goodbyes.
BYE_TIMEOUT: Final = 1.0


@functools.cache  # asked by every member that joins; a process has few local addresses
def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _last_handshake_frame(channel: DataChannel, kind: MessageKind, header: Any) -> None:
    """Send this side's last handshake frame, and lift the channel's limits right behind it.

    Both in one turn of the loop: whatever the peer sends once it has read the
    frame is read under the full limits, and a transport's own frames that
    follow (``shmring``'s RING_HELLO) come after it on the wire.
    """
    rest = channel.send_nowait(kind, header)
    channel.handshake_done()
    if rest is not None:
        await rest


async def _no_verdict(rank: int, reason: str) -> BaseException | None:
    return None  # until a session takes over the plane's peer failures


async def _left_alone(rank: int) -> BaseException:
    return ConnectionResetError(f"rank {rank} left")  # until a session names it better


class DataPlane:
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
    ) -> None:
        """``token`` defaults to ``$AIODIST_TOKEN``; without one, peers are not authenticated.

        ``on_peer_refused`` hears of a peer that failed the token handshake
        (default: fail every posted receive with the error).
        """
        self.job = job
        self.token = token or os.environ.get("AIODIST_TOKEN") or None
        self.on_peer_refused = on_peer_refused or self.fail
        self._refused: dict[int, AuthenticationError] = {}  # peers that failed the handshake
        self._tasks: set[asyncio.Task[object]] = set()
        self.rank = -1
        self.world_size = 0
        self.matcher: Matcher[Posted, Received] = Matcher()
        self._dead_calls: dict[tuple[int, int], None] = {}  # (group, call): ordered, bounded
        self.on_peer_lost = on_peer_lost or _no_verdict
        self.on_peer_left = on_peer_left or _left_alone  # the error for a peer that said bye
        self.on_peer_error = on_peer_error or (lambda src, header: None)
        # Peers that left, and the error of what needs them; those whose channels are all
        # closed (nothing more can come from them); the open channels of each peer.
        self.left: dict[int, BaseException] = {}
        self._gone: set[int] = set()
        self._by_src: dict[int, set[DataChannel]] = {}
        self._byes: set[DataChannel] = set()  # channels whose peer said (or answered) goodbye
        self._bye_news: asyncio.Event | None = None  # set when a goodbye or a close comes
        self._listeners: list[Listener] = []  # this plane's own (TCP)
        self._shared: SharedListener | None = None  # the process's Unix-socket listener
        self._member = 0  # this plane's number on it
        self._lookup: Callable[[], Awaitable[PeerTable]] | None = None
        self._table: PeerTable | None = None
        self._host_ids: Sequence[int] = ()
        self._early_hellos: list[tuple[Link, DataChannel, Any]] = []
        self._orphans: list[Posted] = []  # receives cut off mid-payload (see Link)
        self._arriving: set[Link] = set()  # links receiving a payload for a posted receive
        self._out: dict[int, DataChannel] = {}
        self._connecting: dict[int, asyncio.Future[DataChannel]] = {}
        self._channels: set[DataChannel] = set()
        self._closing = False
        self.use_uds = uds.available() and os.environ.get("AIODIST_UDS", "1") != "0"
        self.use_shm = shm.available()
        self.shm_agreement: dict[int, bool] = {}  # group id -> shared_memory_agreed(its ranks)
        self.segments = shm.SharedSegments()
        self._failed = False  # a session-wide failure happened
        self.bulk = BulkTransfers(self)
        if self.use_shm:
            shm.remove_stale(if_changed=True)  # left by earlier jobs' ranks that crashed

    async def listen(self, host: str) -> list[str]:
        """Start listening; return the addresses to publish.

        ``host`` is the numeric address this rank reaches the rendezvous server
        from. A loopback address means that every member is on this host (no other
        host reaches the server there), so a Unix socket is then all a rank listens
        on. That socket is the process's, shared by all its data planes: this one
        publishes it with its own member number.
        """
        addresses = []
        if self.use_uds:  # with shared memory on, the Unix socket channels carry rings
            shared = await shared_listener(self.use_shm)
            self._member, address = shared.add(self)
            self._shared = shared
            addresses.append(address)
        if not (self.use_uds and _is_loopback(host)):
            self._listeners.append(
                await tcp.listen(host, lambda: Link(self), preauth=preauth_limits())
            )
        addresses += [lst.address for lst in self._listeners]
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
        self.rank = rank
        self.world_size = world_size
        self._lookup = lookup
        self._host_ids = host_ids
        for src, channel in list(self._out.items()):  # said hello before the table came
            if not 0 <= src < world_size:
                logger.warning("closing a data channel from rank %d, not a member", src)
                del self._out[src]
                channel.abort()
        early, self._early_hellos = self._early_hellos, []
        for link, channel, header in early:  # peers that said hello before our Welcome
            try:
                link._hello_received(channel, header)
            except ProtocolError as exc:
                logger.warning("closing a data channel: %s", exc)
                channel.abort()

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

    # --- sending ------------------------------------------------------------------------

    async def send(self, dst: int, key: Key, meta: Any, payload: Buffer | None) -> None:
        """Send one message to global rank ``dst``; returns when ``payload`` may be reused."""
        if dst in self.left:
            raise self.left[dst]
        if dst == self.rank:
            data = memoryview(bytes(payload) if payload is not None else b"")
            self.arrived(dst, key, Received(dst, meta, data))
            return
        if key[0] == MatchKind.P2P and payload is not None:
            view = memoryview(payload).cast("B")
            if view.nbytes >= BULK_MIN_BYTES:
                await self.bulk.send(dst, key, meta, view)
                return
        await self.send_header(dst, [*key, meta], payload)

    async def send_header(self, dst: int, header: list[Any], payload: Buffer | None = None) -> None:
        """Send one DATA frame with ``header`` to peer ``dst`` (not this rank)."""
        if dst in self.left:
            raise self.left[dst]
        try:
            channel = self._out.get(dst) or await self._connect(dst)
            await channel.send(MessageKind.DATA, header, payload)
        except OSError as exc:
            raise await self._send_failed(dst, exc) from exc

    def send_now(
        self, dst: int, key: Key, meta: Any, payload: Buffer | None
    ) -> Coroutine[Any, Any, None] | None:
        """Send like ``send``, as far as it goes without waiting.

        Returns None once the message is handed to the kernel (the usual case for
        a small one on a connected channel), else a coroutine that finishes the
        send as ``send`` would: await it (in a task) before reusing ``payload``.
        """
        if dst == self.rank:
            data = memoryview(bytes(payload) if payload is not None else b"")
            self.arrived(dst, key, Received(dst, meta, data))
            return None
        channel = self._out.get(dst)
        if (
            channel is None
            or dst in self.left
            or (
                key[0] == MatchKind.P2P
                and payload is not None
                and memoryview(payload).nbytes >= BULK_MIN_BYTES
            )
        ):
            return self.send(dst, key, meta, payload)  # connect first, or announce: no shortcut
        try:
            # Written here, in the caller: a frame the kernel took at once needs no
            # task and no loop turn.
            rest = channel.send_nowait(MessageKind.DATA, [*key, meta], payload)
        except OSError as exc:
            return self._raise_send_failed(dst, exc)
        return None if rest is None else self._finish_send(dst, rest)

    async def _finish_send(self, dst: int, rest: Awaitable[None]) -> None:
        try:
            await rest
        except OSError as exc:
            raise await self._send_failed(dst, exc) from exc

    async def _raise_send_failed(self, dst: int, exc: OSError) -> None:
        raise await self._send_failed(dst, exc) from exc

    async def send_error(self, dst: int, header: Any) -> None:
        if dst != self.rank and dst not in self.left:
            channel = self._out.get(dst) or await self._connect(dst)
            await channel.send(MessageKind.PEER_ERROR, header)

    async def _send_failed(self, dst: int, exc: OSError) -> BaseException:
        # A peer we cannot reach or whose connection broke mid-send: the session works
        # out who failed (the peer, or another rank whose failure made the peer leave).
        if self._closing:
            return exc
        return await self.on_peer_lost(dst, f"sending to it failed ({exc})") or exc

    def arrived(self, src: int, key: Key, msg: Received) -> None:
        """A whole message from ``src``: settle the receive it matches, or keep it for one.

        A message of a call that was aborted (``drop_call``) is dropped instead:
        its sender had not heard of the abort yet, and no receive will ask for it.
        """
        posted = self.matcher.arrive(src, key)
        if posted is not None:
            self._complete(posted, msg)
        elif not (
            self._dead_calls
            and key[0] == MatchKind.COLLECTIVE
            and (key[1], call_of(key[2])) in self._dead_calls
        ):
            self.matcher.buffer(src, key, msg)

    def drop_call(self, group_id: int, call: int, exc: BaseException) -> None:
        """Abort call ``call`` of group ``group_id`` here: it will never complete.

        Its posted receives fail with ``exc``, its buffered messages are dropped,
        and so are its messages that arrive later (from peers that sent before
        they heard of the abort). Nothing else of the group changes.
        """
        dead = self._dead_calls
        dead[(group_id, call)] = None
        if len(dead) > _DEAD_CALLS_KEPT:
            del dead[next(iter(dead))]

        def hit(key: tuple[int, ...]) -> bool:
            return key[0] == MatchKind.COLLECTIVE and key[1] == group_id and call_of(key[2]) == call

        self.matcher.drop_unexpected_where(hit)
        for posted in self.matcher.take_posted_where(hit):
            posted.settle(exc)
            if posted.future is not None and not posted.future.cancelled():
                posted.future.exception()  # retrieved: the call reports exc itself

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
        channel = self._out.get(dst)
        if channel is None:
            self._spawn(self._send_notice_later(dst, kind, header))
            return
        try:
            rest = channel.send_nowait(kind, header)  # a frame the kernel took needs no task
        except OSError as exc:
            logger.debug("sending %s to rank %d failed: %s", kind.name, dst, exc)
            return
        if rest is not None:
            self._spawn(rest)

    async def _send_notice_later(self, dst: int, kind: MessageKind, header: list[Any]) -> None:
        try:
            channel = self._out.get(dst) or await self._connect(dst)
            await channel.send(kind, header)
        except (OSError, DistError) as exc:
            logger.debug("sending %s to rank %d failed: %s", kind.name, dst, exc)

    async def _connect(self, dst: int) -> DataChannel:
        """The channel to ``dst``: the one there is, or one attempt shared by every caller.

        The attempt runs in a task of its own: a caller cancelled while it waits
        (an operation that was aborted) leaves it to the others, which would
        otherwise fail with that caller's cancellation.
        """
        pending = self._connecting.get(dst)
        if pending is None:
            refused = self._refused.get(dst)
            if refused is not None:
                raise refused  # never retried: it would be refused again
            pending = asyncio.ensure_future(self._open_channel(dst))
            self._connecting[dst] = pending
            self._tasks.add(pending)
            pending.add_done_callback(functools.partial(self._attempt_done, dst))
        return await asyncio.shield(pending)

    def _attempt_done(self, dst: int, task: asyncio.Future[DataChannel]) -> None:
        self._tasks.discard(task)
        if self._connecting.get(dst) is task:
            del self._connecting[dst]
        if not task.cancelled():
            task.exception()  # retrieved: every caller re-raises it

    async def _open_channel(self, dst: int) -> DataChannel:
        link = Link(self, None if self.token else dst)
        channel = await self._open(dst, link)
        try:
            await self._handshake(dst, channel, link)
        except BaseException:
            channel.abort()
            raise
        self._opened(dst, channel)
        return self._out[dst]

    async def _handshake(self, dst: int, channel: DataChannel, link: Link) -> None:
        hello: list[Any] = [self.job, self.rank, os.getpid(), link.member]
        token = self.token
        if token is None:
            await _last_handshake_frame(channel, MessageKind.PEER_HELLO, hello)
            return
        mine = auth.new_nonce()
        link.challenge = asyncio.get_running_loop().create_future()
        await channel.send(MessageKind.PEER_HELLO, [*hello, mine])
        try:
            theirs, proof = await asyncio.wait_for(
                asyncio.shield(link.challenge), HANDSHAKE_TIMEOUT
            )
        except TimeoutError:
            raise ConnectionError(
                f"rank {dst} did not answer the token handshake within {HANDSHAKE_TIMEOUT:.0f} s"
            ) from None
        expected = auth.accept_proof(token, self.job, self.rank, dst, mine, theirs)
        if type(theirs) is not bytes or not auth.verify(expected, proof):
            # An empty nonce is how a rank without a token answers (see Link).
            holds = "it holds no token" if theirs == b"" else "it holds another one"
            raise self._refuse(
                dst,
                f"the process listening at rank {dst}'s data-plane address ({channel.peer}) "
                f"could not prove that it knows the token of job {self.job!r} ({holds}); "
                "refusing to exchange data with it. Set the same AIODIST_TOKEN on every rank",
            )
        link.src = dst  # only now is what arrives on this channel trusted
        await _last_handshake_frame(
            channel,
            MessageKind.PEER_AUTH,
            [b"", auth.connect_proof(token, self.job, self.rank, dst, theirs, mine)],
        )

    def _refuse(self, rank: int, message: str) -> AuthenticationError:
        """Refuse ``rank`` for good and report it; returns the error to raise."""
        exc = self._refused.get(rank)
        if exc is None:
            exc = self._refused[rank] = AuthenticationError(message, rank=rank)
            logger.error("%s", exc)
            self.on_peer_refused(exc)
        return exc

    def _doubt(self, rank: int, why: str) -> None:
        """A connection claiming to be ``rank`` failed the token handshake: ask ``rank``.

        Anyone can claim a rank, so the claim breaks nothing by itself. Connecting
        to the address ``rank`` published settles it: the genuine rank proves the
        token (the claim was a stranger's), or it is refused like any peer that
        cannot, and the operations waiting on it fail now instead of timing out.
        """
        if self._closing:
            return
        # Not a warning of its own: the listener logs each refusal (within its budget).
        logger.debug("refused a data connection claiming to be rank %d: %s", rank, why)
        if (
            rank == self.rank
            or not 0 <= rank < self.world_size
            or rank in self._out
            or rank in self._connecting
            or rank in self._refused
        ):
            return
        self._spawn(self._probe(rank))

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

    def _task_done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("data-plane background task failed: %s", task.exception())

    async def _open(self, dst: int, link: Link) -> DataChannel:
        addresses = (await self._addresses()).get(dst, ())
        uds_addr = [a for a in addresses if a.startswith("uds:")]
        tcp_addr = [a for a in addresses if a.startswith("tcp://")]
        local = self.all_local([dst])
        # A peer that published no TCP address listens on this host only (see listen):
        # its Unix socket is the way, whatever this rank's AIODIST_UDS or host name says.
        if uds_addr and (not tcp_addr or (self.use_uds and local)):
            rings = local and self.use_shm and shm.capability() in addresses
            link.member = uds.member_of(uds_addr[0])  # the hello names it
            try:
                if rings:
                    return await shmring.connect(uds_addr[0], link)
                return await uds.connect(uds_addr[0], link)
            except OSError:
                if not tcp_addr:
                    raise
                logger.debug("falling back to TCP for rank %d", dst)
        if not tcp_addr:
            raise ConnectionError(f"rank {dst} published no reachable data-plane address")
        link.member = 0  # a plane's own TCP listener: no member to name
        return await tcp.connect(tcp_addr[0], link)

    def _adopt(self, src: int, channel: DataChannel) -> None:
        # A peer connected to us and proved itself (or said hello, without a token): what
        # it sends next is read under the full limits, and we send to it on this channel.
        channel.handshake_done()
        self._opened(src, channel)

    def _opened(self, peer: int, channel: DataChannel) -> None:
        self._channels.add(channel)
        self._by_src.setdefault(peer, set()).add(channel)
        self._out.setdefault(peer, channel)

    # --- receiving ----------------------------------------------------------------------

    def recv(
        self, src: int | None, key: Key, dest: memoryview | None = None
    ) -> asyncio.Future[Received]:
        """Post a receive; the future resolves with the matched message.

        With ``dest``, a payload of the same size is written there directly; the
        returned ``Received.data`` is then ``dest`` (else a buffer holding it).
        """
        future: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        if self._refused and src in self._refused:
            future.set_exception(self._refused[src])
            return future
        posted = Posted(future, dest, key)
        found = self.matcher.post(src, key, posted)
        if found is not None:
            self._complete(posted, found[1])
        elif src in self._gone:
            self._settle_left(src)  # nothing more comes from it: fails at once
        elif key[0] == MatchKind.P2P and src is not None:
            self.bulk.offer(src, posted)
        return future

    def post(
        self,
        src: int | None,
        key: Key,
        dest: memoryview | None,
        callback: Callable[[Received | BaseException], None],
    ) -> None:
        """Post a receive that calls ``callback`` once, with the message or the error.

        ``callback`` runs inside the data plane's own callbacks (or right here, if
        the message came first), so it must not raise. ``dest`` is as for ``recv``.
        """
        if self._refused and src in self._refused:
            callback(self._refused[src])
            return
        posted = Posted(None, dest, key, callback)
        found = self.matcher.post(src, key, posted)
        if found is not None:
            self._complete(posted, found[1])
        elif src in self._gone:
            self._settle_left(src)  # nothing more comes from it: fails at once
        elif key[0] == MatchKind.P2P and src is not None:
            self.bulk.offer(src, posted)

    def _complete(self, posted: Posted, msg: Received) -> None:
        if posted.settled:
            return  # failed while its payload was arriving: the operation reported that
        if msg.error is not None:  # its send failed at the sender (PEER_ABORT)
            posted.settle(msg.error)
            return
        if msg.announced is not None:  # a large payload still at its sender
            self.bulk.deliver(posted, msg)
            return
        dest = posted.dest
        if dest is not None and msg.data is not dest and dest.nbytes == msg.data.nbytes:
            dest[:] = msg.data  # it was buffered before the receive was posted
            msg = Received(msg.src, msg.meta, dest)
        posted.settle(msg)

    def fail(self, exc: BaseException, group_id: int | None = None) -> None:
        """Fail every posted receive (of ``group_id``, if given) with ``exc``.

        That includes receives whose payload is arriving: they left the matcher, and
        the connection carrying the rest may outlive the failure (a dead rank's last
        bytes still being read) or never deliver it.
        """

        def hit(key: tuple[int, ...]) -> bool:
            return group_id is None or key[1] == group_id

        if group_id is None and self.use_shm:  # a rank died (or the session broke)
            self._failed = True
            shm.remove_stale()  # its segments may linger
        self.bulk.forget(group_id)  # their senders fail too: never clear them
        posted_list = self.matcher.take_posted_where(hit)
        arriving = [link._posted for link in self._arriving if link._posted is not None]
        posted_list += [p for p in self._orphans + arriving if hit(p.key)]
        self._orphans = [o for o in self._orphans if not hit(o.key)]
        for posted in posted_list:
            posted.settle(exc)

    def fail_p2p(self, exc: BaseException) -> None:
        """Fail every posted point-to-point receive (tensors and objects) with ``exc``."""
        kinds = (
            MatchKind.P2P,
            MatchKind.OBJECT_P2P,
            MatchKind.CLEAR,
            MatchKind.BULK,
        )  # and the large payloads' own messages
        for posted in self.matcher.take_posted_where(lambda k: k[0] in kinds):
            posted.settle(exc)

    def peer_left(self, rank: int, exc: BaseException) -> None:
        """``rank`` left the job: what needs it fails with ``exc``, once all it sent is in.

        Sends to it fail at once. Receives from it fail once no channel from it is
        open (its goodbye and close come after its last message; and before it told
        the server, it waited for this rank to answer its goodbye on each channel).
        The first ``exc`` given for a rank stays.
        """
        self.left.setdefault(rank, exc)
        if not self._by_src.get(rank):
            self._settle_left(rank)  # else _channel_closed settles it

    def _settle_left(self, rank: int) -> None:
        if self._closing or self._by_src.get(rank):
            return
        self._gone.add(rank)
        exc = self.left[rank]
        for posted in self.matcher.take_posted_from(rank):
            posted.settle(exc)

    def _bye_received(self, channel: DataChannel) -> None:
        self._byes.add(channel)
        if self._bye_news is not None:
            self._bye_news.set()
        elif not self._closing:
            # Answer: the peer waits for it before it tells the server that it left.
            self._spawn(channel.send(MessageKind.PEER_BYE, []))

    def _channel_closed(self, link: Link, channel: DataChannel, exc: Exception | None) -> None:
        if self._early_hellos:  # a stranger's hello kept for set_members: forget it
            self._early_hellos = [e for e in self._early_hellos if e[1] is not channel]
        self._channels.discard(channel)
        self._byes.discard(channel)
        if self._bye_news is not None:
            self._bye_news.set()
        src = link.src
        if src is not None:
            if self._out.get(src) is channel:
                del self._out[src]
            open_channels = self._by_src.get(src)
            if open_channels is not None:
                open_channels.discard(channel)
                if not open_channels:
                    del self._by_src[src]
        if self._closing or src is None:
            return
        if src in self.left:
            self._settle_left(src)  # it left: fail what waits on it once its last channel closed
        elif link.said_bye:
            self._spawn(self._said_bye(src))
        else:
            reason = f"its data connection closed ({exc or 'EOF'})"
            self._spawn(self.on_peer_lost(src, reason))

    async def _said_bye(self, src: int) -> None:
        self.peer_left(src, await self.on_peer_left(src))

    async def aclose(self, *, bye: bool = True) -> None:
        """Say goodbye to every peer (unless not ``bye``), then close channels and listeners.

        A goodbye tells a peer that this rank left the job cleanly; without one, a
        peer finds out why the channel closed some other way (from the server).
        """
        self._closing = True
        # Goodbyes first: closing a listener may close its accepted channels too (uvloop).
        channels = list(self._channels)
        if bye:
            self._bye_news = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(BYE_TIMEOUT):
                    for channel in channels:
                        with contextlib.suppress(OSError):
                            await channel.send(MessageKind.PEER_BYE, [])
                    # Each peer answers once it read all this rank sent it (see above).
                    while any(c in self._channels and c not in self._byes for c in channels):
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
        self._channels.clear()
        self._byes.clear()
        self._by_src.clear()
        self._out.clear()
        self.segments.close(sweep=self._failed)  # a dead peer's may outlive the sweep at fail
