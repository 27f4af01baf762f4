"""The worker processes of ``bench_rendezvous``: N clients of either system, released together.

The parent hands each worker its share of the ranks (a ``RunSpec``); the
worker prepares them (aiodist clients as tasks on one uvloop loop, TCPStore
clients as threads), reports ready, waits at a barrier with the others, and
stamps when its last client finished each phase on the machine-wide monotonic
clock (``WorkerReport``).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Final, Literal

from benchmarks._common import now
from benchmarks._servers import HOST, STARTUP_TIMEOUT, recv, stop_process

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from multiprocessing.connection import Connection
    from multiprocessing.context import ForkServerContext, ForkServerProcess
    from multiprocessing.synchronize import Barrier

__all__ = ["PHASES", "SYSTEMS", "RunResult", "System", "WorkerPool", "worker_pool"]

System = Literal["aiodist", "tcpstore"]

SYSTEMS: Final[tuple[System, ...]] = ("aiodist", "tcpstore")
# Extra seconds the parent waits beyond a run's timeout before it gives up on a worker.
GRACE: Final = 15.0
PHASES: Final = ("join", "set", "wait", "barrier")


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


# --- the parent's side ------------------------------------------------------------------------


class WorkerPool:
    """``size`` spawned worker processes and the barrier that releases them together."""

    def __init__(self, ctx: ForkServerContext, size: int) -> None:
        self._ctx = ctx
        self.size = size
        self._procs: list[ForkServerProcess] = []
        self._conns: list[Connection] = []
        self._barrier: Barrier | None = None
        self._up = False

    def start(self) -> None:
        """Spawn the workers; they import torch and aiodist while the caller goes on."""
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

    def wait_up(self) -> None:
        """Return once every worker has its imports done and waits for runs."""
        if self._up:
            return
        deadline = now() + STARTUP_TIMEOUT
        for conn in self._conns:
            if recv(conn, deadline, "start-up message") != "up":
                raise RuntimeError("a worker sent an unexpected start-up message")
        self._up = True

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(2)
            stop_process(proc)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._barrier, self._up = [], [], None, False

    def restart(self) -> None:
        self.close()
        self.start()
        self.wait_up()

    def run(self, system: System, port: int, world_size: int, timeout: float) -> RunResult:
        """Run N clients of ``system`` spread over the pool; restart the pool on failure."""
        assert self._barrier is not None
        self.wait_up()
        tag = f"bench-{system}-{world_size}-{uuid.uuid4().hex[:12]}"
        workers = min(self.size, world_size)
        try:
            for w, conn in enumerate(self._conns):
                ranks = tuple(range(w, world_size, workers)) if w < workers else ()
                conn.send(RunSpec(system, HOST, port, tag, world_size, ranks, timeout))
            deadline = now() + STARTUP_TIMEOUT
            for conn in self._conns:
                if recv(conn, deadline, "ready message") != "ready":
                    raise RuntimeError("a worker sent an unexpected ready message")
            # Every worker is prepared and waits at the barrier; the clock starts now.
            start = now()
            self._barrier.wait(GRACE)
            deadline = start + timeout + GRACE
            reports: list[WorkerReport] = [recv(conn, deadline, "report") for conn in self._conns]
        except (OSError, EOFError, TimeoutError, RuntimeError, threading.BrokenBarrierError) as exc:
            self.restart()
            return RunResult(None, [math.nan] * len(PHASES), _describe(exc))
        errors = [r.error for r in reports if r.error]
        if errors:
            self.restart()  # a worker may still hold stuck clients
            return RunResult(None, [math.nan] * len(PHASES), errors[0])
        phases = [max(r.phases[i] for r in reports[:workers]) - start for i in range(len(PHASES))]
        return RunResult(phases[-1], phases)


@contextlib.contextmanager
def worker_pool(ctx: ForkServerContext, size: int) -> Iterator[WorkerPool]:
    pool = WorkerPool(ctx, size)
    try:
        pool.start()
        yield pool
    finally:
        pool.close()
