"""One control connection per server per process: the table members share.

The first member of a process to reach a server (per event loop, host, port
and token) connects; members after it open their channels on that connection,
or wait for its connect. A connection that failed or lost its last member is
dropped from the table, and the next member connects anew.
``AIODIST_SHARED_CONTROL=0`` gives each member a connection of its own.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from typing import TYPE_CHECKING

from aiodist import _settings
from aiodist._control.connection import ControlConnection, connect_control
from aiodist._errors import AuthenticationError, RendezvousTimeout

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._control.channel import ControlChannel, Notice

_Key = tuple[str, int, str]
# Per event loop: the shared connection to each (host, port, token), or its connect in progress.
_shared: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[_Key, asyncio.Future[ControlConnection]]
] = weakref.WeakKeyDictionary()
# Shared connects that give up at once when refused (a rank that may embed the server).
_probes: weakref.WeakSet[asyncio.Future[ControlConnection]] = weakref.WeakSet()


def _forget(loop: asyncio.AbstractEventLoop, key: _Key, conn: ControlConnection) -> None:
    """Take a failed or emptied connection out of the shared table: the next member reconnects."""
    table = _shared.get(loop)
    if table is None:
        return
    future = table.get(key)
    if future is not None and future.done() and not future.cancelled():
        if future.exception() is None and future.result() is conn:
            del table[key]


def sharing_enabled() -> bool:
    """Whether members of this process share a control connection (``AIODIST_SHARED_CONTROL``)."""
    return _settings.SHARED_CONTROL.read()


async def open_channel(
    host: str,
    port: int,
    *,
    timeout: float,
    on_notice: Callable[[Notice], None] | None = None,
    retry_refused: bool = True,
    token: str | None = None,
) -> ControlChannel:
    """A new member's channel to the server at ``host:port``.

    Members of one process share the connection to a server (one per token):
    the first connects, the others wait for that connect and open their
    channels on it. Arguments and errors are ``connect_control``'s.
    """
    if token is None:
        token = _settings.TOKEN.read() or ""
    if not sharing_enabled():
        conn = await connect_control(
            host, port, timeout=timeout, retry_refused=retry_refused, token=token
        )
        return conn.open_channel(on_notice)
    loop = asyncio.get_running_loop()
    table = _shared.setdefault(loop, {})
    key = (host, port, token)
    deadline = loop.time() + timeout
    while True:
        future = table.get(key)
        if future is None or (future.done() and _unusable(future)):
            future = table[key] = asyncio.ensure_future(
                connect_control(
                    host, port, timeout=timeout, retry_refused=retry_refused, token=token
                )
            )
            future.add_done_callback(lambda f: _connected(loop, key, f))
            if not retry_refused:
                _probes.add(future)
        elif not retry_refused and not future.done() and future not in _probes:
            # A connect that keeps retrying cannot tell this caller that nothing listens
            # (it must know at once, to embed the server): it connects by itself.
            conn = await connect_control(
                host, port, timeout=timeout, retry_refused=False, token=token
            )
            return conn.open_channel(on_notice)
        try:
            conn = (
                future.result()  # the usual case: a member before us connected
                if future.done()
                else await asyncio.wait_for(asyncio.shield(future), deadline - loop.time())
            )
        except RendezvousTimeout:
            raise  # the connect's own verdict (what listens there never answered)
        except TimeoutError:
            raise RendezvousTimeout(
                f"no rendezvous server answered at {host}:{port} within {timeout:.1f} s; start "
                f"one with `aiodist serve --port {port}` or let rank 0 embed it"
            ) from None
        except ConnectionRefusedError:
            if not retry_refused:
                raise
            continue  # another member's probe found nothing listening: keep trying
        if not conn.closed:
            return conn.open_channel(on_notice)
        # It closed while we waited (its last member left, or it was lost): connect anew,
        # unless it was refused, which a new connection would be too.
        if isinstance(conn.error, AuthenticationError) or loop.time() >= deadline:
            assert conn.error is not None
            raise conn.error


def _unusable(future: asyncio.Future[ControlConnection]) -> bool:
    return future.cancelled() or future.exception() is not None or future.result().closed


def _connected(
    loop: asyncio.AbstractEventLoop, key: _Key, future: asyncio.Future[ControlConnection]
) -> None:
    if not future.cancelled() and future.exception() is None:
        # The table lets go of it when it retires.
        future.result().on_retired = functools.partial(_forget, loop, key)
        return
    table = _shared.get(loop)
    if table is not None and table.get(key) is future:
        del table[key]
