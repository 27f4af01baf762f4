"""Running `aiodist serve` and `aiodist` commands as real processes, for the daemon's tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from anyio.abc import ByteReceiveStream, Process

__all__ = ["TOKEN", "Daemon", "asyncio_only", "run_cli", "serve", "token_file"]

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


# Sets the limits of open files ("SOFT:HARD"), then execs the daemon.
_NOFILE = (
    "import os, resource, sys; soft, hard = map(int, sys.argv[1].split(':')); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)); "
    "os.execv(sys.executable, [sys.executable, '-m', 'aiodist', 'serve', *sys.argv[2:]])"
)


@contextlib.asynccontextmanager
async def serve(
    *args: str, env: dict[str, str] | None = None, nofile: tuple[int, int] | None = None
) -> AsyncIterator[Daemon]:
    """Start `python -m aiodist serve ARGS` and yield it once it announced its address.

    With ``nofile``, the daemon starts with these (soft, hard) limits of open files.
    """
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    full_env.update(env or {})
    if nofile is None:
        cmd = [sys.executable, "-m", "aiodist", "serve", *args]
    else:
        cmd = [sys.executable, "-c", _NOFILE, "{}:{}".format(*nofile), *args]
    async with await open_process(cmd, env=full_env) as proc:
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


async def run_cli(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    full_env.update(env or {})
    with anyio.fail_after(60):
        result = await anyio.run_process(
            [sys.executable, "-m", "aiodist", *args], env=full_env, check=False
        )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


def token_file(tmp_path: Path, token: str = TOKEN) -> Path:
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path
