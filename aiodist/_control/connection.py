"""The client end of a control connection: requests with replies, and notices.

One ``asyncio.Protocol`` per server per process: the job members of one
process (ranks as tasks, several jobs) share it, each on its own *channel*
(``ControlChannel``), so a process of 256 members holds one connection, one
heartbeat timer and one socket instead of 256. A channel is what a member
sees: requests with replies, and the notices the server sends it. Requests
carry a ``req_id`` unique on the connection; the reply resolves the matching
future. Before another member's request the client names its channel
(``Channel``); the server names the channel before a notice. When the
connection drops, every pending request of every channel fails with the same
error and later requests fail at once. ``AIODIST_SHARED_CONTROL=0`` gives each
member a connection of its own.

With a token, the connection first answers the server's challenge (the
responder of ``_wire/handshake.py``) and accepts no reply until the server has
proved the token too. A client holding a token refuses a server that requires
none (its challenge carries no nonce) or cannot prove it: no silent downgrade.

**Losing the server.** A connection counts the server as gone when it leaves
a heartbeat unanswered for too long (``liveness.py``), when its socket closes,
or when the server says it is shutting down. Then every pending request
fails, and every channel's member is told (``ServerLost``) with the same
error: a rank without its server can no longer learn that other ranks failed,
so its session breaks its groups.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from typing import TYPE_CHECKING, Any, Final, cast

import anyio

from aiodist._control.channel import ControlChannel, Notice, ServerLost
from aiodist._control.liveness import Heartbeats
from aiodist._errors import (
    AuthenticationError,
    ClosedError,
    DistError,
    ErrorCode,
    GroupBrokenError,
    ProtocolError,
    RendezvousError,
    RendezvousTimeout,
    from_wire,
)
from aiodist._wire.frame import FrameDecoder, Limits, MiB, encode_message, frame_message
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
    MemberFailed,
    MembersJoined,
    MembersLeft,
    MessageKind,
    Reply,
    ServerClosing,
    Welcome,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from aiodist._wire.frame import Buffer

__all__ = ["ControlChannel", "ControlConnection", "Notice", "ServerLost", "connect_control"]

logger = logging.getLogger(__name__)

CLIENT_LIMITS: Final = Limits(max_header_bytes=64 * MiB, max_payload_bytes=0)
CONNECT_RETRY_INTERVAL: Final = 0.05
# What losing the server means for a member; said once, in every such error.
_WITHOUT_SERVER: Final = (
    "without it this rank can no longer learn that other ranks failed, so its process "
    "groups are broken. Restart the server, then the job."
)
# The least time given to a server's challenge, even when the connect timeout is nearly spent.
AUTH_WAIT: Final = 5.0


class ControlConnection(asyncio.Protocol):
    """Requests to the rendezvous server and the notices it sends back, for every channel."""

    def __init__(self, on_notice: Callable[[Notice], None] | None = None, token: str = "") -> None:
        self.loop = asyncio.get_running_loop()
        self._decoder = FrameDecoder(CLIENT_LIMITS)
        self.request_ids: Iterator[int] = itertools.count(1)  # unique on the connection
        self.routes: dict[int, ControlChannel] = {}  # req_id -> the channel that sent it
        self._own = ControlChannel(self, 0, on_notice)
        self._channels: dict[int, ControlChannel] = {0: self._own}
        self._channel_numbers = itertools.count(1)
        self._out_channel = 0  # the channel the server reads our next message for
        self._switches: dict[int, bytes] = {}  # each channel's encoded Channel message
        self._in_channel = 0  # the channel the server's next notice is for
        self._outbox: list[Buffer] = []
        self._transport: asyncio.Transport | None = None
        self._error: DistError | None = None
        self.token = token  # set before connecting: the challenge may come at once
        self._challenge: asyncio.Future[bytes] = self.loop.create_future()
        self._handshake: TokenHandshake | None = None  # sent our proof; the server's is due
        # With a token, nothing the server says is believed before it proved the token.
        self._trusted = not token
        self.server = "?"
        self.local_host = "127.0.0.1"
        self.heartbeats = Heartbeats(
            self.loop, self._send_heartbeat, self._server_silent, lambda: self.closed
        )
        self.liveness = self.heartbeats.rules  # when the server counts as gone (liveness.py)
        # How late this loop ran its heartbeat (asked before every operation: bound here).
        self.stalled_for = self.heartbeats.stalled_for
        # Called once when the connection fails or its last member leaves (the shared table).
        self.on_retired: Callable[[ControlConnection], None] | None = None

    # --- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast("asyncio.Transport", transport)
        peer = transport.get_extra_info("peername")
        self.server = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        local = transport.get_extra_info("sockname")
        # The numeric address this host reaches the server from: peers can reach it too.
        self.local_host = str(local[0]) if isinstance(local, tuple) else "127.0.0.1"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.liveness.last_heard = self.loop.time()
        try:
            for event in self._decoder.frames(data):
                header = event.header
                if (
                    event.kind == MessageKind.REPLY
                    and self._trusted
                    and type(header) is list
                    and len(header) == 2
                    and type(header[0]) is int
                ):
                    # Most of what a member hears: resolve it without building a Reply.
                    self._resolve(header[0], header[1])
                    continue
                self._dispatch(frame_message(event))
        except ProtocolError as exc:
            self._fail(exc)
            assert self._transport is not None
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.heartbeats.stop()
        if self._error is None:
            why = "it closed" if exc is None else str(exc)
            self._fail(
                GroupBrokenError(
                    f"lost the connection to the rendezvous server at {self.server} ({why}); "
                    f"{_WITHOUT_SERVER}"
                )
            )

    # --- requests --------------------------------------------------------------------

    @property
    def on_notice(self) -> Callable[[Notice], None] | None:
        """Called with the notices for channel 0 (the connection's own)."""
        return self._own.on_notice

    @on_notice.setter
    def on_notice(self, callback: Callable[[Notice], None] | None) -> None:
        self._own.on_notice = callback

    @property
    def closed(self) -> bool:
        return self._transport is None or self._error is not None

    @property
    def error(self) -> DistError | None:
        """Why the connection is unusable, or None while it works."""
        return self._error

    def open_channel(self, on_notice: Callable[[Notice], None] | None = None) -> ControlChannel:
        """A new member's channel on this connection."""
        if self._error is not None:
            raise self._error
        channel = ControlChannel(self, next(self._channel_numbers), on_notice)
        self._channels[channel.number] = channel
        return channel

    async def request(self, build: Callable[[int], Any], *, timeout: float | None = None) -> Any:
        """``ControlChannel.request`` on channel 0, the connection's own."""
        return await self._own.request(build, timeout=timeout)

    def send(self, msg: Any) -> None:
        """Send a message that expects no reply, on channel 0."""
        self._own.send(msg)

    def send_on(self, channel: int, msg: Any) -> None:
        """Send ``msg`` for channel ``channel``, naming the channel first if it changed."""
        if self._error is not None:
            raise self._error
        parts = encode_message(msg)
        if channel != self._out_channel:
            self._out_channel = channel
            switch = self._switches.get(channel)
            if switch is None:  # encoded once per channel: it precedes most of its messages
                switch = self._switches[channel] = b"".join(encode_message(Channel(channel)))
            parts = [switch, *parts]
        self._write(parts)

    def _write(self, parts: list[Buffer]) -> None:
        assert self._transport is not None
        if len(self._channels) <= 2 and not self._outbox:  # one member: write at once
            self._transport.writelines(parts)
            return
        # Members of one process often send together (a job forming, a barrier): their
        # messages leave in one write at the end of this loop iteration, not one each.
        if not self._outbox:
            self.loop.call_soon(self._flush_outbox)
        self._outbox += parts

    def _flush_outbox(self) -> None:
        parts, self._outbox = self._outbox, []
        if self._transport is not None and parts:
            self._transport.writelines(parts)

    def start_heartbeats(self, interval: float, timeout: float | None = None) -> None:
        """Send a heartbeat at least every ``interval`` seconds until the connection closes.

        With ``timeout``, a server that echoed heartbeats and then leaves one
        unanswered that long counts as gone (the shortest timeout of the
        connection's members applies; ``liveness.py`` has the rules).
        """
        self.heartbeats.start(interval, timeout)

    @property
    def heartbeat_interval(self) -> float:
        return self.liveness.interval

    def _send_heartbeat(self) -> None:
        self.send_on(self._out_channel, Heartbeat())  # any channel: it counts for all

    def _server_silent(self, silent: float) -> None:
        self._fail(
            GroupBrokenError(
                f"the rendezvous server at {self.server} did not answer heartbeats for "
                f"{silent:.1f} s (heartbeat timeout {self.liveness.silence_limit:.1f} s); "
                f"{_WITHOUT_SERVER}"
            )
        )
        assert self._transport is not None
        self._transport.abort()  # the server, if it still runs, sees this member go

    def close(self) -> None:
        self.heartbeats.stop()
        if self._error is None:
            self._fail(ClosedError("the control connection was closed"))
        if self._transport is not None:
            self._flush_outbox()
            self._transport.close()

    def channel_closed(self, channel: ControlChannel) -> None:
        """Its member closed ``channel``: tell the server; the last one closes the connection."""
        if channel.number == 0:
            self.close()
            return
        if self._channels.pop(channel.number, None) is None:
            return
        if self._error is None:
            self.send_on(channel.number, CloseChannel(channel.number))
        self._switches.pop(channel.number, None)
        if self._error is None and len(self._channels) == 1:  # its last member left
            self._retire()
            self.close()

    # --- internals ---------------------------------------------------------------------

    async def authenticate(self, token: str, timeout: float) -> None:
        """Answer the server's challenge with a proof of ``token``.

        Returns once the proof is sent; requests may follow at once (the server
        reads them after the proof). The server's own proof is checked when it
        arrives, before any reply is accepted.

        Raises:
            AuthenticationError: The server refused the connection, or requires
                no token (it could never prove ours).
            RendezvousTimeout: No challenge within ``timeout``.

        Cancellation:
            The connection is left unauthenticated; close it.
        """
        self.token = token
        self._trusted = False
        self.send(AuthStart())
        try:
            server_nonce = await asyncio.wait_for(asyncio.shield(self._challenge), timeout)
        except TimeoutError:
            raise RendezvousTimeout(
                f"the rendezvous server at {self.server} sent no challenge within "
                f"{timeout:.1f} s; is it an aiodist server?"
            ) from None
        handshake = TokenHandshake(Role.RESPONDER, token, CONTROL)
        try:
            nonce, proof = handshake.answer(server_nonce)
        except Refused as exc:
            # A server without a token answers AuthStart with an empty challenge: no
            # proof of ours can come back, so refuse now, not at a timeout.
            raise self._refuse(
                f"the rendezvous server at {self.server} did not prove the job token (it "
                "requires none); refusing to use it. Start the server with the same token "
                "(--token-file or AIODIST_TOKEN)"
                if exc.reason == "no token"
                else self._unproved()
            ) from None
        self._handshake = handshake
        self.send(Hello(nonce, proof))

    def _unproved(self) -> str:
        return (
            f"the rendezvous server at {self.server} could not prove that it knows "
            "AIODIST_TOKEN; check that you are talking to the server you meant to"
        )

    def _on_auth_message(self, msg: Challenge | Authenticated) -> None:
        if isinstance(msg, Challenge):
            if msg.nonce and not self.token:
                self._refuse(
                    f"the rendezvous server at {self.server} requires a token; set "
                    "AIODIST_TOKEN to the contents of the server's --token-file"
                )
            elif not self._challenge.done():  # authenticate() answers it
                self._challenge.set_result(msg.nonce)
            return
        handshake, self._handshake = self._handshake, None  # one proof per handshake
        try:
            if handshake is None:
                raise Refused("mismatch")  # a proof nobody asked for
            handshake.check_proof(msg.proof)
        except Refused:
            self._refuse(self._unproved())
        else:
            self._trusted = True

    def _refuse(self, message: str) -> AuthenticationError:
        exc = AuthenticationError(message)
        self._fail(exc)
        self.close()
        return exc

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, Challenge | Authenticated):
            self._on_auth_message(msg)
            return
        if not self._trusted:
            if isinstance(msg, ErrorReply) and msg.req_id not in self.routes:
                pass  # the server's refusal (req_id 0): handled below
            elif not isinstance(msg, ServerClosing):
                self._refuse(
                    f"the rendezvous server at {self.server} answered before proving that it "
                    "knows AIODIST_TOKEN; check that you are talking to the server you meant to"
                )
                return
        if isinstance(msg, Reply | Welcome):
            self._resolve(msg.req_id, msg.value if isinstance(msg, Reply) else msg)
        elif isinstance(msg, Heartbeat):
            self.liveness.echoed = True  # from now on, its silence means it is gone
        elif isinstance(msg, Channel):
            self._in_channel = msg.channel
        elif isinstance(msg, ErrorReply):
            exc = from_wire(msg.code, msg.message, msg.details)
            if msg.req_id in self.routes:
                self._resolve(msg.req_id, exc)
            elif msg.code in (ErrorCode.PROTOCOL, ErrorCode.AUTHENTICATION):
                self._fail(exc)
                self.close()  # the server stopped reading us: hang up so it can close too
            elif msg.code == ErrorCode.RANK_FAILED:
                if (channel := self._channels.get(self._in_channel)) is not None:
                    channel.fail(exc)
            else:
                logger.warning("rendezvous server %s: %s", self.server, msg.message)
        elif isinstance(msg, MemberFailed | MembersLeft | MembersJoined):
            if (channel := self._channels.get(self._in_channel)) is not None:
                channel.notice(msg)
        elif isinstance(msg, ServerClosing):
            if self._error is None:
                logger.warning("the rendezvous server at %s shut down: %s", self.server, msg.reason)
            self._fail(
                RendezvousError(
                    f"the rendezvous server at {self.server} shut down ({msg.reason}); "
                    f"{_WITHOUT_SERVER}"
                )
            )
        else:
            self._fail(ProtocolError(f"the server sent an unexpected {type(msg).__name__}"))

    def _retire(self) -> None:
        # Failed, or its last member left: no member may open a channel on it again.
        retired, self.on_retired = self.on_retired, None
        if retired is not None:
            retired(self)

    def _resolve(self, req_id: int, value: Any) -> None:
        channel = self.routes.get(req_id)
        if channel is not None:
            channel.resolve(req_id, value)

    def _fail(self, exc: DistError) -> None:
        first = self._error is None
        if first:
            self._error = exc
            self._retire()
        if not self._challenge.done():
            self._challenge.set_exception(exc)
            self._challenge.exception()  # retrieved: authenticate() re-raises it
        for channel in list(self._channels.values()):
            channel.fail_pending(exc)
        if first and not isinstance(exc, ClosedError):
            # Not closed by its members: they lost their server, and must hear of it
            # even when no request of theirs is pending (a rank inside a collective).
            for channel in list(self._channels.values()):
                channel.notice(ServerLost(exc))


async def connect_control(
    host: str,
    port: int,
    *,
    timeout: float,
    on_notice: Callable[[Notice], None] | None = None,
    retry_refused: bool = True,
    token: str | None = None,
) -> ControlConnection:
    """Connect to the rendezvous server, retrying while nothing listens yet.

    Args:
        host: The server's address.
        port: The server's port.
        timeout: Seconds to keep retrying while nothing listens.
        on_notice: Called with every notice the server sends (a member failed, closing).
        retry_refused: Retry while the connection is refused.
        token: The job's shared token; ``None`` reads ``$AIODIST_TOKEN``. The
            connection answers the server's challenge with a proof of it (the
            token itself is never sent) before it returns, and believes no
            reply before the server proved the token in turn.

    Raises:
        ConnectionRefusedError: Nothing listens and ``retry_refused`` is false.
        RendezvousTimeout: Nothing answered within ``timeout``.
        AuthenticationError: The server refused the token, or requires none
            (never retried).
    """
    if token is None:
        token = os.environ.get("AIODIST_TOKEN", "")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            _, protocol = await loop.create_connection(
                lambda: ControlConnection(on_notice, token), host, port
            )
        except OSError as exc:
            if not retry_refused and isinstance(exc, ConnectionRefusedError):
                raise
            if loop.time() >= deadline:
                raise RendezvousTimeout(
                    f"no rendezvous server answered at {host}:{port} within {timeout:.1f} s "
                    f"({exc.strerror or exc}); start one with `aiodist serve --port {port}` or "
                    "let rank 0 embed it"
                ) from exc
            # Not a sleep-wait for an event: the server is another process; poll for it.
            await anyio.sleep(CONNECT_RETRY_INTERVAL)
            continue
        if token:
            try:
                await protocol.authenticate(token, max(deadline - loop.time(), AUTH_WAIT))
            except BaseException:
                protocol.close()
                raise
        return protocol
