"""What strangers and absurd values can cost a real `aiodist serve` (issue 28, the daemon's part).

Each test reproduces an attack on a daemon started as a real process, with real
sockets on 127.0.0.1: a stranger without the token is a process of its own
(``tests/helpers/stranger.py``) or raw frames on a socket; a legit job is real clients.

- A stranger holding 1,100 connections, reopened as they are closed, against a
  daemon limited to 1,024 files (soft and hard): a legit job still forms and
  reduces, and the daemon holds a bounded number of descriptors.
- Without a token, a connection that says nothing is closed at the deadline, and
  one announcing a huge header is cut off at once: the daemon's memory stays flat.
- Absurd timeouts (a heartbeat timeout of 1e-9, NaN, infinities, negatives) are
  refused naming the field; the daemon stays idle, and another job's store get
  still times out at its own deadline.
- 2,000 refused connections cost a bounded number of log lines, with counts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import psutil  # type: ignore[import-untyped]  # no stubs; a dev dependency
import pytest
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

import aiodist
from aiodist import DistTimeoutError
from aiodist._errors import ErrorCode
from aiodist._wire.frame import (
    NEED_DATA,
    PREFIX,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    encode_message,
    frame_message,
)
from aiodist._wire.messages import (
    AuthStart,
    Barrier,
    Challenge,
    ErrorReply,
    Heartbeat,
    Join,
    Reply,
    StatusRequest,
    StoreGet,
    StoreWait,
    Welcome,
    pack_keys,
)
from aiodist._wire.preauth import PreAuthLimits
from aiodist.testing import run_ranks
from tests.helpers import ROOT
from tests.helpers.daemon import TOKEN, asyncio_only, serve

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from anyio.abc import SocketStream

pytestmark = [pytest.mark.slow, asyncio_only]

NOFILE = 1024  # systemd's default soft limit, made the hard limit too: it cannot be raised


def _bytes(msg: Any) -> bytes:
    return b"".join(bytes(p) for p in encode_message(msg))


class Stranger:
    """``tests/helpers/stranger.py`` as a process: it holds connections to a daemon."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}


@contextlib.asynccontextmanager
async def stranger(
    address: tuple[str, int], n: int, *, send: bytes = b"", once: bool = False
) -> AsyncIterator[Stranger]:
    """Run a stranger holding ``n`` connections; its counts are read when it ends.

    With ``once``, it ends by itself when the daemon closed every connection;
    otherwise it is stopped when the block ends.
    """
    argv = [sys.executable, "-m", "tests.helpers.stranger", address[0], str(address[1]), str(n)]
    if send:
        argv += ["--send", send.hex()]
    if once:
        argv.append("--once")
    result = Stranger()
    async with await anyio.open_process(argv, cwd=ROOT) as proc:
        assert proc.stdout is not None
        assert proc.stdin is not None
        lines = BufferedByteReceiveStream(proc.stdout)
        try:
            with anyio.fail_after(30):
                ready = json.loads(await lines.receive_until(b"\n", 1 << 16))
            assert ready == {"ready": n}
            yield result
            if not once:
                await proc.stdin.aclose()  # stdin closing stops it
            with anyio.fail_after(60):
                result.counts = json.loads(await lines.receive_until(b"\n", 1 << 16))
                assert await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                with anyio.CancelScope(shield=True):
                    await proc.wait()


class Raw:
    """A socket speaking frames by hand."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder()

    @classmethod
    async def connect(cls, address: tuple[str, int]) -> Raw:
        return cls(await anyio.connect_tcp(*address))

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def next(self) -> Any:
        """The next message, or None once the server closed the connection."""
        while True:
            event = self.decoder.next_event()
            if isinstance(event, Frame):
                return frame_message(event)
            assert event is NEED_DATA, event
            try:
                data = await self.stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return None
            self.decoder.receive_data(data)

    async def until_closed(self) -> list[Any]:
        out = []
        while (msg := await self.next()) is not None:
            out.append(msg)
        return out

    async def aclose(self) -> None:
        await self.stream.aclose()


def _cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


async def _cpu_in(proc: psutil.Process, seconds: float) -> float:
    """CPU time ``proc`` used over the next ``seconds``, a property of what it does."""
    before = _cpu_seconds(proc)
    await anyio.sleep(seconds)  # a measuring window, not a wait for an event
    return _cpu_seconds(proc) - before


async def _all_reduce(g: aiodist.ProcessGroup) -> list[float]:
    out = await aiodist.all_reduce(torch.ones(3) * (g.rank + 1), group=g)
    return [float(x) for x in out]


async def _get_missing(g: aiodist.ProcessGroup) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(DistTimeoutError) as info:
        await g.store.get("missing", timeout=1)
    return str(info.value), time.monotonic() - start


# --- 4: a flood of strangers at the file limit ----------------------------------------------


async def test_stranger_flood_at_fd_limit_legit_job_completes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
    async with serve("--port", "0", env={"AIODIST_TOKEN": TOKEN}, nofile=(NOFILE, NOFILE)) as d:
        daemon = psutil.Process(d.proc.pid)
        assert daemon.rlimit(psutil.RLIMIT_NOFILE) == (NOFILE, NOFILE)
        said = await d.wait_for_line("stderr", lambda line: "file descriptors:" in line)
        assert f"soft limit {NOFILE}, and the hard limit allows no more" in said
        async with stranger(d.address, 1100) as flood:
            # The flood is on: the gate sheds the oldest silent connections.
            await d.wait_for_line("stderr", lambda line: "it was the oldest" in line)
            outs = []
            for _ in range(3):
                with anyio.fail_after(30):
                    outs.append(await run_ranks(d.address, 2, _all_reduce))
            fds = daemon.num_fds()
        lines = len(d.lines["stderr"])
    assert outs == [[[3.0, 3.0, 3.0]] * 2] * 3
    # The strangers' connections were closed as fast as they came: the daemon kept
    # at most its unproved ones (a quarter of 1,024) and a few of its own: far from 1,024.
    pending = PreAuthLimits.for_open_files(1024, share=4, most=1 << 16, deadline=10).max_pending
    assert pending == 256
    assert fds < pending + 64, fds
    assert flood.counts["closed_by_server"] >= 1100 - pending, flood.counts
    assert lines < 100, d.output()


async def test_daemon_raises_its_open_files_limit_to_the_hard_limit() -> None:
    async with serve("--port", "0", nofile=(NOFILE, 4 * NOFILE)) as d:
        said = await d.wait_for_line("stderr", lambda line: "file descriptors:" in line)
        limits = psutil.Process(d.proc.pid).rlimit(psutil.RLIMIT_NOFILE)
    assert f"file descriptors: soft limit raised {NOFILE} -> {4 * NOFILE}" in said
    assert limits == (4 * NOFILE, 4 * NOFILE)


# --- 4: without a token, idle and oversized connections ---------------------------------------


async def test_daemon_without_token_closes_idle_connection_at_deadline() -> None:
    async with serve("--port", "0") as d:
        idle = await Raw.connect(d.address)
        talker = await Raw.connect(d.address)
        await talker.send(_bytes(Heartbeat()))  # a client's first message: its hello
        start = time.monotonic()
        with anyio.fail_after(30):
            said = await idle.until_closed()
        waited = time.monotonic() - start
        await idle.aclose()
        # The client that spoke is served after the idle one's deadline.
        await talker.send(_bytes(StatusRequest(1)))
        with anyio.fail_after(10):
            while isinstance(reply := await talker.next(), Heartbeat):
                pass
        await talker.aclose()
    assert [type(m) for m in said] == [ErrorReply], said
    assert said[0].code == ErrorCode.PROTOCOL
    assert "no request came within 10 s of connecting" in said[0].message
    assert 9.0 <= waited < 20.0, waited
    assert isinstance(reply, Reply)
    assert reply.req_id == 1
    assert "refused a connection from 127.0.0.1" in d.output()


def _flood(
    address: tuple[str, int], first: bytes, chunk: bytes, most: int
) -> tuple[int, list[Any]]:
    """Send ``first``, then ``chunk`` until ``most`` bytes or the server cuts us off.

    A plain blocking socket in a thread: after a reset, the kernel still hands
    out what the server said before it (an asyncio transport drops it when its
    write fails first). Returns the bytes sent and the messages received before
    the server closed the connection (a timeout raises: it was not closed).
    """
    sent = 0
    received = bytearray()
    with socket.create_connection(address, timeout=30) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(first)
            sent = len(first)
            while sent < most:
                sock.sendall(chunk)
                sent += len(chunk)
        with contextlib.suppress(ConnectionResetError):
            while data := sock.recv(1 << 16):
                received += data
    dec = FrameDecoder()
    dec.receive_data(bytes(received))
    msgs = []
    while isinstance(event := dec.next_event(), Frame):
        msgs.append(frame_message(event))
    return sent, msgs


async def test_daemon_cuts_off_huge_unfinished_headers_and_rss_stays_bounded() -> None:
    n, announced = 64, 1 << 20  # before: each buffered (960 KiB here) and kept, for ever
    prefix = PREFIX.pack(b"AD", PROTOCOL_VERSION, Join.KIND, announced, 0)
    async with serve("--port", "0") as d:
        daemon = psutil.Process(d.proc.pid)
        rss_before = daemon.memory_info().rss
        results: list[tuple[int, list[Any]]] = []

        async def one() -> None:
            # 960 KiB of the header, never its end.
            chunk = b"\x90" * (64 << 10)
            flood = functools.partial(_flood, d.address, prefix, chunk, announced - len(chunk))
            results.append(await anyio.to_thread.run_sync(flood))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(n):
                    tg.start_soon(one)
        rss_growth = daemon.memory_info().rss - rss_before
    assert len(results) == n
    limit = f"header of {announced} bytes exceeds the limit of 4096 bytes"
    for _, said in results:
        # Told why, and closed (before: kept open, its header buffered).
        assert [type(m) for m in said] == [ErrorReply], said
        assert limit in said[0].message
        assert said[0].code == ErrorCode.PROTOCOL
    assert rss_growth < 16 << 20, rss_growth  # n MiB before


async def test_daemon_cuts_off_a_stream_of_handshake_frames_at_the_byte_budget() -> None:
    async with serve("--port", "0") as d:
        frame = _bytes(AuthStart())  # answered once; the rest only cost the budget
        flood = functools.partial(_flood, d.address, frame, frame * 256, 16 << 20)
        with anyio.fail_after(60):
            sent, said = await anyio.to_thread.run_sync(flood)
    assert sent < 16 << 20  # cut off, long before
    assert [type(m) for m in said] == [Challenge, ErrorReply], said
    assert said[0].nonce == b""  # no token here: the client holding one refuses this server
    assert said[1].code == ErrorCode.PROTOCOL
    budget = PreAuthLimits().max_bytes
    assert f"over {budget} bytes before the handshake was done" in said[1].message
    assert d.output().count("holds a token but this server requires none") == 1


# --- 5: a heartbeat timeout of 1e-9 -----------------------------------------------------------


async def test_join_absurd_heartbeat_timeout_refused_and_daemon_stays_idle() -> None:
    async with serve("--port", "0") as d:
        daemon = psutil.Process(d.proc.pid)
        raw = await Raw.connect(d.address)
        replies = {}
        with anyio.fail_after(30):
            for req_id, value in enumerate([1e-9, math.nan, math.inf, -1.0, 0.0], start=1):
                join = Join(req_id, "spin", 2, -1, "h", 1, [], value, 30.0)
                await raw.send(_bytes(join))
                replies[value] = await raw.next()
            # Only those requests failed: the connection is served as before.
            await raw.send(_bytes(StatusRequest(99)))
            status = await raw.next()
            cpu = await _cpu_in(daemon, 2.0)
        await raw.aclose()
    for req_id, (value, err) in enumerate(replies.items(), start=1):
        assert isinstance(err, ErrorReply), (value, err)
        assert (err.req_id, err.code) == (req_id, ErrorCode.BAD_REQUEST)
        assert "Join.heartbeat_timeout must be a finite number of seconds in [0.1, " in err.message
        assert f"got {value!r}" in err.message
    assert isinstance(status, Reply)
    assert status.req_id == 99
    assert status.value["jobs"] == []  # no job "spin" was created
    assert cpu < 0.5, cpu  # idle: no sweep spinning every 2.5e-10 s


# --- 6: NaN timeouts and the deadline heap ----------------------------------------------------


async def test_absurd_store_and_barrier_timeouts_refused_and_other_job_get_times_out() -> None:
    async with serve("--port", "0") as d:
        members = [await Raw.connect(d.address) for _ in range(2)]
        with anyio.fail_after(30):
            for rank, raw in enumerate(members):
                await raw.send(_bytes(Join(1, "evil", 2, rank, "h", rank + 1, [], 30.0, 30.0)))
            for raw in members:
                assert isinstance(await raw.next(), Welcome)
            attacks = [
                StoreGet(2, "k", math.nan),
                StoreWait(3, pack_keys(["k"]), math.inf),
                Barrier(4, 1, math.nan),
                StoreGet(5, "k", -1.0),
                Barrier(6, 2, -math.inf),
            ]
            refused = []
            for msg in attacks:
                await members[0].send(_bytes(msg))
                refused.append(await members[0].next())
            ((message, took),) = await run_ranks(d.address, 1, _get_missing)
        for raw in members:
            await raw.aclose()
    for msg, err in zip(attacks, refused, strict=True):
        assert isinstance(err, ErrorReply), (msg, err)
        assert isinstance(msg, StoreGet | StoreWait | Barrier)
        assert (err.req_id, err.code) == (msg.req_id, ErrorCode.BAD_REQUEST)
        name = f"{type(msg).__name__}.timeout"
        assert f"{name} must be a finite number of seconds in [0.001, 31536000]" in err.message
    # Its own deadline, with the server's message: not the client's 6 s give-up.
    assert "store get timed out waiting for keys ['missing']" in message
    assert took < 5.0, took


# --- rate-limited logs ----------------------------------------------------------------------


async def test_refused_stranger_connections_logged_in_bounded_lines() -> None:
    n = 2000
    async with serve("--port", "0", env={"AIODIST_TOKEN": TOKEN}) as d:
        with anyio.fail_after(120):
            async with stranger(d.address, n, send=_bytes(StatusRequest(1)), once=True) as s:
                pass  # each is refused (no proof) or shed; it ends when all are closed
        assert s.counts["closed_by_server"] == n, s.counts
        with anyio.fail_after(30):
            assert await d.stop() == 0  # its last summary is logged on the way out
    full = [line for line in d.lines["stderr"] if "refused a connection from" in line]
    summaries = [line for line in d.lines["stderr"] if "more refused connection" in line]
    assert 1 <= len(summaries) <= 13, d.output()
    assert len(full) <= 5 * len(summaries), d.output()
    summarized = 0
    for line in summaries:
        match = re.search(r"(\d+) more refused connections? in the last .* \((.*)\)", line)
        assert match is not None, line
        counts = dict(part.split(": ") for part in match.group(2).split(", "))
        assert sum(map(int, counts.values())) == int(match.group(1))
        assert set(counts) <= {"token", "shed"}, counts
        summarized += int(match.group(1))
    assert len(full) + summarized == n  # each refusal once: in full, or counted
