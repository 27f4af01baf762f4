"""Agreements on a group's next membership (``Regroup``): the server's side, sans-IO.

Every caller gets the same answer: the same list of ranks, or the same error;
a member that fails or leaves meanwhile is left out of the list.
"""

from __future__ import annotations

from typing import Any

import pytest

from aiodist._errors import ErrorCode, ProtocolError
from aiodist._wire.bounds import FieldError
from aiodist._wire.messages import ErrorReply, Leave, MemberFailed, MembersLeft, Regroup, Reply
from tests.unit.server.test_server_state import FakeServer
from tests.unit.wire.test_bounds import _decoded


@pytest.fixture
def srv() -> FakeServer:
    return FakeServer()


def _regroup(
    srv: FakeServer,
    conn: int,
    members: list[int],
    *,
    key: str = "shrink/0/1",
    group_id: int = 1,
    timeout: float = 30.0,
) -> int:
    return srv.call(conn, Regroup, key, group_id, members, timeout)


def _answers(srv: FakeServer, calls: dict[int, int]) -> list[Any]:
    """The one answer on each connection, checked against the request it answers."""
    out = []
    for conn, req in calls.items():
        msgs = [m for m in srv.take(conn) if not isinstance(m, MemberFailed | MembersLeft)]
        assert len(msgs) == 1, msgs
        assert msgs[0].req_id == req
        out.append(msgs[0])
    return out


def test_regroup_answers_every_caller_with_the_same_ranks(srv: FakeServer) -> None:
    conns = srv.form(4)
    srv.lose(conns[2])
    calls = {}
    for conn in (conns[0], conns[1]):
        calls[conn] = _regroup(srv, conn, [0, 1, 3])
        assert [m for m in srv.take(conn) if not isinstance(m, MemberFailed | MembersLeft)] == []
    calls[conns[3]] = _regroup(srv, conns[3], [0, 1, 3])
    answers = _answers(srv, calls)
    assert all(isinstance(a, Reply) and a.value == [0, 1, 3] for a in answers), answers
    # A caller that comes late (say, its reply was lost) gets the same answer.
    late = _regroup(srv, conns[0], [0, 1, 3])
    assert srv.reply(conns[0], late) == [0, 1, 3]


@pytest.mark.parametrize("how", ["fails", "leaves"])
def test_regroup_leaves_out_a_member_gone_before_it_called(srv: FakeServer, how: str) -> None:
    a, b, c, d = srv.form(4)
    srv.lose(d)
    calls = {a: _regroup(srv, a, [0, 1, 2]), c: _regroup(srv, c, [0, 1, 2])}
    if how == "fails":
        srv.lose(b)  # the second death, while the survivors agree
    else:
        srv.call(b, Leave)
    answers = _answers(srv, calls)
    assert [a.value for a in answers] == [[0, 2], [0, 2]]


def test_regroup_with_a_member_already_gone_in_one_proposal_still_agrees(
    srv: FakeServer,
) -> None:
    """One survivor heard of a second failure, the other not yet: both get the same list."""
    a, b, c, d = srv.form(4)
    srv.lose(d)
    srv.lose(b)
    calls = {a: _regroup(srv, a, [0, 2]), c: _regroup(srv, c, [0, 1, 2])}
    assert [x.value for x in _answers(srv, calls)] == [[0, 2], [0, 2]]


def test_regroup_with_different_ranks_fails_every_caller_alike(srv: FakeServer) -> None:
    a, b, c = srv.form(3)
    calls = {a: _regroup(srv, a, [0, 1]), b: _regroup(srv, b, [0, 1, 2])}
    calls[c] = _regroup(srv, c, [1, 2])
    answers = _answers(srv, calls)
    assert all(isinstance(x, ErrorReply) for x in answers)
    assert {ErrorCode(x.code) for x in answers} == {ErrorCode.MISMATCH}
    assert len({x.message for x in answers}) == 1
    assert "ranks_to_exclude" in answers[0].message
    late = _regroup(srv, a, [0, 1])
    assert srv.error(a, late, ErrorCode.MISMATCH).message == answers[0].message


def test_regroup_with_another_group_id_fails_every_caller_alike(srv: FakeServer) -> None:
    a, b = srv.form(2)
    calls = {a: _regroup(srv, a, [0, 1], group_id=3), b: _regroup(srv, b, [0, 1], group_id=4)}
    answers = _answers(srv, calls)
    assert [ErrorCode(x.code) for x in answers] == [ErrorCode.MISMATCH] * 2
    assert answers[0].message == answers[1].message


def test_regroup_timeout_fails_every_caller_naming_who_never_called(srv: FakeServer) -> None:
    a, b, _ = srv.form(3)
    calls = {a: _regroup(srv, a, [0, 1, 2], timeout=5.0), b: _regroup(srv, b, [0, 1, 2])}
    srv.advance(6.0)
    answers = _answers(srv, calls)
    assert [ErrorCode(x.code) for x in answers] == [ErrorCode.TIMEOUT] * 2
    assert answers[0].details == {"missing": [2]}
    assert answers[0].message == answers[1].message
    srv.advance(100.0)
    assert srv.quiet()


@pytest.mark.parametrize("members", [[1, 2], [0, 0, 1], [0, 9], [-1, 0]])
def test_regroup_with_bad_members_is_refused(srv: FakeServer, members: list[int]) -> None:
    a, _ = srv.form(2)
    req = _regroup(srv, a, members)
    assert "Regroup.members" in srv.error(a, req, ErrorCode.BAD_REQUEST).message


def test_regroup_bounds_checked_on_decoding() -> None:
    msg = Regroup(7, "shrink/0/1", 1, [0, 1], 30.0)
    assert _decoded(msg) == msg
    for field, value in [("members", []), ("key", ""), ("key", "k" * 100_000), ("timeout", -1.0)]:
        with pytest.raises(FieldError) as info:
            _decoded(msg, **{field: value})
        assert info.value.field == f"Regroup.{field}"
        assert info.value.req_id == 7
    with pytest.raises(ProtocolError, match="items of the wrong type"):
        _decoded(msg, members=[0, "1"])
