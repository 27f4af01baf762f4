"""A daemon killed and started again: the jobs on it go on (real processes, real sockets).

Two jobs of two ranks each run on one `aiodist serve`. The daemon is SIGKILLed
while rank 0 of each job waits in an all-reduce, and started again on the same
port (with the same state directory, or without one). Both jobs finish the
collective with the right sum, use the store and a barrier through the server
that came back, and a rank killed after the restart is reported to its peer.
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

from tests.helpers import HELPERS
from tests.helpers.daemon import TOKEN, asyncio_only, run_cli, serve, token_file
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from anyio.abc import Process

    from tests.helpers.daemon import Daemon

pytestmark = pytest.mark.slow

WORKER = HELPERS / "restart_worker.py"
HB_TIMEOUT = 1.5


class Rank:
    """A worker process: its JSON lines, and a line to send it."""

    def __init__(self, proc: Process, job: str, rank: int, stderr: Path) -> None:
        self.proc, self.job, self.rank, self.stderr = proc, job, rank, stderr
        assert proc.stdout is not None
        self._out = BufferedByteReceiveStream(proc.stdout)

    async def line(self) -> dict[str, Any]:
        try:
            raw = await self._out.receive_until(b"\n", 1 << 20)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            raise AssertionError(
                f"{self.job} rank {self.rank} printed no more: {self.stderr.read_text()}"
            ) from None
        out: dict[str, Any] = json.loads(raw)
        return out

    async def tell(self) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send(b"go\n")


@contextlib.asynccontextmanager
async def ranks(
    address: tuple[str, int], jobs: list[str], env: dict[str, str], logs: Path
) -> AsyncIterator[list[Rank]]:
    """Two ranks per job, started at once; every one is killed on the way out."""
    url = f"tcp://{address[0]}:{address[1]}"
    full = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    full.update({"HB_TIMEOUT": str(HB_TIMEOUT), **env})
    procs: list[Rank] = []
    try:
        for job in jobs:
            for r in range(2):
                argv = [sys.executable, str(WORKER), url, job, str(r), "2"]
                stderr = logs / f"{job}-{r}-{time.monotonic_ns()}.txt"
                with stderr.open("wb") as err:  # a local file: opening it does not block
                    proc = await open_process(argv, env=full, stderr=err)
                procs.append(Rank(proc, job, r, stderr))
        yield procs
    finally:
        for p in procs:
            if p.proc.returncode is None:
                p.proc.kill()
            with anyio.CancelScope(shield=True):
                await p.proc.wait()
                await p.proc.aclose()


async def wait_reattached(daemon: Daemon, n: int) -> None:
    """Until the daemon logged ``n`` distinct members re-attached."""
    seen: set[tuple[str, int]] = set()

    def count(line: str) -> bool:
        if '"rank_reattached"' in line:
            event = json.loads(line[line.index("{") :])
            seen.add((event["job"], event["rank"]))
        return len(seen) >= n

    await daemon.wait_for_line("stderr", count)


async def _kill(daemon: Daemon) -> None:
    daemon.proc.send_signal(signal.SIGKILL)
    await daemon.proc.wait()


@asyncio_only
@pytest.mark.parametrize(
    ("durable", "how"),
    [(True, "SIGKILL"), (False, "SIGKILL"), (True, "SIGTERM")],
    ids=["state-dir", "no-state-dir", "state-dir-sigterm"],
)
async def test_daemon_killed_mid_collective_two_jobs_finish_after_restart(
    tmp_path: Path, durable: bool, how: str
) -> None:
    state = ["--state-dir", str(tmp_path / "state")] if durable else []
    auth = ["--token-file", str(token_file(tmp_path))]
    env = {"AIODIST_TOKEN": TOKEN, "AIODIST_SERVER_GRACE": "30"}
    jobs = ["job-a", "job-b"]
    with anyio.fail_after(90):
        async with serve("--port", "0", *auth, *state) as first:
            port = first.port
            async with ranks(first.address, jobs, env, tmp_path) as procs:
                a0, a1, b0, b1 = procs
                for p in procs:
                    assert (await p.line())["ready"]
                for p in (a0, b0):
                    assert (await p.line())["in_collective"]
                if how == "SIGKILL":
                    await _kill(first)
                else:  # an upgrade: a daemon with a state directory says it comes back
                    assert await first.stop() == 0
                killed = time.monotonic()
                async with serve("--port", str(port), *auth, *state) as second:
                    restarted = time.monotonic() - killed
                    assert restarted < 10, restarted
                    for p in (a1, b1):
                        await p.tell()  # now it joins the all-reduce rank 0 has waited in
                    for p in procs:
                        assert (await p.line())["reduced"] == [3.0] * 4, (p.job, p.rank)
                    for p in procs:
                        out = await p.line()
                        assert out["after"], out
                        assert out["kept"] == (f"value-of-{p.job}" if durable else None), out
                    await wait_reattached(second, 4)
                    # Job A finishes; in job B, rank 1 is killed while rank 0 waits for it.
                    await a1.tell()
                    b1.proc.kill()
                    for p in (a0, a1):
                        assert (await p.line()).get("finished"), (p.job, p.rank)
                    error = (await b0.line())["error"]
                    assert error["type"] == "RankFailedError", error
                    assert error["rank"] == 1, error
                    for p in (a0, a1, b0):
                        assert await p.proc.wait() == 0
    if durable:
        assert (tmp_path / "state" / "log").exists()


@asyncio_only
async def test_daemon_restarted_with_another_token_is_refused_by_the_ranks(
    tmp_path: Path,
) -> None:
    env = {"AIODIST_TOKEN": TOKEN, "AIODIST_SERVER_GRACE": "20"}
    state = ["--state-dir", str(tmp_path / "state")]
    with anyio.fail_after(60):
        async with serve("--port", "0", "--token-file", str(token_file(tmp_path)), *state) as d:
            port = d.port
            async with ranks(d.address, ["job-t"], env, tmp_path) as (r0, r1):
                for p in (r0, r1):
                    assert (await p.line())["ready"]
                assert (await r0.line())["in_collective"]
                await _kill(d)
                (tmp_path / "other").mkdir()
                other = token_file(tmp_path / "other", "another-token")
                async with serve("--port", str(port), "--token-file", str(other), *state):
                    # Rank 0's all-reduce breaks once its rank refused the server; rank 1's
                    # starts after that, and fails at once.
                    errors = [(await r0.line())["error"]]
                    await r1.tell()
                    errors.append((await r1.line())["error"])
                    for p, error in zip((r0, r1), errors, strict=True):
                        assert error["type"] == "AuthenticationError", error
                        assert f"127.0.0.1:{port}" in error["message"], error
                        assert await p.proc.wait() == 0


@asyncio_only
async def test_rank_killed_while_the_daemon_is_down_is_reported_once_it_is_back(
    tmp_path: Path,
) -> None:
    state = ["--state-dir", str(tmp_path / "state")]
    env = {"AIODIST_SERVER_GRACE": "30", "LINGER": "1"}
    with anyio.fail_after(60):
        async with serve("--port", "0", *state) as first:
            async with ranks(first.address, ["job-d"], env, tmp_path) as (r0, r1):
                for p in (r0, r1):
                    assert (await p.line())["ready"]
                assert (await r0.line())["in_collective"]
                await _kill(first)
                r1.proc.kill()  # dies while no server can see it
                await r1.proc.wait()
                async with serve("--port", str(first.port), *state) as second:
                    error = (await r0.line())["error"]
                    # The server, once back, reaches the same verdict on its own.
                    line = await second.wait_for_line("stderr", lambda s: '"rank_failed"' in s)
                    failed = json.loads(line[line.index("{") :])
                    await r0.tell()
                    assert await r0.proc.wait() == 0
    assert error["type"] == "RankFailedError", error
    assert error["rank"] == 1, error
    assert (failed["job"], failed["rank"]) == ("job-d", 1), failed
    assert "did not come back" in failed["reason"], failed


@asyncio_only
async def test_daemon_not_back_within_the_grace_period_breaks_the_groups(
    tmp_path: Path,
) -> None:
    grace = 2.0
    with anyio.fail_after(60):
        async with serve("--port", "0") as daemon:
            env = {"AIODIST_SERVER_GRACE": str(grace)}
            async with ranks(daemon.address, ["job-g"], env, tmp_path) as (r0, r1):
                for p in (r0, r1):
                    assert (await p.line())["ready"]
                assert (await r0.line())["in_collective"]
                await _kill(daemon)
                killed = time.monotonic()
                out = await r0.line()
                waited = out["t"] - killed
                await r1.tell()
                later = await r1.line()
    error = out["error"]
    assert error["type"] == "GroupBrokenError", error
    assert f"did not come back within {grace:.1f} s (AIODIST_SERVER_GRACE)" in error["message"]
    # Counted from the moment the rank saw the server go, a hair before ``killed``.
    assert grace - 0.5 <= waited < grace + HB_TIMEOUT + 5, waited
    assert later["error"]["type"] == "GroupBrokenError", later


@asyncio_only
async def test_daemon_stopped_past_the_heartbeat_timeout_loses_no_member(tmp_path: Path) -> None:
    env = {"AIODIST_SERVER_GRACE": "30"}
    with anyio.fail_after(60):
        async with serve("--port", "0") as daemon:
            async with ranks(daemon.address, ["job-s"], env, tmp_path) as (r0, r1):
                for p in (r0, r1):
                    assert (await p.line())["ready"]
                assert (await r0.line())["in_collective"]
                daemon.proc.send_signal(signal.SIGSTOP)
                try:
                    # The fault itself: a server frozen for twice the ranks' heartbeat timeout.
                    await anyio.sleep(2 * HB_TIMEOUT + 0.5)
                finally:
                    daemon.proc.send_signal(signal.SIGCONT)
                await r1.tell()
                for p in (r0, r1):
                    assert (await p.line())["reduced"] == [3.0] * 4
                for p in (r0, r1):
                    assert (await p.line())["after"]
                await wait_reattached(daemon, 2)
                await r1.tell()
                for p in (r0, r1):
                    assert (await p.line()).get("finished"), p.rank
                    assert await p.proc.wait() == 0
    assert '"rank_failed"' not in daemon.output()


@asyncio_only
async def test_second_daemon_on_a_state_dir_in_use_exits_with_a_clear_error(
    tmp_path: Path,
) -> None:
    state = str(tmp_path / "state")
    async with serve("--port", "0", "--state-dir", state) as daemon:
        result = await run_cli("serve", "--port", "0", "--state-dir", state)
        assert "jobs are kept in the state directory" in daemon.output()
    assert result.returncode == 1, result
    assert "is in use by another aiodist server" in result.stderr


GROWN_WORKER = HELPERS / "grown_restart_worker.py"


@asyncio_only
async def test_grown_job_survives_a_daemon_killed_and_started_again(tmp_path: Path) -> None:
    """An elastic job of two grew by a newcomer; the daemon is SIGKILLed and restarted:
    every rank, the newcomer included, re-attaches and goes on with the store and
    collectives, nobody hangs."""
    state = ["--state-dir", str(tmp_path / "state")]
    full = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    full.update({"HB_TIMEOUT": str(HB_TIMEOUT), "AIODIST_SERVER_GRACE": "30"})
    procs: list[Rank] = []

    async def start(url: str, role: str) -> Rank:
        argv = [sys.executable, str(GROWN_WORKER), url, role]
        stderr = tmp_path / f"{role}-{len(procs)}.txt"
        with stderr.open("wb") as err:
            proc = await open_process(argv, env=full, stderr=err)
        procs.append(Rank(proc, "grown", len(procs), stderr))
        return procs[-1]

    try:
        with anyio.fail_after(90):
            async with serve("--port", "0", *state) as first:
                url = f"tcp://{first.host}:{first.port}"
                members = [await start(url, "member") for _ in range(2)]
                for p in members:
                    assert (await p.line())["formed"]
                newcomer = await start(url, "newcomer")
                assert (await newcomer.line())["epoch"] == 1
                joined = [await p.line() for p in procs]
                assert sorted(j["job_rank"] for j in joined) == [0, 1, 2], joined
                assert all(j["reduced"] == [6.0, 6.0] for j in joined), joined
                await _kill(first)
                async with serve("--port", str(first.port), *state) as second:
                    assert "1 job restored" in (
                        await second.wait_for_line("stderr", lambda s: " restored from " in s)
                    )
                    await wait_reattached(second, 3)  # the newcomer too
                    for p in procs:
                        await p.tell()
                    for p in procs:
                        out = await p.line()
                        assert out.get("after"), (p.rank, out)
                        assert out["reduced"] == [6.0, 6.0], out
                        assert out["kept"] == {str(r): f"value-of-{r}" for r in range(3)}, out
                    for p in procs:
                        assert await p.proc.wait() == 0
    finally:
        for p in procs:
            if p.proc.returncode is None:
                p.proc.kill()
            with anyio.CancelScope(shield=True):
                await p.proc.wait()
                await p.proc.aclose()


@asyncio_only
@pytest.mark.parametrize("damage", ["flipped byte", "fifo"])
async def test_daemon_on_a_damaged_state_dir_exits_naming_what_is_damaged(
    tmp_path: Path, damage: str
) -> None:
    state = tmp_path / "state"
    async with serve("--port", "0", "--state-dir", str(state)):
        pass  # a clean start and stop: a snapshot and a log
    snapshot, log = state / "snapshot", state / "log"
    if damage == "fifo":
        log.unlink()
        os.mkfifo(log)
    else:
        data = bytearray(snapshot.read_bytes())
        data[len(data) // 2] ^= 0x10
        snapshot.write_bytes(bytes(data))
    before = snapshot.read_bytes()
    result = await run_cli("serve", "--port", "0", "--state-dir", str(state))
    assert result.returncode == 1, result
    if damage == "fifo":
        assert f"{log} is not a regular file (a FIFO)" in result.stderr, result.stderr
    else:
        assert f"is damaged: {snapshot}: " in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot.read_bytes() == before  # the evidence is kept
