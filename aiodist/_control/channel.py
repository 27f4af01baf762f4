"""A member's channel on a control connection: its requests, its notices, its end.

Members of one process share one connection to a server (``connection.py``);
each holds a ``ControlChannel``. Its requests carry request ids unique on the
connection, so replies find their channel without naming it; notices arrive
after the server named the channel. Channel 0 is the connection's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiodist._errors import ClosedError, DistError, DistTimeoutError
from aiodist._wire.bounds import MAX_WHERE
from aiodist._wire.messages import (
    DumpNotice,
    MemberFailed,
    MembersFailed,
    MembersJoined,
    MembersLeft,
)

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Iterator, Mapping

    from aiodist._control.liveness import Liveness

# Notices a channel keeps until its member sets a callback (a job breaks with the first).
MAX_HELD_NOTICES: Final = 16


@dataclass(frozen=True, slots=True)
class ServerLost:
    """This member's connection to the server failed (not closed by its members): why."""

    error: DistError


@dataclass(frozen=True, slots=True)
class ServerAway:
    """The server went away and may come back: the connection looks for it (``why``).

    ``ServerBack`` follows once this member is back on it, or ``ServerLost`` past
    the grace period. Meanwhile no server can say that a rank failed.
    """

    why: str


@dataclass(frozen=True, slots=True)
class ServerBack:
    """The server came back and took every member of the connection back."""


Notice = (
    MemberFailed
    | MembersFailed
    | MembersLeft
    | MembersJoined
    | DumpNotice
    | ServerLost
    | ServerAway
    | ServerBack
)


class Carrier(Protocol):
    """What a channel needs of the connection it rides (``connection.ControlConnection``)."""

    loop: asyncio.AbstractEventLoop
    request_ids: Iterator[int]  # unique on the connection, for every channel
    routes: dict[int, ControlChannel]  # req_id -> the channel waiting for its reply
    server: str
    local_host: str

    @property
    def closed(self) -> bool: ...

    @property
    def error(self) -> DistError | None: ...

    @property
    def heartbeat_interval(self) -> float: ...

    @property
    def server_away(self) -> bool: ...

    liveness: Liveness

    def send_on(self, channel: int, msg: Any) -> None: ...

    def channel_closed(self, channel: ControlChannel) -> None: ...

    def start_heartbeats(self, interval: float, timeout: float | None = None) -> None: ...

    def stalled_for(self) -> float: ...


class ControlChannel:
    """One member's requests and notices on a (possibly shared) control connection.

    Channel 0 is the connection's own: ``ControlConnection.request`` uses it.
    """

    def __init__(
        self,
        conn: Carrier,
        number: int,
        on_notice: Callable[[Notice], None] | None = None,
    ) -> None:
        self.connection = conn
        self.number = number
        self._on_notice = on_notice
        self._held: list[Notice] | None = None  # notices that came before a callback
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._sent: dict[int, Any] = {}  # the pending requests, to send again after a reconnect
        self._error: DistError | None = None
        # What its member is doing, for the connection's heartbeats: ``[current, last,
        # sent]`` (``Heartbeat.where``); set by the member's session.
        self.where: Callable[[], list[Any]] | None = None
        # Builds this member's ``Reattach`` (set once it joined a server that may come back).
        self.reattach: Callable[[int], Any] | None = None

    @property
    def on_notice(self) -> Callable[[Notice], None] | None:
        """Called with every notice for this channel's member.

        Notices that arrive while it is None (a member failed in the same read as
        the ``Welcome``, before the session exists) are held, and handed to the
        callback when it is set.
        """
        return self._on_notice

    @on_notice.setter
    def on_notice(self, callback: Callable[[Notice], None] | None) -> None:
        self._on_notice = callback
        held, self._held = self._held, None
        if callback is not None and held:
            for notice in held:
                callback(notice)

    def notice(self, notice: Notice) -> None:
        """A notice for this channel's member: handed on, or held until a callback is set."""
        if self._on_notice is not None:
            self._on_notice(notice)
        elif self._held is None:
            self._held = [notice]
        elif len(self._held) < MAX_HELD_NOTICES:
            self._held.append(notice)

    @property
    def server(self) -> str:
        return self.connection.server

    @property
    def local_host(self) -> str:
        """The numeric address this host reaches the server from."""
        return self.connection.local_host

    @property
    def closed(self) -> bool:
        return self._error is not None or self.connection.closed

    @property
    def error(self) -> DistError | None:
        """Why the channel is unusable, or None while it works."""
        return self._error or self.connection.error

    @property
    def server_away(self) -> bool:
        """The server went away and the connection looks for it (``ServerAway``)."""
        return self.connection.server_away

    @property
    def liveness(self) -> Liveness:
        """When the connection heard its server, and how it counts its silence."""
        return self.connection.liveness

    async def request(self, build: Callable[[int], Any], *, timeout: float | None = None) -> Any:
        """Send the message ``build(req_id)`` and return the reply's value.

        Raises:
            DistError: The server's error, rebuilt with its class and attributes.
            AuthenticationError: The server requires a token and this connection's
                was missing or wrong (never retried).
            RendezvousError: The server shut down.
            GroupBrokenError: The connection was lost.
            ClosedError: The channel was closed.
            DistTimeoutError: No reply within ``timeout`` (a safety net; the server
                enforces the operation's own timeout).

        Cancellation:
            The request stays sent; its reply is dropped.
        """
        conn = self.connection
        error = self._error or conn.error
        if error is not None:
            raise error
        req_id = next(conn.request_ids)
        future: asyncio.Future[Any] = conn.loop.create_future()
        self._pending[req_id] = future
        conn.routes[req_id] = self
        # A timer, not a cancel scope: requests are the hot path of a big rendezvous.
        timer = (
            None
            if timeout is None
            else conn.loop.call_later(timeout, self._expire, future, timeout)
        )
        try:
            self._sent[req_id] = msg = build(req_id)
            conn.send_on(self.number, msg)
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            del self._pending[req_id]
            self._sent.pop(req_id, None)
            conn.routes.pop(req_id, None)

    def resend_pending(self, but: int = 0) -> None:
        """Send the requests still waiting for a reply again (on a new connection)."""
        for req_id, msg in list(self._sent.items()):
            if req_id != but and not self._pending[req_id].done():
                self.connection.send_on(self.number, msg)

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
        error = self._error or self.connection.error
        if error is not None:
            raise error
        self.connection.send_on(self.number, msg)

    def start_heartbeats(self, interval: float, timeout: float | None = None) -> None:
        """Make the connection send a heartbeat at least every ``interval`` seconds.

        Heartbeats are the connection's: one keeps every member on it alive.
        With ``timeout``, a server that leaves a heartbeat unanswered that long counts
        as gone (see the connection).
        """
        self.connection.start_heartbeats(interval, timeout)

    def stalled_for(self) -> float:
        """The longest this process's loop ran its heartbeat late (see the connection)."""
        return self.connection.stalled_for()

    @property
    def heartbeat_interval(self) -> float:
        return self.connection.heartbeat_interval

    def close(self) -> None:
        """Fail this channel's requests; the server treats its member as disconnected.

        The connection closes with its last channel (channel 0 closes it at once).
        """
        if self._error is None:
            self.fail(ClosedError("the control connection was closed"))
        self.connection.channel_closed(self)

    def resolve(self, req_id: int, value: Any) -> None:
        """The reply to request ``req_id``: its value, or the error to raise."""
        future = self._pending.get(req_id)
        if future is None or future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
        else:
            future.set_result(value)

    def fail(self, exc: DistError) -> None:
        """Make the channel unusable with ``exc``: its pending and later requests raise it."""
        if self._error is None:
            self._error = exc
        self.fail_pending(exc)

    def fail_pending(self, exc: DistError) -> None:
        """Fail the requests waiting for a reply (the connection failed under them)."""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)


def where_of(channels: Mapping[int, ControlChannel]) -> list[Any]:
    """``Heartbeat.where``: ``[channel, current, last, sent]`` per member that reports
    (bounded)."""
    where: list[Any] = []
    for number, channel in channels.items():
        if channel.where is not None:
            where.append([number, *channel.where()])
            if len(where) == MAX_WHERE:
                break
    return where
