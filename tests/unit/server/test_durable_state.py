"""The daemon's state directory and re-attachment, sans-IO: messages, a fake clock, real files."""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import pytest

from aiodist._errors import ErrorCode
from aiodist._server.durable import Journal, StateDir, StateDirError, file_header, frame
from aiodist._server.parts import Send
from aiodist._server.records import JobFormed, KeySet, MemberAdded, RankFailed, encode_record
from aiodist._server.state import JobTable
from aiodist._wire.messages import (
    Barrier,
    ErrorReply,
    Heartbeat,
    Join,
    Leave,
    MemberFailed,
    MembersFailed,
    MembersJoined,
    Reattach,
    Reply,
    StoreAdd,
    StoreCompareSet,
    StoreDeleteKey,
    StoreGet,
    StoreSet,
    Welcome,
)
from aiodist._wire.timing import MIN_REATTACH_WINDOW, STALL_GAP
from tests.unit.server.test_server_state import decoded_failures

if TYPE_CHECKING:
    from pathlib import Path

HB = 1.0
_OPEN: list[Table] = []


@pytest.fixture(autouse=True)
def _close_tables() -> Any:
    yield
    while _OPEN:
        _OPEN.pop().close()


def secret_of(rank: int) -> bytes:
    return bytes([rank + 1]) * 32


_REQUEST_IDS = itertools.count(1)


class Table:
    """A restartable ``JobTable`` with a fake clock, its state directory wired in as the
    server wires it; its replies sorted by connection."""

    def __init__(self, state_dir: Path | None, now: float = 0.0, *, fsync: bool = True) -> None:
        self.now = now
        self.state = JobTable(now, durable=state_dir is not None, restartable=True)
        self.journal = None
        self.dir = None
        if state_dir is not None:
            self.journal = Journal(StateDir(state_dir, fsync=fsync), self.state, now)
            self.dir = self.journal.state_dir
        self.inbox: dict[int, list[Any]] = defaultdict(list)
        self._conns = itertools.count(1)
        # A client's request ids go on across its server's restart (it keeps its connection
        # object): a request sent again keeps its id, a new one never takes an old one's.
        self._reqs = _REQUEST_IDS
        _OPEN.append(self)

    def connect(self) -> int:
        conn = next(self._conns)
        self.state.connection_made(conn, f"127.0.0.1:{40000 + conn}", self.now)
        return conn

    def send(self, conn: int, build: Any) -> Any:
        """Send ``build(req_id)``; the last message ``conn`` got back."""
        msg = build(next(self._reqs)) if callable(build) else build
        self.state.receive(conn, msg, self.now)
        self.collect()
        return self.inbox[conn][-1] if self.inbox[conn] else None

    def advance(self, seconds: float) -> None:
        self.now += seconds
        deadline = self.state.next_deadline()
        while deadline is not None and deadline <= self.now:
            self.state.handle_timeouts(self.now)
            deadline = self.state.next_deadline()
        self.collect()

    def collect(self) -> None:
        actions = self.state.take_actions()
        records = self.state.take_records()
        if records and self.journal is not None:
            self.journal(records)  # before the replies, as the server's hub does
        for action in actions:
            if isinstance(action, Send):
                self.inbox[action.conn].append(action.msg)

    def close(self) -> None:
        if self.dir is not None:
            self.dir.close()  # closed once
            self.dir = self.journal = None


def beat(table: Table, conn: int, seconds: float, *others: int) -> None:
    """Let ``seconds`` pass while ``conn`` (and ``others``) heartbeat every quarter timeout."""
    for _ in range(round(seconds / (HB / 4))):
        table.advance(HB / 4)
        for c in (conn, *others):
            table.send(c, Heartbeat())


def join(
    table: Table,
    rank: int,
    world: int = 2,
    name: str = "job",
    *,
    max_world: int = 0,
    secret: bytes | None = None,
) -> int:
    """Join ``rank`` (-1: a newcomer of a formed elastic job, with ``secret``)."""
    conn = table.connect()
    table.send(
        conn,
        lambda r: Join(
            r,
            name,
            world,
            rank,
            f"host{rank}",
            100 + rank,
            [f"tcp://h:{rank}"],
            HB,
            60.0,
            0,
            secret_of(rank) if secret is None else secret,
            max_world,
        ),
    )
    return conn


def reattach(table: Table, rank: int, secret: bytes, world: int = 2, name: str = "job") -> Any:
    conn = table.connect()
    reply = table.send(
        conn,
        lambda r: Reattach(
            r, name, 0, world, rank, 0, f"host{rank}", 100 + rank, [f"tcp://h:{rank}"], HB, secret
        ),
    )
    return conn, reply


def formed_job(tmp_path: Path) -> tuple[Table, list[int]]:
    table = Table(tmp_path)
    conns = [join(table, r) for r in range(2)]
    assert all(isinstance(table.inbox[c][-1], Welcome) for c in conns)
    assert all(table.inbox[c][-1].restartable for c in conns)
    table.send(conns[0], lambda r: StoreSet(r, "kept", b"v1"))
    table.send(conns[0], lambda r: StoreSet(r, "gone", b"x"))
    table.send(conns[1], lambda r: StoreDeleteKey(r, "gone"))
    for c in conns:
        table.send(c, lambda r: Barrier(r, 1, 60.0))
    return table, conns


def test_state_dir_replays_job_members_keys_and_barriers(tmp_path: Path) -> None:
    table, _ = formed_job(tmp_path)
    table.close()  # as after SIGKILL: nothing more is written than what each batch wrote
    again = Table(tmp_path, now=500.0)
    job = again.state.jobs["job"]
    assert job.complete
    assert job.world_size == 2
    assert job.store.kv == {"kept": b"v1"}
    assert [(m.rank, m.host, m.pid) for m in job.by_rank] == [(0, "host0", 100), (1, "host1", 101)]
    conn, reply = reattach(again, 0, secret_of(0))
    assert isinstance(reply, Reply)
    # Barrier 1 was passed before the restart: sent again, it answers at once.
    assert isinstance(again.send(conn, lambda r: Barrier(r, 1, 60.0)), Reply)
    assert again.send(conn, lambda r: StoreGet(r, "kept", 5.0)).value == b"v1"


@pytest.mark.parametrize("restarts", [0, 1, 2], ids=["stood-still", "restart", "snapshot"])
def test_a_change_sent_again_is_answered_not_applied_again(tmp_path: Path, restarts: int) -> None:
    # A member that re-attaches sends again the requests it had no answer to. One the
    # server applied before the answer was lost gets that answer, and is not applied a
    # second time: after a restart too, and after the one after it (replaying the
    # snapshot the first wrote).
    table, conns = formed_job(tmp_path)
    ids = [next(table._reqs) for _ in range(4)]
    again = [
        StoreAdd(ids[0], "n", 5),
        StoreCompareSet(ids[1], "c", b"", b"new"),
        StoreSet(ids[2], "s", b"v"),
        StoreDeleteKey(ids[3], "kept"),
    ]
    for msg in again:
        table.send(conns[0], msg)  # applied; say its answer was lost with the connection
    table.send(conns[1], lambda r: StoreSet(r, "s", b"later"))  # another member, after it
    conn = conns[0]
    for n in range(restarts):
        table.close()
        table = Table(tmp_path, now=10.0 * (n + 1))
        conn, reply = reattach(table, 0, secret_of(0))
        assert isinstance(reply, Reply), reply
    replies = [table.send(conn, msg) for msg in again]
    assert [(type(r), r.req_id, r.value) for r in replies] == [
        (Reply, ids[0], 5),
        (Reply, ids[1], b"new"),
        (Reply, ids[2], None),
        (Reply, ids[3], True),
    ]
    assert table.send(conn, lambda r: StoreAdd(r, "n", 0)).value == 5  # added once
    assert table.state.jobs["job"].store.kv == {"c": b"new", "s": b"later", "n": b"5"}


def test_reattach_without_the_members_secret_is_refused(tmp_path: Path) -> None:
    table, _ = formed_job(tmp_path)
    table.close()
    again = Table(tmp_path, now=10.0)
    _, reply = reattach(again, 1, b"a stranger's guess".ljust(32, b"\0"))
    assert isinstance(reply, ErrorReply)
    assert reply.code == ErrorCode.AUTHENTICATION
    assert "secret" in reply.message
    _, reply = reattach(again, 1, secret_of(1))  # the member itself is still taken back
    assert isinstance(reply, Reply)


def test_member_that_never_comes_back_is_declared_failed_to_the_others(tmp_path: Path) -> None:
    table, _ = formed_job(tmp_path)
    table.close()
    again = Table(tmp_path, now=10.0)
    conn, reply = reattach(again, 0, secret_of(0))
    assert isinstance(reply, Reply)
    beat(again, conn, MIN_REATTACH_WINDOW / 2)
    assert not any(isinstance(m, MemberFailed) for m in again.inbox[conn])
    beat(again, conn, MIN_REATTACH_WINDOW)
    failed = [m for m in again.inbox[conn] if isinstance(m, MemberFailed)]
    assert [(f.rank, f.host, f.pid) for f in failed] == [(1, "host1", 101)]
    assert "did not come back" in failed[0].reason
    # The verdict is durable too, and a member back late hears it at once.
    again.close()
    third = Table(tmp_path, now=50.0)
    _, reply = reattach(third, 1, secret_of(1))
    assert isinstance(reply, ErrorReply)
    assert reply.code == ErrorCode.RANK_FAILED
    conn, _ = reattach(third, 0, secret_of(0))
    assert isinstance(third.inbox[conn][0], Reply)  # taken back, then told
    assert isinstance(third.inbox[conn][-1], MemberFailed)
    assert third.inbox[conn][-1].rank == 1


def test_member_back_late_hears_every_failure_of_its_job(tmp_path: Path) -> None:
    table = Table(tmp_path)
    conns = [join(table, r, world=3) for r in range(3)]
    assert all(isinstance(table.inbox[c][-1], Welcome) for c in conns)
    table.close()
    again = Table(tmp_path, now=10.0)
    conn, _ = reattach(again, 0, secret_of(0), world=3)
    beat(again, conn, MIN_REATTACH_WINDOW * 1.5)  # ranks 1 and 2 never come back
    told = [m for m in again.inbox[conn] if isinstance(m, MemberFailed | MembersFailed)]
    # The first at once, the second with the failures of its interval.
    assert [type(m) for m in told] == [MemberFailed, MembersFailed]
    again.close()
    third = Table(tmp_path, now=60.0)
    conn, _ = reattach(third, 0, secret_of(0), world=3)
    reply, notice = third.inbox[conn]
    assert isinstance(reply, Reply)
    assert isinstance(notice, MembersFailed)  # both, not only the first
    assert sorted(f.rank for f in decoded_failures(notice)) == [1, 2]


def test_without_state_dir_members_rebuild_their_job_and_the_store_is_empty() -> None:
    table = Table(None)
    conn0, reply = reattach(table, 0, secret_of(0))
    assert isinstance(reply, Reply)
    job = table.state.jobs["job"]
    assert job.complete
    assert job.store.kv == {}
    _, reply = reattach(table, 1, secret_of(1))
    assert isinstance(reply, Reply)
    _, reply = reattach(table, 1, secret_of(1))  # taken: a second claim is a stranger's
    assert isinstance(reply, Reply) or reply.code == ErrorCode.AUTHENTICATION
    assert table.send(conn0, lambda r: Barrier(r, 7, 60.0)) is not None


def test_torn_log_tail_replays_up_to_the_last_acknowledged_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table, _ = formed_job(tmp_path)
    table.send(table.connect(), Heartbeat())
    table.close()
    log = tmp_path / "log"
    whole = log.read_bytes()
    extra = frame(encode_record(KeySet("job", "late", b"never whole")))
    log.write_bytes(whole + extra[:-3])  # a crash in the middle of a write
    with caplog.at_level(logging.WARNING):
        again = Table(tmp_path)
    assert again.state.jobs["job"].store.kv == {"kept": b"v1"}
    assert f"dropped the {len(extra) - 3} bytes after byte {len(whole)}" in caplog.text


def _state_files(path: Path, snapshot: list[Any], log: list[Any], number: int = 1) -> None:
    """A snapshot and a log holding these records, every one of them acknowledged."""
    for name, records in (("snapshot", snapshot), ("log", log)):
        body = b"".join(frame(encode_record(r)) for r in records)
        length = len(file_header(0, 0)) + len(body)
        (path / name).write_bytes(file_header(number, length) + body)
        (path / name).chmod(0o600)


@pytest.mark.parametrize("damage", ["checksum", "bounds", "unknown job"])
def test_acknowledged_record_failing_its_checksum_or_bounds_refuses_the_start(
    tmp_path: Path, damage: str
) -> None:
    job = [JobFormed("j", 0, 1, 0), MemberAdded("j", 0, 0, "h", 1, [], 1.0, b"")]
    record = {
        "checksum": KeySet("j", "k", b"v"),
        "bounds": RankFailed("j", 1, "h", 1, "rank 1 of a job of 1"),
        "unknown job": KeySet("other", "k", b"v"),
    }[damage]
    first, last = KeySet("j", "a", b"1"), KeySet("j", "b", b"2")
    _state_files(tmp_path, job, [first, record, last])
    if damage == "checksum":
        data = bytearray((tmp_path / "log").read_bytes())
        data[-len(frame(encode_record(last))) - 2] ^= 1  # in the middle record's body
        (tmp_path / "log").write_bytes(bytes(data))
    with pytest.raises(StateDirError) as err:
        Table(tmp_path)
    message = str(err.value)
    at = len(file_header(0, 0)) + len(frame(encode_record(first)))
    assert f"{tmp_path / 'log'}: record 1 at byte {at} " in message, message
    assert ("fails its checksum" if damage == "checksum" else "is malformed") in message


def test_state_dir_held_by_one_server_at_a_time(tmp_path: Path) -> None:
    first = StateDir(tmp_path)
    with pytest.raises(StateDirError, match="in use by another aiodist server"):
        StateDir(tmp_path)
    first.close()
    second = StateDir(tmp_path)
    second.load(lambda rec: None, list)
    second.close()


def test_death_right_after_a_quiet_start_is_a_failure_not_a_stall(tmp_path: Path) -> None:
    # A server no member owed heartbeats to hears nothing while its clients start (torch's
    # import takes seconds): that silence is no stall, and a rank dying as soon as the job
    # formed is reported at once (it was held back as "away" for the re-attach window).
    table = Table(tmp_path)
    table.now += STALL_GAP + 5
    conns = [join(table, r) for r in range(2)]
    table.state.connection_lost(conns[1], table.now + 0.2, "connection reset")
    table.collect()
    assert any(isinstance(m, MemberFailed) for m in table.inbox[conns[0]])


def test_stalled_server_counts_a_dropped_member_as_away_not_failed(tmp_path: Path) -> None:
    table, conns = formed_job(tmp_path)
    table.now += STALL_GAP + 1  # the server's loop stood still (SIGSTOP)
    table.state.connection_lost(conns[1], table.now, "connection reset")
    table.collect()
    assert not any(isinstance(m, MemberFailed) for m in table.inbox[conns[0]])
    back, reply = reattach(table, 1, secret_of(1))
    assert isinstance(reply, Reply)
    beat(table, conns[0], 2 * MIN_REATTACH_WINDOW, back)
    assert not any(isinstance(m, MemberFailed) for m in table.inbox[conns[0]])


# --- a job that grew, and its newcomers, across a restart ----------------------------------

NEWCOMER = b"\x07" * 32


def grown_job(table: Table, name: str = "job", max_world: int = 4) -> tuple[list[int], int]:
    """A job formed with ranks 0 and 1, grown by a newcomer (rank 2)."""
    conns = [join(table, r, name=name, max_world=max_world) for r in range(2)]
    late = join(table, -1, name=name, max_world=max_world, secret=NEWCOMER)
    welcome = next(m for m in table.inbox[late] if isinstance(m, Welcome))
    assert (welcome.rank, welcome.world_size) == (2, 3)
    return conns, late


def test_grown_job_survives_a_restart_its_newcomer_included(tmp_path: Path) -> None:
    table = Table(tmp_path)
    _, late = grown_job(table)
    welcome = next(m for m in table.inbox[late] if isinstance(m, Welcome))
    assert welcome.restartable  # else the newcomer breaks its groups as soon as the daemon goes
    table.send(late, lambda r: StoreSet(r, "from-newcomer", b"n"))
    table.close()
    again = Table(tmp_path, now=10.0)
    job = again.state.jobs["job"]
    assert (job.world_size, job.store.kv) == (3, {"from-newcomer": b"n"})
    back = []
    # Each member re-attaches as its Welcome said: ranks 0 and 1 of 2, the newcomer of 3.
    for rank, world, secret in [(0, 2, secret_of(0)), (1, 2, secret_of(1)), (2, 3, NEWCOMER)]:
        conn, reply = reattach(again, rank, secret, world=world)
        assert isinstance(reply, Reply), (rank, reply)
        back.append(conn)
    # The job grows on: the next newcomer's view counts every change before the restart.
    fourth = join(again, -1, max_world=4, secret=b"\x09" * 32)
    views = [m for m in again.inbox[back[0]] if isinstance(m, MembersJoined)]
    assert [(v.epoch, v.world_size) for v in views] == [(2, 4)]
    beat(again, back[0], 2 * MIN_REATTACH_WINDOW, *back[1:], fourth)
    assert not any(isinstance(m, MemberFailed | MembersFailed) for m in again.inbox[back[0]])


@pytest.mark.parametrize("how", ["fails", "leaves"])
def test_newcomer_gone_replays_and_so_does_every_later_record_of_every_job(
    tmp_path: Path, how: str
) -> None:
    table = Table(tmp_path)
    _, late = grown_job(table, max_world=3)
    other = [join(table, r, name="jobB") for r in range(2)]
    if how == "fails":
        table.state.connection_lost(late, table.now, "connection reset")
        table.collect()
    else:
        table.send(late, lambda r: Leave(r))
    for i in range(200):
        table.send(other[i % 2], lambda r, i=i: StoreSet(r, f"k{i}", b"%d" % i))
    table.close()
    again = Table(tmp_path, now=10.0)
    assert again.state.jobs["jobB"].store.kv == {f"k{i}": b"%d" % i for i in range(200)}
    job = again.state.jobs["job"]
    assert job.world_size == 3
    if how == "fails":
        assert [f[0] for f in job.failures] == [2]
    else:
        assert list(job.left) == [2]
    _, reply = reattach(again, 2, NEWCOMER, world=3)
    assert isinstance(reply, ErrorReply)
    assert reply.code == (ErrorCode.RANK_FAILED if how == "fails" else ErrorCode.RENDEZVOUS)


# --- a damaged state directory is never silently accepted ----------------------------------


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _kept_keys(tmp_path: Path, keys: int = 100, restarts: int = 1) -> None:
    """A job that set ``keys`` keys, and ``restarts`` restarts since (each folds the log)."""
    table = Table(tmp_path)
    conns = [join(table, r) for r in range(2)]
    for i in range(keys):
        table.send(conns[i % 2], lambda r, i=i: StoreSet(r, f"key{i}", b"x" * 20))
    table.close()
    for _ in range(restarts):
        Table(tmp_path).close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_log_damaged_in_the_middle_refuses_to_start_and_keeps_the_evidence(
    tmp_path: Path, damage: str
) -> None:
    _kept_keys(tmp_path, restarts=0)
    log = tmp_path / "log"
    data = bytearray(log.read_bytes())
    middle = len(data) // 2
    if damage == "flip":
        data[middle] ^= 0x5A
    else:
        del data[middle:]
    log.write_bytes(bytes(data))
    before = _files(tmp_path)
    with pytest.raises(StateDirError) as err:
        Table(tmp_path)
    message = str(err.value)
    assert str(log) in message
    assert "damaged" in message
    assert _files(tmp_path) == before  # nothing overwritten, nothing folded away
    StateDir(tmp_path).close()  # the refused start let go of the directory


def test_snapshot_damaged_or_deleted_refuses_to_start(tmp_path: Path) -> None:
    _kept_keys(tmp_path, restarts=1)  # the keys are in the snapshot now
    snapshot = tmp_path / "snapshot"
    whole = snapshot.read_bytes()
    data = bytearray(whole)
    data[len(data) // 2] ^= 0x01
    snapshot.write_bytes(bytes(data))
    with pytest.raises(StateDirError, match="snapshot") as err:
        Table(tmp_path)
    assert "damaged" in str(err.value)
    snapshot.unlink()
    with pytest.raises(StateDirError, match="snapshot") as err:
        Table(tmp_path)
    assert "missing" in str(err.value)
    snapshot.write_bytes(whole)
    assert len(Table(tmp_path).state.jobs["job"].store.kv) == 100


# --- the state directory's files: no link followed, nothing but files, private -------------


def _started(state: Path) -> None:
    table = Table(state)
    conns = [join(table, r) for r in range(2)]
    table.send(conns[0], lambda r: StoreSet(r, "secret-value", b"do not leak"))
    table.close()


@pytest.mark.parametrize("name", ["log", "snapshot", "snapshot.tmp", "log.tmp"])
def test_symlink_in_the_state_dir_is_never_followed(tmp_path: Path, name: str) -> None:
    state = tmp_path / "state"
    _started(state)
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    (state / name).unlink(missing_ok=True)
    (state / name).symlink_to(outside)
    if name.endswith(".tmp"):  # left over: removed (the link, not what it points to)
        Table(state).close()
        assert not (state / name).is_symlink()
    else:
        with pytest.raises(StateDirError) as err:
            Table(state)
        assert f"{state / name} is a symbolic link" in str(err.value)
    assert outside.read_bytes() == b"precious"


def test_state_dir_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    _started(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(StateDirError, match="is a symbolic link"):
        StateDir(tmp_path / "link")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_log_that_is_not_a_file_is_refused_by_name_without_hanging(
    tmp_path: Path, kind: str
) -> None:
    _started(tmp_path)
    log = tmp_path / "log"
    log.unlink()
    if kind == "fifo":
        os.mkfifo(log)
    else:
        log.mkdir()
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            Table(tmp_path)
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=start, daemon=True)  # a FIFO opened to read blocks
    thread.start()
    thread.join(10)
    assert outcome, "the start hung on the log"
    assert isinstance(outcome[0], StateDirError), outcome
    assert str(log) in str(outcome[0])
    assert "not a regular file" in str(outcome[0])


def test_state_dir_and_its_files_are_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o777)
    state.chmod(0o777)
    _started(state)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    files = list(state.iterdir())
    assert files
    for p in files:
        assert stat.S_IMODE(p.lstat().st_mode) == 0o600, p


def test_state_dir_stays_locked_when_its_lock_file_is_deleted(tmp_path: Path) -> None:
    first = StateDir(tmp_path)
    for p in tmp_path.iterdir():
        if p.name == "lock":
            p.unlink()
    with pytest.raises(StateDirError, match="in use by another aiodist server"):
        StateDir(tmp_path)
    first.close()


# --- without a state directory: the first re-attachment of a rank wins ---------------------


def test_without_state_dir_the_first_reattachment_wins_and_the_real_rank_is_told_why() -> None:
    table = Table(None)
    _, reply = reattach(table, 0, secret_of(0))
    assert isinstance(reply, Reply)
    _, reply = reattach(table, 1, b"\x55" * 32)  # anyone holding the token, first
    assert isinstance(reply, Reply)
    _, reply = reattach(table, 1, secret_of(1))  # the real rank 1, second
    assert isinstance(reply, ErrorReply)
    assert reply.code == ErrorCode.AUTHENTICATION
    assert "without a state directory" in reply.message


def test_reattach_without_a_secret_is_refused() -> None:
    table = Table(None)
    _, reply = reattach(table, 0, b"")
    assert isinstance(reply, ErrorReply)
    assert reply.code == ErrorCode.AUTHENTICATION
    assert "secret" in reply.message


def test_a_message_not_declared_durable_may_not_change_durable_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table, conns = formed_job(tmp_path)
    table.send(conns[0], lambda r: StoreGet(r, "kept", 1.0))  # reads: no record, no complaint
    monkeypatch.setattr(StoreSet, "DURABLE", False)  # as if its declaration forgot it
    with pytest.raises(AssertionError, match=r"StoreSet changed durable state: declare it"):
        table.send(conns[0], lambda r: StoreSet(r, "k", b"v"))
