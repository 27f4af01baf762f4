"""The rendezvous server's job table, sans-IO: messages and time in, actions out.

``JobTable`` is composed of parts, each owning its state and its rules, all
acting through one ``Outbox`` (``parts.py``):

- ``membership`` (``membership.py``): the jobs and their members: joins,
  formation, growth, leaves, failures, the heartbeat sweep;
- each job's own parts (``jobs.py``): its store and barriers (``store.py``),
  its regroups (``regroups.py``), its notices (``notices.py``);
- ``reattachment`` (``reattach.py``): members taken back after the server went
  away and came back, jobs replayed from the state directory, stalls;
- the table itself: connections, the dispatch of each message to the part
  that declared it handles it (``parts.handles``), status and dumps, events.

Every change of durable state is a record a part emits; the asyncio shell
takes them (``take_records``) and hands them to the state directory, when the
server has one (``serve.py``), before any reply of their batch leaves. A
message that is not declared ``durable`` (``_wire/messages.py``) may make no
such change: the table checks it.

- Each turn of a job's life is an event (``events.py``) the shell logs.
- A job's ranks are asked to dump their flight recorders (``DumpRequest``,
  from any client) at most once per ``DUMP_INTERVAL``: the requests in between
  share the last notice, so that no number of status commands can keep ranks
  busy writing dumps.
- Nothing here blocks or allocates per byte; deadlines live in one heap, and
  heartbeats are checked by a periodic sweep.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import ErrorCode
from aiodist._server.events import JobLog
from aiodist._server.membership import Conn, Membership, Stats
from aiodist._server.parts import BadRequest, Outbox, handled, handlers, handles
from aiodist._server.reattach import Reattachment
from aiodist._server.store import Store
from aiodist._server.where import heard
from aiodist._wire.messages import (
    DumpNotice,
    DumpRequest,
    ErrorReply,
    Heartbeat,
    Reply,
    ServerClosing,
    StatusRequest,
)

if TYPE_CHECKING:
    from aiodist._server.jobs import Job
    from aiodist._server.parts import Close, ConnId, Send
    from aiodist._server.records import Record

RECENT_IN_STATUS: Final = 16  # finished jobs a status report lists
STATUS_JOBS: Final = 100  # jobs a status report lists (of however many the server holds)
STATUS_RANKS: Final = 64  # ranks each job of such a list shows
JOB_STATUS_RANKS: Final = 4096  # ranks `aiodist status --job J` shows
#: The least time between two notices asking one job's ranks for their flight recorders.
DUMP_INTERVAL: Final = 2.0
# The requests a job's store answers (``Store``'s own ``@handles``): counted as store ops.
_STORE_REQUESTS: Final = frozenset(handled(Store))


class JobTable:
    """All jobs of one server. Feed it messages and time; collect actions and records."""

    def __init__(
        self,
        now: float,
        *,
        durable: bool = False,
        restartable: bool = False,
        reattach_timeout: float | None = None,
    ) -> None:
        self.started_at = now
        self.version = ""  # reported by status; the shell fills it in
        self.out = Outbox()
        self.log = JobLog()
        self.stats = Stats()
        self.membership = Membership(self.out, self.log, self.stats)
        self.membership.durable = durable
        self.membership.restartable = restartable or durable
        self.reattachment = Reattachment(self.membership, self.out, now, timeout=reattach_timeout)
        # The messages a connection may send whoever it is, and who answers each.
        self._handlers = {
            **handlers(self),
            **handlers(self.membership),
            **handlers(self.reattachment),
        }

    @property
    def jobs(self) -> dict[str, Job]:
        return self.membership.jobs

    @property
    def durable(self) -> bool:
        return self.membership.durable

    @property
    def closing(self) -> bool:
        return self.membership.closing

    # --- inputs ------------------------------------------------------------------

    def connection_made(
        self, conn: ConnId, peer: str, now: float, *, channel: bool = False
    ) -> None:
        self.reattachment.tick(now)
        self.membership.conns[conn] = Conn(peer=peer, channel=channel)

    def connection_lost(self, conn: ConnId, now: float, reason: str = "connection lost") -> None:
        self.reattachment.tick(now)
        membership = self.membership
        if membership.closing and membership.durable:
            # Shutting down to come back: the members stay, as the state directory has them.
            membership.conns.pop(conn, None)
            return
        state = membership.conns.get(conn)
        member = None if state is None else state.member
        if (
            member is not None
            and self.reattachment.stalled(now)
            and member.job.complete
            and member.status == "active"
            and not membership.closing
        ):
            # Lost while this server stood still: the member is reconnecting, most likely.
            del membership.conns[conn]
            self.reattachment.away(member, now)
            return
        membership.connection_lost(conn, now, reason)

    def receive(self, conn: ConnId, msg: Any, now: float, *, decoded: bool = False) -> None:
        """Handle ``msg`` from connection ``conn``; ``decoded``: it came from the wire, its
        values checked on decoding (``_wire/bounds.py``), so they are not checked again."""
        self.out.decoded = msg if decoded else None
        self.reattachment.tick(now)
        state = self.membership.conns[conn]
        self.stats.messages += 1
        member = state.member
        if member is not None:
            member.last_seen = now
        kind = type(msg)
        if kind is Heartbeat:
            if msg.where and member is not None:
                entry = msg.where[0]
                heard(member, entry, now)
                member.job.traffic.heard(member, entry[3], now)
            return
        changes = self.out.changes
        try:
            handler = self._handlers.get(kind)
            if handler is not None:
                handler(conn, msg, now)
            else:
                member = self.membership.joined(conn, msg)
                handler = member.job.handlers.get(kind)
                if handler is None:
                    raise BadRequest(
                        ErrorCode.BAD_REQUEST, f"a client may not send {kind.__name__}"
                    )
                self.stats.store_ops += kind in _STORE_REQUESTS
                handler(member, msg, now)
        except BadRequest as exc:
            req_id = getattr(msg, "req_id", 0)
            self.out.send(conn, ErrorReply(req_id, exc.code, str(exc), exc.details))
        # Only a message declared durable may change durable state (``_wire/messages.py``).
        assert getattr(kind, "DURABLE", False) or self.out.changes == changes, (
            f"{kind.__name__} changed durable state: declare it @message(..., durable=True)"
        )

    def bad_request(self, conn: ConnId, req_id: int, message: str, details: dict[str, Any]) -> None:
        """Refuse request ``req_id`` of ``conn``: a value of it was out of range on decoding.

        Queued with the other actions, so the error leaves in order with the
        replies before it; the connection goes on.
        """
        self.stats.messages += 1
        self.out.send(conn, ErrorReply(req_id, ErrorCode.BAD_REQUEST, message, details))

    def next_deadline(self) -> float | None:
        """When ``handle_timeouts`` must next be called; None when nothing is pending."""
        when = self.out.next_deadline()
        sweep = self.membership.next_sweep
        if sweep is not None and (when is None or sweep < when):
            return sweep
        return when

    def handle_timeouts(self, now: float) -> None:
        self.reattachment.tick(now)
        self.out.fire_due(now)
        sweep = self.membership.next_sweep
        if sweep is not None and sweep <= now:
            self.membership.sweep(now)

    def close(self, reason: str) -> None:
        """Tell every connection that the server is going away (and whether it comes back).

        Without a state directory its jobs end here, cut off.
        """
        membership = self.membership
        if membership.durable:
            membership.closing = True
            notice = ServerClosing(reason, coming_back=True)
        else:
            membership.close(reason)
            notice = ServerClosing(reason)
        for conn in list(membership.conns):
            self.out.send(conn, notice)

    # --- outputs -----------------------------------------------------------------

    def take_actions(self) -> list[Send | Close]:
        return self.out.take_actions()

    def take_records(self) -> list[Record]:
        """The durable records made since the last call, oldest first (``records.py``)."""
        return self.out.take_records()

    def take_events(self) -> list[dict[str, Any]]:
        """The job events recorded since the last call (see ``events.py``), oldest first."""
        return self.log.take()

    def records(self) -> list[Record]:
        """Every durable job as records: a snapshot of the state directory."""
        return [rec for job in self.jobs.values() if job.logged for rec in job.records()]

    def replay(self, rec: Record, now: float) -> None:
        """Apply a record read back from the state directory (``reattach.py``)."""
        self.reattachment.replay(rec, now)

    def restored(self, now: float) -> list[Record]:
        """The state directory is replayed: its members are away until they re-attach.
        Returns the snapshot to start the new log from.

        Raises:
            ValueError: What was replayed does not hold together (a job short of members).
        """
        self.reattachment.restored(now)
        return self.records()

    # --- status and dumps ------------------------------------------------------------

    @handles(StatusRequest)
    def _status(self, conn: ConnId, msg: StatusRequest, now: float) -> None:
        ranks = JOB_STATUS_RANKS if msg.job else STATUS_RANKS
        snap = self.snapshot(now, asking=conn, job=msg.job, max_members=ranks)
        self.out.send(conn, Reply(msg.req_id, snap))

    @handles(DumpRequest)
    def _dumps(self, conn: ConnId, msg: DumpRequest, now: float) -> None:
        """Tell every active rank of job ``msg.job`` to write its flight recorder, at most
        once per ``DUMP_INTERVAL``: ``{"ranks": [those told], "request": the notice's number}``.
        """
        job = self.jobs.get(msg.job)
        if job is None:
            raise BadRequest(ErrorCode.BAD_REQUEST, f"no job {msg.job!r} on this server")
        if job.dump is None or now - job.dump[0] >= DUMP_INTERVAL:
            request = secrets.randbits(63)  # never the number of a file from before a restart
            notice = DumpNotice(request)
            told = []
            for m in job.members:
                if m.status == "active":
                    self.out.send(m.conn, notice)
                    told.append(m.rank)
            job.dump = (now, request, sorted(told))
        _, request, ranks = job.dump
        self.out.send(conn, Reply(msg.req_id, {"ranks": ranks, "request": request}))

    def snapshot(
        self,
        now: float,
        asking: ConnId | None = None,
        *,
        job: str = "",
        offset: int = 0,
        limit: int = STATUS_JOBS,
        max_members: int = STATUS_RANKS,
    ) -> dict[str, Any]:
        """Plain data describing the server and some of its jobs (for ``aiodist status``).

        ``job``: that job alone (none if there is no such job); else ``limit`` jobs
        from the ``offset``-th, in the order they came. Each job lists at most
        ``max_members`` of its ranks. What it costs does not grow with the number of
        jobs the server holds (``jobs_total`` says how many).

        ``connections`` counts client sockets other than ``asking``'s (what ``ss``
        and the metrics endpoint show while no status request is open);
        ``channels`` counts the members' channels on them too.
        """
        conns = self.membership.conns
        sockets = sum(1 for cid, c in conns.items() if not c.channel and cid != asking)
        if job:
            chosen = [self.jobs[job]] if job in self.jobs else []
        else:
            chosen = list(itertools.islice(self.jobs.values(), offset, offset + limit))
        return {
            "version": self.version,
            "uptime": now - self.started_at,
            "connections": sockets,
            "channels": len(conns),
            "stats": dataclasses.asdict(self.stats),
            "jobs_total": len(self.jobs),
            "offset": 0 if job else offset,
            "jobs": [j.snapshot(now, max_members) for j in chosen],
            "finished": self.log.recent(now)[:RECENT_IN_STATUS],
        }
