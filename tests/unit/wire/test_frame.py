"""Sans-IO tests of the framing layer: round trips, every split, limits, malformed streams."""

from __future__ import annotations

import array
import itertools
from typing import TYPE_CHECKING, Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist._errors import ErrorCode, ProtocolError
from aiodist._wire.frame import (
    CLOSED,
    NEED_DATA,
    PREFIX,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    Limits,
    PayloadChunk,
    encode_frame,
    encode_message,
    frame_message,
)
from aiodist._wire.headers import message_header
from aiodist._wire.messages import (
    Barrier,
    Data,
    ErrorReply,
    Heartbeat,
    Join,
    Leave,
    MemberFailed,
    MembersFailed,
    MembersRequest,
    Packed,
    Reply,
    ServerClosing,
    StatusRequest,
    StoreCheck,
    StoreCompareSet,
    StoreSet,
    StoreWait,
    Welcome,
    pack_host_runs,
    pack_keys,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from aiodist._wire.frame import Buffer

# One decoded frame: (kind, header, payload), the payload reassembled from its chunks.
Decoded = tuple[int, Any, bytes]

JOIN = Join(
    req_id=7,
    group_name="train",
    world_size=4,
    rank=-1,
    host="node-3",
    pid=4121,
    addresses=["tcp://10.0.0.3:5000", "uds:///tmp/aiodist.sock"],
    heartbeat_timeout=10.0,
    timeout=300.0,
)


def _prefix(
    kind: int = 65,
    header_nbytes: int = 1,
    payload_nbytes: int = 0,
    *,
    magic: bytes = b"AD",
    version: int = PROTOCOL_VERSION,
) -> bytes:
    return PREFIX.pack(magic, version, kind, header_nbytes, payload_nbytes)


def _stream(frames: Iterable[tuple[int, Any, bytes]]) -> bytes:
    return b"".join(
        bytes(part)
        for kind, header, payload in frames
        for part in encode_frame(kind, header, payload)
    )


def _drain(dec: FrameDecoder) -> list[Frame | PayloadChunk]:
    out: list[Frame | PayloadChunk] = []
    while (event := dec.next_event()) is not NEED_DATA:
        assert isinstance(event, Frame | PayloadChunk), event
        out.append(event)
    return out


def _feed(chunks: Iterable[Buffer], limits: Limits | None = None) -> list[Frame | PayloadChunk]:
    """Feed ``chunks`` then EOF, draining after each; the stream must end cleanly."""
    dec = FrameDecoder(limits)
    events: list[Frame | PayloadChunk] = []
    for chunk in chunks:
        dec.receive_data(chunk)
        events += _drain(dec)
    dec.receive_data(b"")
    assert dec.next_event() is CLOSED
    assert dec.buffered_nbytes == 0
    assert dec.payload_remaining == 0
    return events


def _reassemble(events: Sequence[Frame | PayloadChunk]) -> list[Decoded]:
    """Group events into frames, checking that chunks only fill announced payloads."""
    out: list[tuple[Frame, bytearray]] = []
    for event in events:
        if isinstance(event, Frame):
            if out:
                frame, payload = out[-1]
                assert len(payload) == frame.payload_nbytes, "frame started inside a payload"
            out.append((event, bytearray()))
        else:
            assert out, "payload chunk before any frame"
            assert event.data, "empty payload chunk"
            out[-1][1].extend(event.data)
            assert len(out[-1][1]) <= out[-1][0].payload_nbytes
    for frame, payload in out:
        assert len(payload) == frame.payload_nbytes
    return [(frame.kind, frame.header, bytes(payload)) for frame, payload in out]


def _decode_one(parts: Sequence[Buffer]) -> Frame:
    dec = FrameDecoder()
    dec.receive_data(b"".join(bytes(p) for p in parts))
    event = dec.next_event()
    assert isinstance(event, Frame)
    assert dec.next_event() is NEED_DATA
    return event


# --- round trips ---------------------------------------------------------------------


def test_encode_frame_without_payload_is_one_buffer() -> None:
    parts = encode_frame(StatusRequest.KIND, [3])
    assert len(parts) == 1
    assert encode_frame(StatusRequest.KIND, [3], b"") == parts
    body = msgpack.packb([3])
    assert parts[0] == _prefix(StatusRequest.KIND, len(body), 0) + body


def test_encode_frame_returns_payload_uncopied() -> None:
    payload = memoryview(array.array("d", [1.0, 2.0, 3.0]))
    parts = encode_frame(Data.KIND, {"seq": 1}, payload)
    assert len(parts) == 2
    assert parts[1] is payload
    # The prefix counts bytes, not the memoryview's float items.
    assert PREFIX.unpack_from(parts[0])[4] == 24


def test_frame_round_trip_without_payload() -> None:
    header = {"seq": 3, "name": "x", "shape": [2, 3], "ok": True, "none": None}
    assert _reassemble(_feed(encode_frame(33, header))) == [(33, header, b"")]


def test_frame_round_trip_with_payload() -> None:
    payload = bytes(range(256)) * 3
    events = _feed(encode_frame(Data.KIND, [1, "a"], payload))
    assert events == [Frame(Data.KIND, [1, "a"], len(payload)), PayloadChunk(payload)]


def test_frame_round_trip_non_byte_memoryview_payload() -> None:
    payload = array.array("i", range(10))
    events = _feed(encode_frame(Data.KIND, [], memoryview(payload)))
    assert _reassemble(events) == [(Data.KIND, [], payload.tobytes())]


def test_decoder_receive_data_accepts_non_byte_memoryview() -> None:
    data = b"".join(encode_frame(Data.KIND, [1], b"0123456789"))
    assert len(data) % 4 == 0
    events = _feed([memoryview(array.array("i", data))])
    assert _reassemble(events) == [(Data.KIND, [1], b"0123456789")]


SEVERAL_FRAMES: list[tuple[int, Any, bytes]] = [
    (Join.KIND, message_header(JOIN), b""),
    (Data.KIND, {"seq": 1, "dtype": "float32"}, bytes(range(40))),
    (Heartbeat.KIND, [], b""),
    (Data.KIND, [2, [None, True, 1.5, b"\x00\xff"]], b"\x01"),
    (Reply.KIND, [9, "x" * 30], b"payload-bytes" * 3),
    (255, None, b""),
]
SEVERAL_STREAM = _stream(SEVERAL_FRAMES)


def test_several_frames_in_one_chunk() -> None:
    assert _reassemble(_feed([SEVERAL_STREAM])) == SEVERAL_FRAMES


def test_several_frames_split_at_every_byte_boundary() -> None:
    for split in range(1, len(SEVERAL_STREAM)):
        events = _feed([SEVERAL_STREAM[:split], SEVERAL_STREAM[split:]])
        assert _reassemble(events) == SEVERAL_FRAMES, f"split at byte {split}"


def test_several_frames_one_byte_at_a_time() -> None:
    chunks = [SEVERAL_STREAM[i : i + 1] for i in range(len(SEVERAL_STREAM))]
    events = _feed(chunks)
    assert _reassemble(events) == SEVERAL_FRAMES
    # Fed byte by byte, every payload byte is its own chunk.
    chunk_count = sum(isinstance(e, PayloadChunk) for e in events)
    assert chunk_count == sum(len(p) for _, _, p in SEVERAL_FRAMES)


def test_several_frames_fed_as_memoryviews_and_bytearrays() -> None:
    view = memoryview(SEVERAL_STREAM)
    chunks: list[Buffer] = [view[:10], bytearray(view[10:50]), view[50:]]
    assert _reassemble(_feed(chunks)) == SEVERAL_FRAMES


def test_decoder_compacts_its_buffer_on_long_streams() -> None:
    frames = [(Data.KIND, [i], bytes([i % 256]) * 1000) for i in range(600)]
    stream = _stream(frames)
    dec = FrameDecoder()
    events: list[Frame | PayloadChunk] = []
    for i in range(0, len(stream), 7000):
        dec.receive_data(stream[i : i + 7000])
        events += _drain(dec)
        assert dec.buffered_nbytes < 7000
    assert _reassemble(events) == frames


# --- consume_payload: the I/O layer fills the destination itself ----------------------


def _receive_into(dec: FrameDecoder, dest: bytearray, first: bytes, rest: bytes) -> None:
    """Play the I/O layer: drain buffered payload, then read the rest straight into ``dest``."""
    filled = 0
    while (event := dec.next_event()) is not NEED_DATA:
        assert isinstance(event, PayloadChunk)
        dest[filled : filled + len(event.data)] = event.data
        filled += len(event.data)
    assert filled == len(first)
    assert dec.payload_remaining == len(dest) - filled
    # Bytes recv_into()'d straight into place never pass through the decoder.
    dest[filled:] = rest
    dec.consume_payload(len(rest))


def test_consume_payload_writes_into_destination() -> None:
    payload = bytes(range(200))
    head, _ = encode_frame(Data.KIND, [1, "t"], payload)
    after = b"".join(encode_frame(Data.KIND, [2], b"tail"))
    dec = FrameDecoder()
    dec.receive_data(bytes(head) + payload[:37])
    assert dec.next_event() == Frame(Data.KIND, [1, "t"], 200)
    dest = bytearray(200)
    _receive_into(dec, dest, payload[:37], payload[37:])
    assert dest == payload
    assert dec.payload_remaining == 0
    assert dec.next_event() is NEED_DATA
    dec.receive_data(after)
    assert _drain(dec) == [Frame(Data.KIND, [2], 4), PayloadChunk(b"tail")]


def test_consume_payload_in_several_steps_then_eof() -> None:
    (head, _) = encode_frame(Data.KIND, [], b"x" * 100)
    dec = FrameDecoder()
    dec.receive_data(head)
    assert dec.next_event() == Frame(Data.KIND, [], 100)
    for _ in range(4):
        dec.consume_payload(25)
    assert dec.payload_remaining == 0
    dec.consume_payload(0)
    dec.receive_data(b"")
    assert dec.next_event() is CLOSED


def test_consume_payload_with_buffered_payload_raises() -> None:
    dec = FrameDecoder()
    dec.receive_data(b"".join(encode_frame(Data.KIND, [], b"abcdef"))[:-2])
    assert isinstance(dec.next_event(), Frame)
    with pytest.raises(RuntimeError, match="drain buffered payload"):
        dec.consume_payload(1)
    assert dec.next_event() == PayloadChunk(b"abcd")
    dec.consume_payload(2)
    assert dec.payload_remaining == 0


def test_consume_payload_beyond_remaining_raises() -> None:
    dec = FrameDecoder()
    dec.receive_data(encode_frame(Data.KIND, [], b"abc")[0])
    assert isinstance(dec.next_event(), Frame)
    with pytest.raises(ValueError, match=r"consume_payload\(4\) with 3 left"):
        dec.consume_payload(4)
    with pytest.raises(ValueError, match=r"consume_payload\(-1\)"):
        dec.consume_payload(-1)
    assert dec.payload_remaining == 3


# --- limits ----------------------------------------------------------------------------

LIMITS = Limits(max_header_bytes=100, max_payload_bytes=1000)


def test_limits_defaults() -> None:
    assert FrameDecoder().limits == Limits(max_header_bytes=2**20, max_payload_bytes=16 * 2**30)
    assert FrameDecoder(LIMITS).limits is LIMITS


def test_header_at_limit_is_accepted() -> None:
    header = b"x" * (LIMITS.max_header_bytes - 2)  # bin 8: two bytes of msgpack overhead
    frame = b"".join(encode_frame(1, header, b"p" * LIMITS.max_payload_bytes))
    assert PREFIX.unpack_from(frame)[3] == LIMITS.max_header_bytes
    events = _feed([frame], LIMITS)
    assert _reassemble(events) == [(1, header, b"p" * LIMITS.max_payload_bytes)]


def test_header_over_limit_raises_on_prefix_alone() -> None:
    dec = FrameDecoder(LIMITS)
    dec.receive_data(_prefix(header_nbytes=101))
    with pytest.raises(ProtocolError, match="header of 101 bytes exceeds the limit of 100 bytes"):
        dec.next_event()


def test_payload_over_limit_raises_on_prefix_alone() -> None:
    dec = FrameDecoder(LIMITS)
    dec.receive_data(_prefix(payload_nbytes=1001))
    with pytest.raises(
        ProtocolError, match="payload of 1001 bytes exceeds the limit of 1000 bytes"
    ):
        dec.next_event()


def test_huge_payload_refused_at_byte_16_with_default_limits() -> None:
    dec = FrameDecoder()
    dec.receive_data(_prefix(payload_nbytes=2**40))
    with pytest.raises(ProtocolError) as info:
        dec.next_event()
    assert str(2**40) in str(info.value)
    assert str(16 * 2**30) in str(info.value)


def test_limits_checked_before_header_arrives_byte_by_byte() -> None:
    dec = FrameDecoder(LIMITS)
    prefix = _prefix(header_nbytes=2**32 - 1)
    for byte in prefix[:-1]:
        dec.receive_data(bytes([byte]))
        assert dec.next_event() is NEED_DATA
    dec.receive_data(prefix[-1:])
    with pytest.raises(ProtocolError, match=str(2**32 - 1)):
        dec.next_event()


# --- malformed streams ---------------------------------------------------------------


def test_bad_magic_raises() -> None:
    dec = FrameDecoder()
    dec.receive_data(_prefix(magic=b"GE") + b"\x90")
    with pytest.raises(ProtocolError, match=r"bad magic b'GE'.*not an aiodist peer"):
        dec.next_event()


def test_http_request_is_refused_as_bad_magic() -> None:
    dec = FrameDecoder()
    dec.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(ProtocolError, match="bad magic"):
        dec.next_event()


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, 255])
def test_wrong_version_raises(version: int) -> None:
    dec = FrameDecoder()
    dec.receive_data(_prefix(version=version) + b"\x90")
    with pytest.raises(ProtocolError) as info:
        dec.next_event()
    assert f"protocol version {version} is not supported" in str(info.value)
    assert f"speaks {PROTOCOL_VERSION}" in str(info.value)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1", id="reserved-byte"),
        pytest.param(b"\x92\x01", id="truncated-array"),
        pytest.param(b"\x01\x02", id="extra-data"),
        pytest.param(b"\xa2\xff\xfe", id="invalid-utf8"),
        pytest.param(b"\x81\x90\x01", id="unhashable-key"),
    ],
)
def test_undecodable_header_raises(body: bytes) -> None:
    dec = FrameDecoder()
    dec.receive_data(_prefix(Join.KIND, len(body)) + body)
    with pytest.raises(ProtocolError, match="undecodable Join header") as info:
        dec.next_event()
    assert info.value.__cause__ is not None


def test_undecodable_header_of_unknown_kind_names_the_number() -> None:
    dec = FrameDecoder()
    dec.receive_data(_prefix(200, 1) + b"\xc1")
    with pytest.raises(ProtocolError, match="undecodable kind-200 header"):
        dec.next_event()


ONE_FRAME = b"".join(encode_frame(Data.KIND, [1, 2, 3], b"0123456789"))


@pytest.mark.parametrize(
    "cut",
    [1, PREFIX.size - 1, PREFIX.size, PREFIX.size + 2, len(ONE_FRAME) - 10, len(ONE_FRAME) - 1],
)
def test_eof_inside_a_frame_raises(cut: int) -> None:
    dec = FrameDecoder()
    dec.receive_data(ONE_FRAME[:cut])
    _drain(dec)
    dec.receive_data(b"")
    with pytest.raises(ProtocolError, match="closed in the middle of a frame"):
        dec.next_event()


def test_eof_inside_a_consumed_payload_raises() -> None:
    dec = FrameDecoder()
    dec.receive_data(ONE_FRAME[: len(ONE_FRAME) - 10])
    assert isinstance(dec.next_event(), Frame)
    dec.consume_payload(9)
    dec.receive_data(b"")
    with pytest.raises(ProtocolError, match="middle of a frame"):
        dec.next_event()


def test_clean_eof_is_closed() -> None:
    dec = FrameDecoder()
    dec.receive_data(b"")
    assert dec.next_event() is CLOSED
    assert dec.next_event() is CLOSED


def test_clean_eof_after_frames_is_closed() -> None:
    dec = FrameDecoder()
    dec.receive_data(ONE_FRAME)
    dec.receive_data(b"")
    assert _reassemble(list(_events_until_closed(dec))) == [(Data.KIND, [1, 2, 3], b"0123456789")]
    assert dec.next_event() is CLOSED


def _events_until_closed(dec: FrameDecoder) -> Iterable[Frame | PayloadChunk]:
    while (event := dec.next_event()) is not CLOSED:
        assert isinstance(event, Frame | PayloadChunk)
        yield event


def test_receive_data_after_eof_raises() -> None:
    dec = FrameDecoder()
    dec.receive_data(b"")
    with pytest.raises(RuntimeError, match="after EOF"):
        dec.receive_data(b"x")


def test_decoder_stays_poisoned_after_an_error() -> None:
    dec = FrameDecoder(LIMITS)
    dec.receive_data(_prefix(payload_nbytes=5000))
    with pytest.raises(ProtocolError) as first:
        dec.next_event()
    # A valid frame afterwards does not revive the connection: its state is unknown.
    dec.receive_data(ONE_FRAME)
    with pytest.raises(ProtocolError) as second:
        dec.next_event()
    assert second.value is first.value
    dec.receive_data(b"")
    with pytest.raises(ProtocolError, match="5000"):
        dec.next_event()


def test_decoder_poisoned_by_bad_magic_after_good_frames() -> None:
    dec = FrameDecoder()
    dec.receive_data(ONE_FRAME + b"XX" + ONE_FRAME[2:])
    events = [dec.next_event(), dec.next_event()]
    assert events == [Frame(Data.KIND, [1, 2, 3], 10), PayloadChunk(b"0123456789")]
    for _ in range(3):
        with pytest.raises(ProtocolError, match="bad magic b'XX'"):
            dec.next_event()


# --- hypothesis ------------------------------------------------------------------------


@st.composite
def _chunked(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` split at random points into non-empty chunks."""
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=20))
    bounds = sorted({0, len(data), *cuts})
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_garbage_only_yields_events_or_protocol_error(data: st.DataObject) -> None:
    prefix = data.draw(
        st.one_of(
            st.just(b""),
            st.builds(
                _prefix,
                st.integers(0, 255),
                st.integers(0, 64),
                st.integers(0, 64),
                magic=st.sampled_from([b"AD", b"AE"]),
                version=st.sampled_from([PROTOCOL_VERSION, 2]),
            ),
        )
    )
    garbage = prefix + data.draw(st.binary(max_size=200))
    chunks = data.draw(_chunked(garbage))
    dec = FrameDecoder(Limits(max_header_bytes=64, max_payload_bytes=64))
    events: list[Frame | PayloadChunk] = []
    error: ProtocolError | None = None
    try:
        for chunk in chunks:
            dec.receive_data(chunk)
            events += _drain(dec)
        dec.receive_data(b"")
        events += _events_until_closed(dec)
    except ProtocolError as exc:
        error = exc
    if error is not None:
        with pytest.raises(ProtocolError) as again:
            dec.next_event()
        assert again.value is error
    else:
        # The garbage happened to be well framed: it must then be consistent.
        decoded = _reassemble(events)
        assert sum(PREFIX.size for _ in decoded) <= len(garbage)
        assert all(len(payload) <= 64 for _, _, payload in decoded)


_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=10,
)
_frames = st.lists(
    st.tuples(st.integers(0, 255), _plain, st.binary(max_size=300)), min_size=1, max_size=6
)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_random_frames_split_at_random_points_round_trip(data: st.DataObject) -> None:
    frames = data.draw(_frames)
    chunks = data.draw(_chunked(_stream(frames)))
    decoded = _reassemble(_feed(chunks))
    # repr tells True from 1 and -0.0 from 0.0, which == does not.
    assert repr(decoded) == repr(frames)


# --- frame_message -------------------------------------------------------------------

MESSAGES: list[Any] = [
    JOIN,
    Leave(req_id=1),
    Heartbeat(),
    StoreSet(req_id=2, key="k", value=b"\x00\x01"),
    StoreWait(req_id=3, keys=pack_keys(["a", "b"]), timeout=1.5),
    StoreCompareSet(req_id=4, key="k", expected=b"", desired=b"v"),
    Barrier(req_id=5, seq=2, timeout=30.0),
    Reply(req_id=6, value={"nested": [1, 2.5, None]}),
    Welcome(
        req_id=7,
        rank=1,
        world_size=2,
        local_rank=0,
        local_size=1,
        host_runs=[[0, 1], [1, 1]],
    ),
    MembersRequest(req_id=8),
    ErrorReply(req_id=0, code=ErrorCode.PROTOCOL, message="bad", details={"rank": 2}),
    MemberFailed(rank=2, host="node-3", pid=4121, reason="missed heartbeats"),
    ServerClosing(reason="shutdown"),
]


@pytest.mark.parametrize(
    ("runs", "problem"),
    [
        pytest.param([[0, 2], [1, 1]], "covers 3 ranks, world_size is 4", id="short"),
        pytest.param([[0, 2], [1, 3]], "covers 5 ranks, world_size is 4", id="long"),
        pytest.param([[0, 4, 1, 1]], "malformed run", id="four-fields"),
        pytest.param([[0, 2, 0], [1, 4]], "malformed run", id="zero-repeat"),
        pytest.param([[0, 1, 2**40]], "covers 1099511627776 ranks", id="huge-repeat"),
        pytest.param([[0, 1, 3], [3, 2]], "covers 5 ranks, world_size is 4", id="repeat-long"),
        pytest.param([[0, 0], [1, 4]], "malformed run", id="empty-run"),
        pytest.param([[0, True], [1, 3]], "malformed run", id="bool-count"),
        pytest.param([["h", 4]], "malformed run", id="str-host"),
    ],
)
def test_welcome_host_ids_malformed_runs_raise(runs: list[list[Any]], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Welcome(1, 0, 4, 0, 1, runs).host_ids()


def test_welcome_host_ids_expands_runs_in_rank_order() -> None:
    assert Welcome(1, 0, 5, 0, 2, [[1, 2], [0, 3]]).host_ids() == [1, 1, 0, 0, 0]


def test_welcome_host_ids_expand_repeated_runs_over_consecutive_hosts() -> None:
    ids = Welcome(1, 0, 7, 0, 2, [[4, 2, 3], [0, 1]]).host_ids()
    assert ids == [4, 4, 5, 5, 6, 6, 0]
    assert ids.runs == 4


@pytest.mark.parametrize(
    "hosts",
    [
        [0] * 5,
        [i // 8 for i in range(64)],
        [0, 0, 1, 1, 2, 2, 0],
        [3, 3, 0, 3, 3, 3, 3],
        [0, 1, 1, 2, 2, 3, 4, 4, 4],
        [2, 1, 0],
    ],
)
def test_pack_host_runs_round_trips_through_host_ids(hosts: list[int]) -> None:
    runs = pack_host_runs(hosts)
    assert Welcome(1, 0, len(hosts), 0, 1, runs).host_ids() == hosts


def test_pack_host_runs_is_one_run_when_every_host_holds_as_many_ranks() -> None:
    assert pack_host_runs(i // 8 for i in range(65536)) == [[0, 8, 8192]]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_frame_message_round_trip(msg: Any) -> None:
    frame = _decode_one(encode_message(msg))
    assert frame.kind == msg.KIND
    assert frame.payload_nbytes == 0
    decoded = frame_message(frame)
    assert type(decoded) is type(msg)
    assert decoded == msg


def test_frame_message_with_payload_round_trip() -> None:
    msg = StoreSet(req_id=2, key="k", value=b"v")
    parts = encode_message(msg, b"payload")
    assert parts[1] == b"payload"
    events = _feed(parts)
    assert isinstance(events[0], Frame)
    assert frame_message(events[0]) == msg
    assert events[1:] == [PayloadChunk(b"payload")]


@pytest.mark.parametrize("kind", [0, 14, 200, 95])
def test_frame_message_unknown_kind_raises(kind: int) -> None:
    frame = _decode_one(encode_frame(kind, [1]))
    with pytest.raises(ProtocolError, match=f"unknown message kind {int(kind)}"):
        frame_message(frame)


def _with_header(msg: Any, edit: Any) -> Frame:
    header = message_header(msg)
    edit(header)
    return _decode_one(encode_frame(msg.KIND, header))


@pytest.mark.parametrize(
    ("msg", "edit"),
    [
        pytest.param(JOIN, lambda h: h.pop(), id="Join-short"),
        pytest.param(JOIN, lambda h: h.append(0), id="Join-long"),
        pytest.param(Leave(req_id=1), lambda h: h.clear(), id="Leave-empty"),
        pytest.param(Heartbeat(), lambda h: h.append(1), id="Heartbeat-long"),
        pytest.param(ServerClosing("x"), lambda h: h.extend(["y", "z"]), id="ServerClosing-long"),
    ],
)
def test_frame_message_wrong_field_count_raises(msg: Any, edit: Any) -> None:
    frame = _with_header(msg, edit)
    n_fields = len(message_header(msg))
    with pytest.raises(ProtocolError) as info:
        frame_message(frame)
    text = str(info.value)
    assert f"malformed {type(msg).__name__} message" in text
    assert f"{type(msg).__name__} has {n_fields} fields, frame carries {len(frame.header)}" in text


def _set(index: int, value: Any) -> Any:
    def edit(header: list[Any]) -> None:
        header[index] = value

    return edit


@pytest.mark.parametrize(
    ("msg", "edit", "expected"),
    [
        pytest.param(JOIN, _set(3, "0"), "Join.rank must be int, got str", id="Join-rank-str"),
        pytest.param(JOIN, _set(7, "10"), "Join.heartbeat_timeout must be float/int", id="Join-hb"),
        pytest.param(JOIN, _set(6, "h:1"), "Join.addresses must be list, got str", id="Join-addr"),
        pytest.param(
            JOIN, _set(6, ["ok", 5]), "Join.addresses has items of the wrong type", id="Join-item"
        ),
        pytest.param(Leave(1), _set(0, None), "Leave.req_id must be int, got NoneType", id="Leave"),
        pytest.param(
            StoreSet(1, "k", b"v"), _set(2, "v"), "StoreSet.value must be bytes, got str", id="Set"
        ),
        pytest.param(
            StoreCheck(1, ["a"]),
            _set(1, [b"a"]),
            "StoreCheck.keys has items of the wrong type",
            id="StoreCheck-items",
        ),
        pytest.param(
            Welcome(1, 0, 1, 0, 1, [[0, 1]]),
            _set(1, True),
            "Welcome.rank must be int, got bool",
            id="bool",
        ),
        pytest.param(
            StoreWait(1, b"", 1.0), _set(2, False), "StoreWait.timeout must be float/int", id="f"
        ),
        pytest.param(
            ErrorReply(0, 2, "m", {}), _set(3, [1]), "ErrorReply.details must be dict", id="Error"
        ),
        pytest.param(
            MemberFailed(1, "h", 2, "r"), _set(0, 1.0), "MemberFailed.rank must be int", id="Failed"
        ),
    ],
)
def test_frame_message_wrong_field_type_raises(msg: Any, edit: Any, expected: str) -> None:
    frame = _with_header(msg, edit)
    with pytest.raises(ProtocolError, match=f"malformed {type(msg).__name__} message") as info:
        frame_message(frame)
    assert expected in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


def test_packed_field_is_spliced_and_decodes_as_the_plain_value() -> None:
    table = [[0, 0, "h0", 10, ["tcp://h0:1"]], [1, 0, "h1", 11, ["x" * 20_000]]]
    packed = Packed(msgpack.packb(table, use_bin_type=True))
    parts = encode_message(Reply(req_id=9, value=packed))
    assert any(part is packed.data for part in parts)  # a big table is not copied
    msg = frame_message(_decode_one(parts))
    assert msg == Reply(req_id=9, value=table)
    small = encode_message(Reply(req_id=9, value=Packed(msgpack.packb([1, "a"]))))
    assert frame_message(_decode_one(small)) == Reply(req_id=9, value=[1, "a"])


def test_frame_message_header_not_an_array_raises() -> None:
    frame = _decode_one(encode_frame(Leave.KIND, {"req_id": 1}))
    with pytest.raises(ProtocolError, match="Leave header must be an array, got dict"):
        frame_message(frame)


def test_frame_message_accepts_int_for_float_field() -> None:
    frame = _with_header(JOIN, _set(8, 300))
    msg = frame_message(frame)
    assert msg.timeout == 300
    assert msg == JOIN


def test_welcome_host_ids_index_like_the_list_they_stand_for() -> None:
    runs = [[3, 2], [0, 1], [3, 4]]  # a host may come back after another
    ids = Welcome(1, 0, 7, 0, 6, runs).host_ids()
    expanded = [3, 3, 0, 3, 3, 3, 3]
    assert len(ids) == 7
    assert [ids[r] for r in range(7)] == expanded
    assert ids[-1] == 3
    assert ids[1:4] == [3, 0, 3]
    with pytest.raises(IndexError):
        ids[7]


def test_members_failed_names_each_failure_and_refuses_a_malformed_entry() -> None:
    good = MembersFailed([[1, "node-1", 11, "connection lost"], [3, "node-0", 13, "silent"]])
    assert good.each() == [
        MemberFailed(1, "node-1", 11, "connection lost"),
        MemberFailed(3, "node-0", 13, "silent"),
    ]
    frame = _decode_one(encode_message(good))
    assert frame_message(frame) == good
    for entry in ([1, "h", 11], [True, "h", 1, "r"], [1, b"h", 1, "r"], "x", [1, "h", 1, None]):
        with pytest.raises(ValueError, match="malformed entry"):
            MembersFailed([entry]).each()
