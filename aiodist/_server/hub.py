"""The rendezvous server's connections, as its asyncio shell keeps them (see ``serve``).

``Hub`` is what every ``connection.ServerConnection`` talks to (the
``connection.ServerSide`` it was given): it numbers connections and their
channels, admits them through the pre-authentication ``Gate`` with one timer
for the next deadline, logs refusals through one ``LogBudget`` (the first few
of each interval in full, then one summary line with counts), feeds what they
receive to the job table (``state.py``) and writes the table's actions back:
one write per connection for a whole batch, after the batch's durable records
went to the ``journal`` (the state directory, where the server has one: a
client never hears of a change a restart could lose). Deadlines of the table
(store waits, barriers, joins, the heartbeat sweep) are one ``loop.call_at``
timer, re-armed after every batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import TYPE_CHECKING, Any

from aiodist._server.connection import ServerConnection
from aiodist._server.parts import Close
from aiodist._wire.preauth import Gate, LogBudget

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._server.parts import ConnId
    from aiodist._server.state import JobTable
    from aiodist._wire.bounds import FieldError
    from aiodist._wire.frame import Buffer
    from aiodist._wire.preauth import PreAuthLimits

logger = logging.getLogger("aiodist._server.serve")  # one logger for the whole server
event_logger = logging.getLogger("aiodist.events")


class Hub:
    """The connections of one server, their gate and log budget, and the job table's I/O."""

    def __init__(
        self,
        state: JobTable,
        *,
        token: str | None,
        preauth: PreAuthLimits,
        loop: asyncio.AbstractEventLoop,
        journal: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self.state = state
        self.journal = journal
        self.token = token
        self.preauth = preauth
        self.loop = loop
        self.bytes_received = 0
        self.bytes_sent = 0
        self.auth_failures = 0
        self.preauth_closed = 0
        self.conns: dict[ConnId, ServerConnection] = {}  # every channel's connection
        self.sockets: set[ServerConnection] = set()
        self.changed = asyncio.Event()  # set after every batch of actions
        self._next_id = 0
        self._gate: Gate[ServerConnection] = Gate(preauth)
        self._gate_timer: asyncio.TimerHandle | None = None
        self._refusals = LogBudget()
        self._refusals_timer: asyncio.TimerHandle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0
        self._flush_due = False  # a flush is scheduled for the end of this loop iteration
        # Called with each batch of job events (the dashboard keeps the recent ones).
        self.on_events: Callable[[list[dict[str, Any]]], None] | None = None

    def new_connection(self) -> ServerConnection:
        """The protocol of a connection just accepted."""
        return ServerConnection(self, self._new_id())

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    @property
    def pending(self) -> int:
        """Connections waiting for their handshake."""
        return len(self._gate)

    def close(self) -> None:
        """Stop the timers; what the log budget held back is logged now."""
        for timer in (self._timer, self._gate_timer, self._refusals_timer):
            if timer is not None:
                timer.cancel()
        self._gate_timer = self._refusals_timer = None
        self._flush_refusals(final=True)

    # --- called by connections (connection.ServerSide) ---------------------------------

    def connection_made(self, conn: ServerConnection) -> None:
        self.sockets.add(conn)
        self.conns[conn.conn_id] = conn
        now = self.loop.time()
        self.state.connection_made(conn.conn_id, conn.peer, now)
        for oldest in self._gate.admit(conn, now):
            oldest.shed()
        if self._gate_timer is None:
            self._arm_gate_timer()

    def passed(self, conn: ServerConnection) -> None:
        self._gate.passed(conn)

    def spoke(self, conn: ServerConnection) -> None:
        self._gate.spoke(conn)

    def charge(self, conn: ServerConnection, nbytes: int) -> bool:
        return self._gate.charge(conn, nbytes)

    def bad_request(self, conn_id: ConnId, exc: FieldError) -> None:
        self.state.bad_request(conn_id, exc.req_id, str(exc), exc.wire_details())

    def log_refusal(self, reason: str, message: str, *args: object) -> None:
        """Log a refused connection, or count it for the interval's summary line."""
        full, summary = self._refusals.note(self.loop.time(), reason)
        if summary is not None:
            logger.warning("%s", summary)
        if full:
            logger.warning(message, *args)
        elif self._refusals_timer is None and (due := self._refusals.due()) is not None:
            self._refusals_timer = self.loop.call_at(due, self._on_refusals_timer)

    def channel_opened(self, conn: ServerConnection) -> ConnId:
        conn_id = self._new_id()
        self.conns[conn_id] = conn
        self.state.connection_made(conn_id, conn.peer, self.loop.time(), channel=True)
        return conn_id

    def channel_lost(self, conn_id: ConnId, reason: str) -> None:
        if self.conns.pop(conn_id, None) is not None:
            self.state.connection_lost(conn_id, self.loop.time(), reason)

    def connection_lost(self, conn: ServerConnection, reason: str) -> None:
        self.sockets.discard(conn)
        self._gate.left(conn)
        for conn_id in list(conn.channels.values()):
            self.channel_lost(conn_id, reason)
        self.flush()

    def receive(self, conn_id: int, msg: Any) -> None:
        self.state.receive(conn_id, msg, self.loop.time(), decoded=True)

    def flush_soon(self) -> None:
        """Flush once the loop has read every connection that was ready in this iteration.

        In a join storm thousands of connections are readable at once: their
        requests make one batch, so the table's deadlines, its events and its
        durable log (one fsync) are handled once for all of them, not per read.
        """
        if not self._flush_due:
            self._flush_due = True
            self.loop.call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_due = False
        self.flush()

    def flush(self) -> None:
        """Write the job table's actions: one write per connection for the whole batch.

        A barrier released for 256 members of one process is one syscall, not 256.
        """
        out: dict[ServerConnection, list[Buffer]] = {}
        while actions := self._take_actions():  # closing a channel may add some
            for action in actions:
                conn = self.conns.get(action.conn)
                if conn is None:
                    continue
                if isinstance(action, Close):
                    if (parts := out.pop(conn, None)) is not None:
                        conn.write_parts(parts)  # what went before the close goes first
                    conn.end_channel(action.conn)
                else:
                    conn.queue(action.conn, action.msg, out.setdefault(conn, []))
        for conn, parts in out.items():
            if parts:
                conn.write_parts(parts)
        events = self.state.take_events()
        if events and self.on_events is not None:
            self.on_events(events)
        if events and event_logger.isEnabledFor(logging.INFO):
            for event in events:
                event_logger.info(json.dumps(event), extra={"aiodist_event": event})
        self._arm_timer()
        self.changed.set()

    def _take_actions(self) -> list[Any]:
        """The table's next actions, once the records that came with them are durable."""
        actions = self.state.take_actions()
        records = self.state.take_records()
        if records and self.journal is not None:
            self.journal(records)  # write-ahead: before any reply of this batch leaves
        return actions

    # --- timers ---------------------------------------------------------------------

    def _arm_gate_timer(self) -> None:
        when = self._gate.next_deadline()
        self._gate_timer = None if when is None else self.loop.call_at(when, self._on_gate_timer)

    def _on_gate_timer(self) -> None:
        for conn in self._gate.expired(self.loop.time()):
            conn.expired()
        self._arm_gate_timer()

    def _on_refusals_timer(self) -> None:
        self._refusals_timer = None
        self._flush_refusals()
        if (due := self._refusals.due()) is not None:  # woken a hair early: not over yet
            self._refusals_timer = self.loop.call_at(due, self._on_refusals_timer)

    def _flush_refusals(self, *, final: bool = False) -> None:
        # Shutting down: whatever was held back is logged now, its interval over or not.
        now = math.inf if final else self.loop.time()
        if (summary := self._refusals.flush(now)) is not None:
            logger.warning("%s", summary)

    def _arm_timer(self) -> None:
        when = self.state.next_deadline()
        if when is None:
            return
        if self._timer is not None and not self._timer.cancelled() and self._timer_when <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_when = when
        self._timer = self.loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.state.handle_timeouts(self.loop.time())
        self.flush()
