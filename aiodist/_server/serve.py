"""The rendezvous server's asyncio shell: listen, and run the job table on the loop.

All decisions live in the job table (``state.py``); this module and ``hub.py``
move bytes. Each client connection is a ``connection.ServerConnection`` (its
channels, its authentication), kept by the server's ``hub.Hub``, which feeds
the job table and writes its actions back; the table sees each channel as a
connection of its own, so it never knows which members share a socket. Peer
addresses are logged as the numeric addresses the socket reports: the server
never resolves a host name.

With a state directory (``durable.py``), this module wires it in: the jobs
come back from its records at start-up, and the hub hands it each batch of the
table's records (``JobTable.take_records``) before any reply of that batch
leaves; the log is folded into a snapshot of the table's jobs when it grows.

Job events (``events.py``) go to the ``aiodist.events`` logger at INFO, one
record each, its message the event as JSON and the event itself in the
record's ``aiodist_event`` attribute (``aiodist serve`` writes them as JSON lines).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import logging
from typing import TYPE_CHECKING, Any, Final

import anyio

from aiodist._errors import ErrorCode
from aiodist._server.connection import AUTH_TIMEOUT
from aiodist._server.dashboard import Dashboard
from aiodist._server.durable import Journal, StateDir
from aiodist._server.hub import Hub
from aiodist._server.state import JobTable
from aiodist._transport import tls as tls_module
from aiodist._wire.frame import encode_message
from aiodist._wire.messages import ErrorReply
from aiodist._wire.preauth import PreAuthLimits, open_files_limit
from aiodist._wire.tls import speaks_tls_message

if TYPE_CHECKING:
    from anyio.abc import TaskStatus


logger = logging.getLogger(__name__)

DEFAULT_PORT: Final = 29500
# asyncio's default backlog of 100 overflows when a large job connects at once. The
# kernel caps it at net.core.somaxconn (often 4096): a job of more ranks than that,
# connecting at once, can overflow it (each dropped connect is retried after 1 s).
LISTEN_BACKLOG: Final = 65535
# How long a shutdown waits for clients to take the closing notice before cutting them off.
DEFAULT_SHUTDOWN_TIMEOUT: Final = 5.0
# Connections waiting for their handshake at most (a quarter of the open files, at most this).
MAX_PENDING_HANDSHAKES: Final = 65536


def version() -> str:
    """aiodist's installed version, or ``unknown``."""
    try:
        return importlib.metadata.version("aiodist")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout
        return "unknown"


class RendezvousServer:
    """A running rendezvous server. Start one with ``serve_rendezvous``.

    Attributes:
        address: ``(host, port)`` it listens on, with the port the OS picked.
        state: The job table (read it; never change it from outside).
        state_dir: The state directory its jobs are kept in, or None.
        token: The token clients must send, or None when none is required.
        preauth: What a connection may cost before its handshake is done.
        tls: The mutual TLS it requires of every client, or None (clear TCP).
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
        preauth: PreAuthLimits | None = None,
        state_dir: str | None = None,
        restartable: bool = False,
        tls: tls_module.TlsConfig | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        now = self._loop.time()
        self.state = JobTable(now, durable=state_dir is not None, restartable=restartable)
        self.state.version = version()
        journal = None if state_dir is None else Journal(StateDir(state_dir), self.state, now)
        self.state_dir = None if journal is None else journal.state_dir
        self.token = token or None
        self.shutdown_timeout = shutdown_timeout
        # A quarter of the open files may wait for their handshake: a job of thousands of
        # ranks joining at once is not shed, and strangers never take every descriptor.
        self.preauth = preauth or PreAuthLimits.for_open_files(
            open_files_limit(), share=4, most=MAX_PENDING_HANDSHAKES, deadline=AUTH_TIMEOUT
        )
        self._hub = Hub(
            self.state,
            token=self.token,
            preauth=self.preauth,
            loop=self._loop,
            journal=journal,
        )
        self.dashboard = Dashboard()  # what the metrics port's page shows (dashboard.py)
        self._hub.on_events = self.dashboard.note_events
        self.address: tuple[str, int] = ("", 0)
        self.tls = tls
        self._server: asyncio.Server | tls_module.TlsServer | None = None

    async def _start(self, host: str, port: int) -> None:
        if self.tls is None:
            self._server = await self._loop.create_server(
                self._hub.new_connection, host, port, reuse_address=True, backlog=LISTEN_BACKLOG
            )
        else:  # accepts itself: a clear client is told what to set (tls.py)
            refusal = ErrorReply(0, ErrorCode.PROTOCOL, speaks_tls_message("rendezvous server"), {})
            self._server = tls_module.TlsServer(
                tls_module.bind(host, port),
                self._hub.new_connection,
                self.tls.server_context(),
                refusal=b"".join(encode_message(refusal)),
                deadline=self.preauth.deadline,
                max_pending=self.preauth.max_pending,
                what="rendezvous server",
            )
        sockname = self._server.sockets[0].getsockname()
        self.address = (str(sockname[0]), int(sockname[1]))
        logger.info(
            "rendezvous server listening on %s:%d%s",
            *self.address,
            "" if self.tls is None else " (mutual TLS)",
        )
        self._hub.flush()  # jobs restored from a state directory have deadlines already

    def loop_time(self) -> float:
        """The server loop's clock (the job table's time)."""
        return self._loop.time()

    @property
    def num_connections(self) -> int:
        """Client connections open (each may carry several members' channels)."""
        return len(self._hub.sockets)

    @property
    def bytes_received(self) -> int:
        """Bytes read from all clients so far."""
        return self._hub.bytes_received

    @property
    def bytes_sent(self) -> int:
        """Bytes written to all clients so far."""
        return self._hub.bytes_sent

    @property
    def auth_failures(self) -> int:
        """Connections refused for a missing or wrong token."""
        return self._hub.auth_failures

    @property
    def preauth_closed(self) -> int:
        """Connections closed before their handshake: shed, past the deadline, over budget."""
        return self._hub.preauth_closed

    async def wait_until(self, predicate: Any) -> None:
        """Wait until ``predicate(server)`` holds; re-checked after every state change."""
        changed = self._hub.changed
        while not predicate(self):
            changed.clear()
            await changed.wait()

    async def wait_for_members(self, group_name: str, n: int) -> None:
        """Wait until job ``group_name`` has ``n`` members joined."""
        await self.wait_until(
            lambda s: (job := s.state.jobs.get(group_name)) is not None and len(job.members) >= n
        )

    def metrics_sample(self) -> dict[str, Any]:
        """Counters and gauges for the metrics endpoint; call it on the server's loop."""
        jobs = {"forming": 0, "running": 0, "failed": 0}
        members = 0
        for job in self.state.jobs.values():
            jobs[job.state] += 1
            members += len(job.members)
        hub = self._hub
        return {
            "version": self.state.version,
            "uptime": self._loop.time() - self.state.started_at,
            "connections": len(hub.sockets),
            "jobs": jobs,
            "members": members,
            **dataclasses.asdict(self.state.stats),
            "bytes_received": hub.bytes_received,
            "bytes_sent": hub.bytes_sent,
            "auth_failures": hub.auth_failures,
            "preauth_closed": hub.preauth_closed,
            "preauth_pending": hub.pending,
            "reattached": self.state.reattachment.reattached,
            "restored_jobs": self.state.reattachment.restored_jobs,
        }

    async def aclose(self, reason: str = "the rendezvous server is shutting down") -> None:
        """Stop accepting, tell every client the server is going away, close connections.

        Each connection is closed after its notice is written; a client that does
        not read it within ``shutdown_timeout`` seconds is cut off.
        """
        if self._server is None:
            return
        server, self._server = self._server, None
        hub = self._hub
        server.close()
        self.state.close(reason)
        hub.flush()
        for conn in list(hub.sockets):
            if conn.transport is not None:
                conn.transport.close()
        hub.close()
        with anyio.move_on_after(self.shutdown_timeout):
            await self.wait_until(lambda s: not hub.sockets)
        for conn in list(hub.sockets):
            logger.warning("cutting off %s: it did not take the closing notice", conn.peer)
            if conn.transport is not None:
                conn.transport.abort()
        with anyio.move_on_after(self.shutdown_timeout):
            await server.wait_closed()
        if self.state_dir is not None:
            self.state_dir.close()  # writes what is queued, lets go of the lock


async def serve_rendezvous(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    token: str | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    preauth: PreAuthLimits | None = None,
    state_dir: str | None = None,
    restartable: bool = False,
    tls: tls_module.TlsConfig | None = None,
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
        state_dir: A directory for the jobs' durable state (``durable.py``): a
            server started again on it takes its jobs back. Implies ``restartable``.
        restartable: Tell members that this server may come back when it goes
            away (a daemon): they reconnect and re-attach for their grace period
            (``AIODIST_SERVER_GRACE``) instead of breaking their groups at once.
        tls: Require mutual TLS of every client (``tls.TlsConfig``); a clear
            client is refused at once with an error that says what to set.
        task_status: Receives the ``RendezvousServer`` once it is listening.

    Cancellation:
        Cancelling the task closes the listener and every connection, telling
        clients first that the server is going away (bounded by ``shutdown_timeout``).

    Example:
        >>> async with anyio.create_task_group() as tg:
        ...     server = await tg.start(serve_rendezvous, "127.0.0.1", 0)
    """
    server = RendezvousServer(
        token=token,
        shutdown_timeout=shutdown_timeout,
        preauth=preauth,
        state_dir=state_dir,
        restartable=restartable,
        tls=tls,
    )
    await server._start(host, port)
    try:
        task_status.started(server)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await server.aclose()
