"""One data channel as the plane sees it, sans-IO: its peer, its handshake, what arrives.

A ``ChannelState`` is the ``FrameSink`` of one channel to a peer, on either
side: the side that connected says hello (``connect``), the side that
accepted answers it. Both halves of the token handshake are here, each
running one ``TokenHandshake`` (``_wire/handshake.py``)::

    connector (challenger)                      acceptor (responder)
    PeerHello(job, rank, pid, member, nonce)  ->  checks the claim, answers
                                              <-  PeerAuth(nonce, proof)
    checks it; PeerAuth(b"", proof)           ->  checks it
    proved: the route to the acceptor          proved: adopts the channel

Without a token the hello alone (no nonce) opens the channel. Until its
side is done, a channel trusts nothing it receives: ``DATA`` before the
hello is a protocol error. After it, each ``DATA`` frame's key is matched
against the plane's posted receives as its header arrives, and the
transport is handed the destination memory so a matched payload lands in
place. ``DATA`` is the hot path: its header stays a list, read by index
(the match key's four fields, then ``DATA_META``); every other message is
decoded into its declared class (``_wire/messages.py``), types and ranges
checked. The channel never touches a socket: what it sends and every other
effect go through the plane's actions (``core.PlaneCore``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import ProtocolError
from aiodist._plane.receives import Announced, Received, aborted_message
from aiodist._wire.frame import frame_message
from aiodist._wire.handshake import Refused, Role, TokenHandshake, peer_binding
from aiodist._wire.keys import MatchKind
from aiodist._wire.messages import (
    DATA_META,
    Data,
    PeerAbort,
    PeerAnnounce,
    PeerAuth,
    PeerBye,
    PeerError,
    PeerHello,
)

# Hellos a plane keeps from newcomers of an elastic job that it does not know yet.
MAX_EARLY_HELLOS = 64

if TYPE_CHECKING:
    from aiodist._plane.core import PlaneCore
    from aiodist._plane.receives import Posted
    from aiodist._transport.base import DataChannel
    from aiodist._wire.frame import Frame
    from aiodist._wire.keys import Key

_DATA: Final = Data.KIND
_DATA_FIELDS: Final = DATA_META + 1
_CREDIT: Final = MatchKind.CREDIT  # read once: an enum lookup costs every message
_BELL: Final = MatchKind.BELL


class ChannelState:
    """The frame sink of one channel: knows the peer's rank once it is proved."""

    __slots__ = (
        "_buffer",
        "_claim",
        "_connecting",
        "_handshake",
        "_key",
        "_meta",
        "core",
        "member",
        "posted",
        "said_bye",
        "src",
    )

    def __init__(self, core: PlaneCore) -> None:
        self.core = core
        self.src: int | None = None  # the peer, once proved: what it sends is trusted
        self.said_bye = False
        self.member = 0  # connecting side: the member the hello names on a shared listener
        self.posted: Posted | None = None  # the receive whose payload is arriving
        self._buffer: memoryview | None = None
        self._meta: Any = None
        self._key: Key = (0, 0, 0, 0)
        self._handshake: TokenHandshake | None = None
        self._claim = -1  # accepting side: the rank its hello claims, until proved
        self._connecting = -1  # connecting side: the rank connected to, until proved

    # --- the connecting side -------------------------------------------------------------

    def connect(self, channel: DataChannel, dst: int) -> None:
        """The transport connected this channel to rank ``dst``: say hello.

        Without a token the channel is proved at once; with one, when the
        acceptor's proof arrives. Either way the plane hears it through its
        ``connected`` action (with the error, if it failed).
        """
        core = self.core
        core.proving(dst)
        hello = PeerHello(core.job, core.rank, os.getpid(), self.member)
        token = core.token
        if token is None:
            self.src = dst
            core.say(channel, hello)
            core.adopt(dst, channel)
            core.connected(channel, None)
            return
        self._connecting = dst
        handshake = self._handshake = TokenHandshake(
            Role.CHALLENGER, token, peer_binding(core.job, core.rank, dst)
        )
        core.say(channel, dataclasses.replace(hello, nonce=handshake.challenge()))

    def _proof_received(self, channel: DataChannel, auth: PeerAuth) -> None:
        core, dst, handshake = self.core, self._connecting, self._handshake
        assert handshake is not None
        self._handshake, self._connecting = None, -1
        try:
            proof = handshake.check_answer(auth.nonce, auth.proof)
        except Refused as exc:
            holds = "it holds no token" if exc.reason == "no token" else "it holds another one"
            error = core.refuse(
                dst,
                f"the process listening at rank {dst}'s data-plane address ({channel.peer}) "
                f"could not prove that it knows the token of job {core.job!r} ({holds}); "
                "refusing to exchange data with it. Set the same AIODIST_TOKEN on every rank",
            )
            core.connected(channel, error)
            return
        self.src = dst  # only now is what arrives on this channel trusted
        core.say(channel, PeerAuth(b"", proof))
        core.adopt(dst, channel)
        core.connected(channel, None)

    # --- the accepting side --------------------------------------------------------------

    def hello(self, channel: DataChannel, hello: PeerHello) -> None:
        """A peer's ``PeerHello`` (again from ``set_members`` if it came too early)."""
        if self.src is not None or self._claim >= 0 or self._connecting >= 0:
            raise ProtocolError("a second PeerHello on one data channel")
        core = self.core
        job, rank = hello.job, hello.rank
        # A peer that got its Welcome first may say hello before this rank got its
        # own (world_size still 0). With a token, the proof needs this rank's own
        # rank: answer once set_members knows it (the peer sends nothing before).
        # Without one, accept it now; set_members drops it if the rank is no member.
        if core.rank < 0 and core.token is not None:
            core.early_hellos.append((self, channel, hello))
            return
        known = core.world_size
        if core.elastic and known and job == core.job and rank >= known:
            # A newcomer of an elastic job whose hello came before the server's news of
            # it: answer once the plane grows (``DataPlane.grow``), bounded like a stranger.
            if len(core.early_hellos) >= MAX_EARLY_HELLOS:
                raise ProtocolError(f"too many hellos from ranks not known yet (rank {rank})")
            core.early_hellos.append((self, channel, hello))
            return
        if job != core.job or not rank < (known or rank + 1):
            raise ProtocolError(f"peer hello from job {job!r} rank {rank!r} does not belong here")
        token = core.token
        nonce = hello.nonce
        if token is None:
            if nonce is not None:  # the peer holds a token we lack: let it say so
                core.say(channel, PeerAuth(b"", b""))
            self.src = rank
            core.adopt(rank, channel)
            return
        handshake = TokenHandshake(Role.RESPONDER, token, peer_binding(job, rank, core.rank))
        try:
            mine, proof = handshake.answer(nonce)
        except Refused:
            core.doubt(rank, "it offered no proof of the job's token")
            raise ProtocolError(
                f"a peer claiming rank {rank} offered no proof of the job's token; "
                "set the same AIODIST_TOKEN on every rank"
            ) from None
        self._handshake, self._claim = handshake, rank
        core.say(channel, PeerAuth(mine, proof))

    def _auth_received(self, channel: DataChannel, auth: PeerAuth) -> None:
        if self._connecting >= 0:  # connecting side: the acceptor's proof
            self._proof_received(channel, auth)
            return
        handshake, rank = self._handshake, self._claim
        if handshake is None or self.src is not None:
            raise ProtocolError("unexpected PeerAuth on a data channel")
        self._handshake, self._claim = None, -1
        try:
            handshake.check_proof(auth.proof)
        except Refused:
            self.core.doubt(rank, "its proof does not match the job's token")
            raise ProtocolError(
                f"a peer claiming rank {rank} failed to prove the job's token"
            ) from None
        self.src = rank
        self.core.adopt(rank, channel)

    # --- FrameSink -----------------------------------------------------------------------

    def frame_received(self, channel: DataChannel, frame: Frame) -> memoryview | None:
        header = frame.header
        if frame.kind == _DATA:
            src = self.src
            if src is None:
                raise ProtocolError("DATA before PeerHello")
            if type(header) is not list or len(header) != _DATA_FIELDS:
                raise ProtocolError(f"malformed Data header: {header!r:.80}")
            key: Key = (header[0], header[1], header[2], header[3])  # the fields before meta
            core = self.core
            if key[0] == _CREDIT:  # a peer posted a receive for a large payload of ours
                core.bulk.credited(src, key)
                return None
            if key[0] == _BELL:  # a peer wrote rows on its board: look (``_ops.board``)
                core.rang()
                return None
            self._key, self._meta = key, header[DATA_META]
            posted = core.matcher.arrive(src, key)
            self.posted = posted
            if posted is not None:
                core.arriving.add(self)  # off the matcher: fail() must still find it
            nbytes = frame.payload_nbytes
            if posted is not None and posted.dest is not None and posted.dest.nbytes == nbytes:
                self._buffer = posted.dest
            else:  # unexpected, or a size mismatch the receiver reports: buffer it
                self._buffer = memoryview(bytearray(nbytes))
            return self._buffer if nbytes else None
        msg = frame_message(frame)  # the cold path: typed and checked (ProtocolError)
        kind = type(msg)
        if kind is PeerHello:
            self.hello(channel, msg)
            return None
        if kind is PeerAuth:
            self._auth_received(channel, msg)
            return None
        if kind is PeerBye:
            self.said_bye = True
            self.core.bye_received(channel)
            return None
        src = self.src
        if src is None:
            raise ProtocolError(f"{kind.__name__} before PeerHello")
        if kind is PeerAnnounce:  # a large payload: it moves once cleared (``bulk.py``)
            key = (msg.kind, msg.group, msg.a, msg.b)
            announced = Announced(src, msg.group, msg.ident, msg.nbytes)
            self.core.bulk.announced(key, Received(src, msg.meta, memoryview(b""), announced))
        elif kind is PeerAbort:
            key = (msg.kind, msg.group, msg.a, msg.b)
            self.core.arrived(src, key, aborted_message(src, msg))
        elif kind is PeerError:
            self.core.peer_error(src, msg)
        else:
            raise ProtocolError(f"unexpected {kind.__name__} on a data channel")
        return None

    def payload_received(self, channel: DataChannel, frame: Frame) -> None:
        if frame.kind != _DATA or frame.header[0] in (_CREDIT, _BELL):
            return  # not data, or a credit or a bell (handled on arrival)
        src = self.src
        assert src is not None
        assert self._buffer is not None
        msg = Received(src, self._meta, self._buffer)
        posted, self.posted, self._buffer = self.posted, None, None
        core = self.core
        if posted is None:
            # A receive may have been posted while this payload was in flight.
            core.arrived(src, self._key, msg)
        else:
            core.arriving.discard(self)
            core.complete(posted, msg)

    def channel_closed(self, channel: DataChannel, exc: Exception | None) -> None:
        core = self.core
        if self._claim >= 0:
            # It left (or broke the exchange) after our proof, before its own: it may be
            # a rank that could not check our proof, one holding another token.
            claim, self._claim = self._claim, -1
            core.doubt(claim, "it left the token handshake unfinished")
        if self._connecting >= 0:
            self._connecting = -1
            lost = ConnectionResetError(
                f"data connection to {channel.peer} closed ({exc or 'EOF'})"
            )
            core.connected(channel, lost)
        posted = self.posted
        if posted is not None:
            core.arriving.discard(self)
            if not posted.settled:
                # A receive whose payload was arriving when the connection dropped: it left
                # the matcher on arrival, so hand it to the plane to fail with the verdict.
                core.orphans.append((self.src, posted))
        self.posted = self._buffer = None
        core.channel_closed(self, channel, exc)
