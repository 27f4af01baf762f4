"""``aiodist serve``: the rendezvous server as a long-lived daemon.

Runs in the foreground, as systemd and containers expect. Readiness is
announced once the server listens (``on_ready``, and ``READY=1`` on
``$NOTIFY_SOCKET`` when systemd set one). SIGTERM or SIGINT stops accepting,
tells every connected job the server is going away and exits 0 within
``shutdown_timeout``; a second signal exits at once. Metrics are served by
``prometheus_client`` on their own port when asked for.

Every client holds a connection, and so does every stranger until the
server's gate closes it: at start-up the daemon raises its soft limit of open
files to the hard limit (systemd's default soft limit is 1,024), and says so.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import socket
import stat
import sys
from typing import TYPE_CHECKING, Final

import anyio

from aiodist._control.addresses import is_loopback
from aiodist._errors import counted, first_of
from aiodist._server.durable import StateDirError
from aiodist._server.serve import DEFAULT_SHUTDOWN_TIMEOUT, RendezvousServer, serve_rendezvous

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from aiodist._transport.tls import TlsConfig

logger = logging.getLogger(__name__)

MAX_TOKEN_BYTES: Final = 4096
# Fewer open files than this leave little room for clients beside a flood of strangers.
LOW_OPEN_FILES: Final = 4096
# What a soft limit is raised to under an unlimited hard limit (Linux refuses "unlimited").
UNLIMITED_OPEN_FILES: Final = 1 << 20

#: The daemon's full garbage collections run on its own clock, this often (see
#: ``collect_on_a_clock``).
FULL_COLLECTION_INTERVAL: Final = 30.0
# A third threshold no count reaches: Python never starts a full collection itself.
_NEVER: Final = 1 << 30


async def collect_on_a_clock(interval: float = FULL_COLLECTION_INTERVAL) -> None:
    """Run the garbage collector's full collections every ``interval`` seconds, and only then.

    Python starts a full collection each time the objects that outlived the
    younger generations grew by a quarter. A join storm grows them with every
    member (its connection, transport and table entries, all kept for the
    job's life), so 16K ranks joining made seven full collections, each
    scanning every member: a fifth of the daemon's CPU. The young generations
    are still collected as usual (what a request leaves behind); a cycle that
    outlived them waits for the clock. The daemon's process only, never a
    rank's: the previous thresholds are back when it returns (cancelled).
    """
    young, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, _NEVER)
    try:
        while True:
            await anyio.sleep(interval)
            gc.collect()
    finally:
        gc.set_threshold(young, middle, old)


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise this process's soft limit of open files (``RLIMIT_NOFILE``) to its hard limit.

    Returns:
        The soft limit before and after, or None where there is no such limit
        (Windows).
    """
    if sys.platform == "win32":  # pragma: no cover - no RLIMIT_NOFILE there
        return None
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = soft
    targets = [hard] if hard != resource.RLIM_INFINITY else [UNLIMITED_OPEN_FILES]
    if sys.platform == "darwin":  # its kernel caps a process at OPEN_MAX whatever the hard limit
        targets.append(min(targets[0], 10240))
    for target in targets:
        if soft != resource.RLIM_INFINITY and soft >= target:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        soft = target
        break
    return before, soft


def _log_open_files_limit() -> None:
    limits = raise_open_files_limit()
    if limits is None:  # pragma: no cover - Windows
        return
    before, after = limits
    if after != before:
        logger.info("file descriptors: soft limit raised %d -> %d", before, after)
    elif after < LOW_OPEN_FILES:
        logger.warning(
            "file descriptors: soft limit %d, and the hard limit allows no more; each client "
            "holds one: raise it (LimitNOFILE= in the systemd unit, or ulimit -Hn)",
            after,
        )
    else:
        logger.info("file descriptors: soft limit %d (the hard limit)", after)


def read_token_file(path: str) -> str:
    """Read a job token: the file's first line, without surrounding whitespace.

    Raises:
        ValueError: The file is missing, unreadable, empty or too long.
    """
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path!r}: {exc.strerror or exc}") from exc
    if len(raw) > MAX_TOKEN_BYTES:
        raise ValueError(f"the token file {path!r} is over {MAX_TOKEN_BYTES} bytes; is it a token?")
    lines = raw.decode("utf-8", errors="strict").strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"the token file {path!r} is empty; write a random token into it")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "the token file %r can be read by other users; restrict it with `chmod 600`", path
        )
    return token


def sd_notify(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``message`` (``"READY=1"``, ...) to systemd's ``$NOTIFY_SOCKET``, if set.

    The socket is a Unix datagram socket; a name starting with ``@`` lives in
    the abstract namespace. No libsystemd is needed for this one datagram.

    Returns:
        Whether a notification was sent.
    """
    path = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    elif not path.startswith("/"):
        logger.warning("NOTIFY_SOCKET=%r is not a Unix socket; not notifying", path)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)  # never stall the loop on a full queue
            sock.sendto(message.encode(), path)
    except OSError as exc:
        logger.warning("could not notify systemd at %r: %s", path.lstrip("\0"), exc)
        return False
    return True


async def run_daemon(
    host: str,
    port: int,
    *,
    token: str | None = None,
    token_source: str = "",
    metrics_host: str | None = None,
    metrics_port: int | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    on_ready: Callable[[RendezvousServer, str | None], None] | None = None,
    state_dir: str | None = None,
    tls: TlsConfig | None = None,
) -> int:
    """Serve until SIGTERM or SIGINT; return the exit code (0 after a clean shutdown).

    Args:
        host: Address to bind; a non-loopback one without a token logs a warning.
        port: Port to bind (0: the OS picks one; ``on_ready`` learns it).
        token: When given, clients must prove it (``AIODIST_TOKEN``).
        token_source: Where the token came from, for the log (never the token).
        metrics_host: Address of the metrics endpoint (default: ``host``).
        metrics_port: Port of the Prometheus endpoint; None serves no metrics.
        shutdown_timeout: Seconds a shutdown waits for clients to take the notice.
        on_ready: Called once listening, with the server and the metrics port's URL.
        state_dir: Where the jobs' durable state lives (None: memory only; the
            members re-register their jobs after a restart, the store is lost).
        tls: Require mutual TLS of every client (``--tls-cert/--tls-key/--tls-ca``).

    Raises:
        OSError: An address cannot be bound.
        StateDirError: ``state_dir`` cannot be used (damaged, in use, not private);
            raised before anything listens.
    """
    _log_open_files_limit()
    if token is not None:
        logger.info("a token is required (%s)", token_source or "given by the caller")
    elif not is_loopback(host):
        logger.warning(
            "listening on %s without a token: anyone who reaches this port can join jobs and "
            "read or write their stores; pass --token-file or set AIODIST_TOKEN (and set "
            "AIODIST_TOKEN on clients)",
            host,
        )
    else:
        logger.info(
            "no token is required; clients holding one will refuse this server (pass "
            "--token-file or set AIODIST_TOKEN to require one)"
        )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        if len(received) == 1:
            logger.info("received %s: shutting down (again to exit at once)", sig.name)
            stop.set()
            return
        logger.error("received %s again: exiting at once", sig.name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(128 + sig.value)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        async with anyio.create_task_group() as tg:
            server: RendezvousServer = await tg.start(
                functools.partial(
                    serve_rendezvous,
                    host,
                    port,
                    token=token,
                    shutdown_timeout=shutdown_timeout,
                    state_dir=state_dir,
                    restartable=True,  # a daemon may be restarted: its members wait for it
                    tls=tls,
                )
            )
            tg.start_soon(collect_on_a_clock)
            metrics = None
            try:
                if metrics_port is not None:
                    from aiodist._server.metrics import start_metrics

                    metrics = start_metrics(server, loop, metrics_host or host, metrics_port)
                    if token is None and not is_loopback(metrics.address[0]):
                        logger.warning(
                            "the dashboard on http://%s:%d/ shows every job's name, ranks, "
                            "hosts and pids to anyone who reaches it; pass --token-file or set "
                            "AIODIST_TOKEN (its /api/state then asks for the token; /metrics "
                            "stays open), or bind --metrics-host 127.0.0.1",
                            *metrics.address,
                        )
                if server.state_dir is not None:
                    logger.info(
                        "jobs are kept in the state directory %s (fsync'd before each batch "
                        "of replies); %s restored from %s, their members may re-attach",
                        state_dir,
                        counted(server.state.reattachment.restored_jobs, "job"),
                        counted(server.state_dir.replayed, "record"),
                    )
                if on_ready is not None:
                    on_ready(server, None if metrics is None else metrics.url)
                bound = f"{server.address[0]}:{server.address[1]}"
                sd_notify(f"READY=1\nSTATUS=listening on {bound}\nMAINPID={os.getpid()}")
                await stop.wait()
                sd_notify("STOPPING=1")
                jobs = len(server.state.jobs)
                logger.info(
                    "closing %s of %s",
                    counted(server.num_connections, "connection"),
                    counted(jobs, "job"),
                )
                await server.aclose(f"it received {received[0].name}")
            finally:
                tg.cancel_scope.cancel()
                if metrics is not None:
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(metrics.close)
    except BaseExceptionGroup as group:
        # The server refused its state directory as it started: say so, not a traceback.
        refused = first_of(group, StateDirError)
        if refused is None:
            raise
        raise refused from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    logger.info("stopped")
    return 0
