"""Turning ``init_method`` into a control connection: ``tcp://``, ``env://``, ``file://``.

- ``tcp://HOST:PORT`` connects there (``tls://HOST:PORT`` too, insisting that
  ``AIODIST_TLS_*`` is set; with it set, ``tcp://`` uses TLS as well). If
  nothing listens and this process is rank 0 (or ``AIODIST_EMBED=1``), it
  starts the server embedded in itself.
  Other ranks retry until the rendezvous timeout, as TCPStore clients do.
- ``env://`` reads torchrun's variables and then behaves as ``tcp://``: at
  ``AIODIST_SERVER`` (``aiodist run`` on one node, whose launcher also hosts
  torch's store at ``MASTER_ADDR:MASTER_PORT``, as torchrun's agent does), else
  at ``MASTER_ADDR:MASTER_PORT`` (``aiodist run`` on several nodes).
  Under torchrun itself (``TORCHELASTIC_RUN_ID`` set), a torch TCPStore
  listens there instead: rank 0 embeds a server on a free port and publishes
  it in that store, the others read it there (``torchrun.py``).
- A torch ``Store`` (``store=``, as torch's ``init_process_group`` takes one;
  torch's own ``init_process_group(backend="aiodist")`` hands over its store):
  rank 0 embeds a server on a free port and publishes it there, the others
  read it there, as under torchrun.
- ``file:///shared/path`` needs no address: under an fcntl lock on the file,
  the first process starts an embedded server on a free port and writes its
  address there; the others read it and connect. The file is the only thing
  the processes must share, so no port has to be agreed on beforehand.

An embedded server that other hosts may need binds an address they can reach
(``addresses.py``: ``AIODIST_HOST``, ``AIODIST_SOCKET_IFNAME``, ...), and
127.0.0.1 when the launcher says every rank runs on this host
(``LOCAL_WORLD_SIZE == WORLD_SIZE``). One that listens beyond loopback without
a token logs a warning.

The token is the process's ``$AIODIST_TOKEN``: an embedded server requires it
from its clients when it is set, and this process's clients insist that the
server they reach proves it (one that requires no token is refused).
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import os
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import anyio

from aiodist import _settings
from aiodist._control.addresses import is_loopback, reachable_host
from aiodist._control.shared import open_channel
from aiodist._control.torchrun import (
    Torchrun,
    env_int,
    find_in,
    open_store,
    publish_in,
    server_key,
    torchrun_env,
)
from aiodist._errors import AuthenticationError, RendezvousError
from aiodist._server.serve import DEFAULT_PORT, serve_rendezvous
from aiodist._transport import tcp, tls

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Mapping

    from aiodist._control.channel import ControlChannel
    from aiodist._server.serve import RendezvousServer

logger = logging.getLogger(__name__)
FILE_PROBE_TIMEOUT: Final = 2.0
_file_locks: dict[str, asyncio.Lock] = {}  # fcntl locks are per process: also lock in-process


class ServerHost(Protocol):
    """Where an embedded server's task runs: ``start`` as an anyio task group has it."""

    async def start(
        self, func: Callable[..., Coroutine[Any, Any, Any]], *args: object, name: object = None
    ) -> Any: ...


@dataclass(frozen=True, slots=True)
class RendezvousSpec:
    """Where and how to rendezvous, resolved from ``init_method`` and the environment."""

    scheme: Literal["tcp", "file", "torchrun", "store"]
    host: str = ""  # for "torchrun": where torchrun's store listens
    port: int = 0
    path: str = ""
    rank: int = -1
    world_size: int = -1
    local_rank: int | None = None
    local_world_size: int | None = None
    generation: int = 0  # the launcher's restart count
    torchrun: Torchrun | None = None
    store: Any = None  # for "store": the torch Store the server is published in

    @property
    def single_host(self) -> bool:
        """Whether the launcher said that every rank runs on this host."""
        return self.world_size == 1 or (
            self.local_world_size is not None and self.local_world_size == self.world_size
        )


def parse_init_method(
    init_method: str | None,
    *,
    rank: int = -1,
    world_size: int = -1,
    environ: Mapping[str, str] | None = None,
    store: Any = None,
) -> RendezvousSpec:
    """Resolve ``init_method`` (default ``env://``), or a torch ``store``, into a spec.

    Explicit ``rank``/``world_size`` win over the environment, as in torch.

    Raises:
        ValueError: An unknown scheme or a malformed address; both ``init_method``
            and ``store``; a ``store`` without a rank.
        RendezvousError: ``env://`` without the variables it needs.
    """
    env = os.environ if environ is None else environ
    if store is not None:
        if init_method is not None:
            raise ValueError("pass init_method or store, not both (as torch.distributed)")
        if rank < 0:
            raise ValueError("a store needs rank= (the server is published by rank 0)")
        return RendezvousSpec(
            "store",
            rank=rank,
            world_size=world_size,
            local_world_size=_local_world_size(env, world_size),
            generation=env_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
            store=store,
        )
    method = init_method or "env://"
    url = urllib.parse.urlsplit(method)
    generation = env_int(env, "TORCHELASTIC_RESTART_COUNT") or 0
    if generation < 0:
        raise RendezvousError(f"TORCHELASTIC_RESTART_COUNT={generation} must be >= 0")
    if url.scheme == "env":  # only a launcher's environment says which local rank we are
        local_rank = env_int(env, "LOCAL_RANK")
        local_world_size = env_int(env, "LOCAL_WORLD_SIZE")
        if rank < 0:
            rank = env_int(env, "RANK") if "RANK" in env else -1  # type: ignore[assignment]
        if world_size < 0:
            world_size = env_int(env, "WORLD_SIZE") if "WORLD_SIZE" in env else -1  # type: ignore[assignment]
        if server := _settings.SERVER.read(env):
            # ``aiodist run``: its server, while MASTER_ADDR:MASTER_PORT is torch's store.
            return RendezvousSpec(
                "tcp",
                *tcp.parse(server),
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                local_world_size=local_world_size,
                generation=generation,
            )
        port = env_int(env, "MASTER_PORT")
        host = env.get("MASTER_ADDR", "")
        if port is None or not host:
            missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
            raise RendezvousError(
                f"init_method 'env://' needs {' and '.join(missing)}: export MASTER_ADDR=<rank 0's "
                f"address> MASTER_PORT=<free port, e.g. {DEFAULT_PORT}>, launch with "
                "`aiodist run`/torchrun, or pass init_method='tcp://HOST:PORT'"
            )
        run = torchrun_env(env)
        return RendezvousSpec(
            "tcp" if run is None else "torchrun",
            host,
            port,
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            generation=generation,
            torchrun=run,
        )
    if url.scheme == "tls" and tls.from_env(env) is None:
        raise ValueError(
            f"init_method {method!r} asks for TLS: set AIODIST_TLS_CERT, AIODIST_TLS_KEY and "
            "AIODIST_TLS_CA (this process's certificate, its key, the job's CA)"
        )
    if url.scheme in ("tcp", "tls"):  # tls:// is tcp:// that insists on AIODIST_TLS_*
        try:
            tcp_host, tcp_port = url.hostname, url.port
        except ValueError as exc:
            raise ValueError(f"malformed init_method {method!r}: {exc}") from None
        if not tcp_host or tcp_port is None:
            raise ValueError(
                f"init_method {method!r} needs a host and a port: {url.scheme}://HOST:PORT"
            )
        return RendezvousSpec(
            "tcp", tcp_host, tcp_port, rank=rank, world_size=world_size, generation=generation
        )
    if url.scheme == "file":
        path = urllib.parse.unquote(url.path)
        if not path:
            raise ValueError(f"init_method {method!r} needs a path: file:///shared/path")
        return RendezvousSpec(
            "file",
            path=path,
            rank=rank,
            world_size=world_size,
            local_world_size=_local_world_size(env, world_size),
            generation=generation,
        )
    raise ValueError(
        f"init_method {method!r} has an unknown scheme; use tcp://HOST:PORT, tls://HOST:PORT, "
        "env:// or file:///path"
    )


def _local_world_size(env: Mapping[str, str], world_size: int) -> int | None:
    """A launcher's word on how many ranks run here (it decides where a server listens)."""
    env_world_size = env_int(env, "WORLD_SIZE")
    if env_world_size is not None and env_world_size == world_size:
        return env_int(env, "LOCAL_WORLD_SIZE")
    return None


def may_embed(spec: RendezvousSpec, environ: Mapping[str, str] | None = None) -> bool:
    """True if joining with ``spec`` may start an embedded server in this process.

    ``file://`` always may; ``tcp://`` (and ``env://``) only as rank 0 or with
    ``AIODIST_EMBED=1``; under torchrun, rank 0 does.
    """
    env = os.environ if environ is None else environ
    if spec.scheme in ("torchrun", "store"):
        return spec.rank == 0
    return spec.scheme == "file" or spec.rank == 0 or _settings.EMBED.read(env)


async def connect_rendezvous(
    spec: RendezvousSpec,
    tg: ServerHost | None,
    *,
    timeout: float,
    environ: Mapping[str, str] | None = None,
) -> tuple[ControlChannel, RendezvousServer | None]:
    """Open the control connection for ``spec``, embedding a server in ``tg`` if needed.

    ``tg`` may be None only where ``may_embed(spec)`` is false.

    Returns:
        The connection and the embedded server, if this process started one.
    """
    env = os.environ if environ is None else environ
    # One token for the server this process may embed and for its own clients.
    token = _settings.TOKEN.read(env) or ""
    if spec.scheme in ("torchrun", "store"):
        return await _connect_through_store(spec, tg, timeout=timeout, token=token, env=env)
    if not may_embed(spec, env):
        conn = await open_channel(spec.host, spec.port, timeout=timeout, token=token)
        return conn, None
    assert tg is not None, "a process that may embed the server needs a task group"
    if spec.scheme == "file":
        return await _connect_file(spec, tg, timeout=timeout, token=token, env=env)
    try:
        conn = await open_channel(
            spec.host, spec.port, timeout=timeout, retry_refused=False, token=token
        )
        return conn, None
    except ConnectionRefusedError:
        try:
            server = await _embed(tg, spec.host, spec.port, token)
        except OSError:
            pass  # another process won the race to embed it; connect to theirs
        else:
            conn = await open_channel(*server.address, timeout=timeout, token=token)
            return conn, server
    conn = await open_channel(spec.host, spec.port, timeout=timeout, token=token)
    return conn, None


async def _embed(tg: ServerHost, host: str, port: int, token: str) -> RendezvousServer:
    """Start a server in ``tg`` at ``host:port``; warn if it is open beyond loopback.

    With ``$AIODIST_TLS_*`` set it requires mutual TLS of its clients.
    """
    server: RendezvousServer = await tg.start(
        functools.partial(serve_rendezvous, token=token or None, tls=tls.from_env()), host, port
    )
    if not token and not is_loopback(server.address[0]):
        logger.warning(
            "the rendezvous server embedded in this process listens on %s:%d without a token: "
            "anyone who reaches it can join the job; set AIODIST_TOKEN on every rank",
            *server.address,
        )
    return server


def _embed_host(spec: RendezvousSpec, env: Mapping[str, str], *, toward: str | None) -> str:
    """Where to embed a server that every rank of ``spec`` must reach."""
    if host := _settings.HOST.read(env):
        return host
    if spec.single_host:
        return "127.0.0.1"
    return reachable_host(toward, env)


#: The key a job's server is published under in a torch store handed to aiodist.
STORE_KEY: Final = "aiodist/server"


async def _connect_through_store(
    spec: RendezvousSpec,
    tg: ServerHost | None,
    *,
    timeout: float,
    token: str,
    env: Mapping[str, str],
) -> tuple[ControlChannel, RendezvousServer | None]:
    """Rank 0 embeds a server and publishes it in a torch store; the others find it there.

    The store is torchrun's (``spec.torchrun``), opened here, or the one handed
    to ``init_process_group`` (``spec.store``).
    """
    run = spec.torchrun
    if run is None:
        key, where, whose = STORE_KEY, "the torch store given to init_process_group", "rank 0"
    else:
        key, where = server_key(run), f"torchrun's store at {spec.host}:{spec.port}"
        whose = f"rank 0 of torchrun run {run.run_id!r} (restart {run.restart_count})"

    async def store() -> Any:
        if run is None:
            return spec.store
        return await open_store(spec.host, spec.port, spec.rank, spec.world_size, run, timeout)

    if spec.rank != 0:
        address = await find_in(await store(), key, timeout=timeout, where=where, whose=whose)
        return await open_channel(*address, timeout=timeout, token=token), None
    assert tg is not None, "rank 0 embeds the server: it needs a task group"
    # Before the server starts: an address that cannot be found is an error, not a wait.
    host = _file_host(spec, env) if run is None else _embed_host(spec, env, toward=spec.host)
    server = await _embed(tg, host, 0, token)
    await publish_in(await store(), key, server.address, where)
    return await open_channel(*server.address, timeout=timeout, token=token), server


async def _connect_file(
    spec: RendezvousSpec,
    tg: ServerHost,
    *,
    timeout: float,
    token: str,
    env: Mapping[str, str],
) -> tuple[ControlChannel, RendezvousServer | None]:
    path = spec.path
    lock = _file_locks.setdefault(path, asyncio.Lock())
    with anyio.fail_after(timeout):
        async with lock:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                await anyio.to_thread.run_sync(fcntl.lockf, fd, fcntl.LOCK_EX)
                with os.fdopen(os.dup(fd), "r+") as f:
                    content = f.read().strip()
                    if content:
                        try:
                            conn = await open_channel(
                                *tcp.parse(content),
                                timeout=FILE_PROBE_TIMEOUT,
                                retry_refused=False,
                                token=token,
                            )
                            return conn, None
                        except AuthenticationError:
                            # A live server refused our token, or requires none: final,
                            # not stale (replacing it would cut off the job it serves).
                            raise
                        except (OSError, ValueError, RendezvousError):
                            pass  # a stale address from a job that ended: replace it
                    server = await _embed(tg, _file_host(spec, env), 0, token)
                    f.seek(0)
                    f.truncate()
                    f.write(f"{server.address[0]}:{server.address[1]}\n")
                    f.flush()
                    os.fsync(f.fileno())
                conn = await open_channel(*server.address, timeout=timeout, token=token)
                return conn, server
            finally:
                os.close(fd)  # releases the fcntl lock


def _file_host(spec: RendezvousSpec, env: Mapping[str, str]) -> str:
    """Where the first process of a ``file://`` job (or rank 0 of a store's) embeds the server.

    Other hosts may share the file, so it is an address they can reach, unless
    the launcher says every rank runs here; a host whose address cannot be
    found serves this host only (AIODIST_SOCKET_IFNAME says where, if needed).
    """
    configured = any(s.read(env) for s in (_settings.HOST, _settings.SOCKET_IFNAME))
    try:
        return _embed_host(spec, env, toward=None)
    except RendezvousError as exc:
        if configured:
            raise
        logger.info("serving the file:// job on 127.0.0.1 only: %s", exc)
        return "127.0.0.1"
