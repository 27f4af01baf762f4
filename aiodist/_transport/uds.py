"""Unix-domain-socket transport for ranks on one host: ``uds:NAME``.

Names live in Linux's abstract namespace: no file to create, clean up or
leave behind after a crash. The sockets are made here and handed to the loop
(``sock=``) because uvloop cannot connect to an abstract name by itself.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import sys
from typing import TYPE_CHECKING, Final

from aiodist._transport.admission import Admission, SocketListener, serve
from aiodist._transport.stream import StreamChannel

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._transport.base import FrameSink
    from aiodist._wire.preauth import PreAuthLimits

    # Makes the protocol of one connection: its sink, and its listener's admission
    # (None on the connecting side).
    MakeChannel = Callable[[FrameSink, Admission | None], StreamChannel]

scheme: Final = "uds"
SOCKET_BUFFER_BYTES: Final = 4 * 1024 * 1024
# As tcp.LISTEN_BACKLOG: a connect beyond it fails at once (EAGAIN) on a Unix socket.
LISTEN_BACKLOG: Final = 1024


def available() -> bool:
    """Abstract Unix sockets exist on Linux only."""
    return sys.platform.startswith("linux")


def _tune(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


async def listen(
    host: str,
    sink_factory: Callable[[], FrameSink],
    make_channel: MakeChannel = StreamChannel,
    *,
    preauth: PreAuthLimits | None = None,
) -> SocketListener:
    """Listen on a fresh abstract name (``host`` is unused: same-host only).

    ``make_channel`` makes the protocol of each accepted connection (``shmring``'s).
    ``preauth`` bounds what a connection may cost before its handshake (see
    ``admission.py``; default ``DEFAULT_PREAUTH``): the name is visible to every
    user of the host (``/proc/net/unix``), so anyone may connect.
    """
    admission = Admission(preauth)
    name = f"aiodist-{os.getpid()}-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _tune(sock)
    sock.bind("\0" + name)
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    server = await serve(sock, lambda: make_channel(sink_factory(), admission), LISTEN_BACKLOG)
    return SocketListener(f"uds:{name}", server, admission)


def socket_name(address: str) -> str:
    """The abstract name of a ``uds:NAME`` or ``uds:NAME#MEMBER`` address."""
    return address.removeprefix("uds:").partition("#")[0]


def member_of(address: str) -> int:
    """The member a ``uds:NAME#MEMBER`` address names on a shared listener (0: none)."""
    _, _, member = address.partition("#")
    return int(member) if member.isdigit() else 0


async def connect(
    address: str,
    sink: FrameSink,
    make_channel: MakeChannel = StreamChannel,
) -> StreamChannel:
    """Connect to a ``uds:`` address a rank on this host published."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _tune(sock)
        sock.setblocking(False)
        await loop.sock_connect(sock, "\0" + socket_name(address))
        _, channel = await loop.create_unix_connection(lambda: make_channel(sink, None), sock=sock)
    except BaseException:
        sock.close()
        raise
    return channel
