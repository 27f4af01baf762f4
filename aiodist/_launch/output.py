"""The ranks' output under ``aiodist run``: as it comes, each line prefixed with its rank.

Every rank's stdout and stderr are read as they come. Whole lines are written
at once; a partial line (a progress bar redrawn with ``\\r``, say) is written
once nothing more came for ``PARTIAL_DELAY`` seconds, so tqdm's bar shows
live, while ``print``'s text and its newline, which an unbuffered rank writes
separately, still make one line. The prefix (``[rank 3] ``) goes before the
first byte of each line, and again after each ``\\r``, so a redrawn bar keeps
it, in place of the ``[rankN]: `` that torch.distributed's excepthook puts
before each line of a traceback (one prefix is enough). The ranks share the
launcher's stdout (and stderr): when a rank writes
while another rank's partial line is out, that line is ended first, so a line
never carries two ranks' text; the other rank goes on on a line of its own,
prefixed (the newline that would have ended its interrupted line is then not
written again).
"""

from __future__ import annotations

import asyncio
import re
from typing import IO, Final

READ_CHUNK_BYTES: Final = 64 * 1024
PARTIAL_DELAY: Final = 0.05  # how long a partial line waits for the rest of it
MAX_PENDING_BYTES: Final = 1024 * 1024  # a longer partial line is written at once
_SEPARATOR: Final = re.compile(rb"([\r\n])")
_TORCH_PREFIX: Final = re.compile(rb"\[rank\d+\]: ?")  # torch.distributed's excepthook's


class Sink:
    """One stream the ranks write to, and which rank's line on it is unfinished."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.open_by: object | None = None  # the pump whose written line has no end yet
        self._writable = True

    def line(self, text: str) -> None:
        """Write ``text`` as a line of the launcher's own, after any rank's unfinished one."""
        self.write(("\n" if self.open_by is not None else "").encode() + text.encode() + b"\n")
        self.open_by = None

    def write(self, data: bytes) -> None:
        if not self._writable or not data:
            return
        try:
            self.stream.write(data)
            self.stream.flush()
        except (BrokenPipeError, ValueError):  # our reader went away (`| head`): discard
            self._writable = False


class _Writer:
    """One rank's stream into a sink: where its line stands."""

    def __init__(self, sink: Sink, prefix: bytes) -> None:
        self.sink = sink
        self.prefix = prefix
        self.at_start = True  # the next byte begins a line, or follows a \r
        self.open = False  # our last write left a line unfinished

    def write(self, data: bytes) -> None:
        """Write ``data`` (whole lines, or a partial line) to the sink."""
        sink = self.sink
        if self.open and sink.open_by is not self:
            # Another rank's output ended our unfinished line: its newline was written.
            self.open, self.at_start = False, True
            data = data.removeprefix(b"\n")
        if not data:
            return
        out = bytearray()
        if sink.open_by is not None and sink.open_by is not self:
            out += b"\n"  # another rank's line is unfinished: end it before ours
        for piece in _SEPARATOR.split(data):
            if piece == b"\n" or piece == b"\r":
                out += piece
                self.at_start = True
            elif piece:
                if self.at_start:
                    if self.prefix and (torch := _TORCH_PREFIX.match(piece)):
                        piece = piece[torch.end() :]
                    out += self.prefix
                    self.at_start = False
                out += piece
        # A line is open unless ``data`` ended one; after a \r it is being redrawn.
        self.open = not data.endswith(b"\n")
        sink.open_by = self if self.open else None
        sink.write(bytes(out))

    def end(self) -> None:
        """The rank's stream ended: a last line without a newline is kept whole."""
        if self.sink.open_by is self:
            self.sink.write(b"\n")
            self.sink.open_by = None
        self.open = False


async def pump(
    stream: asyncio.StreamReader, sink: Sink, prefix: bytes, partial_delay: float = PARTIAL_DELAY
) -> None:
    """Copy ``stream`` to ``sink`` as it comes, ``prefix`` before each line's first byte."""
    writer = _Writer(sink, prefix)
    pending = b""  # a partial line not written yet
    while True:  # always drain: ranks never block on a full pipe
        if pending:
            try:
                # StreamReader.read is cancellation-safe: nothing read is lost.
                chunk = await asyncio.wait_for(stream.read(READ_CHUNK_BYTES), partial_delay)
            except TimeoutError:
                writer.write(pending)  # nothing more came: show it as it is
                pending = b""
                continue
        else:
            chunk = await stream.read(READ_CHUNK_BYTES)
        if not chunk:
            break
        data = pending + chunk
        cut = data.rfind(b"\n") + 1  # a \r's redraw waits with the rest of its line
        if len(data) - cut > MAX_PENDING_BYTES:
            cut = len(data)
        if cut:
            writer.write(data[:cut])
        pending = data[cut:]
    if pending:
        writer.write(pending)
    writer.end()
