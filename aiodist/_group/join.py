"""Joining a job: ``open_process_group`` makes the session and yields its world group.

Joining parses the init method, listens on the data plane, starts heartbeats
(a timer of the control connection, stopped when it closes) and sends the
``Join``; the server's ``Welcome`` makes the session, then its world group
(the session knows its groups only as ``SessionGroup``). An embedded server runs
in a task owned by ``open_process_group`` (made only when this process embeds
one). Nothing outlives the ``async with``.

Leaving is one path, whatever ends the ``async with`` (``destroy_process_group``,
the end of ``asyncio.run``, interpreter exit): the groups' close hooks run while
the groups are still usable and what they start finishes, bounded (metric
syncs still queued reach every rank); then the session closes, which lets
started operations finish, says goodbye to the peers and leaves the job; an
embedded server stays up while other members use it. Neither the embedded
server's task nor an operation's is cancelled by its loop's shutdown
(``lingering``): the end of ``asyncio.run`` is a clean leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
from typing import TYPE_CHECKING, Any, Final

import anyio

from aiodist import _settings
from aiodist._control.rendezvous import (
    RendezvousSpec,
    connect_rendezvous,
    may_embed,
    parse_init_method,
)
from aiodist._control.store import REPLY_GRACE
from aiodist._group.group import ProcessGroup
from aiodist._group.lingering import LingeringTask
from aiodist._group.session import (
    CLOSE_GRACE,
    DEFAULT_TIMEOUT,
    WORLD_GROUP_ID,
    Session,
)
from aiodist._plane.peers import DataPlane
from aiodist._plane.routes import Selection, selection
from aiodist._wire.messages import Join, Reattach

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence

    from aiodist._group.session import SessionGroup
    from aiodist._server.serve import RendezvousServer

logger = logging.getLogger(__name__)

#: Seconds an embedded server waits for its clients to hang up before it shuts down.
HANG_UP_GRACE: Final = 2.0
#: Seconds an embedded server of a process that is interrupted or failing gives its
#: clients to take the closing notice before cutting them off.
ABANDON_SHUTDOWN: Final = 0.2


def default_group_name(environ: dict[str, str] | os._Environ[str]) -> str:
    """The job's name when none is given: ``AIODIST_JOB_ID``, torchrun's run id, or ``default``."""
    return _settings.JOB_ID.read(environ) or environ.get("TORCHELASTIC_RUN_ID") or "default"


@contextlib.asynccontextmanager
async def open_process_group(
    init_method: str | None = None,
    *,
    world_size: int = -1,
    rank: int = -1,
    group_name: str = "",
    timeout: float = DEFAULT_TIMEOUT,
    backend: str | None = None,
    heartbeat_interval: float | None = None,
    heartbeat_timeout: float | None = None,
    hostname: str | None = None,
    addresses: list[str] | None = None,
    transport: str | Sequence[str] | None = None,
    max_world_size: int | None = None,
    store: Any = None,
) -> AsyncIterator[ProcessGroup]:
    """Join a job and yield its world group; leave the job on exit.

    Args:
        init_method: ``tcp://HOST:PORT``, ``env://`` (default) or ``file:///path``.
        world_size: Number of ranks; required unless the environment gives it.
        rank: This process's rank, or -1 to let the server assign one.
        group_name: The job's name on the server (default ``$AIODIST_JOB_ID`` or
            ``"default"``); jobs sharing a server need distinct names.
        timeout: Seconds to wait for the job to form; also the default timeout of
            every operation.
        backend: Recorded for ``get_backend``; the torch bridge brings it up.
        heartbeat_interval: Seconds between heartbeats (``AIODIST_HEARTBEAT_INTERVAL``).
        heartbeat_timeout: Silence after which the server declares this rank failed
            (``AIODIST_HEARTBEAT_TIMEOUT``).
        hostname: The host this rank counts as for local ranks (default: this
            machine's name; never resolved).
        addresses: Data-plane addresses to publish to the other members.
        transport: The data-plane transports to listen on, by name, in the order
            peers should try them (``"crc,tcp"`` or a list; default
            ``$AIODIST_TRANSPORT``, else Unix sockets and TCP as the job needs).
            A name is a built-in transport's (``tcp``, ``uds``, ``shm``) or one
            registered with ``register_transport``.
        max_world_size: Make the job elastic (torchrun's ``--nnodes MIN:MAX``): it
            forms with ``world_size`` ranks and admits processes that join later
            while fewer than this many are alive (default ``$AIODIST_MAX_WORLD_SIZE``;
            0: not elastic). A process that joins a formed elastic job gets the
            next free rank and a default group of its own until it calls
            ``regroup`` with the others (see the elastic guide).
        store: A torch ``Store`` to meet through instead of ``init_method``: rank 0
            (``rank`` must be given) embeds the server and publishes it there.

    Raises:
        ValueError: A transport this process does not know.
        RendezvousError: The job refused this process (conflicting rank or world size).
        RendezvousTimeout: The job did not form within ``timeout``.

    Cancellation:
        Cancelling while joining abandons the join; the server drops this member.
    """
    env = os.environ
    spec = parse_init_method(init_method, rank=rank, world_size=world_size, store=store)
    if spec.world_size < 1:
        raise ValueError(
            f"world_size must be given (>= 1), got {spec.world_size}: pass world_size= or set "
            "WORLD_SIZE"
        )
    if not -1 <= spec.rank < spec.world_size:
        raise ValueError(f"rank must be in [0, {spec.world_size}) or -1, got {spec.rank}")
    _settings.warn_unknown()
    interval = heartbeat_interval or _settings.HEARTBEAT_INTERVAL.read(env)
    hb_timeout = heartbeat_timeout or _settings.HEARTBEAT_TIMEOUT.read(env)
    if not 0 < interval < hb_timeout:
        raise ValueError(
            f"heartbeat_interval ({interval}) must be > 0 and below heartbeat_timeout "
            f"({hb_timeout})"
        )
    max_ws = _settings.MAX_WORLD_SIZE.read(env) if max_world_size is None else max_world_size
    if max_ws and max_ws < spec.world_size:
        raise ValueError(
            f"max_world_size ({max_ws}) must be 0 (not elastic) or >= world_size "
            f"({spec.world_size})"
        )
    if max_ws and backend is not None and backend.lower() != "aiodist":
        raise ValueError(
            f"an elastic job (max_world_size={max_ws}) runs on aiodist's own data plane: "
            f"torch.distributed's {backend!r} cannot grow its groups; start it without a "
            "backend (torch's group is then aiodist's, and grows with the job)"
        )
    name = group_name or default_group_name(env)
    transports = selection(transport)  # an unknown name fails here, before anything starts
    args = (
        spec,
        name,
        timeout,
        backend,
        interval,
        hb_timeout,
        hostname,
        addresses,
        transports,
        max_ws,
    )
    if not may_embed(spec, env):
        # Nothing to run beside the member (heartbeats are a timer): no server task.
        async with _joined(None, *args) as group:
            yield group
        return
    servers = _EmbeddedServer()
    try:
        async with _joined(servers, *args) as group:
            yield group
    finally:
        with anyio.CancelScope(shield=True):
            await servers.aclose()


async def run_close_hooks(groups: Iterable[SessionGroup], grace: float) -> None:
    """Run the close hooks of ``groups`` while they are usable; wait for what they started.

    A hook may return a future (the metric board's: its syncs reaching every
    rank); the wait is bounded by ``grace`` seconds, then those are cancelled.

    Cancellation:
        Cancelling the caller cancels what the hooks started.
    """
    pending = [future for g in list(groups) for future in g.run_close_hooks()]
    if pending:
        with anyio.move_on_after(grace):
            await asyncio.gather(*pending, return_exceptions=True)


class _Status:
    """The ``task_status`` handed to a server's task: reports the server once it listens."""

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self._future = future

    def started(self, value: Any = None) -> None:
        if not self._future.done():
            self._future.set_result(value)


class _EmbeddedServer:
    """Runs the embedded rendezvous server's task (``ServerHost``); stops it on ``aclose``.

    Not a task group: the server's task must outlive its loop's shutdown
    (``LingeringTask``) while the session keeps it up for the other members.
    """

    def __init__(self) -> None:
        self._tasks: list[LingeringTask[Any]] = []
        self._servers: list[RendezvousServer] = []

    async def start(
        self, func: Callable[..., Coroutine[Any, Any, Any]], *args: object, name: object = None
    ) -> Any:
        """Start ``func(*args, task_status=...)``; return what it reports once started.

        Raises:
            Exception: What ``func`` raised before it started (``OSError``: the
                address is taken).
        """
        loop = asyncio.get_running_loop()
        started: asyncio.Future[Any] = loop.create_future()
        task: LingeringTask[Any] = LingeringTask(
            func(*args, task_status=_Status(started)),
            loop=loop,
            name=str(name or "aiodist-rendezvous-server"),
        )
        self._tasks.append(task)
        try:
            await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not started.done():
                started.cancel()
                task.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(task, return_exceptions=True)
                self._tasks.remove(task)
        if started.cancelled():
            task.result()  # what stopped it
            raise RuntimeError(f"{func!r} returned without starting")
        self._servers.append(started.result())
        return started.result()

    async def aclose(self, grace: float = HANG_UP_GRACE) -> None:
        """Stop every server started here (each tells its clients first).

        Clients still connected hear that the server shuts down, which they
        report: members that just left get ``grace`` seconds to hang up first.
        """
        servers, self._servers = self._servers, []
        tasks, self._tasks = self._tasks, []
        if grace == 0:
            # A process being interrupted or failing: its clients get their notice, and
            # those that do not take it at once are cut off (not ``shutdown_timeout``).
            for server in servers:
                server.shutdown_timeout = min(server.shutdown_timeout, ABANDON_SHUTDOWN)
        try:
            for server in servers:
                with anyio.move_on_after(grace):
                    await server.wait_until(lambda s: s.num_connections == 0)
        finally:
            for task in tasks:  # even if that wait was cancelled: the loop's end waits for them
                task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await task
                except Exception:
                    logger.exception("the embedded rendezvous server failed")


@contextlib.asynccontextmanager
async def _joined(
    servers: _EmbeddedServer | None,
    spec: RendezvousSpec,
    name: str,
    timeout: float,
    backend: str | None,
    interval: float,
    hb_timeout: float,
    hostname: str | None,
    addresses: list[str] | None,
    transports: Selection,
    max_ws: int,
) -> AsyncIterator[ProcessGroup]:
    # Notices that come before the session exists are held by the channel until then.
    conn, server = await connect_rendezvous(spec, servers, timeout=timeout)
    plane = DataPlane(name, transport=transports)
    plane.elastic = max_ws > 0
    try:
        published = [*(addresses or []), *await plane.listen(conn.local_host)]
        host, pid = hostname or socket.gethostname(), os.getpid()
        secret = secrets.token_bytes(32)  # proves this membership if the server comes back
        conn.start_heartbeats(interval, hb_timeout)
        welcome: Any = await conn.request(
            lambda r: Join(
                r,
                name,
                spec.world_size,
                spec.rank,
                host,
                pid,
                published,
                hb_timeout,
                timeout,
                spec.generation,
                secret,
                max_ws,
            ),
            timeout=timeout + REPLY_GRACE,
        )
        if welcome.restartable:
            conn.reattach = functools.partial(
                Reattach,
                group_name=name,
                generation=spec.generation,
                world_size=welcome.world_size,
                rank=welcome.rank,
                local_rank=welcome.local_rank,
                host=host,
                pid=pid,
                addresses=published,
                heartbeat_timeout=hb_timeout,
                secret=secret,
            )
        session = Session(  # ProtocolError if the Welcome is malformed
            conn,
            welcome,
            group_name=name,
            timeout=timeout,
            backend=backend,
            server=server,
            plane=plane,
            heartbeat_timeout=hb_timeout,
        )
        session.hostname = host
        world = ProcessGroup(session, range(session.world_size), name=name, group_id=WORLD_GROUP_ID)
        session.groups[WORLD_GROUP_ID] = world
        # Admitted to a formed elastic job: its rank space is past the size it formed with.
        newcomer = max_ws > 0 and welcome.world_size > spec.world_size
        if newcomer:
            session.admitted()
        del welcome  # held by this frame for the whole membership otherwise
    except BaseException:
        conn.close()
        with anyio.CancelScope(shield=True):
            await plane.aclose()
        raise
    if spec.local_rank is not None:
        session.local_rank = spec.local_rank  # the launcher's word wins, as in torch
    if spec.local_world_size is not None:
        session.local_size = spec.local_world_size
    conn.on_notice = session.on_notice
    try:
        if newcomer:  # its first view: the notice of its own join, right behind the Welcome
            with anyio.fail_after(timeout):
                await session.views.after(-1)
        yield world
    finally:
        with anyio.CancelScope(shield=True):
            await run_close_hooks(session.groups.values(), min(timeout, CLOSE_GRACE))
            await session.aclose()
        if servers is not None:
            with anyio.CancelScope(shield=True):
                # The embedded server, if this process started one; a process being
                # interrupted or failing does not wait for the others to hang up.
                await servers.aclose(0.0 if session.abandoned else HANG_UP_GRACE)
