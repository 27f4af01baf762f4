"""The two rendezvous servers the benchmarks start: ``aiodist serve`` and a TCPStore master.

Each runs in its own process for as long as a benchmark needs it, so its CPU
time and memory are its own; ``running()`` stops it whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import subprocess
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

from benchmarks._common import now

if TYPE_CHECKING:
    from collections.abc import Iterator
    from multiprocessing.connection import Connection
    from multiprocessing.context import (
        ForkServerContext,
        ForkServerProcess,
        SpawnContext,
        SpawnProcess,
    )

__all__ = [
    "DNS_WORKAROUND",
    "HOST",
    "STARTUP_TIMEOUT",
    "AiodistServer",
    "Server",
    "TCPStoreMaster",
    "cpu_seconds",
    "recv",
    "running",
    "sched_seconds",
    "stop_process",
]

HOST: Final = "127.0.0.1"
# Spawned processes import torch and aiodist before they report in; slow on 2 busy cores.
STARTUP_TIMEOUT: Final = 120.0
# torch's client socket reverse-resolves its addresses on every connect (getnameinfo on
# ::ffff:127.0.0.1, which /etc/hosts does not list). Where the DNS server drops some UDP
# queries (sandboxes, air-gapped nodes) that stalls a client for the resolver's 5 s
# timeout. DNS over TCP (glibc's use-vc) fails at once where nothing answers, and costs a
# round trip where a server does: what a working resolver costs. Each such lookup also
# logs a c10d warning, so TCPStore's C++ log is limited to errors.
DNS_WORKAROUND: Final = {"RES_OPTIONS": "use-vc", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def recv(conn: Connection, deadline: float, what: str) -> Any:
    if not conn.poll(max(0.0, deadline - now())):
        raise TimeoutError(f"no {what} from a worker in time")
    return conn.recv()


def cpu_seconds(pid: int | None) -> float:
    """CPU time of process ``pid`` so far, its live threads together, in nanosecond steps.

    Read from each thread's ``schedstat`` (time on a CPU): ``/proc/PID/stat``
    counts in clock ticks of 10 ms, too coarse for a small run. 0 if unknown.
    """
    return sched_seconds(pid)[0]


def sched_seconds(pid: int | None) -> tuple[float, float]:
    """Seconds process ``pid`` spent on a CPU so far, and waiting for one, its live threads
    together (each thread's ``schedstat``); (0, 0) if unknown.

    The wait is time it could have run while other processes held every CPU: on a
    shared machine, what its wall-clock time holds besides its own work.
    """
    if pid is None:
        return 0.0, 0.0
    ran = waited = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for tid in threads:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
                ran, waited = ran + int(fields[0]), waited + int(fields[1])
    return ran / 1e9, waited / 1e9


def stop_process(proc: ForkServerProcess | SpawnProcess) -> None:
    proc.terminate()
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _tcpstore_master_main(conn: Connection, host: str, parent_pid: int) -> None:
    """Hold a TCPStore master until the parent says stop (or goes away)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore(
        host, 0, world_size=None, is_master=True, wait_for_workers=False, timeout=timedelta(hours=1)
    )
    conn.send(store.port)
    while not conn.poll(1.0):
        if os.getppid() != parent_pid:
            break
    del store


class AiodistServer:
    """``aiodist serve`` as a subprocess; ``port`` once started."""

    def __init__(self, profile: str | None = None) -> None:
        self.profile = profile
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "aiodist", "serve", "--host", HOST, "--port", "0"]
        if self.profile:
            cmd[1:1] = ["-m", "cProfile", "-o", self.profile]
        self._proc = subprocess.Popen(
            [*cmd, "--log-level", "warning"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
        )
        self.port = _read_banner(self._proc, STARTUP_TIMEOUT)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()  # SIGTERM: a clean shutdown, so a profile gets written
        try:
            proc.wait(30 if self.profile else 10)
        except subprocess.TimeoutExpired:  # a server stuck in a busy loop ignores SIGTERM
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def _read_banner(proc: subprocess.Popen[bytes], timeout: float) -> int:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    deadline = now() + timeout
    while b"\n" not in buf:
        remaining = deadline - now()
        if remaining <= 0 or proc.poll() is not None:
            raise RuntimeError(f"`aiodist serve` did not report its address (got {buf!r})")
        ready, _, _ = select.select([fd], [], [], min(remaining, 0.5))
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"`aiodist serve` exited early (got {buf!r})")
            buf += chunk
    line = buf.split(b"\n", 1)[0].decode()
    match = re.search(r"listening on (\S+):(\d+)", line)
    if match is None:
        raise RuntimeError(f"unexpected banner from `aiodist serve`: {line!r}")
    return int(match.group(2))


class TCPStoreMaster:
    """A TCPStore master (libuv backend) in its own process; ``port`` once started."""

    def __init__(self, ctx: ForkServerContext | SpawnContext) -> None:
        self._ctx = ctx
        self.port = 0
        self._proc: ForkServerProcess | SpawnProcess | None = None
        self._conn: Connection | None = None

    def start(self) -> None:
        self._conn, child_end = self._ctx.Pipe()
        self._proc = self._ctx.Process(
            target=_tcpstore_master_main,
            args=(child_end, HOST, os.getpid()),
            name="bench-tcpstore-master",
            daemon=True,
        )
        self._proc.start()
        child_end.close()
        self.port = recv(self._conn, now() + STARTUP_TIMEOUT, "TCPStore port")

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def stop(self) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send("stop")
        if proc is not None:
            proc.join(5)
            stop_process(proc)
        if conn is not None:
            conn.close()


Server = AiodistServer | TCPStoreMaster


@contextlib.contextmanager
def running(server: Server) -> Iterator[Server]:
    """Start ``server``; stop it on the way out, whatever happens."""
    try:
        server.start()
        yield server
    finally:
        server.stop()
