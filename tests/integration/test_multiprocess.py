"""Real processes: ranks meeting at the `aiodist serve` daemon, a rank killed, the daemon stopped.

The daemon's own behaviour (flags, signals, metrics, tokens) is tested in test_cli.py and
the launcher's in test_launch.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from aiodist import open_process_group
from tests.helpers import ROOT
from tests.helpers.warm import Proc, open_process, popen

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import anyio, torch
    import aiodist
    from aiodist._ops.p2p import recv, send

    async def main() -> None:
        url, rank, world, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        await aiodist.init_process_group(init_method=url, world_size=world, rank=rank,
                                         group_name="mp", heartbeat_interval=0.1,
                                         heartbeat_timeout=2.0)
        store = aiodist.get_store()
        out = {"rank": aiodist.get_rank(), "pid": os.getpid()}
        if mode == "ring":
            right, left = (rank + 1) % world, (rank - 1) % world
            t = torch.zeros(3)
            w = aiodist._ops.p2p.isend(torch.full((3,), float(rank)), dst=right)
            out["from"] = await recv(t, src=left)
            await w
            out["got"] = t.tolist()
            await store.set(f"done/{rank}", b"")
            await store.wait([f"done/{r}" for r in range(world)])
        elif mode == "victim":
            await store.set(f"ready/{rank}", str(os.getpid()))
            try:  # waits on rank 1 (the store goes on after a failure: not there)
                await recv(torch.zeros(1), src=1 if rank != 1 else 0)
            except aiodist.RankFailedError as exc:
                out["error"] = type(exc).__name__
                out["failed_rank"] = exc.rank
        elif mode == "collectives":  # barriers and small all_reduces until one fails
            t, calls = torch.ones(1), 0
            try:
                while True:
                    await aiodist.all_reduce(t)
                    await aiodist.barrier()
                    if not calls:
                        print("running", flush=True)
                    calls += 1
            except aiodist.RankFailedError as exc:
                out["error"] = type(exc).__name__
                out["failed_rank"] = exc.rank
                out["calls"] = calls
        elif mode == "server-gone":
            await store.set(f"ready/{rank}", b"")
            await store.wait([f"ready/{r}" for r in range(world)])
            print("waiting", flush=True)
            for what in ("pending", "next"):
                try:
                    await store.get("never-set", timeout=60)
                except aiodist.RendezvousError as exc:
                    out[what] = [type(exc).__name__, str(exc)]
        print(json.dumps(out), flush=True)
        await aiodist.destroy_process_group()

    anyio.run(main)
    """
)


@pytest.fixture
def daemon_proc(tmp_path: Path) -> Iterator[tuple[str, int, Proc]]:
    with open(tmp_path / "daemon.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aiodist", "serve", "--host", "127.0.0.1", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # readiness: the bound address, printed once listening
        assert "listening on" in line, line
        host, port = line.split("listening on ", 1)[1].strip().rsplit(":", 1)
        yield host, int(port), proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, (tmp_path / "daemon.log").read_text()
    finally:
        _kill(proc)


@pytest.fixture
def daemon(daemon_proc: tuple[str, int, Proc]) -> tuple[str, int]:
    return daemon_proc[0], daemon_proc[1]


def _kill(proc: Proc) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()  # reaps it and closes its pipes


def _spawn(script: Path, *args: str) -> Proc:
    return popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _reap(procs: list[Proc], timeout: float = 60) -> list[dict[str, object]]:
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, stderr
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            _kill(p)
    return outs


def test_ranks_in_separate_processes_exchange_tensors_through_the_daemon(
    daemon: tuple[str, int], tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    url = f"tcp://{daemon[0]}:{daemon[1]}"
    procs = [_spawn(script, url, str(r), "4", "ring") for r in range(4)]
    outs = sorted(_reap(procs), key=lambda o: int(o["rank"]))  # type: ignore[call-overload]
    for rank, out in enumerate(outs):
        left = (rank - 1) % 4
        assert out["from"] == left
        assert out["got"] == [float(left)] * 3


@pytest.mark.parametrize("victim", [0, 3], ids=["root", "other"])
async def test_rank_killed_in_small_collectives_through_rank_0_fails_them_everywhere(
    daemon: tuple[str, int], tmp_path: Path, victim: int
) -> None:
    # Five ranks: barriers and small all_reduces go through group rank 0 (the star of
    # exchange_rows). Whether rank 0 dies (everyone waits on it) or another rank (rank 0
    # waits on it, the rest on rank 0), every survivor's call fails, naming the victim.
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    url = f"tcp://{daemon[0]}:{daemon[1]}"
    procs = [_spawn(script, url, str(r), "5", "collectives") for r in range(5)]
    try:
        lines = procs[victim].stdout
        assert lines is not None
        with anyio.fail_after(60):  # its first barrier passed: every rank runs the loop
            assert await anyio.to_thread.run_sync(lines.readline) == "running\n"
        _kill(procs[victim])
        survivors = _reap([p for r, p in enumerate(procs) if r != victim], timeout=30)
    finally:
        for p in procs:
            _kill(p)
    for out in survivors:
        assert out["error"] == "RankFailedError", out
        assert out["failed_rank"] == victim, out
        assert int(out["calls"]) >= 1  # type: ignore[call-overload]


async def test_killed_rank_is_reported_to_survivors_by_rank(
    daemon: tuple[str, int], tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    url = f"tcp://{daemon[0]}:{daemon[1]}"
    procs = [_spawn(script, url, str(r), "3", "victim") for r in range(3)]
    try:
        # Watch the job as a 4th party through the daemon's status, not a sleep.
        with anyio.fail_after(60):
            while True:
                status = await anyio.run_process(
                    [sys.executable, "-m", "aiodist", "status", "--port", str(daemon[1]), "--json"]
                )
                jobs = json.loads(status.stdout)["jobs"]
                if jobs and jobs[0]["state"] == "running":
                    break
                await anyio.sleep(0.1)  # polling another process's state: no event to await
        assert jobs[0]["name"] == "mp"
        assert sorted(m["rank"] for m in jobs[0]["members"]) == [0, 1, 2]
        _kill(procs[1])
        survivors = _reap([procs[0], procs[2]])
    finally:
        for p in procs:
            _kill(p)
    for out in survivors:
        assert out["error"] == "RankFailedError"
        assert out["failed_rank"] == 1


def test_aiodist_run_demo_passes_with_rank_prefixes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aiodist", "run", "-n", "4", str(ROOT / "examples" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(4):
        assert f"[rank {rank}] joined: rank {rank} of 4" in result.stdout
    # Rank 0 prints every result; spot-check values a broken collective would get wrong.
    for line in (
        "all_reduce(sum)                    [6.0, 6.0]",
        "all_gather                         [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]",
        "reduce_scatter(sum) (rank 0 gets)  [60.0, 60.0]",
        "all_to_all (rank 0 gets)           [[0.0, 0.0], [10.0, 10.0], [20.0, 20.0], [30.0, 30.0]]",
        "rank 0 received from rank          3: [3.0, 3.0, 3.0]",
        "all_reduce on ranks [0, 2]         [2.0, 2.0]",
    ):
        assert f"[rank 0]   {line}" in result.stdout, result.stdout


async def test_in_process_member_and_subprocess_members_share_a_job(
    daemon: tuple[str, int], tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    url = f"tcp://{daemon[0]}:{daemon[1]}"
    procs = [_spawn(script, url, str(r), "3", "ring") for r in (1, 2)]
    try:
        with anyio.fail_after(60):
            async with open_process_group(url, world_size=3, rank=0, group_name="mp") as g:
                import torch

                from aiodist._ops.p2p import isend, recv

                t = torch.zeros(3)
                w = isend(torch.zeros(3), dst=1, group=g)
                assert await recv(t, src=2, group=g) == 2
                await w
                assert t.tolist() == [2.0, 2.0, 2.0]
                await g.store.set("done/0", b"")
                await g.store.wait([f"done/{r}" for r in range(3)])
        _reap(procs)
    finally:
        for p in procs:
            _kill(p)


async def test_stopping_the_daemon_fails_ranks_control_requests_clearly(
    daemon_proc: tuple[str, int, Proc], tmp_path: Path
) -> None:
    host, port, proc = daemon_proc
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    url = f"tcp://{host}:{port}"
    workers = [
        await open_process([sys.executable, str(script), url, str(r), "2", "server-gone"], env=env)
        for r in range(2)
    ]
    try:
        with anyio.fail_after(60):
            streams = []
            for w in workers:
                assert w.stdout is not None
                streams.append(BufferedByteReceiveStream(w.stdout))
                assert await streams[-1].receive_until(b"\n", 1 << 16) == b"waiting"
            proc.send_signal(signal.SIGTERM)
            outs = []
            for w, stream in zip(workers, streams, strict=True):
                assert await w.wait() == 0
                outs.append(json.loads(await stream.receive_until(b"\n", 1 << 16)))
            # It exits by itself, cleanly (a second SIGTERM would make it exit at once).
            assert await anyio.to_thread.run_sync(proc.wait) == 0
    finally:
        for w in workers:
            if w.returncode is None:
                w.kill()
                with anyio.CancelScope(shield=True):
                    await w.wait()
            await w.aclose()
    for out in outs:
        for what in ("pending", "next"):
            kind, message = out[what]
            assert kind == "RendezvousError"
            assert f"rendezvous server at {host}:{port} shut down (it received SIGTERM)" in message
