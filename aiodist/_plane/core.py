"""The data plane's state, sans-IO: its peers, their channels, and the receives waiting on them.

Events come in as method calls (a frame through a channel's ``ChannelState``,
a receive posted, a peer's goodbye, the server's word that a peer left, a
failure); what the plane must *do* about them goes out as **actions**, the
methods under "actions" below. ``PlaneCore`` itself records each action in
``actions`` (a test feeds events and reads them); ``DataPlane`` (``peers.py``)
overrides them with the asyncio I/O. Settling a receive is not an action: it
calls the receive's callback, here, at once.

Each peer is in one state (``Peer.state``), recomputed after every event
from what the plane knows of it:

    state       what holds                                      a send to it    a receive from it
    IDLE        no channel to it, none being made               connects        waits
    CONNECTING  this rank's connect is under way                joins it        waits
    PROVING     connected, this rank's token handshake too      joins it        waits
    OPEN        a proved channel carries what this rank sends   goes now        waits
    LEAVING     it left (goodbye, or the server said so), a     fails           waits: its last
                channel from it is still open                                   messages may come
    LEFT        it left, and no channel from it is open         fails           fails at once
    FAILED      it failed the token handshake: refused for good fails           fails at once

    event (method)                          moves it to
    connect_started / connect_ended         CONNECTING / back to what holds
    connect (ChannelState), hello sent      PROVING
    adopt: a channel proved (either side)   OPEN
    channel_closed without a goodbye        IDLE, and the ``lost`` action (the session judges)
    bye_received, peer_left                 LEAVING, or LEFT once no channel is open
    refuse                                  FAILED, and the ``refused`` action

Matching: every message carries a key ``(kind, group, a, b)`` (``_wire/keys.py``);
``post`` and ``arrived`` meet in one ``Matcher``; large point-to-point payloads
wait for their receive (``bulk.py``). A receive is settled once, with the
message or with the error that ended it (``fail``, ``drop_call``, a peer that
left or was refused).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiodist._errors import AuthenticationError, ProtocolError
from aiodist._plane.bulk import BulkTransfers
from aiodist._plane.matching import Matcher
from aiodist._plane.receives import Posted, Received
from aiodist._wire.headers import Message, message_header
from aiodist._wire.keys import MatchKind, call_of
from aiodist._wire.messages import PeerBye

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._transport.base import DataChannel
    from aiodist._wire.keys import Key
    from aiodist._wire.messages import PeerError, PeerHello

logger = logging.getLogger(__name__)

# Aborted calls whose late messages are still dropped (see drop_call).
_DEAD_CALLS_KEPT: Final = 4096
# The kinds of key a point-to-point receive waits on (and its large payloads' own).
_P2P_KINDS: Final = frozenset(
    {MatchKind.P2P, MatchKind.OBJECT_P2P, MatchKind.CLEAR, MatchKind.BULK}
)
_P2P: Final = MatchKind.P2P  # read once: an enum member's lookup costs every receive


class PeerState(enum.Enum):
    """Where this rank stands with one peer (see the module docstring's table)."""

    IDLE = "idle"
    CONNECTING = "connecting"
    PROVING = "proving"
    OPEN = "open"
    LEAVING = "leaving"
    LEFT = "left"
    FAILED = "failed"


@dataclass(slots=True, eq=False)
class Peer:
    """What this rank knows of one peer."""

    rank: int
    state: PeerState = PeerState.IDLE
    channels: set[DataChannel] = field(default_factory=set)  # proved, open, from either side
    connecting: bool = False  # this rank's connect is under way
    proving: bool = False  # ... and its transport is up: the handshake runs


class _Side(Protocol):
    """What the plane reads of a channel's ``ChannelState``."""

    src: int | None
    said_bye: bool
    posted: Posted | None

    def hello(self, channel: DataChannel, hello: PeerHello) -> None: ...


class PlaneCore:
    """The data plane's decisions; ``actions`` holds what it asked for (see the module)."""

    def __init__(self, job: str, token: str | None) -> None:
        self.job = job
        self.token = token
        self.rank = -1
        self.world_size = 0
        self.elastic = False  # an elastic job: ranks may join (DataPlane.grow)
        self.matcher: Matcher[Posted, Received] = Matcher()
        self.bulk = BulkTransfers(self)
        self.peers: dict[int, Peer] = {}
        self.routes: dict[int, DataChannel] = {}  # the channel each OPEN peer is sent to on
        self.left: dict[int, BaseException] = {}  # peers that left: the error of what needs them
        self.gone: set[int] = set()  # LEFT peers: nothing more can come from them
        self.refused: dict[int, AuthenticationError] = {}  # FAILED peers
        self.channels: set[DataChannel] = set()  # every channel with a peer, open
        self.byes: set[DataChannel] = set()  # channels whose peer said (or answered) goodbye
        self.closing = False
        self.early_hellos: list[tuple[_Side, DataChannel, PeerHello]] = []
        # Receives cut off mid-payload, with the rank whose payload it was (see ChannelState).
        self.orphans: list[tuple[int | None, Posted]] = []
        self.arriving: set[_Side] = set()  # channels receiving a payload for a posted receive
        self.dead_calls: dict[tuple[int, int], None] = {}  # (group, call): ordered, bounded
        self.actions: list[tuple[Any, ...]] = []

    # --- membership ---------------------------------------------------------------------

    def set_rank(self, rank: int, world_size: int) -> None:
        """This rank is ``rank`` of ``world_size``: hellos that came before are answered now."""
        self.rank = rank
        self.world_size = world_size
        for src, channel in list(self.routes.items()):  # said hello before the table came
            if not 0 <= src < world_size:
                logger.warning("closing a data channel from rank %d, not a member", src)
                del self.routes[src]
                self.abort(channel)
        early, self.early_hellos = self.early_hellos, []
        for side, channel, hello in early:  # peers that said hello before our Welcome
            try:
                side.hello(channel, hello)
            except ProtocolError as exc:
                logger.warning("closing a data channel: %s", exc)
                self.abort(channel)

    def peer(self, rank: int) -> Peer:
        """The record of ``rank``, made on first use."""
        found = self.peers.get(rank)
        if found is None:
            found = self.peers[rank] = Peer(rank)
        return found

    def _restate(self, peer: Peer) -> None:
        rank = peer.rank
        if rank in self.refused:
            state = PeerState.FAILED
        elif rank in self.left:
            state = PeerState.LEAVING if peer.channels else PeerState.LEFT
        elif rank in self.routes:
            state = PeerState.OPEN
        elif peer.proving:
            state = PeerState.PROVING
        elif peer.connecting:
            state = PeerState.CONNECTING
        else:
            state = PeerState.IDLE
        if state is not peer.state:
            logger.debug("rank %d: %s -> %s", rank, peer.state.value, state.value)
            peer.state = state

    # --- channels and their handshakes ---------------------------------------------------

    def connect_started(self, rank: int) -> None:
        """This rank starts connecting to ``rank`` (one attempt at a time)."""
        peer = self.peer(rank)
        peer.connecting = True
        self._restate(peer)

    def connect_ended(self, rank: int) -> None:
        """This rank's attempt to connect to ``rank`` ended (proved, or not)."""
        peer = self.peer(rank)
        peer.connecting = peer.proving = False
        self._restate(peer)

    def proving(self, rank: int) -> None:
        """This rank's channel to ``rank`` is up; its handshake runs."""
        peer = self.peer(rank)
        peer.proving = True
        self._restate(peer)

    def adopt(self, rank: int, channel: DataChannel) -> None:
        """``channel`` to or from ``rank`` is proved: what it sends next is read in full.

        The peer is sent to on it unless another channel does that already.
        """
        self.proved(channel)
        self.channels.add(channel)
        peer = self.peer(rank)
        peer.channels.add(channel)
        self.routes.setdefault(rank, channel)
        self._restate(peer)

    def refuse(self, rank: int, message: str) -> AuthenticationError:
        """Refuse ``rank`` for good and report it; returns the error to raise."""
        exc = self.refused.get(rank)
        if exc is None:
            exc = self.refused[rank] = AuthenticationError(message, rank=rank)
            logger.error("%s", exc)
            self._restate(self.peer(rank))
            self.refused_peer(exc)
        return exc

    def doubt(self, rank: int, why: str) -> None:
        """A connection claiming to be ``rank`` failed the token handshake: ask ``rank``.

        Anyone can claim a rank, so the claim breaks nothing by itself. Connecting
        to the address ``rank`` published settles it: the genuine rank proves the
        token (the claim was a stranger's), or it is refused like any peer that
        cannot, and the operations waiting on it fail now instead of timing out.
        """
        if self.closing:
            return
        # Not a warning of its own: the listener logs each refusal (within its budget).
        logger.debug("refused a data connection claiming to be rank %d: %s", rank, why)
        peer = self.peers.get(rank)
        if (
            rank == self.rank
            or not 0 <= rank < self.world_size
            or rank in self.routes
            or (peer is not None and peer.connecting)
            or rank in self.refused
        ):
            return
        self.probe(rank)

    def bye_received(self, channel: DataChannel) -> None:
        """The peer on ``channel`` said goodbye (or answered ours)."""
        self.byes.add(channel)
        if self.closing:
            self.news()
        else:
            # Answer: the peer waits for it before it tells the server that it left.
            self.say(channel, PeerBye())

    def channel_closed(self, side: _Side, channel: DataChannel, exc: Exception | None) -> None:
        """``channel`` closed; a peer's last one settles what waits on it if it left."""
        if self.early_hellos:  # a stranger's hello kept for set_members: forget it
            self.early_hellos = [e for e in self.early_hellos if e[1] is not channel]
        self.channels.discard(channel)
        self.byes.discard(channel)
        if self.closing:
            self.news()
        src = side.src
        if src is None:
            return
        if self.routes.get(src) is channel:
            del self.routes[src]
        peer = self.peer(src)
        peer.channels.discard(channel)
        self._restate(peer)
        if self.closing:
            return
        if src in self.left:
            self._settle_left(src)  # it left: fail what waits on it once its last channel closed
        elif side.said_bye:
            self.bye_heard(src)
        else:
            self.lost(src, f"its data connection closed ({exc or 'EOF'})")

    # --- receiving ----------------------------------------------------------------------

    def post(
        self,
        src: int | None,
        key: Key,
        dest: memoryview | None,
        callback: Callable[[Received | BaseException], None],
    ) -> Posted:
        """Post a receive that calls ``callback`` once, with the message or the error.

        ``src`` None receives from any source. With ``dest``, a payload of the
        same size is written there directly (``Received.data`` is then ``dest``).
        ``callback`` runs inside the data plane's own callbacks (or right here, if
        the message came first), so it must not raise.
        """
        posted = Posted(dest, key, callback)
        if self.refused and src in self.refused:
            posted.settle(self.refused[src])
            return posted
        found = self.matcher.post(src, key, posted)
        if found is not None:
            self.complete(posted, found[1])
        elif src in self.gone:
            self._settle_left(src)  # nothing more comes from it: fails at once
        elif key[0] == _P2P and src is not None:
            self.bulk.offer(src, posted)
        return posted

    def withdraw(self, src: int | None, posted: Posted) -> bool:
        """Take back a receive that nothing matched yet (``MPI_Cancel``); True if taken.

        A receive whose sender was told it is posted (a large one, credited) may
        have its payload on the way into its buffer: it stays. A withdrawn
        receive's callback is never called.
        """
        if posted.settled or posted.credited:
            return False
        if not self.matcher.withdraw(src, posted.key, posted):
            return False
        posted.callback = None
        return True

    def arrived(self, src: int, key: Key, msg: Received) -> None:
        """A whole message from ``src``: settle the receive it matches, or keep it for one.

        A message of a call that was aborted (``drop_call``) is dropped instead:
        its sender had not heard of the abort yet, and no receive will ask for it.
        """
        posted = self.matcher.arrive(src, key)
        if posted is not None:
            self.complete(posted, msg)
        elif not (
            self.dead_calls
            and key[0] == MatchKind.COLLECTIVE
            and (key[1], call_of(key[2])) in self.dead_calls
        ):
            self.matcher.buffer(src, key, msg)

    def complete(self, posted: Posted, msg: Received) -> None:
        """Settle ``posted`` with ``msg`` (a large one once its payload is in)."""
        if posted.callback is None:
            return  # failed while its payload was arriving: the operation reported that
        if msg.error is not None:  # its send failed at the sender (PeerAbort)
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

    # --- failing ------------------------------------------------------------------------

    def fail(
        self, exc: BaseException, group_id: int | None = None, *, keep_p2p: bool = False
    ) -> None:
        """Fail every posted receive (of ``group_id``, if given) with ``exc``.

        With ``keep_p2p``, point-to-point receives stay posted (a member of the
        group failed: receives from the others may still be matched).

        That includes receives whose payload is arriving: they left the matcher, and
        the connection carrying the rest may outlive the failure (a dead rank's last
        bytes still being read) or never deliver it.
        """

        def hit(key: tuple[int, ...]) -> bool:
            return (group_id is None or key[1] == group_id) and not (
                keep_p2p and key[0] in _P2P_KINDS
            )

        self.bulk.forget(group_id)  # their senders fail too: never clear them
        posted_list = self.matcher.take_posted_where(hit)
        arriving = [side.posted for side in self.arriving if side.posted is not None]
        orphans = [posted for _, posted in self.orphans]
        posted_list += [p for p in orphans + arriving if hit(p.key)]
        self.orphans = [(src, o) for src, o in self.orphans if not hit(o.key)]
        for posted in posted_list:
            posted.settle(exc)

    def fail_p2p(self, exc: BaseException) -> None:
        """Fail every posted point-to-point receive (tensors and objects) with ``exc``."""
        for posted in self.matcher.take_posted_where(lambda k: k[0] in _P2P_KINDS):
            posted.settle(exc)

    def drop_call(self, group_id: int, call: int, exc: BaseException) -> None:
        """Abort call ``call`` of group ``group_id`` here: it will never complete.

        Its posted receives fail with ``exc``, its buffered messages are dropped,
        and so are its messages that arrive later (from peers that sent before
        they heard of the abort). Nothing else of the group changes.
        """
        dead = self.dead_calls
        dead[(group_id, call)] = None
        if len(dead) > _DEAD_CALLS_KEPT:
            del dead[next(iter(dead))]

        def hit(key: tuple[int, ...]) -> bool:
            return key[0] == MatchKind.COLLECTIVE and key[1] == group_id and call_of(key[2]) == call

        self.matcher.drop_unexpected_where(hit)
        for posted in self.matcher.take_posted_where(hit):
            posted.settle(exc)

    def peer_left(self, rank: int, exc: BaseException) -> None:
        """``rank`` left the job: what needs it fails with ``exc``, once all it sent is in.

        Sends to it fail at once. Receives from it fail once no channel from it is
        open (its goodbye and close come after its last message; and before it told
        the server, it waited for this rank to answer its goodbye on each channel).
        The first ``exc`` given for a rank stays.
        """
        self.left.setdefault(rank, exc)
        peer = self.peer(rank)
        self._restate(peer)
        if not peer.channels:
            self._settle_left(rank)  # else channel_closed settles it

    def peer_failed(self, rank: int, exc: BaseException) -> None:
        """``rank`` failed (the server said so): what needs it fails with ``exc``, now.

        As ``peer_left``, but its channels are dropped at once: a failed rank may be
        frozen with its connections open, and nothing it sent last is awaited.
        """
        self.peer_left(rank, exc)
        for channel in list(self.peer(rank).channels):
            self.abort(channel)  # closed: channel_closed then settles what waits on it

    def forget_channels(self) -> None:
        """Every channel was closed (the plane closed): none is open any more."""
        self.channels.clear()
        self.byes.clear()
        self.routes.clear()
        for peer in self.peers.values():
            peer.channels.clear()

    def _settle_left(self, rank: int) -> None:
        peer = self.peer(rank)
        if self.closing or peer.channels:
            return
        self.gone.add(rank)
        exc = self.left[rank]
        # Its receives still posted, and those its payload was arriving for when its last
        # channel closed (of no group of its, say a p2p receive or an rpc reply's tensor:
        # no group's failure reaches them).
        cut = [posted for src, posted in self.orphans if src == rank]
        self.orphans = [(src, o) for src, o in self.orphans if src != rank]
        for posted in [*self.matcher.take_posted_from(rank), *cut]:
            posted.settle(exc)

    def say(self, channel: DataChannel, msg: Message) -> None:
        """``write`` the header-only message ``msg`` on ``channel``."""
        self.write(channel, msg.KIND, message_header(msg))

    # --- actions: what the plane asks of the I/O around it -------------------------------
    # Recorded here; DataPlane does each. None of them may raise.

    def write(self, channel: DataChannel, kind: int, header: list[Any]) -> None:
        """Write a header-only frame on ``channel`` now (best effort)."""
        self.actions.append(("write", channel, kind, header))

    def proved(self, channel: DataChannel) -> None:
        """Lift ``channel``'s pre-handshake limits (right behind this side's last frame)."""
        self.actions.append(("proved", channel))

    def abort(self, channel: DataChannel) -> None:
        """Drop ``channel`` at once."""
        self.actions.append(("abort", channel))

    def send_to(self, rank: int, kind: int, header: list[Any]) -> None:
        """Send a header-only frame to ``rank``, connecting first if need be (best effort)."""
        self.actions.append(("send_to", rank, kind, header))

    def connected(self, channel: DataChannel, error: BaseException | None) -> None:
        """This rank's handshake on ``channel`` is done (``error`` None) or failed."""
        self.actions.append(("connected", channel, error))

    def probe(self, rank: int) -> None:
        """Connect to ``rank`` to settle who claimed to be it (see ``doubt``)."""
        self.actions.append(("probe", rank))

    def lost(self, rank: int, reason: str) -> None:
        """A channel from ``rank`` closed without a goodbye: ask who failed."""
        self.actions.append(("lost", rank, reason))

    def bye_heard(self, rank: int) -> None:
        """``rank`` said goodbye and its channel closed: learn the error for ``peer_left``."""
        self.actions.append(("bye_heard", rank))

    def refused_peer(self, exc: AuthenticationError) -> None:
        """``exc.rank`` failed the token handshake: what needs it must fail."""
        self.actions.append(("refused_peer", exc))

    def rang(self) -> None:
        """A peer wrote rows this rank may wait for on a board (``_ops.board``): look."""
        self.actions.append(("rang",))

    def peer_error(self, src: int, error: PeerError) -> None:
        """``src`` sent ``PeerError`` (a broken group, an aborted call)."""
        self.actions.append(("peer_error", src, error))

    def news(self) -> None:
        """A goodbye or a close came while this plane closes (it waits for them)."""
        self.actions.append(("news",))
