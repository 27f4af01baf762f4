"""``aiodist run``: find or host the rendezvous server, start the ranks, supervise them.

Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``) so that ``init_process_group()`` with no
arguments just works. Where the server is, see ``placement``: node 0 hosts the
job's own, or ``--rdzv-endpoint`` joins a shared one (a daemon). On one node,
the launcher also hosts torch's store, as torchrun's agent does
(``agent_store``): ``MASTER_ADDR:MASTER_PORT`` is that store
(``TORCHELASTIC_USE_AGENT_STORE=True``), so a torch script's own
``init_process_group`` runs unchanged, and aiodist's server is at
``AIODIST_SERVER``.

Rules the supervisor keeps:

- Each rank's output is written as it comes, prefixed with its rank unless
  prefixes are off (``output``); stdout goes to stdout, stderr to stderr.
- The first rank to exit non-zero fails the run: the others are stopped
  (SIGTERM, then SIGKILL after ``STOP_GRACE``). With ``--max-restarts K`` the
  launcher then starts all its ranks again, up to K times, each start a new
  generation of the job (``TORCHELASTIC_RESTART_COUNT``, which the server
  knows); otherwise, or once the restarts are spent, it exits with that
  rank's code (128 + N for signal N) and a one-line summary.
- SIGINT and SIGTERM are forwarded to every rank (each runs in its own process
  group, so a terminal's Ctrl-C reaches it once); a second one kills them.
  A run stopped by a signal is never restarted.
- A launcher that hosts the server keeps it up after its own ranks end until
  the other jobs on it (other nodes' ranks, other launches) have left (at most
  ``SERVER_LINGER``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Final

import anyio

from aiodist import _settings
from aiodist._errors import counted
from aiodist._launch.agent_store import AgentStore
from aiodist._launch.forkserver import START_METHODS, Forked, ForkServer
from aiodist._launch.output import Sink, pump
from aiodist._launch.placement import failure_suspects, parse_endpoint, place_server
from aiodist._launch.replace import (
    MAX_START_FAILURES,
    WATCH_INTERVAL,
    JobWatch,
    start_backoff,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from aiodist._server.serve import RendezvousServer

logger = logging.getLogger(__name__)

STOP_GRACE: Final = 5.0
RankProcess = asyncio.subprocess.Process | Forked  # a rank exec'd, or forked (forkserver.py)
DEFAULT_MAX_REPLACEMENTS: Final = 16
SERVER_LINGER: Final = 60.0
PUMP_DRAIN: Final = 2.0  # after the ranks exit, how long their last output may take
CULPRIT_GRACE: Final = 2.0  # how long the rank that failed first may take to exit


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What ``aiodist run`` starts.

    Attributes:
        cmd: The command of one rank (``[python, script, *args]``).
        nproc: Ranks on this node.
        nnodes: Nodes in the job; each runs one launcher.
        node_rank: This node's index; without ``rdzv_endpoint``, node 0 hosts the server.
        master_addr: Address of the server node 0 hosts ("": 127.0.0.1 for one
            node, else this host's address that other hosts reach).
        master_port: Its port; 0 lets node 0's OS pick one (single node, or
            node 0 of several, which reports it for the others).
        rdzv_endpoint: ``HOST:PORT`` of a shared server to join (hosted here when
            nothing listens there and HOST is this host's).
        job_id: The job's name on the server (default: a fresh one per launch
            for one node, ``run-<port>`` for several).
        max_restarts: Times the ranks are all started again after a failure.
        token: The token the server requires (default ``$AIODIST_TOKEN``);
            the ranks get it as ``AIODIST_TOKEN``.
        prefix: Prefix each output line with the rank.
        max_nnodes: torchrun's ``--nnodes MIN:MAX``: ``nnodes`` is MIN, and the job
            is elastic up to this many nodes (0: not elastic). The nodes past MIN
            join the formed job: their ranks get the next free ranks.
        replace_failed: Start a replacement for a rank that fails, without
            stopping the others; the job is elastic, and the replacement joins
            it with the next free rank (at most ``max_replacements`` in all).
        max_replacements: How many replacements this launcher starts at most.
        start_method: ``"forkserver"``: a Python rank is forked from one interpreter
            that imported torch once (``forkserver.py``); ``"spawn"``:
            each rank is a fresh interpreter (``exec``), as torchrun starts scripts.
    """

    cmd: list[str]
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0
    rdzv_endpoint: str = ""
    job_id: str = ""
    max_restarts: int = 0
    token: str | None = None
    prefix: bool = True
    max_nnodes: int = 0
    replace_failed: bool = False
    max_replacements: int = DEFAULT_MAX_REPLACEMENTS
    start_method: str = START_METHODS[0]

    def __post_init__(self) -> None:
        if self.max_nnodes and self.max_nnodes < self.nnodes:
            raise ValueError(
                f"--nnodes MIN:MAX needs MIN <= MAX, got {self.nnodes}:{self.max_nnodes}"
            )
        if self.max_replacements < 0:
            raise ValueError(f"--max-replacements must be >= 0, got {self.max_replacements}")
        if self.nproc < 1:
            raise ValueError(f"-n/--nproc-per-node must be >= 1, got {self.nproc}")
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"--start-method must be one of {', '.join(START_METHODS)}, "
                f"got {self.start_method!r}"
            )
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < max(self.nnodes, self.max_nnodes):
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"--master-port must be in [0, 65535], got {self.master_port}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.rdzv_endpoint:
            parse_endpoint(self.rdzv_endpoint)
            if self.master_addr or self.master_port:
                raise ValueError(
                    "--rdzv-endpoint names the server: leave out --master-addr and --master-port"
                )
            if self.nnodes > 1 and not self.job_id:
                raise ValueError(
                    "--nnodes > 1 with --rdzv-endpoint needs --rdzv-id: every node must name "
                    "the same job, and a name of its own keeps it apart from other jobs there"
                )
        elif self.node_rank > 0 and (self.master_port == 0 or not self.master_addr):
            raise ValueError(
                "--node-rank > 0 needs --master-addr and --master-port: the address node 0's "
                "launcher reported"
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    @property
    def max_world_size(self) -> int:
        """The elastic job's largest size (``AIODIST_MAX_WORLD_SIZE``); 0: not elastic."""
        if self.max_nnodes:
            return self.max_nnodes * self.nproc
        return self.world_size if self.replace_failed else 0

    def joins_late(self) -> bool:
        """This node is past MIN of ``--nnodes MIN:MAX``: its ranks join the formed job."""
        return self.node_rank >= self.nnodes

    def job_name(self, master: tuple[str, int]) -> str:
        """The job's name: ``job_id``, else one every node derives alike, else a fresh one."""
        if self.job_id:
            return self.job_id
        if self.nnodes > 1:  # node 0's own server: its port names the job on every node
            return f"run-{master[1]}"
        return f"run-{uuid.uuid4().hex[:12]}"  # two launches on one daemon never collide


@dataclass(frozen=True, slots=True)
class LaunchResult:
    """How a run ended: the launcher's exit code and, unless all went well, why."""

    exit_code: int
    summary: str | None = None


def rank_env(
    spec: LaunchSpec,
    local_rank: int,
    master: tuple[str, int],
    job_id: str,
    base: Mapping[str, str],
    restart: int = 0,
    *,
    replacement: bool = False,
    agent_store: tuple[str, int] | None = None,
) -> dict[str, str]:
    """The environment of local rank ``local_rank``: ``base`` plus torchrun's variables.

    ``OMP_NUM_THREADS`` defaults to 1 when several ranks share the node, as with
    torchrun. torchrun's own variables from ``base`` (a launcher started inside a
    torchrun worker) are dropped: this job's server is at ``master``, not in
    torchrun's store. With ``agent_store`` (torch's store, hosted by the launcher),
    ``MASTER_ADDR:MASTER_PORT`` is that store, as under torchrun, and the server is
    at ``AIODIST_SERVER``.
    """
    rank = spec.node_rank * spec.nproc + local_rank
    env = {k: v for k, v in base.items() if not k.startswith("TORCHELASTIC_")}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.nproc),
        GROUP_RANK=str(spec.node_rank),
        NODE_RANK=str(spec.node_rank),
        GROUP_WORLD_SIZE=str(spec.nnodes),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
        TORCHELASTIC_RESTART_COUNT=str(restart),
        TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
        AIODIST_JOB_ID=job_id,
        PYTHONUNBUFFERED="1",
    )
    if agent_store is not None:
        env.update(
            MASTER_ADDR=agent_store[0],
            MASTER_PORT=str(agent_store[1]),
            TORCHELASTIC_RUN_ID=job_id,
            TORCHELASTIC_USE_AGENT_STORE="True",
            AIODIST_SERVER=f"{master[0]}:{master[1]}",
        )
    if spec.max_world_size:
        env["AIODIST_MAX_WORLD_SIZE"] = str(spec.max_world_size)
    if replacement or spec.joins_late():
        # It joins the formed elastic job: the server gives it the next free rank.
        for name in ("RANK", "ROLE_RANK"):
            del env[name]
    if spec.token is not None:
        env["AIODIST_TOKEN"] = spec.token
    if spec.nproc > 1:
        # As torchrun does: N ranks each using every core would oversubscribe the node.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _Ranks:
    """This node's rank processes and what happened to them."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.procs: list[RankProcess] = []
        self.signals: list[signal.Signals] = []
        self.changed = asyncio.Event()

    def global_rank(self, i: int) -> int:
        return self.spec.node_rank * self.spec.nproc + i

    def running(self) -> list[RankProcess]:
        return [p for p in self.procs if p.returncode is None]

    def kill(self, sig: int) -> None:
        for p in self.running():
            _kill(p, sig)

    def on_signal(self, sig: signal.Signals) -> None:
        self.signals.append(sig)
        if len(self.signals) == 1:
            logger.info(
                "received %s: forwarding it to %s", sig.name, counted(len(self.running()), "rank")
            )
            self.kill(sig)
        else:
            logger.warning("received %s again: killing the ranks", sig.name)
            self.kill(signal.SIGKILL)
        self.changed.set()

    async def wait_all(
        self, replace: Callable[[int, int], Awaitable[bool | None]] | None = None
    ) -> tuple[int, int] | None:
        """Wait until all ranks exit 0 (None), one fails ((index, code)), or a signal came.

        With ``replace``, a rank that fails is first offered to it (its index and
        code): when it started a replacement in ``procs[index]`` (True), the run
        goes on; None: that rank is done, and no failure of the run.
        """
        waiters = {asyncio.ensure_future(p.wait()): i for i, p in enumerate(self.procs)}
        changed = asyncio.ensure_future(self.changed.wait())
        try:
            while waiters and not self.signals:
                done, _ = await asyncio.wait(
                    [*waiters, changed], return_when=asyncio.FIRST_COMPLETED
                )
                for fut in done:
                    if fut is changed:
                        continue
                    i = waiters.pop(fut)
                    if fut.result() != 0 and not self.signals:
                        handled = None if replace is None else await replace(i, fut.result())
                        if handled:
                            waiters[asyncio.ensure_future(self.procs[i].wait())] = i
                            continue
                        if handled is None and replace is not None:
                            continue
                        return i, fut.result()
            return None
        finally:
            for fut in [*waiters, changed]:
                fut.cancel()

    async def stop(self, grace: float) -> None:
        """Wait up to ``grace`` for ranks that were signalled, then SIGTERM, then SIGKILL."""
        if not self.signals:
            self.kill(signal.SIGTERM)
        with anyio.move_on_after(grace):
            for p in self.procs:
                await p.wait()
        if self.running():
            if self.signals:
                self.kill(signal.SIGTERM)
                with anyio.move_on_after(grace):
                    for p in self.procs:
                        await p.wait()
            self.kill(signal.SIGKILL)
            for p in self.procs:
                await p.wait()


async def launch(
    spec: LaunchSpec,
    *,
    on_server: Callable[[tuple[str, int]], None] | None = None,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
) -> LaunchResult:
    """Run ``spec.cmd`` as this node's ranks and supervise them.

    Args:
        spec: What to start.
        on_server: Called with the server's address once this launcher hosts it.
        stdout: Where ranks' standard output goes (default: ours).
        stderr: Where ranks' standard error goes (default: ours); also where
            each restart is announced.

    Returns:
        Exit code 0 when every rank exited 0; otherwise the failed rank's code
        (128 + N for signal N), or 128 + N when this launcher got signal N.

    Raises:
        OSError: The server cannot bind its address, or the command cannot be started.
        RendezvousError: ``--rdzv-endpoint`` answers, but not as an aiodist
            server, or refuses the token; or no address other hosts reach was found.
    """
    out = Sink(stdout or sys.stdout.buffer)
    err = Sink(stderr or sys.stderr.buffer)
    token = spec.token if spec.token is not None else _settings.TOKEN.read()
    async with anyio.create_task_group() as tg:
        master, server = await place_server(spec, tg, token)
        if server is not None and on_server is not None:
            on_server(master)
        job_id = spec.job_name(master)
        for restart in range(spec.max_restarts + 1):
            ranks = _Ranks(spec)
            blame = None if server is None else functools.partial(failure_suspects, server, job_id)
            # On one node, torch's store for this start, as torchrun's agent hosts it.
            agent = AgentStore("127.0.0.1") if spec.nnodes == 1 and not spec.max_nnodes else None
            if agent is not None:
                agent.serve_on_demand()
            try:
                result = await _run_ranks(
                    spec,
                    ranks,
                    master,
                    job_id,
                    restart,
                    out,
                    err,
                    blame,
                    None if agent is None else agent.address,
                    JobWatch(job_id, server, master, token) if spec.replace_failed else None,
                )
            finally:
                if agent is not None:
                    agent.close()  # kills its process if it started: at once
            if result.exit_code == 0 or ranks.signals or restart == spec.max_restarts:
                break
            err.line(
                f"{result.summary}; restarting all {counted(spec.nproc, 'rank')}{_where(spec)} "
                f"(restart {restart + 1} of {spec.max_restarts})"
            )
        if server is not None:
            await _linger(server, job_id, succeeded=result.exit_code == 0)
        tg.cancel_scope.cancel()
    return result


async def _linger(server: RendezvousServer, job_id: str, *, succeeded: bool) -> None:
    """Keep the server up while other jobs use it (on failure, not for our own job)."""

    def others_gone(s: RendezvousServer) -> bool:
        return all(name == job_id and not succeeded for name in s.state.jobs)

    if others_gone(server):
        return
    with anyio.move_on_after(SERVER_LINGER) as linger:
        await server.wait_until(others_gone)
    if linger.cancelled_caught:
        logger.warning("stopping the rendezvous server while other ranks still use it")


def _where(spec: LaunchSpec) -> str:
    return f" on node {spec.node_rank}" if spec.nnodes > 1 else ""


async def _run_ranks(
    spec: LaunchSpec,
    ranks: _Ranks,
    master: tuple[str, int],
    job_id: str,
    restart: int,
    out: Sink,
    err: Sink,
    blame: Callable[[], list[int]] | None = None,
    agent_store: tuple[str, int] | None = None,
    watch: JobWatch | None = None,
) -> LaunchResult:
    loop = asyncio.get_running_loop()
    width = len(str(spec.world_size - 1))
    failed: tuple[int, int] | None = None
    where = _where(spec)
    forks = ForkServer()  # also takes (and closes) a server this launcher was forked with
    async with anyio.create_task_group() as pumps:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, ranks.on_signal, sig)
            replaced = 0
            generations = [0] * spec.nproc  # replacements started per local rank

            async def start(i: int, replacement: bool = False) -> None:
                env = rank_env(
                    spec,
                    i,
                    master,
                    job_id,
                    os.environ,
                    restart,
                    replacement=replacement,
                    agent_store=agent_store,
                )
                proc: RankProcess | None = None
                if spec.start_method == "forkserver":
                    proc = await forks.start(spec.cmd, env)
                if proc is None:
                    proc = await asyncio.create_subprocess_exec(
                        *spec.cmd,
                        env=env,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE,
                        start_new_session=True,
                    )
                if replacement:
                    ranks.procs[i] = proc
                else:
                    ranks.procs.append(proc)
                name = f"{ranks.global_rank(i):>{width}}"
                if replacement:  # "rank 3+1": the first replacement of local rank 3's process
                    generations[i] += 1
                    name += f"+{generations[i]}"
                tag = f"[rank {name}] ".encode() if spec.prefix else b""
                assert proc.stdout is not None
                assert proc.stderr is not None
                pumps.start_soon(pump, proc.stdout, out, tag)
                pumps.start_soon(pump, proc.stderr, err, tag)

            # Replacements not seen in the job yet, those stopped because it ended, and
            # how many replacements in a row died before they joined (``replace.py``).
            pending: dict[int, RankProcess] = {}
            ending: dict[int, float] = {}
            start_failures = 0
            first_replaced: tuple[int, int] | None = None  # the first failure replaced

            async def replace(i: int, code: int) -> bool | None:
                nonlocal replaced, start_failures, first_replaced
                if ending.pop(i, None) is not None:
                    return None  # stopped: the job it was to join had ended
                dead = ranks.procs[i]
                what = f"rank {ranks.global_rank(i)}'s process (pid {dead.pid}){where} "
                if watch is None or replaced >= spec.max_replacements:
                    return False
                if pending.pop(i, None) is not None:
                    start_failures += 1
                    what = f"rank {ranks.global_rank(i)}'s replacement (pid {dead.pid}){where} "
                    if start_failures >= MAX_START_FAILURES:
                        err.line(
                            f"aiodist run: {what}{_describe(code)} before it joined job "
                            f"{job_id!r}: {start_failures} replacements in a row failed at "
                            "start-up; starting no more"
                        )
                        return False
                if (await watch.look()).ended:
                    return False  # failed after the job ended: nothing to join
                delay = start_backoff(start_failures)
                replaced += 1
                err.line(
                    f"aiodist run: {what}{_describe(code)}; starting a replacement"
                    + (f" in {delay:g} s" if delay else "")
                    + f" ({replaced} of at most {spec.max_replacements}), the others go on"
                )
                if delay:
                    await anyio.sleep(delay)
                    if ranks.signals:
                        return False
                    if (await watch.look()).ended:
                        return None  # the job went on without it, and ended
                first_replaced = first_replaced or (i, code)
                await start(i, replacement=True)
                pending[i] = ranks.procs[i]
                return True

            async def watch_pending(watch: JobWatch) -> None:
                nonlocal start_failures
                while True:
                    if pending or ending:
                        look = await watch.look()
                        for i, proc in list(pending.items()):
                            if proc.pid in look.pids and not look.forming:
                                del pending[i]
                                start_failures = 0
                            elif (look.ended or look.forming) and proc.returncode is None:
                                del pending[i]
                                ending[i] = anyio.current_time() + STOP_GRACE
                                err.line(
                                    f"aiodist run: job {job_id!r} ended before rank "
                                    f"{ranks.global_rank(i)}'s replacement (pid {proc.pid})"
                                    f"{where} joined it; stopping the replacement"
                                )
                                _kill(proc, signal.SIGTERM)
                        for i, deadline in ending.items():
                            if anyio.current_time() > deadline:
                                _kill(ranks.procs[i], signal.SIGKILL)
                    await anyio.sleep(WATCH_INTERVAL)

            for i in range(spec.nproc):
                await start(i)
            async with anyio.create_task_group() as watching:
                if watch is not None:
                    watching.start_soon(watch_pending, watch)
                failed = await ranks.wait_all(replace if watch is not None else None)
                watching.cancel_scope.cancel()
            if failed is None and not any(p.returncode == 0 for p in ranks.procs):
                failed = first_replaced  # no rank of ours went on: their failures stand
            if failed is not None and blame is not None:
                failed = await _culprit(spec, ranks, failed, blame())
            running = len(ranks.running())
        finally:
            with anyio.CancelScope(shield=True):
                await ranks.stop(STOP_GRACE)
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
                forks.close()
            # A rank's child may hold its pipes open: bound the wait for the last output.
            pumps.cancel_scope.deadline = anyio.current_time() + PUMP_DRAIN
    if ranks.signals:
        sig = ranks.signals[0]
        codes = ", ".join(
            f"rank {ranks.global_rank(i)} {_describe(p.returncode)}"
            for i, p in enumerate(ranks.procs)
        )
        return LaunchResult(
            128 + sig.value,
            f"aiodist run: received {sig.name}{where}; forwarded it to the ranks ({codes})",
        )
    if failed is None:
        return LaunchResult(0)
    i, code = failed
    rank = ranks.global_rank(i)
    others = f"; stopped the other {counted(running, 'rank')}{where}" if running else ""
    return LaunchResult(
        128 - code if code < 0 else code,
        f"aiodist run: rank {rank} (pid {ranks.procs[i].pid}){where} {_describe(code)}{others}",
    )


async def _culprit(
    spec: LaunchSpec, ranks: _Ranks, failed: tuple[int, int], suspects: list[int]
) -> tuple[int, int]:
    """The rank to blame: the earliest of the server's suspects that is ours and failed.

    The first rank to exit non-zero may be a victim (its peer crashed, and it
    raised ``RankFailedError``) that happened to exit first; the server knows
    which member failed first, and which left before that (a ``sys.exit(n)``
    the server took for a clean leave: its exit code says). Those are ending
    too: give them a moment.
    """
    with anyio.move_on_after(CULPRIT_GRACE):
        for rank in suspects:
            i = rank - spec.node_rank * spec.nproc
            if not 0 <= i < len(ranks.procs):
                continue
            if i == failed[0]:
                return failed
            await ranks.procs[i].wait()
            if (code := ranks.procs[i].returncode) not in (None, 0):
                return i, code
    return failed


def _kill(proc: RankProcess, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # the rank's own process group: its children too


def _describe(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by {_signal_name(-code)}"
    return f"exited with code {code}"
