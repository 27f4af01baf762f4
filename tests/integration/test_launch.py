"""`aiodist run`: real launcher processes starting real ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from aiodist._launch.run import LaunchSpec, rank_env
from tests.helpers import ROOT

if TYPE_CHECKING:
    from pathlib import Path

    from anyio.abc import Process

# Launchers are what is under test here, not the loop of the test process.
asyncio_only = pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"debug": True}), id="asyncio")]
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiodist", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def _script(tmp_path: Path, body: str, name: str = "script.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


async def _start(*args: str) -> Process:
    return await anyio.open_process([sys.executable, "-m", "aiodist", "run", *args], env=_env())


async def _read_until(stream: BufferedByteReceiveStream, marker: str) -> list[str]:
    lines: list[str] = []
    while not lines or marker not in lines[-1]:
        lines.append((await stream.receive_until(b"\n", 1 << 20)).decode())
    return lines


async def _finish(proc: Process, timeout: float = 60) -> tuple[int, str, str]:
    """Wait for ``proc``; return its code and the rest of its output. Kills it on timeout."""
    out, err = bytearray(), bytearray()

    async def drain(stream: object, sink: bytearray) -> None:
        async for chunk in stream:  # type: ignore[attr-defined]
            sink.extend(chunk)

    try:
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain, proc.stdout, out)
                tg.start_soon(drain, proc.stderr, err)
                code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            with anyio.CancelScope(shield=True):
                await proc.wait()
    return code, out.decode(), err.decode()


# --- environment ---------------------------------------------------------------------


def test_rank_env_is_torchruns() -> None:
    spec = LaunchSpec(
        ["python", "x.py"],
        nproc=4,
        nnodes=2,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=1234,
        max_restarts=3,
        token="tok",
    )
    base = {"PATH": "/bin", "RANK": "99", "TORCHELASTIC_RUN_ID": "outer", "TORCHELASTIC_X": "1"}
    env = rank_env(spec, 2, ("10.0.0.1", 1234), "job", base, restart=2)
    assert {k: env[k] for k in env if k != "PATH"} == {
        "RANK": "6",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "NODE_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "6",
        "ROLE_WORLD_SIZE": "8",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        # torchrun's restart count: the generation of the job the ranks join
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "AIODIST_JOB_ID": "job",
        "AIODIST_TOKEN": "tok",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }  # an outer torchrun's variables are dropped: this job's server is not in its store
    assert env["PATH"] == "/bin"
    assert rank_env(spec, 0, ("h", 1), "j", {"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"
    single = LaunchSpec(["python", "x.py"], nproc=1)
    assert "OMP_NUM_THREADS" not in rank_env(single, 0, ("h", 1), "j", {})


def test_rank_env_with_the_agent_store_is_torchruns_and_names_the_server_apart() -> None:
    spec = LaunchSpec(["python", "x.py"], nproc=2)
    env = rank_env(spec, 1, ("127.0.0.1", 4000), "job", {}, agent_store=("127.0.0.1", 5000))
    # torch's env:// finds its store as under torchrun; aiodist's finds its server.
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "5000")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["TORCHELASTIC_RUN_ID"] == "job"
    assert env["AIODIST_SERVER"] == "127.0.0.1:4000"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc": 0}, "-n/--nproc-per-node must be >= 1"),
        ({"nproc": 1, "nnodes": 0}, "--nnodes must be >= 1"),
        ({"nproc": 1, "nnodes": 2, "node_rank": 2}, r"--node-rank must be in \[0, 2\)"),
        ({"nproc": 1, "nnodes": 2, "node_rank": 1}, "needs --master-addr and --master-port"),
        (
            {"nproc": 1, "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1"},
            "needs --master-addr and --master-port",
        ),
        ({"nproc": 1, "master_port": 70000}, "--master-port must be in"),
        ({"nproc": 1, "max_restarts": -1}, "--max-restarts must be >= 0"),
        ({"nproc": 1, "rdzv_endpoint": "host"}, "--rdzv-endpoint must be HOST:PORT"),
        ({"nproc": 1, "rdzv_endpoint": "host:0"}, "--rdzv-endpoint must be HOST:PORT"),
        (
            {"nproc": 1, "rdzv_endpoint": "h:1", "master_port": 2},
            "leave out --master-addr and --master-port",
        ),
        ({"nproc": 1, "nnodes": 2, "rdzv_endpoint": "h:1"}, "needs --rdzv-id"),
    ],
)
def test_launch_spec_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LaunchSpec(["x"], **kwargs)


@pytest.mark.slow
def test_run_gives_each_rank_torchruns_environment(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import json, os, socket
        names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "AIODIST_JOB_ID"]
        env = {n: os.environ[n] for n in names}
        # The launcher hosts the rendezvous server at MASTER_ADDR:MASTER_PORT.
        socket.create_connection((env["MASTER_ADDR"], int(env["MASTER_PORT"])), 5).close()
        print(json.dumps(env))
        """,
    )
    result = _run("-n", "3", "--no-prefix", "--job-id", "envjob", script)
    assert result.returncode == 0, result.stderr
    envs = sorted(
        (json.loads(line) for line in result.stdout.splitlines()), key=lambda e: e["RANK"]
    )
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("0", "0"), ("1", "1"), ("2", "2")]
    for e in envs:
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("3", "3")
        assert (e["GROUP_RANK"], e["NODE_RANK"], e["MASTER_ADDR"]) == ("0", "0", "127.0.0.1")
        assert e["AIODIST_JOB_ID"] == "envjob"
    assert len({e["MASTER_PORT"] for e in envs}) == 1


# --- output ------------------------------------------------------------------------------

OUTPUT_SCRIPT = """
import os, sys
rank = os.environ["RANK"]
print(f"out one {rank}")
print(f"out two {rank}")
print(f"err {rank}", file=sys.stderr)
sys.stdout.write(f"partial {rank}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_run_prefixes_each_line_with_its_rank_or_not(tmp_path: Path, prefix: bool) -> None:
    script = _script(tmp_path, OUTPUT_SCRIPT)
    result = _run("-n", "2", *([] if prefix else ["--no-prefix"]), script)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        tag = f"[rank {rank}] " if prefix else ""
        out = result.stdout.splitlines()
        assert f"{tag}out one {rank}" in out
        assert f"{tag}out two {rank}" in out
        assert f"{tag}partial {rank}" in out  # a last line without newline is kept whole
        assert f"{tag}err {rank}" in result.stderr.splitlines()  # stderr stays stderr
        assert f"err {rank}" not in result.stdout
    assert len(result.stdout.splitlines()) == 6


@pytest.mark.slow
def test_run_module_flag_runs_a_module(tmp_path: Path) -> None:
    result = _run("-n", "2", "-m", "json.tool", "--help")
    assert result.returncode == 0, result.stderr
    assert sum("usage:" in line for line in result.stdout.splitlines()) == 2


# --- failures and signals -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "code", "summary"),
    [
        ("sys.exit(3)", 3, "exited with code 3"),
        ("os.kill(os.getpid(), signal.SIGKILL)", 128 + 9, "was killed by SIGKILL"),
    ],
    ids=["exit-code", "signal"],
)
def test_run_fails_fast_with_the_failed_ranks_code_and_summary(
    tmp_path: Path, how: str, code: int, summary: str
) -> None:
    script = _script(
        tmp_path,
        f"""
        import os, signal, sys, time
        if os.environ["RANK"] == "2":
            {how}
        time.sleep(600)  # the launcher must stop this rank
        """,
    )
    started = time.monotonic()
    result = _run("-n", "3", script, timeout=60)
    assert time.monotonic() - started < 30  # not the ranks' 600 s
    assert result.returncode == code
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("aiodist run: rank 2 (pid ")
    assert last.endswith(f"{summary}; stopped the other 2 ranks")


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
async def test_run_forwards_signals_to_every_rank(tmp_path: Path, sig: signal.Signals) -> None:
    script = _script(
        tmp_path,
        """
        import os, signal, sys, time
        def handler(signum, frame):
            print(f"got {signal.Signals(signum).name}", flush=True)
            sys.exit(7)
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        print("ready", flush=True)
        time.sleep(600)
        """,
    )
    proc = await _start("-n", "2", script)
    assert proc.stdout is not None
    stdout = BufferedByteReceiveStream(proc.stdout)
    with anyio.fail_after(60):
        await _read_until(stdout, "] ready")
        await _read_until(stdout, "] ready")
    proc.send_signal(sig)
    code, out, err = await _finish(proc)
    assert code == 128 + sig.value
    assert f"[rank 0] got {sig.name}" in out.splitlines()
    assert f"[rank 1] got {sig.name}" in out.splitlines()
    assert err.strip().splitlines()[-1] == (
        f"aiodist run: received {sig.name}; forwarded it to the ranks "
        "(rank 0 exited with code 7, rank 1 exited with code 7)"
    )


# --- multi-node -------------------------------------------------------------------------------

NODE_SCRIPT = """
import json, os
import anyio
import aiodist

async def main() -> None:
    await aiodist.init_process_group(timeout=60)
    me = [aiodist.get_rank(), aiodist.get_local_rank(), int(os.environ["NODE_RANK"])]
    everyone = await aiodist.all_gather_object(me)
    print(json.dumps(everyone))
    await aiodist.destroy_process_group()

anyio.run(main)
"""


@pytest.mark.slow
@asyncio_only
async def test_two_launchers_form_one_job_with_nnodes(tmp_path: Path) -> None:
    script = _script(tmp_path, NODE_SCRIPT)
    common = ["-n", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    node0 = await _start(*common, "--node-rank", "0", script)
    node1: Process | None = None
    try:
        assert node0.stderr is not None
        with anyio.fail_after(60):
            stderr = BufferedByteReceiveStream(node0.stderr)
            announce = (await _read_until(stderr, "start the other nodes"))[-1]
        port = announce.split("--master-port ", 1)[1].strip()
        node1 = await _start(*common, "--node-rank", "1", "--master-port", port, script)
        code1, out1, err1 = await _finish(node1)
        code0, out0, err0 = await _finish(node0)
    finally:
        for p in (node0, node1):
            if p is not None and p.returncode is None:
                p.kill()
                with anyio.CancelScope(shield=True):
                    await p.wait()
    assert (code0, code1) == (0, 0), err0 + err1
    expected = [[0, 0, 0], [1, 1, 0], [2, 0, 1], [3, 1, 1]]
    lines = {}
    for out in (out0, out1):
        for line in out.splitlines():
            tag, _, payload = line.partition("] ")
            lines[tag + "]"] = json.loads(payload)
    assert lines == {f"[rank {r}]": expected for r in range(4)}


@pytest.mark.slow
def test_run_reports_a_master_port_it_cannot_bind() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("-n", "1", "--master-port", str(port), "x.py", timeout=60)
    assert result.returncode == 1
    assert "aiodist run: cannot start:" in result.stderr
