"""The data plane's sans-IO core: feed events, assert actions and settled receives.

No socket, no loop: a ``PlaneCore`` records what it asks of the I/O in ``actions``;
frames go in through a ``ChannelState``, as a transport would hand them over.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist._errors import AuthenticationError, ProtocolError, RankFailedError
from aiodist._plane.bulk import BULK_MIN_BYTES
from aiodist._plane.channel import ChannelState
from aiodist._plane.core import PeerState, PlaneCore
from aiodist._plane.receives import Received
from aiodist._wire.frame import Frame
from aiodist._wire.handshake import Role, TokenHandshake, peer_binding
from aiodist._wire.keys import MatchKind
from aiodist._wire.messages import Data, PeerAbort, PeerAnnounce, PeerAuth, PeerBye, PeerHello

TOKEN = "job-token"
KEY = (MatchKind.COLLECTIVE, 0, 1, 0)


class Chan:
    """A channel as the core sees it: a handle with a name, never used (the actions say)."""

    def __init__(self, peer: str = "peer") -> None:
        self.peer = peer

    def __repr__(self) -> str:
        return f"Chan({self.peer})"

    async def send(self, kind: int, header: object, payload: object = None) -> None:
        raise AssertionError("the sans-IO core never writes itself")

    def send_nowait(self, kind: int, header: object, payload: object = None) -> None:
        raise AssertionError("the sans-IO core never writes itself")

    def handshake_done(self) -> None:
        raise AssertionError("the sans-IO core asks for it with the proved action")

    def close(self) -> None:
        raise AssertionError("the sans-IO core never closes a channel itself")

    def abort(self) -> None:
        raise AssertionError("the sans-IO core asks for it with the abort action")


def _core(rank: int = 0, world_size: int = 4, token: str | None = None) -> PlaneCore:
    core = PlaneCore("job", token)
    core.set_rank(rank, world_size)
    return core


def _state(core: PlaneCore, rank: int) -> PeerState:
    return core.peers[rank].state


def _take(core: PlaneCore) -> list[tuple[Any, ...]]:
    actions, core.actions = core.actions, []
    return actions


def _open(core: PlaneCore, src: int) -> tuple[ChannelState, Chan]:
    """A channel from ``src`` that said hello (no token): proved at once."""
    side, chan = ChannelState(core), Chan(f"rank{src}")
    side.frame_received(chan, Frame(PeerHello.KIND, ["job", src, 1, 0, None], 0))
    return side, chan


def _deliver(side: ChannelState, chan: Chan, key: tuple[int, ...], meta: Any, data: bytes) -> None:
    """A DATA frame and its payload, as a transport hands them to the sink."""
    frame = Frame(Data.KIND, [*key, meta], len(data))
    dest = side.frame_received(chan, frame)
    if data:
        assert dest is not None
        dest[:] = data
    side.payload_received(chan, frame)


class Outcomes:
    """Callbacks that keep what settled each receive."""

    def __init__(self) -> None:
        self.got: list[Received | BaseException] = []

    def __call__(self, outcome: Received | BaseException) -> None:
        self.got.append(outcome)


# --- handshakes and peer states ---------------------------------------------------------------


def test_hello_without_token_proves_the_channel_and_opens_the_peer() -> None:
    core = _core()
    side, chan = _open(core, 2)
    assert _take(core) == [("proved", chan)]
    assert side.src == 2
    assert core.routes == {2: chan}
    assert _state(core, 2) is PeerState.OPEN


def test_data_before_the_hello_is_a_protocol_error() -> None:
    core = _core()
    side = ChannelState(core)
    with pytest.raises(ProtocolError, match="DATA before PeerHello"):
        side.frame_received(Chan(), Frame(Data.KIND, [*KEY, None], 0))


def test_accepting_side_runs_the_responder_half_of_the_token_handshake() -> None:
    core = _core(rank=1, token=TOKEN)
    side, chan = ChannelState(core), Chan()
    connector = TokenHandshake(Role.CHALLENGER, TOKEN, peer_binding("job", 3, 1))
    hello = ["job", 3, 1234, 0, connector.challenge()]
    side.frame_received(chan, Frame(PeerHello.KIND, hello, 0))
    ((what, where, kind, (nonce, proof)),) = _take(core)
    assert (what, where, kind) == ("write", chan, PeerAuth.KIND)
    assert side.src is None  # nothing it sends is trusted yet
    assert 3 not in core.peers  # a claim moves no peer's state
    answer = connector.check_answer(nonce, proof)
    side.frame_received(chan, Frame(PeerAuth.KIND, [b"", answer], 0))
    assert _take(core) == [("proved", chan)]
    assert _state(core, 3) is PeerState.OPEN


def test_accepting_side_doubts_a_claim_whose_proof_is_wrong() -> None:
    core = _core(rank=1, token=TOKEN)
    side, chan = ChannelState(core), Chan()
    stranger = TokenHandshake(Role.CHALLENGER, "another", peer_binding("job", 3, 1))
    hello = ["job", 3, 1234, 0, stranger.challenge()]
    side.frame_received(chan, Frame(PeerHello.KIND, hello, 0))
    _take(core)
    with pytest.raises(ProtocolError, match="failed to prove"):
        side.frame_received(chan, Frame(PeerAuth.KIND, [b"", b"x" * 32], 0))
    assert _take(core) == [("probe", 3)]  # ask rank 3 itself: the claim alone breaks nothing
    assert 3 not in core.refused


def test_connecting_side_runs_the_challenger_half_and_opens_on_the_proof() -> None:
    core = _core(rank=0, token=TOKEN)
    core.connect_started(2)
    assert _state(core, 2) is PeerState.CONNECTING
    side, chan = ChannelState(core), Chan()
    side.connect(chan, 2)
    assert _state(core, 2) is PeerState.PROVING
    ((what, where, kind, hello),) = _take(core)
    assert (what, where, kind) == ("write", chan, PeerHello.KIND)
    acceptor = TokenHandshake(Role.RESPONDER, TOKEN, peer_binding("job", 0, 2))
    nonce, proof = acceptor.answer(hello[4])
    side.frame_received(chan, Frame(PeerAuth.KIND, [nonce, proof], 0))
    (write, proved, connected) = _take(core)
    assert write[:3] == ("write", chan, PeerAuth.KIND)
    acceptor.check_proof(write[3][1])
    assert proved == ("proved", chan)
    assert connected == ("connected", chan, None)
    core.connect_ended(2)
    assert _state(core, 2) is PeerState.OPEN


@pytest.mark.parametrize(("theirs", "holds"), [(None, "holds no token"), ("x", "another one")])
def test_connecting_side_refuses_an_acceptor_that_cannot_prove_the_token(
    theirs: str | None, holds: str
) -> None:
    core = _core(rank=0, token=TOKEN)
    waiting = Outcomes()
    core.post(2, KEY, None, waiting)
    side, chan = ChannelState(core), Chan("10.0.0.2:4000")
    side.connect(chan, 2)
    hello = _take(core)[0][3]
    if theirs is None:
        answer = [b"", b""]  # how a rank without a token answers
    else:
        answer = list(
            TokenHandshake(Role.RESPONDER, theirs, peer_binding("job", 0, 2)).answer(hello[4])
        )
    side.frame_received(chan, Frame(PeerAuth.KIND, answer, 0))
    (refused, connected) = _take(core)
    assert refused[0] == "refused_peer"
    exc = refused[1]
    assert isinstance(exc, AuthenticationError)
    assert exc.rank == 2
    assert holds in str(exc)
    assert "10.0.0.2:4000" in str(exc)
    assert connected == ("connected", chan, exc)
    assert _state(core, 2) is PeerState.FAILED
    later = Outcomes()
    core.post(2, KEY, None, later)
    assert later.got == [exc]  # refused for good: at once


def test_goodbye_then_close_makes_the_peer_leave_after_its_last_message() -> None:
    core = _core()
    side, chan = _open(core, 1)
    _take(core)
    waiting = Outcomes()
    core.post(1, (MatchKind.P2P, 0, 0, 0), None, waiting)
    side.frame_received(chan, Frame(PeerBye.KIND, [], 0))
    assert _take(core) == [("write", chan, PeerBye.KIND, [])]  # answered
    side.channel_closed(chan, None)
    assert _take(core) == [("bye_heard", 1)]  # the session names the error
    core.peer_left(1, RankFailedError("rank 1 left", rank=1))
    assert _state(core, 1) is PeerState.LEFT
    assert len(waiting.got) == 1
    assert isinstance(waiting.got[0], RankFailedError)
    later = Outcomes()
    core.post(1, KEY, None, later)
    assert later.got == waiting.got  # fails at once, with the same error


def test_server_word_of_a_leave_waits_for_the_open_channel() -> None:
    core = _core()
    side, chan = _open(core, 1)
    waiting = Outcomes()
    core.post(1, KEY, None, waiting)
    core.peer_left(1, RankFailedError("rank 1 left", rank=1))
    assert _state(core, 1) is PeerState.LEAVING
    _deliver(side, chan, KEY, "last", b"bytes")  # what it sent before leaving still lands
    assert [(m.meta, bytes(m.data)) for m in waiting.got if isinstance(m, Received)] == [
        ("last", b"bytes")
    ]
    side.channel_closed(chan, None)
    assert _state(core, 1) is PeerState.LEFT


def test_channel_lost_without_goodbye_asks_who_failed() -> None:
    core = _core()
    side, chan = _open(core, 3)
    _take(core)
    side.channel_closed(chan, ConnectionResetError("reset"))
    assert _take(core) == [("lost", 3, "its data connection closed (reset)")]
    assert _state(core, 3) is PeerState.IDLE
    assert core.routes == {}


def test_early_hello_with_a_token_is_answered_once_the_rank_is_known() -> None:
    core = PlaneCore("job", TOKEN)
    side, chan = ChannelState(core), Chan()
    connector = TokenHandshake(Role.CHALLENGER, TOKEN, peer_binding("job", 2, 0))
    hello = ["job", 2, 1234, 0, connector.challenge()]
    side.frame_received(chan, Frame(PeerHello.KIND, hello, 0))
    assert _take(core) == []  # this rank's own rank is not known yet
    core.set_rank(0, 3)
    ((what, _, kind, (nonce, proof)),) = _take(core)
    assert (what, kind) == ("write", PeerAuth.KIND)
    connector.check_answer(nonce, proof)  # bound to ranks 2 and 0


# --- matching and failures ---------------------------------------------------------------------


def test_payload_lands_in_the_posted_receives_memory() -> None:
    core = _core()
    side, chan = _open(core, 1)
    dest = memoryview(bytearray(5))
    got = Outcomes()
    core.post(1, KEY, dest, got)
    _deliver(side, chan, KEY, {"dtype": "u8"}, b"hello")
    (msg,) = got.got
    assert isinstance(msg, Received)
    assert msg.data is dest
    assert bytes(dest) == b"hello"


def test_message_before_its_receive_is_buffered_then_copied_in() -> None:
    core = _core()
    side, chan = _open(core, 1)
    _deliver(side, chan, KEY, None, b"early")
    assert core.matcher.num_unexpected == 1
    dest = memoryview(bytearray(5))
    got = Outcomes()
    core.post(None, KEY, dest, got)  # any source
    (msg,) = got.got
    assert isinstance(msg, Received)
    assert (msg.src, bytes(dest), msg.data is dest) == (1, b"early", True)


def test_failure_reaches_a_receive_whose_payload_is_arriving() -> None:
    core = _core()
    side, chan = _open(core, 1)
    got = Outcomes()
    core.post(1, KEY, memoryview(bytearray(4)), got)
    side.frame_received(chan, Frame(Data.KIND, [*KEY, None], 4))
    assert core.matcher.arrive(1, KEY) is None  # it left the matcher
    error = RankFailedError("rank 1 failed", rank=1)
    core.fail(error, group_id=0)
    assert got.got == [error]
    side.payload_received(chan, Frame(Data.KIND, [*KEY, None], 4))
    assert got.got == [error]  # settled once


def test_dropped_call_fails_its_receives_and_drops_its_late_messages() -> None:
    core = _core()
    side, chan = _open(core, 1)
    got = Outcomes()
    core.post(1, KEY, None, got)
    error = RuntimeError("aborted")
    core.drop_call(0, 1, error)
    assert got.got == [error]
    _deliver(side, chan, KEY, None, b"late")
    assert core.matcher.num_unexpected == 0


def test_abort_message_fails_the_receive_it_matches() -> None:
    core = _core()
    side, chan = _open(core, 1)
    got = Outcomes()
    core.post(1, KEY, None, got)
    header = [*map(int, KEY), 1, "bad dtype", "isend"]  # as msgpack decodes it
    side.frame_received(chan, Frame(PeerAbort.KIND, header, 0))
    (exc,) = got.got
    assert isinstance(exc, BaseException)
    assert "bad dtype" in str(exc)


# --- large payloads (bulk.py) --------------------------------------------------------------------


def test_announced_payload_is_cleared_by_its_receive_and_lands_in_place() -> None:
    core = _core(rank=1)
    side, chan = _open(core, 0)
    _take(core)
    key = (MatchKind.P2P, 0, 7, 0)
    n = BULK_MIN_BYTES
    announcement = [*map(int, key), "meta", 5, n]  # as msgpack decodes it
    side.frame_received(chan, Frame(PeerAnnounce.KIND, announcement, 0))
    assert len(core.bulk.held) == 1
    assert _take(core) == []  # held: nothing moves until the receive is posted
    dest = memoryview(bytearray(n))
    got = Outcomes()
    core.post(0, key, dest, got)
    clear = [MatchKind.CLEAR, 0, 5, 0, 0]
    assert _take(core) == [("send_to", 0, Data.KIND, clear)]
    payload = bytes(range(256)) * (n // 256)
    _deliver(side, chan, (MatchKind.BULK, 0, 5, 0), None, payload)
    (msg,) = got.got
    assert isinstance(msg, Received)
    assert (msg.meta, msg.data is dest, bytes(dest) == payload) == ("meta", True, True)


def test_large_receive_posted_first_credits_its_sender() -> None:
    core = _core(rank=1)
    core.post(0, (MatchKind.P2P, 0, 3, 0), memoryview(bytearray(BULK_MIN_BYTES)), Outcomes())
    credit = [MatchKind.CREDIT, 0, 3, BULK_MIN_BYTES, None]
    assert _take(core) == [("send_to", 0, Data.KIND, credit)]
    # The sender's side: the credit lets the send go without announcing.
    sender = _core(rank=0)
    side, chan = _open(sender, 1)
    side.frame_received(chan, Frame(Data.KIND, credit, 0))
    key = (MatchKind.P2P, 0, 3, 0)
    assert sender.bulk.take_credit(1, key, BULK_MIN_BYTES)
    assert not sender.bulk.take_credit(1, key, BULK_MIN_BYTES)  # one credit, one send


# --- properties ----------------------------------------------------------------------------------

_events = st.lists(
    st.tuples(st.sampled_from(["send", "post", "post_any"]), st.integers(0, 2), st.integers(0, 1)),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(events=_events)
def test_messages_match_receives_in_send_order_each_exactly_once(
    events: list[tuple[str, int, int]],
) -> None:
    # Sources 0..2 send numbered messages on two keys; receives name a source or any.
    core = _core(rank=3)
    sides = {src: _open(core, src) for src in range(3)}
    sent: dict[tuple[int, int], int] = {}
    receives: list[tuple[int | None, int, Outcomes]] = []
    for what, src, k in events:
        key = (MatchKind.COLLECTIVE, 0, 1, k)
        if what == "send":
            n = sent.get((src, k), 0)
            sent[(src, k)] = n + 1
            side, chan = sides[src]
            _deliver(side, chan, key, [src, k, n], b"")
        else:
            got = Outcomes()
            core.post(src if what == "post" else None, key, None, got)
            receives.append((src if what == "post" else None, k, got))
    delivered: list[list[int]] = []
    for named, k, got in receives:
        assert len(got.got) <= 1
        for msg in got.got:
            assert isinstance(msg, Received)
            assert msg.meta[1] == k
            assert named is None or msg.meta[0] == named
            delivered.append(msg.meta)
    assert len({tuple(m) for m in delivered}) == len(delivered)  # none twice
    for s in range(3):
        for k in range(2):
            numbers = [m[2] for m in delivered if m[0] == s and m[1] == k]
            assert numbers == sorted(numbers)  # non-overtaking
    matched = len(delivered)
    waiting = sum(1 for *_, got in receives if not got.got)
    assert matched + core.matcher.num_unexpected == sum(sent.values())
    assert waiting + matched == len(receives)


_peer_events = st.lists(
    st.sampled_from(["connect", "open", "close", "close_bye", "left", "refuse", "post"]),
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(events=_peer_events)
def test_peer_state_always_says_what_the_plane_knows(events: list[str]) -> None:
    core = _core()
    rank = 1
    open_sides: list[tuple[ChannelState, Chan]] = []
    outcomes: list[Outcomes] = []
    for event in events:
        if event == "connect":
            core.connect_started(rank)
        elif event == "open":
            side, chan = ChannelState(core), Chan()
            side.src = rank
            core.adopt(rank, chan)
            open_sides.append((side, chan))
        elif event.startswith("close") and open_sides:
            side, chan = open_sides.pop(0)
            side.said_bye = event == "close_bye"
            side.channel_closed(chan, None)
        elif event == "left":
            core.peer_left(rank, RankFailedError("left", rank=rank))
        elif event == "refuse":
            core.refuse(rank, "refused")
        elif event == "post":
            got = Outcomes()
            core.post(rank, KEY, None, got)
            outcomes.append(got)
        peer = core.peer(rank)
        state = peer.state
        assert (state is PeerState.FAILED) == (rank in core.refused)
        if state is not PeerState.FAILED:
            assert (state is PeerState.OPEN) == (rank in core.routes and rank not in core.left)
            assert (state is PeerState.LEFT) == (rank in core.left and not peer.channels)
            assert (state is PeerState.LEAVING) == (rank in core.left and bool(peer.channels))
        if state in (PeerState.LEFT, PeerState.FAILED):
            # Nothing more can come from it: no receive from it still waits.
            assert all(got.got for got in outcomes) or state is PeerState.FAILED
        assert all(len(got.got) <= 1 for got in outcomes)
