"""Elastic jobs that grow: the server's side, sans-IO (``_server/membership.py``).

A process that joins a formed elastic job gets the next free rank, and every
member alive, the newcomer included, gets the same view with the next epoch.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from aiodist._errors import ErrorCode
from aiodist._wire.messages import (
    ErrorReply,
    Join,
    Leave,
    MemberFailed,
    MembersFailed,
    MembersJoined,
    Packed,
    Welcome,
)
from tests.unit.server.test_server_state import LONG, FakeServer, decoded_failures


@pytest.fixture
def srv() -> FakeServer:
    return FakeServer()


def _join(
    srv: FakeServer, lo: int, hi: int, rank: int = -1, host: str = "node0", pid: int = 1
) -> int:
    conn = srv.connect()
    srv.call(
        conn, Join, "job", lo, rank, host, pid, [f"tcp://{host}:{pid}"], LONG, LONG, 0, b"", hi
    )
    return conn


def _form(srv: FakeServer, lo: int, hi: int) -> list[int]:
    conns = [_join(srv, lo, hi, pid=100 + i) for i in range(lo)]
    assert [srv.only(c, Welcome).rank for c in conns] == list(range(lo))
    return conns


def _view(notice: Any) -> list[Any]:
    assert isinstance(notice, MembersJoined)
    ranks = msgpack.unpackb(notice.ranks.data) if isinstance(notice.ranks, Packed) else notice.ranks
    return [notice.epoch, notice.world_size, ranks, notice.joined]


def test_join_of_formed_elastic_job_gets_next_rank_and_every_member_the_view(
    srv: FakeServer,
) -> None:
    conns = _form(srv, 3, 4)
    late = _join(srv, 3, 4, pid=200)
    welcome, notice = srv.take(late)
    assert isinstance(welcome, Welcome)
    assert (welcome.rank, welcome.world_size, welcome.local_rank) == (3, 4, 3)
    assert _view(notice) == [1, 4, [0, 1, 2, 3], [[3, "node0", 200]]]
    for conn in conns:  # the same view, on every member
        assert _view(srv.only(conn, MembersJoined)) == [1, 4, [0, 1, 2, 3], [[3, "node0", 200]]]
    # The member table now holds the newcomer's addresses.
    assert [row[0] for row in srv.table(conns[0])][-1] == 3


def test_newcomer_after_a_failure_gets_a_rank_never_given_and_the_epoch_counts_both(
    srv: FakeServer,
) -> None:
    a, b, c = _form(srv, 3, 3)
    srv.lose(b)  # epoch 1: rank 1 failed
    assert isinstance(srv.only(a, MemberFailed), MemberFailed)
    srv.take(c)
    late = _join(srv, 3, 3, pid=300)
    welcome, notice = srv.take(late)
    assert welcome.rank == 3  # not 1: a dead rank's number stays with its failure
    assert _view(notice) == [2, 4, [0, 2, 3], [[3, "node0", 300]]]
    # Its local rank is the lowest one free on its host (rank 1's).
    assert welcome.local_rank == 1


def test_join_of_elastic_job_at_its_largest_size_is_refused(srv: FakeServer) -> None:
    _form(srv, 2, 3)
    _join(srv, 2, 3, pid=7)
    full = _join(srv, 2, 3, pid=8)
    (err,) = srv.take(full)
    assert isinstance(err, ErrorReply)
    assert err.code == ErrorCode.JOB_FULL
    assert "3 members alive" in err.message


@pytest.mark.parametrize(
    ("lo", "hi", "rank", "code"),
    [
        (2, 5, -1, ErrorCode.WORLD_SIZE_MISMATCH),  # another MAX
        (2, 0, -1, ErrorCode.WORLD_SIZE_MISMATCH),  # a joiner that is not elastic
        (2, 4, 1, ErrorCode.BAD_REQUEST),  # a rank of its own
        (3, 4, -1, ErrorCode.WORLD_SIZE_MISMATCH),  # another MIN
    ],
)
def test_join_of_formed_elastic_job_that_does_not_fit_is_refused_and_job_untouched(
    srv: FakeServer, lo: int, hi: int, rank: int, code: ErrorCode
) -> None:
    conns = _form(srv, 2, 4)
    stray = _join(srv, lo, hi, rank=rank, pid=9)
    (err,) = srv.take(stray)
    assert isinstance(err, ErrorReply)
    assert err.code == code, err.message
    assert all(srv.take(c) == [] for c in conns)
    assert srv.state.jobs["job"].world_size == 2
    assert srv.state.jobs["job"].epoch == 0


def test_job_that_is_not_elastic_never_grows(srv: FakeServer) -> None:
    srv.form(2)
    late = srv.join("job", 2)
    (err,) = srv.take(late)
    assert isinstance(err, ErrorReply)
    assert err.code == ErrorCode.JOB_FULL


def test_leave_not_yet_announced_goes_out_before_a_join_and_not_to_the_newcomer(
    srv: FakeServer,
) -> None:
    a, b, c = _form(srv, 3, 4)
    srv.call(c, Leave)  # epoch 1; its notice goes at once (the first of the job)
    srv.take(c)
    assert srv.left(a) == [[2, "node0", 102]]
    srv.left(b)
    srv.call(b, Leave)  # epoch 2; its notice is planned a moment later
    srv.take(b)
    assert srv.take(a) == []
    late = _join(srv, 3, 4, pid=300)  # epoch 3
    # rank 0 gets the leave first, then the join: it counts epochs 2 and 3 in order.
    left, joined = srv.take(a)
    assert msgpack.unpackb(left.members.data) == [[1, "node0", 101]]
    assert _view(joined) == [3, 4, [0, 3], [[3, "node0", 300]]]
    welcome, first = srv.take(late)  # the newcomer: its Welcome and its view, nothing else
    assert welcome.rank == 3
    assert _view(first) == [3, 4, [0, 3], [[3, "node0", 300]]]


def test_failures_held_back_go_out_before_a_join_so_the_epochs_stay_in_order(
    srv: FakeServer,
) -> None:
    a, b, c = _form(srv, 3, 8)
    srv.lose(a)  # epoch 1, told at once
    assert srv.only(c, MemberFailed).rank == 0
    srv.lose(b)  # epoch 2, held back with the notice interval
    assert srv.take(c) == []
    _join(srv, 3, 8, pid=300)  # epoch 3
    failed, joined = srv.take(c)
    assert isinstance(failed, MembersFailed)
    assert [f.rank for f in decoded_failures(failed)] == [1]
    assert _view(joined)[:2] == [3, 4]
