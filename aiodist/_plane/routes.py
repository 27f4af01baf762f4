"""Which transports a rank listens on, and which one carries each peer pair.

**Per job**: ``AIODIST_TRANSPORT`` (or ``open_process_group(transport=...)``)
names the transports every rank listens on, in the order it prefers them,
comma-separated: ``tcp``, ``uds``, ``shm`` (Unix sockets whose large payloads
go through shared-memory rings, and shared-memory collectives) and any
transport registered under a name (``_transport/registry.py``). Unset, a
rank does what suits one machine or many: a Unix socket (with rings where
``/dev/shm`` allows, unless ``AIODIST_UDS=0`` or ``AIODIST_SHM=0``), and TCP
unless every member is on this host.

**Per peer pair**: a rank publishes its addresses in that order, each naming
its scheme (``tcp://``, ``uds:``, ``crc://``). A rank connecting to a peer
takes the first of them whose scheme it has a transport for; for the
built-in ones it takes a Unix socket to a peer on its own host, else TCP.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
from typing import TYPE_CHECKING, Final

from aiodist import _settings
from aiodist._transport import registry, shm, shmring, tcp, tls, uds

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from aiodist._plane.channel import ChannelState
    from aiodist._transport.base import DataChannel

logger = logging.getLogger(__name__)

_CAPABILITY_SCHEME: Final = "shm"  # shm.capability(): a promise among the addresses, not one


class Selection:
    """The transports one rank listens on (see the module docstring).

    ``use_uds``, ``use_shm``, ``use_tcp``: the built-in ones; ``custom``: the
    names of the others, in order. ``order`` is every name in publishing
    order (the built-in Unix socket first when none was named).
    """

    def __init__(self, names: Sequence[str] | None) -> None:
        self.named = names is not None
        # With TLS configured, TCP means TLS: this rank never listens in clear over TCP.
        self.tls = tls.from_env() is not None
        if names is None:
            self.use_uds = uds.available() and _settings.UDS.read()
            self.use_shm = shm.available()
            self.use_tcp = True
            self.order: tuple[str, ...] = ("uds", "tls" if self.tls else "tcp")
            self.custom: tuple[str, ...] = ()
            return
        for name in names:
            registry.get_transport(name)  # ValueError for a name nobody registered
        if self.tls:
            names = ["tls" if n == "tcp" else n for n in names]
        self.order = tuple(dict.fromkeys(names))
        self.use_shm = "shm" in self.order and shm.available()
        self.use_uds = uds.available() and ("uds" in self.order or "shm" in self.order)
        self.use_tcp = "tcp" in self.order or "tls" in self.order
        self.custom = tuple(n for n in self.order if n not in registry.BUILTIN)


def selection(value: str | Sequence[str] | None = None) -> Selection:
    """The transports of this job: ``value``, else ``$AIODIST_TRANSPORT``, else the default.

    Raises:
        ValueError: A name no transport has in this process.
    """
    if value is None:
        value = _settings.TRANSPORT.read()
    if value is None:
        return Selection(None)
    parts = value.split(",") if isinstance(value, str) else list(value)
    names = [n.strip() for n in parts if n.strip()]
    if not names:
        raise ValueError(f"no transport named in {value!r}")
    return Selection(names)


@functools.cache  # asked by every member that joins; a process has few local addresses
def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def scheme_of(address: str) -> str:
    """The scheme an address starts with: ``tcp``, ``uds``, ``crc``, ..."""
    return address.partition(":")[0]


async def connect(
    dst: int,
    addresses: Sequence[str],
    sink: ChannelState,
    *,
    local: bool,
    use_uds: bool,
    use_shm: bool,
) -> DataChannel:
    """Connect to rank ``dst``, which published ``addresses``, with ``sink`` receiving.

    ``local``: ``dst`` runs on this host. Sets ``sink.member`` to the member
    its hello must name (a shared Unix-socket listener's, else 0).
    """
    for address in addresses:
        scheme = scheme_of(address)
        if scheme in ("tcp", "uds", "tls"):
            break  # the built-in ones: chosen together, below
        if scheme == _CAPABILITY_SCHEME:
            continue
        transport = registry.by_scheme(scheme)
        if transport is not None:
            sink.member = 0  # a plane's own listener
            return await transport.connect(address, sink)
    uds_addr = [a for a in addresses if a.startswith("uds:")]
    tcp_addr, tcp_connect = tls_route(dst, addresses, local=local and use_uds and bool(uds_addr))
    # A peer that published no TCP address listens on this host only (see listen):
    # its Unix socket is the way, whatever this rank's AIODIST_UDS or host name says.
    if uds_addr and (not tcp_addr or (use_uds and local)):
        rings = local and use_shm and shm.capability() in addresses
        sink.member = uds.member_of(uds_addr[0])  # the hello names it
        try:
            if rings:
                return await shmring.connect(uds_addr[0], sink)
            return await uds.connect(uds_addr[0], sink)
        except OSError:
            if not tcp_addr:
                raise
            logger.debug("falling back to TCP for rank %d", dst)
    if not tcp_addr:
        schemes = sorted({scheme_of(a) for a in addresses} - {_CAPABILITY_SCHEME})
        hint = (
            f" (it uses {', '.join(schemes)}: register that transport here too, under the "
            "name the job's AIODIST_TRANSPORT gives it)"
            if schemes
            else ""
        )
        raise ConnectionError(f"rank {dst} published no reachable data-plane address{hint}")
    sink.member = 0  # a plane's own TCP listener: no member to name
    return await tcp_connect(tcp_addr[0], sink)


def tls_route(
    dst: int, addresses: Sequence[str], *, local: bool
) -> tuple[list[str], Callable[[str, ChannelState], Awaitable[DataChannel]]]:
    """The addresses of ``dst`` this rank may reach it at over TCP, and how to connect.

    A rank with ``AIODIST_TLS_*`` set takes only ``tls://`` ones; a rank without
    takes only ``tcp://`` ones. A peer that offers none of the kind this rank
    needs (and no Unix socket this rank uses, ``local``) is refused at once,
    with what to set: TLS is never given up for clear TCP, either way.

    Raises:
        TlsMismatch: Only the other kind is published.
    """
    want_tls = tls.from_env() is not None
    mine = [a for a in addresses if a.startswith("tls://" if want_tls else "tcp://")]
    other = [a for a in addresses if a.startswith("tcp://" if want_tls else "tls://")]
    if not mine and other and not local:
        if want_tls:
            why = (
                f"rank {dst} speaks clear TCP (it published {other[0]}) and this rank requires "
                "TLS (AIODIST_TLS_* is set); set AIODIST_TLS_CERT, AIODIST_TLS_KEY and "
                "AIODIST_TLS_CA on every rank of the job, or on none"
            )
        else:
            why = (
                f"rank {dst} requires TLS (it published {other[0]}) and this rank has no TLS "
                "configuration; set AIODIST_TLS_CERT, AIODIST_TLS_KEY and AIODIST_TLS_CA on "
                "this rank too"
            )
        raise TlsMismatch(why)
    return mine, (tls.connect if want_tls else tcp.connect)


class TlsMismatch(ConnectionError):
    """A peer publishes TCP addresses of the other kind (clear, or TLS) only."""
