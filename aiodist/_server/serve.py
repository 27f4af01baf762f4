"""The rendezvous server's asyncio shell: accept, decode, feed ``ServerState``, write.

All decisions live in ``state.py``; this module moves bytes. One
``asyncio.Protocol`` per connection feeds a ``FrameDecoder``; a protocol error
closes that one connection with a log line. A connection carries the members
of one client process on *channels* (``Channel`` names the channel of the
messages after it): ``state.py`` sees each channel as a connection of its own,
so a job table never knows which members share a socket. A heartbeat counts
for every channel of its connection. The replies of one batch of actions
leave in one write per connection. Deadlines (store waits, barriers,
joins, the heartbeat sweep) are one ``loop.call_at`` timer, re-armed after
every batch of actions. Peer addresses are logged as the numeric addresses the
socket reports: the server never resolves a host name.

A server started with a token authenticates each connection before anything it
sends reaches the job table: it sends a fresh nonce (``Challenge``) as soon as
the client connects, and the client's first message must be a ``Hello`` whose
HMAC answers that nonce (checked in constant time, see ``_auth.py``); anything
else gets one AUTHENTICATION error and the connection is closed, as is one that
has not authenticated within ``AUTH_TIMEOUT`` seconds. The token never crosses
the wire and is never logged.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import socket
from typing import TYPE_CHECKING, Any, Final, cast

import anyio

from aiodist._auth import NONCE_BYTES, client_proof, new_nonce, server_proof, verify
from aiodist._errors import ProtocolError
from aiodist._server.jobs import Close
from aiodist._server.state import ServerState
from aiodist._wire.frame import (
    CLOSED,
    NEED_DATA,
    Frame,
    FrameDecoder,
    Limits,
    MiB,
    encode_message,
    frame_message,
)
from aiodist._wire.messages import (
    Authenticated,
    AuthStart,
    Challenge,
    Channel,
    CloseChannel,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    Hello,
    MessageKind,
    Reply,
    Welcome,
)

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

    from aiodist._server.jobs import ConnId
    from aiodist._wire.frame import Buffer

__all__ = ["DEFAULT_PORT", "DEFAULT_SHUTDOWN_TIMEOUT", "RendezvousServer", "serve_rendezvous"]

logger = logging.getLogger(__name__)

DEFAULT_PORT: Final = 29500
# The server never relays bulk data: any payload is a protocol error.
SERVER_LIMITS: Final = Limits(max_header_bytes=1 * MiB, max_payload_bytes=0)
# A client that stops reading its replies is cut off rather than buffered forever.
MAX_WRITE_BUFFER_BYTES: Final = 64 * MiB
# asyncio's default backlog of 100 overflows when a large job connects at once.
LISTEN_BACKLOG: Final = 4096
# How long a shutdown waits for clients to take the closing notice before cutting them off.
DEFAULT_SHUTDOWN_TIMEOUT: Final = 5.0
# A connection that has not proved the token by then is closed: it holds no slot forever.
AUTH_TIMEOUT: Final = 10.0
# How long a refused connection is drained after its error went out (see ``_close_after``).
LINGER_TIMEOUT: Final = 5.0
# Members' channels one connection may open: a process's ranks, with room to spare.
MAX_CHANNELS: Final = 65536


def _version() -> str:
    try:
        return importlib.metadata.version("aiodist")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout
        return "unknown"


class _ServerConnection(asyncio.Protocol):
    def __init__(self, server: RendezvousServer, conn_id: int) -> None:
        self._server = server
        self._id = conn_id
        self._decoder = FrameDecoder(SERVER_LIMITS)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.authenticated = server.token is None
        self._nonce = b""
        self._auth_timer: asyncio.TimerHandle | None = None
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
        self._server._connection_made(self)
        if not self.authenticated:
            self._nonce = new_nonce()
            self.write(Challenge(self._nonce))
            self._auth_timer = self._server._loop.call_later(AUTH_TIMEOUT, self._auth_expired)

    def data_received(self, data: bytes) -> None:
        self._server.bytes_received += len(data)
        if self.transport is None or self.transport.is_closing() or self._linger_timer:
            return  # refused or cut off: nothing more it sends is read
        dec = self._decoder
        try:
            dec.receive_data(data)
            while (event := dec.next_event()) is not NEED_DATA:
                if event is CLOSED:
                    break
                assert isinstance(event, Frame)  # payloads are refused by SERVER_LIMITS
                if event.kind == MessageKind.CHANNEL and self.authenticated:
                    # Before nearly every request of a shared connection: read it here.
                    header = event.header
                    if type(header) is not list or len(header) != 1 or type(header[0]) is not int:
                        raise ProtocolError(f"malformed CHANNEL message: {header!r:.80}")
                    self._select(header[0])
                    continue
                msg = frame_message(event)
                if not self.authenticated or isinstance(msg, AuthStart | Hello):
                    if not self._authenticate(msg):
                        break
                    continue
                kind = type(msg)
                if kind is Heartbeat:
                    for conn_id in self.channels.values():
                        self._server._receive(conn_id, msg)
                elif kind is CloseChannel:
                    self._close_channel(msg.channel)
                else:
                    self._server._receive(self._current, msg)
        except ProtocolError as exc:
            logger.warning("closing connection from %s: %s", self.peer, exc)
            self._close_after(ErrorReply(0, ErrorCode.PROTOCOL, str(exc), {}))
        self._server._flush()

    def _select(self, channel: int) -> None:
        conn_id = self.channels.get(channel)
        if conn_id is None:
            if channel < 0 or len(self.channels) >= MAX_CHANNELS:
                raise ProtocolError(
                    f"channel {channel} refused: channels are numbered from 0, at most "
                    f"{MAX_CHANNELS} per connection"
                )
            conn_id = self._server._channel_opened(self)
            self.channels[channel] = conn_id
            self._channel_of[conn_id] = channel
        self._current = conn_id

    def _close_channel(self, channel: int) -> None:
        conn_id = self.channels.get(channel)
        if conn_id is None or channel == 0:
            return  # already gone; channel 0 closes with the connection
        del self.channels[channel], self._channel_of[conn_id]
        if self._current == conn_id:
            self._current = self._id
        self._server._channel_lost(conn_id, "its channel was closed")

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
        if conn_id == self._id:
            if self.transport is not None:
                self.transport.close()
            return
        channel = self._channel_of.pop(conn_id, None)
        if channel is not None:
            del self.channels[channel]
            if self._current == conn_id:
                self._current = self._id
            self._server._channel_lost(conn_id, "closed by the server")

    def _authenticate(self, msg: Any) -> bool:
        token = self._server.token
        if isinstance(msg, AuthStart):
            if token is None:
                self.write(Challenge(b""))  # nothing to prove: the client goes on
            return True  # with a token, the challenge went out on connect
        if token is None or self.authenticated:
            return True  # a proof sent to a server that requires none is accepted
        if isinstance(msg, Hello):
            nonce = msg.nonce
            if len(nonce) == NONCE_BYTES and verify(
                client_proof(token, self._nonce, nonce), msg.proof
            ):
                self.authenticated = True
                server_nonce, self._nonce = self._nonce, b""  # one answer per challenge
                self._cancel_auth_timer()
                self.write(Authenticated(server_proof(token, nonce, server_nonce)))
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

    def _cancel_auth_timer(self) -> None:
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None

    def _refuse(self, why: str, message: str) -> None:
        self._cancel_auth_timer()
        self._server.auth_failures += 1
        logger.warning("refused a connection from %s: %s", self.peer, why)
        self._close_after(ErrorReply(0, ErrorCode.AUTHENTICATION, message, {}))

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
        self._linger_timer = self._server._loop.call_later(LINGER_TIMEOUT, transport.close)

    def _auth_expired(self) -> None:
        self._auth_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self._refuse(
                f"it did not prove the token within {AUTH_TIMEOUT:.0f} s",
                "the rendezvous server requires a token and got no proof of it in time; set "
                "AIODIST_TOKEN to the contents of the server's --token-file",
            )

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        if self._auth_timer is not None:
            # It left before proving the token (a client without one gives up at the challenge).
            self._cancel_auth_timer()
            self._server.auth_failures += 1
            logger.warning(
                "refused a connection from %s: it left without proving the token", self.peer
            )
        self._server._connection_lost(self, "connection lost" if exc is None else str(exc))

    def write(self, msg: Any) -> None:
        self.write_parts(encode_message(msg))

    def write_parts(self, parts: list[Buffer]) -> None:
        transport = self.transport
        if transport is None or transport.is_closing() or self._linger_timer is not None:
            return  # gone, or refused: its error was the last thing it is sent
        self._server.bytes_sent += sum(map(len, parts))
        transport.writelines(parts)
        if transport.get_write_buffer_size() > MAX_WRITE_BUFFER_BYTES:
            logger.warning("closing connection from %s: it stopped reading replies", self.peer)
            transport.abort()


class RendezvousServer:
    """A running rendezvous server. Start one with ``serve_rendezvous``.

    Attributes:
        address: ``(host, port)`` it listens on, with the port the OS picked.
        state: The job table (read it; never change it from outside).
        token: The token clients must send, or None when none is required.
        bytes_received: Bytes read from all clients so far.
        bytes_sent: Bytes written to all clients so far.
        auth_failures: Connections refused for a missing or wrong token.
    """

    def __init__(
        self, *, token: str | None = None, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.state = ServerState(self._loop.time())
        self.state.version = _version()
        self.token = token or None
        self.shutdown_timeout = shutdown_timeout
        self.bytes_received = 0
        self.bytes_sent = 0
        self.auth_failures = 0
        self.address: tuple[str, int] = ("", 0)
        self._conns: dict[ConnId, _ServerConnection] = {}  # every channel's connection
        self._sockets: set[_ServerConnection] = set()
        self._next_id = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0
        self._server: asyncio.Server | None = None
        self._changed = asyncio.Event()

    async def _start(self, host: str, port: int) -> None:
        self._server = await self._loop.create_server(
            lambda: _ServerConnection(self, self._new_id()),
            host,
            port,
            reuse_address=True,
            backlog=LISTEN_BACKLOG,
        )
        sockname = self._server.sockets[0].getsockname()
        self.address = (str(sockname[0]), int(sockname[1]))
        logger.info("rendezvous server listening on %s:%d", *self.address)

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    @property
    def num_connections(self) -> int:
        """Client connections open (each may carry several members' channels)."""
        return len(self._sockets)

    async def wait_until(self, predicate: Any) -> None:
        """Wait until ``predicate(server)`` holds; re-checked after every state change."""
        while not predicate(self):
            self._changed.clear()
            await self._changed.wait()

    async def wait_for_members(self, group_name: str, n: int) -> None:
        """Wait until job ``group_name`` has ``n`` members joined."""
        await self.wait_until(
            lambda s: (job := s.state.jobs.get(group_name)) is not None and len(job.members) >= n
        )

    def metrics_sample(self) -> dict[str, Any]:
        """Counters and gauges for the metrics endpoint; call it on the server's loop."""
        stats = self.state.stats
        jobs = {"forming": 0, "running": 0, "failed": 0}
        members = 0
        for job in self.state.jobs.values():
            jobs["failed" if job.failures else "running" if job.complete else "forming"] += 1
            members += len(job.members)
        return {
            "version": self.state.version,
            "uptime": self._loop.time() - self.state.started_at,
            "connections": len(self._sockets),
            "jobs": jobs,
            "members": members,
            "joins": stats.joins,
            "jobs_formed": stats.jobs_formed,
            "failures": stats.failures,
            "store_ops": stats.store_ops,
            "messages": stats.messages,
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "auth_failures": self.auth_failures,
        }

    async def aclose(self, reason: str = "the rendezvous server is shutting down") -> None:
        """Stop accepting, tell every client the server is going away, close connections.

        Each connection is closed after its notice is written; a client that does
        not read it within ``shutdown_timeout`` seconds is cut off.
        """
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        self.state.close(reason)
        self._flush()
        for conn in list(self._sockets):
            conn._cancel_auth_timer()
            if conn.transport is not None:
                conn.transport.close()
        if self._timer is not None:
            self._timer.cancel()
        with anyio.move_on_after(self.shutdown_timeout):
            await self.wait_until(lambda s: not s._sockets)
        for conn in list(self._sockets):
            logger.warning("cutting off %s: it did not take the closing notice", conn.peer)
            if conn.transport is not None:
                conn.transport.abort()
        with anyio.move_on_after(self.shutdown_timeout):
            await server.wait_closed()

    # --- called by connections -------------------------------------------------------

    def _connection_made(self, conn: _ServerConnection) -> None:
        self._sockets.add(conn)
        self._conns[conn._id] = conn
        self.state.connection_made(conn._id, conn.peer, self._loop.time())

    def _channel_opened(self, conn: _ServerConnection) -> ConnId:
        conn_id = self._new_id()
        self._conns[conn_id] = conn
        self.state.connection_made(conn_id, conn.peer, self._loop.time())
        return conn_id

    def _channel_lost(self, conn_id: ConnId, reason: str) -> None:
        if self._conns.pop(conn_id, None) is not None:
            self.state.connection_lost(conn_id, self._loop.time(), reason)

    def _connection_lost(self, conn: _ServerConnection, reason: str) -> None:
        self._sockets.discard(conn)
        for conn_id in list(conn.channels.values()):
            self._channel_lost(conn_id, reason)
        self._flush()

    def _receive(self, conn_id: int, msg: Any) -> None:
        self.state.receive(conn_id, msg, self._loop.time())

    def _flush(self) -> None:
        # One write per connection for the whole batch: a barrier released for 256
        # members of one process is one syscall, not 256.
        out: dict[_ServerConnection, list[Buffer]] = {}
        while actions := self.state.take_actions():  # closing a channel may add some
            for action in actions:
                conn = self._conns.get(action.conn)
                if conn is None:
                    continue
                if isinstance(action, Close):
                    if (parts := out.pop(conn, None)) is not None:
                        conn.write_parts(parts)  # what went before the close goes first
                    conn.end_channel(action.conn)
                else:
                    conn.queue(action.conn, action.msg, out.setdefault(conn, []))
        for conn, parts in out.items():
            if parts:
                conn.write_parts(parts)
        self._arm_timer()
        self._changed.set()

    def _arm_timer(self) -> None:
        when = self.state.next_deadline()
        if when is None:
            return
        if self._timer is not None and not self._timer.cancelled() and self._timer_when <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_when = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.state.handle_timeouts(self._loop.time())
        self._flush()


async def serve_rendezvous(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    token: str | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    task_status: TaskStatus[RendezvousServer] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a rendezvous server until cancelled.

    Args:
        host: Numeric address to bind; the default accepts local clients only.
        port: 0 lets the OS pick one; read it from ``server.address``.
        token: When given, every client must send it (``AIODIST_TOKEN``) before
            anything else; others are refused with ``AuthenticationError``.
        shutdown_timeout: Seconds a shutdown waits for clients to take the
            closing notice before cutting them off.
        task_status: Receives the ``RendezvousServer`` once it is listening.

    Cancellation:
        Cancelling the task closes the listener and every connection, telling
        clients first that the server is going away (bounded by ``shutdown_timeout``).

    Example:
        >>> async with anyio.create_task_group() as tg:
        ...     server = await tg.start(serve_rendezvous, "127.0.0.1", 0)
    """
    server = RendezvousServer(token=token, shutdown_timeout=shutdown_timeout)
    await server._start(host, port)
    try:
        task_status.started(server)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await server.aclose()
