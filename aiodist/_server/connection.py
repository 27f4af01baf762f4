"""The rendezvous server's side of one client connection (see ``serve``).

One ``asyncio.Protocol`` per connection feeds a ``FrameDecoder``; a protocol
error closes that one connection with a log line. A connection carries the
members of one client process on *channels* (``Channel`` names the channel of
the messages after it): the job table sees each channel as a connection of its
own. A heartbeat counts for every channel of its connection.

Each heartbeat a client sends is echoed on its connection: the client counts
the server as gone once a heartbeat goes unanswered for its heartbeat timeout.

A server started with a token authenticates each connection before anything it
sends reaches the job table: it sends a fresh nonce (``Challenge``) as soon as
the client connects, and the client's first message must be a ``Hello`` whose
HMAC answers that nonce (checked in constant time, see ``_wire/auth.py``); anything
else gets one AUTHENTICATION error and the connection is closed. The token
never crosses the wire and is never logged. A server without a token answers a
client's ``AuthStart`` with an empty ``Challenge``: that client holds a token,
and refuses a server that cannot prove it.

**Before its handshake** a connection is in the server's ``Gate``
(``_wire/preauth.py``) and can cost it only a small, fixed amount: its frames
are decoded under ``PREAUTH_FRAME_LIMITS``, it may send ``max_bytes`` in all,
it is cut off at its deadline (``AUTH_TIMEOUT`` by default), and the oldest
such connection is shed when ``max_pending`` wait at once (first those that
have not sent a whole frame yet: a real client speaks at once). The handshake is
done when the client proved the token; on a server without a token, with the
client's first well-formed message other than the token handshake's (a real
client's first heartbeat or request, sent as soon as it connects). The server
then decodes its frames under ``SERVER_LIMITS``. A connection cut off by the
gate is sent why, then aborted: it holds no descriptor while a close lingers.
Refusals are logged through the server's ``LogBudget``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

from aiodist._errors import ErrorCode, ProtocolError
from aiodist._transport.tls import describe_ssl_error
from aiodist._wire.bounds import FieldError
from aiodist._wire.frame import (
    FrameDecoder,
    Limits,
    MiB,
    encode_message,
    frame_message,
)
from aiodist._wire.handshake import CONTROL, Refused, Role, TokenHandshake
from aiodist._wire.messages import (
    Authenticated,
    AuthStart,
    Challenge,
    Channel,
    CloseChannel,
    ErrorReply,
    Heartbeat,
    Hello,
    Reply,
    Welcome,
)
from aiodist._wire.preauth import PREAUTH_FRAME_LIMITS
from aiodist._wire.tls import TLS_HANDSHAKE_BYTE, speaks_clear_message

if TYPE_CHECKING:
    from aiodist._server.parts import ConnId
    from aiodist._server.state import JobTable
    from aiodist._wire.frame import Buffer
    from aiodist._wire.preauth import PreAuthLimits

# The server never relays bulk data: any payload is a protocol error.
SERVER_LIMITS: Final = Limits(max_header_bytes=1 * MiB, max_payload_bytes=0)
# A client that stops reading its replies is cut off rather than buffered forever.
MAX_WRITE_BUFFER_BYTES: Final = 64 * MiB
# A connection that has not finished its handshake by then is closed (the gate's deadline).
AUTH_TIMEOUT: Final = 10.0
# How long a refused connection is drained after its error went out (see ``_close_after``).
LINGER_TIMEOUT: Final = 5.0
# Members' channels one connection may open: a process's ranks, with room to spare.
MAX_CHANNELS: Final = 65536
_HEARTBEAT: Final = Heartbeat()
HEARTBEAT_ECHO: Final = b"".join(encode_message(_HEARTBEAT))


# A client that opens with a TLS handshake record: it began TLS with a clear server.
TLS_HELLO: Final = bytes([TLS_HANDSHAKE_BYTE])


class ServerSide(Protocol):
    """What a connection asks of the server that keeps it (``hub.Hub``)."""

    token: str | None
    state: JobTable
    preauth: PreAuthLimits
    loop: asyncio.AbstractEventLoop
    bytes_received: int
    bytes_sent: int
    auth_failures: int
    preauth_closed: int

    def connection_made(self, conn: ServerConnection) -> None: ...
    def passed(self, conn: ServerConnection) -> None: ...
    def spoke(self, conn: ServerConnection) -> None: ...
    def charge(self, conn: ServerConnection, nbytes: int) -> bool: ...
    def bad_request(self, conn_id: ConnId, exc: FieldError) -> None: ...
    def log_refusal(self, reason: str, message: str, *args: object) -> None: ...
    def channel_opened(self, conn: ServerConnection) -> ConnId: ...
    def channel_lost(self, conn_id: ConnId, reason: str) -> None: ...
    def connection_lost(self, conn: ServerConnection, reason: str) -> None: ...
    def receive(self, conn_id: int, msg: Any) -> None: ...
    def flush(self) -> None: ...
    def flush_soon(self) -> None: ...


class ServerConnection(asyncio.Protocol):
    """One client connection: its channels, its authentication, its writes."""

    def __init__(self, server: ServerSide, conn_id: int) -> None:
        self._server = server
        self.conn_id = conn_id
        # Until its handshake is done: hellos and proofs, a few hundred bytes.
        self._decoder = FrameDecoder(PREAUTH_FRAME_LIMITS)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        # What it sends may reach the job table (it proved the token, or none is needed).
        self.authenticated = server.token is None
        # Its handshake is done: it left the gate, and its frames may be as large as any.
        self.proved = False
        self._refused = False  # its refusal was counted and logged
        self._answered_auth_start = False
        self._spoke = False  # it sent a whole frame (the gate sheds silent ones first)
        self._handshake: TokenHandshake | None = None  # the challenge it must answer
        self._linger_timer: asyncio.TimerHandle | None = None
        # The client's channel numbers and the server's ids for them; channel 0 is ours.
        self.channels: dict[int, ConnId] = {0: conn_id}
        self._channel_of: dict[ConnId, int] = {conn_id: 0}
        self._current = conn_id  # where the client's next message goes
        self._named = 0  # the channel our last notice went to

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast("asyncio.Transport", transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "local")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._server.connection_made(self)  # into the gate: it may shed the oldest there
        token = self._server.token
        if token is not None:
            self._handshake = TokenHandshake(Role.CHALLENGER, token, CONTROL)
            self.write(Challenge(self._handshake.challenge()))

    def data_received(self, data: bytes) -> None:
        self._server.bytes_received += len(data)
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._linger_timer is not None:
            # Refused: nothing more it sends is read, but it still counts against the gate.
            if not self.proved and not self._server.charge(self, len(data)):
                transport.abort()
            return
        gated = not self.proved
        try:
            if not self._spoke and data[:1] == TLS_HELLO:
                raise ProtocolError(speaks_clear_message("rendezvous server"))
            for event in self._decoder.frames(data):  # payloads are refused by both limits
                if not self._spoke:
                    self._spoke = True
                    self._server.spoke(self)  # a silent stranger is shed before it
                try:
                    msg = frame_message(event)
                except FieldError as exc:
                    if not (exc.req_id and self.authenticated):
                        raise
                    # A request with a value out of range: refused alone, the connection goes on.
                    if not self.proved:
                        self._passed()
                    self._server.bad_request(self._current, exc)
                    continue
                kind = type(msg)
                if kind is Channel and self.authenticated:
                    # Before nearly every request of a shared connection: the next ones' member.
                    self._select(msg.channel)
                    if not self.proved:
                        self._passed()
                    continue
                if not self.authenticated or isinstance(msg, AuthStart | Hello):
                    if not self._authenticate(msg):
                        break
                    continue
                if not self.proved:
                    self._passed()  # no token: its first message (but the handshake's) is its hello
                if kind is Heartbeat:
                    if msg.where:  # each channel's member hears its own position only
                        where = {entry[0]: entry for entry in msg.where}
                        for channel, conn_id in self.channels.items():
                            own = where.get(channel)
                            self._server.receive(conn_id, Heartbeat([own]) if own else _HEARTBEAT)
                    else:
                        for conn_id in self.channels.values():
                            self._server.receive(conn_id, msg)
                    # Echoed, so that a client can tell a dead server from a quiet one.
                    self.write_parts([HEARTBEAT_ECHO])
                elif kind is CloseChannel:
                    self._close_channel(msg.channel)
                else:
                    self._server.receive(self._current, msg)
        except ProtocolError as exc:
            self._count_refusal()
            self._server.log_refusal(
                "protocol error", "closing connection from %s: %s", self.peer, exc
            )
            self._close_after(ErrorReply(0, ErrorCode.PROTOCOL, str(exc), {}))
        if gated and not self.proved and not transport.is_closing():
            # Every byte it sent before its handshake was done counts, read or not.
            if not self._server.charge(self, len(data)):
                limit = self._server.preauth.max_bytes
                self.cut_off(
                    "byte budget",
                    f"it sent over {limit} bytes without finishing its handshake",
                    f"the rendezvous server closed this connection: over {limit} bytes before "
                    "the handshake was done",
                )
        self._server.flush_soon()

    def _passed(self) -> None:
        """Its handshake is done: out of the gate, and its frames may be as large as any."""
        self.proved = True
        self._decoder.limits = SERVER_LIMITS
        self._server.passed(self)

    def _select(self, channel: int) -> None:
        conn_id = self.channels.get(channel)
        if conn_id is None:
            if len(self.channels) >= MAX_CHANNELS:
                raise ProtocolError(
                    f"channel {channel} refused: channels are numbered from 0, at most "
                    f"{MAX_CHANNELS} per connection"
                )
            conn_id = self._server.channel_opened(self)
            self.channels[channel] = conn_id
            self._channel_of[conn_id] = channel
        self._current = conn_id

    def _close_channel(self, channel: int) -> None:
        conn_id = self.channels.get(channel)
        if conn_id is None or channel == 0:
            return  # already gone; channel 0 closes with the connection
        del self.channels[channel], self._channel_of[conn_id]
        if self._current == conn_id:
            self._current = self.conn_id
        self._server.channel_lost(conn_id, "its channel was closed")

    def queue(self, conn_id: ConnId, msg: Any, out: list[Buffer]) -> None:
        """Add ``msg`` for channel ``conn_id`` to ``out``, naming the channel before a notice."""
        kind = type(msg)
        if not (kind is Reply or kind is Welcome or (kind is ErrorReply and msg.req_id)):
            channel = self._channel_of.get(conn_id)
            if channel is None:
                return  # that channel closed
            if channel != self._named:
                self._named = channel
                out += encode_message(Channel(channel))
        out += encode_message(msg)

    def end_channel(self, conn_id: ConnId) -> None:
        """The server closes channel ``conn_id``; channel 0 closes the whole connection."""
        if conn_id == self.conn_id:
            if self.transport is not None:
                self.transport.close()
            return
        channel = self._channel_of.pop(conn_id, None)
        if channel is not None:
            del self.channels[channel]
            if self._current == conn_id:
                self._current = self.conn_id
            self._server.channel_lost(conn_id, "closed by the server")

    def _authenticate(self, msg: Any) -> bool:
        token = self._server.token
        if isinstance(msg, AuthStart):
            if token is None and not self._answered_auth_start:
                self._answered_auth_start = True  # once: a stranger's stream of them costs nothing
                # Only a client holding a token asks. An empty challenge tells it at once
                # that no proof will come, and it refuses this server (no downgrade).
                self._server.log_refusal(
                    "token holder",
                    "a client at %s holds a token but this server requires none: it will "
                    "refuse to use this server; start it with --token-file or AIODIST_TOKEN",
                    self.peer,
                )
                self.write(Challenge(b""))
            return True  # with a token, the challenge went out on connect
        if token is None or self.authenticated:
            return True  # a proof sent to a server that requires none is accepted
        handshake, self._handshake = self._handshake, None  # one answer per challenge
        if isinstance(msg, Hello) and handshake is not None:
            try:
                proof = handshake.check_answer(msg.nonce, msg.proof)
            except Refused:
                pass
            else:
                self.authenticated = True
                self._passed()
                self.write(Authenticated(proof))
                return True
            why = "its proof of the token does not match the server's token"
            message = (
                "the rendezvous server refused this connection: AIODIST_TOKEN does not match "
                "the server's token; set it to the contents of the server's --token-file"
            )
        else:
            why = f"it sent {type(msg).__name__} without proving the token"
            message = (
                "the rendezvous server requires a token; set AIODIST_TOKEN to the contents "
                "of the server's --token-file"
            )
        self._refuse(why, message)
        return False

    def _count_refusal(self) -> None:
        if not self._refused and not self.proved:
            self._refused = True
            if self._server.token is not None:
                self._server.auth_failures += 1

    def _refuse(self, why: str, message: str) -> None:
        self._count_refusal()
        self._server.log_refusal("token", "refused a connection from %s: %s", self.peer, why)
        self._close_after(ErrorReply(0, ErrorCode.AUTHENTICATION, message, {}))

    def cut_off(self, reason: str, why: str, message: str, *, again: bool = False) -> None:
        """Close a connection the gate gave up on: tell it why, then abort (no lingering).

        Args:
            reason: The short fixed phrase the log's summary counts it under.
            why: What the log says it did.
            message: What the client is told.
            again: It was closed to make room, not for anything it did: a client
                connects again (``details["again"]``) until its own timeout.
        """
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._server.preauth_closed += 1
        if not self._refused:
            self._count_refusal()
            self._server.log_refusal(reason, "refused a connection from %s: %s", self.peer, why)
            token = self._server.token is not None and reason == "deadline"
            code = ErrorCode.AUTHENTICATION if token else ErrorCode.PROTOCOL
            # Small: the kernel takes it at once, before the abort drops what it did not.
            self.write(ErrorReply(0, code, message, {"again": True} if again else {}))
        transport.abort()

    def expired(self) -> None:
        """The gate's deadline passed before its handshake was done."""
        deadline = self._server.preauth.deadline
        if self._server.token is not None:
            self.cut_off(
                "deadline",
                f"it did not prove the token within {deadline:g} s",
                "the rendezvous server requires a token and got no proof of it in time; set "
                "AIODIST_TOKEN to the contents of the server's --token-file",
            )
        else:
            self.cut_off(
                "deadline",
                f"it sent no request within {deadline:g} s",
                f"the rendezvous server closed this connection: no request came within "
                f"{deadline:g} s of connecting",
            )

    def shed(self) -> None:
        """Too many connections wait for their handshake, and this one is the oldest."""
        most = self._server.preauth.max_pending
        self.cut_off(
            "shed",
            f"{most} connections were waiting for their handshake; it was the oldest",
            f"the rendezvous server closed this connection: {most} connections were waiting "
            "for their handshake, and this one had waited longest; connect again",
            again=True,
        )

    def _close_after(self, error: ErrorReply) -> None:
        """Send `error` last, then close without letting the peer lose it.

        Closing a socket with unread input makes the kernel answer with a reset,
        and a reset can discard the error still on its way to the client (whose
        next request was already in flight). So the write side is shut first and
        whatever still arrives is read and dropped, until the client closes or
        ``LINGER_TIMEOUT`` passes.
        """
        transport = self.transport
        assert transport is not None
        self.write(error)
        if self._linger_timer is not None or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self._linger_timer = self._server.loop.call_later(LINGER_TIMEOUT, transport.close)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        server = self._server
        if isinstance(exc, ssl.SSLError):  # a record altered in flight, a TLS alert
            why = describe_ssl_error(exc, f"the client at {self.peer}")
            server.log_refusal("tls", "closing connection from %s: %s", self.peer, why)
        if not self.proved and not self._refused and not server.state.closing:
            if server.token is not None:
                # It left before proving the token (a client without one gives up at the challenge).
                self._count_refusal()
                server.log_refusal(
                    "left",
                    "refused a connection from %s: it left without proving the token",
                    self.peer,
                )
        server.connection_lost(self, "connection lost" if exc is None else str(exc))

    def write(self, msg: Any) -> None:
        self.write_parts(encode_message(msg))

    def write_parts(self, parts: list[Buffer]) -> None:
        transport = self.transport
        if transport is None or transport.is_closing() or self._linger_timer is not None:
            return  # gone, or refused: its error was the last thing it is sent
        self._server.bytes_sent += sum(map(len, parts))
        transport.writelines(parts)
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER_BYTES:
            self._server.log_refusal(
                "not reading", "closing connection from %s: it stopped reading replies", self.peer
            )
            transport.abort()
