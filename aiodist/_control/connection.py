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

**A server that comes back.** A member of a job on a server that may come
back (its ``Welcome`` said so: a daemon) does not give up at once: the
connection reconnects with backoff and jitter for ``AIODIST_SERVER_GRACE``
seconds, authenticates again, re-attaches each member and sends its pending
requests again (``reconnect.py``). Meanwhile the members' pending requests
wait, and their operations among themselves go on. Each member is told when
the server goes away (``ServerAway``) and when it is back (``ServerBack``):
meanwhile no server can say that a rank failed. Past the grace period, the
members are told as above (``ServerLost``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import socket
import ssl
from typing import TYPE_CHECKING, Any, Final, cast

import anyio

from aiodist import _settings
from aiodist._control.channel import (
    ControlChannel,
    Notice,
    ServerAway,
    ServerBack,
    ServerLost,
    where_of,
)
from aiodist._control.liveness import Heartbeats
from aiodist._control.reconnect import Reconnect
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
from aiodist._transport import tls
from aiodist._wire.frame import FrameDecoder, Limits, MiB, encode_message, frame_message
from aiodist._wire.handshake import CONTROL, Refused, Role, TokenHandshake
from aiodist._wire.messages import (
    Authenticated,
    AuthStart,
    Challenge,
    Channel,
    CloseChannel,
    DumpNotice,
    ErrorReply,
    Heartbeat,
    Hello,
    MemberFailed,
    MembersFailed,
    MembersJoined,
    MembersLeft,
    Reattach,
    Reply,
    ServerClosing,
    Welcome,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from aiodist._wire.frame import Buffer

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
# How long a server may take to echo the first heartbeat (it does so in milliseconds):
# past it, what listens is not an aiodist server (``aiodist run --rdzv-endpoint``'s too).
PROBE_WAIT: Final = 5.0
# While nothing listens: the first word after this many seconds, then one every so often.
FIRST_WAITING_WORD: Final = 5.0
WAITING_WORD_INTERVAL: Final = 30.0

# What a reconnecting connection sends before its members are back: the token's proof
# and each member's re-attachment.
_REJOINING: Final = frozenset({AuthStart, Hello, Reattach})


class _Shed(ProtocolError):
    """The server's gate closed this connection before its handshake, to make room
    (a flood of connections): ``connect_control`` connects again."""


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
        # connect_control's TLS arguments (none: clear TCP); reopen connects with them too.
        self.ssl_args: dict[str, Any] = {}
        self._heard = False  # the server sent something
        self.local_host = "127.0.0.1"
        self.heartbeats = Heartbeats(
            self.loop, self._send_heartbeat, self._server_silent, lambda: self.closed
        )
        self.liveness = self.heartbeats.rules  # when the server counts as gone (liveness.py)
        # How late this loop ran its heartbeat (asked before every operation: bound here).
        self.stalled_for = self.heartbeats.stalled_for
        # Resolved by the first frame the server sends (``probe``), failed if it cannot be.
        self.heard: asyncio.Future[None] = self.loop.create_future()
        # Called once when the connection fails or its last member leaves (the shared table).
        self.on_retired: Callable[[ControlConnection], None] | None = None
        self.address: tuple[str, int] | None = None  # where connect_control reached the server
        self.reconnect: Reconnect | None = None  # while the server is away and we look for it
        # Reconnecting: every member re-attached, their pending requests may go again.
        self.reattached = False

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
        self._heard = True
        self.liveness.heard(self.loop.time())
        try:
            for event in self._decoder.frames(data):
                if not self.heard.done():
                    self.heard.set_result(None)  # a frame of aiodist's: the probe's answer
                header = event.header
                if (
                    event.kind == Reply.KIND
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
        if self._error is None and isinstance(exc, ssl.SSLError):  # refused, or altered in flight
            peer = f"the rendezvous server at {self.server}"
            self._fail(AuthenticationError(tls.describe_ssl_error(exc, peer)))
        elif self._error is None and self.ssl_args and not self._heard:
            # A server that refused our certificate may close without a word (or its
            # alert may be lost): before it said anything, that is the likely reason.
            self._fail(
                AuthenticationError(
                    f"the rendezvous server at {self.server} closed the TLS connection before "
                    "answering: it refused this process's certificate, most likely. "
                    "AIODIST_TLS_CERT (--tls-cert) must be signed by the CA the server trusts "
                    "(its --tls-ca); the server's log says why"
                )
            )
        elif self._error is None:
            why = "it closed" if exc is None else str(exc)
            if self._server_away(f"lost the connection ({why})"):
                return
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
        if self.reconnect is not None and not self.reattached and type(msg) not in _REJOINING:
            # Back on a new connection, not re-attached yet: a member's request must not
            # reach the server before the token's proof (it would refuse the connection);
            # it waits in its channel and is sent again once every member is back.
            return
        parts = encode_message(msg)
        if channel != self._out_channel:
            self._out_channel = channel
            switch = self._switches.get(channel)
            if switch is None:  # encoded once per channel: it precedes most of its messages
                switch = self._switches[channel] = b"".join(encode_message(Channel(channel)))
            parts = [switch, *parts]
        self._write(parts)

    def _write(self, parts: list[Buffer]) -> None:
        if self._transport is None:
            # The server is away: requests wait in their channels, sent again on reconnecting.
            assert self.reconnect is not None
            return
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
        # Any channel: it counts for all; it carries what each member is doing.
        self.send_on(self._out_channel, Heartbeat(where_of(self._channels)))

    def _server_silent(self, silent: float) -> None:
        if self._server_away(f"it did not answer heartbeats for {silent:.1f} s"):
            assert self._transport is not None
            self._transport.abort()
            return
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
        if self.reconnect is not None:
            self.reconnect.cancel()
            self.reconnect = None
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

    async def probe(self, timeout: float) -> None:
        """Check that an aiodist rendezvous server answers here (it echoes a heartbeat).

        A port where something else listens (a torch TCPStore, an HTTP server,
        a silent listener) would otherwise hold the join until its timeout.

        Raises:
            RendezvousError: What listens there does not speak aiodist's protocol.
            RendezvousTimeout: It said nothing within ``timeout`` seconds.
        """
        self.send(Heartbeat())
        try:
            with anyio.fail_after(timeout):
                await asyncio.shield(self.heard)
            if isinstance(self._error, _Shed):  # its answer was that it had no room
                raise self._error
        except TimeoutError:
            self.close()
            raise RendezvousTimeout(
                f"something listens at {self.server}, but it did not answer as an aiodist "
                f"rendezvous server within {timeout:.1f} s (a torch TCPStore, another service?); "
                "point init_method at the port `aiodist serve` or rank 0 listens on"
            ) from None
        except DistError as exc:
            if isinstance(exc, AuthenticationError | _Shed):
                raise
            raise RendezvousError(
                f"something listens at {self.server}, but it does not speak as an aiodist "
                f"rendezvous server ({exc}); "
                "point init_method at the port `aiodist serve` or rank 0 listens on"
            ) from None

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
            if msg.req_id == 0 and msg.details.get("again") is True:
                if self.reconnect is not None and self._transport is not None:
                    self._transport.abort()  # shed while coming back: the search tries again
                    return
                exc = _Shed(msg.message)
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
        elif isinstance(
            msg, MemberFailed | MembersFailed | MembersLeft | MembersJoined | DumpNotice
        ):
            if (channel := self._channels.get(self._in_channel)) is not None:
                channel.notice(msg)
        elif isinstance(msg, ServerClosing):
            if msg.coming_back and self._server_away(f"it is restarting ({msg.reason})"):
                if self._transport is not None:
                    self._transport.abort()
                return
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

    # --- a server that may come back (reconnect.py drives these) -------------------------

    def _server_away(self, why: str) -> bool:
        """The server went away: look for it if it may come back. False: give up now."""
        if self.reconnect is not None:
            self.reconnect.lost(why)  # already looking: this attempt's connection failed
            return True
        if self.address is None or not any(c.reattach for c in self._channels.values()):
            return False
        self.reconnect = Reconnect.start(self, why)
        if self.reconnect is None:
            return False
        for channel in list(self._channels.values()):
            channel.notice(ServerAway(why))
        return True

    @property
    def server_away(self) -> bool:
        """The server went away and this connection looks for it (``reconnect.py``)."""
        return self.reconnect is not None

    def transport_or_none(self) -> asyncio.Transport | None:
        return self._transport

    def member_channels(self) -> list[ControlChannel]:
        return list(self._channels.values())

    async def reopen(self) -> None:
        """Connect again to the address ``connect_control`` reached (``reconnect.py``).

        The new transport starts framing, channels and the handshake over.
        """
        assert self.address is not None
        self._decoder = FrameDecoder(CLIENT_LIMITS)
        self._out_channel = self._in_channel = 0
        self._outbox = []
        self._challenge = self.loop.create_future()
        self._handshake = None
        self._trusted = not self.token
        self.reattached = False
        rules = self.liveness
        rules.echoed = False
        rules.unanswered_since = None
        rules.last_heard = self.loop.time()
        try:
            await self.loop.create_connection(lambda: self, *self.address, **self.ssl_args)
        except ssl.SSLError as exc:  # the server came back with a certificate we refuse
            refused = AuthenticationError(
                tls.describe_ssl_error(exc, f"the rendezvous server at {self.server}")
            )
            self._fail(refused)
            raise refused from exc

    def back(self) -> None:
        """Every member re-attached: heartbeats again, at once (the echo restarts the watch)."""
        self.reconnect = None
        if self.liveness.interval > 0 and self._transport is not None:
            self.heartbeats.start(self.liveness.interval, None)
            self.heartbeats.send_one()
        for channel in list(self._channels.values()):
            channel.notice(ServerBack())

    def give_up(self, why: str, grace: float) -> None:
        """The server did not come back within ``grace`` seconds: fail as if never waited."""
        self.reconnect = None
        self._fail(
            GroupBrokenError(
                f"the rendezvous server at {self.server} went away ({why}) and did not come "
                f"back within {grace:.1f} s (AIODIST_SERVER_GRACE); {_WITHOUT_SERVER}"
            )
        )
        if self._transport is not None:
            self._transport.abort()

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
        if self.reconnect is not None and isinstance(exc, AuthenticationError):
            self.reconnect = None  # refused: never retried
            exc = AuthenticationError(
                f"the rendezvous server at {self.server} came back but the token handshake "
                f"failed ({exc}); a server started again with another token cannot take its "
                "jobs back: restart it with the token it had, or restart the job"
            )
        first = self._error is None
        if first:
            self._error = exc
            self._retire()
        if not self._challenge.done():
            self._challenge.set_exception(exc)
            self._challenge.exception()  # retrieved: authenticate() re-raises it
        if not self.heard.done():
            self.heard.set_exception(exc)
            self.heard.exception()  # retrieved: probe() re-raises it
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
    tls_config: tls.TlsConfig | None = None,
) -> ControlConnection:
    """Connect to the rendezvous server, retrying while nothing listens yet, and while its
    gate sheds this connection before the handshake (a flood of connections).

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
        tls_config: Mutual TLS to use; None reads ``$AIODIST_TLS_*`` (none set:
            clear TCP). With TLS, the connection is never clear: a server
            that answers in clear is refused.

    Raises:
        ConnectionRefusedError: Nothing listens and ``retry_refused`` is false.
        RendezvousTimeout: Nothing answered within ``timeout``, or the server's
            gate shed every try.
        AuthenticationError: The server refused the token, or requires none; or
            TLS failed: the server speaks clear, or one side refused the other's
            certificate (never retried).
        ValueError: ``$AIODIST_TLS_*`` is set but unusable (the message names it).
    """
    if token is None:
        token = _settings.TOKEN.read() or ""
    if tls_config is None:
        tls_config = tls.from_env()
    ssl_args: dict[str, Any] = {}
    if tls_config is not None:
        ssl_args = {
            "ssl": tls_config.client_context(),
            "server_hostname": host,
            "ssl_handshake_timeout": max(timeout, AUTH_WAIT),
        }
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    next_word = loop.time() + FIRST_WAITING_WORD  # a wait in silence says so, now and then
    while True:
        try:
            _, protocol = await loop.create_connection(
                lambda: ControlConnection(on_notice, token), host, port, **ssl_args
            )
        except ssl.SSLError as exc:
            peer = f"the rendezvous server at {host}:{port}"
            raise AuthenticationError(tls.describe_ssl_error(exc, peer)) from exc
        except OSError as exc:
            if not retry_refused and isinstance(exc, ConnectionRefusedError):
                raise
            if loop.time() >= next_word:
                next_word = loop.time() + WAITING_WORD_INTERVAL
                logger.warning(
                    "waiting for the rendezvous server at %s:%d (%s) for %.0f s more; rank 0 "
                    "starts it (tcp://), or run `aiodist serve --port %d`",
                    host,
                    port,
                    "nothing listens there"
                    if isinstance(exc, ConnectionRefusedError)
                    else exc.strerror or exc,
                    max(deadline - loop.time(), 0.0),
                    port,
                )
            if loop.time() >= deadline:
                raise RendezvousTimeout(
                    f"no rendezvous server answered at {host}:{port} within {timeout:.1f} s "
                    f"({exc.strerror or exc}); start one with `aiodist serve --port {port}` or "
                    "let rank 0 embed it"
                ) from exc
            # Not a sleep-wait for an event: the server is another process; poll for it.
            await anyio.sleep(CONNECT_RETRY_INTERVAL)
            continue
        protocol.address = (host, port)
        protocol.ssl_args = ssl_args
        try:
            if token:  # the server's challenge is its answer
                await protocol.authenticate(token, max(deadline - loop.time(), AUTH_WAIT))
            else:
                await protocol.probe(min(PROBE_WAIT, max(deadline - loop.time(), 0.1)))
        except _Shed as exc:
            protocol.close()
            if loop.time() >= deadline:
                raise RendezvousTimeout(
                    f"the rendezvous server at {host}:{port} closed every connection of this "
                    f"rank within {timeout:.1f} s to make room for others ({exc}); it is flooded "
                    "with connections that do not finish their handshake"
                ) from exc
            logger.debug("connecting again to %s:%d: %s", host, port, exc)
            # Spread out: the ranks of a job shed together do not come back together.
            await anyio.sleep(CONNECT_RETRY_INTERVAL * random.random())
            continue
        except BaseException:
            protocol.close()
            raise
        return protocol
