"""A rank dies while the daemon is away (real processes, a real daemon, real sockets).

Four ranks of one job run on `aiodist serve`; three of them wait in an
all-reduce the last one never joins. The daemon is SIGKILLed (or SIGSTOPped),
then the last rank. Its peers see their data connections to it drop while no
server can say who failed: they wait for the server's verdict. Once the
daemon is back (started again on the same port, with its state directory or
without one; or running again) it declares the rank failed, every survivor
gets ``RankFailedError`` naming it, and they shrink the default group and
all-reduce in it. A daemon that never comes back gives every survivor the
same error, naming the server, at the end of the grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from aiodist._wire.timing import STALL_GAP
from tests.helpers import HELPERS
from tests.helpers.daemon import asyncio_only, serve
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from anyio.abc import Process

pytestmark = pytest.mark.slow

WORKER = HELPERS / "away_worker.py"
WORLD = 4
# The daemon's re-attach window is twice the heartbeat timeout (at least 5 s): one of 2.5 s
# makes it exactly twice, the bound within which every survivor must name the dead rank.
HB_TIMEOUT = 2.5


class Rank:
    """A worker process and its JSON lines."""

    def __init__(self, proc: Process, rank: int, stderr: Path) -> None:
        self.proc, self.rank, self.stderr = proc, rank, stderr
        assert proc.stdout is not None
        self._out = BufferedByteReceiveStream(proc.stdout)

    async def line(self) -> dict[str, Any]:
        try:
            raw = await self._out.receive_until(b"\n", 1 << 20)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            raise AssertionError(
                f"rank {self.rank} printed no more: {self.stderr.read_text()}"
            ) from None
        out: dict[str, Any] = json.loads(raw)
        return out


@contextlib.asynccontextmanager
async def ranks(
    address: tuple[str, int], env: dict[str, str], logs: Path, hb_timeout: float = HB_TIMEOUT
) -> AsyncIterator[list[Rank]]:
    """``WORLD`` ranks of job ``away``; every one is killed on the way out."""
    url = f"tcp://{address[0]}:{address[1]}"
    full = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    full.update({"HB_TIMEOUT": str(hb_timeout), **env})
    procs: list[Rank] = []
    try:
        for r in range(WORLD):
            argv = [sys.executable, str(WORKER), url, "away", str(r), str(WORLD)]
            stderr = logs / f"rank-{r}-{time.monotonic_ns()}.txt"
            with stderr.open("wb") as err:  # a local file: opening it does not block
                proc = await open_process(argv, env=full, stderr=err)
            procs.append(Rank(proc, r, stderr))
        yield procs
    finally:
        for p in procs:
            if p.proc.returncode is None:
                p.proc.kill()
            with anyio.CancelScope(shield=True):
                await p.proc.wait()
                await p.proc.aclose()


async def _stop_daemon_then_kill_a_rank(
    daemon_proc: Process, procs: list[Rank], how: signal.Signals = signal.SIGKILL
) -> list[Rank]:
    """Every rank ready, the survivors in the all-reduce: the daemon goes, then the last rank."""
    *survivors, victim = procs
    for p in procs:
        assert (await p.line())["ready"]
    for p in survivors:
        assert (await p.line())["in_collective"]
    daemon_proc.send_signal(how)
    if how == signal.SIGKILL:
        await daemon_proc.wait()
    victim.proc.send_signal(signal.SIGKILL)  # dies while no server can see it
    await victim.proc.wait()
    return survivors


async def _survivors_name_it_and_shrink(survivors: list[Rank]) -> float:
    """Every survivor names the dead rank, shrinks and all-reduces; when the last named it."""
    errors = [await p.line() for p in survivors]
    for out in errors:
        error = out["error"]
        assert error["type"] == "RankFailedError", error
        assert error["rank"] == WORLD - 1, error
        assert "shrink_group" in error["message"], error  # the session lives on
    survivors_sum = float(sum(range(1, WORLD)))
    for p in survivors:
        out = await p.line()
        assert out["reduced"] == [survivors_sum] * 4, out
        assert out["world"] == WORLD - 1, out
    for p in survivors:
        assert (await p.line()).get("finished"), p.rank
        assert await p.proc.wait() == 0
    return float(max(out["t"] for out in errors))


@asyncio_only
@pytest.mark.parametrize("durable", [True, False], ids=["state-dir", "no-state-dir"])
async def test_rank_killed_while_the_daemon_is_away_is_named_on_every_survivor_who_shrink(
    tmp_path: Path, durable: bool
) -> None:
    state = ["--state-dir", str(tmp_path / "state")] if durable else []
    env = {"AIODIST_SERVER_GRACE": "60"}
    with anyio.fail_after(100):
        async with serve("--port", "0", *state) as first:
            async with ranks(first.address, env, tmp_path) as procs:
                survivors = await _stop_daemon_then_kill_a_rank(first.proc, procs)
                # The fault itself: longer than the heartbeat timeout, so the survivors'
                # data plane saw the rank go long before any server could confirm it.
                await anyio.sleep(2 * HB_TIMEOUT)
                async with serve("--port", str(first.port), *state):
                    back = time.monotonic()
                    named = await _survivors_name_it_and_shrink(survivors) - back
    # Named by the server at the end of its re-attach window (twice the heartbeat
    # timeout), counted from its start with a state directory, else from the first
    # re-attachment (a reconnect delay later); the bound leaves room for a loaded machine.
    assert named < 2 * HB_TIMEOUT + 5, named


@asyncio_only
@pytest.mark.parametrize(
    ("hb_timeout", "stopped"),
    [(HB_TIMEOUT, 2 * HB_TIMEOUT), (6.0, 4.0)],
    ids=["past-the-heartbeat-timeout", "within-it"],
)
async def test_rank_killed_while_the_daemon_is_stopped_is_named_on_every_survivor_who_shrink(
    tmp_path: Path, hb_timeout: float, stopped: float
) -> None:
    # Stopped past the ranks' heartbeat timeout, the daemon is away for them: they
    # reconnect. Within it, they wait; either way, stopped longer than STALL_GAP, the
    # daemon counts a member it lost meanwhile as away for its re-attach window.
    assert stopped > STALL_GAP
    env = {"AIODIST_SERVER_GRACE": "60"}
    with anyio.fail_after(100):
        async with serve("--port", "0") as daemon:
            async with ranks(daemon.address, env, tmp_path, hb_timeout) as procs:
                survivors = await _stop_daemon_then_kill_a_rank(daemon.proc, procs, signal.SIGSTOP)
                try:
                    await anyio.sleep(stopped)  # the fault itself: a daemon frozen that long
                finally:
                    daemon.proc.send_signal(signal.SIGCONT)
                back = time.monotonic()
                named = await _survivors_name_it_and_shrink(survivors) - back
    assert named < 2 * hb_timeout + 5, named


@asyncio_only
async def test_rank_killed_while_the_daemon_never_comes_back_gives_every_survivor_one_error(
    tmp_path: Path,
) -> None:
    grace = 3 * HB_TIMEOUT
    env = {"AIODIST_SERVER_GRACE": str(grace)}
    with anyio.fail_after(60):
        async with serve("--port", "0") as daemon:
            async with ranks(daemon.address, env, tmp_path) as procs:
                survivors = await _stop_daemon_then_kill_a_rank(daemon.proc, procs)
                errors = [(await p.line())["error"] for p in survivors]
                for p in survivors:
                    assert await p.proc.wait() == 0
    for error in errors:
        assert error["type"] == "GroupBrokenError", error
        assert f"did not come back within {grace:.1f} s (AIODIST_SERVER_GRACE)" in error["message"]
