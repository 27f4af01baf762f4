"""A job's store and its barriers: two parts of a job, requests that answer now or wait.

- Key-value operations follow torch's TCPStore (``add`` keeps decimal ASCII,
  ``compare_set`` returns the value now stored). Every change of a key goes
  through one method (``Store._put``), which records it (``KeySet``) and wakes
  its waits: a new operation that changes the store cannot be lost on restart.
- A change is applied once, whatever the connection does: a member that
  re-attaches (its server restarted or stood still) sends its unanswered
  requests again, and one the server had applied before the answer was lost
  gets that answer again (``StoreAnswered``, kept with the change), not a
  second ``add``.
- A ``get`` or ``wait`` on keys not all set parks a waiter under its first
  missing key only; each set moves it along, so a wait on N keys costs O(N) in
  all. Waits on the very same keys ride along with the first one.
- A barrier completes when every rank of the job arrived (``BarriersPassed``:
  a later call of it answers at once, after a restart too); one that timed
  out, or that a member left while others waited at it, fails for all. A
  barrier that a member which left never reached fails at once: it cannot
  complete. A failure fails every barrier, now and later (it needs every
  member).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from aiodist._errors import ErrorCode, rank_left_error
from aiodist._server.parts import BadRequest, handles
from aiodist._server.records import BarriersPassed, KeySet, StoreAnswered
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
    unpack_keys,
)

if TYPE_CHECKING:
    from aiodist._server.parts import JobView, MemberView, Outbox
    from aiodist._server.records import Record

#: Barriers passed out of order a job remembers (beyond the ones passed in order).
MAX_PASSED_AHEAD: Final = 1024
#: Answers to changes of the store a job keeps for requests sent again, at least (and
#: 4 per member): a member sends again only the requests it had in flight.
MIN_ANSWERS_KEPT: Final = 1024

# The kinds of change (``StoreAnswered.op``).
SET, ADD, COMPARE_SET, DELETE = range(4)


def answer(op: int, reply: bytes | None) -> Any:
    """The reply to a change of kind ``op``, from what ``StoreAnswered.reply`` keeps of it:
    ``set``, None; ``add``, the new value; ``compare_set``, the value now stored;
    ``delete``, whether it deleted (``b"1"``)."""
    if op == ADD:
        return int(reply or b"0")
    if op == COMPARE_SET:
        return reply
    return reply is not None if op == DELETE else None


@dataclass(eq=False, slots=True)
class Waiter:
    conn: int
    req_id: int
    keys: list[str]
    kind: Literal["get", "wait", "barrier"]
    packed_keys: bytes = b""  # a wait's keys as the client sent them (its watch's key)
    seq: int = 0
    done: bool = False
    pos: int = 0  # keys[:pos] are known to be set: each key is checked once in total
    # Waits on the very same keys ride along with the first one (every rank of a job
    # usually waits on the same N keys: checking them once, not N times, keeps a
    # job's rendezvous O(N) on the server instead of O(N^2)).
    followers: list[Waiter] = field(default_factory=list)


class Store:
    """The key-value store of one job and the waits on it."""

    def __init__(self, job: JobView, out: Outbox) -> None:
        self._job = job
        self._out = out
        self.kv: dict[str, bytes] = {}
        self.key_waiters: dict[str, list[Waiter]] = {}  # missing key -> the waits parked on it
        self.watches: dict[bytes, Waiter] = {}  # packed keys -> first wait
        self._deletions = 0  # keys deleted so far: a set of keys once all set stays so until one is
        # The keys of the latest wait, decoded, and the value of ``_deletions`` when they
        # were last seen all set (-1: not known to be).
        self._last_keys: tuple[bytes, list[str]] = (b"", [])
        self._last_keys_set_at = -1
        # (rank, request id) -> (kind of change, reply): what a request sent again gets.
        self.answered: dict[tuple[int, int], tuple[int, bytes | None]] = {}

    # --- requests ------------------------------------------------------------------------

    @handles(StoreSet)
    def set(self, member: MemberView, msg: StoreSet, now: float) -> None:
        if not self._answered_before(member, msg.req_id):
            self._answer(member, msg.req_id, SET, None)  # before the waits it wakes
            self._put(msg.key, msg.value)

    @handles(StoreAdd)
    def add(self, member: MemberView, msg: StoreAdd, now: float) -> None:
        if self._answered_before(member, msg.req_id):
            return
        old = self.kv.get(msg.key, b"0")
        try:
            value = str(int(old) + msg.amount).encode()
        except ValueError:
            raise BadRequest(
                ErrorCode.BAD_REQUEST, f"key {msg.key!r} holds {old[:32]!r}, not an integer"
            ) from None
        self._answer(member, msg.req_id, ADD, value)
        self._put(msg.key, value)

    @handles(StoreCompareSet)
    def compare_set(self, member: MemberView, msg: StoreCompareSet, now: float) -> None:
        if self._answered_before(member, msg.req_id):
            return
        current = self.kv.get(msg.key)
        if (current is None and not msg.expected) or current == msg.expected:
            self._answer(member, msg.req_id, COMPARE_SET, msg.desired)
            self._put(msg.key, msg.desired)
        else:
            stored = msg.expected if current is None else current  # torch's answer
            self._answer(member, msg.req_id, COMPARE_SET, stored)

    @handles(StoreDeleteKey)
    def delete(self, member: MemberView, msg: StoreDeleteKey, now: float) -> None:
        if self._answered_before(member, msg.req_id):
            return
        deleted = msg.key in self.kv
        self._answer(member, msg.req_id, DELETE, b"1" if deleted else None)
        if deleted:
            self._put(msg.key, None)

    @handles(StoreNumKeys)
    def num_keys(self, member: MemberView, msg: StoreNumKeys, now: float) -> None:
        self._out.send(member.conn, Reply(msg.req_id, len(self.kv)))

    @handles(StoreCheck)
    def check(self, member: MemberView, msg: StoreCheck, now: float) -> None:
        kv = self.kv
        self._out.send(member.conn, Reply(msg.req_id, all(k in kv for k in msg.keys)))

    @handles(StoreGet, StoreWait)
    def wait(self, member: MemberView, msg: StoreGet | StoreWait, now: float) -> None:
        self._out.check(msg)  # a finite timeout in range, before anything waits on it
        conn, kv = member.conn, self.kv
        kind: Literal["get", "wait"] = "get" if isinstance(msg, StoreGet) else "wait"
        if isinstance(msg, StoreGet):
            if msg.key in kv:
                self._out.send(conn, Reply(msg.req_id, kv[msg.key]))
                return
            keys, packed = [msg.key], b""
        else:
            # The same keys watched already: ride along without decoding them again.
            first = self.watches.get(msg.keys)
            if first is not None:
                waiter = Waiter(conn, msg.req_id, first.keys, "wait", msg.keys)
                first.followers.append(waiter)
                self._out.at(now + msg.timeout, waiter, self._timed_out)
                return
            if self._known_set(msg.keys):  # the late members of a rendezvous: no scan
                self._out.send(conn, Reply(msg.req_id, None))
                return
            keys = self._wait_keys(msg.keys)
            packed = msg.keys
        waiter = Waiter(conn, msg.req_id, keys, kind, packed)
        # Park the waiter under its first missing key only; _wake moves it along.
        # (Under every key, a wait on N keys cost O(N^2) per set: O(N^3) in all.)
        if self._advance(waiter):
            if kind == "wait":
                self.watches[packed] = waiter
        else:
            if kind == "wait":
                self._mark_set(packed)
            self._out.send(conn, Reply(msg.req_id, kv[keys[0]] if kind == "get" else None))
            return
        self._out.at(now + msg.timeout, waiter, self._timed_out)

    # --- what the job asks ---------------------------------------------------------------

    def waiters(self) -> list[Waiter]:
        """Every wait parked on the store, followers included."""
        out = [w for ws in self.key_waiters.values() for w in ws]
        out.extend(f for w in out[:] for f in w.followers)
        return out

    def records(self) -> list[Record]:
        name = self._job.name
        out: list[Record] = [KeySet(name, key, value) for key, value in self.kv.items()]
        out.extend(StoreAnswered(name, *k, *a) for k, a in self.answered.items())
        return out

    def restore(self, key: str, value: bytes | None) -> None:
        """Replay ``KeySet``: nothing waits yet, nothing is recorded again."""
        if value is None:
            self.kv.pop(key, None)
        else:
            self.kv[key] = value

    def restore_answer(self, rec: StoreAnswered) -> None:
        """Replay ``StoreAnswered``."""
        self._keep_answer(rec.rank, rec.req_id, rec.op, rec.reply)

    # --- inside ---------------------------------------------------------------------------

    def _answered_before(self, member: MemberView, req_id: int) -> bool:
        """True if ``member`` sent request ``req_id`` before, now answered again."""
        kept = self.answered.get((member.rank, req_id))
        if kept is None:
            return False
        self._out.send(member.conn, Reply(req_id, answer(*kept)))
        return True

    def _answer(self, member: MemberView, req_id: int, op: int, reply: bytes | None) -> None:
        """Answer ``member``'s request ``req_id`` to change the store (made or not), and keep
        the answer: that request sent again gets it again, and changes nothing."""
        self._out.send(member.conn, Reply(req_id, answer(op, reply)))
        rank = member.rank
        if rank >= 0:  # a member of a formed job, which may re-attach
            self._keep_answer(rank, req_id, op, reply)
            if self._job.logged:  # in the change's batch: a restart keeps both or neither
                self._out.record(self._job, StoreAnswered(self._job.name, rank, req_id, op, reply))

    def _keep_answer(self, rank: int, req_id: int, op: int, reply: bytes | None) -> None:
        answered = self.answered
        answered[(rank, req_id)] = (op, reply)
        if len(answered) > max(MIN_ANSWERS_KEPT, 4 * self._job.world_size):
            del answered[next(iter(answered))]  # the oldest

    def _put(self, key: str, value: bytes | None) -> None:
        """Set ``key`` to ``value`` (None: delete it): the one way the store changes."""
        if value is None:
            del self.kv[key]
            self._deletions += 1
        else:
            self.kv[key] = value
        self._out.record(self._job, KeySet(self._job.name, key, value))
        if value is not None:
            self._wake(key)

    def _wake(self, key: str) -> None:
        waiters = self.key_waiters.pop(key, None)
        if not waiters:
            return
        kv = self.kv
        for waiter in waiters:
            # all() stops at the first live follower: a watch with N followers is not
            # scanned on each of its N wakes, only once when it completes.
            gave_up = waiter.done and all(f.done for f in waiter.followers)
            if not gave_up and self._advance(waiter):
                continue
            if waiter.kind == "wait":
                self.watches.pop(waiter.packed_keys, None)
            if gave_up:  # every request on it timed out
                continue
            if waiter.kind == "wait":
                self._mark_set(waiter.packed_keys)
            value = kv[waiter.keys[0]] if waiter.kind == "get" else None
            for w in (waiter, *waiter.followers):
                if not w.done:
                    w.done = True
                    self._out.send(w.conn, Reply(w.req_id, value))

    def _advance(self, waiter: Waiter) -> bool:
        """Park ``waiter`` under its next missing key; False once all its keys are set."""
        keys, kv = waiter.keys, self.kv
        # The first missing key, found in C: a wait on N keys that are all set (the
        # common case at start-up) costs a fast pass, not N Python iterations.
        missing = next(
            itertools.filterfalse(kv.__contains__, itertools.islice(keys, waiter.pos, None)), None
        )
        if missing is None:
            waiter.pos = len(keys)
            return False
        waiter.pos = keys.index(missing, waiter.pos)
        self.key_waiters.setdefault(missing, []).append(waiter)
        return True

    def _timed_out(self, waiter: Waiter, now: float) -> None:
        waiter.done = True
        missing = [k for k in waiter.keys if k not in self.kv]
        self._out.send(
            waiter.conn,
            ErrorReply(
                waiter.req_id,
                ErrorCode.TIMEOUT,
                f"store {waiter.kind} timed out waiting for keys {missing} of job "
                f"{self._job.name!r}",
                {"keys": missing},
            ),
        )

    def _wait_keys(self, packed: bytes) -> list[str]:
        """The keys of a wait, decoded once for the many members that wait on the same ones."""
        if packed != self._last_keys[0]:
            try:
                self._last_keys = (packed, unpack_keys(packed))
            except ValueError as exc:
                raise BadRequest(ErrorCode.BAD_REQUEST, str(exc)) from None
            self._last_keys_set_at = -1
        return self._last_keys[1]

    def _known_set(self, packed: bytes) -> bool:
        """True if the keys ``packed`` were all set and none was deleted since."""
        return packed == self._last_keys[0] and self._last_keys_set_at == self._deletions

    def _mark_set(self, packed: bytes) -> None:
        """Record that the keys ``packed`` are all set now (a later wait needs no scan)."""
        if packed == self._last_keys[0]:
            self._last_keys_set_at = self._deletions


class Barriers:
    """The job-wide barriers of one job: who arrived at each, and what they came to."""

    def __init__(self, job: JobView, out: Outbox) -> None:
        self._job = job
        self._out = out
        self._waiting: dict[int, dict[int, Waiter]] = {}  # seq -> rank -> its call
        self._failed: dict[int, tuple[ErrorCode, str, dict[str, Any]]] = {}
        # The barriers every member reached: all below ``_below``, and those in ``_also``
        # (members number them in order: it is empty but for a moment).
        self._below = 0
        self._also: set[int] = set()

    @handles(Barrier)
    def arrive(self, member: MemberView, msg: Barrier, now: float) -> None:
        job = self._job
        if job.complete and self._passed(msg.seq):
            # Passed already (before the server went away: this member's reply was lost).
            self._out.send(member.conn, Reply(msg.req_id, None))
            return
        self._out.check(msg)  # before its deadline is computed: the heap holds finite ones
        if not job.complete:
            raise BadRequest(ErrorCode.NOT_JOINED, f"job {job.name!r} has not formed yet")
        if job.failures:
            rank, host, pid, reason = job.failures[0]
            raise BadRequest(
                ErrorCode.RANK_FAILED,
                f"rank {rank} (host {host}, pid {pid}) failed: {reason}; the barriers of job "
                f"{job.name!r} need every member and fail from now on. Use a group's barrier "
                "(after shrink_group) instead.",
                {"rank": rank, "host": host, "pid": pid, "reason": reason},
            )
        if (failed := self._failed.get(msg.seq)) is not None:
            raise BadRequest(*failed)
        arrived = self._waiting.get(msg.seq, {})
        if job.left:
            # A member that left and did not reach this barrier never will.
            gone = next((r for r in job.left if r not in arrived), None)
            if gone is not None:
                code, message, details = left_error(job, gone)
                self.fail(msg.seq, code, message, details)
                raise BadRequest(code, message, details)
        waiter = Waiter(member.conn, msg.req_id, [], "barrier", seq=msg.seq)
        arrived = self._waiting.setdefault(msg.seq, arrived)
        arrived[member.rank] = waiter
        if len(arrived) < job.world_size:
            self._out.at(now + msg.timeout, waiter, self._timed_out)
            return
        del self._waiting[msg.seq]
        self._pass(msg.seq)
        self._out.record(job, self._record())
        for w in arrived.values():
            w.done = True
            self._out.send(w.conn, Reply(w.req_id, None))

    def fail(
        self, seq: int, code: ErrorCode, message: str, details: dict[str, Any] | None = None
    ) -> None:
        """Fail barrier ``seq`` for every member at it, and every later call of it."""
        arrived = self._waiting.pop(seq, {})
        self._failed[seq] = (code, message, details or {})
        for w in arrived.values():
            if not w.done:
                w.done = True
                self._out.send(w.conn, ErrorReply(w.req_id, code, message, details or {}))

    def member_failed(self, message: str, details: dict[str, Any]) -> None:
        """A member failed: every barrier needs it, so every one waiting fails now."""
        for w in [w for arrived in self._waiting.values() for w in arrived.values()]:
            if not w.done:
                w.done = True
                self._out.send(
                    w.conn, ErrorReply(w.req_id, ErrorCode.RANK_FAILED, message, details)
                )
        self._waiting.clear()

    def member_left(self, rank: int) -> None:
        """Rank ``rank`` left cleanly: the barriers it did not reach can never complete."""
        for seq, arrived in list(self._waiting.items()):
            if rank not in arrived:
                self.fail(seq, *left_error(self._job, rank))

    def waiters(self) -> list[Waiter]:
        return [w for arrived in self._waiting.values() for w in arrived.values()]

    def records(self) -> list[Record]:
        return [self._record()] if self._below or self._also else []

    def restore(self, rec: BarriersPassed) -> None:
        """Replay ``BarriersPassed``: a later call of those answers at once."""
        self._below, self._also = rec.below, set(rec.also[-MAX_PASSED_AHEAD:])

    def _passed(self, seq: int) -> bool:
        return seq < self._below or seq in self._also

    def _pass(self, seq: int) -> None:
        also = self._also
        also.add(seq)
        while self._below in also:
            also.remove(self._below)
            self._below += 1
        if len(also) > MAX_PASSED_AHEAD:  # numbered out of order on purpose: forget the oldest
            also.remove(min(also))

    def _record(self) -> BarriersPassed:
        return BarriersPassed(self._job.name, self._below, sorted(self._also))

    def _timed_out(self, waiter: Waiter, now: float) -> None:
        job = self._job
        arrived = sorted(self._waiting.get(waiter.seq, {}))
        missing = [r for r in range(job.world_size) if r not in arrived]
        self.fail(
            waiter.seq,
            ErrorCode.TIMEOUT,
            f"barrier of job {job.name!r} timed out: ranks {missing} never arrived "
            f"(ranks {arrived} did)",
            {"missing": missing},
        )


def left_error(job: JobView, rank: int) -> tuple[ErrorCode, str, dict[str, Any]]:
    """The (code, message, details) an operation gets that needs ``rank``, which left ``job``."""
    host, pid = job.left[rank]
    exc = rank_left_error(rank, host, pid)
    return exc.code, str(exc), exc.wire_details()
