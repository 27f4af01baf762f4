"""TCP transport: ``tcp://HOST:PORT`` with numeric hosts, Nagle off."""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Any, Final, TypeVar

from aiodist._transport.admission import Admission, SocketListener, serve
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

P = TypeVar("P", bound=asyncio.BaseProtocol)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


async def listen(
    host: str, sink_factory: Callable[[], FrameSink], *, preauth: PreAuthLimits | None = None
) -> SocketListener:
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
    return SocketListener(f"tcp://{shown}:{port}", server, admission)


def parse(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


async def connect(address: str, sink: FrameSink) -> StreamChannel:
    """Connect to a ``tcp://`` address another rank published."""
    host, port = parse(address)
    return await dial(host, port, lambda: StreamChannel(sink))


async def dial(host: str, port: int, protocol_factory: Callable[[], P], **kwargs: Any) -> P:
    """Connect a tuned socket to ``host:port`` (numeric) and hand it to the loop.

    ``kwargs`` go to ``loop.create_connection`` (``tls.connect``'s ``ssl=``); the
    socket is closed if anything fails.
    """
    loop = asyncio.get_running_loop()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        _tune(sock)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        _, protocol = await loop.create_connection(protocol_factory, sock=sock, **kwargs)
    except BaseException:
        sock.close()
        raise
    return protocol
