"""TCP transport: ``tcp://HOST:PORT`` with numeric hosts, Nagle off."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from aiodist._transport.admission import Admission, serve
from aiodist._transport.stream import StreamChannel

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._transport.base import FrameSink
    from aiodist._wire.preauth import PreAuthLimits

scheme: Final = "tcp"
SOCKET_BUFFER_BYTES: Final = 4 * 1024 * 1024
# Connections a listener queues before accepting them: every peer of a large job may
# connect at once. (``admission.serve`` keeps the loop's number from replacing it.)
LISTEN_BACKLOG: Final = 1024


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


@dataclass
class TcpListener:
    address: str
    server: asyncio.Server
    admission: Admission

    def close(self) -> None:
        self.server.close()
        self.admission.close()


async def listen(
    host: str, sink_factory: Callable[[], FrameSink], *, preauth: PreAuthLimits | None = None
) -> TcpListener:
    """Listen on ``host`` (numeric) at a port the OS picks.

    ``preauth`` bounds what a connection may cost before its handshake (see
    ``admission.py``; default ``DEFAULT_PREAUTH``).
    """
    admission = Admission(preauth)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _tune(sock)  # accepted sockets inherit the buffer sizes
    sock.bind((host, 0))
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    server = await serve(sock, lambda: StreamChannel(sink_factory(), admission), LISTEN_BACKLOG)
    bound_host, port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
    return TcpListener(f"tcp://{shown}:{port}", server, admission)


def parse(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


async def connect(address: str, sink: FrameSink) -> StreamChannel:
    """Connect to a ``tcp://`` address another rank published."""
    loop = asyncio.get_running_loop()
    host, port = parse(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        _tune(sock)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        _, channel = await loop.create_connection(lambda: StreamChannel(sink), sock=sock)
    except BaseException:
        sock.close()
        raise
    return channel
