"""The rendezvous server's job table, sans-IO: messages and time in, actions out.

Rules this module keeps (the asyncio shell in ``serve.py`` only moves bytes):

- A job is keyed by ``group_name``. It is *forming* until ``world_size``
  members have joined, then *complete*: ranks are assigned and every member
  gets the same ``Welcome`` with the table of all members' addresses.
- A join that conflicts with the job (duplicate rank, another world size, a
  job already complete) gets an error; the job itself is left untouched.
- Automatic ranks fill the ranks no member asked for, grouped by host in the
  order hosts first joined, so ranks on one host are contiguous and
  ``local_rank`` means what torchrun means.
- A member of a complete job whose connection drops, or who misses heartbeats,
  has *failed*: every other member is told once, pending waits of the job fail
  with RANK_FAILED, and the job is broken for good. A member that leaves
  cleanly has not failed. A forming member that disconnects simply drops out.
- A job's state is dropped when its last member is gone.
- Key-value operations follow torch's TCPStore (``add`` keeps decimal ASCII,
  ``compare_set`` returns the value now stored).
- Nothing here blocks or allocates per byte; deadlines live in one heap, and
  heartbeats are checked by a periodic sweep.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

import msgpack

from aiodist._server.jobs import Job, Member, Waiter, assign_ranks
from aiodist._wire.messages import (
    Barrier,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    Join,
    Leave,
    MemberFailed,
    MembersRequest,
    Packed,
    Reply,
    ServerClosing,
    StatusRequest,
    StoreAdd,
    StoreCheck,
    StoreCompareSet,
    StoreDeleteKey,
    StoreGet,
    StoreNumKeys,
    StoreSet,
    StoreWait,
    Welcome,
)

__all__ = ["Close", "ConnId", "Send", "ServerState"]

ConnId = int

MAX_GROUP_NAME_CHARS: Final = 256
MAX_ADDRESSES: Final = 64
MAX_SWEEP_INTERVAL: Final = 1.0


@dataclass(frozen=True, slots=True)
class Send:
    conn: ConnId
    msg: Any


@dataclass(frozen=True, slots=True)
class Close:
    conn: ConnId
    reason: str


@dataclass(slots=True)
class _Conn:
    peer: str
    opened_at: float
    member: Member | None = None


@dataclass(slots=True)
class Stats:
    joins: int = 0
    jobs_formed: int = 0
    failures: int = 0
    store_ops: int = 0
    messages: int = 0


class _BadRequest(Exception):
    def __init__(self, code: ErrorCode, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.details = details or {}


@dataclass(order=True, slots=True)
class _Timer:
    when: float
    seq: int
    target: Any = field(compare=False)  # Member (join deadline) | Waiter


class ServerState:
    """All jobs of one server. Feed it messages and time; collect actions."""

    def __init__(self, now: float) -> None:
        self.started_at = now
        self.version = ""  # reported by status; the shell fills it in
        self.closing = False
        self.jobs: dict[str, Job] = {}
        self.stats = Stats()
        self._conns: dict[ConnId, _Conn] = {}
        self._actions: list[Send | Close] = []
        self._timers: list[_Timer] = []
        self._timer_seq = itertools.count()
        self._next_sweep: float | None = None
        self._sweep_interval = MAX_SWEEP_INTERVAL

    # --- inputs ------------------------------------------------------------------

    def connection_made(self, conn: ConnId, peer: str, now: float) -> None:
        self._conns[conn] = _Conn(peer=peer, opened_at=now)

    def connection_lost(self, conn: ConnId, now: float, reason: str = "connection lost") -> None:
        state = self._conns.pop(conn, None)
        if state is None or state.member is None:
            return
        member = state.member
        # A server shutting down drops its members; that is no failure of theirs.
        if member.job.complete and member.status == "active" and not self.closing:
            self._fail(member, f"{reason} (control connection from {state.peer})")
        self._remove(member)

    def receive(self, conn: ConnId, msg: Any, now: float) -> None:
        state = self._conns[conn]
        self.stats.messages += 1
        if state.member is not None:
            state.member.last_seen = now
        if isinstance(msg, Heartbeat):
            return
        req_id = getattr(msg, "req_id", 0)
        try:
            self._dispatch(conn, state, msg, now)
        except _BadRequest as exc:
            self._send(conn, ErrorReply(req_id, exc.code, str(exc), exc.details))

    def next_deadline(self) -> float | None:
        """When ``handle_timeouts`` must next be called; None when nothing is pending."""
        while self._timers and self._timers[0].target.done:
            heapq.heappop(self._timers)
        candidates = [t for t in (self._next_sweep,) if t is not None]
        if self._timers:
            candidates.append(self._timers[0].when)
        return min(candidates) if candidates else None

    def handle_timeouts(self, now: float) -> None:
        while self._timers and self._timers[0].when <= now:
            timer = heapq.heappop(self._timers)
            if timer.target.done:
                continue
            if isinstance(timer.target, Member):
                self._join_timed_out(timer.target)
            else:
                self._waiter_timed_out(timer.target)
        if self._next_sweep is not None and self._next_sweep <= now:
            self._sweep(now)

    def close(self, reason: str) -> None:
        """Tell every connection that the server is going away."""
        self.closing = True
        for conn in list(self._conns):
            self._send(conn, ServerClosing(reason))

    def take_actions(self) -> list[Send | Close]:
        actions, self._actions = self._actions, []
        return actions

    # --- dispatch ----------------------------------------------------------------

    def _dispatch(self, conn: ConnId, state: _Conn, msg: Any, now: float) -> None:
        if isinstance(msg, Join):
            self._join(conn, state, msg, now)
            return
        if isinstance(msg, StatusRequest):
            self._send(conn, Reply(msg.req_id, self.snapshot(now)))
            return
        member = state.member
        if member is None:
            if isinstance(msg, Leave):
                self._send(conn, Reply(msg.req_id, None))
                return
            raise _BadRequest(
                ErrorCode.NOT_JOINED, f"{type(msg).__name__} needs a joined job; join one first"
            )
        job = member.job
        if isinstance(msg, Leave):
            member.status = "left"
            self._send(conn, Reply(msg.req_id, None))
            self._remove(member)
            state.member = None
        elif isinstance(msg, Barrier):
            self._barrier(member, msg, now)
        elif isinstance(msg, MembersRequest):
            if not job.complete:
                raise _BadRequest(
                    ErrorCode.BAD_REQUEST, f"job {job.name!r} has not formed; join it first"
                )
            self._send(conn, Reply(msg.req_id, job.packed_table()))
        elif isinstance(msg, StoreSet | StoreGet | StoreAdd | StoreWait | StoreCompareSet):
            self.stats.store_ops += 1
            self._store_op(conn, job, msg, now)
        elif isinstance(msg, StoreDeleteKey):
            self.stats.store_ops += 1
            deleted = job.kv.pop(msg.key, None) is not None
            job.deletions += deleted
            self._send(conn, Reply(msg.req_id, deleted))
        elif isinstance(msg, StoreNumKeys):
            self.stats.store_ops += 1
            self._send(conn, Reply(msg.req_id, len(job.kv)))
        elif isinstance(msg, StoreCheck):
            self.stats.store_ops += 1
            self._send(conn, Reply(msg.req_id, all(k in job.kv for k in msg.keys)))
        else:
            raise _BadRequest(ErrorCode.BAD_REQUEST, f"a client may not send {type(msg).__name__}")

    # --- membership ----------------------------------------------------------------

    def _join(self, conn: ConnId, state: _Conn, msg: Join, now: float) -> None:
        if state.member is not None:
            raise _BadRequest(
                ErrorCode.BAD_REQUEST,
                f"this connection already joined job {state.member.job.name!r}; "
                "open one connection per member",
            )
        _validate_join(msg)
        job = self.jobs.get(msg.group_name)
        if job is None:
            job = self.jobs[msg.group_name] = Job(msg.group_name, msg.world_size, created_at=now)
        elif job.world_size != msg.world_size:
            raise _BadRequest(
                ErrorCode.WORLD_SIZE_MISMATCH,
                f"job {job.name!r} has world_size {job.world_size} but this process asked for "
                f"{msg.world_size}; start every rank with the same world size",
            )
        elif job.complete:
            raise _BadRequest(
                ErrorCode.JOB_FULL,
                f"job {job.name!r} already has all {job.world_size} members; use another "
                "group_name, or wait until that job ends",
            )
        if msg.rank >= 0 and (holder := job.requested.get(msg.rank)) is not None:
            raise _BadRequest(
                ErrorCode.DUPLICATE_RANK,
                f"rank {msg.rank} of job {job.name!r} is already taken by pid {holder.pid} on "
                f"host {holder.host}; give every process its own rank",
                {"rank": msg.rank, "host": holder.host, "pid": holder.pid},
            )
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
        )
        job.add(member)
        state.member = member
        self._sweep_interval = min(self._sweep_interval, member.heartbeat_timeout / 4)
        # A shorter heartbeat timeout than any before must not wait for a sweep planned
        # with the old, longer interval.
        if self._next_sweep is None or now + self._sweep_interval < self._next_sweep:
            self._next_sweep = now + self._sweep_interval
        if len(job.members) < job.world_size:
            self._push_timer(now + msg.timeout, member)
            return
        assign_ranks(job)
        job.complete = True
        self.stats.jobs_formed += 1
        local_sizes = Counter(m.host for m in job.by_rank)  # one pass, not O(N^2)
        host_index = {host: i for i, host in enumerate(local_sizes)}
        runs: list[list[int]] = []
        for m in job.by_rank:
            host_id = host_index[m.host]
            if runs and runs[-1][0] == host_id:
                runs[-1][1] += 1
            else:
                runs.append([host_id, 1])
        # Encoded once for the whole job: every member gets the same bytes.
        host_runs = cast("list[list[int]]", Packed(msgpack.packb(runs)))
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
                    host_runs,
                ),
            )

    def _join_timed_out(self, member: Member) -> None:
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
        self._remove(member)
        self._conns[member.conn].member = None

    def _remove(self, member: Member) -> None:
        member.done = True
        job = member.job
        job.discard(member)
        if member.status == "left":
            for barrier in list(job.barriers.values()):
                if member.rank not in barrier.arrived:
                    self._fail_barrier(
                        job,
                        barrier.seq,
                        ErrorCode.GROUP_BROKEN,
                        f"rank {member.rank} left job {job.name!r} while others waited at a "
                        "barrier",
                    )
        if not job.members and self.jobs.get(job.name) is job:
            del self.jobs[job.name]
            for waiter in job.all_waiters():
                waiter.done = True

    def _fail(self, member: Member, reason: str) -> None:
        job = member.job
        member.status = "failed"
        self.stats.failures += 1
        job.failures.append((member.rank, member.host, member.pid, reason))
        notice = MemberFailed(member.rank, member.host, member.pid, reason)
        for other in job.members:
            if other is not member and other.status == "active":
                self._send(other.conn, notice)
        message = (
            f"rank {member.rank} (host {member.host}, pid {member.pid}) failed: {reason}; "
            f"job {job.name!r} is broken on all ranks. Restart the job."
        )
        details = {"rank": member.rank, "host": member.host, "pid": member.pid, "reason": reason}
        for waiter in job.all_waiters():
            if not waiter.done:
                waiter.done = True
                self._send(
                    waiter.conn, ErrorReply(waiter.req_id, ErrorCode.RANK_FAILED, message, details)
                )
        job.barriers.clear()

    def _sweep(self, now: float) -> None:
        for job in list(self.jobs.values()):
            for member in list(job.members):
                silent = now - member.last_seen
                if member.status == "active" and silent > member.heartbeat_timeout:
                    self._fail(member, f"missed heartbeats for {silent:.1f} s")
                    self._remove(member)
                    self._send(
                        member.conn,
                        ErrorReply(
                            0, ErrorCode.RANK_FAILED, "declared failed: missed heartbeats", {}
                        ),
                    )
                    self._actions.append(Close(member.conn, "missed heartbeats"))
                    self._conns[member.conn].member = None
        self._next_sweep = now + self._sweep_interval if self.jobs else None

    # --- barrier and store -------------------------------------------------------------

    def _barrier(self, member: Member, msg: Barrier, now: float) -> None:
        job = member.job
        if not job.complete:
            raise _BadRequest(ErrorCode.NOT_JOINED, f"job {job.name!r} has not formed yet")
        if job.failures:
            rank, host, pid, reason = job.failures[0]
            raise _BadRequest(
                ErrorCode.RANK_FAILED,
                f"rank {rank} (host {host}, pid {pid}) failed: {reason}; job {job.name!r} is "
                "broken on all ranks. Restart the job.",
                {"rank": rank, "host": host, "pid": pid, "reason": reason},
            )
        if (failed := job.failed_barriers.get(msg.seq)) is not None:
            raise _BadRequest(*failed)
        barrier = job.barrier(msg.seq)
        waiter = Waiter(member.conn, msg.req_id, [], "barrier", job, seq=msg.seq)
        barrier.arrived[member.rank] = waiter
        if len(barrier.arrived) == job.world_size:
            del job.barriers[msg.seq]
            for w in barrier.arrived.values():
                w.done = True
                self._send(w.conn, Reply(w.req_id, None))
        else:
            self._push_timer(now + msg.timeout, waiter)

    def _fail_barrier(
        self,
        job: Job,
        seq: int,
        code: ErrorCode,
        message: str,
        details: dict[str, Any] | None = None,
    ) -> None:
        barrier = job.barriers.pop(seq, None)
        job.failed_barriers[seq] = (code, message, details or {})
        if barrier is None:
            return
        for w in barrier.arrived.values():
            if not w.done:
                w.done = True
                self._send(w.conn, ErrorReply(w.req_id, code, message, details or {}))

    def _store_op(self, conn: ConnId, job: Job, msg: Any, now: float) -> None:
        kv = job.kv
        if isinstance(msg, StoreSet):
            kv[msg.key] = msg.value
            self._send(conn, Reply(msg.req_id, None))
            self._wake(job, msg.key)
        elif isinstance(msg, StoreAdd):
            old = kv.get(msg.key, b"0")
            try:
                value = int(old) + msg.amount
            except ValueError:
                raise _BadRequest(
                    ErrorCode.BAD_REQUEST, f"key {msg.key!r} holds {old[:32]!r}, not an integer"
                ) from None
            kv[msg.key] = str(value).encode()
            self._send(conn, Reply(msg.req_id, value))
            self._wake(job, msg.key)
        elif isinstance(msg, StoreCompareSet):
            current = kv.get(msg.key)
            if (current is None and not msg.expected) or current == msg.expected:
                kv[msg.key] = msg.desired
                self._send(conn, Reply(msg.req_id, msg.desired))
                self._wake(job, msg.key)
            else:
                self._send(conn, Reply(msg.req_id, msg.expected if current is None else current))
        else:  # StoreGet | StoreWait
            if msg.timeout <= 0:
                raise _BadRequest(ErrorCode.BAD_REQUEST, f"timeout must be > 0, got {msg.timeout}")
            kind: Literal["get", "wait"] = "get" if isinstance(msg, StoreGet) else "wait"
            if isinstance(msg, StoreGet):
                keys, packed = [msg.key], b""
            else:
                # The same keys watched already: ride along without decoding them again.
                first = job.watches.get(msg.keys)
                if first is not None:
                    waiter = Waiter(conn, msg.req_id, first.keys, "wait", job, msg.keys)
                    first.followers.append(waiter)
                    self._push_timer(now + msg.timeout, waiter)
                    return
                if job.known_set(msg.keys):  # the late members of a rendezvous: no scan
                    self._send(conn, Reply(msg.req_id, None))
                    return
                try:
                    keys = job.wait_keys(msg.keys)
                except ValueError as exc:
                    raise _BadRequest(ErrorCode.BAD_REQUEST, str(exc)) from None
                packed = msg.keys
            waiter = Waiter(conn, msg.req_id, keys, kind, job, packed)
            # Park the waiter under its first missing key only; _wake moves it along.
            # (Under every key, a wait on N keys cost O(N^2) per set: O(N^3) in all.)
            if self._advance_waiter(job, waiter):
                if kind == "wait":
                    job.watches[packed] = waiter
            else:
                if kind == "wait":
                    job.mark_set(packed)
                self._send(conn, Reply(msg.req_id, kv[keys[0]] if kind == "get" else None))
                return
            self._push_timer(now + msg.timeout, waiter)

    def _wake(self, job: Job, key: str) -> None:
        waiters = job.key_waiters.pop(key, None)
        if not waiters:
            return
        kv = job.kv
        for waiter in waiters:
            # all() stops at the first live follower: a watch with N followers is not
            # scanned on each of its N wakes, only once when it completes.
            gave_up = waiter.done and all(f.done for f in waiter.followers)
            if not gave_up and self._advance_waiter(job, waiter):
                continue
            if waiter.kind == "wait":
                job.watches.pop(waiter.packed_keys, None)
            if gave_up:  # every request on it timed out
                continue
            if waiter.kind == "wait":
                job.mark_set(waiter.packed_keys)
            value = kv[waiter.keys[0]] if waiter.kind == "get" else None
            for w in (waiter, *waiter.followers):
                if not w.done:
                    w.done = True
                    self._send(w.conn, Reply(w.req_id, value))

    @staticmethod
    def _advance_waiter(job: Job, waiter: Waiter) -> bool:
        """Park ``waiter`` under its next missing key; False once all its keys are set."""
        keys, kv = waiter.keys, job.kv
        # The first missing key, found in C: a wait on N keys that are all set (the
        # common case at start-up) costs a fast pass, not N Python iterations.
        missing = next(
            itertools.filterfalse(kv.__contains__, itertools.islice(keys, waiter.pos, None)), None
        )
        if missing is None:
            waiter.pos = len(keys)
            return False
        waiter.pos = keys.index(missing, waiter.pos)
        job.key_waiters.setdefault(missing, []).append(waiter)
        return True

    def _waiter_timed_out(self, waiter: Waiter) -> None:
        job = waiter.job
        if waiter.kind == "barrier":
            barrier = job.barriers.get(waiter.seq)
            arrived = sorted(barrier.arrived) if barrier else []
            missing = [r for r in range(job.world_size) if r not in arrived]
            self._fail_barrier(
                job,
                waiter.seq,
                ErrorCode.TIMEOUT,
                f"barrier of job {job.name!r} timed out: ranks {missing} never arrived "
                f"(ranks {arrived} did)",
                {"missing": missing},
            )
            return
        waiter.done = True
        missing_keys = [k for k in waiter.keys if k not in job.kv]
        self._send(
            waiter.conn,
            ErrorReply(
                waiter.req_id,
                ErrorCode.TIMEOUT,
                f"store {waiter.kind} timed out waiting for keys {missing_keys} of job "
                f"{job.name!r}",
                {"keys": missing_keys},
            ),
        )

    # --- helpers ---------------------------------------------------------------------

    def _send(self, conn: ConnId, msg: Any) -> None:
        self._actions.append(Send(conn, msg))

    def _push_timer(self, when: float, target: Member | Waiter) -> None:
        heapq.heappush(self._timers, _Timer(when, next(self._timer_seq), target))

    def snapshot(self, now: float) -> dict[str, Any]:
        """Plain data describing the server and every job (for ``aiodist status``)."""
        return {
            "version": self.version,
            "uptime": now - self.started_at,
            "connections": len(self._conns),
            "stats": {
                "joins": self.stats.joins,
                "jobs_formed": self.stats.jobs_formed,
                "failures": self.stats.failures,
                "store_ops": self.stats.store_ops,
                "messages": self.stats.messages,
            },
            "jobs": [job.snapshot(now) for job in self.jobs.values()],
        }


def _validate_join(msg: Join) -> None:
    problems = []
    if not 0 < len(msg.group_name) <= MAX_GROUP_NAME_CHARS:
        problems.append(f"group_name must have 1 to {MAX_GROUP_NAME_CHARS} characters")
    if msg.world_size < 1:
        problems.append(f"world_size must be >= 1, got {msg.world_size}")
    if not -1 <= msg.rank < max(msg.world_size, 1):
        problems.append(f"rank must be -1 (automatic) or in [0, {msg.world_size}), got {msg.rank}")
    if len(msg.addresses) > MAX_ADDRESSES:
        problems.append(f"at most {MAX_ADDRESSES} addresses, got {len(msg.addresses)}")
    if not msg.heartbeat_timeout > 0 or not msg.timeout > 0:
        problems.append("heartbeat_timeout and timeout must be > 0")
    if problems:
        raise _BadRequest(ErrorCode.BAD_REQUEST, "; ".join(problems))
