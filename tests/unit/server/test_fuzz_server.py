"""Fuzz the real rendezvous server over real sockets with hypothesis.

Whatever a connection sends (random bytes, bad prefixes, truncated and
oversized frames, well-formed messages with wild fields or in the wrong order),
the server closes at most that connection, logs nothing worse than a warning,
keeps no state for it, and still forms a new job afterwards.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import typing
from typing import TYPE_CHECKING, Any

import anyio
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiodist
from aiodist import serve_rendezvous
from aiodist._errors import ProtocolError
from aiodist._wire.frame import MAGIC, PREFIX, PROTOCOL_VERSION, encode_frame
from aiodist._wire.headers import MESSAGES, _decode_checked, _spec, message_fields
from aiodist.testing import run_ranks
from tests.integration.test_security import RawPeer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from aiodist import ProcessGroup, RendezvousServer

FUZZ = settings(
    max_examples=120,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --- strategies ---------------------------------------------------------------------------

_ints = st.one_of(st.integers(-3, 70), st.integers(-(2**63), 2**64 - 1))
_floats = st.one_of(st.floats(-5, 5), st.sampled_from([float("nan"), float("inf"), -1.0, 1e308]))
_scalars = st.one_of(
    st.none(), st.booleans(), _ints, _floats, st.text(max_size=12), st.binary(max_size=40)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


def _field(tp: Any) -> st.SearchStrategy[Any]:
    """Values that fit a message field's type, edge cases first, or anything at all."""
    fitting: st.SearchStrategy[Any]
    if tp is int:
        fitting = _ints
    elif tp is float:
        fitting = _floats
    elif tp is str:
        fitting = st.one_of(st.sampled_from(["job", "", "k"]), st.text(max_size=300))
    elif tp is bytes:
        fitting = st.binary(max_size=64)
    elif typing.get_origin(tp) is list:
        fitting = st.lists(st.text(max_size=6), max_size=6)
    else:
        fitting = _values
    return st.one_of(fitting, fitting, _values)  # mostly the right type


@st.composite
def _message_frames(draw: st.DrawFn) -> bytes:
    """One frame of any kind: a message with fitting or wild fields, or a bad header."""
    kind = draw(st.sampled_from([*MESSAGES.classes, 0, 14, 255]))
    cls = MESSAGES.classes.get(kind)
    if cls is not None and draw(st.booleans()):
        hints = typing.get_type_hints(cls)
        header: Any = [draw(_field(hints[name])) for name, _ in message_fields(cls)]
        if draw(st.integers(0, 9)) == 0:
            header = header[: draw(st.integers(0, len(header)))]  # too few fields
    else:
        header = draw(st.one_of(st.lists(_values, max_size=10), _values))
    payload = draw(st.one_of(st.none(), st.binary(min_size=1, max_size=16)))
    return b"".join(bytes(p) for p in encode_frame(int(kind), header, payload))


@st.composite
def _headers(draw: st.DrawFn) -> tuple[Any, list[Any]]:
    """A declared class and a header for it: fitting or wild fields, sometimes too few."""
    cls = draw(st.sampled_from(list(MESSAGES.classes.values())))
    hints = typing.get_type_hints(cls)
    header = [draw(_field(hints[name])) for name, _ in message_fields(cls)]
    if draw(st.integers(0, 9)) == 0:
        header = header[: draw(st.integers(0, len(header)))]
    return cls, header


@FUZZ
@given(_headers())
def test_quick_and_long_decoding_agree_on_any_header(drawn: tuple[Any, list[Any]]) -> None:
    # The generated checks accept exactly what the long way accepts, and make the same object.
    cls, header = drawn
    spec = _spec(cls)
    try:
        slow = _decode_checked(spec, header)
    except (ValueError, ProtocolError):  # a wrong type or count; a value out of range
        slow = None
    quick = spec.accept(header)
    assert (quick is None) == (slow is None), (cls.__name__, header)
    if quick is not None:
        assert quick == slow


@st.composite
def _bad_prefixes(draw: st.DrawFn) -> bytes:
    """A prefix with a wrong magic, version or announced length, then some bytes."""
    magic = draw(st.sampled_from([MAGIC, b"XX", b"\0\0"]))
    version = draw(st.sampled_from([PROTOCOL_VERSION, 0, PROTOCOL_VERSION + 1, 255]))
    kind = draw(st.integers(0, 255))
    header_nbytes = draw(st.sampled_from([0, 1, 5, 2**20 + 1, 2**32 - 1]))
    payload_nbytes = draw(st.sampled_from([0, 1, 2**40, 2**64 - 1]))
    body = draw(st.binary(max_size=32))
    return PREFIX.pack(magic, version, kind, header_nbytes, payload_nbytes) + body


@st.composite
def _streams(draw: st.DrawFn) -> list[bytes]:
    """What one connection sends, cut into chunks at arbitrary points."""
    pieces = draw(
        st.lists(
            st.one_of(
                _message_frames(), _message_frames(), _bad_prefixes(), st.binary(max_size=64)
            ),
            min_size=1,
            max_size=6,
        )
    )
    data = b"".join(pieces)
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]  # truncated mid-frame
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=4)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


# --- harness ------------------------------------------------------------------------------


class _LoopErrors:
    """Errors the event loop saw (a protocol callback that raised)."""

    def __init__(self) -> None:
        self.contexts: list[dict[str, Any]] = []

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.contexts.append(context)


@pytest.fixture
async def watched_server(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[RendezvousServer, _LoopErrors]]:
    errors = _LoopErrors()
    loop = asyncio.get_running_loop()
    old = loop.get_exception_handler()
    loop.set_exception_handler(errors)
    token = getattr(request, "param", None)
    try:
        async with anyio.create_task_group() as tg:
            yield await tg.start(functools.partial(serve_rendezvous, token=token)), errors
            tg.cancel_scope.cancel()
    finally:
        loop.set_exception_handler(old)


async def _send_and_drain(server: RendezvousServer, chunks: list[bytes]) -> None:
    peer = await RawPeer.connect(f"tcp://{server.address[0]}:{server.address[1]}")
    try:
        for chunk in chunks:
            await peer.send(chunk)
        if not peer.writer.is_closing() and peer.writer.can_write_eof():
            try:
                peer.writer.write_eof()
            except OSError:
                pass
        with anyio.fail_after(10):  # the server answers EOF by closing: no example hangs
            while await peer.reader.read(65536):
                pass
    except ConnectionError:
        pass  # the server cut it off mid-send: allowed
    finally:
        peer.close()


async def _assert_still_serves(server: RendezvousServer, errors: _LoopErrors) -> None:
    with anyio.fail_after(10):
        await server.wait_until(lambda s: s.num_connections == 0 and not s.state.jobs)
    assert not errors.contexts, errors.contexts

    async def body(g: ProcessGroup) -> tuple[int, bytes]:
        await g.store.set(f"k{g.rank}", b"v%d" % g.rank)
        await aiodist.barrier(group=g)
        return await g.store.add("n", 1), await g.store.get(f"k{(g.rank + 1) % 3}")

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 3, body, group_name="after-fuzz")
    assert sorted(o[0] for o in outs) == [1, 2, 3]
    assert [o[1] for o in outs] == [b"v1", b"v2", b"v0"]


def _no_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


@pytest.mark.parametrize("watched_server", [None, "fuzz-token"], indirect=True)
async def test_server_survives_arbitrary_connections(
    watched_server: tuple[RendezvousServer, _LoopErrors], caplog: pytest.LogCaptureFixture
) -> None:
    server, errors = watched_server

    # hypothesis draws the inputs (it cannot drive a coroutine); the loop sends them.
    streams: list[list[bytes]] = []

    @FUZZ
    @given(chunks=_streams())
    def draw(chunks: list[bytes]) -> None:
        streams.append(chunks)

    draw()
    assert len(streams) >= FUZZ.max_examples // 2
    with caplog.at_level(logging.WARNING, logger="aiodist"):
        for chunks in streams:
            await _send_and_drain(server, chunks)
        await _assert_still_serves_with(server, errors)
    _no_errors_logged(caplog)


async def _assert_still_serves_with(server: RendezvousServer, errors: _LoopErrors) -> None:
    if server.token is None:
        await _assert_still_serves(server, errors)
        return
    with anyio.fail_after(10):
        await server.wait_until(lambda s: s.num_connections == 0 and not s.state.jobs)
    assert not errors.contexts, errors.contexts


async def test_bad_frame_closes_only_that_connection_with_a_log_line(
    server: RendezvousServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def member(g: ProcessGroup) -> bytes:
        await g.store.set(f"r{g.rank}", b"x")
        await aiodist.barrier(group=g)
        if g.rank == 0:  # a bad connection comes and goes while the job runs
            bad = PREFIX.pack(MAGIC, PROTOCOL_VERSION + 1, 1, 0, 0)
            await _send_and_drain(server, [bad + msgpack.packb([1])])
        await aiodist.barrier(group=g)
        return await g.store.get("r1")

    with caplog.at_level(logging.WARNING, logger="aiodist"), anyio.fail_after(10):
        outs = await run_ranks(server.address, 2, member)
    assert outs == [b"x", b"x"]
    assert any(
        "closing connection from 127.0.0.1:" in r.getMessage() and "version" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
