"""`aiodist status --job`: where each rank is, and who a collective waits for (real processes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from aiodist._control.connection import connect_control
from aiodist._wire.messages import StatusRequest
from tests.helpers import HELPERS
from tests.helpers.daemon import asyncio_only, run_cli, serve

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from anyio.abc import Process

pytestmark = [pytest.mark.slow, asyncio_only]

WORKER = str(HELPERS / "observe_worker.py")
ENV = {"AIODIST_HEARTBEAT_INTERVAL": "0.1"}


@contextlib.asynccontextmanager
async def ranks(
    url: str, n: int, job: str, mode: str, dump_dir: Path | None = None
) -> AsyncIterator[list[Process]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env.update(ENV)
    if dump_dir is not None:
        env["AIODIST_DUMP_DIR"] = str(dump_dir)
    procs: list[Process] = []
    try:
        for r in range(n):
            argv = [sys.executable, WORKER, url, str(r), str(n), job, mode]
            procs.append(await anyio.open_process(argv, env=env))
        yield procs
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
        with anyio.CancelScope(shield=True):
            for p in procs:
                await p.wait()
                await p.aclose()


async def read_lines(proc: Process) -> list[dict[str, Any]]:
    assert proc.stdout is not None
    data = b""
    async for chunk in proc.stdout:
        data += chunk
    return [json.loads(line) for line in data.decode().splitlines() if line.startswith("{")]


async def status_json(port: int, job: str) -> dict[str, Any] | None:
    """The job's `status --job --json` report; None while the server holds no such job."""
    done = await run_cli("status", "--port", str(port), "--job", job, "--json")
    if done.returncode != 0:
        assert "holds no job" in done.stderr, done.stderr
        return None
    return json.loads(done.stdout)["job"]  # type: ignore[no-any-return]


async def heard_in_all_reduce(port: int, job: str, ranks: int) -> None:
    """Return once the server's status shows ``ranks`` ranks of ``job`` in a collective."""
    conn = await connect_control("127.0.0.1", port, timeout=10)
    try:
        while True:
            snap = await conn.request(StatusRequest, timeout=10)
            found = [j for j in snap["jobs"] if j["name"] == job]
            if found and found[0]["waits"] and len(found[0]["waits"][0]["waiting"]) == ranks:
                return
            await anyio.sleep(0.1)
    finally:
        conn.close()


async def test_status_job_names_the_rank_outside_the_all_reduce(tmp_path: Path) -> None:
    signalled = tmp_path / "signal"
    signalled.mkdir()
    with anyio.fail_after(60):
        async with serve("--port", "0") as daemon:
            url = f"tcp://127.0.0.1:{daemon.port}"
            async with ranks(url, 3, "obs", "sleep", dump_dir=signalled) as procs:
                # Until the server heard ranks 0 and 1 in the all_reduce (heartbeats: 0.1 s),
                # asked in this process; then the command, once.
                await heard_in_all_reduce(daemon.port, "obs", 2)
                job = await status_json(daemon.port, "obs")
                assert job is not None
                waits = job["waits"]
                (call,) = waits
                assert call["name"] == "all_reduce"
                assert call["group"] == "obs"
                assert [w["rank"] for w in call["waiting"]] == [0, 1]
                assert [n["rank"] for n in call["not_entered"]] == [2]
                sleeper = call["not_entered"][0]
                assert sleeper["op"] is None
                assert sleeper["last"]["name"] == "barrier"
                assert sleeper["last"]["seq"] == call["seq"] - 1
                by_rank = {m["rank"]: m for m in job["members"]}
                assert by_rank[0]["op"]["name"] == "all_reduce"
                assert by_rank[2]["op"] is None
                assert by_rank[2]["pid"] == procs[2].pid

                text = await run_cli("status", "--port", str(daemon.port), "--job", "obs")
                assert text.returncode == 0, text.stderr
                line = next(x for x in text.stdout.splitlines() if x.startswith("all_reduce"))
                assert f"all_reduce #{call['seq']} on group 'obs': ranks 0, 1 waiting" in line
                assert f"rank 2 not entered (last: barrier #{call['seq'] - 1}, done" in line

                # Dumps through the server: one file per rank, and one for the job.
                done = await run_cli(
                    "status", "--port", str(daemon.port), "--job", "obs", "--dump", str(tmp_path)
                )
                assert done.returncode == 0, done.stderr
                merged = json.loads((tmp_path / "aiodist-dump-obs.json").read_text())
                assert [d["rank"] for d in merged["ranks"]] == [0, 1, 2]
                for d in merged["ranks"]:
                    assert d["format"] == "aiodist.flight-recorder/1"
                    assert (tmp_path / f"aiodist-dump-obs-rank{d['rank']}.json").exists()
                    ops = [(o["name"], o["seq"], o["state"]) for o in d["operations"]]
                    assert ("barrier", call["seq"] - 1, "done") in ops
                    if d["rank"] < 2:
                        assert ops[-1] == ("all_reduce", call["seq"], "pending")
                        assert d["operations"][-1]["bytes"] == 16
                        assert d["operations"][-1]["shape"] == [4]
                        assert d["operations"][-1]["dtype"] == "float32"
                    else:
                        assert ops[-1][0] == "barrier"

                # SIGUSR1: the rank writes its recorder into AIODIST_DUMP_DIR.
                procs[2].send_signal(signal.SIGUSR1)
                dumped = signalled / "aiodist-dump-obs-rank2.json"
                while not dumped.exists():  # noqa: ASYNC110
                    await anyio.sleep(0.05)  # a file appears: there is no event to await
                assert json.loads(dumped.read_text())["reason"] == "SIGUSR1"

                # The sleeping rank wakes up: the all_reduce completes on every rank.
                assert procs[2].stdin is not None
                await procs[2].stdin.send(b"go\n")
                reports = [await read_lines(p) for p in procs]
                for lines in reports:
                    assert lines[-1]["sum"] == [3.0] * 4


async def test_status_job_unknown_job_fails() -> None:
    with anyio.fail_after(30):
        async with serve("--port", "0") as daemon:
            done = await run_cli("status", "--port", str(daemon.port), "--job", "nope")
            assert done.returncode != 0
            assert "no job 'nope'" in done.stderr


async def test_timeout_error_names_the_rank_that_never_entered(tmp_path: Path) -> None:
    with anyio.fail_after(60):
        async with serve("--port", "0") as daemon:
            url = f"tcp://127.0.0.1:{daemon.port}"
            async with ranks(url, 3, "late", "timeout", dump_dir=tmp_path) as procs:
                first, second = await read_lines(procs[0]), await read_lines(procs[1])
                assert procs[2].stdin is not None
                await procs[2].stdin.aclose()  # the sleeping rank exits
                for lines in (first, second):
                    kind, message = lines[-1]["error"]
                    assert kind == "DistTimeoutError", message
                    assert "rank 2 not entered (last: barrier #" in message, message
                    assert "ranks 0, 1 waiting" in message, message
                # The timeout broke the group: ranks 0 and 1 wrote their recorders.
                for rank in (0, 1):
                    dump = json.loads((tmp_path / f"aiodist-dump-late-rank{rank}.json").read_text())
                    last = dump["operations"][-1]
                    assert (last["name"], last["state"]) == ("all_reduce", "failed")
                    assert "DistTimeoutError" in last["error"]
