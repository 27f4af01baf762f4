"""The job table's store and barriers, sans-IO: requests that answer now or wait.

``ServerState`` builds on this half of the table, which also owns what the
whole table emits: the actions (``Send``, ``Close``) and the heap of deadlines.

- Key-value operations follow torch's TCPStore (``add`` keeps decimal ASCII,
  ``compare_set`` returns the value now stored).
- A ``get`` or ``wait`` on keys not all set parks a waiter under its first
  missing key only; each set moves it along, so a wait on N keys costs O(N) in
  all. Waits on the very same keys ride along with the first one.
- A barrier completes when every rank of the job arrived; one that timed out,
  or that a member left while others waited at it, fails for all. A barrier
  that a member which left never reached fails at once: it cannot complete.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import TYPE_CHECKING, Any, Final, Literal

from aiodist._errors import ErrorCode, rank_left_error
from aiodist._server.jobs import BadRequest, Send, Timer, Waiter, check_values
from aiodist._wire.messages import (
    Barrier,
    ErrorReply,
    Reply,
    StoreAdd,
    StoreCheck,
    StoreCompareSet,
    StoreDeleteKey,
    StoreGet,
    StoreNumKeys,
    StoreSet,
    StoreWait,
)

if TYPE_CHECKING:
    from aiodist._server.jobs import Close, ConnId, FailureNotice, Job, LeaveNotice, Member

__all__ = ["STORE_REQUESTS", "StoreAndBarriers", "left_error"]

# The requests ``StoreAndBarriers._store_op`` answers.
STORE_REQUESTS: Final = (
    StoreSet,
    StoreGet,
    StoreAdd,
    StoreWait,
    StoreCompareSet,
    StoreDeleteKey,
    StoreNumKeys,
    StoreCheck,
)


def _check_not_failed(job: Job) -> None:
    """Refuse a barrier in a job a member failed in: a job's barrier needs every member."""
    if job.failures:
        rank, host, pid, reason = job.failures[0]
        raise BadRequest(
            ErrorCode.RANK_FAILED,
            f"rank {rank} (host {host}, pid {pid}) failed: {reason}; the barriers of job "
            f"{job.name!r} need every member and fail from now on. Use a group's barrier "
            "(after shrink_group) instead.",
            {"rank": rank, "host": host, "pid": pid, "reason": reason},
        )


def left_error(job: Job, rank: int) -> tuple[ErrorCode, str, dict[str, Any]]:
    """The (code, message, details) an operation gets that needs ``rank``, which left ``job``."""
    host, pid = job.left[rank]
    exc = rank_left_error(rank, host, pid)
    return exc.code, str(exc), exc.wire_details()


def _wait_keys(job: Job, packed: bytes) -> list[str]:
    try:
        return job.wait_keys(packed)
    except ValueError as exc:
        raise BadRequest(ErrorCode.BAD_REQUEST, str(exc)) from None


class StoreAndBarriers:
    """Store operations and barriers of every job, and the actions and timers of the table."""

    def __init__(self) -> None:
        self._actions: list[Send | Close] = []
        self._timers: list[Timer] = []
        self._timer_seq = itertools.count()
        # The message in hand came from the wire: its values were checked on decoding.
        self._decoded: object = None

    def _check_values(self, msg: Any) -> None:
        """``check_values``, unless ``msg`` was checked on decoding already."""
        if msg is not self._decoded:
            check_values(msg)

    def _barrier(self, member: Member, msg: Barrier, now: float) -> None:
        self._check_values(msg)  # before its deadline is computed: the heap holds finite ones only
        job = member.job
        if not job.complete:
            raise BadRequest(ErrorCode.NOT_JOINED, f"job {job.name!r} has not formed yet")
        _check_not_failed(job)
        if (failed := job.failed_barriers.get(msg.seq)) is not None:
            raise BadRequest(*failed)
        if job.left:
            # A member that left and did not reach this barrier never will.
            barrier = job.barriers.get(msg.seq)
            gone = next((r for r in job.left if barrier is None or r not in barrier.arrived), None)
            if gone is not None:
                code, message, details = left_error(job, gone)
                self._fail_barrier(job, msg.seq, code, message, details)
                raise BadRequest(code, message, details)
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
                raise BadRequest(
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
        elif isinstance(msg, StoreDeleteKey):
            deleted = kv.pop(msg.key, None) is not None
            job.deletions += deleted
            self._send(conn, Reply(msg.req_id, deleted))
        elif isinstance(msg, StoreNumKeys):
            self._send(conn, Reply(msg.req_id, len(kv)))
        elif isinstance(msg, StoreCheck):
            self._send(conn, Reply(msg.req_id, all(k in kv for k in msg.keys)))
        else:  # StoreGet | StoreWait
            self._check_values(msg)  # a finite timeout in range, before anything waits on it
            kind: Literal["get", "wait"] = "get" if isinstance(msg, StoreGet) else "wait"
            if isinstance(msg, StoreGet):
                if msg.key in kv:
                    self._send(conn, Reply(msg.req_id, kv[msg.key]))
                    return
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
                keys = _wait_keys(job, msg.keys)
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

    def _send(self, conn: ConnId, msg: Any) -> None:
        self._actions.append(Send(conn, msg))

    def _push_timer(
        self, when: float, target: Member | Waiter | LeaveNotice | FailureNotice
    ) -> None:
        # Timeouts were checked on the way in: one NaN here would break the heap's
        # order, and with it every other job's deadlines.
        assert math.isfinite(when), when
        heapq.heappush(self._timers, (when, next(self._timer_seq), target))
