"""Sans-IO tests of the range checks on a client's messages (``_wire/bounds.py``).

Every value decoded from the wire is checked before anything acts on it: a
timeout that is NaN, infinite, zero, negative, absurdly small or huge, an id or
a size out of range, gets a ``FieldError`` naming the field, the value and the
allowed range, with the request's id so the server can refuse that request alone.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiodist._errors import ProtocolError
from aiodist._wire.bounds import (
    MAX_ADDRESSES,
    MAX_GROUP_NAME_CHARS,
    MAX_TIMEOUT,
    MIN_HEARTBEAT_TIMEOUT,
    MIN_TIMEOUT,
    FieldError,
)
from aiodist._wire.frame import NEED_DATA, Frame, FrameDecoder, encode_frame, frame_message
from aiodist._wire.headers import check_message, message_header
from aiodist._wire.messages import (
    Barrier,
    Channel,
    CloseChannel,
    Hello,
    Join,
    Reply,
    StoreAdd,
    StoreGet,
    StoreWait,
    Welcome,
    pack_keys,
)

JOIN = Join(7, "train", 4, -1, "node-1", 4121, ["tcp://10.0.0.1:5000"], 10.0, 1800.0)
ABSURD_SECONDS = [
    pytest.param(math.nan, id="nan"),
    pytest.param(math.inf, id="inf"),
    pytest.param(-math.inf, id="-inf"),
    pytest.param(-1.0, id="negative"),
    pytest.param(0.0, id="zero"),
    pytest.param(-0.0, id="minus-zero"),
    pytest.param(1e-9, id="tiny"),
    pytest.param(1e300, id="huge"),
    pytest.param(-1, id="negative-int"),
    pytest.param(2**64 - 1, id="huge-int"),
]


def _decoded(msg: Any, **fields: Any) -> Any:
    """``msg`` with ``fields`` replaced, through the real encoder and decoder."""
    header = message_header(msg)
    names = [f.name for f in dataclasses.fields(msg)]
    for name, value in fields.items():
        header[names.index(name)] = value
    dec = FrameDecoder()
    dec.receive_data(b"".join(bytes(p) for p in encode_frame(msg.KIND, header)))
    event = dec.next_event()
    assert isinstance(event, Frame)
    assert dec.next_event() is NEED_DATA
    return frame_message(event)


def _refused(msg: Any, field: str, **fields: Any) -> FieldError:
    with pytest.raises(FieldError) as info:
        _decoded(msg, **fields)
    exc = info.value
    assert isinstance(exc, ProtocolError)  # anyone who only knows protocol errors closes
    assert exc.field == f"{type(msg).__name__}.{field}"
    assert str(exc).startswith(f"{type(msg).__name__}.{field} must be ")
    return exc


@pytest.mark.parametrize("value", ABSURD_SECONDS)
@pytest.mark.parametrize(
    ("msg", "field"),
    [
        pytest.param(JOIN, "heartbeat_timeout", id="Join.heartbeat_timeout"),
        pytest.param(JOIN, "timeout", id="Join.timeout"),
        pytest.param(StoreGet(3, "k", 1.0), "timeout", id="StoreGet.timeout"),
        pytest.param(StoreWait(4, pack_keys(["k"]), 1.0), "timeout", id="StoreWait.timeout"),
        pytest.param(Barrier(5, 1, 30.0), "timeout", id="Barrier.timeout"),
    ],
)
def test_absurd_timeout_refused_naming_field_value_and_range(
    msg: Any, field: str, value: float
) -> None:
    exc = _refused(msg, field, **{field: value})
    assert exc.req_id == msg.req_id  # that request alone is refused
    assert exc.value == value or (math.isnan(value) and math.isnan(float(exc.value)))  # type: ignore[arg-type]
    assert repr(value) in str(exc)
    lowest = MIN_HEARTBEAT_TIMEOUT if field == "heartbeat_timeout" else MIN_TIMEOUT
    assert f"a finite number of seconds in [{lowest:g}, 31536000]" in str(exc)
    details = exc.wire_details()
    assert details["field"] == exc.field
    assert details["allowed"] == exc.allowed
    # A number, or the words for one that JSON cannot hold.
    assert details["value"] == (value if math.isfinite(value) else repr(float(value)))


@pytest.mark.parametrize(
    ("msg", "field", "value"),
    [
        pytest.param(JOIN, "heartbeat_timeout", MIN_HEARTBEAT_TIMEOUT, id="hb-lowest"),
        pytest.param(JOIN, "heartbeat_timeout", MAX_TIMEOUT, id="hb-highest"),
        pytest.param(JOIN, "timeout", MIN_TIMEOUT, id="join-lowest"),
        pytest.param(StoreGet(3, "k", 1.0), "timeout", 2, id="get-int"),
        pytest.param(Barrier(5, 1, 30.0), "timeout", MAX_TIMEOUT, id="barrier-highest"),
        pytest.param(JOIN, "world_size", 2**31 - 1, id="world-size-int32"),
        pytest.param(JOIN, "group_name", "g" * MAX_GROUP_NAME_CHARS, id="longest-name"),
        pytest.param(JOIN, "addresses", ["a"] * MAX_ADDRESSES, id="most-addresses"),
        pytest.param(StoreAdd(1, "k", 1), "amount", -(2**63), id="add-int64-min"),
    ],
)
def test_values_at_the_edge_of_their_range_pass(msg: Any, field: str, value: Any) -> None:
    decoded = _decoded(msg, **{field: value})
    assert getattr(decoded, field) == value


@pytest.mark.parametrize(
    ("msg", "field", "value", "allowed"),
    [
        pytest.param(JOIN, "world_size", 0, "an integer in [1, 2147483647]", id="world-0"),
        pytest.param(JOIN, "world_size", 2**40, "an integer in [1, ", id="world-huge"),
        pytest.param(JOIN, "rank", -2, "an integer in [-1, ", id="rank-below-auto"),
        pytest.param(JOIN, "pid", -5, "an integer in [0, ", id="pid-negative"),
        pytest.param(JOIN, "generation", -1, "an integer in [0, ", id="generation-negative"),
        pytest.param(JOIN, "group_name", "", "of 1 to 256 characters (it has 0)", id="name-empty"),
        pytest.param(JOIN, "group_name", "g" * 257, "(it has 257)", id="name-long"),
        pytest.param(JOIN, "host", "h" * 5000, "of 0 to 1024 characters", id="host-long"),
        pytest.param(JOIN, "addresses", ["a"] * 65, "of 0 to 64 items (it has 65)", id="addrs"),
        pytest.param(JOIN, "addresses", ["a" * 5000], "at most 4096 characters", id="addr-long"),
        pytest.param(StoreAdd(1, "k", 1), "amount", 2**63, "an integer in [", id="add-over"),
        pytest.param(Barrier(5, 1, 30.0), "seq", -1, "an integer in [0, ", id="seq-negative"),
    ],
)
def test_out_of_range_int_or_size_refused(msg: Any, field: str, value: Any, allowed: str) -> None:
    exc = _refused(msg, field, **{field: value})
    assert exc.req_id == msg.req_id
    assert allowed in str(exc)


@pytest.mark.parametrize(
    ("msg", "field", "value"),
    [
        pytest.param(Channel(1), "channel", -1, id="Channel"),
        pytest.param(CloseChannel(1), "channel", -3, id="CloseChannel"),
        pytest.param(Hello(b"n" * 32, b"p" * 32), "nonce", b"n" * 100_000, id="Hello.nonce"),
        pytest.param(JOIN, "req_id", -1, id="Join.req_id"),
    ],
)
def test_out_of_range_value_of_no_request_has_no_req_id(msg: Any, field: str, value: Any) -> None:
    # Nothing to refuse alone: the server closes that connection.
    assert _refused(msg, field, **{field: value}).req_id == 0


def test_first_bad_field_of_a_request_names_it_and_keeps_the_req_id() -> None:
    exc = _refused(JOIN, "world_size", world_size=0, heartbeat_timeout=math.nan)
    assert exc.req_id == JOIN.req_id
    assert exc.wire_details() == {
        "field": "Join.world_size",
        "value": 0,
        "allowed": "an integer in [1, 2147483647]",
    }


def test_long_value_is_cut_short_in_the_message() -> None:
    exc = _refused(JOIN, "host", host="x" * 5000)
    assert len(str(exc)) < 200
    assert exc.wire_details()["value"] is None  # strings do not travel back


def test_server_to_client_messages_are_not_range_checked() -> None:
    # What a client decodes comes from a server that proved the token.
    assert _decoded(Reply(1, None), req_id=-5) == Reply(-5, None)
    assert _decoded(Welcome(1, 0, 1, 0, 1, [[0, 1]]), world_size=0).world_size == 0


def test_check_message_checks_a_message_built_in_process() -> None:
    check_message(JOIN)
    with pytest.raises(FieldError, match=r"Join\.heartbeat_timeout must be .*got 1e-09"):
        check_message(Join(1, "g", 1, -1, "h", 1, [], 1e-9, 1.0))
    with pytest.raises(FieldError, match=r"Barrier\.timeout must be .*got nan"):
        check_message(Barrier(1, 1, math.nan))
    check_message(Reply(1, None))  # no bounds: nothing to check


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(-(2**63), 2**64 - 1))
def test_any_timeout_either_decodes_in_range_or_is_refused(value: float) -> None:
    msg = StoreGet(9, "k", 1.0)
    if MIN_TIMEOUT <= value <= MAX_TIMEOUT:
        decoded = _decoded(msg, timeout=value)
        assert math.isfinite(decoded.timeout)
        assert decoded.timeout == value
    else:
        assert _refused(msg, "timeout", timeout=value).req_id == 9


def test_printable_escapes_control_characters_and_keeps_the_rest() -> None:
    from aiodist._wire.text import printable, printable_data

    assert printable("nœud-7 ok") == "nœud-7 ok"
    assert printable("a\x1b[2Jb\n\u2028") == "a\\x1b[2Jb\\n\\u2028"
    assert printable_data({"host\x07": ["x\x1b", 3, None]}) == {"host\\x07": ["x\\x1b", 3, None]}
