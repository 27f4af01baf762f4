"""`aiodist serve` and `aiodist status`: the daemon as a real process, real clients over TCP.

Tokens and metrics are tested in test_tokens_and_metrics.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import aiodist
from aiodist import RendezvousError, open_process_group
from aiodist._control.addresses import is_loopback
from aiodist._control.connection import ControlConnection
from aiodist._launch.cli import format_status, main
from aiodist._launch.daemon import sd_notify
from aiodist._wire.messages import StoreGet
from aiodist.testing import run_ranks
from tests.helpers.daemon import asyncio_only, run_cli, serve

if TYPE_CHECKING:
    from pathlib import Path

    from aiodist import ProcessGroup


# --- serve: flags, environment, logging, readiness ------------------------------------


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize(
    ("args", "env", "json_lines", "metrics"),
    [
        pytest.param(["--port", "0", "--log-format", "json"], {}, True, False, id="flags"),
        pytest.param(
            [],
            {
                "AIODIST_PORT": "0",
                "AIODIST_HOST": "127.0.0.1",
                "AIODIST_LOG_FORMAT": "json",
                "AIODIST_LOG_LEVEL": "debug",
                "AIODIST_METRICS_PORT": "0",
            },
            True,
            True,
            id="environment",
        ),
        pytest.param(
            ["--log-format", "text", "--port", "0"],
            {"AIODIST_LOG_FORMAT": "json", "AIODIST_PORT": "1"},
            False,
            False,
            id="flags-win",
        ),
    ],
)
async def test_serve_takes_flags_and_environment(
    args: list[str], env: dict[str, str], json_lines: bool, metrics: bool
) -> None:
    async with serve(*args, env=env) as daemon:
        assert daemon.host == "127.0.0.1"
        assert daemon.port > 1  # port 0 picked a real one; the flag beat AIODIST_PORT=1
        assert daemon.ready.startswith("{") is json_lines
        assert ("metrics" in daemon.ready) is metrics
        with anyio.fail_after(10):
            logged = await daemon.wait_for_line("stderr", lambda line: "listening on" in line)
        if json_lines:
            record = json.loads(logged)
            assert record["level"] == "info"
            assert record["logger"] == "aiodist._server.serve"
            assert f"127.0.0.1:{daemon.port}" in record["message"]
        else:
            assert " INFO aiodist._server.serve: " in logged
        assert await daemon.stop() == 0
    if json_lines:  # every line of the log is JSON
        assert all(json.loads(line) for line in daemon.lines["stderr"])


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize("abstract", [True, False], ids=["abstract", "path"])
async def test_serve_notifies_systemd_ready_and_stopping(tmp_path: Path, abstract: bool) -> None:
    name = f"@aiodist-test-{os.getpid()}-{time.monotonic_ns()}" if abstract else ""
    path = str(tmp_path / "notify") if not abstract else "\0" + name[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.setblocking(False)

        async def datagram() -> str:
            with anyio.fail_after(30):
                await anyio.wait_readable(sock)
            return sock.recv(4096).decode()

        async with serve("--port", "0", env={"NOTIFY_SOCKET": name or path}) as daemon:
            ready = await datagram()
            fields = dict(line.split("=", 1) for line in ready.splitlines())
            assert fields["READY"] == "1"
            assert fields["MAINPID"] == str(daemon.proc.pid)
            assert fields["STATUS"] == f"listening on 127.0.0.1:{daemon.port}"
            # READY=1 is sent only once the server listens: a client connects at once.
            status = await run_cli("status", "--port", str(daemon.port), "--json")
            assert status.returncode == 0, status.stderr
            assert await daemon.stop() == 0
            assert await datagram() == "STOPPING=1"


def test_sd_notify_without_socket_sends_nothing() -> None:
    assert sd_notify("READY=1", environ={}) is False
    assert sd_notify("READY=1", environ={"NOTIFY_SOCKET": "vsock:2:1"}) is False


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("node-1", False)],
)  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# --- shutdown ---------------------------------------------------------------------------


@pytest.mark.slow
@asyncio_only
async def test_sigterm_fails_pending_and_next_requests_clearly_and_exits_zero() -> None:
    async with serve("--port", "0") as daemon:
        url = f"tcp://{daemon.host}:{daemon.port}"
        errors: dict[str, BaseException] = {}
        waiting = {"r0": anyio.Event(), "r1": anyio.Event()}

        async def body(g: ProcessGroup) -> None:
            key = f"r{g.rank}"
            await g.store.set(key, b"")  # a round trip: the job works
            waiting[key].set()
            with pytest.raises(RendezvousError) as pending:
                await g.store.get("never-set", timeout=600)
            errors[f"pending-{key}"] = pending.value
            with pytest.raises(RendezvousError) as later:
                await g.store.set("after", b"")
            errors[f"later-{key}"] = later.value

        async def forming_member() -> None:
            with pytest.raises(RendezvousError) as joining:
                async with open_process_group(url, world_size=3, group_name="forming"):
                    pass
            errors["join"] = joining.value

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_ranks, daemon.address, 2, body)
            tg.start_soon(forming_member)
            with anyio.fail_after(30):
                for event in waiting.values():
                    await event.wait()
                status: dict[str, Any] = {"jobs": []}
                while len(status["jobs"]) < 2:  # the forming job's member is in too
                    out = await run_cli("status", "--port", str(daemon.port), "--json")
                    status = json.loads(out.stdout)
            started = time.monotonic()
            assert await daemon.stop(timeout=15) == 0
            assert time.monotonic() - started < 10
    assert sorted(errors) == ["join", "later-r0", "later-r1", "pending-r0", "pending-r1"]
    for exc in errors.values():
        assert f"rendezvous server at 127.0.0.1:{daemon.port} shut down" in str(exc)
        assert "SIGTERM" in str(exc)
    assert any("received SIGTERM: shutting down" in line for line in daemon.lines["stderr"])


@pytest.mark.slow
@asyncio_only
async def test_second_signal_exits_at_once_while_a_client_stalls_shutdown() -> None:
    async with serve("--port", "0", "--shutdown-timeout", "120") as daemon:
        url = f"tcp://{daemon.host}:{daemon.port}"
        async with open_process_group(url, world_size=1, group_name="stall") as g:
            await g.store.set("big", b"x" * 900_000)
            conn = g.session.conn
            assert isinstance(conn.connection, ControlConnection)
            transport = conn.connection._transport
            assert transport is not None
            transport.pause_reading()  # a client that stops reading its replies
            for i in range(40):  # ~36 MB of replies: more than the sockets hold
                conn.send(StoreGet(1000 + i, "big", 60.0))
            started = time.monotonic()
            daemon.proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(30):  # logged just before it waits for the clients
                await daemon.wait_for_line("stderr", lambda line: "closing 1 connection of" in line)
            daemon.proc.send_signal(signal.SIGINT)
            with anyio.fail_after(30):
                code = await daemon.proc.wait()
            assert time.monotonic() - started < 30  # not the 120 s shutdown timeout
            assert code == 128 + signal.SIGINT  # a clean shutdown would have exited 0
            transport.resume_reading()
    assert any("received SIGINT again: exiting at once" in line for line in daemon.lines["stderr"])


# --- status -------------------------------------------------------------------------------


@pytest.mark.slow
@asyncio_only
async def test_status_table_and_json_describe_a_live_job() -> None:
    async with serve("--port", "0") as daemon:
        port = str(daemon.port)
        seen: dict[str, Any] = {}

        async def body(g: ProcessGroup) -> None:
            await g.session.barrier()
            if g.rank == 0:
                seen["json"] = await run_cli("status", "--port", port, "--json")
                seen["table"] = await run_cli("status", "--port", port)
            await g.session.barrier()

        with anyio.fail_after(60):
            await run_ranks(
                daemon.address, 2, body, group_name="train", hostnames=["node-a", "node-bb"]
            )
    assert seen["json"].returncode == 0, seen["json"].stderr
    snap = json.loads(seen["json"].stdout)
    assert snap["version"] == aiodist.__version__
    assert snap["server"] == f"127.0.0.1:{port}"
    assert snap["uptime"] > 0
    (job,) = snap["jobs"]
    assert (job["name"], job["world_size"], job["joined"], job["state"]) == (
        "train",
        2,
        2,
        "running",
    )
    assert [(m["rank"], m["host"], m["pid"]) for m in job["members"]] == [
        (0, "node-a", os.getpid()),
        (1, "node-bb", os.getpid()),
    ]
    assert all(0 <= m["heartbeat_age"] < 10 for m in job["members"])
    assert job["failures"] == []
    table = seen["table"].stdout
    assert table.startswith(f"aiodist {aiodist.__version__} at 127.0.0.1:{port}: up ")
    assert "job 'train': running, 2/2 joined" in table
    rows = [line.split() for line in table.splitlines() if "node-" in line]
    assert [row[:5] for row in rows] == [
        ["0", "0", "node-a", str(os.getpid()), "active"],
        ["1", "0", "node-bb", str(os.getpid()), "active"],
    ]
    assert all(row[-1] == "ago" for row in rows)


def test_format_status_shows_failures_and_forming_members() -> None:
    snap = {
        "version": "1.2.3",
        "uptime": 3725.0,
        "connections": 2,
        "jobs": [
            {
                "name": "j",
                "world_size": 3,
                "joined": 2,
                "state": "forming",
                "age": 5.0,
                "keys": 0,
                "members": [
                    {"rank": None, "local_rank": -1, "host": "h", "pid": 7, "status": "joining",
                     "heartbeat_age": 0.25},
                ],
                "failures": [{"rank": 2, "host": "h3", "pid": 9, "reason": "missed heartbeats"}],
            }
        ],
    }  # fmt: skip
    text = format_status("h:1", snap)
    assert text.splitlines()[0] == "aiodist 1.2.3 at h:1: up 1h02m, 2 connections, 1 jobs"
    assert "job 'j': forming, 2/3 joined, age 5.0 s, 0 keys" in text
    member_row = next(line for line in text.splitlines() if "joining" in line)
    assert member_row.split() == ["?", "?", "h", "7", "joining", "0.2", "s", "ago"]
    assert "FAILED rank 2 (h3, pid 9): missed heartbeats" in text


@pytest.mark.slow
@asyncio_only
async def test_status_without_server_fails_clearly() -> None:
    with socket.socket() as probe:  # a port nothing listens on: bound, never listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        result = await run_cli("status", "--port", str(port), "--timeout", "2")
    assert result.returncode == 1
    assert f"no rendezvous server answers at 127.0.0.1:{port}" in result.stderr
    assert result.stdout == ""


# --- the daemon stays torch-free -------------------------------------------------------------


def test_daemon_never_imports_torch() -> None:
    code = (
        "import sys; import aiodist._launch.cli, aiodist._launch.daemon, aiodist._server.serve, "
        "aiodist._server.metrics, aiodist._launch.run, aiodist._launch.placement, "
        "aiodist._control.rendezvous, aiodist._control.torchrun; print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize(
    ("variable", "value"), [("AIODIST_LOG_LEVEL", "verbose"), ("AIODIST_LOG_FORMAT", "xml")]
)
def test_bad_setting_from_environment_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    assert main(["serve", "--port", "0"]) == 2
    assert f"{variable}={value!r} is not one of" in capsys.readouterr().err
