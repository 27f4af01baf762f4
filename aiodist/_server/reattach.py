"""A server that went away and came back: re-attachment, members away, stalls, replay.

- **Re-attachment.** A member of a formed job whose server went away (killed,
  restarted, stopped for a while) reconnects and sends ``Reattach`` with the
  secret its ``Join`` carried, and the world size its ``Welcome`` said (an
  elastic job's newcomers were welcomed into a larger one). The member it
  names is given the new channel: its secret must match the one the server
  holds (compared in constant time), so a client that merely holds the token
  cannot take a member's place. Pending requests are sent again by the client
  after that (a barrier already passed answers at once, and so does a regroup
  decided: the job keeps both).
- **Durable state.** With a state directory, the jobs come back from its
  records (``replay``; ``records.py``), every member *away*. A job replaced by
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
import math
from typing import TYPE_CHECKING, Any, Final, cast

import msgpack

from aiodist._errors import ErrorCode
from aiodist._server.jobs import Away, Job, Member
from aiodist._server.parts import BadRequest, handles
from aiodist._server.records import (
    BarriersPassed,
    JobEnded,
    JobFormed,
    KeySet,
    MemberAdded,
    RankFailed,
    RankLeft,
    RegroupSettled,
    StoreAnswered,
)
from aiodist._server.regroups import Answer
from aiodist._wire.messages import MemberFailed, MembersFailed, Packed, Reattach, Reply
from aiodist._wire.timing import STALL_GAP, STALL_WINDOW, reattach_window

if TYPE_CHECKING:
    from aiodist._server.membership import Membership
    from aiodist._server.parts import ConnId, Outbox

# A re-attachment's secret is at least this long (aiodist's clients draw 32 bytes).
MIN_SECRET_BYTES: Final = 16


class Reattachment:
    """Members taken back after the server went away, and the jobs it brought back."""

    def __init__(
        self, membership: Membership, out: Outbox, now: float, *, timeout: float | None = None
    ) -> None:
        self._membership = membership
        self._out = out
        self.timeout = timeout
        self.reattached = 0  # members taken back
        self.restored_jobs = 0
        self._rebuilt: set[Job] = set()  # jobs rebuilt from re-attachments (no state kept)
        self._replayed: list[Job] = []  # jobs replayed, their members not yet away
        self._away_ids = itertools.count(-1, -1)  # connection ids nobody has
        self._last_input = now
        self._stall_until = -math.inf

    # --- re-attaching ----------------------------------------------------------------------

    @handles(Reattach)
    def reattach(self, conn: ConnId, msg: Reattach, now: float) -> None:
        membership = self._membership
        state = membership.conns[conn]
        if state.member is not None:
            raise BadRequest(
                ErrorCode.BAD_REQUEST,
                f"this channel already belongs to a member of job {state.member.job.name!r}",
            )
        self._out.check(msg)
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
        job = membership.jobs.get(msg.group_name)
        if job is None:
            if membership.durable:
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
        if (old := membership.conns.get(member.conn)) is not None and old.member is member:
            old.member = None  # it moved to this connection; its old one may linger
        if member.away is not None:
            member.away.done = True
            member.away = None
        member.conn = conn
        member.peer = state.peer
        member.last_seen = now
        member.sent = None  # its counts go on from before: its next report is the baseline
        state.member = member
        self.reattached += 1
        membership.log.record(
            "rank_reattached", job, rank=member.rank, host=member.host, pid=member.pid
        )
        self._out.send(conn, Reply(msg.req_id, None))
        if job.failures:
            # Every failure of its job (failure isolation: each breaks only what needs
            # that rank), those while it was away among them: it cannot tell the server
            # which ones it heard before, and a member ignores one it knows already.
            if len(job.failures) == 1:
                self._out.send(conn, MemberFailed(*job.failures[0]))
            else:
                entries = [list(failure) for failure in job.failures]
                packed = cast("list[Any]", Packed(msgpack.packb(entries)))
                self._out.send(conn, MembersFailed(packed))

    def _rebuild(self, msg: Reattach, now: float) -> Job:
        """A job this server never knew (it kept no state): its members re-register it."""
        name, hb = msg.group_name, float(msg.heartbeat_timeout)
        self.replay(JobFormed(name, msg.generation, msg.world_size, 0), now)
        for rank in range(msg.world_size):
            self.replay(MemberAdded(name, rank, 0, "", 0, [], hb, b""), now)
        job = self._membership.jobs[name]
        job.logged = False
        for member in job.by_rank:
            member.secret = None  # unknown: each rank's first re-attachment names it
        self._rebuilt.add(job)
        self.restored(now)
        return job

    # --- members away ----------------------------------------------------------------------

    def away(self, member: Member, now: float) -> None:
        """``member`` is away until it re-attaches, or its window ends: then it failed."""
        window = self.timeout or reattach_window(member.heartbeat_timeout)
        member.conn = next(self._away_ids)
        member.peer = "(away)"
        member.joined_at = now  # counts the window in its error message
        member.last_seen = now + window  # the sweep leaves it to the window
        member.away = Away(member, now + window)
        self._out.at(now + window, member.away, self._gone)

    def _gone(self, away: Away, now: float) -> None:
        member = away.member
        away.done = True
        window = away.until - member.joined_at
        membership = self._membership
        membership.fail(
            member,
            f"it did not come back within {window:.1f} s after the rendezvous server did "
            "(it died while the server was away, or cannot reach it)",
            now,
        )
        membership.remove(member, now)

    # --- stalls ----------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """An input at ``now``: after a silence while members owed heartbeats, this server
        stood still (a server with no formed job hears nothing for as long as its clients
        take to start: its next input is no stall, and a death right after it a failure)."""
        if now - self._last_input > STALL_GAP and self._heartbeats_due():
            self._stall_until = now + STALL_WINDOW
            for job in self._membership.jobs.values():  # the silence was this server's
                for member in job.members:
                    if member.away is None:
                        member.last_seen = max(member.last_seen, now)
        self._last_input = now

    def stalled(self, now: float) -> bool:
        """True right after a stall: a connection lost now is most likely reconnecting."""
        return now < self._stall_until

    def _heartbeats_due(self) -> bool:
        return any(
            job.complete and any(m.status == "active" for m in job.members)
            for job in self._membership.jobs.values()
        )

    # --- replaying the state directory -----------------------------------------------------

    def replay(self, rec: Any, now: float) -> None:
        """Apply one record read back from the state directory (``records.py``).

        Raises:
            ValueError: The record does not fit what came before it (a job it names
                unknown, a rank out of range): the state directory is damaged.
        """
        jobs = self._membership.jobs
        if isinstance(rec, JobFormed):
            if rec.max_world_size and rec.max_world_size < rec.min_world_size:
                raise ValueError(
                    f"job {rec.job!r} may grow to {rec.max_world_size} members, fewer than it "
                    f"formed with ({rec.min_world_size})"
                )
            job = Job(
                rec.job,
                0,
                created_at=now,
                out=self._out,
                generation=rec.generation,
                min_world_size=rec.min_world_size,
                max_world_size=rec.max_world_size,
            )
            job.complete, job.formed_at, job.logged = True, now, self._membership.durable
            jobs[rec.job] = job  # a later generation takes the name
            self._replayed.append(job)
            return
        found = jobs.get(rec.job)
        if found is None:
            raise ValueError(f"a {type(rec).__name__} record for a job with no JobFormed record")
        job = found
        if isinstance(rec, MemberAdded):
            if rec.rank != job.world_size:
                raise ValueError(f"a member of job {job.name!r} must have rank {job.world_size}")
            if job.world_size >= job.min_world_size and not job.max_world_size:
                raise ValueError(f"a newcomer joined job {job.name!r}, which is not elastic")
            member = Member(
                conn=next(self._away_ids),
                job=job,
                join_req_id=0,
                requested_rank=rec.rank,
                host=rec.host,
                pid=rec.pid,
                addresses=list(rec.addresses),
                peer="(away)",
                heartbeat_timeout=rec.heartbeat_timeout,
                joined_at=now,
                last_seen=now,
                rank=rec.rank,
                local_rank=rec.local_rank,
                status="active",
                done=True,
                secret=rec.secret,
            )
            job.world_size += 1
            job.by_rank.append(member)
            job.add(member)
            return
        if isinstance(rec, JobEnded):
            if rec.generation == job.generation:
                del jobs[job.name]
            return
        if isinstance(rec, KeySet):
            job.store.restore(rec.key, rec.value)
            return
        if isinstance(rec, StoreAnswered):
            job.store.restore_answer(rec)
            return
        if isinstance(rec, BarriersPassed):
            job.barriers.restore(rec)
            return
        if isinstance(rec, RegroupSettled):
            if any(not 0 <= r < job.world_size for r in rec.ranks):
                raise ValueError(f"a regroup of job {job.name!r} names a rank it does not have")
            if rec.code and rec.code not in ErrorCode._value2member_map_:
                raise ValueError(f"an error code expected, got {rec.code}")
            code = ErrorCode(rec.code) if rec.code else 0
            job.regroups.restore(rec.key, Answer(rec.ranks, code, rec.message, rec.details))
            return
        if not isinstance(rec, RankFailed | RankLeft):
            raise ValueError(f"no replay for record {type(rec).__name__}")
        if not 0 <= rec.rank < job.world_size:
            raise ValueError(f"rank {rec.rank} of job {job.name!r}, which has {job.world_size}")
        member = job.by_rank[rec.rank]
        if isinstance(rec, RankFailed):
            job.failures.append((rec.rank, rec.host, rec.pid, rec.reason))
            member.status = "failed"
        else:
            job.left[rec.rank] = (rec.host, rec.pid)
            member.status = "left"
        job.discard(member)

    def restored(self, now: float) -> None:
        """The records are replayed: every member still in its job is away until it is back."""
        membership = self._membership
        replayed, self._replayed = self._replayed, []
        for job in replayed:
            if membership.jobs.get(job.name) is not job:
                continue  # ended, or a later generation took its name
            if len(job.by_rank) < job.min_world_size:
                raise ValueError(
                    f"job {job.name!r} has {len(job.by_rank)} members, fewer than the "
                    f"{job.min_world_size} it formed with"
                )
            # Each failure, leave and admission was one epoch (``membership.py``): the
            # members' views go on from there, and so must the next join's.
            job.epoch = len(job.failures) + len(job.left) + job.world_size - job.min_world_size
            for member in job.members:
                self.away(member, now)
                membership.watch(member.heartbeat_timeout, now)
            self.restored_jobs += 1
            membership.log.record(
                "job_restored",
                job,
                world_size=job.world_size,
                away=len(job.members),
                keys=len(job.store.kv),
            )
