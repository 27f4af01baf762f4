"""Where the job of ``aiodist run`` finds its rendezvous server: hosted here, or joined.

- ``--rdzv-endpoint HOST:PORT``: a server there (an ``aiodist serve`` daemon
  that many jobs share, or another launcher's) is joined; the launcher first
  asks it for its status, so that a port where something else listens (a
  torch TCPStore, say) is an error at once, not a hang in every rank. When
  nothing listens there and HOST is this host's, the launcher hosts the
  server there itself (another launcher on this host may win that race: then
  it joins that one). When HOST is another host's, the ranks wait for it.
- Otherwise node 0's launcher hosts the job's own server at ``--master-addr``
  (127.0.0.1 for one node; for several, this host's address that the other
  nodes can reach, see ``_control.addresses``) and the other nodes point at it.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Final, Protocol

import anyio

from aiodist._control.addresses import is_local, is_loopback, reachable_host
from aiodist._control.connection import connect_control
from aiodist._errors import (
    AuthenticationError,
    DistError,
    DistTimeoutError,
    RendezvousError,
    counted,
)
from aiodist._server.serve import serve_rendezvous
from aiodist._transport import tls
from aiodist._wire.messages import StatusRequest
from aiodist._wire.tls import speaks_tls_message

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from aiodist._server.serve import RendezvousServer

logger = logging.getLogger(__name__)

PROBE_TIMEOUT: Final = 5.0  # an aiodist server answers a status request in milliseconds


class Placement(Protocol):
    """Where a launch looks for its server: the options of ``aiodist run`` that say so.

    ``aiodist._launch.run.LaunchSpec`` is the one implementation; its docstring
    says what each means.
    """

    @property
    def rdzv_endpoint(self) -> str: ...
    @property
    def nnodes(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def master_addr(self) -> str: ...
    @property
    def master_port(self) -> int: ...


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as a pair.

    Raises:
        ValueError: No port, or a port outside 1..65535.
    """
    host, sep, port = endpoint.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdecimal() or not 0 < int(port) < 65536:
        raise ValueError(
            f"--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got {endpoint!r}"
        )
    return host, int(port)


def failure_suspects(server: RendezvousServer, job_id: str) -> list[int]:
    """The ranks of job ``job_id`` that may have made it fail, earliest first.

    The ranks that left ``server`` (hosted here) before the first failure, then
    the first to fail. A leave is a suspect because a program's own
    ``sys.exit(n)`` looks like a clean leave to the server: its peers then fail,
    and only the launcher sees that its exit code was not 0. Empty: no failure.
    """
    job = server.state.jobs.get(job_id)
    if job is not None and job.failures:
        return [*job.left_before_failure, job.failures[0][0]]
    record = server.state.log.finished.get(job_id)
    first = record.get("first_failure") if record is not None else None
    if not isinstance(first, dict):
        return []
    return [*first.get("after_leaves", ()), int(first["rank"])]


def _not_a_server(where: str, port: int, exc: DistError) -> RendezvousError:
    if str(exc) == speaks_tls_message("rendezvous server"):  # a TLS server's refusal
        return RendezvousError(f"the rendezvous server at --rdzv-endpoint {where}: {exc}")
    why = "did not answer" if isinstance(exc, DistTimeoutError) else "hung up on"
    return RendezvousError(
        f"something listens at --rdzv-endpoint {where} but {why} an aiodist status "
        f"request; start a rendezvous server there with `aiodist serve --port {port}`, "
        "or point at one"
    )


def _warn_if_open(host: str, token: str | None) -> None:
    if token is None and not is_loopback(host):
        logger.warning(
            "hosting the job's server on %s without a token: anyone who reaches it can join "
            "the job; pass --token-file or set AIODIST_TOKEN on every node",
            host,
        )


async def _host(tg: TaskGroup, host: str, port: int, token: str | None) -> RendezvousServer:
    _warn_if_open(host, token)
    server: RendezvousServer = await tg.start(
        functools.partial(serve_rendezvous, host, port, token=token, tls=tls.from_env())
    )
    return server


async def place_server(
    spec: Placement, tg: TaskGroup, token: str | None
) -> tuple[tuple[str, int], RendezvousServer | None]:
    """Find or host the job's server; return its address and the server if hosted here.

    Raises:
        OSError: The server to host cannot bind its address.
        RendezvousError: The endpoint answers, but not as an aiodist server, or
            refuses the token; no address other hosts can reach was found.
    """
    if spec.rdzv_endpoint:
        return await _join_or_host(spec, tg, token)
    if spec.node_rank > 0:
        return (spec.master_addr, spec.master_port), None
    host = spec.master_addr
    if not host:  # resolving this host's name blocks: not on the loop
        host = "127.0.0.1" if spec.nnodes == 1 else await anyio.to_thread.run_sync(reachable_host)
    server = await _host(tg, host, spec.master_port, token)
    return server.address, server


async def _join_or_host(
    spec: Placement, tg: TaskGroup, token: str | None
) -> tuple[tuple[str, int], RendezvousServer | None]:
    host, port = parse_endpoint(spec.rdzv_endpoint)
    where = f"{host}:{port}"
    try:
        conn = await connect_control(
            host, port, timeout=PROBE_TIMEOUT, retry_refused=False, token=token or ""
        )
    except ConnectionRefusedError:
        if not await anyio.to_thread.run_sync(is_local, host):
            logger.info("nothing listens at %s yet: the ranks wait for it", where)
            return (host, port), None
        try:
            server = await _host(tg, host, port, token)
        except OSError as exc:
            logger.info("another launcher hosts %s (%s): joining it", where, exc)
            return (host, port), None
        logger.info("nothing listened at %s: hosting the rendezvous server there", where)
        return server.address, server
    except OSError as exc:
        raise RendezvousError(f"cannot reach the rendezvous server at {where}: {exc}") from exc
    except AuthenticationError:
        raise
    except DistError as exc:  # it answered the connection's probe wrongly, or not at all
        raise _not_a_server(where, port, exc) from exc
    try:
        status = await conn.request(StatusRequest, timeout=PROBE_TIMEOUT)
    except AuthenticationError:
        raise
    except DistError as exc:
        raise _not_a_server(where, port, exc) from exc
    finally:
        conn.close()
    logger.info(
        "joining the rendezvous server at %s (aiodist %s, %s)",
        where,
        status.get("version", "?"),
        counted(int(status.get("jobs_total", 0)), "job"),
    )
    return (host, port), None
