"""Transports by name: the built-in ones, and those a user registers.

A transport (``base.Transport``: a ``scheme``, ``listen`` and ``connect``) is
known to a process under a name: ``tcp``, ``uds``, ``shm`` and ``tls`` are built in,
and more come from ``register_transport`` or from an entry point of the group
``aiodist.transports`` in an installed package (its name the transport's, its
object the transport), loaded the first time a name or scheme is asked for::

    [project.entry-points."aiodist.transports"]
    crc = "my_package.crc_transport:transport"

A job picks what its ranks listen on by name (``AIODIST_TRANSPORT``, see
``_plane/routes.py``); a rank connecting to a peer picks by the scheme of the
addresses the peer published (``crc://...``), so each scheme belongs to one
transport.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import threading
from typing import TYPE_CHECKING, Final

from aiodist._transport import shmring, tcp, tls, uds

if TYPE_CHECKING:
    from aiodist._transport.base import Transport

logger = logging.getLogger(__name__)

#: The entry point group packages register transports under.
ENTRY_POINT_GROUP: Final = "aiodist.transports"
#: The built-in transports, by name (``shm``: Unix sockets whose large payloads use rings;
#: ``tls``: TCP in mutual TLS, see ``tls.py``).
BUILTIN: Final[dict[str, Transport]] = {"tcp": tcp, "uds": uds, "shm": shmring, "tls": tls}
_NAME: Final = re.compile(r"[a-z][a-z0-9_.+-]{0,31}")
_SCHEME: Final = re.compile(r"[a-z][a-z0-9.+-]{0,31}")

_lock = threading.Lock()  # a process may register from any thread
_registered: dict[str, Transport] = {}
_entry_points_loaded = False


def register_transport(name: str, transport: Transport, *, replace: bool = False) -> None:
    """Make ``transport`` known to this process as ``name``.

    Every rank of a job that uses it registers it (before it joins), under the
    same name: peers publish their addresses with the transport's ``scheme``,
    and a rank connects with the transport that owns the scheme it reads.

    Args:
        name: What ``AIODIST_TRANSPORT`` calls it: lowercase letters, digits
            and ``_.+-``, starting with a letter; not a built-in's.
        transport: An object (or module) with ``scheme``, ``listen`` and
            ``connect`` (see ``aiodist.transport.Transport``); it should pass
            ``aiodist.testing.check_data_channel``.
        replace: Replace a transport registered under ``name`` before.

    Raises:
        ValueError: A bad or built-in name, a name taken (without ``replace``),
            or a scheme another transport owns.
        TypeError: ``transport`` lacks ``scheme``, ``listen`` or ``connect``.

    Example:
        >>> aiodist.register_transport("crc", CrcTransport())
        >>> os.environ["AIODIST_TRANSPORT"] = "crc"   # this job's ranks listen on it
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"a transport's name is 1 to 32 lowercase letters, digits or '_.+-', starting "
            f"with a letter; got {name!r}"
        )
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in transport's name; choose another")
    scheme = getattr(transport, "scheme", None)
    if not callable(getattr(transport, "listen", None)) or not callable(
        getattr(transport, "connect", None)
    ):
        raise TypeError(f"transport {name!r} needs listen() and connect(); got {transport!r}")
    if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme):
        raise TypeError(
            f"transport {name!r} needs a scheme (lowercase letters, digits or '.+-', "
            f"starting with a letter) for its addresses; got {scheme!r}"
        )
    with _lock:
        if name in _registered and not replace:
            raise ValueError(f"a transport is registered as {name!r} already (pass replace=True)")
        owner = _owner(scheme)
        if owner is not None and owner != name:
            raise ValueError(
                f"scheme {scheme!r} belongs to transport {owner!r}; give {name!r} another one"
            )
        _registered[name] = transport


def unregister_transport(name: str) -> None:
    """Forget the transport registered as ``name`` (ranks already listening keep it)."""
    with _lock:
        _registered.pop(name, None)


def registered() -> dict[str, Transport]:
    """Every transport this process knows, by name: the built-in ones first."""
    _load_entry_points()
    with _lock:
        return {**BUILTIN, **_registered}


def get_transport(name: str) -> Transport:
    """The transport called ``name``.

    Raises:
        ValueError: No transport has that name here; the message lists those that do.
    """
    found = BUILTIN.get(name) or _registered.get(name)
    if found is None:
        _load_entry_points()
        found = _registered.get(name)
    if found is None:
        raise ValueError(
            f"no data-plane transport is called {name!r} in this process (known: "
            f"{', '.join(registered())}); register it with aiodist.register_transport() "
            f"before joining, or install the package whose {ENTRY_POINT_GROUP!r} entry point "
            "provides it"
        )
    return found


def by_scheme(scheme: str) -> Transport | None:
    """The registered (not built-in) transport whose addresses start ``scheme:``, if any."""
    owner = _owner(scheme)
    if owner is None and not _entry_points_loaded:
        _load_entry_points()
        owner = _owner(scheme)
    return None if owner is None else _registered.get(owner)


def _owner(scheme: str) -> str | None:
    if scheme in ("tcp", "uds", "tls"):
        return scheme
    return next((n for n, t in list(_registered.items()) if t.scheme == scheme), None)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in _registered:
            continue  # registered by hand: that one wins
        try:
            register_transport(entry.name, entry.load())
        except Exception as exc:  # a broken plugin must not stop the job
            logger.warning("ignoring transport %r from entry point %s: %s", entry.name, entry, exc)
