"""The job table of a server that can go away and come back, sans-IO (see ``state.py``).

``RestartableState`` is ``ServerState`` plus what a restart needs:

- **Re-attachment.** A member of a formed job whose server went away (killed,
  restarted, stopped for a while) reconnects and sends ``Reattach`` with the
  secret its ``Join`` carried, and the world size its ``Welcome`` said (an
  elastic job's newcomers were welcomed into a larger one). The member it
  names is given the new channel: its secret must match the one the server
  holds (compared in constant time), so a client that merely holds the token
  cannot take a member's place. Pending requests are sent again by the client
  after that (a barrier already passed answers at once: the job keeps the last
  barrier it passed; so does a regroup decided: the job keeps its answer).
- **Durable state** (``durable.py``): with a state directory, every formed job,
  newcomer admitted, store key, passed barrier, decided regroup, failure,
  leave and end is logged before the replies of its batch leave, and replayed
  at start-up. The jobs come back with every member *away*. A job replaced by
  a later generation is no longer logged: its members go on alone, and a
  restart forgets them.
- **Members away.** A member is away after a restart until it re-attaches,
  and for at most ``reattach_timeout`` (or twice its heartbeat timeout, at
  least ``MIN_REATTACH_WINDOW`` s): past it, the member is declared failed, and
  every member that is back is told (a rank that died while the server was
  gone).
- **Without a state directory** the server knows no member's secret after a
  restart: the first ``Reattach`` of a job unknown to it rebuilds the job (its
  membership from what the ranks re-register, its store empty), and **the
  first re-attachment of each rank is taken**, whoever holds the token; a
  later claim of that rank is refused, saying so. Nothing a member holds can
  prove it to a server that kept nothing: the token is all they share, and
  every client holds it.
- **A server that stalled** (SIGSTOP, a loop blocked for seconds) sees its
  clients' heartbeats as late and their reconnections as lost connections. A
  gap of more than ``STALL_GAP`` s between two inputs is such a stall: for
  ``STALL_WINDOW`` s after it, a member whose connection drops is away, not
  failed, and the sweep forgives the silence the stall caused.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import math
from typing import TYPE_CHECKING, Any, Final, cast

import msgpack

from aiodist._errors import ErrorCode
from aiodist._server.durable import JobRecord, MemberRecord
from aiodist._server.jobs import BadRequest, Job, Member
from aiodist._server.state import ServerState
from aiodist._wire.messages import (
    Barrier,
    ErrorReply,
    MemberFailed,
    MembersFailed,
    Packed,
    Reattach,
    Reply,
    ServerClosing,
    StoreAdd,
    StoreCompareSet,
    StoreDeleteKey,
    StoreSet,
)

if TYPE_CHECKING:
    from aiodist._server.durable import StateDir
    from aiodist._server.elastic import Agreement
    from aiodist._server.jobs import Close, ConnId, Send

__all__ = ["MIN_REATTACH_WINDOW", "RestartableState", "reattach_window"]

logger = logging.getLogger("aiodist._server.serve")

MIN_REATTACH_WINDOW: Final = 5.0
# Two inputs this far apart mean the server's loop stood still (the sweep runs every second).
STALL_GAP: Final = 3.0
STALL_WINDOW: Final = 1.0
_MUTATIONS: Final = (StoreSet, StoreAdd, StoreCompareSet, StoreDeleteKey)
# A re-attachment's secret is at least this long (aiodist's clients draw 32 bytes).
MIN_SECRET_BYTES: Final = 16


def reattach_window(heartbeat_timeout: float) -> float:
    """How long a member away is waited for before it is declared failed (see the module).

    Its peers wait as long for that verdict once the server is back (``Session``).
    """
    return max(MIN_REATTACH_WINDOW, 2 * heartbeat_timeout)


class RestartableState(ServerState):
    """``ServerState`` whose jobs survive the server going away (see the module)."""

    def __init__(
        self,
        now: float,
        *,
        state_dir: StateDir | None = None,
        restartable: bool = False,
        reattach_timeout: float | None = None,
    ) -> None:
        super().__init__(now)
        self.restartable = restartable or state_dir is not None
        self.durable = state_dir
        self.reattach_timeout = reattach_timeout
        self.reattached = 0  # members taken back
        self.restored_jobs = 0
        self._rebuilt: set[Job] = set()  # jobs rebuilt from re-attachments (no state kept)
        self._barriers_done: dict[Job, int] = {}
        self._logged: set[Job] = set()  # formed jobs the state directory holds
        self._away: dict[Member, float] = {}  # member -> when it must be back
        self._away_ids = itertools.count(-1, -1)  # connection ids nobody has
        self._last_input = now
        self._stall_until = -math.inf
        if state_dir is not None:
            for record in state_dir.load().values():
                self._restore(record, now)

    # --- inputs ------------------------------------------------------------------

    def connection_made(
        self, conn: ConnId, peer: str, now: float, *, channel: bool = False
    ) -> None:
        self._tick(now)
        super().connection_made(conn, peer, now, channel=channel)

    def connection_lost(self, conn: ConnId, now: float, reason: str = "connection lost") -> None:
        self._tick(now)
        if self.closing and self.durable is not None:
            # Shutting down to come back: the members stay, as the state directory has them.
            self._conns.pop(conn, None)
            return
        state = self._conns.get(conn)
        member = None if state is None else state.member
        if (
            member is not None
            and now < self._stall_until
            and member.job.complete
            and member.status == "active"
            and not self.closing
        ):
            # Lost while this server stood still: the member is reconnecting, most likely.
            del self._conns[conn]
            self._set_away(member, now)
            return
        super().connection_lost(conn, now, reason)

    def receive(self, conn: ConnId, msg: Any, now: float, *, decoded: bool = False) -> None:
        self._decoded = msg if decoded else None
        self._tick(now)
        state = self._conns[conn]
        if isinstance(msg, Reattach):
            self.stats.messages += 1
            try:
                self._reattach(conn, msg, now)
            except BadRequest as exc:
                self._send(conn, _error(msg.req_id, exc))
            return
        member = state.member
        if (
            isinstance(msg, Barrier)
            and member is not None
            and member.job.complete
            and msg.seq <= self._barriers_done.get(member.job, 0)
        ):
            # Passed before the server went away; this member's reply was lost with it.
            self.stats.messages += 1
            member.last_seen = now
            self._send(conn, Reply(msg.req_id, None))
            return
        super().receive(conn, msg, now, decoded=decoded)
        if member is None:
            return
        job = member.job
        if isinstance(msg, _MUTATIONS):
            self._append(job, ["kv", job.name, msg.key, job.kv.get(msg.key)])
        elif (
            isinstance(msg, Barrier)
            and job.complete
            and msg.seq not in job.barriers
            and msg.seq not in job.failed_barriers
            and not job.failures
        ):
            self._barriers_done[job] = max(self._barriers_done.get(job, 0), msg.seq)
            self._append(job, ["barrier", job.name, msg.seq])

    def next_deadline(self) -> float | None:
        when = super().next_deadline()
        if self._away:
            first = min(self._away.values())
            when = first if when is None else min(when, first)
        return when

    def handle_timeouts(self, now: float) -> None:
        self._tick(now)
        if self._away:
            for member, deadline in list(self._away.items()):
                if deadline <= now and member in self._away:
                    del self._away[member]
                    window = deadline - member.joined_at
                    self._fail(
                        member,
                        f"it did not come back within {window:.1f} s after the rendezvous "
                        "server did (it died while the server was away, or cannot reach it)",
                        now,
                    )
                    self._remove(member, now)
        super().handle_timeouts(now)

    def take_actions(self) -> list[Send | Close]:
        if self.durable is not None:
            self.durable.commit()  # before the replies of this batch leave: write-ahead
            if self.durable.wants_compaction():
                self.durable.compact(self._records())
        return super().take_actions()

    def close(self, reason: str) -> None:
        """Tell every connection that the server is going away (and whether it comes back).

        Without a state directory its jobs end here, cut off (the table's own close).
        """
        if self.durable is None:
            super().close(reason)
            return
        self.closing = True
        notice = ServerClosing(reason, coming_back=True)
        for conn in list(self._conns):
            self._send(conn, notice)

    # --- hooks on the table's own steps ----------------------------------------------

    def _fail(self, member: Member, reason: str, now: float) -> None:
        super()._fail(member, reason, now)
        self._append(
            member.job, ["failed", member.job.name, member.rank, member.host, member.pid, reason]
        )

    def _remove(self, member: Member, now: float) -> None:
        job = member.job
        self._away.pop(member, None)
        super()._remove(member, now)
        if member.status == "left" and member.rank in job.left:
            self._append(job, ["left", job.name, member.rank, member.host, member.pid])
        if job.ended:
            self._append(job, ["end", job.name, job.generation])
            self._replaced(job)

    def _formed(self, job: Job) -> None:
        if self.durable is not None and job not in self._logged:
            self._logged.add(job)
            for rec in self._record_of(job).records():
                self.durable.append(rec)

    def _admit(self, member: Member, now: float) -> None:
        super()._admit(member, now)
        job = member.job
        self._append(job, ["joined", job.name, _member_record(member).row()])

    def _settle(self, agreement: Agreement, answer: tuple[Any, ...]) -> None:
        super()._settle(agreement, answer)
        job = agreement.job
        self._append(job, ["regroup", job.name, agreement.key, list(answer)])

    def _replaced(self, job: Job) -> None:
        """``job`` ended, or a later generation took its name: nothing of it is logged now."""
        self._logged.discard(job)
        self._rebuilt.discard(job)
        self._barriers_done.pop(job, None)

    # --- re-attachment -----------------------------------------------------------------

    def _reattach(self, conn: ConnId, msg: Reattach, now: float) -> None:
        state = self._conns[conn]
        if state.member is not None:
            raise BadRequest(
                ErrorCode.BAD_REQUEST,
                f"this channel already belongs to a member of job {state.member.job.name!r}",
            )
        self._check_values(msg)
        if msg.rank >= msg.world_size:
            raise BadRequest(
                ErrorCode.BAD_REQUEST, f"Reattach.rank {msg.rank} is not below its world size"
            )
        if len(msg.secret) < MIN_SECRET_BYTES:
            raise BadRequest(
                ErrorCode.AUTHENTICATION,
                f"refused to re-attach rank {msg.rank} of job {msg.group_name!r}: it brings a "
                f"secret of {len(msg.secret)} bytes (at least {MIN_SECRET_BYTES}); a member "
                "proves itself with the secret its join carried",
            )
        job = self.jobs.get(msg.group_name)
        if job is None:
            if self.durable is not None:
                raise BadRequest(
                    ErrorCode.RENDEZVOUS,
                    f"the rendezvous server does not know job {msg.group_name!r}: it ended, "
                    "or this server started with another state directory than the one that "
                    "held it; restart the job",
                )
            job = self._rebuild(msg, now)
        # A member names the world size its Welcome said: the job's, or (an elastic job's
        # newcomer, or a member that has seen newcomers since) a rank space it has had.
        if job.generation != msg.generation or not (
            job.min_world_size <= msg.world_size <= job.world_size
        ):
            raise BadRequest(
                ErrorCode.RENDEZVOUS,
                f"job {job.name!r} on the rendezvous server is generation {job.generation} "
                f"of {job.world_size} ranks, this member is of generation {msg.generation} "
                f"of {msg.world_size}: it was started again meanwhile",
            )
        if not job.complete:
            raise BadRequest(
                ErrorCode.RENDEZVOUS, f"job {job.name!r} is forming again: join it, not re-attach"
            )
        member = job.by_rank[msg.rank]
        if member not in job.members:
            why = next((f[3] for f in job.failures if f[0] == msg.rank), None)
            if why is not None:
                raise BadRequest(
                    ErrorCode.RANK_FAILED,
                    f"rank {msg.rank} of job {job.name!r} was declared failed while it was "
                    f"away from the rendezvous server: {why}",
                    {"rank": msg.rank, "host": member.host, "pid": member.pid, "reason": why},
                )
            raise BadRequest(ErrorCode.RENDEZVOUS, f"rank {msg.rank} left job {job.name!r}")
        if member.secret is None:  # a job rebuilt from re-attachments: the first one names it
            member.secret = msg.secret
            member.host, member.pid, member.local_rank = msg.host, msg.pid, msg.local_rank
            member.addresses = list(msg.addresses)
            job.forget_table()
        if not hmac.compare_digest(member.secret, msg.secret):
            if job in self._rebuilt:
                raise BadRequest(
                    ErrorCode.AUTHENTICATION,
                    f"refused to re-attach rank {msg.rank} of job {job.name!r}: pid "
                    f"{member.pid} on host {member.host} re-attached it first, with another "
                    "secret. This rendezvous server restarted without a state directory, so "
                    "it knows no member's secret and takes the first re-attachment of each "
                    "rank, whoever holds the token. Restart the job; run the daemon with "
                    "--state-dir for members to prove themselves after a restart",
                )
            raise BadRequest(
                ErrorCode.AUTHENTICATION,
                f"refused to re-attach rank {msg.rank} of job {job.name!r}: this connection "
                "does not hold that member's secret",
            )
        if (old := self._conns.get(member.conn)) is not None and old.member is member:
            old.member = None  # it moved to this connection; its old one may linger
        self._away.pop(member, None)
        member.conn = conn
        member.peer = state.peer
        member.last_seen = now
        state.member = member
        self.reattached += 1
        self.log.record("rank_reattached", job, rank=member.rank, host=member.host, pid=member.pid)
        self._send(conn, Reply(msg.req_id, None))
        if job.failures:
            # Every failure of its job (failure isolation: each breaks only what needs
            # that rank), those while it was away among them: it cannot tell the server
            # which ones it heard before, and a member ignores one it knows already.
            if len(job.failures) == 1:
                self._send(conn, MemberFailed(*job.failures[0]))
            else:
                entries = [list(failure) for failure in job.failures]
                self._send(conn, MembersFailed(cast("list[Any]", Packed(msgpack.packb(entries)))))

    def _rebuild(self, msg: Reattach, now: float) -> Job:
        """A job this server never knew (it kept no state): its members re-register it."""
        record = JobRecord(
            msg.group_name,
            msg.generation,
            msg.world_size,
            [
                MemberRecord(rank, 0, "", 0, [], float(msg.heartbeat_timeout), b"")
                for rank in range(msg.world_size)
            ],
        )
        job = self._restore(record, now)
        for member in job.by_rank:
            member.secret = None  # unknown: each rank's first re-attachment names it
        self._rebuilt.add(job)
        return job

    def _restore(self, record: JobRecord, now: float) -> Job:
        job = Job(
            record.name,
            record.world_size,
            created_at=now,
            generation=record.generation,
            min_world_size=record.min_world_size,
            max_world_size=record.max_world_size,
        )
        job.complete = True
        job.formed_at = now
        job.kv = dict(record.kv)
        job.failures = list(record.failures)
        job.left = dict(record.left)
        # Each failure, leave and admission was one epoch (``grow.py``): the members'
        # views go on from there, and so must the next join's.
        job.epoch = len(job.failures) + len(job.left) + record.world_size - record.min_world_size
        if record.regroups:
            self._settled[job] = {key: tuple(answer) for key, answer in record.regroups.items()}
        gone = {f[0] for f in record.failures} | set(record.left)
        for m in sorted(record.members, key=lambda m: m.rank):
            member = Member(
                conn=next(self._away_ids),
                job=job,
                join_req_id=0,
                requested_rank=m.rank,
                host=m.host,
                pid=m.pid,
                addresses=list(m.addresses),
                peer="(away)",
                heartbeat_timeout=m.heartbeat_timeout,
                joined_at=now,
                last_seen=now,
                rank=m.rank,
                local_rank=m.local_rank,
                status="active",
                done=True,
                secret=m.secret,
            )
            job.by_rank.append(member)
            if m.rank not in gone:
                job.add(member)
                self._set_away(member, now)
        self.jobs[job.name] = job
        if record.barriers_done:
            self._barriers_done[job] = record.barriers_done
        self._logged.add(job)
        self.restored_jobs += 1
        self.log.record(
            "job_restored", job, world_size=job.world_size, away=len(job.members), keys=len(job.kv)
        )
        if self._next_sweep is None:
            self._next_sweep = now + self._sweep_interval
        return job

    def _set_away(self, member: Member, now: float) -> None:
        window = self.reattach_timeout or reattach_window(member.heartbeat_timeout)
        member.conn = next(self._away_ids)
        member.peer = "(away)"
        member.joined_at = now  # counts the window in its error message
        member.last_seen = now + window  # the sweep leaves it to the window
        self._away[member] = now + window

    # --- the state directory -----------------------------------------------------------

    def _tick(self, now: float) -> None:
        if now - self._last_input > STALL_GAP and self._heartbeats_due():
            # Silence while members owed heartbeats: this server stood still. (A server
            # with no formed job hears nothing for as long as its clients take to start:
            # its next input is no stall, and a death right after it is a failure.)
            self._stall_until = now + STALL_WINDOW
            for job in self.jobs.values():  # the silence was this server's, not theirs
                for member in job.members:
                    if member not in self._away:
                        member.last_seen = max(member.last_seen, now)
        self._last_input = now

    def _heartbeats_due(self) -> bool:
        """True if some member of a formed job owes this server heartbeats (rare: asked
        only after a silence)."""
        return any(
            job.complete and any(m.status == "active" for m in job.members)
            for job in self.jobs.values()
        )

    def _append(self, job: Job, rec: list[Any]) -> None:
        if self.durable is not None and job in self._logged:
            self.durable.append(rec)

    def _record_of(self, job: Job) -> JobRecord:
        return JobRecord(
            job.name,
            job.generation,
            job.world_size,
            [_member_record(m) for m in job.by_rank],
            job.min_world_size,
            job.max_world_size,
            dict(job.kv),
            self._barriers_done.get(job, 0),
            list(job.failures),
            dict(job.left),
            {key: list(answer) for key, answer in self._settled.get(job, {}).items()},
        )

    def _records(self) -> list[JobRecord]:
        return [self._record_of(job) for job in self.jobs.values() if job in self._logged]

    def close_state_dir(self) -> None:
        """Write what is queued and let go of the state directory."""
        if self.durable is not None:
            self.durable.close()


def _member_record(m: Member) -> MemberRecord:
    return MemberRecord(
        m.rank, m.local_rank, m.host, m.pid, m.addresses, m.heartbeat_timeout, m.secret or b""
    )


def _error(req_id: int, exc: BadRequest) -> ErrorReply:
    return ErrorReply(req_id, exc.code, str(exc), exc.details)
