"""The suite's processes, forked warm: ``open_process`` as anyio's, torch and aiodist imported.

A test worker (``python worker.py ...``) or launcher (``python -m aiodist run ...``)
exec'd pays about 2.5 s of CPU importing torch and aiodist before its first line;
the suite starts hundreds. Here each pytest process keeps one of aiodist's own fork
servers (``aiodist/_launch/forkserver.py``, what ``aiodist run`` starts its ranks
with by default) and forks them from it: each is still a process of its own, a
child of the test's process, in a session of its own, with its pid, signals, exit
status and pipes as anyio gives them. A command that is not such a Python
command, or asks for other streams than pipes, is exec'd as before.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
from typing import IO, TYPE_CHECKING, Any, TypeAlias

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream, Process

from aiodist._launch.forkserver import Forked, ForkServer

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Mapping, Sequence
    from pathlib import Path

__all__ = ["Proc", "WarmPopen", "WarmProcess", "open_process", "popen", "run"]

_server: ForkServer | None = None


def _forks() -> ForkServer:
    global _server
    if _server is None:
        _server = ForkServer()
        atexit.register(_server.close)
    return _server


class _Reader(ByteReceiveStream):
    def __init__(self, reader: asyncio.StreamReader) -> None:
        self._reader = reader

    async def receive(self, max_bytes: int = 65536) -> bytes:
        data = await self._reader.read(max_bytes)
        if not data:
            raise anyio.EndOfStream
        return data

    async def aclose(self) -> None:
        self._reader.feed_eof()


class _Writer(ByteSendStream):
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer

    async def send(self, item: bytes) -> None:
        self._writer.write(item)
        await self._writer.drain()

    async def aclose(self) -> None:
        self._writer.close()


class WarmProcess(Process):
    """A forked process as anyio's ``Process``."""

    def __init__(self, forked: Forked) -> None:
        self._forked = forked
        self._stdout = _Reader(forked.stdout)
        self._stderr = _Reader(forked.stderr)
        self._stdin = None if forked.stdin is None else _Writer(forked.stdin)

    @property
    def stdin(self) -> ByteSendStream | None:
        return self._stdin

    @property
    def stdout(self) -> ByteReceiveStream:
        return self._stdout

    @property
    def stderr(self) -> ByteReceiveStream:
        return self._stderr

    @property
    def pid(self) -> int:
        return self._forked.pid

    @property
    def returncode(self) -> int | None:
        return self._forked.returncode

    async def wait(self) -> int:
        return await self._forked.wait()

    def send_signal(self, sig: int) -> None:
        self._forked.send_signal(sig)

    def terminate(self) -> None:
        self._forked.terminate()

    def kill(self) -> None:
        self._forked.kill()

    async def aclose(self) -> None:
        """As anyio's: close the pipes, wait for the end (killing it if the wait is cancelled)."""
        self._forked.close_pipes()
        try:
            await self.wait()
        except BaseException:
            self.kill()
            with anyio.CancelScope(shield=True):
                await self.wait()
            raise


async def open_process(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    **streams: Any,
) -> Process:
    """``anyio.open_process(argv, env=..., cwd=...)``, forked warm where it can be (its
    ``stderr`` may also be a file: ``stderr=open(path, "wb")``)."""
    stderr = streams.pop("stderr", subprocess.PIPE)
    to_file = hasattr(stderr, "fileno")
    if (stderr == subprocess.PIPE or to_file) and all(
        v == subprocess.PIPE
        for v in streams.values()  # none given: pipes, as anyio
    ):
        forked = await _forks().start(
            list(argv),
            dict(os.environ if env is None else env),
            None if cwd is None else str(cwd),
            stdin_pipe=True,
            stderr=stderr.fileno() if to_file else None,
        )
        if forked is not None:
            return WarmProcess(forked)
    return await anyio.open_process(argv, env=env, cwd=cwd, stderr=stderr, **streams)


class WarmPopen:
    """A forked process as much of ``subprocess.Popen`` as the suite uses (text mode)."""

    def __init__(self, pid: int, stdout: IO[str] | None, stderr: IO[str] | None) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = stdout
        self.stderr = stderr

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read both pipes to their end and wait, within ``timeout`` s in all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        texts: dict[str, list[str]] = {"stdout": [], "stderr": []}
        readers = [
            threading.Thread(target=lambda f=f, n=n: texts[n].append(f.read()), daemon=True)
            for n, f in (("stdout", self.stdout), ("stderr", self.stderr))
            if f is not None and not f.closed
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return "".join(texts["stdout"]), "".join(texts["stderr"])


Proc: TypeAlias = "WarmPopen | subprocess.Popen[str]"  # what ``popen`` returns


def popen(
    argv: Sequence[str],
    *,
    stdout: int | None = None,
    stderr: int | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> Proc:
    """``subprocess.Popen(argv, stdout=, stderr=, text=True, env=, cwd=)``, forked warm
    where it can be (``stdout``/``stderr``: ``PIPE``, ``DEVNULL`` or None)."""
    ours: list[int] = [os.open(os.devnull, os.O_RDONLY)]
    theirs: list[int] = [ours[0]]
    pipes: list[int | None] = []
    for how, fd in ((stdout, 1), (stderr, 2)):
        if how == subprocess.PIPE:
            r, w = os.pipe()
            ours.append(w)
            theirs.append(w)
            pipes.append(r)
        elif how == subprocess.DEVNULL:
            null = os.open(os.devnull, os.O_WRONLY)
            ours.append(null)
            theirs.append(null)
            pipes.append(None)
        elif how is None:
            theirs.append(fd)
            pipes.append(None)
        else:
            break
    pid: int | None = None
    if len(theirs) == 3:
        pid = _forks().fork(
            list(argv),
            dict(os.environ if env is None else env),
            None if cwd is None else str(cwd),
            theirs,
        )
    for fd in ours:
        os.close(fd)
    if pid is None:
        for read_end in pipes:
            if read_end is not None:
                os.close(read_end)
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True, env=env, cwd=cwd)
    out, err = (None if fd is None else open(fd, errors="replace") for fd in pipes)
    return WarmPopen(pid, out, err)


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=...)``, forked warm."""
    proc = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode is not None
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
