"""The client end of a control connection: requests with replies, and notices.

One ``asyncio.Protocol`` per job member. Requests carry a ``req_id``; the
reply resolves the matching future. Notices from the server (a member failed,
the server is closing) go to a callback. When the connection drops, every
pending request fails with the same error and later requests fail at once.

With a token, the connection first answers the server's challenge (see
``_auth.py``) and accepts no reply until the server has proved the token too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from typing import TYPE_CHECKING, Any, Final, cast

import anyio

from aiodist._auth import client_proof, new_nonce, server_proof, verify
from aiodist._errors import (
    AuthenticationError,
    ClosedError,
    DistError,
    DistTimeoutError,
    GroupBrokenError,
    ProtocolError,
    RendezvousError,
    RendezvousTimeout,
    from_wire,
)
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
    ErrorCode,
    ErrorReply,
    Heartbeat,
    Hello,
    MemberFailed,
    Reply,
    ServerClosing,
    Welcome,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["ControlConnection", "connect_control"]

logger = logging.getLogger(__name__)

CLIENT_LIMITS: Final = Limits(max_header_bytes=64 * MiB, max_payload_bytes=0)
CONNECT_RETRY_INTERVAL: Final = 0.05
# The least time given to a server's challenge, even when the connect timeout is nearly spent.
AUTH_WAIT: Final = 5.0
Notice = MemberFailed | ServerClosing


class ControlConnection(asyncio.Protocol):
    """Requests to the rendezvous server and the notices it sends back."""

    def __init__(self, on_notice: Callable[[Notice], None] | None = None, token: str = "") -> None:
        self._loop = asyncio.get_running_loop()
        self._decoder = FrameDecoder(CLIENT_LIMITS)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count(1)
        self._transport: asyncio.Transport | None = None
        self._error: DistError | None = None
        self.on_notice = on_notice
        self.token = token  # set before connecting: the challenge may come at once
        self._challenge: asyncio.Future[bytes] = self._loop.create_future()
        self._expected_proof: bytes | None = None
        self.server = "?"
        self.local_host = "127.0.0.1"
        self._heartbeat: asyncio.TimerHandle | None = None
        self._heartbeat_interval = 0.0

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
        dec = self._decoder
        try:
            dec.receive_data(data)
            while (event := dec.next_event()) is not NEED_DATA and event is not CLOSED:
                assert isinstance(event, Frame)
                self._dispatch(frame_message(event))
        except ProtocolError as exc:
            self._fail(exc)
            assert self._transport is not None
            self._transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._stop_heartbeats()
        if self._error is None:
            self._fail(
                GroupBrokenError(
                    f"lost the connection to the rendezvous server at {self.server}; "
                    "check that it is still running"
                )
            )

    # --- requests --------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._transport is None or self._error is not None

    @property
    def error(self) -> DistError | None:
        """Why the connection is unusable, or None while it works."""
        return self._error

    async def request(self, build: Callable[[int], Any], *, timeout: float | None = None) -> Any:
        """Send the message ``build(req_id)`` and return the reply's value.

        Raises:
            DistError: The server's error, rebuilt with its class and attributes.
            AuthenticationError: The server requires a token and this connection's
                was missing or wrong (never retried).
            RendezvousError: The server shut down.
            GroupBrokenError: The connection was lost.
            DistTimeoutError: No reply within ``timeout`` (a safety net; the server
                enforces the operation's own timeout).

        Cancellation:
            The request stays sent; its reply is dropped.
        """
        if self._error is not None:
            raise self._error
        req_id = next(self._ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[req_id] = future
        # A timer, not a cancel scope: requests are the hot path of a big rendezvous.
        timer = (
            None
            if timeout is None
            else self._loop.call_later(timeout, self._expire, future, timeout)
        )
        try:
            self.send(build(req_id))
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(req_id, None)

    def _expire(self, future: asyncio.Future[Any], timeout: float) -> None:
        if not future.done():
            future.set_exception(
                DistTimeoutError(
                    f"the rendezvous server at {self.server} did not answer within "
                    f"{timeout:.1f} s; check that it is running and not overloaded"
                )
            )

    def send(self, msg: Any) -> None:
        """Send a message that expects no reply."""
        if self._error is not None:
            raise self._error
        assert self._transport is not None
        self._transport.writelines(encode_message(msg))

    def start_heartbeats(self, interval: float) -> None:
        """Send a heartbeat every ``interval`` seconds until the connection closes.

        The first goes one interval from now: the server counts any message as
        one, so the request sent next (the join) is the first. A timer, not a
        task: a process with many members pays no task per member.
        """
        self._heartbeat_interval = interval
        self._heartbeat = self._loop.call_later(interval, self._beat)

    def _beat(self) -> None:
        if self.closed:
            self._heartbeat = None
            return
        self.send(Heartbeat())
        self._heartbeat = self._loop.call_later(self._heartbeat_interval, self._beat)

    def _stop_heartbeats(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None

    def close(self) -> None:
        self._stop_heartbeats()
        if self._error is None:
            self._fail(ClosedError("the control connection was closed"))
        if self._transport is not None:
            self._transport.close()

    # --- internals ---------------------------------------------------------------------

    async def authenticate(self, token: str, timeout: float) -> None:
        """Answer the server's challenge with a proof of ``token``.

        Returns once the proof is sent; requests may follow at once (the server
        reads them after the proof). The server's own proof is checked when it
        arrives, before any reply is accepted.

        Raises:
            AuthenticationError: The server refused the connection.
            RendezvousTimeout: No challenge within ``timeout``.

        Cancellation:
            The connection is left unauthenticated; close it.
        """
        self.token = token
        self.send(AuthStart())
        try:
            server_nonce = await asyncio.wait_for(asyncio.shield(self._challenge), timeout)
        except TimeoutError:
            raise RendezvousTimeout(
                f"the rendezvous server at {self.server} sent no challenge within "
                f"{timeout:.1f} s; is it an aiodist server?"
            ) from None
        if not server_nonce:
            logger.debug("the rendezvous server at %s requires no token", self.server)
            return
        client_nonce = new_nonce()
        self._expected_proof = server_proof(token, client_nonce, server_nonce)
        self.send(Hello(client_nonce, client_proof(token, server_nonce, client_nonce)))

    def _on_auth_message(self, msg: Challenge | Authenticated) -> None:
        if isinstance(msg, Challenge):
            if not self._challenge.done():
                self._challenge.set_result(msg.nonce)
            if msg.nonce and not self.token:
                self._fail(
                    AuthenticationError(
                        f"the rendezvous server at {self.server} requires a token; set "
                        "AIODIST_TOKEN to the contents of the server's --token-file"
                    )
                )
                self.close()
        elif self._expected_proof is not None and verify(self._expected_proof, msg.proof):
            self._expected_proof = None
        else:
            self._fail(
                AuthenticationError(
                    f"the rendezvous server at {self.server} could not prove that it knows "
                    "AIODIST_TOKEN; check that you are talking to the server you meant to"
                )
            )
            self.close()

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, Challenge | Authenticated):
            self._on_auth_message(msg)
            return
        if self._expected_proof is not None and not isinstance(msg, ErrorReply | ServerClosing):
            self._fail(
                AuthenticationError(
                    f"the rendezvous server at {self.server} answered before proving that it "
                    "knows AIODIST_TOKEN; check that you are talking to the server you meant to"
                )
            )
            self.close()
            return
        if isinstance(msg, Reply | Welcome):
            self._resolve(msg.req_id, msg.value if isinstance(msg, Reply) else msg)
        elif isinstance(msg, ErrorReply):
            exc = from_wire(msg.code, msg.message, msg.details)
            if msg.req_id in self._pending:
                self._resolve(msg.req_id, exc)
            elif msg.code in (ErrorCode.PROTOCOL, ErrorCode.AUTHENTICATION):
                self._fail(exc)
                self.close()  # the server stopped reading us: hang up so it can close too
            elif msg.code == ErrorCode.RANK_FAILED:
                self._fail(exc)
            else:
                logger.warning("rendezvous server %s: %s", self.server, msg.message)
        elif isinstance(msg, MemberFailed | ServerClosing):
            if isinstance(msg, ServerClosing):
                logger.warning("the rendezvous server at %s shut down: %s", self.server, msg.reason)
                self._fail(
                    RendezvousError(
                        f"the rendezvous server at {self.server} shut down ({msg.reason}); "
                        "store, barrier and join requests can no longer be served. Restart "
                        "the server, then the job."
                    )
                )
            if self.on_notice is not None:
                self.on_notice(msg)
        else:
            self._fail(ProtocolError(f"the server sent an unexpected {type(msg).__name__}"))

    def _resolve(self, req_id: int, value: Any) -> None:
        future = self._pending.get(req_id)
        if future is None or future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    def _fail(self, exc: DistError) -> None:
        if self._error is None:
            self._error = exc
        if not self._challenge.done():
            self._challenge.set_exception(exc)
            self._challenge.exception()  # retrieved: authenticate() re-raises it
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)


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
            token itself is never sent) before it returns.

    Raises:
        ConnectionRefusedError: Nothing listens and ``retry_refused`` is false.
        RendezvousTimeout: Nothing answered within ``timeout``.
        AuthenticationError: The server refused the token (never retried).
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
