"""The receiving end of one data channel: frames in, matched receives out.

A ``Link`` is the ``FrameSink`` of one channel to a peer. It learns the peer's
rank from ``PEER_HELLO`` (after the token exchange when the job has one),
matches each ``DATA`` frame's key against the data plane's posted receives,
and hands the transport the destination memory so a matched payload lands in
place. ``Posted`` is a receive waiting to be matched, settled through a future
or a callback; ``Received`` is what it settles with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiodist._errors import AbortedError, ProtocolError
from aiodist._plane.bulk import Announced
from aiodist._wire import auth
from aiodist._wire.keys import MatchKind
from aiodist._wire.messages import MessageKind

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from aiodist._plane.peers import DataPlane, Key
    from aiodist._transport.base import DataChannel
    from aiodist._wire.frame import Frame

__all__ = ["Link", "Posted", "Received", "aborted_message"]


@dataclass(slots=True)
class Received:
    """A matched message: who sent it, its metadata, and where its payload is.

    ``announced`` marks a large payload still at its sender (see ``bulk.py``);
    ``error`` a send that failed at its sender before its data left: the
    receive it matches fails with it.
    """

    src: int
    meta: Any
    data: memoryview
    announced: Announced | None = None
    error: BaseException | None = None


@dataclass(slots=True, eq=False)
class Posted:
    """A posted receive: its future, or (``post``) a callback that takes the outcome."""

    future: asyncio.Future[Received] | None
    dest: memoryview | None
    key: Key
    callback: Callable[[Received | BaseException], None] | None = None
    credited: bool = False  # its sender was told it is posted (see bulk.py)

    @property
    def settled(self) -> bool:
        """True once the outcome was handed over (a failure may come before the payload)."""
        return self.callback is None and (self.future is None or self.future.done())

    def settle(self, outcome: Received | BaseException) -> None:
        if self.callback is not None:
            callback, self.callback = self.callback, None  # at most once
            callback(outcome)
            return
        future = self.future
        assert future is not None
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def aborted_message(src: int, header: list[Any]) -> Received:
    """The message a ``PEER_ABORT`` from ``src`` stands for: one that fails its receive."""
    rank, reason, what = [*header[4], None, None, None][:3]
    rank = rank if type(rank) is int else src
    error = AbortedError(
        f"{what} failed on rank {rank} before its data left ({reason}), so the receive it "
        "matched fails too. Fix that rank's call.",
        rank=rank,
        reason=str(reason),
    )
    return Received(src, None, memoryview(b""), error=error)


class Link:
    """The frame sink of one channel: knows the peer's rank once it said hello."""

    def __init__(self, plane: DataPlane, src: int | None = None) -> None:
        self.plane = plane
        self.src = src
        self.said_bye = False
        self.member = 0  # connecting side: the member the hello names on a shared listener
        self._posted: Posted | None = None
        self._buffer: memoryview | None = None
        self._meta: Any = None
        self._key: Key = (0, 0, 0, 0)
        # Token handshake state: the accepting side's claim and nonces, the connecting
        # side's wait for the acceptor's proof.
        self._claim: tuple[int, bytes, bytes] | None = None
        self.challenge: asyncio.Future[tuple[Any, Any]] | None = None

    def frame_received(self, channel: DataChannel, frame: Frame) -> memoryview | None:
        kind, header = frame.kind, frame.header
        if kind == MessageKind.DATA:
            if self.src is None:
                raise ProtocolError("DATA before PEER_HELLO")
            if not isinstance(header, list) or len(header) not in (5, 7):
                raise ProtocolError("malformed DATA header")
            key: Key = (header[0], header[1], header[2], header[3])
            if key[0] == MatchKind.CREDIT:  # a peer posted a receive for a large payload of ours
                self.plane.bulk.credited(self.src, key)
                return None
            if len(header) == 7:  # announces a large payload: it moves once cleared
                ident, nbytes = header[5], header[6]
                if type(ident) is not int or type(nbytes) is not int or nbytes < 0:
                    raise ProtocolError(f"malformed payload announcement {header!r}")
                announced = Announced(self.src, key[1], ident, nbytes)
                msg = Received(self.src, header[4], memoryview(b""), announced)
                self.plane.bulk.announced(key, msg)
                return None
            self._key, self._meta = key, header[4]
            posted = self.plane.matcher.arrive(self.src, key)
            self._posted = posted
            if posted is not None:
                self.plane._arriving.add(self)  # off the matcher: fail() must still find it
            nbytes = frame.payload_nbytes
            if posted is not None and posted.dest is not None and posted.dest.nbytes == nbytes:
                self._buffer = posted.dest
            else:  # unexpected, or a size mismatch the receiver reports: buffer it
                self._buffer = memoryview(bytearray(nbytes))
            return self._buffer if nbytes else None
        if kind == MessageKind.PEER_HELLO:
            self._hello_received(channel, header)
        elif kind == MessageKind.PEER_AUTH:
            self._auth_received(channel, header)
        elif kind == MessageKind.PEER_ABORT:
            self._abort_received(header)
        elif kind == MessageKind.PEER_ERROR:
            if self.src is not None:
                self.plane.on_peer_error(self.src, header)
        elif kind == MessageKind.PEER_BYE:
            self.said_bye = True
            self.plane._bye_received(channel)
        else:
            raise ProtocolError(f"unexpected frame kind {kind} on a data channel")
        return None

    def _abort_received(self, header: Any) -> None:
        if self.src is None:
            raise ProtocolError("PEER_ABORT before PEER_HELLO")
        if not isinstance(header, list) or len(header) != 5 or not isinstance(header[4], list):
            raise ProtocolError("malformed PEER_ABORT header")
        key: Key = (header[0], header[1], header[2], header[3])
        self.plane.arrived(self.src, key, aborted_message(self.src, header))

    def _hello_received(self, channel: DataChannel, header: Any) -> None:
        if self.src is not None or self._claim is not None:
            raise ProtocolError("a second PEER_HELLO on one data channel")
        if not isinstance(header, list) or len(header) not in (4, 5):
            raise ProtocolError("malformed PEER_HELLO header")
        job, rank = header[0], header[1]
        # A peer that got its Welcome first may say hello before this rank got its
        # own (world_size still 0). With a token, the proof needs this rank's own
        # rank: answer once set_members knows it (the peer sends nothing before).
        # Without one, accept it now; set_members drops it if the rank is no member.
        if self.plane.rank < 0 and self.plane.token is not None:
            self.plane._early_hellos.append((self, channel, header))
            return
        known = self.plane.world_size
        if job != self.plane.job or type(rank) is not int or not 0 <= rank < (known or rank + 1):
            raise ProtocolError(f"peer hello from job {job!r} rank {rank!r} does not belong here")
        token = self.plane.token
        nonce = header[4] if len(header) == 5 else None
        if token is None:
            if nonce is not None:  # the peer holds a token we lack: let it say so
                self.plane._spawn(channel.send(MessageKind.PEER_AUTH, [b"", b""]))
            self.src = rank
            self.plane._adopt(rank, channel)
            return
        if type(nonce) is not bytes or len(nonce) != auth.NONCE_BYTES:
            self.plane._doubt(rank, "it offered no proof of the job's token")
            raise ProtocolError(
                f"a peer claiming rank {rank} offered no proof of the job's token; "
                "set the same AIODIST_TOKEN on every rank"
            )
        mine = auth.new_nonce()
        self._claim = (rank, nonce, mine)
        proof = auth.accept_proof(token, job, rank, self.plane.rank, nonce, mine)
        self.plane._spawn(channel.send(MessageKind.PEER_AUTH, [mine, proof]))

    def _auth_received(self, channel: DataChannel, header: Any) -> None:
        if not isinstance(header, list) or len(header) != 2:
            raise ProtocolError("malformed PEER_AUTH header")
        if self.challenge is not None:  # connecting side: the acceptor's proof
            if not self.challenge.done():
                self.challenge.set_result((header[0], header[1]))
            return
        claim, token = self._claim, self.plane.token
        if claim is None or token is None or self.src is not None:
            raise ProtocolError("unexpected PEER_AUTH on a data channel")
        rank, theirs, mine = claim
        expected = auth.connect_proof(token, self.plane.job, rank, self.plane.rank, mine, theirs)
        self._claim = None
        if not auth.verify(expected, header[1]):
            self.plane._doubt(rank, "its proof does not match the job's token")
            raise ProtocolError(f"a peer claiming rank {rank} failed to prove the job's token")
        self.src = rank
        self.plane._adopt(rank, channel)

    def payload_received(self, channel: DataChannel, frame: Frame) -> None:
        if (
            frame.kind != MessageKind.DATA
            or len(frame.header) == 7
            or frame.header[0] == MatchKind.CREDIT
        ):
            return  # not data, or an announcement or a credit (handled on arrival)
        assert self.src is not None
        assert self._buffer is not None
        msg = Received(self.src, self._meta, self._buffer)
        posted, self._posted, self._buffer = self._posted, None, None
        self.plane._arriving.discard(self)
        if posted is None:
            # A receive may have been posted while this payload was in flight.
            self.plane.arrived(self.src, self._key, msg)
        else:
            self.plane._complete(posted, msg)

    def channel_closed(self, channel: DataChannel, exc: Exception | None) -> None:
        if self._claim is not None:
            # It left (or broke the exchange) after our proof, before its own: it may be
            # a rank that could not check our proof, one holding another token.
            claim, self._claim = self._claim, None
            self.plane._doubt(claim[0], "it left the token handshake unfinished")
        if self.challenge is not None and not self.challenge.done():
            self.challenge.set_exception(
                ConnectionResetError(f"data connection to {channel.peer} closed ({exc or 'EOF'})")
            )
            self.challenge.exception()  # retrieved: _handshake re-raises it
        self.plane._arriving.discard(self)
        if self._posted is not None and not self._posted.settled:
            # A receive whose payload was arriving when the connection dropped: it left
            # the matcher on arrival, so hand it to the plane to fail with the verdict.
            self.plane._orphans.append(self._posted)
        self._posted = self._buffer = None
        self.plane._channel_closed(self, channel, exc)
