"""The rendezvous server's job table, sans-IO: messages and time in, actions out.

Rules this module keeps (the asyncio shell in ``serve.py`` only moves bytes):

- A job is keyed by ``group_name``. It is *forming* until ``world_size``
  members have joined, then *complete*: ranks are assigned and every member
  gets the same ``Welcome`` with the table of all members' addresses.
- A join that conflicts with the job (a rank already taken, a job already
  complete) gets an error naming the conflict; the job itself is left untouched.
  A join with another world size than a *forming* job's breaks that job: no
  world size can be right for all of them, so the newcomer and every member
  waiting get the same WORLD_SIZE_MISMATCH error naming both sizes, and the
  job is dropped. A complete job is not affected by such a stray joiner.
- Automatic ranks fill the ranks no member asked for, grouped by host in the
  order hosts first joined, so ranks on one host are contiguous and
  ``local_rank`` means what torchrun means.
- A member of a complete job whose connection drops, or who misses heartbeats,
  has *failed*: every other member is told once, and the job's barriers (which
  need every member) fail with RANK_FAILED, now and later. Nothing else
  breaks: the store, and the groups that do not contain it, go on (failure
  isolation; the members break the groups that contain it). A member that
  leaves cleanly has not failed: the others are told (``MembersLeft``, at most
  one notice per ``LEAVE_NOTICE_INTERVAL``, stretched for jobs of more than
  ``NOTICE_FANOUT`` members, so a job of N members ending costs O(N)
  notices, not O(N^2)), and the barriers it will not reach fail. Failures are
  told the same way: the first at once (``MemberFailed``), those after it within
  ``FAILURE_NOTICE_INTERVAL`` together (``MembersFailed``). A
  forming member that disconnects simply drops out.
- Members agree on a group's next membership through the server
  (``Regroup``, ``elastic.py``): a failure or a leave is fed to the pending
  agreements, so that every caller gets the same answer.
- A job's state is dropped when its last member is gone.
- A job is started anew under the same name with a later *generation* (a
  launcher's restart count, in ``Join``): the first member of the later
  generation replaces the job (members of the earlier one, if any are left,
  go on alone in the record they hold) and a member of an earlier generation
  than the job's is refused.
- Each turn of a job's life is an event (``events.py``) the shell logs.
- A job's ranks are asked to dump their flight recorders (``DumpRequest``,
  from any client) at most once per ``DUMP_INTERVAL``: the requests in between
  share the last notice, so that no number of status commands can keep ranks
  busy writing dumps.
- Store operations and barriers, and the waits they park, are the job
  table's other half (``store.py``).
- Nothing here blocks or allocates per byte; deadlines live in one heap, and
  heartbeats are checked by a periodic sweep.
- Every timeout is checked before it is added to the clock (``_wire/bounds.py``,
  as on decoding): the heap only ever holds finite deadlines (one NaN breaks a
  heap's order for every job), and the sweep runs every quarter of the
  shortest heartbeat timeout of the members present, never more often than
  every ``MIN_SWEEP_INTERVAL``: it speeds up for a job with a short timeout,
  and slows down again once that job is gone.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

import msgpack

from aiodist._errors import ErrorCode
from aiodist._server.elastic import Agreement, Agreements
from aiodist._server.events import JobLog
from aiodist._server.grow import Growth, check_admission, host_runs
from aiodist._server.jobs import (
    BadRequest,
    Close,
    FailureNotice,
    Job,
    LeaveNotice,
    Member,
    assign_ranks,
)
from aiodist._server.store import STORE_REQUESTS, StoreAndBarriers, left_error
from aiodist._server.where import heard
from aiodist._wire.bounds import MIN_HEARTBEAT_TIMEOUT
from aiodist._wire.messages import (
    Barrier,
    DumpNotice,
    DumpRequest,
    ErrorReply,
    Heartbeat,
    Join,
    Leave,
    MemberFailed,
    MembersFailed,
    MembersLeft,
    MembersRequest,
    Packed,
    Regroup,
    Reply,
    ServerClosing,
    StatusRequest,
    Welcome,
)
from aiodist._wire.text import printable

if TYPE_CHECKING:
    from aiodist._server.jobs import ConnId, Send

__all__ = ["ServerState"]

MAX_SWEEP_INTERVAL: Final = 1.0
# The sweep for silent members runs at most this often, whatever a member asked for.
MIN_SWEEP_INTERVAL: Final = MIN_HEARTBEAT_TIMEOUT / 4
# The least time between two notices of members that left one job (the first goes at once).
LEAVE_NOTICE_INTERVAL: Final = 0.1
# The same for failures: the first is told at once, those within the interval after it
# together (a job of N dying at once costs O(N) notices, not N^2: 8.4M for 4K members).
FAILURE_NOTICE_INTERVAL: Final = 0.05
# Members a notice may go to per interval before the next one waits longer, up to a
# second (failures are told within a second).
NOTICE_FANOUT: Final = 1024
MAX_NOTICE_INTERVAL: Final = 1.0
RECENT_IN_STATUS: Final = 16  # finished jobs a status report lists
STATUS_JOBS: Final = 100  # jobs a status report lists (of however many the server holds)
STATUS_RANKS: Final = 64  # ranks each job of such a list shows
JOB_STATUS_RANKS: Final = 4096  # ranks `aiodist status --job J` shows
#: The least time between two notices asking one job's ranks for their flight recorders.
DUMP_INTERVAL: Final = 2.0
LEFT_BEFORE_FAILURE: Final = 8  # leaves before a job's first failure that its record names


@dataclass(slots=True)
class _Conn:
    peer: str
    opened_at: float
    member: Member | None = None
    channel: bool = False  # a member's channel on a shared connection, not a socket


@dataclass(slots=True)
class Stats:
    joins: int = 0
    jobs_formed: int = 0
    failures: int = 0
    store_ops: int = 0
    messages: int = 0


class ServerState(StoreAndBarriers, Agreements, Growth):
    """All jobs of one server. Feed it messages and time; collect actions."""

    def __init__(self, now: float) -> None:
        StoreAndBarriers.__init__(self)
        Agreements.__init__(self)
        self.started_at = now
        self.version = ""  # reported by status; the shell fills it in
        self.closing = False
        self.restartable = False  # told to members in their Welcome (see restart.py)
        self.jobs: dict[str, Job] = {}
        self.log = JobLog()
        self.stats = Stats()
        self._conns: dict[ConnId, _Conn] = {}
        self._next_sweep: float | None = None
        self._sweep_interval = MAX_SWEEP_INTERVAL

    # --- inputs ------------------------------------------------------------------

    def connection_made(
        self, conn: ConnId, peer: str, now: float, *, channel: bool = False
    ) -> None:
        self._conns[conn] = _Conn(peer=peer, opened_at=now, channel=channel)

    def connection_lost(self, conn: ConnId, now: float, reason: str = "connection lost") -> None:
        state = self._conns.pop(conn, None)
        if state is None or state.member is None:
            return
        member = state.member
        # A server shutting down drops its members; that is no failure of theirs.
        if member.job.complete and member.status == "active" and not self.closing:
            self._fail(member, f"{reason} (control connection from {state.peer})", now)
        self._remove(member, now)

    def receive(self, conn: ConnId, msg: Any, now: float, *, decoded: bool = False) -> None:
        """Handle ``msg`` from connection ``conn``; ``decoded``: it came from the wire, its
        values checked on decoding (``_wire/bounds.py``), so they are not checked again."""
        self._decoded = msg if decoded else None
        state = self._conns[conn]
        self.stats.messages += 1
        if state.member is not None:
            state.member.last_seen = now
            state.member.job.messages += 1
        if isinstance(msg, Heartbeat):
            if msg.where and state.member is not None:
                heard(state.member, msg.where[0], now)
            return
        req_id = getattr(msg, "req_id", 0)
        try:
            self._dispatch(conn, state, msg, now)
        except BadRequest as exc:
            self._send(conn, ErrorReply(req_id, exc.code, str(exc), exc.details))

    def job_of(self, conn: ConnId) -> Job | None:
        """The job of the member on connection (channel) ``conn``, if any."""
        state = self._conns.get(conn)
        return None if state is None or state.member is None else state.member.job

    def bad_request(self, conn: ConnId, req_id: int, message: str, details: dict[str, Any]) -> None:
        """Refuse request ``req_id`` of ``conn``: a value of it was out of range on decoding.

        Queued with the other actions, so the error leaves in order with the
        replies before it; the connection goes on.
        """
        self.stats.messages += 1
        self._send(conn, ErrorReply(req_id, ErrorCode.BAD_REQUEST, message, details))

    def next_deadline(self) -> float | None:
        """When ``handle_timeouts`` must next be called; None when nothing is pending."""
        timers = self._timers
        while timers and timers[0][2].done:
            heapq.heappop(timers)
        candidates = [t for t in (self._next_sweep,) if t is not None]
        if timers:
            candidates.append(timers[0][0])
        return min(candidates) if candidates else None

    def handle_timeouts(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            target = heapq.heappop(self._timers)[2]
            if target.done:
                continue
            if isinstance(target, Member):
                self._join_timed_out(target, now)
            elif isinstance(target, LeaveNotice):
                self._send_leave_notice(target.job, now)
            elif isinstance(target, FailureNotice):
                self._send_failure_notice(target.job, now)
            elif isinstance(target, Agreement):
                self._agreement_timed_out(target)
            else:
                self._waiter_timed_out(target)
        if self._next_sweep is not None and self._next_sweep <= now:
            self._sweep(now)

    def close(self, reason: str) -> None:
        """Tell every connection that the server is going away."""
        self.closing = True
        for job in self.jobs.values():
            # Its members are dropped with the server: the job did not end well.
            if not job.end_reason:
                job.end_reason = f"cut off: the rendezvous server shut down ({reason})"
        for conn in list(self._conns):
            self._send(conn, ServerClosing(reason))

    def take_actions(self) -> list[Send | Close]:
        actions, self._actions = self._actions, []
        return actions

    def take_events(self) -> list[dict[str, Any]]:
        """The job events recorded since the last call (see ``events.py``), oldest first."""
        return self.log.take()

    # --- dispatch ----------------------------------------------------------------

    def _dispatch(self, conn: ConnId, state: _Conn, msg: Any, now: float) -> None:
        if isinstance(msg, Join):
            self._join(conn, state, msg, now)
            return
        if isinstance(msg, StatusRequest):
            ranks = JOB_STATUS_RANKS if msg.job else STATUS_RANKS
            snap = self.snapshot(now, asking=conn, job=msg.job, max_members=ranks)
            self._send(conn, Reply(msg.req_id, snap))
            return
        if isinstance(msg, DumpRequest):
            self._send(conn, Reply(msg.req_id, self._ask_dumps(msg, now)))
            return
        member = state.member
        if member is None:
            if isinstance(msg, Leave):
                self._send(conn, Reply(msg.req_id, None))
                return
            raise BadRequest(
                ErrorCode.NOT_JOINED, f"{type(msg).__name__} needs a joined job; join one first"
            )
        job = member.job
        if isinstance(msg, Leave):
            was_active = member.status == "active"  # a member of a formed job, not failed
            if was_active and msg.reason and not job.failures:
                # It failed (its program ended with an uncaught exception): the others
                # hear that, not that it left; a member failing after the first failure
                # is one of its victims, and leaves as usual.
                self._fail(member, printable(msg.reason), now)  # it reaches terminals
                was_active = False
            if member.status != "failed":
                member.status = "left"
            if was_active:
                job.epoch += 1
                job.left[member.rank] = (member.host, member.pid)
                self._announce_leave(member, now)
            self._send(conn, Reply(msg.req_id, None))
            self._remove(member, now)
            state.member = None
            if was_active:
                self._members_gone(job)
        elif isinstance(msg, Barrier):
            self._barrier(member, msg, now)
        elif isinstance(msg, Regroup):
            self._regroup(member, msg, now)
        elif isinstance(msg, MembersRequest):
            if not job.complete:
                raise BadRequest(
                    ErrorCode.BAD_REQUEST, f"job {job.name!r} has not formed; join it first"
                )
            self._send(conn, Reply(msg.req_id, job.packed_table()))
        elif isinstance(msg, STORE_REQUESTS):
            self.stats.store_ops += 1
            self._store_op(conn, job, msg, now)
        else:
            raise BadRequest(ErrorCode.BAD_REQUEST, f"a client may not send {type(msg).__name__}")

    def _ask_dumps(self, msg: DumpRequest, now: float) -> dict[str, Any]:
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
                    self._send(m.conn, notice)
                    told.append(m.rank)
            job.dump = (now, request, sorted(told))
        _, request, ranks = job.dump
        return {"ranks": ranks, "request": request}

    # --- membership ----------------------------------------------------------------

    def _join(self, conn: ConnId, state: _Conn, msg: Join, now: float) -> None:
        if state.member is not None:
            raise BadRequest(
                ErrorCode.BAD_REQUEST,
                f"this channel already joined job {state.member.job.name!r}; "
                "open one channel per member",
            )
        self._check_values(msg)
        _validate_join(msg)
        job = self.jobs.get(msg.group_name)
        previous = None
        grow = False  # a join of a formed elastic job (grow.py)
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
            self._replaced(previous)
        if job is None:
            job = Job(
                msg.group_name,
                msg.world_size,
                created_at=now,
                generation=msg.generation,
                min_world_size=msg.world_size,
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
            check_admission(job, msg)
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
        self._sweep_interval = min(self._sweep_interval, _sweep_interval(member.heartbeat_timeout))
        # A shorter heartbeat timeout than any before must not wait for a sweep planned
        # with the old, longer interval.
        if self._next_sweep is None or now + self._sweep_interval < self._next_sweep:
            self._next_sweep = now + self._sweep_interval
        if grow:
            self._admit(member, now)
            return
        if len(job.members) < job.world_size:
            self._push_timer(now + msg.timeout, member)
            return
        assign_ranks(job)
        job.complete = True
        job.formed_at = now
        self.stats.jobs_formed += 1
        self.log.job_formed(job, now)
        self._formed(job)
        local_sizes, runs = host_runs(job.by_rank)
        # Encoded once for the whole job: every member gets the same bytes.
        packed_runs = cast("list[list[int]]", Packed(msgpack.packb(runs)))
        for m in job.by_rank:
            m.done = True  # its join deadline no longer applies
            m.status = "active"
            m.last_seen = now  # waiting for the others to join is not missing heartbeats
            self._send(
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

    def _formed(self, job: Job) -> None:
        """``job`` has all its members (a hook: ``restart.py`` logs it)."""

    def _replaced(self, job: Job) -> None:
        """``job`` was replaced by a later generation (a hook: ``restart.py`` forgets it)."""

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
            self._send(
                member.conn,
                ErrorReply(member.join_req_id, ErrorCode.WORLD_SIZE_MISMATCH, message, details),
            )
        for waiter in job.all_waiters():  # store waits of members still forming
            if not waiter.done:
                waiter.done = True
                self._send(
                    waiter.conn,
                    ErrorReply(waiter.req_id, ErrorCode.WORLD_SIZE_MISMATCH, message, details),
                )
        for member in list(job.members):
            self._remove(member, now)  # the last one drops the job
            self._conns[member.conn].member = None
        raise BadRequest(ErrorCode.WORLD_SIZE_MISMATCH, message, details)

    def _join_timed_out(self, member: Member, now: float) -> None:
        job = member.job
        present = sorted(
            f"rank {m.requested_rank}" if m.requested_rank >= 0 else f"pid {m.pid}@{m.host}"
            for m in job.members
        )
        self._send(
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
        self._remove(member, now)
        self._conns[member.conn].member = None

    def _remove(self, member: Member, now: float) -> None:
        member.done = True
        job = member.job
        job.discard(member)
        if member.status == "left" and member.rank in job.left:
            for barrier in list(job.barriers.values()):
                if member.rank not in barrier.arrived:
                    self._fail_barrier(job, barrier.seq, *left_error(job, member.rank))
        if not job.members and not job.ended:
            job.ended = True
            if self.jobs.get(job.name) is job:  # not replaced by a later generation
                del self.jobs[job.name]
            for waiter in job.all_waiters():
                waiter.done = True
            if job.leave_notice is not None:
                job.leave_notice.done = True  # nobody is left to tell
            self._jobs_ended(job)
            self.log.job_finished(job, now)

    def _announce_leave(self, member: Member, now: float) -> None:
        """Tell the other members that ``member`` left, now or with the next notice."""
        job = member.job
        job.unannounced.append([member.rank, member.host, member.pid])
        if job.leave_notice is not None:
            return  # a notice is planned: this leave goes with it
        if now >= job.next_leave_notice:
            self._send_leave_notice(job, now)
        else:
            job.leave_notice = LeaveNotice(job)
            self._push_timer(job.next_leave_notice, job.leave_notice)

    def _send_leave_notice(self, job: Job, now: float) -> None:
        if job.leave_notice is not None:
            job.leave_notice.done = True
            job.leave_notice = None
        entries, job.unannounced = job.unannounced, []
        # A big job's notices are spaced out: each goes to every member, and a job of N
        # ending must not cost N sends every interval (16K members: minutes of sends).
        job.next_leave_notice = now + _notice_interval(LEAVE_NOTICE_INTERVAL, job)
        # Encoded once for the whole job: every member gets the same bytes.
        notice = MembersLeft(cast("list[Any]", Packed(msgpack.packb(entries))))
        for m in job.members:
            if m.status == "active":
                self._send(m.conn, notice)

    def _fail(self, member: Member, reason: str, now: float) -> None:
        job = member.job
        if not job.failures:
            job.left_before_failure = list(itertools.islice(job.left, LEFT_BEFORE_FAILURE))
        member.status = "failed"
        job.epoch += 1
        self.stats.failures += 1
        self.log.rank_failed(member, reason, now)
        job.failures.append((member.rank, member.host, member.pid, reason))
        # Every failure is told to every member: each breaks only the groups that
        # contain the failed rank (failure isolation), so a later one matters too. The
        # first of an interval at once; those after it together when the interval ends.
        notice = MemberFailed(member.rank, member.host, member.pid, reason)
        if job.failure_notice is None and now >= job.next_failure_notice:
            job.next_failure_notice = now + _notice_interval(FAILURE_NOTICE_INTERVAL, job)
            for other in job.members:
                if other.status == "active":
                    self._send(other.conn, notice)
        else:
            job.unannounced_failures.append([member.rank, member.host, member.pid, reason])
            if job.failure_notice is None:
                job.failure_notice = FailureNotice(job)
                self._push_timer(job.next_failure_notice, job.failure_notice)
        if member.conn in self._conns:
            # Still connected (it missed heartbeats: a stopped or starved loop): told
            # too, so that when it runs again it says that it was declared failed,
            # whichever of its peers' goodbyes and this notice it reads first.
            self._send(member.conn, notice)
        message = (
            f"rank {member.rank} (host {member.host}, pid {member.pid}) failed: {reason}; "
            f"the barriers of job {job.name!r} need every member and fail from now on. "
            "Groups that do not contain it go on (see shrink_group)."
        )
        details = {"rank": member.rank, "host": member.host, "pid": member.pid, "reason": reason}
        # Only the job's barriers need every member; the store goes on (failure isolation).
        for waiter in [w for b in job.barriers.values() for w in b.arrived.values()]:
            if not waiter.done:
                waiter.done = True
                self._send(
                    waiter.conn, ErrorReply(waiter.req_id, ErrorCode.RANK_FAILED, message, details)
                )
        job.barriers.clear()
        self._members_gone(job)

    def _send_failure_notice(self, job: Job, now: float) -> None:
        """Tell the members the failures held back since the last notice, in one message."""
        if job.failure_notice is not None:
            job.failure_notice.done = True
            job.failure_notice = None
        entries, job.unannounced_failures = job.unannounced_failures, []
        if not entries:
            return
        job.next_failure_notice = now + _notice_interval(FAILURE_NOTICE_INTERVAL, job)
        # Encoded once for the whole job: every member gets the same bytes.
        notice = MembersFailed(cast("list[Any]", Packed(msgpack.packb(entries))))
        for m in job.members:
            if m.status == "active":
                self._send(m.conn, notice)

    def _sweep(self, now: float) -> None:
        shortest = MAX_SWEEP_INTERVAL  # what the members still here need: it may grow again
        for job in list(self.jobs.values()):
            for member in list(job.members):
                shortest = min(shortest, _sweep_interval(member.heartbeat_timeout))
                silent = now - member.last_seen
                if member.status == "active" and silent > member.heartbeat_timeout:
                    self._fail(member, f"missed heartbeats for {silent:.1f} s", now)
                    self._remove(member, now)
                    self._send(
                        member.conn,
                        ErrorReply(
                            0, ErrorCode.RANK_FAILED, "declared failed: missed heartbeats", {}
                        ),
                    )
                    self._actions.append(Close(member.conn, "missed heartbeats"))
                    self._conns[member.conn].member = None
        self._sweep_interval = shortest
        self._next_sweep = now + self._sweep_interval if self.jobs else None

    # --- helpers ---------------------------------------------------------------------

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
        sockets = sum(1 for cid, c in self._conns.items() if not c.channel and cid != asking)
        if job:
            chosen = [self.jobs[job]] if job in self.jobs else []
        else:
            chosen = list(itertools.islice(self.jobs.values(), offset, offset + limit))
        return {
            "version": self.version,
            "uptime": now - self.started_at,
            "connections": sockets,
            "channels": len(self._conns),
            "stats": {
                "joins": self.stats.joins,
                "jobs_formed": self.stats.jobs_formed,
                "failures": self.stats.failures,
                "store_ops": self.stats.store_ops,
                "messages": self.stats.messages,
            },
            "jobs_total": len(self.jobs),
            "offset": 0 if job else offset,
            "jobs": [j.snapshot(now, max_members) for j in chosen],
            "finished": self.log.recent(now)[:RECENT_IN_STATUS],
        }


def _rank_taken(job: Job, rank: int, holder: Member) -> BadRequest:
    return BadRequest(
        ErrorCode.DUPLICATE_RANK,
        f"rank {rank} of job {job.name!r} is already taken by pid {holder.pid} on host "
        f"{holder.host}; give every process its own rank (RANK)",
        {"rank": rank, "host": holder.host, "pid": holder.pid},
    )


def _notice_interval(base: float, job: Job) -> float:
    """How long after one notice to a job's members the next may go: ``base``, stretched
    for a job of more than ``NOTICE_FANOUT`` members (each notice is a send to every
    member), at most ``MAX_NOTICE_INTERVAL``."""
    return min(base * max(1.0, len(job.members) / NOTICE_FANOUT), MAX_NOTICE_INTERVAL)


def _sweep_interval(heartbeat_timeout: float) -> float:
    return min(max(heartbeat_timeout / 4, MIN_SWEEP_INTERVAL), MAX_SWEEP_INTERVAL)


def _validate_join(msg: Join) -> None:
    if msg.rank >= msg.world_size:
        raise BadRequest(
            ErrorCode.BAD_REQUEST,
            f"Join.rank must be -1 (automatic) or in [0, {msg.world_size}), got {msg.rank}",
            {"field": "Join.rank", "value": msg.rank, "allowed": f"[-1, {msg.world_size})"},
        )
