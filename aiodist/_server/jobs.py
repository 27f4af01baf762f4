"""Plain records of the job table: jobs, members, waiters, rank assignment, actions."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from aiodist._errors import ErrorCode
from aiodist._server.where import member_position, positions
from aiodist._wire.bounds import FieldError, check_message
from aiodist._wire.messages import Packed, unpack_keys

__all__ = [
    "BadRequest",
    "BarrierState",
    "Close",
    "ConnId",
    "FailureNotice",
    "Job",
    "LeaveNotice",
    "Member",
    "Send",
    "Timer",
    "Waiter",
    "assign_ranks",
    "check_values",
]

ConnId = int
MemberStatus = Literal["joining", "active", "failed", "left"]


@dataclass(eq=False, slots=True)
class Member:
    conn: int
    job: Job
    join_req_id: int
    requested_rank: int
    host: str
    pid: int
    addresses: list[str]
    peer: str
    heartbeat_timeout: float
    joined_at: float
    last_seen: float
    rank: int = -1
    local_rank: int = -1
    status: MemberStatus = "joining"
    done: bool = False  # its join deadline no longer applies
    # What its heartbeats say it does: (current, last) operations (``where.py``).
    position: tuple[Any, Any] | None = None
    # Its proof of membership when it re-attaches (``Join.secret``); None: not known yet
    # (a job rebuilt from re-attachments, ``restart.py``).
    secret: bytes | None = b""


@dataclass(eq=False, slots=True)
class Waiter:
    conn: int
    req_id: int
    keys: list[str]
    kind: Literal["get", "wait", "barrier"]
    job: Job
    packed_keys: bytes = b""  # a wait's keys as the client sent them (its watch's key)
    seq: int = 0
    done: bool = False
    pos: int = 0  # keys[:pos] are known to be set: each key is checked once in total
    # Waits on the very same keys ride along with the first one (every rank of a job
    # usually waits on the same N keys: checking them once, not N times, keeps a
    # job's rendezvous O(N) on the server instead of O(N^2)).
    followers: list[Waiter] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class BarrierState:
    seq: int
    arrived: dict[int, Waiter] = field(default_factory=dict)


@dataclass(eq=False, slots=True)
class LeaveNotice:
    """A planned notice to a job's members of the members that left it since the last one."""

    job: Job
    done: bool = False


@dataclass(eq=False, slots=True)
class FailureNotice:
    """A planned notice to a job's members of the members that failed since the last one."""

    job: Job
    done: bool = False


@dataclass(eq=False, slots=True)
class Job:
    name: str
    world_size: int
    created_at: float
    generation: int = 0  # the how-many-th start of the job under this name
    # Elastic jobs (``grow.py``): it forms with ``min_world_size`` members and admits
    # joiners while fewer than ``max_world_size`` are alive (0: not elastic);
    # ``world_size`` is then its rank space. ``epoch`` counts membership changes.
    min_world_size: int = 0
    max_world_size: int = 0
    epoch: int = 0
    formed_at: float | None = None
    ended: bool = False  # its last member is gone (its ``job_finished`` was recorded)
    end_reason: str = ""  # why a job was dropped: it never formed, or the server shut down
    # In join order; a dict as an ordered set: a leave or a lookup is O(1), not O(N).
    members: dict[Member, None] = field(default_factory=dict)
    requested: dict[int, Member] = field(default_factory=dict)
    by_rank: list[Member] = field(default_factory=list)
    complete: bool = False
    failures: list[tuple[int, str, int, str]] = field(default_factory=list)
    kv: dict[str, bytes] = field(default_factory=dict)
    key_waiters: dict[str, list[Waiter]] = field(default_factory=dict)
    watches: dict[bytes, Waiter] = field(default_factory=dict)  # packed keys -> first wait
    barriers: dict[int, BarrierState] = field(default_factory=dict)
    failed_barriers: dict[int, tuple[Any, str, dict[str, Any]]] = field(default_factory=dict)
    deletions: int = 0  # keys deleted so far: a set of keys once all set stays so until one is
    # Members that left the formed job cleanly: rank -> (host, pid). Barriers need them all.
    left: dict[int, tuple[str, int]] = field(default_factory=dict)
    # The first ranks (at most ``LEFT_BEFORE_FAILURE``) that had left when the first
    # failure came: a program's own ``sys.exit(n)`` looks like a clean leave from here,
    # and its peers' failures follow it (a launcher, which sees exit codes, reads this).
    left_before_failure: list[int] = field(default_factory=list)
    # ``[rank, host, pid]`` of leaves not announced yet, the planned notice, and when the
    # next notice may go (one notice per interval: a job of N ending costs O(N) notices).
    unannounced: list[list[Any]] = field(default_factory=list)
    leave_notice: LeaveNotice | None = None
    next_leave_notice: float = 0.0
    # The same for failures: ``[rank, host, pid, reason]`` not told yet (the first of an
    # interval is told at once), the planned notice, and when the next may go.
    unannounced_failures: list[list[Any]] = field(default_factory=list)
    failure_notice: FailureNotice | None = None
    next_failure_notice: float = 0.0
    _packed_table: Packed | None = None
    # For the dashboard's rates: messages received from its members, bytes sent to them.
    messages: int = 0
    bytes_sent: int = 0
    # The last notice asking its ranks for their flight recorders: (when, its number,
    # the ranks told); ``ServerState`` sends at most one per ``DUMP_INTERVAL``.
    dump: tuple[float, int, list[int]] | None = None
    # The keys of the latest wait, decoded, and the value of ``deletions`` when they were
    # last seen all set (-1: not known to be).
    _last_keys: tuple[bytes, list[str]] = (b"", [])
    _last_keys_set_at: int = -1

    def wait_keys(self, packed: bytes) -> list[str]:
        """The keys of a wait, decoded once for the many members that wait on the same ones.

        Raises:
            ValueError: ``packed`` is not a msgpack array of str.
        """
        if packed != self._last_keys[0]:
            self._last_keys = (packed, unpack_keys(packed))
            self._last_keys_set_at = -1
        return self._last_keys[1]

    def known_set(self, packed: bytes) -> bool:
        """True if the keys ``packed`` were all set and none was deleted since."""
        return packed == self._last_keys[0] and self._last_keys_set_at == self.deletions

    def mark_set(self, packed: bytes) -> None:
        """Record that the keys ``packed`` are all set now (a later wait needs no scan)."""
        if packed == self._last_keys[0]:
            self._last_keys_set_at = self.deletions

    def packed_table(self) -> Packed:
        """``[rank, local_rank, host, pid, addresses]`` per rank, encoded once per job.

        Members fetch it on first need; encoding it once, not once per member,
        keeps a job's formation O(N) on the server.
        """
        assert self.complete
        if self._packed_table is None:
            table = [[m.rank, m.local_rank, m.host, m.pid, m.addresses] for m in self.by_rank]
            self._packed_table = Packed(msgpack.packb(table, use_bin_type=True))
        return self._packed_table

    def forget_table(self) -> None:
        """A member's entry changed (it re-registered): encode the table again when asked."""
        self._packed_table = None

    def grown(self, member: Member) -> None:
        """Admit ``member`` into the formed job as its next rank (``grow.py``)."""
        member.rank = self.world_size
        self.world_size += 1
        self.by_rank.append(member)
        self._packed_table = None

    def add(self, member: Member) -> None:
        self.members[member] = None
        if member.requested_rank >= 0:
            self.requested[member.requested_rank] = member

    def discard(self, member: Member) -> None:
        self.members.pop(member, None)
        if self.requested.get(member.requested_rank) is member:
            del self.requested[member.requested_rank]

    def barrier(self, seq: int) -> BarrierState:
        state = self.barriers.get(seq)
        if state is None:
            state = self.barriers[seq] = BarrierState(seq)
        return state

    def all_waiters(self) -> list[Waiter]:
        out = [w for ws in self.key_waiters.values() for w in ws]
        out.extend(f for w in out[:] for f in w.followers)
        out.extend(w for b in self.barriers.values() for w in b.arrived.values())
        return out

    def snapshot(self, now: float, max_members: int) -> dict[str, Any]:
        """The job as plain data, with the first ``max_members`` of its members."""
        listed = self.by_rank if self.complete else self.members
        present = (m for m in listed if m in self.members)
        members = list(itertools.islice(present, max_members))
        return {
            "name": self.name,
            "generation": self.generation,
            "world_size": self.world_size,
            "joined": len(self.members),
            "state": "failed" if self.failures else "running" if self.complete else "forming",
            "age": now - self.created_at,
            "members": [
                {
                    "rank": m.rank if self.complete else m.requested_rank,
                    "local_rank": m.local_rank,
                    "host": m.host,
                    "pid": m.pid,
                    "peer": m.peer,
                    "status": m.status,
                    "heartbeat_age": now - m.last_seen,
                    **member_position(m, now),
                }
                for m in members
            ],
            "ranks_hidden": max(0, len(self.members) - max_members),
            "failures": [
                {"rank": r, "host": h, "pid": p, "reason": why} for r, h, p, why in self.failures
            ],
            "keys": len(self.kv),
            "waits": positions(self, now) if self.complete else [],
        }


def assign_ranks(job: Job) -> None:
    """Give every member its rank and local rank once the job is complete.

    Explicit ranks are kept. Automatic members fill the remaining ranks grouped
    by host, hosts in the order they first joined, members of one host in join
    order; so with automatic ranks, the ranks of one host are contiguous.
    """
    free = sorted(set(range(job.world_size)) - job.requested.keys())
    auto = [m for m in job.members if m.requested_rank < 0]
    host_order: dict[str, int] = {}
    for m in job.members:
        host_order.setdefault(m.host, len(host_order))
    auto.sort(key=lambda m: host_order[m.host])  # stable: join order within a host
    for rank, m in zip(free, auto, strict=True):
        m.rank = rank
    for m in job.members:
        if m.requested_rank >= 0:
            m.rank = m.requested_rank
    job.by_rank = sorted(job.members, key=lambda m: m.rank)
    seen: dict[str, int] = {}
    for m in job.by_rank:
        m.local_rank = seen.get(m.host, 0)
        seen[m.host] = m.local_rank + 1


@dataclass(frozen=True, slots=True)
class Send:
    conn: ConnId
    msg: Any


@dataclass(frozen=True, slots=True)
class Close:
    conn: ConnId
    reason: str


class BadRequest(Exception):
    def __init__(self, code: ErrorCode, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.details = details or {}


# A deadline in the job table's heap: (when, sequence, target), compared in C (a heap of
# dataclasses compared in Python cost a 4K-rank join storm 96K __lt__ calls). The
# sequence breaks ties, so the target (a Member's join deadline, a Waiter, a
# LeaveNotice, an Agreement) is never compared.
Timer = tuple[float, int, Any]


def check_values(msg: Any) -> None:
    """Refuse a request whose values are out of range (``_wire/bounds.py``).

    Messages from the wire were checked on decoding; this guards the table's
    own input (an embedded caller, a test) before a deadline is computed.

    Raises:
        BadRequest: A field is out of range; the message names it.
    """
    try:
        check_message(msg)
    except FieldError as exc:
        raise BadRequest(ErrorCode.BAD_REQUEST, str(exc), exc.wire_details()) from None
