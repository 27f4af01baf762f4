"""The fault matrix: workloads x faults x shared memory, each cell in real processes.

A cell starts ``aiodist serve --state-dir`` and a job of ``WORLD`` ranks
(``matrix_worker.py``, one process each), lets the workload warm up, injects its
fault, lets the survivors go on, then tells every rank where to stop. It checks:

- every value right (each rank checks every value it receives, drawn from the seed);
- every acknowledged write kept (the store workload: each survivor reads back every
  write any rank had acknowledged, the dead rank's too);
- every failure named on every survivor (``RankFailedError`` with the victim's
  ``.rank``) within ``2 x HB`` of the fault, or of the daemon's return when the rank
  died while it was away (``AWAY_ALLOWANCE`` more: the daemon's own verdict is due
  exactly then); no notice at all where nobody failed;
- no hang: each phase has a limit, and every process is killed on the way out.

Workloads: ``p2p`` (a ring of isend/irecv, tensors and objects of every size
threshold, several in flight per peer), ``collectives`` (all_reduce, broadcast,
all_gather_object; shrink_group after a failure), ``store`` (set, get, delete_key,
add), ``elastic`` (a job that grew by one newcomer before the fault, collectives,
the state broadcast at every regroup and shrink), ``rpc`` (calls around a ring,
the lowest rank calling every rank; rpc.shutdown at the end).

Faults: ``kill9`` (SIGKILL a rank), ``sigstop`` (SIGSTOP a rank until every survivor
named it), ``restart`` (SIGKILL the daemon, start it again on its port and state
directory), ``away`` (SIGKILL the daemon, then a rank, then start the daemon again),
``newcomer`` (a process joins the job; every rank regroups with it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Final

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream

from tests.helpers import ROOT
from tests.helpers.daemon import TOKEN, serve, token_file
from tests.helpers.matrix_worker import FIRST_CREDIT
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from anyio.abc import Process

    from tests.helpers.daemon import Daemon

__all__ = [
    "FAULTS",
    "HB",
    "WORKLOADS",
    "Cell",
    "Outcome",
    "cells",
    "run_cell",
]

WORKLOADS: Final = ("p2p", "collectives", "store", "elastic", "rpc")
FAULTS: Final = ("kill9", "sigstop", "restart", "away", "newcomer")
#: Faults that kill (or freeze) one rank: its failure must be named on every survivor.
RANK_FAULTS: Final = ("kill9", "sigstop", "away")
WORLD: Final = 3  # odd: catches ring bugs; small: two cores run a cell
# The heartbeat timeout: long enough that a rank starved of CPU on two loaded cores (a
# loop stalled for 2.3 s was seen at a load of 12) is not declared failed, short enough
# that a frozen rank is named within seconds.
HB: Final = 4.0
INTERVAL: Final = 0.25  # between heartbeats
WARM: Final = 5  # rounds every rank runs at least before the fault, and after it
# Limits of each phase (seconds): generous, for two loaded cores; a phase past its limit
# is a hang.
START_LIMIT: Final = 90.0
NOTICE_GRACE: Final = 20.0
# A rank that died while the daemon was away can be declared only once the daemon is back:
# the daemon waits 2 x HB (at least 5 s) after its start for it to re-attach
# (docs/operations/daemon.md), so that notice is due 2 x HB after the daemon's return,
# and this much more for the notice to reach the survivors.
AWAY_ALLOWANCE: Final = 1.0  # after 2 x HB: how late a notice still counts as late (not never)
PHASE_LIMIT: Final = 60.0
END_LIMIT: Final = 120.0

#: A rank declared failed because its own event loop stood still that long: the machine
#: was starved of CPU (the daemon was right), not a fault of the cell's.
OVERLOAD: Final = "its event loop stopped for"


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix."""

    workload: str
    fault: str
    shm: bool
    seed: int = 0

    @property
    def name(self) -> str:
        return f"{self.workload}/{self.fault}/{'shm' if self.shm else 'noshm'}"

    @property
    def victim(self) -> int | None:
        """The job rank the fault kills or freezes (None: the fault kills no rank).

        It rotates over the ranks with the fault, the shared-memory setting and the seed,
        so that rank 0 (rpc's shutdown coordinator) and the elastic job's grown rank are
        among the victims of every seed.
        """
        if self.fault not in RANK_FAULTS:
            return None
        ranks = WORLD + (1 if self.workload == "elastic" else 0)  # the grown rank too
        return (self.seed + 2 * FAULTS.index(self.fault) + self.shm) % ranks

    @property
    def max_world(self) -> int:
        """0 for a job that does not grow; else the most ranks it admits."""
        grows = (self.workload == "elastic") + (self.fault == "newcomer")
        return WORLD + grows if grows else 0


def cells(seed: int = 0) -> list[Cell]:
    return [Cell(w, f, shm, seed) for w in WORKLOADS for f in FAULTS for shm in (True, False)]


@dataclass
class Outcome:
    """What a cell showed."""

    cell: Cell
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    notice_s: float | None = None  # the latest survivor's time to the failure notice
    values: int = 0
    writes: int = 0
    seconds: float = 0.0
    logs: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def result(self) -> str:
        if self.ok:
            return "pass"
        if any(OVERLOAD in p for p in self.problems):
            return "OVERLOAD"  # inconclusive: run it again on a quieter machine
        hang = any(p.startswith("hang") for p in self.problems)
        return "HANG" if hang else "FAIL"

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cell"] = self.cell.name
        out["seed"] = self.cell.seed
        out["victim"] = self.cell.victim
        out["result"] = self.result
        return out


class Stop(Exception):
    """The cell cannot go on: a rank gave up or died, or a phase hung."""


class Hang(Stop):
    """A phase did not end within its limit."""


class Rank:
    """A worker process: its events (each with the time it was read), its stdin."""

    def __init__(self, proc: Process, label: str, err: Path) -> None:
        self.proc, self.label, self.err = proc, label, err
        self.rank: int | None = None
        self.events: list[dict[str, Any]] = []
        self.progress: dict[int, int] = {}  # era -> the last round done
        self.era = 0
        self.eof = False
        self.victim = False

    def __repr__(self) -> str:
        return self.label if self.rank is None else f"rank {self.rank}"

    def last(self, ev: str) -> dict[str, Any] | None:
        return next((e for e in reversed(self.events) if e["ev"] == ev), None)

    def all(self, ev: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == ev]

    def rounds_since(self, era: int, t: float) -> int:
        return sum(
            1 for e in self.events if e["ev"] == "progress" and e["era"] == era and e["_t"] > t
        )

    async def send(self, cmd: dict[str, Any]) -> None:
        if self.eof or self.proc.returncode is not None or self.proc.stdin is None:
            return
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self.proc.stdin.send((json.dumps(cmd) + "\n").encode())

    def stderr_tail(self, lines: int = 12) -> str:
        try:
            text = self.err.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


class CellRun:
    """One run of one cell."""

    def __init__(self, cell: Cell, workdir: Path, rounds: int) -> None:
        self.cell = cell
        self.rounds = rounds
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.ranks: list[Rank] = []
        self.changed = anyio.Event()
        self.granted: dict[int, int] = {}
        self.closed_eras: set[int] = set()  # eras with a finish or regroup: no more credit
        self.daemon: Daemon | None = None
        self.daemons: contextlib.AsyncExitStack | None = None
        self.port = 0
        self.daemons_started = 0
        self.out = Outcome(cell)
        self.t_fault: float | None = None
        self.t_back: float | None = None  # the daemon came back
        self.finishing = False
        self.notices_awaited = False
        self.t_stop = float("inf")  # when the cell stopped early: later events are its doing
        self.tg: Any = None

    # --- processes ----------------------------------------------------------------------

    def notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
        env.update({"AIODIST_TOKEN": TOKEN, "AIODIST_SHM": "1" if self.cell.shm else "0"})
        env["AIODIST_DUMP_DIR"] = str(self.workdir)  # flight recorders, on SIGUSR1
        return env

    async def spawn(self, rank: int) -> Rank:
        cfg = {
            "url": f"tcp://127.0.0.1:{self.port}",
            "job": "matrix",
            "workload": self.cell.workload,
            "rank": rank,
            "world": WORLD,
            "max_world": self.cell.max_world,
            "hb": HB,
            "interval": INTERVAL,
            "seed": self.cell.seed,
            "fault": self.cell.fault,
        }
        label = f"rank {rank}" if rank >= 0 else f"newcomer {len(self.ranks) - WORLD + 1}"
        err = self.workdir / f"{label.replace(' ', '')}.stderr.txt"
        argv = [sys.executable, "-m", "tests.helpers.matrix_worker", json.dumps(cfg)]
        with err.open("wb") as stderr:  # a local file: opening it does not block
            proc = await open_process(argv, cwd=ROOT, env=self.env(), stderr=stderr)
        r = Rank(proc, label, err)
        if rank >= 0:
            r.rank = rank
        self.ranks.append(r)
        self.tg.start_soon(self.read, r)
        return r

    async def read(self, r: Rank) -> None:
        assert r.proc.stdout is not None
        stream = BufferedByteReceiveStream(r.proc.stdout)
        with (self.workdir / f"{r.label.replace(' ', '')}.events.jsonl").open("w") as log:
            while True:
                try:
                    line = await stream.receive_until(b"\n", 1 << 24)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError):
                    break
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                event["_t"] = time.time()
                log.write(json.dumps(event) + "\n")
                r.events.append(event)
                if event["ev"] == "up":
                    r.rank = event["rank"]
                elif event["ev"] == "progress":
                    r.era = event["era"]
                    r.progress[event["era"]] = event["round"]
                elif event["ev"] == "era":
                    r.era = event["era"]
                self.notify()
        r.eof = True
        self.notify()

    def live(self) -> list[Rank]:
        """The ranks that should be running: not the victim."""
        return [r for r in self.ranks if not r.victim]

    def by_rank(self, rank: int) -> Rank:
        return next(r for r in self.ranks if r.rank == rank)

    # --- the daemon ----------------------------------------------------------------------

    async def start_daemon(self) -> None:
        assert self.daemons is not None
        args = ["--port", str(self.port), "--token-file", str(token_file(self.workdir))]
        args += ["--state-dir", str(self.workdir / "state")]
        self.daemon = await self.daemons.enter_async_context(serve(*args))
        self.daemons_started += 1
        self.port = self.daemon.port
        self.t_back = time.time()

    async def kill_daemon(self) -> None:
        assert self.daemon is not None
        self.save_daemon_log()
        self.daemon.proc.send_signal(signal.SIGKILL)
        await self.daemon.proc.wait()

    def save_daemon_log(self) -> None:
        if self.daemon is not None:
            path = self.workdir / f"daemon{self.daemons_started}.txt"
            path.write_text(self.daemon.output())

    # --- waiting ------------------------------------------------------------------------

    def where(self) -> str:
        parts = []
        for r in self.ranks:
            state = "killed" if r.victim else ("exited" if r.eof else "running")
            at = f"era {r.era} round {r.progress.get(r.era, -1)}"
            parts.append(f"{r!r}: {state}, {at}")
        return "; ".join(parts)

    async def until(self, what: str, cond: Callable[[], bool], limit: float) -> None:
        with anyio.move_on_after(limit):
            while not cond():
                self.check_alive()
                await self.changed.wait()
            return
        raise Hang(f"hang: {what} not within {limit:.0f} s ({self.where()})")

    def check_alive(self) -> None:
        for r in self.live():
            fatal = r.last("fatal")
            if fatal is not None:
                raise Stop(f"{r!r} could not go on: {fatal['what'][:600]}")
            if r.eof and not self.finishing:
                raise Stop(f"{r!r} exited early ({r.proc.returncode}): {r.stderr_tail()}")

    # --- credit and commands ------------------------------------------------------------

    async def credit(self) -> None:
        """Keep every era's credit a few rounds ahead of its fastest rank."""
        while True:
            for era in {r.era for r in self.live()} - self.closed_eras:
                top = max((r.progress.get(era, -1) for r in self.live()), default=-1)
                if self.granted.get(era, FIRST_CREDIT) - top < 8:
                    self.granted[era] = top + 15
                    for r in self.live():
                        await r.send({"cmd": "credit", "era": era, "upto": self.granted[era]})
            await anyio.sleep(0.1)

    def stop_at(self, era: int) -> int:
        """The round of ``era`` every rank can stop at: the credit, which none passed."""
        self.closed_eras.add(era)
        return self.granted.get(era, FIRST_CREDIT)

    def warm(self, era: int, since: float = 0.0) -> Callable[[], bool]:
        return lambda: all(r.rounds_since(era, since) >= self.rounds for r in self.live())

    async def add_newcomer(self, era: int) -> None:
        """A process joins; every rank regroups with it before round N of ``era``."""
        r = await self.spawn(-1)
        await self.until("the newcomer joined", lambda: r.last("up") is not None, START_LIMIT)
        up = r.last("up")
        assert up is not None
        cmd = {"cmd": "regroup", "era": era, "at": self.stop_at(era), "epoch": up["epoch"]}
        for x in self.live():
            await x.send(cmd)
        await self.until(
            f"every rank regrouped with rank {r.rank}",
            lambda: all(x.era > era for x in self.live()),
            PHASE_LIMIT,
        )

    # --- the scenario --------------------------------------------------------------------

    async def scenario(self) -> None:
        cell = self.cell
        await self.start_daemon()
        for rank in range(WORLD):
            await self.spawn(rank)
        self.tg.start_soon(self.credit)
        await self.until("every rank warmed up", self.warm(0), START_LIMIT)
        era = 0
        if cell.workload == "elastic":  # a grown job: one newcomer before the fault
            await self.add_newcomer(era)
            era += 1
            await self.until("every rank warmed up in the grown job", self.warm(era), PHASE_LIMIT)
        await anyio.sleep(random.Random(cell.name).uniform(0, 0.2))  # lands anywhere in a round
        await self.fault(era)
        if cell.fault != "restart":
            era += 1
        since = self.t_back if cell.fault == "restart" and self.t_back else 0.0
        await self.until("every rank went on after the fault", self.warm(era, since), PHASE_LIMIT)
        await self.finish(era)

    async def fault(self, era: int) -> None:
        cell = self.cell
        victim = None
        if cell.victim is not None:
            victim = self.by_rank(cell.victim)
            victim.victim = True
        self.t_fault = time.time()
        if cell.fault == "kill9":
            assert victim is not None
            os.kill(victim.proc.pid, signal.SIGKILL)
            await self.await_notices(self.t_fault)
        elif cell.fault == "sigstop":
            assert victim is not None
            os.kill(victim.proc.pid, signal.SIGSTOP)
            try:
                await self.await_notices(self.t_fault)
            finally:
                os.kill(victim.proc.pid, signal.SIGKILL)
        elif cell.fault == "restart":
            await self.kill_daemon()
            await self.start_daemon()
        elif cell.fault == "away":
            assert victim is not None
            await self.kill_daemon()
            os.kill(victim.proc.pid, signal.SIGKILL)
            await victim.proc.wait()
            await self.start_daemon()
            assert self.t_back is not None
            await self.await_notices(self.t_back)
        elif cell.fault == "newcomer":
            await self.add_newcomer(era)

    async def await_notices(self, since: float) -> None:
        """Until every survivor named a failure (late ones are measured, then judged)."""

        def told() -> bool:
            return all(r.last("notice") is not None for r in self.live())

        with contextlib.suppress(Hang):
            await self.until("every survivor told", told, 2 * HB + NOTICE_GRACE)
        self.notices_awaited = True

    async def finish(self, era: int) -> None:
        acked: dict[str, dict[str, int]] = {}
        for r in self.ranks:
            if r.rank is not None:
                acked[str(r.rank)] = {str(e): n for e, n in r.progress.items()}
        at = self.stop_at(era)
        self.finishing = True
        for r in self.live():
            await r.send({"cmd": "finish", "era": era, "at": at, "acked": acked})
        # Only the live ranks' own progress after this moment is not in ``acked``: the
        # ranks stop at ``at``; every round they ran is theirs to check.
        for r in self.live():
            acked[str(r.rank)][str(era)] = at - 1
        await self.until("every rank ended", lambda: all(r.eof for r in self.live()), END_LIMIT)
        for r in self.live():
            await r.proc.wait()

    # --- judging ------------------------------------------------------------------------

    def judge(self) -> None:
        out = self.out
        for r in self.live():
            final = r.last("final")
            if final is not None:
                out.values += final["values"]
                out.writes += final["writes"]
                out.notes += [f"{r!r}: {n}" for n in final["notes"]]
                out.problems += [f"{r!r}: {p}" for p in final["problems"]]
                if final["problem_count"] > len(final["problems"]):
                    more = final["problem_count"] - len(final["problems"])
                    out.problems.append(f"{r!r}: ... and {more} more problems")
                if r.proc.returncode != 0:
                    out.problems.append(f"{r!r}: exit code {r.proc.returncode}: {r.stderr_tail()}")
            else:  # stopped before its end: its checks so far
                last = r.last("fatal") or r.last("progress")
                out.values += last.get("values", 0) if last else 0
                out.problems += [f"{r!r}: {e['what']}" for e in r.all("problem")]
                if self.finishing and self.t_stop == float("inf"):
                    out.problems.append(f"{r!r}: no final report ({self.where()})")
            self.judge_notices(r)
        for log in sorted(self.workdir.glob("daemon*.txt")):
            if "Traceback" in log.read_text():
                out.problems.append(f"the daemon logged a traceback ({log.name})")
        late = [t for r in self.live() if (t := self.notice_time(r)) is not None]
        if late:
            out.notice_s = max(late)

    def notice_time(self, r: Rank) -> float | None:
        """Seconds from the fault (or the daemon's return) to ``r``'s notice of the victim."""
        if self.t_fault is None or r.rank == self.cell.victim:
            return None  # no fault yet: the cell stopped before it
        ref = self.t_back if self.cell.fault == "away" else self.t_fault
        times: list[float] = [
            n["t"]
            for n in r.all("notice")
            if n["rank"] == self.cell.victim
            and n["type"] == "RankFailedError"
            and n["_t"] <= self.t_stop
        ]
        if ref is None or not times:
            return None
        return min(times) - ref

    def judge_notices(self, r: Rank) -> None:
        out, victim = self.out, self.cell.victim
        for n in r.all("notice"):
            if n["_t"] > self.t_stop:
                continue  # the cell was stopping: its own kills
            what = f"{n['type']} ({n['via']}): {n['message'][:240]}"
            if n["type"] != "RankFailedError":
                out.problems.append(f"{r!r}: got {what}")
            elif n["rank"] != victim:
                out.problems.append(
                    f"{r!r}: told rank {n['rank']} failed, not the victim {victim}: {what}"
                )
            elif n["via"] == "probe" and n["peer"] != n["rank"]:
                out.problems.append(
                    f"{r!r}: its receive from rank {n['peer']} (alive) failed with {what}"
                )
        if victim is None or not self.notices_awaited or r.rank is None:
            return
        took = self.notice_time(r)
        limit = 2 * HB + (AWAY_ALLOWANCE if self.cell.fault == "away" else 0.0)
        if took is None:
            out.problems.append(f"{r!r}: never told that rank {victim} failed")
        elif took > limit:
            out.problems.append(
                f"{r!r}: told that rank {victim} failed after {took:.2f} s (limit {limit:.1f} s)"
            )

    async def run(self) -> Outcome:
        started = time.monotonic()
        self.out.logs = str(self.workdir)
        try:
            with anyio.fail_after(START_LIMIT + 3 * PHASE_LIMIT + END_LIMIT + 60):
                async with anyio.create_task_group() as self.tg:
                    async with contextlib.AsyncExitStack() as self.daemons:
                        try:
                            await self.scenario()
                        except BaseException as exc:
                            self.t_stop = time.time()
                            if isinstance(exc, Hang | TimeoutError):
                                await self.dump()
                            raise
                        finally:
                            await self.cleanup()
                            await self.stop_daemon()
                    self.tg.cancel_scope.cancel()
        except Stop as exc:
            self.out.problems.insert(0, str(exc))
        except TimeoutError:
            self.out.problems.append(f"hang: the cell ran past its limit ({self.where()})")
        except BaseExceptionGroup as group:  # a Stop from inside the task groups
            stops = _stops(group)
            if stops is None:
                raise
            self.out.problems[:0] = [str(e) for e in stops]
        self.judge()
        self.out.problems = list(dict.fromkeys(self.out.problems))  # each once, in order
        self.out.seconds = time.monotonic() - started
        return self.out

    async def dump(self) -> None:
        """Where each live rank waits: its tasks (stderr) and its flight recorder."""
        with anyio.CancelScope(shield=True):
            for r in self.live():
                if r.proc.returncode is None:
                    for sig in (signal.SIGUSR2, signal.SIGUSR1):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(r.proc.pid, sig)
            await anyio.sleep(1.5)

    async def stop_daemon(self) -> None:
        with anyio.CancelScope(shield=True):
            self.save_daemon_log()
            if self.daemon is not None and self.daemon.proc.returncode is None:
                rc = await self.daemon.stop()
                if rc != 0:
                    self.out.problems.append(f"the daemon exited with {rc} on SIGTERM")
                self.save_daemon_log()

    async def cleanup(self) -> None:
        with anyio.CancelScope(shield=True):
            for r in self.ranks:
                if r.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(r.proc.pid, signal.SIGKILL)
                with anyio.move_on_after(10):
                    await r.proc.wait()
                await r.proc.aclose()


def _stops(exc: BaseException) -> list[Stop] | None:
    """The ``Stop``s in ``exc`` (nested groups flattened); None if it holds anything else."""
    if isinstance(exc, Stop):
        return [exc]
    if not isinstance(exc, BaseExceptionGroup):
        return None
    out: list[Stop] = []
    for inner in exc.exceptions:
        stops = _stops(inner)
        if stops is None:
            return None
        out += stops
    return out


async def run_cell(cell: Cell, workdir: Path, rounds: int = WARM) -> Outcome:
    """Run ``cell`` with its logs in ``workdir``: what it showed.

    Every rank runs at least ``rounds`` rounds before the fault, and as many after it.
    """
    return await CellRun(cell, workdir, rounds).run()
