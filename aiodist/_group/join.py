"""Joining a job: ``open_process_group`` makes the session and yields its world group.

Joining parses the init method, listens on the data plane, starts heartbeats
(a timer of the control connection, stopped when it closes) and sends the
``Join``; the server's ``Welcome`` makes the session. An embedded server lives
in an anyio task group owned by ``open_process_group`` (made only when this
process may embed one). Nothing outlives the ``async with``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import TYPE_CHECKING, Any

import anyio

from aiodist._control.rendezvous import (
    RendezvousSpec,
    connect_rendezvous,
    may_embed,
    parse_init_method,
)
from aiodist._control.store import REPLY_GRACE
from aiodist._group.session import (
    DEFAULT_HEARTBEAT_INTERVAL,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_TIMEOUT,
    Session,
)
from aiodist._plane.peers import DataPlane
from aiodist._wire.messages import Join

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

    from anyio.abc import TaskGroup

    from aiodist._group.group import ProcessGroup

__all__ = ["open_process_group"]


def _default_group_name(environ: dict[str, str] | os._Environ[str]) -> str:
    return environ.get("AIODIST_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID") or "default"


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

    Raises:
        RendezvousError: The job refused this process (conflicting rank or world size).
        RendezvousTimeout: The job did not form within ``timeout``.

    Cancellation:
        Cancelling while joining abandons the join; the server drops this member.
    """
    env = os.environ
    spec = parse_init_method(init_method, rank=rank, world_size=world_size)
    if spec.world_size < 1:
        raise ValueError(
            f"world_size must be given (>= 1), got {spec.world_size}: pass world_size= or set "
            "WORLD_SIZE"
        )
    if not -1 <= spec.rank < spec.world_size:
        raise ValueError(f"rank must be in [0, {spec.world_size}) or -1, got {spec.rank}")
    interval = heartbeat_interval or float(
        env.get("AIODIST_HEARTBEAT_INTERVAL", DEFAULT_HEARTBEAT_INTERVAL)
    )
    hb_timeout = heartbeat_timeout or float(
        env.get("AIODIST_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT)
    )
    if not 0 < interval < hb_timeout:
        raise ValueError(
            f"heartbeat_interval ({interval}) must be > 0 and below heartbeat_timeout "
            f"({hb_timeout})"
        )
    name = group_name or _default_group_name(env)
    args = (spec, name, timeout, backend, interval, hb_timeout, hostname, addresses)
    if not may_embed(spec, env):
        # Nothing to run beside the member (heartbeats are a timer): no task group.
        async with _joined(None, *args) as group:
            yield group
        return
    with _unwrap_single_error():
        async with anyio.create_task_group() as tg:
            async with _joined(tg, *args) as group:
                yield group


@contextlib.contextmanager
def _unwrap_single_error() -> Iterator[None]:
    # Task groups wrap every error in an ExceptionGroup; a caller that gets one
    # error (RendezvousError, or its own) should see it plainly.
    try:
        yield
    except BaseExceptionGroup as group:
        errors = _flatten(group)
        if len(errors) == 1:
            raise errors[0] from errors[0].__cause__
        raise


def _flatten(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_flatten(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


@contextlib.asynccontextmanager
async def _joined(
    tg: TaskGroup | None,
    spec: RendezvousSpec,
    name: str,
    timeout: float,
    backend: str | None,
    interval: float,
    hb_timeout: float,
    hostname: str | None,
    addresses: list[str] | None,
) -> AsyncIterator[ProcessGroup]:
    # Notices that come before the session exists are held by the channel until then.
    conn, server = await connect_rendezvous(spec, tg, timeout=timeout)
    plane = DataPlane(name)
    try:
        published = [*(addresses or []), *await plane.listen(conn.local_host)]
        host, pid = hostname or socket.gethostname(), os.getpid()
        conn.start_heartbeats(interval, hb_timeout)
        welcome: Any = await conn.request(
            lambda r: Join(
                r, name, spec.world_size, spec.rank, host, pid, published, hb_timeout, timeout
            ),
            timeout=timeout + REPLY_GRACE,
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
        yield session.world
    finally:
        with anyio.CancelScope(shield=True):
            await session.aclose()
        if tg is not None:
            tg.cancel_scope.cancel()  # the embedded server, if this process started one
