"""Looking for a rendezvous server that went away, and re-attaching to it.

A connection whose server may come back (a daemon restarted, killed and
started again, stopped for a while) runs one ``Reconnect`` when it loses it:

1. Connect again to the same address, with exponential backoff from
   ``FIRST_DELAY`` to ``MAX_DELAY`` and jitter (half to one and a half times
   the delay), so that thousands of ranks do not all knock at once.
2. Prove the token again (a server that came back with another token is
   refused, and refuses us: the members fail with ``AuthenticationError``).
3. Re-attach every member of the process (``Reattach``, with the member's
   secret), then send its pending requests again. A member the server will
   not take back (declared failed while away, its job unknown) fails alone,
   with the server's error.

Past ``AIODIST_SERVER_GRACE`` seconds (``DEFAULT_SERVER_GRACE``; 0 turns
reconnecting off) the connection gives up, and its members break their
groups as they did at once before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import TYPE_CHECKING, Final, Protocol

from aiodist import _settings
from aiodist._control.channel import ServerLost
from aiodist._errors import AuthenticationError, DistError

if TYPE_CHECKING:
    from aiodist._control.channel import ControlChannel

logger = logging.getLogger(__name__)

DEFAULT_SERVER_GRACE: Final = _settings.SERVER_GRACE.default
FIRST_DELAY: Final = 0.05
MAX_DELAY: Final = 1.0


def server_grace() -> float:
    """Seconds a rank waits for its server to come back (``AIODIST_SERVER_GRACE``)."""
    try:
        return _settings.SERVER_GRACE.read()
    except ValueError as exc:  # read once the server is gone: no time to fail the job for it
        logger.warning("%s; using %.0f", exc, DEFAULT_SERVER_GRACE)
        return DEFAULT_SERVER_GRACE


class LostConnection(Protocol):
    """A control connection as its search for the server sees it.

    ``aiodist._control.connection.ControlConnection`` is the one implementation:
    it owns its transport and its members' channels, and this module the policy
    of looking for the server (backoff, re-attaching, giving up).
    """

    reattached: bool  # every member re-attached: their pending requests may go again

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def server(self) -> str:
        """The server's address, for the log."""
        ...

    @property
    def token(self) -> str:
        """The token to prove again ("": none)."""
        ...

    @property
    def error(self) -> DistError | None:
        """Why the connection is unusable, or None while it works."""
        ...

    async def reopen(self) -> None:
        """Open a new transport to the server's address, the state of the last one reset."""
        ...

    async def authenticate(self, token: str, timeout: float) -> None:
        """Answer the server's challenge with a proof of ``token``."""
        ...

    def member_channels(self) -> list[ControlChannel]: ...

    def transport_or_none(self) -> asyncio.Transport | None: ...

    def back(self) -> None:
        """Every member re-attached: tell them the server is back."""
        ...

    def give_up(self, why: str, grace: float) -> None:
        """The server did not come back within ``grace`` seconds: fail every member."""
        ...


class Reconnect:
    """One connection's search for its server (see the module)."""

    def __init__(self, conn: LostConnection, why: str, grace: float) -> None:
        self.conn = conn
        self.why = why
        self.grace = grace
        self.attempts = 0
        self._lost: asyncio.Future[str] = conn.loop.create_future()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def start(cls, conn: LostConnection, why: str) -> Reconnect | None:
        """Start looking for the server; None when reconnecting is off (grace 0)."""
        grace = server_grace()
        if grace <= 0:
            return None
        self = cls(conn, why, grace)
        logger.warning(
            "the rendezvous server at %s went away (%s); reconnecting for up to %.1f s "
            "(AIODIST_SERVER_GRACE) while this rank's operations go on",
            conn.server,
            why,
            grace,
        )
        self._task = conn.loop.create_task(self._run())
        return self

    def lost(self, why: str) -> None:
        """The connection of the attempt under way was lost."""
        if not self._lost.done():
            self._lost.set_result(why)

    def cancel(self) -> None:
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    async def _run(self) -> None:
        conn, loop = self.conn, self.conn.loop
        started = loop.time()
        deadline = started + self.grace
        delay = FIRST_DELAY
        while conn.error is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                conn.give_up(self.why, self.grace)
                return
            self.attempts += 1
            self._lost = loop.create_future()
            attempt = loop.create_task(self._attempt(remaining))
            waits: set[asyncio.Future[object]] = {attempt, self._lost}  # type: ignore[arg-type]
            done, _ = await asyncio.wait(
                waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            if attempt in done and attempt.exception() is None:
                logger.warning(
                    "re-attached to the rendezvous server at %s after %.1f s (%d attempts)",
                    conn.server,
                    loop.time() - started,
                    self.attempts,
                )
                conn.back()
                return
            if attempt in done:
                exc = attempt.exception()
                if isinstance(exc, AuthenticationError) or conn.error is not None:
                    return  # refused: the connection failed its members with the reason
                logger.debug("reconnect attempt %d failed: %s", self.attempts, exc)
            else:
                attempt.cancel()
                with contextlib.suppress(BaseException):
                    await attempt
            transport = conn.transport_or_none()
            if transport is not None:
                transport.abort()
            await asyncio.sleep(min(delay * random.uniform(0.5, 1.5), max(remaining, 0)))
            delay = min(delay * 2, MAX_DELAY)

    async def _attempt(self, remaining: float) -> None:
        conn = self.conn
        await conn.reopen()
        if conn.token:
            await conn.authenticate(conn.token, remaining)
        channels = [c for c in conn.member_channels() if c.reattach is not None]
        results = await asyncio.gather(
            *(self._reattach(c, remaining) for c in channels), return_exceptions=True
        )
        for channel, result in zip(channels, results, strict=True):
            if isinstance(result, DistError):
                # The server will not take this member back: it alone fails, with the reason.
                channel.fail(result)
                channel.notice(ServerLost(result))
            elif isinstance(result, BaseException):
                raise result
        conn.reattached = True
        for channel in conn.member_channels():
            if channel.error is None:
                channel.resend_pending()

    @staticmethod
    async def _reattach(channel: ControlChannel, remaining: float) -> None:
        assert channel.reattach is not None
        await channel.request(channel.reattach, timeout=remaining)
