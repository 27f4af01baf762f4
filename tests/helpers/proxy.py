"""A recording TCP proxy: what a man in the middle would see, and a byte it could change.

``RecordingProxy(target)`` listens on 127.0.0.1 and forwards every connection
to ``target`` (real sockets both ways), keeping every byte that passed in
``seen``. With ``tamper_at=N`` it flips one bit of the N-th byte that goes from
the side that connected towards ``target`` (counted over all connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket


class RecordingProxy:
    def __init__(self, target: tuple[str, int], *, tamper_at: int | None = None) -> None:
        self.target = target
        self.seen = bytearray()
        self.forwarded = 0  # bytes sent towards the target
        self.tamper_at = tamper_at
        self.tampered = asyncio.Event()
        self.address: tuple[str, int] = ("", 0)
        self._server: asyncio.Server | None = None
        self._sock: socket.socket | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> RecordingProxy:
        # Bound here, so that aclose() closes it even if this start is cancelled midway.
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self.address = self._sock.getsockname()[:2]
        self._server = await asyncio.start_server(self._serve, sock=self._sock)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers += [writer, up_writer]
        towards = asyncio.create_task(self._pipe(reader, up_writer, upstream=True))
        back = asyncio.create_task(self._pipe(up_reader, writer, upstream=False))
        self._tasks |= {towards, back}
        await asyncio.gather(towards, back, return_exceptions=True)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        try:
            while data := await reader.read(256 * 1024):
                self.seen += data
                if upstream:
                    at = self.tamper_at
                    if at is not None and self.forwarded <= at < self.forwarded + len(data):
                        changed = bytearray(data)
                        changed[at - self.forwarded] ^= 0x01
                        data = bytes(changed)
                        self.tampered.set()
                    self.forwarded += len(data)
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                writer.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._sock is not None:
            self._sock.close()
        for writer in self._writers:
            with contextlib.suppress(OSError):
                writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        if self._server is not None:
            await self._server.wait_closed()
