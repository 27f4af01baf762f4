"""`aiodist status --job`: where each rank is, and who a collective waits for (real processes)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from aiodist._control.connection import connect_control
from aiodist._launch.status_job import read_dump
from aiodist._server.state import DUMP_INTERVAL
from aiodist._wire.messages import DumpRequest, StatusRequest
from tests.helpers import HELPERS
from tests.helpers.daemon import asyncio_only, run_cli, serve
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from anyio.abc import Process

pytestmark = [pytest.mark.slow, asyncio_only]

WORKER = str(HELPERS / "observe_worker.py")
ENV = {"AIODIST_HEARTBEAT_INTERVAL": "0.1"}


@contextlib.asynccontextmanager
async def ranks(
    url: str,
    n: int,
    job: str,
    mode: str,
    dump_dir: Path | None = None,
    extra: dict[str, str] | None = None,
) -> AsyncIterator[list[Process]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env.update(ENV, **(extra or {}))
    if dump_dir is not None:
        env["AIODIST_DUMP_DIR"] = str(dump_dir)
    procs: list[Process] = []
    try:
        for r in range(n):
            argv = [sys.executable, WORKER, url, str(r), str(n), job, mode]
            procs.append(await open_process(argv, env=env))
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

                # Dumps through the server: one file per rank in its AIODIST_DUMP_DIR, and
                # one for the job there.
                done = await run_cli(
                    "status", "--port", str(daemon.port), "--job", "obs", "--dump", str(signalled)
                )
                assert done.returncode == 0, done.stderr
                merged = json.loads((signalled / "aiodist-dump-obs.json").read_text())
                assert [d["rank"] for d in merged["ranks"]] == [0, 1, 2]
                for d in merged["ranks"]:
                    assert d["format"] == "aiodist.flight-recorder/1"
                    assert d["reason"] == "aiodist status --dump"
                    assert (signalled / f"aiodist-dump-obs-rank{d['rank']}.json").exists()
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
                while json.loads(dumped.read_text())["reason"] != "SIGUSR1":  # noqa: ASYNC110
                    await anyio.sleep(0.05)  # a file is replaced: there is no event to await

                # The sleeping rank wakes up: the all_reduce completes on every rank.
                assert procs[2].stdin is not None
                await procs[2].stdin.send(b"go\n")
                reports = [await read_lines(p) for p in procs]
                for lines in reports:
                    assert lines[-1]["sum"] == [3.0] * 4


async def test_dumps_go_only_where_the_ranks_keep_them_and_follow_no_link(
    tmp_path: Path,
) -> None:
    mine, elsewhere = tmp_path / "ranks", tmp_path / "elsewhere"
    mine.mkdir()
    elsewhere.mkdir()
    target = tmp_path / "precious"
    target.write_text("not a dump")
    (mine / "aiodist-dump-obs.json").symlink_to(target)  # planted where the merge goes
    with anyio.fail_after(90):
        async with serve("--port", "0") as daemon:
            url = f"tcp://127.0.0.1:{daemon.port}"
            async with ranks(url, 2, "obs", "sleep", dump_dir=mine) as procs:
                await heard_in_all_reduce(daemon.port, "obs", 1)
                port = str(daemon.port)
                done = await run_cli("status", "--port", port, "--job", "obs", "--dump", str(mine))
                assert done.returncode == 0, done.stderr
                assert target.read_text() == "not a dump"  # the link was replaced, not followed
                merged = mine / "aiodist-dump-obs.json"
                assert not merged.is_symlink()
                assert [d["rank"] for d in json.loads(merged.read_text())["ranks"]] == [0, 1]

                # A request names no directory: the ranks write into theirs, never DIR.
                args = ("status", "--port", port, "--job", "obs", "--timeout", "3")
                done = await run_cli(*args, "--dump", str(elsewhere))
                assert done.returncode == 1
                assert "ranks 0, 1 wrote none in time" in done.stderr
                assert sorted(p.name for p in elsewhere.iterdir()) == ["aiodist-dump-obs.json"]

                assert procs[1].stdin is not None
                await procs[1].stdin.send(b"go\n")
                for p in procs:
                    assert (await read_lines(p))[-1]["sum"] == [2.0] * 4


async def test_dump_without_a_directory_uses_the_users_private_one(tmp_path: Path) -> None:
    env = {"TMPDIR": str(tmp_path)}  # the ranks' and the command's temporary directory
    with anyio.fail_after(90):
        async with serve("--port", "0") as daemon:
            url = f"tcp://127.0.0.1:{daemon.port}"
            async with ranks(url, 2, "quiet", "sleep", extra=env) as procs:
                await heard_in_all_reduce(daemon.port, "quiet", 1)
                port = str(daemon.port)
                done = await run_cli("status", "--port", port, "--job", "quiet", "--dump", env=env)
                assert done.returncode == 0, done.stderr
                private = tmp_path / f"aiodist-dumps-{os.getuid()}"
                assert str(private / "aiodist-dump-quiet.json") in done.stdout
                assert stat.S_IMODE(private.stat().st_mode) == 0o700
                merged = json.loads((private / "aiodist-dump-quiet.json").read_text())
                assert [d["rank"] for d in merged["ranks"]] == [0, 1]
                assert procs[1].stdin is not None
                await procs[1].stdin.send(b"go\n")
                for p in procs:
                    assert (await read_lines(p))[-1]["sum"] == [2.0] * 4


async def test_dump_into_a_directory_not_made_yet_makes_it_private(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"  # AIODIST_DUMP_DIR=dumps and --dump dumps, never made
    with anyio.fail_after(90):
        async with serve("--port", "0") as daemon:
            url = f"tcp://127.0.0.1:{daemon.port}"
            async with ranks(url, 2, "fresh", "sleep", dump_dir=dumps) as procs:
                await heard_in_all_reduce(daemon.port, "fresh", 1)
                port = str(daemon.port)
                args = ("status", "--port", port, "--job", "fresh", "--dump", str(dumps))
                done = await run_cli(*args)
                # Before: "aiodist status: --dump .../dumps: no such directory".
                assert done.returncode == 0, done.stderr
                assert stat.S_IMODE(dumps.stat().st_mode) == 0o700
                merged = json.loads((dumps / "aiodist-dump-fresh.json").read_text())
                assert [d["rank"] for d in merged["ranks"]] == [0, 1]
                assert procs[1].stdin is not None
                await procs[1].stdin.send(b"go\n")
                for p in procs:
                    assert (await read_lines(p))[-1]["sum"] == [2.0] * 4


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


BUSY = str(HELPERS / "busy_worker.py")


async def test_dump_requests_in_a_flood_never_fail_the_job(tmp_path: Path) -> None:
    # 400 dump requests in 4 s, from one token holder: the ranks' heartbeats keep flowing
    # (a short heartbeat timeout, so that a loop held up by dumps would be declared failed),
    # and the job's results stay right.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env.update(
        AIODIST_HEARTBEAT_INTERVAL="0.2",
        AIODIST_HEARTBEAT_TIMEOUT="3",
        AIODIST_DUMP_DIR=str(tmp_path),
    )
    with anyio.fail_after(120):
        async with serve("--port", "0") as daemon:
            url = f"tcp://127.0.0.1:{daemon.port}"
            procs = [
                await open_process([sys.executable, BUSY, url, str(r), "2", "busy"], env=env)
                for r in range(2)
            ]
            try:
                outs = [BufferedByteReceiveStream(p.stdout) for p in procs if p.stdout]
                for out in outs:
                    ready = await out.receive_until(b"\n", 1 << 16)
                    assert b'"ready"' in ready, ready
                conn = await connect_control("127.0.0.1", daemon.port, timeout=10)
                replies: list[Any] = []

                async def ask() -> None:
                    replies.append(await conn.request(lambda r: DumpRequest(r, "busy"), timeout=60))

                try:
                    async with anyio.create_task_group() as tg:
                        start = anyio.current_time()
                        for i in range(400):
                            tg.start_soon(ask)
                            await anyio.sleep_until(start + (i + 1) * 0.01)
                    took = anyio.current_time() - start
                    snap = await conn.request(StatusRequest, timeout=10)
                finally:
                    conn.close()
                (job,) = [j for j in snap["jobs"] if j["name"] == "busy"]
                assert job["failures"] == []
                assert len(replies) == 400
                # The server told the ranks once per DUMP_INTERVAL; the others shared it.
                requests = [r["request"] for r in replies]
                assert 1 <= len(set(requests)) <= took / DUMP_INTERVAL + 1
                assert all(r["ranks"] == [0, 1] for r in replies)

                def answered(rank: int) -> bool:
                    found = read_dump(tmp_path, "busy", rank)
                    return found is not None and found["request"] == requests[-1]

                for rank in range(2):  # the last notice's dump is written all the same
                    while not answered(rank):  # noqa: ASYNC110
                        await anyio.sleep(0.05)  # a file is replaced: no event to await
                for p in procs:
                    assert p.stdin is not None
                    await p.stdin.send(b"stop\n")
                reports = [json.loads(await out.receive_until(b"\n", 1 << 16)) for out in outs]
                for rank, report in enumerate(reports):
                    assert report["error"] is None, report
                    assert report["rank"] == rank
                    assert report["count"] > 0
                    assert report["wrong"] == 0
            finally:
                for p in procs:
                    if p.returncode is None:
                        p.kill()
                with anyio.CancelScope(shield=True):
                    for p in procs:
                        await p.wait()
                        await p.aclose()
