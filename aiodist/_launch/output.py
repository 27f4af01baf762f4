"""The ranks' output under ``aiodist run``: each piece as it comes, prefixed with its rank.

Every rank's stdout and stderr are read as they come and written at once, not
when a line ends, so a progress bar that redraws its line with ``\\r`` (tqdm)
shows live. The prefix (``[rank 3] ``) goes before the first byte of each
line, and again after each ``\\r``, so a redrawn bar keeps it. The ranks share
the launcher's stdout (and stderr): when a rank writes while another rank's
line is unfinished, that line is ended first, so a line never carries two
ranks' text; the other rank's next bytes start a line of their own, prefixed.
"""

from __future__ import annotations

import re
from typing import IO, TYPE_CHECKING, Final

if TYPE_CHECKING:
    import asyncio

__all__ = ["READ_CHUNK_BYTES", "Sink", "pump"]

READ_CHUNK_BYTES: Final = 64 * 1024
_SEPARATOR: Final = re.compile(rb"([\r\n])")


class Sink:
    """One stream the ranks write to, and which rank's line on it is unfinished."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.open_by: object | None = None  # the pump whose line has no end yet
        self._writable = True

    def write(self, data: bytes) -> None:
        if not self._writable or not data:
            return
        try:
            self.stream.write(data)
            self.stream.flush()
        except (BrokenPipeError, ValueError):  # our reader went away (`| head`): discard
            self._writable = False


async def pump(stream: asyncio.StreamReader, sink: Sink, prefix: bytes) -> None:
    """Copy ``stream`` to ``sink`` as it comes, ``prefix`` before each line's first byte."""
    me = object()
    at_start = True  # the next byte begins a line, or follows a \r
    while chunk := await stream.read(READ_CHUNK_BYTES):  # always drain: ranks never block
        out = bytearray()
        if sink.open_by is not me:
            if sink.open_by is not None:
                out += b"\n"  # another rank's line is unfinished: end it before ours
            at_start = True  # and ours, if it was, was ended by another rank's output
        for piece in _SEPARATOR.split(chunk):
            if piece == b"\n" or piece == b"\r":
                out += piece
                at_start = True
            elif piece:
                if at_start:
                    out += prefix
                    at_start = False
                out += piece
        # A line is open unless the chunk ended one; after a \r it is being redrawn.
        sink.open_by = None if chunk.endswith(b"\n") else me
        sink.write(bytes(out))
    if sink.open_by is me:  # a last line without a newline is kept whole
        sink.write(b"\n")
        sink.open_by = None
