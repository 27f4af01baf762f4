"""Random sequences of what a daemon keeps, across restarts and damaged state directories.

Sans-IO: the job table with a state directory of real files, a fake clock. A
seeded random sequence forms jobs (some elastic), writes their stores (set,
add, compare-set, delete), passes barriers, grows elastic jobs, has members
leave, fail (a lost connection, a failing leave), agree on regroups, ends jobs
and starts later generations of them, and restarts the server on the same
directory between operations: the members re-attach, and some never do (they
are declared failed). A model kept beside the server holds every change the
server acknowledged.

With ``damage``, each restart may first damage the directory: the log cut at a
random byte (mid-record included), a byte of the log or the snapshot flipped, a
torn write appended to the log, the snapshot or the log deleted. The server
then either refuses to start, naming the damaged file and leaving every file as
it was, or comes back with every acknowledged change of every job.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

from aiodist._server.durable import StateDirError, frame
from aiodist._server.records import KeySet, encode_record
from aiodist._wire.messages import (
    Barrier,
    ErrorReply,
    Heartbeat,
    Join,
    Leave,
    MembersJoined,
    Reattach,
    Regroup,
    Reply,
    StoreAdd,
    StoreCompareSet,
    StoreDeleteKey,
    StoreSet,
    Welcome,
)
from aiodist._wire.timing import MIN_REATTACH_WINDOW
from tests.unit.server.test_durable_state import HB, Table

if TYPE_CHECKING:
    from pathlib import Path

NAMES = ("a", "b", "c", "d")
KEYS = ("k0", "k1", "k2", "k3")
COUNTERS = ("n0", "n1")
OPERATIONS = 400  # per seed
SEEDS = (0, 1, 2)


@dataclass
class Member:
    rank: int
    conn: int
    secret: bytes
    world: int  # the world size its Welcome said
    host: str
    pid: int
    last: tuple[Any, Any] | None = None  # its latest change of the store, and the answer


@dataclass
class Job:
    name: str
    generation: int
    world: int  # its rank space
    max_world: int
    alive: dict[int, Member] = field(default_factory=dict)
    kv: dict[str, bytes] = field(default_factory=dict)
    barrier: int = 0  # the last barrier passed
    failed: set[int] = field(default_factory=set)
    left: set[int] = field(default_factory=set)
    regroups: dict[str, list[int]] = field(default_factory=dict)
    epoch: int = 0


class Run:
    """One seeded sequence against one state directory, and the model beside it."""

    def __init__(self, path: Path, seed: int, damage: bool) -> None:
        self.rng = random.Random(seed)
        self.path = path
        self.damage = damage
        self.table = Table(path, fsync=False)
        self.jobs: dict[str, Job] = {}
        self.generations: dict[str, int] = {}
        self.orphans: list[Member] = []  # members of a generation replaced by a later one
        self.counts: collections.Counter[str] = collections.Counter()
        self.pids = iter(range(1000, 10**6))
        self.regroups = 0

    # --- the table ------------------------------------------------------------------

    def call(self, conn: int, build: Any) -> Any:
        """Send ``build(req_id)``; its answer (a Reply or an ErrorReply), or None."""
        self.sent = build(next(self.table._reqs))
        self.table.state.receive(conn, self.sent, self.table.now)
        self.table.collect()
        return self.answer(conn, self.sent.req_id)

    def answer(self, conn: int, req: int) -> Any:
        for msg in self.table.inbox[conn]:
            if isinstance(msg, Reply | ErrorReply | Welcome) and msg.req_id == req:
                return msg
        return None

    def ok(self, conn: int, build: Any) -> Any:
        reply = self.call(conn, build)
        assert isinstance(reply, Reply), reply
        return reply.value

    # --- operations ---------------------------------------------------------------------

    def step(self) -> None:
        choices = [self.form, self.form, self.restart]
        live = [j for j in self.jobs.values() if j.alive]
        if live:
            choices += [self.store] * 8 + [self.barrier, self.regroup, self.leave, self.fail]
            choices += [self.grow, self.grow, self.end, self.regen, self.orphan_write]
        self.rng.choice(choices)()

    def pick(self) -> Job | None:
        live = [j for j in self.jobs.values() if j.alive]
        return self.rng.choice(live) if live else None

    def member(self, job: Job) -> Member:
        return self.rng.choice(list(job.alive.values()))

    def _join(self, name: str, world: int, rank: int, max_world: int, generation: int) -> Any:
        conn = self.table.connect()
        secret = self.rng.randbytes(32)
        host, pid = f"host{self.rng.randrange(3)}", next(self.pids)
        req = next(self.table._reqs)
        address = [f"tcp://{host}:{pid}"]
        msg = Join(req, name, world, rank, host, pid, address, HB, 60.0, generation, secret)
        msg = dataclasses.replace(msg, max_world_size=max_world)
        self.table.state.receive(conn, msg, self.table.now)
        self.table.collect()
        return conn, req, secret, host, pid

    def form(self, name: str | None = None) -> None:
        free = [n for n in NAMES if n not in self.jobs]
        if name is None:
            if not free:
                return
            name = self.rng.choice(free)
        generation = self.generations.get(name, -1) + 1
        self.generations[name] = generation
        world = self.rng.randint(1, 3)
        max_world = world + 2 if self.rng.random() < 0.5 else 0
        joins = [self._join(name, world, r, max_world, generation) for r in range(world)]
        job = Job(name, generation, world, max_world)
        for rank, (conn, req, secret, host, pid) in enumerate(joins):
            welcome = self.answer(conn, req)
            assert isinstance(welcome, Welcome), welcome
            assert welcome.rank == rank
            assert welcome.restartable
            job.alive[rank] = Member(rank, conn, secret, world, host, pid)
        self.jobs[name] = job
        self.counts["join"] += world

    def regen(self) -> None:
        """A later generation of a job replaces it; its members go on alone."""
        job = self.pick()
        if job is None:
            return
        self.orphans.extend(job.alive.values())
        del self.jobs[job.name]
        self.form(job.name)
        self.counts["generation"] += 1

    def orphan_write(self) -> None:
        """A member of a replaced generation writes its own store (never the later one's)."""
        if not self.orphans:
            return
        m = self.rng.choice(self.orphans)
        key = self.rng.choice(KEYS)
        self.call(m.conn, lambda r: StoreSet(r, key, b"orphan"))
        self.counts["orphan write"] += 1

    def store(self) -> None:
        job = self.pick()
        if job is None:
            return
        m = self.member(job)
        kv = job.kv
        kind = self.rng.choice(["set", "set", "add", "cas", "delete"])
        if kind == "set":
            key, value = self.rng.choice(KEYS), self.rng.randbytes(self.rng.randint(0, 40))
            got = self.ok(m.conn, lambda r: StoreSet(r, key, value))
            kv[key] = value
        elif kind == "add":
            key, amount = self.rng.choice(COUNTERS), self.rng.randint(-5, 50)
            got = self.ok(m.conn, lambda r: StoreAdd(r, key, amount))
            new = int(kv.get(key, b"0")) + amount
            assert got == new, (got, new)
            kv[key] = str(new).encode()
        elif kind == "cas":
            key = self.rng.choice(KEYS)
            current = kv.get(key)
            expected = (current or b"") if self.rng.random() < 0.7 else b"not it"
            desired = self.rng.randbytes(8)
            got = self.ok(m.conn, lambda r: StoreCompareSet(r, key, expected, desired))
            if (current is None and not expected) or current == expected:
                kv[key] = desired
                assert got == desired
            else:
                assert got == (expected if current is None else current)
        else:
            key = self.rng.choice(KEYS)
            got = self.ok(m.conn, lambda r: StoreDeleteKey(r, key))
            assert got == (kv.pop(key, None) is not None)
        m.last = (self.sent, got)
        self.counts[f"store {kind}"] += 1

    def barrier(self) -> None:
        job = self.pick()
        if job is None or job.failed or job.left:
            return  # a job's barrier needs every rank
        seq = job.barrier + 1
        reqs = [(m.conn, next(self.table._reqs)) for m in job.alive.values()]
        for conn, req in reqs:
            self.table.state.receive(conn, Barrier(req, seq, 60.0), self.table.now)
        self.table.collect()
        for conn, req in reqs:
            assert isinstance(self.answer(conn, req), Reply)
        job.barrier = seq
        self.counts["barrier"] += 1

    def regroup(self) -> None:
        job = self.pick()
        if job is None:
            return
        self.regroups += 1
        key, ranks = f"g{self.regroups}", sorted(job.alive)
        reqs = [(m.conn, next(self.table._reqs)) for m in job.alive.values()]
        for conn, req in reqs:
            msg = Regroup(req, key, self.regroups, ranks, 60.0)
            self.table.state.receive(conn, msg, self.table.now)
        self.table.collect()
        for conn, req in reqs:
            reply = self.answer(conn, req)
            assert isinstance(reply, Reply), reply
            assert reply.value == ranks, reply
        job.regroups[key] = ranks
        self.counts["regroup"] += 1

    def grow(self) -> None:
        growing = [j for j in self.jobs.values() if j.alive and len(j.alive) < j.max_world]
        if not growing:
            return
        job = self.rng.choice(growing)
        witness = self.member(job)
        seen = len(self.table.inbox[witness.conn])
        conn, req, secret, host, pid = self._join(
            job.name, job.max_world - 2, -1, job.max_world, job.generation
        )
        welcome = self.answer(conn, req)
        assert isinstance(welcome, Welcome), welcome
        assert (welcome.rank, welcome.world_size) == (job.world, job.world + 1)
        assert welcome.restartable, "a newcomer must re-attach like any member"
        job.epoch += 1
        views = [m for m in self.table.inbox[witness.conn][seen:] if isinstance(m, MembersJoined)]
        assert [v.epoch for v in views] == [job.epoch], (views, job.epoch)
        job.alive[job.world] = Member(job.world, conn, secret, job.world + 1, host, pid)
        job.world += 1
        self.counts["grow"] += 1

    def _gone(self, job: Job, rank: int, failed: bool) -> None:
        (job.failed if failed else job.left).add(rank)
        del job.alive[rank]
        job.epoch += 1
        if not job.alive:
            del self.jobs[job.name]
            self.counts["job end"] += 1

    def leave(self) -> None:
        job = self.pick()
        if job is None:
            return
        m = self.member(job)
        reason = self.rng.choice(["", "", "it raised"])
        self.ok(m.conn, lambda r: Leave(r, reason))
        # A leave with a reason is the job's first failure; after one, it is a leave.
        self._gone(job, m.rank, failed=bool(reason) and not job.failed)
        self.counts["leave" if not reason else "failing leave"] += 1

    def fail(self) -> None:
        job = self.pick()
        if job is None:
            return
        m = self.member(job)
        self.table.state.connection_lost(m.conn, self.table.now, "connection reset")
        self.table.collect()
        self._gone(job, m.rank, failed=True)
        self.counts["failure"] += 1

    def end(self) -> None:
        job = self.pick()
        if job is None:
            return
        for m in list(job.alive.values()):
            self.ok(m.conn, lambda r: Leave(r))
            self._gone(job, m.rank, failed=False)
        self.counts["end"] += 1

    # --- restarts ---------------------------------------------------------------------------

    def restart(self) -> None:
        self.counts["records written"] += self.table.dir.records_in_log  # type: ignore[union-attr]
        self.table.close()
        self.orphans.clear()  # their generation was replaced: the server forgets it
        now = self.table.now + 1.0
        if self.damage:
            self.damage_then_start(now)
        else:
            self.table = Table(self.path, now, fsync=False)
        self.counts["restart"] += 1
        self.counts["records replayed"] += self.table.dir.replayed  # type: ignore[union-attr]
        self.check()
        self.reattach()

    def damage_then_start(self, now: float) -> None:
        files = {p.name: p.read_bytes() for p in self.path.iterdir() if p.is_file()}
        kind = self.rng.choice(["none", "torn", "cut", "flip log", "flip snapshot", "delete"])
        log, snapshot = self.path / "log", self.path / "snapshot"
        damaged_file = snapshot if "snapshot" in kind else log
        if kind == "torn":  # a crash while writing records no reply had told of yet
            extra = frame(encode_record(KeySet("a", "never acknowledged", b"x" * 30))) * 3
            log.write_bytes(files["log"] + extra[: self.rng.randrange(1, len(extra))])
        elif kind == "cut":
            log.write_bytes(files["log"][: self.rng.randrange(len(files["log"]))])
        elif kind.startswith("flip"):
            target = log if kind == "flip log" else snapshot
            flipped = bytearray(files[target.name])
            flipped[self.rng.randrange(len(flipped))] ^= self.rng.randrange(1, 256)
            target.write_bytes(bytes(flipped))
        elif kind == "delete":
            damaged_file = snapshot if self.rng.random() < 0.5 else log
            damaged_file.unlink()
        damaged = {p.name: p.read_bytes() for p in self.path.iterdir() if p.is_file()}
        refused: StateDirError | None = None
        try:
            self.table = Table(self.path, now, fsync=False)
        except StateDirError as exc:
            refused = exc
        if refused is not None:
            assert kind not in ("none", "torn"), refused
            assert f"{damaged_file}: " in str(refused), (kind, refused)
            after = {p.name: p.read_bytes() for p in self.path.iterdir() if p.is_file()}
            assert after == damaged, "a refused start changed the state directory"
            self.counts[f"damage refused: {kind}"] += 1
            for p in self.path.iterdir():
                if p.is_file():
                    p.unlink()
            for name, data in files.items():  # the operator puts the good copy back
                (self.path / name).write_bytes(data)
            self.table = Table(self.path, now, fsync=False)
            return
        assert kind != "delete", "a state directory missing a file was accepted"
        self.counts[f"damage survived: {kind}"] += 1

    def check(self) -> None:
        """Every acknowledged change of every job is back."""
        jobs = self.table.state.jobs
        for name, job in self.jobs.items():
            assert name in jobs, f"job {name!r} lost"
            assert jobs[name].store.kv == job.kv, (
                f"job {name!r}: its store is not what was acknowledged"
            )
        for name, job in self.jobs.items():
            restored = jobs[name]
            assert restored.generation == job.generation, name
            assert sorted(f[0] for f in restored.failures) == sorted(job.failed), name
            assert set(restored.left) == job.left, name
            assert restored.world_size == job.world, name
        assert set(jobs) == set(self.jobs), "a job that ended came back"

    def reattach(self) -> None:
        table = self.table
        back: list[int] = []
        dead: list[tuple[Job, Member]] = []
        for job in self.jobs.values():
            for m in list(job.alive.values()):
                if self.rng.random() < 0.1:
                    dead.append((job, m))  # died while the server was away
                    continue
                m.conn = table.connect()
                reply = self.call(
                    m.conn,
                    lambda r, m=m, job=job: Reattach(
                        r, job.name, job.generation, m.world, m.rank, 0, m.host, m.pid,
                        [f"tcp://{m.host}:{m.pid}"], HB, m.secret,
                    ),
                )  # fmt: skip
                assert isinstance(reply, Reply), (job.name, m.rank, reply)
                back.append(m.conn)
                self.counts["re-attach"] += 1
                if m.last is not None and self.rng.random() < 0.5:
                    # Its latest change sent again, as if its answer had been lost: the
                    # same answer, and the store as acknowledged (check() below).
                    msg, got = m.last
                    table.state.receive(m.conn, msg, table.now)
                    table.collect()
                    again = self.answer(m.conn, msg.req_id)
                    assert isinstance(again, Reply), (msg, again)
                    assert again.value == got, (msg, got, again)
                    self.counts["change sent again"] += 1
        if dead:
            for _ in range(round(2 * MIN_REATTACH_WINDOW / (HB / 4))):
                table.advance(HB / 4)
                for conn in back:
                    table.state.receive(conn, Heartbeat(), table.now)
                table.collect()
            for job, m in dead:
                self._gone(job, m.rank, failed=True)
                self.counts["failed while away"] += 1
        for job in self.jobs.values():
            m = self.member(job)
            if job.barrier:  # passed before: sent again, it answers at once
                self.ok(m.conn, lambda r, job=job: Barrier(r, job.barrier, 60.0))
            for key, ranks in job.regroups.items():
                if m.rank in ranks:  # decided before: sent again, the same answer
                    msg = lambda r, key=key, ranks=ranks: Regroup(r, key, 0, ranks, 60.0)  # noqa: E731
                    got = self.call(m.conn, msg)
                    assert isinstance(got, Reply), (job.name, key, got)
                    assert got.value == ranks, (job.name, key, got)
        self.check()


def _run(path: Path, seed: int, damage: bool) -> collections.Counter[str]:
    run = Run(path, seed, damage)
    for _ in range(OPERATIONS):
        run.step()
        run.counts["operations"] += 1
    run.restart()
    run.table.close()
    return run.counts


@pytest.mark.parametrize("seed", SEEDS)
def test_random_sequences_across_restarts_keep_every_acknowledged_change(
    tmp_path: Path, seed: int
) -> None:
    counts = _run(tmp_path, seed, damage=False)
    print(f"\nseed {seed}: {dict(sorted(counts.items()))}")
    for kind in ("grow", "failure", "leave", "regroup", "barrier", "end", "re-attach"):
        assert counts[kind] > 0, (kind, counts)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_damage_is_refused_by_name_or_loses_nothing(tmp_path: Path, seed: int) -> None:
    counts = _run(tmp_path, 100 + seed, damage=True)
    print(f"\nseed {100 + seed} (damage): {dict(sorted(counts.items()))}")
    assert any(k.startswith("damage refused") for k in counts), counts
