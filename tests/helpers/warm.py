"""The suite's processes, forked warm: ``open_process`` as anyio's, torch already imported.

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
import subprocess
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import ByteReceiveStream, Process

from aiodist._launch.forkserver import Forked, ForkServer

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Mapping, Sequence
    from pathlib import Path

__all__ = ["WarmProcess", "open_process"]

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


class WarmProcess(Process):
    """A forked process as anyio's ``Process`` (its standard input is empty: no stream)."""

    def __init__(self, forked: Forked) -> None:
        self._forked = forked
        self._stdout = _Reader(forked.stdout)
        self._stderr = _Reader(forked.stderr)

    @property
    def stdin(self) -> None:
        return None

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
    """``anyio.open_process(argv, env=..., cwd=...)``, forked warm where it can be."""
    if not streams or all(v == subprocess.PIPE for v in streams.values()):
        forked = await _forks().start(
            list(argv),
            dict(os.environ if env is None else env),
            None if cwd is None else str(cwd),
        )
        if forked is not None:
            return WarmProcess(forked)
    return await anyio.open_process(argv, env=env, cwd=cwd, **streams)
