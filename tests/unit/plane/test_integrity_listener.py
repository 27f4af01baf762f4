"""Strangers at a rank's data-plane listeners cost it a small, fixed amount (issue 28).

A stranger here is another process on the host: it can find a rank's abstract
Unix socket (``/proc/net/unix`` lists it) or TCP port and send it any bytes.
Before the data plane's handshake nothing it sends is parsed but small hellos:
no shared-memory frame, no big header, no payload. Its connection closes at a
byte budget, at a deadline, or when newer ones shed it, and the refusals are
logged as a few lines and counts. The ranks are real processes of a 2-rank
job with a token; each test checks that the rank's collectives still give the
right results and that its memory and file descriptors are back where they
were once the strangers left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import os
import re
import resource
import socket
import sys
import textwrap
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist import ProtocolError, serve_rendezvous
from aiodist._plane.peers import DataPlane
from aiodist._transport import ringwire, shm, shmring, uds
from aiodist._wire.frame import PROTOCOL_VERSION, encode_frame
from aiodist._wire.keys import MatchKind
from aiodist._wire.messages import Data
from tests.helpers import ROOT as REPO
from tests.helpers.daemon import TOKEN
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from anyio.abc import Process

    from aiodist import RendezvousServer
    from aiodist._transport.base import DataChannel
    from aiodist._wire.frame import Frame

ROOT = str(REPO)
needs_shm = pytest.mark.skipif(not shm.available(), reason="needs Linux and a writable /dev/shm")
# The ranks are processes with loops of their own: the test's loop only drives them.
one_backend = pytest.mark.parametrize("anyio_backend", ["asyncio"])
# What a rank may grow by while strangers come and go (each attack cost it 256 MiB or more).
RSS_SLACK = 32 * 1024 * 1024
GiB = 1 << 30

RANK = textwrap.dedent(
    """
    import json, logging, os, resource, sys
    import anyio, torch
    import aiodist
    from aiodist._group.world import get_default_group

    async def main() -> None:
        url, rank = sys.argv[1], int(sys.argv[2])
        if "TEST_NOFILE" in os.environ:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (int(os.environ["TEST_NOFILE"]), hard))
        if "TEST_DEADLINE" in os.environ:  # how long a stranger may stay silent
            from aiodist._plane import listener
            listener.HANDSHAKE_DEADLINE = float(os.environ["TEST_DEADLINE"])
        if "TEST_LOG_INTERVAL" in os.environ:  # how often refusals are summed up
            from aiodist._transport import admission
            admission.LOG_INTERVAL = float(os.environ["TEST_LOG_INTERVAL"])
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        await aiodist.init_process_group(
            init_method=url, world_size=2, rank=rank, group_name="strangers", timeout=60
        )
        members = await get_default_group().session.members()
        out = {"rank": rank, "pid": os.getpid(), "addresses": list(members[rank].addresses)}
        print(json.dumps(out), flush=True)
        calls = 0
        while (await anyio.to_thread.run_sync(sys.stdin.readline)).strip() == "all_reduce":
            calls += 1
            t = torch.arange(1 << 20, dtype=torch.float32) * (rank + 1) + calls  # 4 MiB
            with anyio.fail_after(30):
                await aiodist.all_reduce(t)
            expected = torch.arange(1 << 20, dtype=torch.float32) * 3 + 2 * calls
            print(json.dumps({"right": bool(torch.equal(t, expected))}), flush=True)
        await aiodist.destroy_process_group()

    if os.environ.get("TEST_UVLOOP"):
        import uvloop
        anyio.run(main, backend_options={"loop_factory": uvloop.new_event_loop})
    else:
        anyio.run(main)
    """
)

# Raw sockets and hand-made frames only: what anyone on the host can send.
STRANGER = textwrap.dedent(
    """
    import json, os, resource, select, socket, struct, sys, time
    import msgpack

    PREFIX = struct.Struct("!2sBBIQ")
    VERSION = @VERSION@  # the protocol version this aiodist speaks

    def frame(kind, header, payload_nbytes=0):
        body = msgpack.packb(header, use_bin_type=True)
        return PREFIX.pack(b"AD", VERSION, kind, len(body), payload_nbytes) + body

    def connect(address):
        if address.startswith("uds:"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # Blocking: with the rank's listen queue full, it waits for room (a socket
            # with a timeout would fail with EAGAIN instead).
            sock.connect("\\0" + address[4:].partition("#")[0])
            sock.settimeout(20)
        else:
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(20)
            sock.connect((host, int(port)))
        return sock

    def closed_by_rank(sock, timeout=20.0):
        # True once the rank closed it: EOF or a reset, and nothing sent back.
        sock.settimeout(timeout)
        try:
            return sock.recv(65536) == b""
        except ConnectionError:
            return True
        except socket.timeout:
            return False

    def report(**out):
        print(json.dumps(out), flush=True)

    mode, address, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    member = int(address.partition("#")[2] or 0)

    if mode == "frames":  # one connection per frame; did the rank close each one?
        closed = []
        for data in args["frames"]:
            sock = connect(address)
            sock.sendall(bytes.fromhex(data))
            closed.append(closed_by_rank(sock))
            sock.close()
        report(closed=closed)

    elif mode == "unfinished_headers":  # rounds of connections announcing huge headers
        closed = 0
        for _ in range(args["rounds"]):
            socks = [connect(address) for _ in range(args["conns"])]
            for sock in socks:
                prefix = PREFIX.pack(b"AD", VERSION, 65, args["header"], 0)  # a DATA frame's
                sock.settimeout(10)
                try:  # all of the header but its last byte, as far as the rank takes it
                    sock.sendall(prefix + bytes(args["header"] - 1))
                except OSError:
                    pass
            closed += sum(closed_by_rank(sock, timeout=1) for sock in socks)
            for sock in socks:
                sock.close()
        report(closed=closed)

    elif mode == "idle":  # connections that never say a word
        socks = [connect(address) for _ in range(args["conns"])]
        poller = select.poll()
        for i, sock in enumerate(socks):
            poller.register(sock, select.POLLIN | select.POLLHUP)
        fileno = {sock.fileno(): i for i, sock in enumerate(socks)}
        gone = set()

        def wait_until(most_open, timeout):
            end = time.monotonic() + timeout
            while len(socks) - len(gone) > most_open and time.monotonic() < end:
                for fd, _ in poller.poll(100):
                    gone.add(fileno[fd])
                    poller.unregister(fd)

        wait_until(args["cap"], 30)
        kept = sorted(set(range(len(socks))) - gone)
        # The shed ones are the oldest: the open ones are the newest (the oldest of them).
        report(held=len(socks), open=len(kept), oldest_open=min(kept, default=len(socks)))
        sys.stdin.readline()  # the job runs a collective meanwhile
        start = time.monotonic()
        wait_until(0, 30)
        report(open=len(socks) - len(gone), waited=round(time.monotonic() - start, 2))

    elif mode == "hellos":  # hellos that prove nothing, one connection each
        hello = frame(64, ["strangers", 0, os.getpid(), member, None])
        closed = 0
        for _ in range(args["conns"]):
            sock = connect(address)
            sock.sendall(hello)
            closed += closed_by_rank(sock)
            sock.close()
        report(closed=closed)
    """
).replace("@VERSION@", str(PROTOCOL_VERSION))


@dataclass
class Rank:
    """A rank process of the job: its pid, addresses, output and stderr lines."""

    proc: Process
    out: BufferedByteReceiveStream
    pid: int = 0
    addresses: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # its stderr, as it comes
    news: anyio.Event = field(default_factory=anyio.Event)  # set on each new stderr line

    async def next_report(self) -> dict[str, Any]:
        report: dict[str, Any] = json.loads(await self.out.receive_until(b"\n", 1 << 20))
        return report

    def address(self, scheme: str) -> str:
        (address,) = [a for a in self.addresses if a.startswith(scheme)]
        return address

    def rss(self) -> int:
        """Its resident memory in bytes."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) * 1024  # type: ignore[index]

    def fds(self) -> int:
        """Its open file descriptors."""
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    async def wait_for_line(self, pred: Any, timeout: float = 15.0) -> None:
        """Until a line of its stderr satisfies ``pred`` (the caller checks it did)."""
        with anyio.move_on_after(timeout):
            while not any(pred(line) for line in self.lines):
                self.news = anyio.Event()
                await self.news.wait()


class Job:
    """The two ranks of a job with a token, driven line by line."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks

    async def all_reduce(self) -> list[bool]:
        """Run a 4 MiB all_reduce (through shared memory) on both ranks: right on each?"""
        for r in self.ranks:
            assert r.proc.stdin is not None
            await r.proc.stdin.send(b"all_reduce\n")
        return [(await r.next_report())["right"] for r in self.ranks]


async def _drain(rank: Rank) -> None:
    # Read a rank's stderr as it comes: a rank must never block on its pipe.
    assert rank.proc.stderr is not None
    buf = b""
    async for chunk in rank.proc.stderr:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        rank.lines += [line.decode(errors="replace") for line in lines]
        rank.news.set()


@contextlib.asynccontextmanager
async def _job(
    server: RendezvousServer, tmp_path: Path, env: dict[int, dict[str, str]] | None = None
) -> AsyncIterator[Job]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    ranks: list[Rank] = []
    try:
        async with anyio.create_task_group() as tg:
            for r in range(2):
                proc = await open_process(
                    [sys.executable, str(script), url, str(r)],
                    env={
                        **os.environ,
                        "PYTHONPATH": ROOT,
                        "AIODIST_TOKEN": TOKEN,
                        **(env or {}).get(r, {}),
                    },
                )
                assert proc.stdout is not None
                ranks.append(Rank(proc, BufferedByteReceiveStream(proc.stdout)))
                tg.start_soon(_drain, ranks[-1])
            for rank in ranks:
                ready = await rank.next_report()
                rank.pid, rank.addresses = ready["pid"], ready["addresses"]
            yield Job(ranks)
            for rank in ranks:  # anything but "all_reduce" makes it leave the job
                assert rank.proc.stdin is not None
                await rank.proc.stdin.send(b"leave\n")
            with anyio.fail_after(30):
                assert [await rank.proc.wait() for rank in ranks] == [0, 0], [
                    rank.lines[-20:] for rank in ranks
                ]
    finally:
        for rank in ranks:
            if rank.proc.returncode is None:
                rank.proc.kill()
            with anyio.CancelScope(shield=True):
                await rank.proc.wait()
                await rank.proc.aclose()


async def _stranger(tmp_path: Path, mode: str, address: str, **args: Any) -> dict[str, Any]:
    """Run the stranger process to its end; its last report."""
    script = tmp_path / "stranger.py"
    script.write_text(STRANGER)
    result = await anyio.run_process(
        [sys.executable, str(script), mode, address, json.dumps(args)], check=False
    )
    assert result.returncode == 0, result.stderr.decode()
    report: dict[str, Any] = json.loads(result.stdout.decode().splitlines()[-1])
    return report


@contextlib.asynccontextmanager
async def _stranger_process(
    tmp_path: Path, mode: str, address: str, **args: Any
) -> AsyncIterator[tuple[Process, BufferedByteReceiveStream]]:
    script = tmp_path / "stranger.py"
    script.write_text(STRANGER)
    proc = await anyio.open_process(  # its stderr goes to the test's, to say why it failed
        [sys.executable, str(script), mode, address, json.dumps(args)], stderr=None
    )
    try:
        assert proc.stdout is not None
        yield proc, BufferedByteReceiveStream(proc.stdout)
    finally:
        if proc.returncode is None:
            proc.kill()
        with anyio.CancelScope(shield=True):
            await proc.wait()
            await proc.aclose()


@pytest.fixture
async def token_server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RendezvousServer]:
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
    async with anyio.create_task_group() as tg:
        yield await tg.start(functools.partial(serve_rendezvous, token=TOKEN))
        tg.cancel_scope.cancel()


def _hex(kind: int, header: Any) -> str:
    return b"".join(bytes(p) for p in encode_frame(kind, header)).hex()


def _refusals(lines: list[str]) -> list[str]:
    return [line for line in lines if "refused" in line]


def _troubles(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(("ERROR", "CRITICAL", "Traceback"))]


# --- shared memory before the handshake ----------------------------------------------------


@needs_shm
@pytest.mark.slow
@one_backend
async def test_ring_data_from_a_stranger_is_refused_before_any_allocation(
    token_server: RendezvousServer, tmp_path: Path
) -> None:
    ring = f"aiodist-{os.getuid()}-0-1-stranger"
    crafted = {
        # 43 bytes whose slots * slot_bytes is a 2 GiB string: it was built, then kept.
        "2 GiB product": [65, None, 1, [ring, "a", 2 * GiB]],
        "2 GiB of int slots": [65, None, 1, [ring, 16, GiB // 8]],
        "a chunk": [0, 1],
    }
    frames = [_hex(ringwire.RING_DATA, h) for h in list(crafted.values())[:2]]
    frames.append(_hex(ringwire.RING_CHUNK, crafted["a chunk"]))
    with anyio.fail_after(120):
        async with _job(token_server, tmp_path) as job:
            target = job.ranks[1]
            assert await job.all_reduce() == [True, True]
            rss, fds = target.rss(), target.fds()
            report = await _stranger(tmp_path, "frames", target.address("uds:"), frames=frames)
            await target.wait_for_line(lambda line: "RING_CHUNK" in line or "kind 98" in line)
            grown, fds_after = target.rss() - rss, target.fds()
            assert await job.all_reduce() == [True, True]
    assert report["closed"] == [True] * len(frames), report
    assert grown < RSS_SLACK, f"the rank grew by {grown >> 20} MiB"
    assert fds_after <= fds
    refusals = _refusals(target.lines)
    assert len(refusals) == len(frames), target.lines
    assert all("before the handshake" in line for line in refusals), refusals
    assert not _troubles(target.lines), target.lines


# --- unfinished headers, churned ------------------------------------------------------------


@pytest.mark.slow
@one_backend
@pytest.mark.parametrize("scheme", ["uds:", "tcp://"])
async def test_unfinished_headers_from_strangers_leave_the_rank_as_it_was(
    token_server: RendezvousServer, tmp_path: Path, scheme: str
) -> None:
    env = {} if scheme == "uds:" else {r: {"AIODIST_UDS": "0"} for r in range(2)}
    with anyio.fail_after(120):
        async with _job(token_server, tmp_path, env) as job:
            target = job.ranks[1]
            assert await job.all_reduce() == [True, True]
            rss, fds = target.rss(), target.fds()
            peak = rss

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, target.rss())
                    await anyio.sleep(0.05)  # sampling memory: there is no event to await

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                report = await _stranger(
                    tmp_path,
                    "unfinished_headers",
                    target.address(scheme),
                    rounds=3,
                    conns=40,
                    header=15 << 20,
                )
                tg.cancel_scope.cancel()
            after_rss, after_fds = target.rss(), target.fds()
            assert await job.all_reduce() == [True, True]
    # Each was refused at its prefix (a header over the pre-handshake limit), and closed.
    assert report["closed"] == 3 * 40, report
    assert peak - rss < RSS_SLACK, f"the rank grew by {(peak - rss) >> 20} MiB on the way"
    assert after_rss - rss < RSS_SLACK, f"the rank kept {(after_rss - rss) >> 20} MiB"
    assert after_fds <= fds
    assert any("header of 15728640 bytes exceeds the limit" in x for x in _refusals(target.lines))
    assert not _troubles(target.lines), target.lines


# --- idle connections with few file descriptors ---------------------------------------------

NOFILE = 1024


@pytest.mark.slow
@one_backend
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_idle_strangers_beyond_the_rank_file_limit_are_shed_and_closed_at_the_deadline(
    token_server: RendezvousServer, tmp_path: Path, loop: str
) -> None:
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2 * NOFILE:
        pytest.skip("the stranger needs more file descriptors than the rank may have")
    deadline = 3.0
    env = {"TEST_NOFILE": str(NOFILE), "TEST_DEADLINE": str(deadline), "TEST_LOG_INTERVAL": "1"}
    if loop == "uvloop":
        env["TEST_UVLOOP"] = "1"
    cap = NOFILE // 8  # what a data-plane listener keeps unproved (listener.preauth_limits)
    with anyio.fail_after(120):
        async with _job(token_server, tmp_path, {0: env, 1: env}) as job:
            target = job.ranks[1]
            fds = target.fds()  # no data channel yet: the collective below needs a new one
            address = target.address("uds:")
            async with _stranger_process(tmp_path, "idle", address, conns=1100, cap=cap) as (
                proc,
                out,
            ):
                held = json.loads(await out.receive_until(b"\n", 1 << 16))
                fds_held = target.fds()
                # While the strangers hold their connections, the ranks connect and reduce.
                assert await job.all_reduce() == [True, True]
                assert proc.stdin is not None
                await proc.stdin.send(b"go on\n")
                left = json.loads(await out.receive_until(b"\n", 1 << 16))
            await target.wait_for_line(lambda line: f"within {deadline:g} s" in line)
            assert await job.all_reduce() == [True, True]
            fds_after = target.fds()
    assert held["held"] == 1100
    assert held["open"] <= cap, held
    # The oldest were shed: the ones left are the newest. (uvloop may close a few in
    # between itself, accepting more than it may keep at once: EMFILE.)
    assert held["oldest_open"] >= held["held"] - 2 * cap, held
    assert fds_held < fds + cap + 16, f"{fds_held} descriptors with {fds} at the start"
    assert left["open"] == 0, left
    assert fds_after <= fds + 4  # the two ranks' data channel
    assert any("shed for a newer connection" in line for line in target.lines)
    assert not _troubles(target.lines), target.lines[-20:]


# --- the log of refusals --------------------------------------------------------------------

SUMMARY = re.compile(r"(\d+) more refused connections? in the last")


@pytest.mark.slow
@one_backend
async def test_refusals_of_2000_strangers_are_logged_as_a_burst_and_counts(
    token_server: RendezvousServer, tmp_path: Path
) -> None:
    env = {1: {"TEST_LOG_INTERVAL": "1.0"}}
    with anyio.fail_after(120):
        async with _job(token_server, tmp_path, env) as job:
            target = job.ranks[1]
            report = await _stranger(tmp_path, "hellos", target.address("uds:"), conns=2000)

            def counted() -> int:
                full = sum("refused a data connection from" in x for x in target.lines)
                return full + sum(int(m[1]) for x in target.lines if (m := SUMMARY.search(x)))

            # The last summary comes once its interval is over, with nothing else to say.
            await target.wait_for_line(lambda _: counted() >= 2000)
            assert await job.all_reduce() == [True, True]
    assert report["closed"] == 2000
    refusals = _refusals(target.lines)
    summaries = [x for x in refusals if SUMMARY.search(x)]
    assert counted() == 2000, refusals  # every stranger is in the log, most as a count
    assert summaries
    # Five lines in full per interval and one summary: a few lines a second at most.
    assert len(refusals) <= 6 * (len(summaries) + 1), refusals
    assert len(refusals) < 100
    assert all("offered no proof of the job's token" in x for x in refusals if x not in summaries)
    assert not _troubles(target.lines), target.lines


# --- a member that misbehaves after the handshake -------------------------------------------


async def _authenticated_pair(
    lost: list[tuple[int, str]], news: anyio.Event
) -> tuple[DataPlane, DataPlane, DataChannel]:
    """Two planes with the token, and rank 0's (authenticated) channel to rank 1.

    Rank 1's lost peers go to ``lost`` (and set ``news``).
    """

    async def on_peer_lost(rank: int, why: str) -> None:
        lost.append((rank, why))
        news.set()

    a, b = DataPlane("job", token=TOKEN), DataPlane("job", token=TOKEN, on_peer_lost=on_peer_lost)
    addresses = {0: tuple(await a.listen("127.0.0.1")), 1: tuple(await b.listen("127.0.0.1"))}

    async def table() -> dict[int, tuple[str, ...]]:
        return addresses

    a.set_members(0, 2, table, [0, 0])
    b.set_members(1, 2, table, [0, 0])
    key = (MatchKind.P2P, 0, 0, 0)
    received = b.recv(0, key)
    await a.send(1, key, "meta", b"hello")
    assert bytes((await received).data) == b"hello"
    return a, b, a.routes[1]


def _malformed(ring: str) -> dict[str, list[tuple[int, Any]]]:
    data_header = [MatchKind.P2P, 0, 0, 1, None]  # a DATA frame's header, for the ring payload
    announce = [Data.KIND, data_header, 100, [ring, 2, 4096]]
    return {
        "a string for the slots": [(ringwire.RING_DATA, [65, data_header, 1, [ring, "a", GiB]])],
        "a ring over the limit": [(ringwire.RING_DATA, [65, data_header, 100, [ring, 1024, GiB]])],
        "a ring with no name": [(ringwire.RING_DATA, [65, data_header, 100, [None, 2, 4096]])],
        "a chunk of a string slot": [
            (ringwire.RING_DATA, announce),
            (ringwire.RING_CHUNK, ["x", 10]),
        ],
        "a chunk out of the ring": [(ringwire.RING_DATA, announce), (ringwire.RING_CHUNK, [2, 10])],
        "a chunk past the payload": [
            (ringwire.RING_DATA, announce),
            (ringwire.RING_CHUNK, [0, 4096]),
        ],
        "a free of a slot never sent": [(ringwire.RING_FREE, [0])],
        "an unknown ring kind": [(ringwire.RING_FREE + 1, [])],
    }


# What a peer may put in a header: msgpack's values, nested, ints of any size it carries.
_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=12,
)
_small_ints = st.integers(min_value=-2, max_value=70_000)


@settings(max_examples=300, deadline=None)
@given(
    header=_values
    | st.tuples(_small_ints, _values, _small_ints, _values).map(list)
    | st.tuples(_values, _values, _values).map(lambda r: [65, None, 8, list(r)])
    | st.tuples(_small_ints, _small_ints).map(list)
)
def test_ring_headers_of_any_shape_are_checked_fields_or_a_protocol_error(header: Any) -> None:
    ring = ringwire.Ring("aiodist-0-0-0-x", 4, 4096)
    with contextlib.suppress(ProtocolError):
        data = ringwire.parse_ring_data(header, 1 << 20)
        assert type(data.kind) is int
        assert 0 <= data.kind < ringwire.RING_HELLO
        assert type(data.nbytes) is int
        assert 0 < data.nbytes <= 1 << 20
        if data.ring is not None:
            assert type(data.ring.name) is str
            assert 0 < data.ring.slots * data.ring.slot_bytes <= 256 << 20
    with contextlib.suppress(ProtocolError):
        slot, n = ringwire.parse_ring_chunk(header, ring, room=10_000)
        assert 0 <= slot < ring.slots
        assert 0 < n <= min(ring.slot_bytes, 10_000)
    with contextlib.suppress(ProtocolError):
        assert 0 <= ringwire.parse_ring_free(header, 4) < 4


@needs_shm
@pytest.mark.parametrize("what", list(_malformed("x")))
async def test_malformed_ring_frame_after_the_handshake_closes_that_connection_with_a_warning(
    what: str, caplog: pytest.LogCaptureFixture
) -> None:
    lost: list[tuple[int, str]] = []
    news = anyio.Event()
    ring = shm.create_segment(8192)  # a real ring of this user, for the frames to name
    a, b, channel = await _authenticated_pair(lost, news)
    assert isinstance(channel, shmring.ShmChannel)
    caplog.set_level(logging.INFO)
    caplog.clear()
    try:
        with anyio.fail_after(10):
            for kind, header in _malformed(ring.name)[what]:
                await channel.send(kind, header)
            await news.wait()
    finally:
        await a.aclose(bye=False)
        await b.aclose(bye=False)
        ring.close()
    assert lost[0][0] == 0, lost  # rank 1 lost rank 0's connection, for what it sent
    assert lost[0][1].startswith("its data connection closed ("), lost
    assert "EOF" not in lost[0][1], lost
    closing = [r for r in caplog.records if "closing the data channel" in r.getMessage()]
    assert len(closing) == 1, caplog.text
    assert closing[0].levelno == logging.WARNING
    assert "\n" not in closing[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


@needs_shm
async def test_second_free_of_a_ring_slot_closes_the_connection_before_a_slot_is_reused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Rank 1 sends rank 0 a payload through its ring; rank 0 frees the slot, then frees
    # it again. Taken twice, the slot would carry two chunks at once: wrong data.
    lost: list[tuple[int, str]] = []
    news = anyio.Event()
    a, b, channel = await _authenticated_pair(lost, news)
    key = (MatchKind.COLLECTIVE, 0, 1, 0)
    payload = bytes(range(256)) * (shmring.SLOT_BYTES // 256)
    caplog.set_level(logging.INFO)
    try:
        with anyio.fail_after(10):
            received = a.recv(1, key)
            await b.send(0, key, "meta", payload)
            # Rank 0 wrote its RING_FREE before the payload was delivered: this one follows it.
            assert bytes((await received).data) == payload
            assert isinstance(b.routes[0], shmring.ShmChannel)
            await channel.send(ringwire.RING_FREE, [0])
            await news.wait()
    finally:
        await a.aclose(bye=False)
        await b.aclose(bye=False)
    assert lost[0][0] == 0
    assert "RING_FREE for slot 0" in lost[0][1], lost
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


# --- what a refused connection leaves behind --------------------------------------------------


class _Sink:
    """A frame sink that proves a channel on its hello and remembers what closed."""

    def __init__(self, closed: list[weakref.ref[DataChannel]], news: anyio.Event) -> None:
        self.closed = closed
        self.news = news

    def frame_received(self, channel: DataChannel, frame: Frame) -> memoryview | None:
        if frame.header == ["hello"]:
            channel.handshake_done()
        return None

    def payload_received(self, channel: DataChannel, frame: Frame) -> None:
        pass

    def channel_closed(self, channel: DataChannel, exc: Exception | None) -> None:
        self.closed.append(weakref.ref(channel))
        self.news.set()


@needs_shm
@pytest.mark.parametrize("proved", [False, True], ids=["stranger", "member"])
async def test_refused_ring_channel_is_freed_without_a_garbage_collection(proved: bool) -> None:
    closed: list[weakref.ref[DataChannel]] = []
    news = anyio.Event()
    hello = b"".join(bytes(p) for p in encode_frame(Data.KIND, ["hello"]))
    bad = b"".join(bytes(p) for p in encode_frame(ringwire.RING_CHUNK, ["x", 1]))
    gc.collect()
    gc.disable()  # reference counting alone must free it
    try:
        listener = await shmring.listen("", lambda: _Sink(closed, news))
        try:
            with anyio.fail_after(10):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                loop = asyncio.get_running_loop()
                await loop.sock_connect(sock, "\0" + uds.socket_name(listener.address))
                reader, writer = await asyncio.open_connection(sock=sock)
                writer.write((hello if proved else b"") + bad)
                with contextlib.suppress(OSError):
                    assert await reader.read() == b""  # the rank closes it, saying nothing
                writer.close()
                await news.wait()
                for _ in range(10):  # the transport lets go of it in the same turn or next
                    if closed[0]() is None:
                        break
                    await anyio.lowlevel.checkpoint()
        finally:
            listener.close()
    finally:
        gc.enable()
    assert closed[0]() is None, gc.get_referrers(closed[0]())
