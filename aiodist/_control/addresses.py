"""Finding this host's address that other hosts can reach, as torch's gloo does.

A server that ranks on other hosts must reach (the one ``aiodist run`` hosts on
node 0, the one rank 0 embeds under torchrun or with ``file://``) binds one
address of this host, found in this order:

1. ``$AIODIST_HOST``: the address to bind, as the daemon's ``--host``.
2. ``$AIODIST_SOCKET_IFNAME``: the IPv4 address of that network interface,
   the way ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` pick one.
3. The address this host reaches a given peer from (torchrun's store on the
   master node): the kernel's choice of source address for that route, found
   without sending a packet.
4. This host's name resolved, as torch does (``socket.getfqdn()``), if it
   resolves to a non-loopback address of this host.

The data plane needs no such search: each rank listens on the address it
reaches the server from, which is one the server's other clients can reach too.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from typing import TYPE_CHECKING, Final

from aiodist import _settings
from aiodist._errors import RendezvousError

if TYPE_CHECKING:
    from collections.abc import Mapping

_SIOCGIFADDR: Final = 0x8915  # Linux: an interface's IPv4 address
_IFNAMSIZ: Final = 16


def is_loopback(host: str) -> bool:
    """Whether ``host`` reaches this host only (never resolves a name but ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux).

    Raises:
        RendezvousError: No such interface, or it has no IPv4 address.
    """
    if not 0 < len(name.encode()) < _IFNAMSIZ:
        raise RendezvousError(f"AIODIST_SOCKET_IFNAME={name!r} is not an interface name")
    request = struct.pack("256s", name.encode())
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
    except OSError as exc:
        known = ", ".join(n for _, n in socket.if_nameindex())
        raise RendezvousError(
            f"AIODIST_SOCKET_IFNAME={name!r}: no IPv4 address on that interface "
            f"({exc.strerror or exc}); this host has {known}"
        ) from exc
    return socket.inet_ntoa(reply[20:24])


def _bindable(address: str) -> bool:
    """Whether ``address`` belongs to this host (binding it succeeds)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def is_local(host: str) -> bool:
    """Whether ``host`` names this host: loopback, or an address this host can bind.

    A name is resolved (this blocks: call it from a thread in async code).
    """
    if is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return any(_bindable(str(sockaddr[0])) for *_, sockaddr in infos)


def _route_source(peer: str) -> str | None:
    """The source address this host would use to reach ``peer``; nothing is sent."""
    try:
        infos = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as sock:
            sock.connect(sockaddr)  # UDP: picks the route, sends nothing
            return str(sock.getsockname()[0])
    return None


def _resolved_hostname() -> str | None:
    """This host's name resolved to a non-loopback address of this host, as torch does."""
    for name in dict.fromkeys((socket.getfqdn(), socket.gethostname())):
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError:
            continue
        for *_, sockaddr in infos:
            address = str(sockaddr[0])
            if not is_loopback(address) and _bindable(address):
                return address
    return None


def reachable_host(toward: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """An address of this host that other hosts can reach (see the module's order).

    Args:
        toward: A peer other hosts reach too (the master's address), whose route
            names the interface to use; None to skip that step.
        environ: The environment to read; defaults to ``os.environ``.

    Raises:
        RendezvousError: No such address was found; the message says what to set.
    """
    env = os.environ if environ is None else environ
    if host := _settings.HOST.read(env):
        return host
    if ifname := _settings.SOCKET_IFNAME.read(env):
        return interface_address(ifname)
    if toward and (source := _route_source(toward)) is not None and not is_loopback(source):
        return source
    if (resolved := _resolved_hostname()) is not None:
        return resolved
    raise RendezvousError(
        f"cannot find an address of host {socket.gethostname()!r} that other hosts can reach: "
        "its name resolves to a loopback address"
        + (f" and it reaches {toward} over loopback" if toward else "")
        + "; set AIODIST_SOCKET_IFNAME=<interface> (e.g. eth0) or AIODIST_HOST=<address>"
    )
