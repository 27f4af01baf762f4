"""A job as the table holds it: its members and ranks, and the parts it owns.

A ``Job`` holds its membership (members in join order, ranks, failures,
leaves, the epoch of its view) and owns one of each of its parts, composed,
each with its own state and rules, acting through the table's ``Outbox``:

- ``store``: the key-value store and the waits on it (``store.py``);
- ``barriers``: the job-wide barriers (``store.py``);
- ``regroups``: the agreements on a group's next membership (``regroups.py``);
- ``notices``: telling the members who left and who failed (``notices.py``).

Every change of durable state is a record (``records.py``) that its part
emits; ``records()`` is the job's whole durable state as those records.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

import msgpack

from aiodist._server.notices import Notices
from aiodist._server.parts import handlers
from aiodist._server.records import JobEnded, JobFormed, MemberAdded, RankFailed, RankLeft
from aiodist._server.regroups import Regroups
from aiodist._server.store import Barriers, Store
from aiodist._server.traffic import Traffic
from aiodist._server.where import member_position, positions
from aiodist._wire.messages import Packed, pack_host_runs

LEFT_BEFORE_FAILURE: Final = 8  # leaves before a job's first failure that its record names

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._server.parts import ConnId, Outbox
    from aiodist._server.records import Record

MemberStatus = Literal["joining", "active", "failed", "left"]


@dataclass(eq=False, slots=True)
class Member:
    conn: ConnId
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
    # (a job rebuilt from re-attachments, ``reattach.py``).
    secret: bytes | None = b""
    # Away from a server that came back: the deadline of its re-attachment (``reattach.py``).
    away: Away | None = None
    # What its heartbeats last said it sent its peers: (messages, bytes) since it joined;
    # None: its next report sets where it counts from (it re-attached, ``traffic.py``).
    sent: tuple[int, int] | None = (0, 0)

    def added(self) -> MemberAdded:
        """The record of this member as it joined the formed job."""
        return MemberAdded(
            self.job.name,
            self.rank,
            self.local_rank,
            self.host,
            self.pid,
            self.addresses,
            self.heartbeat_timeout,
            self.secret or b"",
        )


@dataclass(eq=False, slots=True)
class Away:
    """A member's deadline to re-attach to a server that came back (``reattach.py``)."""

    member: Member
    until: float
    done: bool = False


@dataclass(eq=False)
class Job:
    name: str
    world_size: int
    created_at: float
    out: Outbox
    generation: int = 0  # the how-many-th start of the job under this name
    # Elastic jobs (``membership.py``): it forms with ``min_world_size`` members and admits
    # joiners while fewer than ``max_world_size`` are alive (0: not elastic);
    # ``world_size`` is then its rank space. ``epoch`` counts membership changes.
    min_world_size: int = 0
    max_world_size: int = 0
    epoch: int = 0
    formed_at: float | None = None
    ended: bool = False  # its last member is gone (its ``job_finished`` was recorded)
    end_reason: str = ""  # why a job was dropped: it never formed, or the server shut down
    logged: bool = False  # the state directory holds it: its changes are records
    # In join order; a dict as an ordered set: a leave or a lookup is O(1), not O(N).
    members: dict[Member, None] = field(default_factory=dict)
    requested: dict[int, Member] = field(default_factory=dict)
    by_rank: list[Member] = field(default_factory=list)
    complete: bool = False
    failures: list[tuple[int, str, int, str]] = field(default_factory=list)
    # Members that left the formed job cleanly: rank -> (host, pid). Barriers need them all.
    left: dict[int, tuple[str, int]] = field(default_factory=dict)
    # The first ranks (at most ``LEFT_BEFORE_FAILURE``) that had left when the first
    # failure came: a program's own ``sys.exit(n)`` looks like a clean leave from here,
    # and its peers' failures follow it (a launcher, which sees exit codes, reads this).
    left_before_failure: list[int] = field(default_factory=list)
    # What its members sent each other, as their heartbeats report it (``traffic.py``).
    traffic: Traffic = field(default_factory=Traffic)
    # The last notice asking its ranks for their flight recorders: (when, its number,
    # the ranks told); the table sends at most one per ``DUMP_INTERVAL``.
    dump: tuple[float, int, list[int]] | None = None
    _packed_table: Packed | None = None

    def __post_init__(self) -> None:
        if not self.min_world_size:
            self.min_world_size = self.world_size
        self.store = Store(self, self.out)
        self.barriers = Barriers(self, self.out)
        self.regroups = Regroups(self, self.out)
        self.notices = Notices(self, self.out)
        # The requests of its members that its parts answer, by message class.
        self.handlers: dict[type[Any], Callable[..., None]] = {
            **handlers(self.store),
            **handlers(self.barriers),
            **handlers(self.regroups),
        }

    # --- membership ------------------------------------------------------------------------

    def add(self, member: Member) -> None:
        self.members[member] = None
        if member.requested_rank >= 0:
            self.requested[member.requested_rank] = member

    def discard(self, member: Member) -> None:
        self.members.pop(member, None)
        if self.requested.get(member.requested_rank) is member:
            del self.requested[member.requested_rank]

    def grown(self, member: Member) -> None:
        """Admit ``member`` into the formed job as its next rank (``membership.py``)."""
        member.rank = self.world_size
        self.world_size += 1
        self.by_rank.append(member)
        self._packed_table = None
        self.out.record(self, member.added())

    def failed(self, member: Member, reason: str) -> None:
        if not self.failures:
            self.left_before_failure = list(itertools.islice(self.left, LEFT_BEFORE_FAILURE))
        member.status = "failed"
        self.epoch += 1
        self.failures.append((member.rank, member.host, member.pid, reason))
        self.out.record(self, RankFailed(self.name, member.rank, member.host, member.pid, reason))

    def gone_cleanly(self, member: Member) -> None:
        """``member`` of the formed job left it cleanly (its barriers will never come)."""
        self.epoch += 1
        self.left[member.rank] = (member.host, member.pid)
        self.out.record(self, RankLeft(self.name, member.rank, member.host, member.pid))

    def end(self) -> None:
        """Its last member is gone: nothing of it is kept."""
        self.out.record(self, JobEnded(self.name, self.generation))
        self.logged = False

    def gone(self) -> set[int]:
        """The ranks that failed or left."""
        return {r for r, *_ in self.failures} | self.left.keys()

    def alive(self) -> int:
        return sum(1 for m in self.members if m.status == "active")

    @property
    def state(self) -> Literal["failed", "running", "forming"]:
        """What status and the metrics say of it."""
        return "failed" if self.failures else "running" if self.complete else "forming"

    # --- what it tells ---------------------------------------------------------------------

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

    def records(self) -> list[Record]:
        """The job's durable state as the records that rebuild it (a snapshot's part)."""
        out: list[Record] = [
            JobFormed(self.name, self.generation, self.min_world_size, self.max_world_size)
        ]
        out.extend(m.added() for m in self.by_rank)
        out.extend(self.store.records())
        out.extend(self.barriers.records())
        out.extend(RankFailed(self.name, *f) for f in self.failures)
        out.extend(RankLeft(self.name, r, h, p) for r, (h, p) in self.left.items())
        out.extend(self.regroups.records())
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
            "state": self.state,
            "age": now - self.created_at,
            "members": [
                {
                    "rank": _shown_rank(m),
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
            "keys": len(self.store.kv),
            "waits": positions(self.name, self.members, now) if self.complete else [],
            "traffic": self.traffic.summary(),
        }


def _shown_rank(m: Member) -> int | None:
    """``m``'s rank once it has one (the rank it asked for while the job forms), else None."""
    if m.rank >= 0:
        return m.rank
    return m.requested_rank if m.requested_rank >= 0 else None


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


def host_runs(members: list[Member]) -> tuple[Counter[str], list[list[int]]]:
    """Members per host, and the hosts of ``members`` as ``Welcome.host_runs``.

    Host ids number the hosts in the order they first appear; a job whose
    hosts all hold as many ranks is one run, whatever its size.
    """
    local_sizes = Counter(m.host for m in members)  # one pass, not O(N^2)
    host_index = {host: i for i, host in enumerate(local_sizes)}
    return local_sizes, pack_host_runs(host_index[m.host] for m in members)
