"""Who is in which job: joins, formation, growth, leaves, failures, the heartbeat sweep.

Rules this part of the job table keeps:

- A job is keyed by ``group_name``. It is *forming* until ``world_size``
  members have joined, then *complete*: ranks are assigned and every member
  gets the same ``Welcome``; the member table is fetched on first need
  (``MembersRequest``). A durable server records the job now (``Job.records``).
- A join that conflicts with the job (a rank already taken, a job already
  complete) gets an error naming the conflict; the job itself is left untouched.
  A join with another world size than a *forming* job's breaks that job: no
  world size can be right for all of them, so the newcomer and every member
  waiting get the same WORLD_SIZE_MISMATCH error naming both sizes, and the
  job is dropped. A complete job is not affected by such a stray joiner.
- Automatic ranks fill the ranks no member asked for, grouped by host in the
  order hosts first joined, so ranks on one host are contiguous and
  ``local_rank`` means what torchrun means.
- **Growth.** A job is elastic when its members joined with ``max_world_size``
  (torchrun's ``--nnodes MIN:MAX``): it forms with ``world_size`` members and
  then admits a process that joins it while fewer than ``max_world_size``
  members are alive. A newcomer gets the next free rank: ranks are never
  given again (a dead rank's number stays with its failure), and the job's
  rank space (``Job.world_size``) grows by one. Each membership change of a
  formed job (a join, a failure, a leave) bumps its ``epoch``; leaves and
  failures held back are announced before a join, and the join to every
  member alive, the newcomer included (``MembersJoined``: the new view). The
  newcomer proved the token as every member does, and forms groups with the
  others by a regroup agreement (``regroups.py``).
- A member of a complete job whose connection drops, or who misses heartbeats,
  has *failed*: every other member is told (``notices.py``), and the job's
  barriers fail. Nothing else breaks: the store, and the groups that do not
  contain it, go on (failure isolation). A member that leaves cleanly has not
  failed: the others are told, and the barriers it will not reach fail. A
  member whose program ended with an uncaught exception leaves with a reason:
  it failed. A forming member that disconnects simply drops out. Either way
  the pending regroups no longer wait on it.
- A job's state is dropped when its last member is gone.
- A job is started anew under the same name with a later *generation* (a
  launcher's restart count, in ``Join``): the first member of the later
  generation replaces the job (members of the earlier one, if any are left,
  go on alone in the record they hold) and a member of an earlier generation
  than the job's is refused.
- Heartbeats are checked by a periodic sweep, every quarter of the shortest
  heartbeat timeout of the members present, never more often than every
  ``MIN_SWEEP_INTERVAL``: it speeds up for a job with a short timeout, and
  slows down again once that job is gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

import msgpack

from aiodist._errors import ErrorCode
from aiodist._server.jobs import Job, Member, assign_ranks, host_runs
from aiodist._server.parts import BadRequest, handles
from aiodist._wire.bounds import MIN_HEARTBEAT_TIMEOUT
from aiodist._wire.messages import (
    ErrorReply,
    Join,
    Leave,
    MembersJoined,
    MembersRequest,
    Packed,
    Reply,
    Welcome,
)
from aiodist._wire.text import printable

if TYPE_CHECKING:
    from aiodist._server.events import JobLog
    from aiodist._server.parts import ConnId, Outbox

MAX_SWEEP_INTERVAL: Final = 1.0
# The sweep for silent members runs at most this often, whatever a member asked for.
MIN_SWEEP_INTERVAL: Final = MIN_HEARTBEAT_TIMEOUT / 4


@dataclass(slots=True)
class Conn:
    peer: str
    member: Member | None = None
    channel: bool = False  # a member's channel on a shared connection, not a socket


@dataclass(slots=True)
class Stats:
    """The server's counters, each reported under its field's name (status, metrics)."""

    joins: int = 0
    jobs_formed: int = 0
    failures: int = 0
    store_ops: int = 0
    messages: int = 0


class Membership:
    """The jobs of one server and the connections of their members."""

    def __init__(self, out: Outbox, log: JobLog, stats: Stats) -> None:
        self.out = out
        self.log = log
        self.stats = stats
        self.jobs: dict[str, Job] = {}
        self.conns: dict[ConnId, Conn] = {}
        self.closing = False
        self.durable = False  # a state directory keeps the formed jobs (``Job.logged``)
        self.restartable = False  # told to members in their Welcome (see reattach.py)
        self.next_sweep: float | None = None
        self._sweep_interval = MAX_SWEEP_INTERVAL

    # --- joining ---------------------------------------------------------------------------

    @handles(Join)
    def join(self, conn: ConnId, msg: Join, now: float) -> None:
        state = self.conns[conn]
        if state.member is not None:
            raise BadRequest(
                ErrorCode.BAD_REQUEST,
                f"this channel already joined job {state.member.job.name!r}; "
                "open one channel per member",
            )
        self.out.check(msg)
        if msg.rank >= msg.world_size:
            raise BadRequest(
                ErrorCode.BAD_REQUEST,
                f"Join.rank must be -1 (automatic) or in [0, {msg.world_size}), got {msg.rank}",
                {"field": "Join.rank", "value": msg.rank, "allowed": f"[-1, {msg.world_size})"},
            )
        job = self.jobs.get(msg.group_name)
        previous = None
        grow = False  # a join of a formed elastic job
        if job is not None and msg.generation != job.generation:
            if msg.generation < job.generation:
                raise BadRequest(
                    ErrorCode.RENDEZVOUS,
                    f"this process joined generation {msg.generation} of job {job.name!r}, but "
                    f"the job was started again (generation {job.generation} is running); it "
                    "is left over from an earlier start: stop it",
                    {"generations": [job.generation, msg.generation]},
                )
            previous, job = job, None
            del self.jobs[previous.name]  # its members go on in the record they hold
            previous.logged = False  # a restart forgets them
        if job is None:
            job = Job(
                msg.group_name,
                msg.world_size,
                created_at=now,
                out=self.out,
                generation=msg.generation,
                max_world_size=msg.max_world_size,
            )
            self.jobs[msg.group_name] = job
            self.log.job_created(job, previous)
        elif job.min_world_size != msg.world_size:
            if not job.complete:
                self._break_forming_job(job, msg, now)  # raises for the newcomer
            raise BadRequest(
                ErrorCode.WORLD_SIZE_MISMATCH,
                f"job {job.name!r} is running with world_size {job.min_world_size}, but this "
                f"process asked for {msg.world_size}; start every rank with the same world "
                "size, or use another group_name",
                {"world_sizes": [job.min_world_size, msg.world_size]},
            )
        elif job.complete and job.max_world_size:
            _check_admission(job, msg)
            grow = True
        elif job.complete:
            if msg.rank >= 0 and (taken := job.by_rank[msg.rank]) in job.members:
                raise _rank_taken(job, msg.rank, taken)
            raise BadRequest(
                ErrorCode.JOB_FULL,
                f"job {job.name!r} already has all {job.world_size} members; use another "
                "group_name, or wait until that job ends",
            )
        if msg.rank >= 0 and (holder := job.requested.get(msg.rank)) is not None:
            raise _rank_taken(job, msg.rank, holder)
        self.stats.joins += 1
        member = Member(
            conn=conn,
            job=job,
            join_req_id=msg.req_id,
            requested_rank=msg.rank,
            host=msg.host,
            pid=msg.pid,
            addresses=list(msg.addresses),
            peer=state.peer,
            heartbeat_timeout=float(msg.heartbeat_timeout),
            joined_at=now,
            last_seen=now,
            secret=msg.secret,
        )
        job.add(member)
        state.member = member
        self.log.rank_joined(member)
        self.watch(member.heartbeat_timeout, now)
        if grow:
            self._admit(member, now)
        elif len(job.members) < job.world_size:
            self.out.at(now + msg.timeout, member, self._join_timed_out)
        else:
            self._form(job, now)

    def watch(self, heartbeat_timeout: float, now: float) -> None:
        """A member with ``heartbeat_timeout`` is here: sweep often enough for it."""
        self._sweep_interval = min(self._sweep_interval, _sweep_interval(heartbeat_timeout))
        # A shorter heartbeat timeout than any before must not wait for a sweep planned
        # with the old, longer interval.
        if self.next_sweep is None or now + self._sweep_interval < self.next_sweep:
            self.next_sweep = now + self._sweep_interval

    def _form(self, job: Job, now: float) -> None:
        assign_ranks(job)
        job.complete = True
        job.formed_at = now
        self.stats.jobs_formed += 1
        self.log.job_formed(job, now)
        if self.durable:
            job.logged = True
            for rec in job.records():  # the job as it formed: from now on, each change
                self.out.record(job, rec)
        local_sizes, runs = host_runs(job.by_rank)
        # Encoded once for the whole job: every member gets the same bytes.
        packed_runs = cast("list[list[int]]", Packed(msgpack.packb(runs)))
        for m in job.by_rank:
            m.done = True  # its join deadline no longer applies
            m.status = "active"
            m.last_seen = now  # waiting for the others to join is not missing heartbeats
            self.out.send(
                m.conn,
                Welcome(
                    m.join_req_id,
                    m.rank,
                    job.world_size,
                    m.local_rank,
                    local_sizes[m.host],
                    packed_runs,
                    self.restartable,
                ),
            )

    def _admit(self, member: Member, now: float) -> None:
        """Give ``member``, which joined a formed elastic job, the next rank; tell everyone."""
        job = member.job
        # Leaves and failures wait a moment to go out together: send them before the join,
        # so that every member counts the epochs in the server's order, and the newcomer
        # (whose first view is the join's) is not told of them.
        job.notices.flush(now)
        used = {
            m.local_rank
            for m in job.members
            if m.host == member.host and m is not member and m.status == "active"
        }
        member.local_rank = min(set(range(len(used) + 1)) - used)
        member.done = True  # no join deadline: it is in
        member.status = "active"
        job.grown(member)
        job.epoch += 1
        _, runs = host_runs(job.by_rank)
        alive = [m.rank for m in job.by_rank if m in job.members and m.status == "active"]
        self.out.send(
            member.conn,
            Welcome(
                member.join_req_id,
                member.rank,
                job.world_size,
                member.local_rank,
                sum(1 for m in job.members if m.host == member.host and m.status == "active"),
                runs,
                self.restartable,  # it re-attaches after a restart, as every member does
            ),
        )
        joined = [[member.rank, member.host, member.pid]]
        notice = MembersJoined(
            job.epoch, job.world_size, cast("list[int]", Packed(msgpack.packb(alive))), joined
        )
        for m in job.members:
            if m.status == "active":
                self.out.send(m.conn, notice)

    def _break_forming_job(self, job: Job, msg: Join, now: float) -> None:
        """Fail every member of forming ``job`` and the joiner ``msg``: they disagree on its size.

        Raises:
            BadRequest: Always: the joiner's error, the same as every member's.
        """
        first = next(iter(job.members))
        message = (
            f"the processes of job {job.name!r} disagree on world_size: {len(job.members)} "
            f"joined with {job.world_size} (the first: pid {first.pid} on host {first.host}), "
            f"pid {msg.pid} on host {msg.host} with {msg.world_size}; the job cannot form and "
            "was dropped. Start every rank with the same world size, then start them all again"
        )
        details = {"world_sizes": [job.world_size, msg.world_size]}
        job.end_reason = (
            f"world sizes disagree: {job.world_size} and {msg.world_size} (pid {msg.pid} on "
            f"host {msg.host})"
        )
        for member in list(job.members):
            self.out.send(
                member.conn,
                ErrorReply(member.join_req_id, ErrorCode.WORLD_SIZE_MISMATCH, message, details),
            )
        for waiter in job.store.waiters():  # store waits of members still forming
            if not waiter.done:
                waiter.done = True
                self.out.send(
                    waiter.conn,
                    ErrorReply(waiter.req_id, ErrorCode.WORLD_SIZE_MISMATCH, message, details),
                )
        for member in list(job.members):
            self.remove(member, now)  # the last one drops the job
            self.conns[member.conn].member = None
        raise BadRequest(ErrorCode.WORLD_SIZE_MISMATCH, message, details)

    def _join_timed_out(self, member: Member, now: float) -> None:
        job = member.job
        present = sorted(
            f"rank {m.requested_rank}" if m.requested_rank >= 0 else f"pid {m.pid}@{m.host}"
            for m in job.members
        )
        self.out.send(
            member.conn,
            ErrorReply(
                member.join_req_id,
                ErrorCode.RENDEZVOUS_TIMEOUT,
                f"job {job.name!r} did not form: {len(job.members)} of {job.world_size} members "
                f"joined ({', '.join(present)}); check that every rank was started and points "
                "at this server",
                {},
            ),
        )
        if not job.end_reason:
            job.end_reason = (
                f"did not form: {len(job.members)} of {job.world_size} members joined in time"
            )
        self.remove(member, now)
        self.conns[member.conn].member = None

    # --- leaving ---------------------------------------------------------------------------

    @handles(Leave)
    def leave(self, conn: ConnId, msg: Leave, now: float) -> None:
        state = self.conns[conn]
        member = state.member
        if member is None:
            self.out.send(conn, Reply(msg.req_id, None))
            return
        job = member.job
        was_active = member.status == "active"  # a member of a formed job, not failed
        if was_active and msg.reason and not job.failures:
            # It failed (its program ended with an uncaught exception): the others hear
            # that, not that it left; a member failing after the first failure is one of
            # its victims, and leaves as usual.
            self.fail(member, printable(msg.reason), now)  # it reaches terminals
            was_active = False
        if member.status != "failed":
            member.status = "left"
        if was_active:
            job.gone_cleanly(member)
            job.notices.left(member, now)
        self.out.send(conn, Reply(msg.req_id, None))
        self.remove(member, now)
        state.member = None
        if was_active:
            job.regroups.members_gone()

    @handles(MembersRequest)
    def member_table(self, conn: ConnId, msg: MembersRequest, now: float) -> None:
        job = self.joined(conn, msg).job
        if not job.complete:
            raise BadRequest(
                ErrorCode.BAD_REQUEST, f"job {job.name!r} has not formed; join it first"
            )
        self.out.send(conn, Reply(msg.req_id, job.packed_table()))

    def joined(self, conn: ConnId, msg: Any) -> Member:
        """The member on ``conn``, which sent ``msg``.

        Raises:
            BadRequest: No member joined on ``conn``.
        """
        member = self.conns[conn].member
        if member is None:
            raise BadRequest(
                ErrorCode.NOT_JOINED, f"{type(msg).__name__} needs a joined job; join one first"
            )
        return member

    def connection_lost(self, conn: ConnId, now: float, reason: str) -> None:
        state = self.conns.pop(conn, None)
        if state is None or state.member is None:
            return
        member = state.member
        # A server shutting down drops its members; that is no failure of theirs.
        if member.job.complete and member.status == "active" and not self.closing:
            self.fail(member, f"{reason} (control connection from {state.peer})", now)
        self.remove(member, now)

    # --- failing ---------------------------------------------------------------------------

    def fail(self, member: Member, reason: str, now: float) -> None:
        """``member`` of a formed job failed: tell everyone; its job's barriers fail."""
        job = member.job
        job.failed(member, reason)
        self.stats.failures += 1
        self.log.rank_failed(member, reason, now)
        job.notices.failed(member, reason, now, connected=member.conn in self.conns)
        message = (
            f"rank {member.rank} (host {member.host}, pid {member.pid}) failed: {reason}; "
            f"the barriers of job {job.name!r} need every member and fail from now on. "
            "Groups that do not contain it go on (see shrink_group)."
        )
        details = {"rank": member.rank, "host": member.host, "pid": member.pid, "reason": reason}
        # Only the job's barriers need every member; the store goes on (failure isolation).
        job.barriers.member_failed(message, details)
        job.regroups.members_gone()

    def remove(self, member: Member, now: float) -> None:
        """``member`` is gone from its job; the last one gone ends the job."""
        member.done = True
        if member.away is not None:
            member.away.done = True
        job = member.job
        job.discard(member)
        if member.status == "left" and member.rank in job.left:
            job.barriers.member_left(member.rank)
        if not job.members and not job.ended:
            self._end(job, now)

    def _end(self, job: Job, now: float) -> None:
        job.ended = True
        if self.jobs.get(job.name) is job:  # not replaced by a later generation
            del self.jobs[job.name]
        for waiter in [*job.store.waiters(), *job.barriers.waiters()]:
            waiter.done = True
        job.notices.ended()
        job.regroups.ended()
        job.end()
        self.log.job_finished(job, now)

    def sweep(self, now: float) -> None:
        """Fail the members silent for longer than their heartbeat timeout."""
        shortest = MAX_SWEEP_INTERVAL  # what the members still here need: it may grow again
        for job in list(self.jobs.values()):
            for member in list(job.members):
                shortest = min(shortest, _sweep_interval(member.heartbeat_timeout))
                silent = now - member.last_seen
                if member.status == "active" and silent > member.heartbeat_timeout:
                    self.fail(member, f"missed heartbeats for {silent:.1f} s", now)
                    self.remove(member, now)
                    self.out.send(
                        member.conn,
                        ErrorReply(
                            0, ErrorCode.RANK_FAILED, "declared failed: missed heartbeats", {}
                        ),
                    )
                    self.out.close(member.conn, "missed heartbeats")
                    self.conns[member.conn].member = None
        self._sweep_interval = shortest
        self.next_sweep = now + self._sweep_interval if self.jobs else None

    def close(self, reason: str) -> None:
        """The server is going away for good: its jobs end with it."""
        self.closing = True
        for job in self.jobs.values():
            # Its members are dropped with the server: the job did not end well.
            if not job.end_reason:
                job.end_reason = f"cut off: the rendezvous server shut down ({reason})"


def _check_admission(job: Job, msg: Join) -> None:
    """Refuse ``msg``, a join of formed elastic ``job``, unless it can be admitted.

    Raises:
        BadRequest: The job is at its largest size, or the joiner asks for a rank
            or another largest size.
    """
    if msg.max_world_size != job.max_world_size:
        raise BadRequest(
            ErrorCode.WORLD_SIZE_MISMATCH,
            f"job {job.name!r} is elastic with at most {job.max_world_size} members, but this "
            f"process asked for {msg.max_world_size or 'a job that is not elastic'}; start "
            "every rank with the same MIN:MAX",
            {"world_sizes": [job.max_world_size, msg.max_world_size]},
        )
    if msg.rank >= 0:
        raise BadRequest(
            ErrorCode.BAD_REQUEST,
            f"job {job.name!r} has formed: a process that joins it gets the next free rank; "
            f"start it without a rank (it asked for {msg.rank})",
            {"rank": msg.rank},
        )
    alive = job.alive()
    if alive >= job.max_world_size:
        raise BadRequest(
            ErrorCode.JOB_FULL,
            f"elastic job {job.name!r} already has {alive} members alive, its largest size "
            f"({job.max_world_size}); join it again once a member is gone",
        )


def _rank_taken(job: Job, rank: int, holder: Member) -> BadRequest:
    return BadRequest(
        ErrorCode.DUPLICATE_RANK,
        f"rank {rank} of job {job.name!r} is already taken by pid {holder.pid} on host "
        f"{holder.host}; give every process its own rank (RANK)",
        {"rank": rank, "host": holder.host, "pid": holder.pid},
    )


def _sweep_interval(heartbeat_timeout: float) -> float:
    return min(max(heartbeat_timeout / 4, MIN_SWEEP_INTERVAL), MAX_SWEEP_INTERVAL)
