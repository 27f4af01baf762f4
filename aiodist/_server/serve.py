"""The rendezvous server's asyncio shell: accept, decode, feed ``ServerState``, write.

All decisions live in ``state.py``; this module moves bytes. Each client
connection is a ``connection.ServerConnection`` (its channels, its
authentication); ``state.py`` sees each channel as a connection of its own,
so a job table never knows which members share a socket. The replies of one
batch of actions leave in one write per connection. Deadlines (store waits, barriers,
joins, the heartbeat sweep) are one ``loop.call_at`` timer, re-armed after
every batch of actions. Peer addresses are logged as the numeric addresses the
socket reports: the server never resolves a host name.

Job events (``events.py``) go to the ``aiodist.events`` logger at INFO, one
record each, its message the event as JSON and the event itself in the
record's ``aiodist_event`` attribute (``aiodist serve`` writes them as JSON lines).

Connections that have not finished their handshake wait in one ``Gate``
(``_wire/preauth.py``, see ``connection``) with one timer for its next
deadline; refused connections are logged through one ``LogBudget``: the first
few of each interval in full, then one summary line with counts, so a flood of
strangers costs a few lines, not one each.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import math
from typing import TYPE_CHECKING, Any, Final

import anyio

from aiodist._server.connection import AUTH_TIMEOUT, ServerConnection
from aiodist._server.jobs import Close
from aiodist._server.state import ServerState
from aiodist._wire.preauth import Gate, LogBudget, PreAuthLimits, open_files_limit

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

    from aiodist._server.jobs import ConnId
    from aiodist._wire.bounds import FieldError
    from aiodist._wire.frame import Buffer

__all__ = ["DEFAULT_PORT", "DEFAULT_SHUTDOWN_TIMEOUT", "RendezvousServer", "serve_rendezvous"]

logger = logging.getLogger(__name__)
event_logger = logging.getLogger("aiodist.events")

DEFAULT_PORT: Final = 29500
# asyncio's default backlog of 100 overflows when a large job connects at once.
LISTEN_BACKLOG: Final = 4096
# How long a shutdown waits for clients to take the closing notice before cutting them off.
DEFAULT_SHUTDOWN_TIMEOUT: Final = 5.0
# Connections waiting for their handshake at most (a quarter of the open files, at most this).
MAX_PENDING_HANDSHAKES: Final = 65536


def _version() -> str:
    try:
        return importlib.metadata.version("aiodist")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout
        return "unknown"


class RendezvousServer:
    """A running rendezvous server. Start one with ``serve_rendezvous``.

    Attributes:
        address: ``(host, port)`` it listens on, with the port the OS picked.
        state: The job table (read it; never change it from outside).
        token: The token clients must send, or None when none is required.
        bytes_received: Bytes read from all clients so far.
        bytes_sent: Bytes written to all clients so far.
        auth_failures: Connections refused for a missing or wrong token.
        preauth: What a connection may cost before its handshake is done.
        preauth_closed: Connections the gate closed before their handshake was
            done: shed, past the deadline, or over the byte budget.
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        preauth: PreAuthLimits | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.state = ServerState(self._loop.time())
        self.state.version = _version()
        self.token = token or None
        self.shutdown_timeout = shutdown_timeout
        self.bytes_received = 0
        self.bytes_sent = 0
        self.auth_failures = 0
        # A quarter of the open files may wait for their handshake: a job of thousands of
        # ranks joining at once is not shed, and strangers never take every descriptor.
        self.preauth = preauth or PreAuthLimits.for_open_files(
            open_files_limit(), share=4, most=MAX_PENDING_HANDSHAKES, deadline=AUTH_TIMEOUT
        )
        self.preauth_closed = 0
        self._gate: Gate[ServerConnection] = Gate(self.preauth)
        self._gate_timer: asyncio.TimerHandle | None = None
        self._refusals = LogBudget()
        self._refusals_timer: asyncio.TimerHandle | None = None
        self.address: tuple[str, int] = ("", 0)
        self._conns: dict[ConnId, ServerConnection] = {}  # every channel's connection
        self._sockets: set[ServerConnection] = set()
        self._next_id = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0
        self._server: asyncio.Server | None = None
        self._changed = asyncio.Event()

    async def _start(self, host: str, port: int) -> None:
        self._server = await self._loop.create_server(
            lambda: ServerConnection(self, self._new_id()),
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
            "preauth_closed": self.preauth_closed,
            "preauth_pending": len(self._gate),
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
            if conn.transport is not None:
                conn.transport.close()
        for timer in (self._timer, self._gate_timer, self._refusals_timer):
            if timer is not None:
                timer.cancel()
        self._gate_timer = self._refusals_timer = None
        self._flush_refusals(final=True)
        with anyio.move_on_after(self.shutdown_timeout):
            await self.wait_until(lambda s: not s._sockets)
        for conn in list(self._sockets):
            logger.warning("cutting off %s: it did not take the closing notice", conn.peer)
            if conn.transport is not None:
                conn.transport.abort()
        with anyio.move_on_after(self.shutdown_timeout):
            await server.wait_closed()

    # --- called by connections -------------------------------------------------------

    def _connection_made(self, conn: ServerConnection) -> None:
        self._sockets.add(conn)
        self._conns[conn._id] = conn
        now = self._loop.time()
        self.state.connection_made(conn._id, conn.peer, now)
        for oldest in self._gate.admit(conn, now):
            oldest.shed()
        if self._gate_timer is None:
            self._arm_gate_timer()

    def _passed(self, conn: ServerConnection) -> None:
        self._gate.passed(conn)

    def _spoke(self, conn: ServerConnection) -> None:
        self._gate.spoke(conn)

    def _charge(self, conn: ServerConnection, nbytes: int) -> bool:
        return self._gate.charge(conn, nbytes)

    def _arm_gate_timer(self) -> None:
        when = self._gate.next_deadline()
        self._gate_timer = None if when is None else self._loop.call_at(when, self._on_gate_timer)

    def _on_gate_timer(self) -> None:
        for conn in self._gate.expired(self._loop.time()):
            conn.expired()
        self._arm_gate_timer()

    def _bad_request(self, conn_id: ConnId, exc: FieldError) -> None:
        self.state.bad_request(conn_id, exc.req_id, str(exc), exc.wire_details())

    def _log_refusal(self, reason: str, message: str, *args: object) -> None:
        """Log a refused connection, or count it for the interval's summary line."""
        full, summary = self._refusals.note(self._loop.time(), reason)
        if summary is not None:
            logger.warning("%s", summary)
        if full:
            logger.warning(message, *args)
        elif self._refusals_timer is None and (due := self._refusals.due()) is not None:
            self._refusals_timer = self._loop.call_at(due, self._on_refusals_timer)

    def _on_refusals_timer(self) -> None:
        self._refusals_timer = None
        self._flush_refusals()
        if (due := self._refusals.due()) is not None:  # woken a hair early: not over yet
            self._refusals_timer = self._loop.call_at(due, self._on_refusals_timer)

    def _flush_refusals(self, *, final: bool = False) -> None:
        # Shutting down: whatever was held back is logged now, its interval over or not.
        now = math.inf if final else self._loop.time()
        if (summary := self._refusals.flush(now)) is not None:
            logger.warning("%s", summary)

    def _channel_opened(self, conn: ServerConnection) -> ConnId:
        conn_id = self._new_id()
        self._conns[conn_id] = conn
        self.state.connection_made(conn_id, conn.peer, self._loop.time())
        return conn_id

    def _channel_lost(self, conn_id: ConnId, reason: str) -> None:
        if self._conns.pop(conn_id, None) is not None:
            self.state.connection_lost(conn_id, self._loop.time(), reason)

    def _connection_lost(self, conn: ServerConnection, reason: str) -> None:
        self._sockets.discard(conn)
        self._gate.left(conn)
        for conn_id in list(conn.channels.values()):
            self._channel_lost(conn_id, reason)
        self._flush()

    def _receive(self, conn_id: int, msg: Any) -> None:
        self.state.receive(conn_id, msg, self._loop.time())

    def _flush(self) -> None:
        # One write per connection for the whole batch: a barrier released for 256
        # members of one process is one syscall, not 256.
        out: dict[ServerConnection, list[Buffer]] = {}
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
        if (events := self.state.take_events()) and event_logger.isEnabledFor(logging.INFO):
            for event in events:
                event_logger.info(json.dumps(event), extra={"aiodist_event": event})
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
    preauth: PreAuthLimits | None = None,
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
        preauth: What a connection may cost before its handshake is done (bytes,
            deadline, how many wait at once); the default suits a daemon.
        task_status: Receives the ``RendezvousServer`` once it is listening.

    Cancellation:
        Cancelling the task closes the listener and every connection, telling
        clients first that the server is going away (bounded by ``shutdown_timeout``).

    Example:
        >>> async with anyio.create_task_group() as tg:
        ...     server = await tg.start(serve_rendezvous, "127.0.0.1", 0)
    """
    server = RendezvousServer(token=token, shutdown_timeout=shutdown_timeout, preauth=preauth)
    await server._start(host, port)
    try:
        task_status.started(server)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await server.aclose()
