"""Sans-IO tests of the rendezvous server's job table: messages and fake time in, actions out."""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from typing import Any, cast

import msgpack
import pytest

from aiodist._errors import ErrorCode
from aiodist._server.notices import FAILURE_NOTICE_INTERVAL
from aiodist._server.parts import Close, ConnId, Send
from aiodist._server.state import JobTable
from aiodist._server.traffic import HISTORY_INTERVAL, HISTORY_POINTS
from aiodist._wire.frame import FrameDecoder, encode_message, frame_message
from aiodist._wire.messages import (
    Barrier,
    ErrorReply,
    Heartbeat,
    Join,
    Leave,
    MemberFailed,
    MembersFailed,
    MembersLeft,
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
    pack_keys,
)

LONG = 1000.0  # a heartbeat or join timeout that no test reaches unless it means to


def host_of(rank: int) -> str:
    return f"node{rank % 2}"


def pid_of(rank: int) -> int:
    return 1000 + rank


def addresses_of(rank: int) -> list[str]:
    return [f"tcp://10.0.0.{rank % 2}:{5000 + rank}", f"uds:///tmp/aiodist-{rank}.sock"]


class FakeServer:
    """A ``JobTable`` with a fake clock that sorts its actions into per-connection inboxes."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.state = JobTable(now)
        self.inbox: dict[ConnId, list[Any]] = defaultdict(list)
        self.closed: dict[ConnId, list[str]] = defaultdict(list)
        self._conn_ids = itertools.count(1)
        self._req_ids = itertools.count(1)

    # --- inputs -------------------------------------------------------------------

    def connect(self) -> ConnId:
        conn = next(self._conn_ids)
        self.state.connection_made(conn, f"127.0.0.1:{40000 + conn}", self.now)
        self._collect()
        return conn

    def send(self, conn: ConnId, msg: Any) -> None:
        self.state.receive(conn, msg, self.now)
        self._collect()

    def call(self, conn: ConnId, cls: type[Any], *args: Any) -> int:
        """Send ``cls(req_id, *args)`` on ``conn``; return the fresh req_id."""
        req_id = next(self._req_ids)
        self.send(conn, cls(req_id, *args))
        return req_id

    def join(
        self,
        group: str = "job",
        world_size: int = 2,
        rank: int = -1,
        *,
        host: str = "node0",
        pid: int = 1,
        addresses: list[str] | None = None,
        heartbeat_timeout: float = LONG,
        timeout: float = LONG,
        conn: ConnId | None = None,
        generation: int = 0,
    ) -> ConnId:
        """Join from a new connection (or ``conn``); return the connection."""
        if conn is None:
            conn = self.connect()
        self.call(
            conn,
            Join,
            group,
            world_size,
            rank,
            host,
            pid,
            addresses if addresses is not None else [f"tcp://{host}:{pid}"],
            heartbeat_timeout,
            timeout,
            generation,
        )
        return conn

    def form(
        self, world_size: int, group: str = "job", heartbeat_timeout: float = LONG
    ) -> list[ConnId]:
        """Form a job with explicit ranks; return its connections in rank order."""
        conns = [
            self.join(
                group,
                world_size,
                rank,
                host=host_of(rank),
                pid=pid_of(rank),
                addresses=addresses_of(rank),
                heartbeat_timeout=heartbeat_timeout,
            )
            for rank in range(world_size)
        ]
        for rank, conn in enumerate(conns):
            assert self.only(conn, Welcome).rank == rank
        return conns

    def table(self, conn: ConnId) -> list[list[Any]]:
        """The member table as ``conn``'s member fetches it (decoded as a client would)."""
        req_id = self.call(conn, MembersRequest)
        reply = self.only(conn, Reply)
        assert reply.req_id == req_id
        assert isinstance(reply.value, Packed)
        return cast("list[list[Any]]", msgpack.unpackb(reply.value.data))

    def welcome(self, conn: ConnId) -> Welcome:
        """The one message waiting on ``conn``, a Welcome, decoded as a client would."""
        dec = FrameDecoder()
        dec.receive_data(b"".join(encode_message(self.only(conn, Welcome))))
        welcome = frame_message(dec.next_event())  # type: ignore[arg-type]
        assert isinstance(welcome, Welcome)
        return welcome

    def left(self, conn: ConnId) -> list[list[Any]]:
        """The members named by the one message waiting on ``conn``, a ``MembersLeft``."""
        notice = self.only(conn, MembersLeft)
        assert isinstance(notice.members, Packed)  # encoded once for every member
        return cast("list[list[Any]]", msgpack.unpackb(notice.members.data))

    def heartbeat(self, *conns: ConnId) -> None:
        for conn in conns:
            self.send(conn, Heartbeat())

    def lose(self, conn: ConnId, reason: str = "connection lost") -> None:
        self.state.connection_lost(conn, self.now, reason)
        self._collect()

    def advance(self, to: float) -> None:
        """Move the clock to ``to``, firing every deadline on the way as serve.py would."""
        assert to >= self.now
        while (deadline := self.state.next_deadline()) is not None and deadline <= to:
            self.now = max(self.now, deadline)
            self.state.handle_timeouts(self.now)
            self._collect()
        self.now = to
        self.state.handle_timeouts(to)
        self._collect()

    # --- outputs ------------------------------------------------------------------

    def take(self, conn: ConnId) -> list[Any]:
        msgs, self.inbox[conn] = self.inbox[conn], []
        return msgs

    def only(self, conn: ConnId, cls: type[Any]) -> Any:
        """Take the one message waiting on ``conn``, which must be a ``cls``."""
        msgs = self.take(conn)
        assert len(msgs) == 1, msgs
        assert isinstance(msgs[0], cls), msgs[0]
        return msgs[0]

    def error(self, conn: ConnId, req_id: int, code: ErrorCode) -> ErrorReply:
        err: ErrorReply = self.only(conn, ErrorReply)
        assert (err.req_id, ErrorCode(err.code)) == (req_id, code), err
        return err

    def reply(self, conn: ConnId, req_id: int) -> Any:
        msg = self.only(conn, Reply)
        assert msg.req_id == req_id, msg
        return msg.value

    def quiet(self) -> bool:
        return not any(self.inbox.values()) and not any(self.closed.values())

    def _collect(self) -> None:
        for action in self.state.take_actions():
            if isinstance(action, Send):
                self.inbox[action.conn].append(action.msg)
            else:
                assert isinstance(action, Close)
                self.closed[action.conn].append(action.reason)


@pytest.fixture
def srv() -> FakeServer:
    return FakeServer()


# --- forming a job --------------------------------------------------------------------


@pytest.mark.parametrize("world_size", range(1, 9))
def test_join_explicit_ranks_welcome_everyone_once_after_last_join(world_size: int) -> None:
    srv = FakeServer()
    order = random.Random(world_size).sample(range(world_size), world_size)
    conn_of: dict[int, ConnId] = {}
    join_req: dict[int, int] = {}
    for i, rank in enumerate(order):
        assert srv.quiet(), f"a message went out before member {i + 1} of {world_size} joined"
        conn = conn_of[rank] = srv.connect()
        join_req[rank] = srv.call(
            conn,
            Join,
            "job",
            world_size,
            rank,
            host_of(rank),
            pid_of(rank),
            addresses_of(rank),
            LONG,
            LONG,
        )

    table = [[r, r // 2, host_of(r), pid_of(r), addresses_of(r)] for r in range(world_size)]
    for rank, conn in conn_of.items():
        welcome = srv.only(conn, Welcome)
        assert welcome.req_id == join_req[rank]
        assert (welcome.rank, welcome.world_size) == (rank, world_size)
        assert welcome.local_rank == rank // 2
        assert welcome.local_size == len(range(rank % 2, world_size, 2))
        assert srv.table(conn) == table
    assert srv.quiet()
    assert srv.state.jobs["job"].complete


@pytest.mark.parametrize(
    ("hosts", "expected_ranks"),
    [
        # hosts in join order -> rank each member gets, in join order
        (["hB", "hA", "hB", "hA"], [0, 2, 1, 3]),
        (["h1", "h2", "h1", "h2", "h1", "h2", "h1", "h2"], [0, 4, 1, 5, 2, 6, 3, 7]),
        (["h1", "h2", "h1", "h2", "h1"], [0, 3, 1, 4, 2]),
        (["c", "a", "b", "a", "c", "b"], [0, 2, 4, 3, 1, 5]),
    ],
)
def test_join_automatic_ranks_contiguous_per_host_in_first_join_order(
    srv: FakeServer, hosts: list[str], expected_ranks: list[int]
) -> None:
    world_size = len(hosts)
    conns = [
        srv.join(world_size=world_size, host=host, pid=100 + i) for i, host in enumerate(hosts)
    ]
    welcomes = [srv.only(conn, Welcome) for conn in conns]
    tables = [srv.table(conn) for conn in conns]
    assert [w.rank for w in welcomes] == expected_ranks
    host_of_rank = {rank: hosts[i] for i, rank in enumerate(expected_ranks)}
    for i, w in enumerate(welcomes):
        same_host = sorted(r for r, h in host_of_rank.items() if h == hosts[i])
        assert same_host == list(range(same_host[0], same_host[0] + len(same_host)))
        assert w.local_rank == same_host.index(w.rank)
        assert w.local_size == len(same_host)
        assert tables[i] == tables[0]
    assert [row[0] for row in tables[0]] == list(range(world_size))
    for i, rank in enumerate(expected_ranks):
        _, local_rank, host, pid, _ = tables[0][rank]
        assert (host, pid, local_rank) == (hosts[i], 100 + i, welcomes[i].local_rank)


def test_join_mixed_explicit_and_automatic_ranks_fills_free_ranks(srv: FakeServer) -> None:
    # (rank asked for, host): explicit ranks are kept, automatic ones fill 1, 2, 3 by host.
    joins = [(-1, "h1"), (0, "h2"), (-1, "h1"), (-1, "h2"), (4, "h1")]
    conns = [
        srv.join(world_size=5, rank=rank, host=host, pid=10 + i)
        for i, (rank, host) in enumerate(joins)
    ]
    welcomes = [srv.welcome(conn) for conn in conns]
    assert [w.rank for w in welcomes] == [1, 0, 2, 3, 4]
    # Hosts by rank: h2 h1 h1 h2 h1 (ids in the order hosts first appear by rank).
    assert all(w.host_runs == [[0, 1], [1, 2], [0, 1, 2]] for w in welcomes)
    assert all(w.host_ids() == [0, 1, 1, 0, 1] for w in welcomes)
    assert [(w.local_rank, w.local_size) for w in welcomes] == [
        (0, 3),
        (0, 2),
        (1, 3),
        (1, 2),
        (2, 3),
    ]
    assert [row[:4] for row in srv.table(conns[0])] == [
        [0, 0, "h2", 11],
        [1, 0, "h1", 10],
        [2, 1, "h1", 12],
        [3, 1, "h2", 13],
        [4, 2, "h1", 14],
    ]


# --- conflicts leave the job intact ---------------------------------------------------


def test_join_duplicate_explicit_rank_rejected_with_holder_details(srv: FakeServer) -> None:
    a = srv.join(world_size=3, rank=0, host="alpha", pid=111)
    b = srv.connect()
    req = srv.call(b, Join, "job", 3, 0, "beta", 222, [], LONG, LONG)
    err = srv.error(b, req, ErrorCode.DUPLICATE_RANK)
    assert err.details == {"rank": 0, "host": "alpha", "pid": 111}
    assert "rank 0" in err.message
    assert len(srv.state.jobs["job"].members) == 1
    assert srv.quiet()

    srv.join(world_size=3, rank=1, host="beta", pid=222, conn=b)  # same connection, right rank
    c = srv.join(world_size=3, rank=2, host="gamma", pid=333)
    assert [srv.only(conn, Welcome).rank for conn in (a, b, c)] == [0, 1, 2]


def test_join_world_size_mismatch_fails_every_forming_member_and_drops_the_job(
    srv: FakeServer,
) -> None:
    a = srv.join(world_size=3, rank=0, host="alpha", pid=111)
    waiting = srv.join(world_size=3, rank=-1, host="alpha", pid=112)
    a_join = 1  # the first request on the table
    get = srv.call(waiting, StoreGet, "never-set", LONG)  # a forming member's store wait
    b = srv.connect()
    req = srv.call(b, Join, "job", 2, 1, "beta", 222, [], LONG, LONG)
    err = srv.error(b, req, ErrorCode.WORLD_SIZE_MISMATCH)
    assert err.details == {"world_sizes": [3, 2]}
    assert "2 joined with 3 (the first: pid 111 on host alpha)" in err.message
    assert "pid 222 on host beta with 2" in err.message
    assert "same world size" in err.message
    # Every member waiting gets the same error, at once, on its join (and its waits).
    assert srv.error(a, a_join, ErrorCode.WORLD_SIZE_MISMATCH) == ErrorReply(
        a_join, err.code, err.message, err.details
    )
    msgs = srv.take(waiting)
    assert [(m.req_id, m.message) for m in msgs] == [(2, err.message), (get, err.message)]
    assert srv.state.jobs == {}
    srv.advance(2 * LONG)  # no join deadline or wait is left to fire
    assert srv.quiet()

    # The name is free again: a job of either size can form under it.
    c, d = srv.join(world_size=2, rank=0), srv.join(world_size=2, rank=1)
    assert [srv.only(conn, Welcome).world_size for conn in (c, d)] == [2, 2]


def test_join_world_size_mismatch_leaves_a_complete_job_untouched(srv: FakeServer) -> None:
    a, _ = srv.form(2)
    c = srv.connect()
    req = srv.call(c, Join, "job", 3, 1, "node9", 9, [], LONG, LONG)
    err = srv.error(c, req, ErrorCode.WORLD_SIZE_MISMATCH)
    assert err.details == {"world_sizes": [2, 3]}
    assert "running with world_size 2" in err.message
    assert "asked for 3" in err.message
    assert srv.quiet()
    req = srv.call(a, StoreSet, "k", b"v")
    assert srv.reply(a, req) is None
    assert len(srv.state.jobs["job"].members) == 2


def test_join_rank_taken_in_a_complete_job_names_the_rank_and_its_holder(
    srv: FakeServer,
) -> None:
    srv.form(2)
    c = srv.connect()
    req = srv.call(c, Join, "job", 2, 1, "node9", 9, [], LONG, LONG)
    err = srv.error(c, req, ErrorCode.DUPLICATE_RANK)
    assert err.details == {"rank": 1, "host": host_of(1), "pid": pid_of(1)}
    assert f"rank 1 of job 'job' is already taken by pid {pid_of(1)} on host {host_of(1)}" in (
        err.message
    )


def test_join_complete_job_rejected_job_full(srv: FakeServer) -> None:
    a, b = srv.form(2)
    c = srv.connect()
    req = srv.call(c, Join, "job", 2, -1, "node9", 9, [], LONG, LONG)
    srv.error(c, req, ErrorCode.JOB_FULL)
    assert srv.quiet()
    job = srv.state.jobs["job"]
    assert [m.rank for m in job.by_rank] == [0, 1]
    assert len(job.members) == 2
    # the job works as before
    srv.call(a, StoreSet, "k", b"v")
    srv.only(a, Reply)
    req = srv.call(b, StoreGet, "k", 5.0)
    assert srv.reply(b, req) == b"v"


@pytest.mark.parametrize(
    ("group", "world_size", "rank", "heartbeat_timeout", "n_addresses"),
    [
        pytest.param("job", 0, -1, LONG, 1, id="world_size_0"),
        pytest.param("job", 2, 2, LONG, 1, id="rank_eq_world_size"),
        pytest.param("job", 2, 7, LONG, 1, id="rank_gt_world_size"),
        pytest.param("job", 2, -2, LONG, 1, id="rank_below_minus_one"),
        pytest.param("", 2, 1, LONG, 1, id="empty_group_name"),
        pytest.param("job", 2, 1, 0.0, 1, id="heartbeat_timeout_0"),
        pytest.param("job", 2, 1, LONG, 65, id="too_many_addresses"),
    ],
)
def test_join_invalid_request_bad_request_and_job_still_forms(
    srv: FakeServer,
    group: str,
    world_size: int,
    rank: int,
    heartbeat_timeout: float,
    n_addresses: int,
) -> None:
    a = srv.join(world_size=2, rank=0)
    b = srv.connect()
    addresses = [f"tcp://h:{i}" for i in range(n_addresses)]
    req = srv.call(b, Join, group, world_size, rank, "node1", 2, addresses, heartbeat_timeout, LONG)
    srv.error(b, req, ErrorCode.BAD_REQUEST)
    assert list(srv.state.jobs) == ["job"]
    assert len(srv.state.jobs["job"].members) == 1
    assert srv.quiet()

    srv.join(world_size=2, rank=1, conn=b)
    assert srv.only(a, Welcome).rank == 0
    assert srv.only(b, Welcome).rank == 1


def test_join_invalid_first_request_creates_no_job(srv: FakeServer) -> None:
    conn = srv.connect()
    req = srv.call(conn, Join, "job", 0, -1, "node0", 1, [], LONG, LONG)
    srv.error(conn, req, ErrorCode.BAD_REQUEST)
    assert srv.state.jobs == {}


@pytest.mark.parametrize("complete", [False, True])
def test_join_second_time_on_same_connection_bad_request(srv: FakeServer, complete: bool) -> None:
    a = srv.join(world_size=2, rank=0)
    if complete:
        b = srv.join(world_size=2, rank=1)
        srv.only(a, Welcome)
        srv.only(b, Welcome)
    req = srv.call(a, Join, "job", 2, 1, "node0", 1, [], LONG, LONG)
    err = srv.error(a, req, ErrorCode.BAD_REQUEST)
    assert "already joined" in err.message
    job = srv.state.jobs["job"]
    assert len(job.members) == (2 if complete else 1)
    assert next(iter(job.members)).conn == a
    if not complete:
        b = srv.join(world_size=2, rank=1)
        assert srv.only(a, Welcome).rank == 0
        assert srv.only(b, Welcome).rank == 1


@pytest.mark.parametrize(
    "msg",
    [
        StoreSet(7, "k", b"v"),
        StoreGet(7, "k", 1.0),
        StoreAdd(7, "k", 1),
        StoreWait(7, pack_keys(["k"]), 1.0),
        StoreCompareSet(7, "k", b"", b"v"),
        StoreDeleteKey(7, "k"),
        StoreNumKeys(7),
        StoreCheck(7, ["k"]),
        Barrier(7, 0, 1.0),
    ],
    ids=lambda msg: type(msg).__name__,
)
def test_store_op_before_join_not_joined(srv: FakeServer, msg: Any) -> None:
    conn = srv.connect()
    srv.send(conn, msg)
    err = srv.error(conn, 7, ErrorCode.NOT_JOINED)
    assert type(msg).__name__ in err.message
    assert srv.state.jobs == {}


def test_store_op_after_leave_not_joined(srv: FakeServer) -> None:
    a, b = srv.form(2)
    req = srv.call(a, Leave)
    assert srv.reply(a, req) is None
    assert srv.left(b) == [[0, host_of(0), pid_of(0)]]
    req = srv.call(a, StoreSet, "k", b"v")
    srv.error(a, req, ErrorCode.NOT_JOINED)


def test_leave_before_join_replies_none(srv: FakeServer) -> None:
    conn = srv.connect()
    req = srv.call(conn, Leave)
    assert srv.reply(conn, req) is None


def test_server_to_client_message_from_client_bad_request(srv: FakeServer) -> None:
    a, _ = srv.form(2)
    srv.send(a, Reply(5, None))
    srv.error(a, 5, ErrorCode.BAD_REQUEST)


# --- key-value store ------------------------------------------------------------------


def test_store_set_then_get_returns_value(srv: FakeServer) -> None:
    a, b = srv.form(2)
    req = srv.call(a, StoreSet, "k", b"hello")
    assert srv.reply(a, req) is None
    req = srv.call(b, StoreGet, "k", 5.0)
    assert srv.reply(b, req) == b"hello"
    req = srv.call(a, StoreSet, "k", b"again")
    srv.only(a, Reply)
    req = srv.call(a, StoreGet, "k", 5.0)
    assert srv.reply(a, req) == b"again"


def test_store_works_while_job_is_forming(srv: FakeServer) -> None:
    a = srv.join(world_size=3)
    req = srv.call(a, StoreSet, "k", b"v")
    assert srv.reply(a, req) is None
    b = srv.join(world_size=3)
    req = srv.call(b, StoreGet, "k", 5.0)
    assert srv.reply(b, req) == b"v"


def test_store_get_missing_key_replies_only_once_another_member_sets_it(
    srv: FakeServer,
) -> None:
    a, b = srv.form(2)
    get_req = srv.call(a, StoreGet, "k", 30.0)
    srv.call(b, StoreSet, "other", b"x")
    srv.only(b, Reply)
    srv.advance(10.0)
    assert srv.take(a) == []
    set_req = srv.call(b, StoreSet, "k", b"v")
    assert srv.reply(b, set_req) is None
    assert srv.reply(a, get_req) == b"v"
    srv.advance(60.0)  # the get's deadline passes: no second answer
    assert srv.quiet()


def test_store_get_several_waiters_all_released(srv: FakeServer) -> None:
    a, b, c = srv.form(3)
    reqs = [srv.call(a, StoreGet, "k", 30.0), srv.call(b, StoreGet, "k", 30.0)]
    srv.call(c, StoreSet, "k", b"v")
    srv.only(c, Reply)
    assert srv.reply(a, reqs[0]) == b"v"
    assert srv.reply(b, reqs[1]) == b"v"


def test_store_get_times_out_at_deadline_not_before(srv: FakeServer) -> None:
    a, b = srv.form(2)
    srv.advance(1.5)
    req = srv.call(a, StoreGet, "missing/key", 5.0)
    assert srv.state.next_deadline() is not None
    srv.advance(6.4375)
    assert srv.quiet()
    srv.advance(6.5)
    err = srv.error(a, req, ErrorCode.TIMEOUT)
    assert "missing/key" in err.message
    assert err.details == {"keys": ["missing/key"]}
    srv.call(b, StoreSet, "missing/key", b"late")
    srv.only(b, Reply)
    assert srv.take(a) == []  # a timed-out get is not answered again


def test_store_get_timeout_deadline_reported_by_next_deadline(srv: FakeServer) -> None:
    conn = srv.join(world_size=1)
    srv.only(conn, Welcome)
    srv.call(conn, StoreGet, "k", 0.25)  # sooner than the first heartbeat sweep
    assert srv.state.next_deadline() == 0.25


def test_store_get_nonpositive_timeout_bad_request(srv: FakeServer) -> None:
    a, _ = srv.form(2)
    req = srv.call(a, StoreGet, "k", 0.0)
    srv.error(a, req, ErrorCode.BAD_REQUEST)


def test_store_add_returns_new_value_stored_as_decimal_ascii(srv: FakeServer) -> None:
    a, b = srv.form(2)
    req = srv.call(a, StoreAdd, "n", 1)
    assert srv.reply(a, req) == 1
    req = srv.call(b, StoreAdd, "n", 2)
    assert srv.reply(b, req) == 3
    req = srv.call(a, StoreGet, "n", 5.0)
    assert srv.reply(a, req) == b"3"
    req = srv.call(a, StoreAdd, "n", -5)
    assert srv.reply(a, req) == -2
    req = srv.call(a, StoreGet, "n", 5.0)
    assert srv.reply(a, req) == b"-2"


def test_store_add_on_value_set_as_decimal_ascii(srv: FakeServer) -> None:
    a, _ = srv.form(2)
    srv.call(a, StoreSet, "n", b"40")
    srv.only(a, Reply)
    req = srv.call(a, StoreAdd, "n", 2)
    assert srv.reply(a, req) == 42
    req = srv.call(a, StoreAdd, "n", 0)
    assert srv.reply(a, req) == 42


def test_store_add_non_integer_value_bad_request_value_unchanged(srv: FakeServer) -> None:
    a, _ = srv.form(2)
    srv.call(a, StoreSet, "k", b"abc")
    srv.only(a, Reply)
    req = srv.call(a, StoreAdd, "k", 1)
    err = srv.error(a, req, ErrorCode.BAD_REQUEST)
    assert "'k'" in err.message
    req = srv.call(a, StoreGet, "k", 5.0)
    assert srv.reply(a, req) == b"abc"


def test_store_add_wakes_waiting_get(srv: FakeServer) -> None:
    a, b = srv.form(2)
    req = srv.call(a, StoreGet, "n", 30.0)
    srv.call(b, StoreAdd, "n", 5)
    assert srv.only(b, Reply).value == 5
    assert srv.reply(a, req) == b"5"


def test_store_wait_several_keys_released_only_when_last_is_set(srv: FakeServer) -> None:
    a, b = srv.form(2)
    req = srv.call(a, StoreWait, pack_keys(["x", "y", "z"]), 30.0)
    for key in ("y", "x"):
        srv.call(b, StoreSet, key, b"1")
        srv.only(b, Reply)
        assert srv.take(a) == []
    srv.call(b, StoreSet, "y", b"2")  # setting a key again releases nothing more
    srv.only(b, Reply)
    assert srv.take(a) == []
    srv.call(b, StoreSet, "z", b"1")
    srv.only(b, Reply)
    assert srv.reply(a, req) is None
    srv.advance(60.0)
    assert srv.quiet()


def test_store_waits_on_the_same_keys_share_one_watch_and_time_out_alone(
    srv: FakeServer,
) -> None:
    a, b, c = srv.form(3)
    keys = ["k0", "k1", "k2"]
    short = srv.call(a, StoreWait, pack_keys(keys), 2.0)
    longer = [srv.call(conn, StoreWait, pack_keys(keys), 30.0) for conn in (b, c)]
    job = srv.state.jobs["job"]
    parked = [w for ws in job.store.key_waiters.values() for w in ws]
    assert len(parked) == 1  # one watch, checked once per set, whoever waits on it
    assert len(parked[0].followers) == 2
    srv.call(c, StoreSet, "k1", b"1")
    srv.only(c, Reply)
    srv.advance(2.0)  # the first request gives up; the others still wait on the watch
    srv.error(a, short, ErrorCode.TIMEOUT)
    for key in ("k0", "k2"):
        srv.call(c, StoreSet, key, b"1")
    assert srv.reply(b, longer[0]) is None
    replies = srv.take(c)
    assert [m.req_id for m in replies if isinstance(m, Reply)][-1] == longer[1]
    assert job.store.watches == {}
    assert srv.take(a) == []
    # A later wait on the same keys is answered at once, not parked.
    again = srv.call(a, StoreWait, pack_keys(keys), 5.0)
    assert srv.reply(a, again) is None


def test_store_wait_present_keys_replies_at_once(srv: FakeServer) -> None:
    a, _ = srv.form(2)
    srv.call(a, StoreSet, "x", b"1")
    srv.only(a, Reply)
    req = srv.call(a, StoreWait, pack_keys(["x"]), 5.0)
    assert srv.reply(a, req) is None


def test_store_wait_times_out_naming_missing_keys(srv: FakeServer) -> None:
    a, b = srv.form(2)
    req = srv.call(a, StoreWait, pack_keys(["x", "y"]), 4.0)
    srv.call(b, StoreSet, "x", b"1")
    srv.only(b, Reply)
    srv.advance(3.9375)
    assert srv.take(a) == []
    srv.advance(4.0)
    err = srv.error(a, req, ErrorCode.TIMEOUT)
    assert err.details == {"keys": ["y"]}
    assert "'y'" in err.message
    srv.call(b, StoreSet, "y", b"1")
    srv.only(b, Reply)
    assert srv.take(a) == []


@pytest.mark.parametrize(
    ("initial", "expected", "desired", "returned", "stored"),
    [
        pytest.param(None, b"", b"new", b"new", b"new", id="missing_key_empty_expected_sets"),
        pytest.param(b"old", b"old", b"new", b"new", b"new", id="match_sets_desired"),
        pytest.param(b"old", b"other", b"new", b"old", b"old", id="mismatch_returns_current"),
        pytest.param(None, b"exp", b"new", b"exp", None, id="missing_key_returns_expected"),
        pytest.param(b"", b"", b"new", b"new", b"new", id="empty_value_matches_empty"),
    ],
)
def test_store_compare_set_follows_tcpstore(
    srv: FakeServer,
    initial: bytes | None,
    expected: bytes,
    desired: bytes,
    returned: bytes,
    stored: bytes | None,
) -> None:
    a, _ = srv.form(2)
    if initial is not None:
        srv.call(a, StoreSet, "k", initial)
        srv.only(a, Reply)
    req = srv.call(a, StoreCompareSet, "k", expected, desired)
    assert srv.reply(a, req) == returned
    req = srv.call(a, StoreCheck, ["k"])
    assert srv.reply(a, req) is (stored is not None)
    if stored is not None:
        req = srv.call(a, StoreGet, "k", 5.0)
        assert srv.reply(a, req) == stored


def test_store_compare_set_wakes_waiting_get(srv: FakeServer) -> None:
    a, b = srv.form(2)
    req = srv.call(a, StoreGet, "k", 30.0)
    srv.call(b, StoreCompareSet, "k", b"", b"v")
    srv.only(b, Reply)
    assert srv.reply(a, req) == b"v"


def test_store_delete_key_reports_whether_key_existed(srv: FakeServer) -> None:
    a, _ = srv.form(2)
    srv.call(a, StoreSet, "k", b"v")
    srv.only(a, Reply)
    req = srv.call(a, StoreDeleteKey, "k")
    assert srv.reply(a, req) is True
    req = srv.call(a, StoreDeleteKey, "k")
    assert srv.reply(a, req) is False
    req = srv.call(a, StoreCheck, ["k"])
    assert srv.reply(a, req) is False
    srv.call(a, StoreGet, "k", 5.0)
    assert srv.take(a) == []  # a deleted key is missing again: get waits


def test_store_num_keys_counts_keys(srv: FakeServer) -> None:
    a, b = srv.form(2)
    req = srv.call(a, StoreNumKeys)
    assert srv.reply(a, req) == 0
    for key in ("x", "y", "x"):
        srv.call(b, StoreSet, key, b"1")
        srv.only(b, Reply)
    srv.call(b, StoreAdd, "n", 1)
    srv.only(b, Reply)
    req = srv.call(a, StoreNumKeys)
    assert srv.reply(a, req) == 3
    srv.call(a, StoreDeleteKey, "x")
    srv.only(a, Reply)
    req = srv.call(a, StoreNumKeys)
    assert srv.reply(a, req) == 2


def test_store_check_true_only_when_every_key_present(srv: FakeServer) -> None:
    a, _ = srv.form(2)
    srv.call(a, StoreSet, "x", b"1")
    srv.only(a, Reply)
    req = srv.call(a, StoreCheck, ["x"])
    assert srv.reply(a, req) is True
    req = srv.call(a, StoreCheck, ["x", "y"])
    assert srv.reply(a, req) is False
    srv.call(a, StoreSet, "y", b"1")
    srv.only(a, Reply)
    req = srv.call(a, StoreCheck, ["x", "y"])
    assert srv.reply(a, req) is True


# --- barrier --------------------------------------------------------------------------


def test_barrier_replies_to_all_only_when_every_rank_arrived(srv: FakeServer) -> None:
    conns = srv.form(4)
    reqs = {}
    for conn in conns[:3]:
        reqs[conn] = srv.call(conn, Barrier, 1, 30.0)
        assert srv.quiet()
    reqs[conns[3]] = srv.call(conns[3], Barrier, 1, 30.0)
    for conn in conns:
        assert srv.reply(conn, reqs[conn]) is None
    srv.advance(60.0)
    assert srv.quiet()


def test_barrier_timeout_names_missing_ranks_and_late_arrival_gets_same_error(
    srv: FakeServer,
) -> None:
    conns = srv.form(4)
    reqs = {rank: srv.call(conns[rank], Barrier, 3, 5.0) for rank in (0, 2)}
    srv.advance(4.9375)
    assert srv.quiet()
    srv.advance(5.0)
    errors = [srv.error(conns[rank], reqs[rank], ErrorCode.TIMEOUT) for rank in (0, 2)]
    for err in errors:
        assert err.details == {"missing": [1, 3]}
        assert err.message == errors[0].message
    assert "[1, 3]" in errors[0].message

    late = srv.call(conns[1], Barrier, 3, 5.0)
    err = srv.error(conns[1], late, ErrorCode.TIMEOUT)
    assert (err.message, err.details) == (errors[0].message, {"missing": [1, 3]})
    srv.advance(20.0)
    assert srv.quiet()


def test_barrier_different_seqs_independent(srv: FakeServer) -> None:
    a, b = srv.form(2)
    a1 = srv.call(a, Barrier, 1, 30.0)
    a2 = srv.call(a, Barrier, 2, 30.0)
    b2 = srv.call(b, Barrier, 2, 30.0)
    assert srv.reply(a, a2) is None
    assert srv.reply(b, b2) is None
    b1 = srv.call(b, Barrier, 1, 30.0)
    assert srv.reply(a, a1) is None
    assert srv.reply(b, b1) is None


def test_barrier_timeout_of_one_seq_leaves_next_seq_working(srv: FakeServer) -> None:
    a, b = srv.form(2)
    a1 = srv.call(a, Barrier, 1, 2.0)
    srv.advance(2.0)
    assert srv.error(a, a1, ErrorCode.TIMEOUT).details == {"missing": [1]}
    a2 = srv.call(a, Barrier, 2, 30.0)
    b2 = srv.call(b, Barrier, 2, 30.0)
    assert srv.reply(a, a2) is None
    assert srv.reply(b, b2) is None


def test_barrier_while_forming_not_joined(srv: FakeServer) -> None:
    a = srv.join(world_size=2)
    req = srv.call(a, Barrier, 0, 5.0)
    srv.error(a, req, ErrorCode.NOT_JOINED)


# --- liveness -------------------------------------------------------------------------


def test_connection_lost_in_complete_job_notifies_every_other_member_once(
    srv: FakeServer,
) -> None:
    conns = srv.form(4)
    srv.lose(conns[2], "reset by peer")
    for rank in (0, 1, 3):
        notice = srv.only(conns[rank], MemberFailed)
        assert (notice.rank, notice.host, notice.pid) == (2, host_of(2), pid_of(2))
        assert "reset by peer" in notice.reason
    assert srv.take(conns[2]) == []
    srv.advance(30.0)
    assert srv.quiet()
    job = srv.state.jobs["job"]
    assert [f[0] for f in job.failures] == [2]
    assert srv.state.stats.failures == 1


def test_connection_lost_fails_barriers_and_the_store_goes_on(srv: FakeServer) -> None:
    """Failure isolation: a job's barrier needs every member, the store does not."""
    a, b, c = srv.form(3)
    get_req = srv.call(a, StoreGet, "k", 30.0)
    wait_req = srv.call(a, StoreWait, pack_keys(["x", "y"]), 30.0)
    barrier_req = srv.call(b, Barrier, 0, 30.0)
    srv.lose(c)
    assert [type(m) for m in srv.take(a)] == [MemberFailed]
    notice, err = srv.take(b)
    assert isinstance(notice, MemberFailed)
    assert (err.req_id, ErrorCode(err.code)) == (barrier_req, ErrorCode.RANK_FAILED)
    assert (err.details["rank"], err.details["pid"]) == (2, pid_of(2))
    assert "rank 2" in err.message
    # The barriers stay failed: a new one fails at once.
    req = srv.call(b, Barrier, 1, 30.0)
    assert srv.error(b, req, ErrorCode.RANK_FAILED).details["rank"] == 2
    # The store's waits go on, and are answered when the keys are set.
    srv.call(b, StoreSet, "k", b"v")
    srv.take(b)
    assert srv.reply(a, get_req) == b"v"
    srv.call(b, StoreSet, "x", b"1")
    srv.call(b, StoreSet, "y", b"1")
    srv.take(b)
    assert srv.reply(a, wait_req) is None
    srv.advance(60.0)
    assert srv.quiet()


def test_store_waits_after_a_failure_wait_and_time_out_as_before(srv: FakeServer) -> None:
    """A get or wait that starts after a member failed waits for its keys (the store goes on)."""
    a, b, c = srv.form(3)
    srv.call(a, StoreSet, "here", b"1")
    srv.take(a)
    srv.lose(c)
    srv.only(a, MemberFailed)
    srv.only(b, MemberFailed)
    later = srv.call(b, StoreGet, "later", 30.0)
    missing = srv.call(b, StoreWait, pack_keys(["here", "missing"]), 5.0)
    assert srv.take(b) == []
    srv.call(a, StoreSet, "later", b"2")
    srv.take(a)
    assert srv.reply(b, later) == b"2"
    srv.advance(10.0)
    assert "missing" in srv.error(b, missing, ErrorCode.TIMEOUT).message
    req = srv.call(b, StoreGet, "here", 30.0)
    assert srv.reply(b, req) == b"1"
    srv.advance(60.0)
    assert srv.quiet()


def test_connection_lost_barrier_waiter_gets_rank_failed(srv: FakeServer) -> None:
    a, b, c = srv.form(3)
    ra = srv.call(a, Barrier, 0, 30.0)
    rb = srv.call(b, Barrier, 0, 30.0)
    srv.lose(c)
    for conn, req in ((a, ra), (b, rb)):
        msgs = srv.take(conn)
        assert [type(m) for m in msgs] == [MemberFailed, ErrorReply]
        err = msgs[1]
        assert (err.req_id, ErrorCode(err.code)) == (req, ErrorCode.RANK_FAILED)


def test_heartbeat_silence_past_timeout_declared_failed_at_sweep(srv: FakeServer) -> None:
    a, b = srv.form(2, heartbeat_timeout=2.0)
    failed_at = None
    t = 0.0
    while t < 10.0 and failed_at is None:
        srv.heartbeat(a)  # a keeps heartbeating, b has gone silent
        t += 0.25
        srv.advance(t)
        if srv.inbox[a]:
            failed_at = t
    assert failed_at is not None, "b was never declared failed"
    # declared after its heartbeat_timeout, at the first sweep past it (every timeout / 4)
    assert 2.0 < failed_at <= 2.5
    notice = srv.only(a, MemberFailed)
    assert (notice.rank, notice.host, notice.pid) == (1, host_of(1), pid_of(1))
    assert "heartbeat" in notice.reason
    # b hears the verdict too (a loop that ran again says it was declared failed) ...
    told = srv.inbox[b].pop(0)
    assert isinstance(told, MemberFailed)
    assert told.rank == 1
    # ... then the error, and its connection closes.
    err = srv.error(b, 0, ErrorCode.RANK_FAILED)
    assert "heartbeat" in err.message
    assert srv.closed.pop(b) == ["missed heartbeats"]
    # the sweep's Close makes the server drop the connection: nothing is reported twice
    srv.lose(b)
    for _ in range(40):
        srv.heartbeat(a)
        t += 0.25
        srv.advance(t)
    assert srv.quiet()
    assert [m.rank for m in srv.state.jobs["job"].members] == [0]


def test_heartbeat_messages_keep_members_alive(srv: FakeServer) -> None:
    conns = srv.form(3, heartbeat_timeout=1.0)
    t = 0.0
    for _ in range(200):
        srv.heartbeat(*conns)
        t += 0.5
        srv.advance(t)
    assert srv.quiet()
    assert srv.state.jobs["job"].failures == []


def test_any_message_counts_as_heartbeat(srv: FakeServer) -> None:
    a, b = srv.form(2, heartbeat_timeout=1.0)
    t = 0.0
    for _ in range(20):
        srv.call(a, StoreNumKeys)
        srv.only(a, Reply)
        srv.heartbeat(b)
        t += 0.5
        srv.advance(t)
    assert srv.quiet()


def test_heartbeat_timeout_detected_promptly_beside_job_with_long_timeout(
    srv: FakeServer,
) -> None:
    srv.form(1, group="slow", heartbeat_timeout=40.0)  # sweeps every 1.0 s
    a, _ = srv.form(2, group="fast", heartbeat_timeout=0.5)  # needs a sweep every 0.125 s
    srv.heartbeat(a)
    srv.advance(0.5)
    srv.heartbeat(a)
    assert srv.quiet()
    srv.advance(0.75)
    assert srv.only(a, MemberFailed).rank == 1


def test_heartbeat_silence_while_forming_not_a_failure(srv: FakeServer) -> None:
    # a rank that waits long for the others to start has not missed heartbeats
    a = srv.join(world_size=2, rank=0, heartbeat_timeout=2.0)
    srv.advance(30.0)
    b = srv.join(world_size=2, rank=1, heartbeat_timeout=2.0)
    srv.only(a, Welcome)
    srv.only(b, Welcome)
    srv.advance(31.0)
    assert srv.quiet()
    assert srv.state.jobs["job"].failures == []
    # from then on silence counts: b heartbeats, a does not
    t = 31.0
    while t < 34.0:
        srv.heartbeat(b)
        t += 0.25
        srv.advance(t)
    assert srv.only(b, MemberFailed).rank == 0


def test_leave_is_not_a_failure(srv: FakeServer) -> None:
    a, b, c = srv.form(3)
    req = srv.call(b, Leave)
    assert srv.reply(b, req) is None
    assert srv.left(a) == srv.left(c) == [[1, host_of(1), pid_of(1)]]
    srv.lose(b)
    srv.advance(30.0)
    assert srv.quiet()
    job = srv.state.jobs["job"]
    assert job.failures == []
    assert [m.conn for m in job.members] == [a, c]
    assert srv.state.stats.failures == 0


def _left_details(rank: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "host": host_of(rank),
        "pid": pid_of(rank),
        "reason": "left the job (destroy_process_group, or its program ended)",
    }


def test_leave_while_others_wait_at_barrier_fails_barrier_naming_the_rank_that_left(
    srv: FakeServer,
) -> None:
    a, b, c = srv.form(3)
    ra = srv.call(a, Barrier, 0, 30.0)
    srv.call(c, Leave)
    srv.only(c, Reply)
    notice, err = srv.take(a)
    assert isinstance(notice, MembersLeft)
    assert isinstance(notice.members, Packed)
    assert msgpack.unpackb(notice.members.data) == [[2, host_of(2), pid_of(2)]]
    assert (err.req_id, err.code, err.details) == (ra, ErrorCode.RANK_FAILED, _left_details(2))
    assert err.message.startswith(
        f"rank 2 (host {host_of(2)}, pid {pid_of(2)}) left the job "
        "(destroy_process_group, or its program ended) "
        "while this operation waited on it"
    )
    assert err.message.count("left the job") == 1
    assert srv.only(b, MembersLeft) == notice  # the very same bytes
    rb = srv.call(b, Barrier, 0, 30.0)  # a late arrival gets the same error
    assert srv.error(b, rb, ErrorCode.RANK_FAILED).message == err.message
    rb = srv.call(b, Barrier, 1, 30.0)  # so does a barrier started after the leave, at once
    assert srv.error(b, rb, ErrorCode.RANK_FAILED).details == _left_details(2)
    assert srv.take(a) == []


def test_barrier_reached_before_a_member_left_completes_for_the_others(srv: FakeServer) -> None:
    a, b, c = srv.form(3)
    srv.call(c, Barrier, 0, 30.0)
    srv.call(c, Leave)
    assert [type(m) for m in srv.take(c)] == [Reply]
    assert srv.left(a) == srv.left(b) == [[2, host_of(2), pid_of(2)]]
    ra, rb = srv.call(a, Barrier, 0, 30.0), srv.call(b, Barrier, 0, 30.0)
    assert srv.reply(a, ra) is None
    assert srv.reply(b, rb) is None


def test_leave_notices_first_at_once_then_at_most_one_per_interval(srv: FakeServer) -> None:
    conns = srv.form(5)
    srv.call(conns[4], Leave)
    for conn in conns[:4]:
        assert srv.left(conn) == [[4, host_of(4), pid_of(4)]]
    srv.now = 0.01
    srv.call(conns[3], Leave)
    srv.now = 0.05
    srv.call(conns[2], Leave)
    assert all(srv.take(conn) == [] for conn in conns[:2])  # held for the interval
    assert srv.state.next_deadline() == pytest.approx(0.1)
    srv.advance(0.1)
    for conn in conns[:2]:
        assert srv.left(conn) == [[3, host_of(3), pid_of(3)], [2, host_of(2), pid_of(2)]]
    srv.advance(1.0)
    srv.call(conns[1], Leave)  # a quiet interval later: at once again
    assert srv.left(conns[0]) == [[1, host_of(1), pid_of(1)]]


def test_job_ending_with_a_notice_planned_leaves_no_timer(srv: FakeServer) -> None:
    conns = srv.form(3)
    for conn in conns:
        srv.call(conn, Leave)
    assert srv.state.jobs == {}
    # The first leave was told at once; the second waits for a notice nobody is left for.
    assert [type(m) for m in srv.take(conns[2])] == [MembersLeft, Reply]
    srv.take(conns[0])
    srv.take(conns[1])
    srv.state.next_deadline()  # drops the timers of the notice nobody is left for
    assert srv.state.out.deadlines == []
    srv.advance(1.0)
    assert srv.quiet()


def test_leave_after_a_failure_is_announced(srv: FakeServer) -> None:
    """The job goes on after a failure: the members still there hear of a leave."""
    a, b, c = srv.form(3)
    srv.lose(a)
    srv.only(b, MemberFailed)
    srv.only(c, MemberFailed)
    srv.call(c, Leave)
    srv.only(c, Reply)
    assert srv.left(b) == [[2, host_of(2), pid_of(2)]]


def decoded_failures(notice: Any) -> list[MemberFailed]:
    """The failures a ``MembersFailed`` names, as the client reads them off the wire."""
    dec = FrameDecoder()
    dec.receive_data(b"".join(encode_message(notice)))
    msg = frame_message(dec.next_event())  # type: ignore[arg-type]
    assert isinstance(msg, MembersFailed)
    return msg.each()


def test_failures_within_the_notice_interval_are_told_together(srv: FakeServer) -> None:
    a, b, c, d = srv.form(4)
    srv.lose(a)
    for conn in (b, c, d):  # the first failure is told at once
        assert srv.only(conn, MemberFailed).rank == 0
    srv.lose(b)
    srv.lose(c)
    assert srv.take(d) == []  # held back until the interval ends...
    srv.advance(srv.now + FAILURE_NOTICE_INTERVAL)
    notice = srv.only(d, MembersFailed)  # ...then both in one notice, encoded once
    assert isinstance(notice.members, Packed)
    assert [(f.rank, f.host, f.pid) for f in decoded_failures(notice)] == [
        (1, host_of(1), pid_of(1)),
        (2, host_of(2), pid_of(2)),
    ]
    srv.advance(srv.now + 1.0)
    assert srv.take(d) == []  # nothing held back any more
    srv.lose(d)  # after a quiet interval, a failure is told at once again


def test_a_failure_after_a_quiet_interval_is_told_at_once(srv: FakeServer) -> None:
    a, b, c = srv.form(3)
    srv.lose(a)
    srv.only(c, MemberFailed)
    srv.advance(srv.now + FAILURE_NOTICE_INTERVAL)
    srv.lose(b)
    assert srv.only(c, MemberFailed).rank == 1


def test_a_whole_job_dying_at_once_costs_a_notice_per_member_not_n_squared(
    srv: FakeServer,
) -> None:
    n = 256
    conns = srv.form(n)
    for conn in conns:
        srv.lose(conn)
    srv.advance(srv.now + 1.0)
    told = sum(len(msgs) for msgs in srv.inbox.values())
    assert told == n - 1  # the first failure, to every other member; then nobody is left
    assert srv.state.stats.failures == n


def test_leave_while_forming_sends_no_notice(srv: FakeServer) -> None:
    a = srv.join(world_size=3, rank=0)
    b = srv.join(world_size=3, rank=1)
    srv.call(b, Leave)
    srv.only(b, Reply)
    assert srv.take(a) == []
    assert srv.state.jobs["job"].left == {}


@pytest.mark.parametrize("rank", [1, -1])
def test_forming_member_disconnect_drops_out_and_replacement_completes_job(
    srv: FakeServer, rank: int
) -> None:
    a = srv.join(world_size=3, rank=0, host="h0", pid=10)
    gone = srv.join(world_size=3, rank=rank, host="h1", pid=11)
    srv.lose(gone)
    assert srv.quiet()
    job = srv.state.jobs["job"]
    assert [m.pid for m in job.members] == [10]
    assert job.failures == []

    b = srv.join(world_size=3, rank=rank, host="h1", pid=21)
    c = srv.join(world_size=3, rank=2, host="h2", pid=22)
    welcomes = [srv.only(conn, Welcome) for conn in (a, b, c)]
    assert [w.rank for w in welcomes] == [0, 1, 2]
    assert [row[3] for row in srv.table(a)] == [10, 21, 22]
    assert srv.take(gone) == []
    assert srv.state.stats.failures == 0


def test_forming_member_leave_drops_out(srv: FakeServer) -> None:
    a = srv.join(world_size=2, rank=0)
    req = srv.call(a, Leave)
    assert srv.reply(a, req) is None
    assert srv.state.jobs == {}
    b = srv.join(world_size=2, rank=0)
    c = srv.join(world_size=2, rank=1)
    assert srv.only(b, Welcome).rank == 0
    assert srv.only(c, Welcome).rank == 1


def test_join_timeout_while_forming_rendezvous_timeout(srv: FakeServer) -> None:
    a = srv.connect()
    req_a = srv.call(a, Join, "job", 4, 0, "h0", 10, [], LONG, 10.0)
    srv.advance(5.0)
    b = srv.connect()
    req_b = srv.call(b, Join, "job", 4, 1, "h1", 11, [], LONG, 10.0)
    srv.advance(9.9375)
    assert srv.quiet()
    srv.advance(10.0)
    err = srv.error(a, req_a, ErrorCode.RENDEZVOUS_TIMEOUT)
    assert "2 of 4" in err.message
    assert srv.take(b) == []
    assert [m.pid for m in srv.state.jobs["job"].members] == [11]

    srv.advance(15.0)
    err = srv.error(b, req_b, ErrorCode.RENDEZVOUS_TIMEOUT)
    assert "1 of 4" in err.message
    assert srv.state.jobs == {}
    # the connection may try again, and the rank it held is free
    srv.join(world_size=2, rank=0, conn=a)
    c = srv.join(world_size=2, rank=1)
    assert srv.only(a, Welcome).rank == 0
    assert srv.only(c, Welcome).rank == 1


def test_join_timeout_does_not_fire_once_job_formed(srv: FakeServer) -> None:
    a = srv.join(world_size=2, timeout=5.0)
    srv.advance(4.0)
    b = srv.join(world_size=2, timeout=5.0)
    srv.only(a, Welcome)
    srv.only(b, Welcome)
    srv.advance(20.0)
    assert srv.quiet()


# --- job lifetime ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["leave", "disconnect"])
def test_job_dropped_when_all_members_gone(srv: FakeServer, how: str) -> None:
    conns = srv.form(3)
    srv.call(conns[0], StoreGet, "never", 30.0)
    for i, conn in enumerate(conns):
        assert "job" in srv.state.jobs, f"dropped with {len(conns) - i} members left"
        if how == "leave":
            srv.call(conn, Leave)
        srv.lose(conn)
    assert "job" not in srv.state.jobs
    srv.take(conns[0])
    srv.advance(60.0)  # the dropped job's deadlines are gone with it
    assert not srv.inbox[conns[0]]
    assert srv.state.snapshot(srv.now)["jobs"] == []


def test_two_jobs_side_by_side_independent(srv: FakeServer) -> None:
    a0 = srv.join("a", 2, 0)
    b0 = srv.join("b", 3, 0)  # the same rank in another job is no conflict
    b1 = srv.join("b", 3, 1)
    a1 = srv.join("a", 2, 1)
    assert srv.only(a0, Welcome).world_size == 2
    assert srv.only(a1, Welcome).rank == 1
    assert srv.quiet()
    b2 = srv.join("b", 3, 2)
    assert [srv.only(c, Welcome).world_size for c in (b0, b1, b2)] == [3, 3, 3]

    srv.call(a0, StoreSet, "k", b"in a")
    srv.only(a0, Reply)
    req = srv.call(b0, StoreCheck, ["k"])
    assert srv.reply(b0, req) is False
    req = srv.call(b0, StoreNumKeys)
    assert srv.reply(b0, req) == 0

    srv.lose(a1)
    assert srv.only(a0, MemberFailed).rank == 1
    assert srv.quiet()
    req = srv.call(b0, Barrier, 0, 30.0)
    srv.call(b1, Barrier, 0, 30.0)
    srv.call(b2, Barrier, 0, 30.0)
    assert srv.reply(b0, req) is None
    assert srv.state.jobs["b"].failures == []


def test_job_same_name_forms_again_after_old_job_ended(srv: FakeServer) -> None:
    old = srv.form(2)
    srv.call(old[0], StoreSet, "k", b"old")
    srv.only(old[0], Reply)
    srv.lose(old[0])
    srv.lose(old[1])
    assert srv.state.jobs == {}

    new = [srv.join(world_size=3) for _ in range(3)]
    assert [srv.only(c, Welcome).world_size for c in new] == [3, 3, 3]
    req = srv.call(new[0], StoreNumKeys)
    assert srv.reply(new[0], req) == 0
    assert srv.state.jobs["job"].failures == []


def test_job_full_until_every_member_gone(srv: FakeServer) -> None:
    a, b = srv.form(2)
    srv.call(a, Leave)
    srv.only(a, Reply)
    assert srv.left(b) == [[0, host_of(0), pid_of(0)]]
    c = srv.connect()
    req = srv.call(c, Join, "job", 2, -1, "h", 1, [], LONG, LONG)
    srv.error(c, req, ErrorCode.JOB_FULL)
    srv.call(b, Leave)
    srv.only(b, Reply)
    srv.join(world_size=1, conn=c)
    assert srv.only(c, Welcome).world_size == 1


# --- generations ----------------------------------------------------------------------


def test_later_generation_replaces_a_running_job_and_the_earlier_one_goes_on_alone(
    srv: FakeServer,
) -> None:
    old = srv.form(2)
    srv.call(old[0], StoreSet, "k", b"old")
    srv.only(old[0], Reply)
    new0 = srv.join(world_size=2, rank=0, generation=1)
    job = srv.state.jobs["job"]
    assert (job.generation, len(job.members)) == (1, 1)
    req = srv.call(new0, StoreCheck, ["k"])
    assert srv.reply(new0, req) is False  # a new start: nothing of the old one's store
    # The earlier generation's members still use the record they hold.
    srv.lose(old[1])
    assert srv.only(old[0], MemberFailed).rank == 1
    srv.call(old[0], Leave)
    srv.only(old[0], Reply)
    assert srv.state.jobs["job"] is job
    assert srv.quiet()
    new1 = srv.join(world_size=2, rank=1, generation=1)
    assert [srv.only(c, Welcome).rank for c in (new0, new1)] == [0, 1]


def test_earlier_generation_than_the_jobs_is_refused_and_the_job_goes_on(srv: FakeServer) -> None:
    new0 = srv.join(world_size=2, rank=0, generation=2)
    stale = srv.connect()
    req = srv.call(stale, Join, "job", 2, 1, "h", 9, [], LONG, LONG, 1)
    err = srv.error(stale, req, ErrorCode.RENDEZVOUS)
    assert "generation 1" in err.message
    assert "generation 2 is running" in err.message
    assert err.details == {"generations": [2, 1]}
    new1 = srv.join(world_size=2, rank=1, generation=2)
    assert [srv.only(c, Welcome).rank for c in (new0, new1)] == [0, 1]


def test_job_of_a_reused_name_may_start_at_generation_zero_after_it_ended(
    srv: FakeServer,
) -> None:
    earlier = srv.join(world_size=1, generation=3)
    srv.only(earlier, Welcome)
    srv.lose(earlier)
    conn = srv.join(world_size=1)  # a launch of its own that reuses the name
    assert srv.only(conn, Welcome).world_size == 1
    assert srv.state.jobs["job"].generation == 0


# --- job events -----------------------------------------------------------------------


def events(srv: FakeServer, *fields: str) -> list[tuple[Any, ...]]:
    """The events since the last call, each as (event, *fields)."""
    return [(e["event"], *(e.get(f) for f in fields)) for e in srv.state.take_events()]


def test_events_follow_a_job_from_creation_to_success(srv: FakeServer) -> None:
    srv.now = 10.0
    a = srv.join(world_size=2, rank=1, host="n1", pid=7)
    srv.now = 11.5
    b = srv.join(world_size=2, host="n0", pid=8)
    evs = srv.state.take_events()
    assert [e["event"] for e in evs] == ["job_created", "rank_joined", "rank_joined", "job_formed"]
    assert all((e["job"], e["generation"]) == ("job", 0) for e in evs)
    assert evs[0]["world_size"] == 2
    assert [(e["rank"], e["host"], e["pid"], e["joined"]) for e in evs[1:3]] == [
        (1, "n1", 7, 1),
        (None, "n0", 8, 2),  # an automatic rank is not known when it joins
    ]
    assert (evs[3]["seconds"], evs[3]["hosts"]) == (1.5, 2)
    srv.now = 20.0
    for conn in (a, b):
        srv.call(conn, Leave)
    srv.lose(a)
    srv.lose(b)
    [finished] = srv.state.take_events()
    assert finished == {
        "event": "job_finished",
        "job": "job",
        "generation": 0,
        "state": "succeeded",
        "world_size": 2,
        "seconds": 10.0,
        "ran": 8.5,
        "failures": 0,
    }


def test_events_of_a_failed_rank_and_of_the_next_generation(srv: FakeServer) -> None:
    conns = srv.form(2)
    srv.state.take_events()
    srv.now = 2.0  # (no input for STALL_GAP: a live server, not one that stood still)
    srv.lose(conns[1], "connection reset")
    assert events(srv, "rank", "host", "ran") == [("rank_failed", 1, host_of(1), 2.0)]
    srv.now = 3.0
    srv.call(conns[0], Leave)
    assert events(srv, "state", "failures", "seconds") == [("job_finished", "failed", 1, 3.0)]
    srv.join(world_size=2, rank=0, generation=1)
    assert events(srv, "generation", "previous_generation", "previous_state") == [
        ("job_created", 1, None, None),
        ("generation_restarted", 1, 0, "failed"),
        ("rank_joined", 1, None, None),
    ]


def test_events_when_a_later_generation_replaces_a_running_job(srv: FakeServer) -> None:
    old = srv.form(2)
    srv.state.take_events()
    srv.join(world_size=2, rank=0, generation=1)
    assert events(srv, "generation", "previous_state")[:2] == [
        ("job_created", 1, None),
        ("generation_restarted", 1, "replaced"),
    ]
    for conn in old:  # the replaced generation still finishes, once
        srv.call(conn, Leave)
        srv.lose(conn)
    assert events(srv, "generation", "state") == [("job_finished", 0, "succeeded")]


@pytest.mark.parametrize("how", ["timeout", "world_size"])
def test_job_that_never_formed_finishes_not_formed_with_the_reason(
    srv: FakeServer, how: str
) -> None:
    srv.join(world_size=3, rank=0, timeout=5.0)
    srv.join(world_size=3, rank=1, timeout=5.0)
    if how == "timeout":
        srv.advance(6.0)
    else:
        srv.join(world_size=2, rank=1, host="hz", pid=99)
    *_, finished = srv.state.take_events()
    assert (finished["event"], finished["state"], finished["ran"]) == (
        "job_finished",
        "not_formed",
        None,
    )
    expected = "2 of 3 members joined in time" if how == "timeout" else "disagree: 3 and 2"
    assert expected in finished["reason"]
    assert srv.state.jobs == {}


def test_snapshot_reports_generations_and_recently_finished_jobs(srv: FakeServer) -> None:
    done = srv.join("done", 1, generation=2)
    srv.only(done, Welcome)
    srv.now = 3.0
    srv.call(done, Leave)
    srv.join("running", 2, 0, generation=4)
    srv.now = 10.0
    snap = srv.state.snapshot(srv.now)
    [running] = snap["jobs"]
    assert (running["name"], running["generation"]) == ("running", 4)
    [finished] = snap["finished"]
    assert (finished["job"], finished["generation"], finished["state"]) == ("done", 2, "succeeded")
    assert (finished["seconds"], finished["ago"]) == (3.0, 7.0)


# --- close, status --------------------------------------------------------------------


def test_close_sends_server_closing_to_every_connection(srv: FakeServer) -> None:
    members = srv.form(2)
    forming = srv.join("other", 3)
    idle = srv.connect()
    gone = srv.connect()
    srv.lose(gone)
    srv.state.close("maintenance")
    srv._collect()
    for conn in [*members, forming, idle]:
        assert srv.only(conn, ServerClosing).reason == "maintenance"
    assert srv.take(gone) == []


def test_snapshot_reports_jobs_members_failures(srv: FakeServer) -> None:
    conns = srv.form(3)
    srv.join("forming", 4, 2, host="hx", pid=77)
    srv.call(conns[0], StoreSet, "k", b"v")
    srv.advance(2.0)
    srv.lose(conns[1])
    snap = srv.state.snapshot(5.0)
    assert snap["uptime"] == 5.0
    assert snap["connections"] == 3  # one of the four was lost
    assert snap["stats"]["jobs_formed"] == 1
    assert snap["stats"]["joins"] == 4
    assert snap["stats"]["failures"] == 1
    jobs = {job["name"]: job for job in snap["jobs"]}
    assert set(jobs) == {"job", "forming"}

    job = jobs["job"]
    assert (job["world_size"], job["joined"], job["state"], job["keys"]) == (3, 2, "failed", 1)
    assert [(m["rank"], m["host"], m["pid"], m["status"]) for m in job["members"]] == [
        (0, host_of(0), pid_of(0), "active"),
        (2, host_of(2), pid_of(2), "active"),
    ]
    assert all(m["heartbeat_age"] == 5.0 for m in job["members"])
    [failure] = job["failures"]
    assert (failure["rank"], failure["host"], failure["pid"]) == (1, host_of(1), pid_of(1))

    forming = jobs["forming"]
    assert (forming["world_size"], forming["joined"], forming["state"]) == (4, 1, "forming")
    assert [(m["rank"], m["host"], m["pid"]) for m in forming["members"]] == [(2, "hx", 77)]
    assert forming["failures"] == []


def test_snapshot_shows_no_rank_for_a_member_the_job_has_not_numbered_yet(
    srv: FakeServer,
) -> None:
    srv.join("auto", 3, -1, host="ha", pid=70)  # the server assigns its rank when it forms
    srv.join("auto", 3, 2, host="hb", pid=71)  # asked for rank 2
    (job,) = srv.state.snapshot(srv.now)["jobs"]
    assert [(m["rank"], m["pid"], m["status"]) for m in job["members"]] == [
        (None, 70, "joining"),
        (2, 71, "joining"),
    ]


def _report(messages: int, nbytes: int) -> Heartbeat:
    return Heartbeat([[0, None, None, [messages, nbytes]]])


def test_traffic_adds_what_members_report_and_keeps_a_bounded_history(srv: FakeServer) -> None:
    a, b = srv.form(2)
    for conn in (a, b):
        srv.send(conn, _report(0, 0))
    # Each member sends 10 messages of 1000 bytes a second, for far longer than the history.
    steps = int(HISTORY_POINTS * HISTORY_INTERVAL * 2)
    for t in range(1, steps + 1):
        srv.now = float(t)
        for conn in (a, b):
            srv.send(conn, _report(10 * t, 10_000 * t))
    (job,) = srv.state.snapshot(srv.now)["jobs"]
    traffic = job["traffic"]
    assert (traffic["messages"], traffic["bytes"]) == (2 * 10 * steps, 2 * 10_000 * steps)
    assert traffic["messages_per_second"] == pytest.approx(20.0)
    assert traffic["bytes_per_second"] == pytest.approx(20_000.0)
    history = srv.state.jobs["job"].traffic.history(srv.now)
    assert len(history) == HISTORY_POINTS  # bounded, however long the job runs
    assert history[-1][0] < HISTORY_INTERVAL  # the newest interval ended just now
    assert all(p[1:] == [20.0, 20_000] for p in history[1:])
    # A report that goes back (its counts restarted) adds nothing, and counts from there.
    srv.send(a, _report(0, 0))
    srv.send(a, _report(10 * steps, 10_000 * steps))
    assert srv.state.jobs["job"].traffic.messages == 2 * 10 * steps + 10 * steps


def test_status_request_replies_with_snapshot_without_joining(srv: FakeServer) -> None:
    srv.form(2)
    conn = srv.connect()
    req = srv.call(conn, StatusRequest)
    snap = srv.reply(conn, req)
    assert [job["name"] for job in snap["jobs"]] == ["job"]
    assert snap["connections"] == 2  # the members' sockets; the asking one is not counted


def test_member_table_is_encoded_once_per_job_and_refused_before_it_forms(
    srv: FakeServer,
) -> None:
    a = srv.join(world_size=2, rank=0)
    req = srv.call(a, MembersRequest)
    srv.error(a, req, ErrorCode.BAD_REQUEST)
    b = srv.join(world_size=2, rank=1)
    srv.only(a, Welcome)
    srv.only(b, Welcome)
    replies = []
    for conn in (a, b, a):
        srv.call(conn, MembersRequest)
        replies.append(srv.only(conn, Reply).value)
    # The very same encoded bytes go to every member that asks.
    assert replies[0] is replies[1] is replies[2]
    assert [row[0] for row in msgpack.unpackb(replies[0].data)] == [0, 1]


def test_member_table_request_needs_a_joined_job(srv: FakeServer) -> None:
    conn = srv.connect()
    req = srv.call(conn, MembersRequest)
    srv.error(conn, req, ErrorCode.NOT_JOINED)


def test_join_welcome_sends_one_run_per_host_not_one_id_per_rank(srv: FakeServer) -> None:
    world_size = 64
    conns = [
        srv.join(world_size=world_size, host=f"h{i % 2}", pid=10 + i) for i in range(world_size)
    ]
    welcomes = [srv.welcome(conn) for conn in conns]
    # Automatic ranks are contiguous per host: one run of two hosts, whatever the size.
    assert all(w.host_runs == [[0, 32, 2]] for w in welcomes)
    assert welcomes[0].host_ids() == [0] * 32 + [1] * 32


@pytest.mark.parametrize(
    "packed",
    [
        pytest.param(b"\xc1", id="not-msgpack"),
        pytest.param(msgpack.packb({"k": 1}), id="not-an-array"),
        pytest.param(msgpack.packb(["k", b"k"]), id="bytes-key"),
        pytest.param(msgpack.packb(["k", 1]), id="int-key"),
    ],
)
def test_store_wait_malformed_keys_is_a_bad_request_and_the_job_goes_on(
    srv: FakeServer, packed: bytes
) -> None:
    a, b = srv.form(2)
    req = srv.call(a, StoreWait, packed, 5.0)
    err = srv.error(a, req, ErrorCode.BAD_REQUEST)
    assert "StoreWait.keys" in err.message
    srv.call(b, StoreSet, "k", b"1")
    srv.only(b, Reply)
    assert srv.reply(a, srv.call(a, StoreWait, pack_keys(["k"]), 5.0)) is None


def test_store_waits_on_the_same_keys_by_every_member_decode_them_once(
    srv: FakeServer,
) -> None:
    conns = srv.form(4)
    keys = [f"addr/{r}" for r in range(4)]
    job = srv.state.jobs["job"]
    reqs = [srv.call(conn, StoreWait, pack_keys(keys), 30.0) for conn in conns]
    (watch,) = job.store.watches.values()
    assert all(f.keys is watch.keys for f in watch.followers)  # shared, not decoded again
    for conn, key in zip(conns, keys, strict=True):
        srv.call(conn, StoreSet, key, b"1")
    for conn, req in zip(conns, reqs, strict=True):
        replies = [m for m in srv.take(conn) if isinstance(m, Reply) and m.req_id == req]
        assert [m.value for m in replies] == [None]
    assert job.store.watches == {}
    # All set now: later waits are answered at once, from the one decoded copy.
    late = [srv.call(conn, StoreWait, pack_keys(keys), 30.0) for conn in conns[:2]]
    assert [srv.reply(conn, req) for conn, req in zip(conns[:2], late, strict=True)] == [None] * 2


def test_store_wait_after_a_key_was_deleted_waits_again(srv: FakeServer) -> None:
    a, b = srv.form(2)
    keys = pack_keys(["x", "y"])
    for key in ("x", "y"):
        srv.call(b, StoreSet, key, b"1")
        srv.only(b, Reply)
    assert srv.reply(a, srv.call(a, StoreWait, keys, 5.0)) is None  # all set: at once
    assert srv.reply(a, srv.call(a, StoreWait, keys, 5.0)) is None  # known set: at once
    srv.call(b, StoreDeleteKey, "y")
    assert srv.only(b, Reply).value is True
    req = srv.call(a, StoreWait, keys, 5.0)
    assert srv.take(a) == []  # "y" is gone: the wait is parked, not answered from memory
    srv.call(b, StoreSet, "y", b"2")
    srv.only(b, Reply)
    assert srv.reply(a, req) is None


def test_store_wait_whose_requests_all_timed_out_is_not_remembered_as_set(
    srv: FakeServer,
) -> None:
    a, b = srv.form(2)
    keys = pack_keys(["x", "y"])
    req = srv.call(a, StoreWait, keys, 1.0)
    srv.advance(1.0)
    srv.error(a, req, ErrorCode.TIMEOUT)
    srv.call(b, StoreSet, "x", b"1")  # wakes the given-up watch; "y" is still unset
    srv.only(b, Reply)
    req = srv.call(a, StoreWait, keys, 5.0)
    assert srv.take(a) == []
    srv.call(b, StoreSet, "y", b"1")
    srv.only(b, Reply)
    assert srv.reply(a, req) is None


# --- absurd values never reach the clock (issue 28) -------------------------------------


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 0.0, 1e-9, 1e300])
@pytest.mark.parametrize("request_kind", ["get", "wait", "barrier"])
def test_absurd_timeout_refused_and_other_jobs_deadlines_still_fire(
    srv: FakeServer, request_kind: str, timeout: float
) -> None:
    a, _ = srv.form(2, group="evil")
    if request_kind == "get":
        req = srv.call(a, StoreGet, "k", timeout)
    elif request_kind == "wait":
        req = srv.call(a, StoreWait, pack_keys(["k"]), timeout)
    else:
        req = srv.call(a, Barrier, 1, timeout)
    err = srv.error(a, req, ErrorCode.BAD_REQUEST)
    assert "timeout must be a finite number of seconds in [0.001, 31536000]" in err.message
    assert err.details["field"].endswith(".timeout")
    assert all(math.isfinite(when) for when in srv.state.out.deadlines)
    # Another job's get times out when it should: the heap is in order.
    (c,) = srv.form(1, group="legit")
    req = srv.call(c, StoreGet, "missing", 1.0)
    srv.advance(srv.now + 0.99)
    assert srv.take(c) == []
    srv.advance(srv.now + 0.02)
    assert (
        "store get timed out waiting for keys ['missing']"
        in srv.error(c, req, ErrorCode.TIMEOUT).message
    )


@pytest.mark.parametrize("heartbeat_timeout", [1e-9, math.nan, math.inf, -1.0, 0.05])
def test_join_absurd_heartbeat_timeout_refused_and_sweeps_stay_spaced(
    srv: FakeServer, heartbeat_timeout: float
) -> None:
    conn = srv.connect()
    req = srv.call(conn, Join, "spin", 2, -1, "h", 1, [], heartbeat_timeout, LONG)
    err = srv.error(conn, req, ErrorCode.BAD_REQUEST)
    assert "Join.heartbeat_timeout must be a finite number of seconds in [0.1, " in err.message
    assert srv.state.jobs == {}
    srv.join(world_size=2, heartbeat_timeout=2.0)
    # Sweeps stay a quarter of the shortest timeout apart: never a spin.
    first = srv.state.next_deadline()
    assert first == pytest.approx(0.5)


def test_sweep_interval_floor_and_it_slows_down_once_the_fast_job_is_gone(
    srv: FakeServer,
) -> None:
    fast = srv.form(2, group="fast", heartbeat_timeout=0.1)  # the shortest allowed
    srv.form(1, group="slow", heartbeat_timeout=40.0)
    assert srv.state.next_deadline() == pytest.approx(0.025)
    times = []
    t = 0.0
    while t < 1.0:  # the fast job heartbeats; count the sweeps
        srv.heartbeat(*fast)
        deadline = srv.state.next_deadline()
        assert deadline is not None
        times.append(deadline)
        t = deadline
        srv.advance(t)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.025 - 1e-9
    for conn in fast:
        srv.call(conn, Leave)
        srv.take(conn)
    srv.advance(srv.now + 0.03)  # one sweep sees only the slow job
    assert srv.state.next_deadline() == pytest.approx(srv.now + 1.0, abs=0.03)
