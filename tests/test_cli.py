"""`aiodist serve` and `aiodist status`: the daemon as a real process, real clients over TCP."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client.parser import text_string_to_metric_families

import aiodist
from aiodist import AuthenticationError, RendezvousError, open_process_group
from aiodist._cli import format_status, main
from aiodist._control import connect_control
from aiodist._daemon import is_loopback, read_token_file, sd_notify
from aiodist._wire.messages import StatusRequest, StoreGet
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from anyio.abc import ByteReceiveStream, Process

    from aiodist import ProcessGroup

# Tests that drive a daemon process run on one loop: the daemon is what is under test.
asyncio_only = pytest.mark.parametrize(
    "anyio_backend", [pytest.param(("asyncio", {"debug": True}), id="asyncio")]
)
TOKEN = "s3cr3t-t0ken-for-tests"


class Daemon:
    """A running `aiodist serve` process, its output collected line by line."""

    def __init__(self, proc: Process) -> None:
        self.proc = proc
        self.lines: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.eof: set[str] = set()
        self._changed = anyio.Event()
        self.ready: str = ""
        self.host = ""
        self.port = 0

    async def drain(self, name: str, stream: ByteReceiveStream | None) -> None:
        assert stream is not None
        buffered = BufferedByteReceiveStream(stream)
        while True:
            try:
                line = await buffered.receive_until(b"\n", 1 << 20)
            except (anyio.IncompleteRead, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            self.lines[name].append(line.decode())
            self._notify()
        self.eof.add(name)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for_line(self, name: str, predicate: Callable[[str], bool]) -> str:
        while True:
            for line in self.lines[name]:
                if predicate(line):
                    return line
            assert name not in self.eof, f"{name} ended without the line: {self.lines[name]}"
            await self._changed.wait()

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def output(self) -> str:
        return "\n".join(self.lines["stdout"] + self.lines["stderr"])

    async def stop(self, timeout: float = 15) -> int:
        """SIGTERM, then the exit code (it must come within ``timeout``)."""
        self.proc.send_signal(signal.SIGTERM)
        with anyio.fail_after(timeout):
            return await self.proc.wait()


@contextlib.asynccontextmanager
async def serve(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[Daemon]:
    """Start `python -m aiodist serve ARGS` and yield it once it announced its address."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "aiodist", "serve", *args]
    async with await anyio.open_process(cmd, env=full_env) as proc:
        daemon = Daemon(proc)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(daemon.drain, "stdout", proc.stdout)
                tg.start_soon(daemon.drain, "stderr", proc.stderr)
                with anyio.fail_after(30):
                    daemon.ready = await daemon.wait_for_line("stdout", lambda _: True)
                daemon.host, daemon.port = _parse_ready(daemon.ready)
                yield daemon
                if proc.returncode is None:
                    assert await daemon.stop() == 0, daemon.output()
        finally:
            if proc.returncode is None:
                proc.kill()
                with anyio.CancelScope(shield=True):
                    await proc.wait()


def _parse_ready(line: str) -> tuple[str, int]:
    if line.startswith("{"):
        info = json.loads(line)
        return info["host"], int(info["port"])
    assert "listening on " in line, line
    address = line.split("listening on ", 1)[1].split(",", 1)[0].strip()
    host, port = address.rsplit(":", 1)
    return host, int(port)


async def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    full_env.update(env or {})
    with anyio.fail_after(60):
        result = await anyio.run_process(
            [sys.executable, "-m", "aiodist", *args], env=full_env, check=False
        )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


def _token_file(tmp_path: Path, token: str = TOKEN) -> Path:
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


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
            status = await _cli("status", "--port", str(daemon.port), "--json")
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


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize("with_token", [False, True], ids=["no-token", "token"])
async def test_serve_warns_on_public_address_without_token(
    tmp_path: Path, with_token: bool
) -> None:
    args = ["--host", "0.0.0.0", "--port", "0", "--log-level", "warning"]
    if with_token:
        args += ["--token-file", str(_token_file(tmp_path))]
    async with serve(*args) as daemon:
        assert daemon.host == "0.0.0.0"
        assert await daemon.stop() == 0
    warned = any("without a token" in line for line in daemon.lines["stderr"])
    assert warned is not with_token, daemon.output()


@pytest.mark.slow
@asyncio_only
async def test_serve_reports_bad_token_file_and_busy_port(tmp_path: Path) -> None:
    missing = await _cli("serve", "--port", "0", "--token-file", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert "cannot read the token file" in missing.stderr
    (tmp_path / "empty").write_text("\n")
    empty = await _cli("serve", "--port", "0", "--token-file", str(tmp_path / "empty"))
    assert empty.returncode == 2
    assert "is empty" in empty.stderr
    async with serve("--port", "0") as daemon:
        busy = await _cli("serve", "--port", str(daemon.port))
        assert busy.returncode == 1
        assert "cannot listen" in busy.stderr


def test_read_token_file_strips_and_warns_when_others_can_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    path.write_text("  abc  \nsecond line\n")
    path.chmod(0o644)
    assert read_token_file(str(path)) == "abc"
    assert "chmod 600" in caplog.text
    assert "abc" not in caplog.text


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
                    out = await _cli("status", "--port", str(daemon.port), "--json")
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
            transport = conn._transport
            assert transport is not None
            transport.pause_reading()  # a client that stops reading its replies
            for i in range(40):  # ~36 MB of replies: more than the sockets hold
                conn.send(StoreGet(1000 + i, "big", 60.0))
            started = time.monotonic()
            daemon.proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(30):  # logged just before it waits for the clients
                await daemon.wait_for_line("stderr", lambda line: "closing 1 connections" in line)
            daemon.proc.send_signal(signal.SIGINT)
            with anyio.fail_after(30):
                code = await daemon.proc.wait()
            assert time.monotonic() - started < 30  # not the 120 s shutdown timeout
            assert code == 128 + signal.SIGINT  # a clean shutdown would have exited 0
            transport.resume_reading()
    assert any("received SIGINT again: exiting at once" in line for line in daemon.lines["stderr"])


# --- metrics ------------------------------------------------------------------------------


async def _scrape(url: str) -> dict[str, float]:
    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            return str(response.read().decode())

    text = await anyio.to_thread.run_sync(get)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


@pytest.mark.slow
@asyncio_only
async def test_metrics_endpoint_counts_a_job() -> None:
    async with serve("--port", "0", "--metrics-port", "0") as daemon:
        url = daemon.ready.split("metrics on ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:")
        before = await _scrape(url)
        assert before["aiodist_joins_total"] == 0
        assert before["aiodist_members"] == 0
        assert before["aiodist_jobs{state=running}"] == 0
        assert before["aiodist_server_info{version=" + aiodist.__version__ + "}"] == 1
        assert before["process_resident_memory_bytes"] > 0
        during: list[dict[str, float]] = []

        async def body(g: ProcessGroup) -> None:
            for _ in range(5):
                await g.store.add("counter", 1)
            await g.session.barrier()
            if g.rank == 0:
                during.append(await _scrape(url))
            await g.session.barrier()

        with anyio.fail_after(30):
            await run_ranks(daemon.address, 3, body, group_name="metrics-job")
            after = await _scrape(url)
    (mid,) = during
    assert mid["aiodist_members"] == 3
    assert mid["aiodist_jobs{state=running}"] == 1
    assert mid["aiodist_connections"] >= 3
    assert after["aiodist_joins_total"] == 3
    assert after["aiodist_jobs_formed_total"] == 1
    assert after["aiodist_store_operations_total"] >= 15
    assert after["aiodist_members"] == 0  # the job ended and was dropped
    assert after["aiodist_received_bytes_total"] > before["aiodist_received_bytes_total"]
    assert after["aiodist_sent_bytes_total"] > mid["aiodist_sent_bytes_total"] > 0
    assert after["aiodist_rank_failures_total"] == 0


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
                seen["json"] = await _cli("status", "--port", port, "--json")
                seen["table"] = await _cli("status", "--port", port)
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
                    {"rank": -1, "local_rank": -1, "host": "h", "pid": 7, "status": "joining",
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
        result = await _cli("status", "--port", str(port), "--timeout", "2")
    assert result.returncode == 1
    assert f"no rendezvous server answers at 127.0.0.1:{port}" in result.stderr
    assert result.stdout == ""


# --- tokens -------------------------------------------------------------------------------


@pytest.mark.slow
@asyncio_only
async def test_token_accepted_refused_and_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = _token_file(tmp_path)
    async with serve("--port", "0", "--token-file", str(token_file), "--log-level", "debug") as d:
        assert "token required" in d.ready
        url = f"tcp://{d.host}:{d.port}"
        port = str(d.port)

        monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
        with anyio.fail_after(30):
            async with open_process_group(url, world_size=1, group_name="ok") as g:
                await g.store.set("k", b"v")
                assert await g.store.get("k") == b"v"

        for token, expected in [("wrong-token", "does not match"), (None, "requires a token")]:
            if token is None:
                monkeypatch.delenv("AIODIST_TOKEN")
            else:
                monkeypatch.setenv("AIODIST_TOKEN", token)
            started = time.monotonic()
            with anyio.fail_after(30), pytest.raises(AuthenticationError, match=expected):
                # rank 1: the kind of member that would retry a refused connection
                async with open_process_group(url, world_size=2, rank=1, group_name="bad"):
                    pass
            assert time.monotonic() - started < 10, "a refused token must not be retried"

        refused = await _cli("status", "--port", port, "--json")
        assert refused.returncode == 1
        assert "refused" in refused.stderr
        assert "AIODIST_TOKEN" in refused.stderr
        accepted = await _cli("status", "--port", port, "--json", env={"AIODIST_TOKEN": TOKEN})
        assert accepted.returncode == 0, accepted.stderr
        from_file = await _cli("status", "--port", port, "--token-file", str(token_file))
        assert from_file.returncode == 0, from_file.stderr
        # The refused members never reached the job table.
        assert json.loads(accepted.stdout)["jobs"] == []
    logged = d.output()
    assert "refused a connection from 127.0.0.1:" in logged
    assert "does not match" in logged
    assert TOKEN not in logged
    assert "wrong-token" not in logged


async def test_token_refusal_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODIST_TOKEN", raising=False)
    async with anyio.create_task_group() as tg:
        server = await tg.start(functools.partial(aiodist.serve_rendezvous, token=TOKEN))
        url = f"tcp://{server.address[0]}:{server.address[1]}"
        with anyio.fail_after(10), pytest.raises(AuthenticationError, match="requires a token"):
            async with open_process_group(url, world_size=1, group_name="x"):
                pass
        monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
        with anyio.fail_after(10):
            outs = await run_ranks(server.address, 2, lambda g: g.store.add("n", 1))
        assert sorted(outs) == [1, 2]
        assert server.auth_failures == 1
        assert "x" not in server.state.jobs
        tg.cancel_scope.cancel()


# --- the daemon stays torch-free -------------------------------------------------------------


def test_daemon_never_imports_torch() -> None:
    code = (
        "import sys; import aiodist._cli, aiodist._daemon, aiodist._server.serve, "
        "aiodist._server.metrics, aiodist._launch; print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "False", result.stderr


async def test_embedded_server_requires_the_token_when_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
    with anyio.fail_after(20):
        async with open_process_group(f"file://{tmp_path}/rdzv", world_size=1) as g:
            server = g.session.server
            assert server is not None  # this process embedded it
            assert server.token == TOKEN
            conn = await connect_control(*server.address, timeout=5, token="")
            try:
                with pytest.raises(AuthenticationError, match="requires a token"):
                    await conn.request(StatusRequest, timeout=5)
            finally:
                conn.close()


@pytest.mark.parametrize(
    ("variable", "value"), [("AIODIST_LOG_LEVEL", "verbose"), ("AIODIST_LOG_FORMAT", "xml")]
)
def test_bad_setting_from_environment_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0"])
    assert exit_info.value.code == 2
    assert f"{variable}={value!r} is not one of" in capsys.readouterr().err
