"""Running test workers as real processes: to their end, within a limit, none left behind."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from tests.helpers.warm import Proc, open_process

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "Finished",
    "alive",
    "free_port",
    "json_lines",
    "last_reports",
    "reports_by_rank",
    "run",
    "run_job",
]


# Ports below the kernel's ephemeral range, a slice for each pytest-xdist worker.
PORT_BASE, PORTS_PER_WORKER, WORKER_SLICES = 20000, 2000, 6
# From a random place in the slice: two test sessions at once on one machine rarely meet.
_next_port = itertools.count(random.randrange(PORTS_PER_WORKER))


def free_port() -> int:
    """A port nothing listens on now, from this test process's own slice of ports.

    The kernel's ``bind(port 0)`` hands a port it just handed out (and that was
    closed again) to the next process that asks: two workers starting tests at
    once got the same port for servers their children bind seconds later, and
    one's TCPStore clients talked to the other's aiodist server. A slice per
    worker, taken in turn, is never another worker's.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = PORT_BASE + (int(worker) % WORKER_SLICES if worker.isdecimal() else 0) * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        port = base + next(_next_port) % PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))  # also taken when something listens on any address
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {base}..{base + PORTS_PER_WORKER - 1}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; its parent reaps it


def json_lines(stdout: str) -> list[dict[str, Any]]:
    """The lines of ``stdout`` that are JSON objects (workers report on one line each)."""
    out = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a dict printed by Python, not a report
    return out


def reports_by_rank(stdout: str) -> dict[int, dict[str, Any]]:
    """The workers' reports by rank (a worker that failed early may report no rank)."""
    return {r["rank"]: r for r in json_lines(stdout) if "rank" in r}


@dataclass
class Finished:
    """A process that ran to its end."""

    returncode: int
    stdout: str
    stderr: str


def last_reports(start: Callable[[int], Proc], world: int, timeout: float) -> list[Any]:
    """Start ``world`` ranks (``start(rank)``); their last lines of output as JSON, in rank order.

    Every rank must exit 0 within ``timeout`` s. Whatever happens, no process is
    left running.
    """
    procs: list[Proc] = []
    try:
        procs.extend(start(rank) for rank in range(world))
        reports = []
        for rank, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{stderr}"
            reports.append(json.loads(stdout.strip().splitlines()[-1]))
        return reports
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


async def run(
    argv: list[str], limit: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Finished:
    """Run ``argv`` to its end within ``limit`` s; whatever happens, leave no process behind.

    Workers print ``{"pid": ...}`` lines: ranks that ``aiodist run`` started (each in
    a session of its own) are killed by pid if they outlive it.

    Raises:
        AssertionError: It ran past ``limit``; the message holds what it printed.
    """
    pids: set[int] = set()
    data = {"stdout": bytearray(), "stderr": bytearray()}

    async def drain(stream: Any, name: str) -> None:
        async for chunk in stream:
            data[name] += chunk
            if name == "stdout":  # complete lines only
                text = data[name][: data[name].rfind(b"\n") + 1].decode(errors="replace")
                pids.update(r["pid"] for r in json_lines(text) if "pid" in r)

    proc = await open_process(argv, env={**os.environ, **(env or {})}, cwd=cwd)
    returncode: int | None = None
    try:
        with anyio.move_on_after(limit):
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain, proc.stdout, "stdout")
                tg.start_soon(drain, proc.stderr, "stderr")
            returncode = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.terminate()  # aiodist run passes it on to its ranks
            with anyio.move_on_after(5, shield=True):
                await proc.wait()
        if proc.returncode is None:
            proc.kill()
        with anyio.CancelScope(shield=True):
            await proc.aclose()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    out, err = data["stdout"].decode(errors="replace"), data["stderr"].decode(errors="replace")
    if returncode is None:
        raise AssertionError(
            f"{argv} ran past {limit:g} s; its stdout ends:\n{out[-3000:]}\n"
            f"its stderr ends:\n{err[-5000:]}"
        )
    return Finished(returncode, out, err)


async def run_job(
    argv: list[str], world: int, limit: float, env: dict[str, str] | None = None
) -> list[Finished]:
    """Run ``world`` ranks of ``argv`` (forked warm) as one job, each to its end within ``limit``.

    Each rank gets what torchrun gives it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``), so ``init_process_group()`` forms the job with
    rank 0 hosting the server: for tests whose subject is the job, not the launcher
    (``aiodist run`` costs a server process importing torch per job). Ranks by rank.
    """
    port = str(free_port())
    done: dict[int, Finished] = {}

    async def one(rank: int) -> None:
        rank_env = {
            **(env or {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        done[rank] = await run(argv, limit, rank_env)

    async with anyio.create_task_group() as tg:
        for rank in range(world):
            tg.start_soon(one, rank)
    return [done[rank] for rank in range(world)]
