"""A listener, and its connections before their handshake: the gate, its timer, its log.

Each listener of a stream transport (``tcp``, ``uds``, and so ``shmring``)
admits what it accepts through one ``Admission``: the I/O side of the sans-IO
``preauth.Gate``. A channel enters when accepted, is charged for every read
until the data plane says its peer proved itself (``DataChannel.handshake_done``),
and leaves when it closes. Until then the admission closes it when it sends too
much, when its deadline passes, or when newer connections shed it (the silent
ones first, then the oldest); and each
refusal is logged through a ``preauth.LogBudget``, so a flood of strangers
writes a few lines and a count, not a line each.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from aiodist._errors import ProtocolError
from aiodist._wire.preauth import Gate, LogBudget, PreAuthLimits

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

#: What a listener allows before a handshake when its caller says nothing.
DEFAULT_PREAUTH: Final = PreAuthLimits()
#: Seconds between the summaries of refusals not logged one by one. Read when a
#: listener opens: a test may lower it first.
LOG_INTERVAL = 10.0
#: Connections asyncio's own loop accepts in one turn (see ``serve``).
ACCEPT_BATCH: Final = 64
# A refusal's detail is cut to this: it may quote what the peer sent.
_DETAIL_CHARS: Final = 200


class Admitted(Protocol):
    """A connection as its listener's admission sees it."""

    peer: str

    def refuse(self, exc: ProtocolError) -> None:
        """Close the connection at once, reporting ``exc`` as the reason."""


class Server(Protocol):
    """What a listener accepts with: an ``asyncio.Server``, or ``tls.TlsServer``."""

    def close(self) -> None: ...


@dataclass
class SocketListener:
    """A stream transport's listener (``tcp``, ``uds``, ``tls``); ``address`` is what peers dial."""

    address: str
    server: Server
    admission: Admission

    def close(self) -> None:
        self.server.close()
        self.admission.close()


class Admission:
    """The unproved connections of one listener, and what it logs about them.

    Example:
        >>> admission = Admission(PreAuthLimits(max_pending=64, deadline=5.0))
        >>> # in a channel: admission.enter(self) when accepted, admission.charge(self, n)
        >>> # per read, admission.passed(self) after the handshake, admission.left(self)
    """

    def __init__(self, limits: PreAuthLimits | None = None) -> None:
        self.limits = limits or DEFAULT_PREAUTH
        self._gate: Gate[Admitted] = Gate(self.limits)
        self._log = LogBudget(interval=LOG_INTERVAL)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._flush_timer: asyncio.TimerHandle | None = None
        self._refused: set[Admitted] = set()  # closed by us, not yet gone: no second line
        self.closed = False

    def __len__(self) -> int:
        """Connections waiting for their handshake now."""
        return len(self._gate)

    def enter(self, conn: Admitted) -> None:
        """``conn`` was accepted: admit it, shedding the oldest unproved ones beyond the cap."""
        loop = asyncio.get_running_loop()
        if self.closed:
            conn.refuse(ProtocolError("the listener is closed"))
            return
        shed = self._gate.admit(conn, loop.time())
        self._refuse_all(shed, "shed", "shed for a newer connection (too many unproved at once)")
        self._arm(loop)

    def spoke(self, conn: Admitted) -> None:
        """``conn`` sent its first whole frame: the silent ones are shed before it.

        A real peer's hello is on its way as it connects; a stranger holding
        connections open to push real peers out says nothing.
        """
        self._gate.spoke(conn)

    def charge(self, conn: Admitted, nbytes: int) -> bool:
        """Count ``nbytes`` read from ``conn``; False (and ``conn`` refused) once over budget."""
        if self._gate.charge(conn, nbytes):
            return True
        self._refuse_all(
            [conn],
            "byte budget",
            f"sent more than {self.limits.max_bytes} bytes before finishing its handshake",
        )
        return False

    def passed(self, conn: Admitted) -> None:
        """``conn``'s peer proved itself: none of the limits applies to it any more."""
        self._gate.passed(conn)

    def left(self, conn: Admitted) -> None:
        """``conn`` closed. Not a refusal, so not a warning: a peer closing as the job ends
        may leave a connection it had just opened, and a stranger that left costs nothing."""
        if conn in self._gate:
            self._gate.left(conn)
            logger.debug("a data connection from %s closed before its handshake", conn.peer)
        self._refused.discard(conn)

    def forget(self, conn: Admitted) -> None:
        """This side closes ``conn`` for a reason of its own: out of the gate, nothing logged."""
        self._gate.left(conn)

    def protocol_error(self, conn: Admitted, exc: Exception) -> None:
        """``conn`` broke the protocol before its handshake: log it (within the budget)."""
        self._gate.left(conn)
        if conn not in self._refused and not self.closed:
            self._refused.add(conn)
            detail = str(exc) if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {exc}"
            self.note(conn, "protocol error", detail)

    def note(self, conn: Admitted, reason: str, detail: str) -> None:
        """Log one refusal of ``conn`` for ``reason`` (a fixed phrase): in full, or counted."""
        loop = asyncio.get_running_loop()
        full, summary = self._log.note(loop.time(), reason)
        if summary is not None:
            logger.warning("%s", summary)
        if full:
            logger.warning(
                "refused a data connection from %s: %s", conn.peer, detail[:_DETAIL_CHARS]
            )
        elif self._flush_timer is None and (due := self._log.due()) is not None:
            # Say what was counted once the interval is over, even if nothing else comes.
            self._flush_timer = loop.call_at(due, self._flush)

    def close(self) -> None:
        """The listener closed: refuse every connection still waiting, quietly."""
        if not self.closed and (summary := self._log.flush(float("inf"))) is not None:
            logger.warning("%s", summary)  # what was held back, its interval over or not
        self.closed = True
        for timer in (self._timer, self._flush_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._flush_timer = None
        for conn in self._gate.expired(float("inf")):
            conn.refuse(ProtocolError("the listener closed before the handshake"))

    # --- timers -------------------------------------------------------------------------

    def _refuse_all(self, conns: Iterable[Admitted], reason: str, detail: str) -> None:
        for conn in conns:
            self._gate.left(conn)
            if conn in self._refused:
                continue
            self._refused.add(conn)
            self.note(conn, reason, detail)
            conn.refuse(ProtocolError(f"refused before its handshake: it {detail}"))

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        when = self._gate.next_deadline()
        if when is None or (self._timer is not None and self._timer_at <= when):
            return  # none waiting, or the timer fires by then (and re-arms)
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(when, self._expire), when

    def _expire(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        late = self._gate.expired(loop.time())
        detail = f"did not finish its handshake within {self.limits.deadline:g} s"
        self._refuse_all(late, "deadline", detail)
        self._arm(loop)

    def _flush(self) -> None:
        self._flush_timer = None
        loop = asyncio.get_running_loop()
        summary = self._log.flush(loop.time())
        if summary is not None:
            logger.warning("%s", summary)
        elif (due := self._log.due()) is not None:  # woken a hair early: not over yet
            self._flush_timer = loop.call_at(due, self._flush)


async def serve(
    sock: socket.socket, protocol_factory: Callable[[], asyncio.BaseProtocol], backlog: int
) -> asyncio.Server:
    """Serve the bound ``sock``, with a listen queue of ``backlog``, a batch at a time.

    asyncio's own loop accepts as many queued connections in one turn as the
    backlog it was given, and only later does each reach its admission: a
    queue full of strangers would be that many descriptors at once (``EMFILE``
    for the rank's own sockets and files, and a traceback logged for every
    accept that failed). Given ``ACCEPT_BATCH`` instead, it accepts that many
    a turn and the admission sheds between turns; the kernel's queue is set
    back to ``backlog`` right after (the loop called ``listen`` with its
    number). uvloop accepts whatever is queued and copes with ``EMFILE`` itself
    (it accepts and closes what it cannot keep).
    """
    loop = asyncio.get_running_loop()
    if sock.family == socket.AF_UNIX:
        server = await loop.create_unix_server(protocol_factory, sock=sock, backlog=ACCEPT_BATCH)
    else:
        server = await loop.create_server(protocol_factory, sock=sock, backlog=ACCEPT_BATCH)
    sock.listen(backlog)
    return server
