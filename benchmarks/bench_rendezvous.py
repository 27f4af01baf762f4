"""Time the full rendezvous of N clients: aiodist's server against torch's TCPStore.

One run, for either system, is what every rank of a job does at start-up:

1. join the job (aiodist: ``open_process_group``, which returns once all N
   joined; TCPStore: connect a client store and ``add("rank", 1)``);
2. set its own key ``addr/{rank}``;
3. wait for all N ``addr/*`` keys;
4. pass a barrier (aiodist: the server-side ``session.barrier()``; TCPStore:
   torch's store-based barrier, ``add("barrier", 1)`` then ``wait(["barrier_done"])``,
   where the client that brings the count to N sets ``barrier_done``).

Both servers run in their own process for the whole benchmark: ``aiodist serve``
as a subprocess, the TCPStore master (libuv) in a spawned process. Clients are
spread over a few worker processes: aiodist clients as tasks on one uvloop loop
per worker, TCPStore clients (a blocking API) as threads. Each run uses a fresh
job name / key prefix. The clock starts when the parent releases the workers
(all prepared, waiting at a barrier) and stops when the last client has passed
the barrier; each worker stamps its clients on the machine-wide monotonic clock.
A failed or timed-out run restarts the worker pool and that system's server, so
a server still busy with a broken job cannot slow the next measurement.

What the two joins do differs: aiodist's join also starts each client's
data-plane listeners and hands every client the whole member table (one row per
rank) when the job forms; TCPStore's is a connection and one ``add``.

TCPStore processes get ``RES_OPTIONS=use-vc`` unless ``--no-dns-workaround``
is given: see ``DNS_WORKAROUND``.

Usage::

    python -m benchmarks.bench_rendezvous [--sizes 16 128 1024] [--repeats K] [--quick]

Results go to ``benchmarks/results/rendezvous.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import re
import select
import subprocess
import sys
import threading
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Literal

from benchmarks._common import format_table, now, raise_fd_limit, summarize, write_results

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnContext, SpawnProcess
    from multiprocessing.synchronize import Barrier

System = Literal["aiodist", "tcpstore"]

SYSTEMS: Final[tuple[System, ...]] = ("aiodist", "tcpstore")
HOST: Final = "127.0.0.1"
DEFAULT_SIZES: Final = (16, 128, 1024)
QUICK_SIZES: Final = (16, 128)
QUICK_REPEATS: Final = 2
DEFAULT_WORKERS: Final = 4
# Seconds one run may take before it counts as a timeout (also the clients' op timeout).
DEFAULT_RUN_TIMEOUT: Final = 30.0
# Extra seconds the parent waits beyond a run's timeout before it gives up on a worker.
GRACE: Final = 15.0
# Spawned workers import torch and aiodist before they report in; slow on 2 busy cores.
STARTUP_TIMEOUT: Final = 120.0
PHASES: Final = ("join", "set", "wait", "barrier")
# torch's client socket reverse-resolves its addresses on every connect (getnameinfo on
# ::ffff:127.0.0.1, which /etc/hosts does not list). Where the DNS server drops some UDP
# queries (sandboxes, air-gapped nodes) that stalls a client for the resolver's 5 s
# timeout. DNS over TCP (glibc's use-vc) fails at once where nothing answers, and costs a
# round trip where a server does: what a working resolver costs. Each such lookup also
# logs a c10d warning, so TCPStore's C++ log is limited to errors.
DNS_WORKAROUND: Final = {"RES_OPTIONS": "use-vc", "TORCH_CPP_LOG_LEVEL": "ERROR"}


def default_repeats(world_size: int) -> int:
    """More repeats where runs are cheap."""
    return 7 if world_size <= 16 else 5 if world_size <= 128 else 3


# --- what the parent sends and the workers report ------------------------------------------


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One worker's share of one run."""

    system: System
    host: str
    port: int
    tag: str  # aiodist group_name / TCPStore key prefix; fresh per run
    world_size: int
    ranks: tuple[int, ...]
    timeout: float


@dataclass(slots=True)
class WorkerReport:
    """When this worker's last client finished each phase (``now()`` clock)."""

    phases: list[float] = field(default_factory=lambda: [math.nan] * len(PHASES))
    error: str = ""


@dataclass(slots=True)
class RunResult:
    """One run of N clients, as the parent saw it."""

    wall: float | None  # seconds from release to the last client past the barrier
    phases: list[float]  # seconds from release to the last client past each phase
    error: str = ""


def _address_value(rank: int) -> str:
    return f"{HOST}:{20000 + rank}"


def _latest(stamps: Sequence[Sequence[float]]) -> list[float]:
    return [max((s[i] for s in stamps), default=math.nan) for i in range(len(PHASES))]


# --- worker processes ------------------------------------------------------------------------


def _worker_main(conn: Connection, barrier: Barrier, parent_pid: int) -> None:
    """Run the runs the parent sends until it sends None (or goes away)."""
    # Pay every import before the first run is timed.
    import anyio
    import torch.distributed
    import uvloop

    import aiodist

    del anyio, torch.distributed, uvloop, aiodist
    conn.send("up")
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent_pid:
                return
        spec: RunSpec | None = conn.recv()
        if spec is None:
            return
        try:
            if spec.system == "aiodist":
                report = _run_aiodist(spec, conn, barrier)
            else:
                report = _run_tcpstore(spec, conn, barrier)
        except Exception as exc:  # reported to the parent, which restarts the pool
            report = WorkerReport(error=_describe(exc))
        conn.send(report)


def _describe(exc: BaseException, limit: int = 300) -> str:
    if isinstance(exc, BaseExceptionGroup):
        text = "; ".join(_describe(e, limit) for e in exc.exceptions[:3])
    else:
        text = "".join(traceback.format_exception_only(exc)).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _run_aiodist(spec: RunSpec, conn: Connection, barrier: Barrier) -> WorkerReport:
    import anyio
    import uvloop

    report: WorkerReport = anyio.run(
        _aiodist_clients,
        spec,
        conn,
        barrier,
        backend_options={"loop_factory": uvloop.new_event_loop},
    )
    return report


async def _aiodist_clients(spec: RunSpec, conn: Connection, barrier: Barrier) -> WorkerReport:
    import anyio

    from aiodist import open_process_group

    url = f"tcp://{spec.host}:{spec.port}"
    keys = [f"addr/{r}" for r in range(spec.world_size)]
    stamps = [[math.nan] * len(PHASES) for _ in spec.ranks]

    async def client(stamp: list[float], rank: int) -> None:
        async with open_process_group(
            url, world_size=spec.world_size, rank=rank, group_name=spec.tag, timeout=spec.timeout
        ) as group:
            stamp[0] = now()
            await group.store.set(keys[rank], _address_value(rank))
            stamp[1] = now()
            await group.store.wait(keys)
            stamp[2] = now()
            await group.session.barrier()
            stamp[3] = now()

    conn.send("ready")
    # In a thread so the loop is already running when the parent releases us.
    await anyio.to_thread.run_sync(barrier.wait, spec.timeout)
    with anyio.fail_after(spec.timeout + GRACE / 2):
        async with anyio.create_task_group() as tg:
            for stamp, rank in zip(stamps, spec.ranks, strict=True):
                tg.start_soon(client, stamp, rank)
    return WorkerReport(_latest(stamps))


def _run_tcpstore(spec: RunSpec, conn: Connection, barrier: Barrier) -> WorkerReport:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    prefix = spec.tag
    keys = [f"{prefix}/addr/{r}" for r in range(spec.world_size)]
    stamps = [[math.nan] * len(PHASES) for _ in spec.ranks]
    errors: list[str] = []
    go = threading.Event()
    released = False

    def client(stamp: list[float], rank: int) -> None:
        if not go.wait(spec.timeout) or not released:
            return
        try:
            store = TCPStore(
                spec.host,
                spec.port,
                world_size=None,
                is_master=False,
                timeout=timedelta(seconds=spec.timeout),
                wait_for_workers=False,
            )
            store.add(f"{prefix}/rank", 1)
            stamp[0] = now()
            store.set(keys[rank], _address_value(rank))
            stamp[1] = now()
            store.wait(keys)
            stamp[2] = now()
            # torch's store-based barrier: the last one in opens the door.
            if store.add(f"{prefix}/barrier", 1) == spec.world_size:
                store.set(f"{prefix}/barrier_done", "1")
            store.wait([f"{prefix}/barrier_done"])
            stamp[3] = now()
        except Exception as exc:
            errors.append(f"rank {rank}: {_describe(exc)}")

    # Threads exist before the clock starts: we time TCPStore, not thread creation.
    threads = [
        threading.Thread(target=client, args=(stamp, rank), daemon=True)
        for stamp, rank in zip(stamps, spec.ranks, strict=True)
    ]
    try:
        for t in threads:
            t.start()
        conn.send("ready")
        barrier.wait(spec.timeout)
        released = True
    finally:
        go.set()  # on failure the threads see released == False and return
    deadline = now() + spec.timeout + GRACE / 2
    for t in threads:
        t.join(max(0.0, deadline - now()))
    stuck = sum(t.is_alive() for t in threads)
    if stuck:
        errors.append(f"{stuck} of {len(threads)} clients still running after {spec.timeout} s")
    return WorkerReport(_latest(stamps), "; ".join(errors[:3]))


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


# --- the parent: servers, the worker pool, runs ------------------------------------------------


def _recv(conn: Connection, deadline: float, what: str) -> Any:
    if not conn.poll(max(0.0, deadline - now())):
        raise TimeoutError(f"no {what} from a worker in time")
    return conn.recv()


def _stop_process(proc: SpawnProcess) -> None:
    proc.terminate()
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


class WorkerPool:
    """``size`` spawned worker processes and the barrier that releases them together."""

    def __init__(self, ctx: SpawnContext, size: int) -> None:
        self._ctx = ctx
        self.size = size
        self._procs: list[SpawnProcess] = []
        self._conns: list[Connection] = []
        self._barrier: Barrier | None = None

    def start(self) -> None:
        self._barrier = self._ctx.Barrier(self.size + 1)
        for i in range(self.size):
            parent_end, child_end = self._ctx.Pipe()
            proc = self._ctx.Process(
                target=_worker_main,
                args=(child_end, self._barrier, os.getpid()),
                name=f"bench-worker-{i}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        deadline = now() + STARTUP_TIMEOUT
        for conn in self._conns:
            if _recv(conn, deadline, "start-up message") != "up":
                raise RuntimeError("a worker sent an unexpected start-up message")

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(2)
            _stop_process(proc)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._barrier = [], [], None

    def restart(self) -> None:
        self.close()
        self.start()

    def run(self, system: System, port: int, world_size: int, timeout: float) -> RunResult:
        """Run N clients of ``system`` spread over the pool; restart the pool on failure."""
        assert self._barrier is not None
        tag = f"bench-{system}-{world_size}-{uuid.uuid4().hex[:12]}"
        workers = min(self.size, world_size)
        try:
            for w, conn in enumerate(self._conns):
                ranks = tuple(range(w, world_size, workers)) if w < workers else ()
                conn.send(RunSpec(system, HOST, port, tag, world_size, ranks, timeout))
            deadline = now() + STARTUP_TIMEOUT
            for conn in self._conns:
                if _recv(conn, deadline, "ready message") != "ready":
                    raise RuntimeError("a worker sent an unexpected ready message")
            # Every worker is prepared and waits at the barrier; the clock starts now.
            start = now()
            self._barrier.wait(GRACE)
            deadline = start + timeout + GRACE
            reports: list[WorkerReport] = [_recv(conn, deadline, "report") for conn in self._conns]
        except (OSError, EOFError, TimeoutError, RuntimeError, threading.BrokenBarrierError) as exc:
            self.restart()
            return RunResult(None, [math.nan] * len(PHASES), _describe(exc))
        errors = [r.error for r in reports if r.error]
        if errors:
            self.restart()  # a worker may still hold stuck clients
            return RunResult(None, [math.nan] * len(PHASES), errors[0])
        phases = [max(r.phases[i] for r in reports[:workers]) - start for i in range(len(PHASES))]
        return RunResult(phases[-1], phases)


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

    def __init__(self, ctx: SpawnContext) -> None:
        self._ctx = ctx
        self.port = 0
        self._proc: SpawnProcess | None = None
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
        self.port = _recv(self._conn, now() + STARTUP_TIMEOUT, "TCPStore port")

    def stop(self) -> None:
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send("stop")
        if proc is not None:
            proc.join(5)
            _stop_process(proc)
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


@contextlib.contextmanager
def worker_pool(ctx: SpawnContext, size: int) -> Iterator[WorkerPool]:
    pool = WorkerPool(ctx, size)
    try:
        pool.start()
        yield pool
    finally:
        pool.close()


# --- the benchmark ------------------------------------------------------------------------------


def _restart(server: Server) -> None:
    server.stop()
    server.start()


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def bench(
    sizes: Sequence[int],
    repeats: int | None,
    *,
    systems: Sequence[System] = SYSTEMS,
    workers: int,
    timeout: float,
    profile_server: str | None = None,
) -> dict[str, Any]:
    """Run every size for both systems; return the results as plain data."""
    ctx = multiprocessing.get_context("spawn")
    results: list[dict[str, Any]] = []
    systems = [s for s in SYSTEMS if s in systems]
    with contextlib.ExitStack() as stack:
        servers: dict[System, Server] = {}
        if "aiodist" in systems:
            servers["aiodist"] = stack.enter_context(running(AiodistServer(profile_server)))
        if "tcpstore" in systems:
            servers["tcpstore"] = stack.enter_context(running(TCPStoreMaster(ctx)))
        pool = stack.enter_context(worker_pool(ctx, workers))
        for system in systems:  # warm-up: first connections, lazy imports, thread pools
            if pool.run(system, servers[system].port, min(sizes), timeout).wall is None:
                _restart(servers[system])
        for n in sizes:
            runs: dict[System, list[RunResult]] = {s: [] for s in systems}
            k = repeats or default_repeats(n)
            for i in range(k):
                # Alternate which system goes first, so neither always runs on a warmer machine.
                for system in systems if i % 2 == 0 else systems[::-1]:
                    if any(r.wall is None for r in runs[system]):
                        continue  # it failed or timed out at this size: skip its remaining repeats
                    result = pool.run(system, servers[system].port, n, timeout)
                    runs[system].append(result)
                    if result.wall is None:
                        # A failed server may still be busy; it must not slow the other system.
                        _restart(servers[system])
                    shown = (
                        f"{_ms(result.wall)} ms"
                        if result.wall is not None
                        else f"FAILED: {result.error[:160]}"
                    )
                    print(f"  N={n:<5} {system:<8} run {i + 1}/{k}: {shown}", flush=True)
            results.append(_size_result(n, runs))
    return {
        "config": {
            "sizes": list(sizes),
            "repeats": repeats,
            "systems": systems,
            "workers": workers,
            "timeout_s": timeout,
            "host": HOST,
            "environment_overrides": {k: os.environ.get(k) for k in DNS_WORKAROUND},
            "aiodist_loop": "uvloop",
            "tcpstore": {"use_libuv": True, "clients": "threads"},
        },
        "phases": list(PHASES),
        "results": results,
    }


def _size_result(n: int, runs: dict[System, list[RunResult]]) -> dict[str, Any]:
    out: dict[str, Any] = {"world_size": n}
    for system, rs in runs.items():
        walls = [r.wall for r in rs if r.wall is not None]
        summary = summarize(walls)
        out[system] = {
            "wall_s": walls,
            "summary_s": summary,
            "phases_s": {
                name: summarize([r.phases[i] for r in rs if r.wall is not None])
                for i, name in enumerate(PHASES)
            },
            "errors": [r.error for r in rs if r.error],
        }
    aio = out.get("aiodist", {}).get("summary_s")
    tcp = out.get("tcpstore", {}).get("summary_s")
    out["ratio_tcpstore_over_aiodist"] = (
        tcp.median / aio.median if aio is not None and tcp is not None else None
    )
    return out


def render(data: dict[str, Any]) -> str:
    """The summary table and the per-phase table."""
    rows = []
    phase_rows = []
    for res in data["results"]:
        n = res["world_size"]
        cells: list[str] = [str(n)]
        for system in SYSTEMS:
            if system not in res:
                cells += ["not run", "-"]
                continue
            s = res[system]["summary_s"]
            if s is None:
                errors = res[system]["errors"]
                kind = errors[0].split(":")[0].rsplit(".", 1)[-1] if errors else "failed"
                cells += [kind, "-"]
            else:
                cells += [_ms(s.median), s.spread(1e3)]
            phases = res[system]["phases_s"]
            phase_rows.append(
                [str(n), system]
                + [_ms(phases[p].median if phases[p] else None) for p in data["phases"]]
            )
        ratio = res["ratio_tcpstore_over_aiodist"]
        cells.append("-" if ratio is None else f"{ratio:.1f}x")
        rows.append(cells)
    main = format_table(
        [
            "N",
            "aiodist median (ms)",
            "aiodist min-max",
            "TCPStore median (ms)",
            "TCPStore min-max",
            "TCPStore/aiodist",
        ],
        rows,
    )
    phases = format_table(["N", "system", *(f"{p} (ms)" for p in data["phases"])], phase_rows)
    return (
        f"{main}\n\nWhen the last client finished each step (median, ms after the start):\n{phases}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks.bench_rendezvous``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_rendezvous", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=None, metavar="N")
    parser.add_argument("--repeats", type=int, default=None, metavar="K")
    parser.add_argument("--quick", action="store_true", help="N=16,128 with 2 repeats")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    parser.add_argument("--timeout", type=float, default=DEFAULT_RUN_TIMEOUT, metavar="SECONDS")
    parser.add_argument(
        "--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="what to run"
    )
    parser.add_argument(
        "--no-dns-workaround",
        action="store_true",
        help=f"do not set {' '.join(f'{k}={v}' for k, v in DNS_WORKAROUND.items())}",
    )
    parser.add_argument(
        "--profile-server", metavar="PATH", help="run `aiodist serve` under cProfile, write PATH"
    )
    args = parser.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    repeats = args.repeats or (QUICK_REPEATS if args.quick else None)
    if min(sizes) < 1 or args.workers < 1 or (repeats is not None and repeats < 1):
        parser.error("sizes, --repeats and --workers must be >= 1")
    if not args.no_dns_workaround:
        for key, value in DNS_WORKAROUND.items():
            os.environ.setdefault(key, value)  # spawned processes inherit it
    # Each server holds one socket per client; children inherit the limit.
    fds = raise_fd_limit(2 * max(sizes) + 1024)
    if fds < max(sizes) + 64:
        print(f"warning: only {fds} file descriptors allowed; large N may fail", file=sys.stderr)
    print(
        f"rendezvous of N clients over {args.workers} worker processes, sizes {list(sizes)}"
        + ("" if args.no_dns_workaround else f" ({DNS_WORKAROUND}, see DNS_WORKAROUND)"),
        flush=True,
    )
    data = bench(
        sizes,
        repeats,
        systems=args.systems,
        workers=args.workers,
        timeout=args.timeout,
        profile_server=args.profile_server,
    )
    path = write_results("rendezvous", data)
    print()
    print(render(data))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
