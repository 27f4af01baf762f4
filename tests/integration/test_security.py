"""Tokens as challenge-response on both planes, with the real server and real sockets.

A stranger here is raw bytes on a real socket: what an attacker on the host
or the network can send without knowing the token.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

import aiodist
from aiodist import AuthenticationError, serve_rendezvous
from aiodist._control.connection import ControlConnection, connect_control
from aiodist._errors import ErrorCode
from aiodist._plane.peers import DataPlane
from aiodist._transport import uds
from aiodist._wire.auth import client_proof, new_nonce, server_proof, verify
from aiodist._wire.frame import NEED_DATA, Frame, FrameDecoder, Limits, encode_frame, encode_message
from aiodist._wire.keys import MatchKind
from aiodist._wire.messages import (
    Authenticated,
    Challenge,
    Data,
    ErrorReply,
    Hello,
    PeerAuth,
    PeerHello,
    Reply,
    StatusRequest,
)
from aiodist._wire.preauth import PreAuthLimits
from aiodist.testing import run_ranks
from tests.helpers import ROOT as REPO
from tests.helpers.daemon import TOKEN, asyncio_only
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from anyio.abc import ByteStream, SocketStream

    from aiodist import ProcessGroup, RendezvousServer


def _bytes(parts: list[Any]) -> bytes:
    return b"".join(bytes(p) for p in parts)


def _message(msg: Any) -> bytes:
    return _bytes(encode_message(msg))


def _frame(kind: int, header: Any, payload: bytes | None = None) -> bytes:
    return _bytes(encode_frame(kind, header, payload))


class RawPeer:
    """A plain socket speaking frames by hand: the stranger of these tests."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder(Limits())

    @classmethod
    async def connect(cls, address: str) -> RawPeer:
        loop = asyncio.get_running_loop()
        if address.startswith("uds:"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = "\0" + uds.socket_name(address)
        else:
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            target = (host, int(port))
        sock.setblocking(False)
        await loop.sock_connect(sock, target)
        return cls(*await asyncio.open_connection(sock=sock))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        try:
            await self.writer.drain()
        except ConnectionError:
            pass  # refused mid-write: what it read back says why

    async def next_frame(self) -> Frame | None:
        """The next whole frame, or None at EOF (or a reset)."""
        while True:
            event = self.decoder.next_event()
            if isinstance(event, Frame):
                return event
            assert event is NEED_DATA, event
            try:
                chunk = await self.reader.read(65536)
            except ConnectionError:
                return None
            if not chunk:
                return None
            self.decoder.receive_data(chunk)

    async def frames_until_closed(self) -> list[Frame]:
        frames = []
        while (frame := await self.next_frame()) is not None:
            frames.append(frame)
        return frames

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
async def token_server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RendezvousServer]:
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
    async with anyio.create_task_group() as tg:
        yield await tg.start(functools.partial(serve_rendezvous, token=TOKEN))
        tg.cancel_scope.cancel()


# --- control plane ------------------------------------------------------------------------


async def _challenged(server: RendezvousServer) -> tuple[RawPeer, bytes]:
    """A raw connection to ``server`` and the nonce of the challenge it sent at once."""
    peer = await RawPeer.connect(f"tcp://{server.address[0]}:{server.address[1]}")
    challenge = await peer.next_frame()
    assert challenge is not None
    assert challenge.kind == Challenge.KIND
    return peer, challenge.header[0]


async def _relay(target: tuple[str, int], up: list[bytes], down: list[bytes], client: ByteStream):
    async def pump(src: ByteStream | SocketStream, dst: Any, record: list[bytes]) -> None:
        with anyio.CancelScope() as scope:
            try:
                async for chunk in src:
                    record.append(chunk)
                    await dst.send(chunk)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
            scope.cancel()

    async with client, await anyio.connect_tcp(*target) as server_side:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pump, client, server_side, up)
            await pump(server_side, client, down)
            tg.cancel_scope.cancel()


async def test_token_never_on_the_wire_and_a_replayed_handshake_is_refused(
    token_server: RendezvousServer,
) -> None:
    up: list[bytes] = []
    down: list[bytes] = []
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, functools.partial(_relay, token_server.address, up, down))
        relay = ("127.0.0.1", listener.extra(anyio.abc.SocketAttribute.local_port))
        with anyio.fail_after(10):
            outs = await run_ranks(relay, 1, lambda g: g.store.add("n", 5), group_name="spied")
        assert outs == [5]
        tg.cancel_scope.cancel()
    sent, received = b"".join(up), b"".join(down)
    assert TOKEN.encode() not in sent
    assert TOKEN.encode() not in received
    assert token_server.auth_failures == 0

    # Replay everything the member sent, byte for byte, on a new connection.
    with anyio.fail_after(10):
        peer = await RawPeer.connect(f"tcp://{token_server.address[0]}:{token_server.address[1]}")
        await peer.send(sent)
        frames = await peer.frames_until_closed()
    peer.close()
    kinds = [f.kind for f in frames]
    assert kinds == [Challenge.KIND, ErrorReply.KIND], kinds
    assert frames[0].header[0] not in received  # a fresh nonce, so the old proof answers nothing
    assert frames[1].header[1] == ErrorCode.AUTHENTICATION
    assert token_server.auth_failures == 1
    assert token_server.state.stats.store_ops == 1  # the replayed add never ran


async def test_a_correct_proof_is_served_and_the_server_proves_the_token(
    token_server: RendezvousServer,
) -> None:
    with anyio.fail_after(10):
        peer, server_nonce = await _challenged(token_server)
        mine = new_nonce()
        await peer.send(
            _message(Hello(mine, client_proof(TOKEN, server_nonce, mine)))
            + _message(StatusRequest(7))
        )
        auth, reply = await peer.next_frame(), await peer.next_frame()
    peer.close()
    assert auth is not None
    assert auth.kind == Authenticated.KIND
    assert verify(server_proof(TOKEN, mine, server_nonce), auth.header[0])
    assert reply is not None
    assert reply.kind == Reply.KIND
    assert reply.header[0] == 7
    assert token_server.auth_failures == 0


async def test_client_refuses_a_server_that_cannot_prove_the_token() -> None:
    async def impostor(client: SocketStream) -> None:
        async with client:
            await client.send(_message(Challenge(new_nonce())))
            await client.receive()  # the client's proof: useless without the token
            await client.send(_message(Authenticated(b"\0" * 32)) + _message(Reply(1, {})))
            with anyio.move_on_after(10):
                await client.receive()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, impostor)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        conns: list[ControlConnection] = []

        async def status() -> None:
            # The bad proof may come before or after the client's own: either way, refused.
            conns.append(await connect_control("127.0.0.1", port, timeout=5, token=TOKEN))
            await conns[0].request(StatusRequest)

        with anyio.fail_after(10), pytest.raises(AuthenticationError, match="could not prove"):
            await status()
        for conn in conns:
            conn.close()
        tg.cancel_scope.cancel()


async def test_silent_connection_is_closed_after_the_auth_timeout() -> None:
    async with anyio.create_task_group() as tg:
        token_server = await tg.start(
            functools.partial(serve_rendezvous, token=TOKEN, preauth=PreAuthLimits(deadline=0.2))
        )
        with anyio.fail_after(10):
            address = f"tcp://{token_server.address[0]}:{token_server.address[1]}"
            peer = await RawPeer.connect(address)
            frames = await peer.frames_until_closed()  # it sends nothing; the server gives up
        peer.close()
        assert [f.kind for f in frames] == [Challenge.KIND, ErrorReply.KIND]
        refusal = ErrorReply(*frames[1].header)
        assert refusal.code == ErrorCode.AUTHENTICATION
        assert refusal.details == {}  # its own fault: connecting again would not help
        assert token_server.auth_failures == 1
        await token_server.wait_until(lambda s: s.num_connections == 0)
        tg.cancel_scope.cancel()


async def test_gate_tells_the_connection_it_shed_to_connect_again() -> None:
    async with anyio.create_task_group() as tg:
        server = await tg.start(
            functools.partial(serve_rendezvous, token=TOKEN, preauth=PreAuthLimits(max_pending=1))
        )
        address = f"tcp://{server.address[0]}:{server.address[1]}"
        with anyio.fail_after(10):
            first = await RawPeer.connect(address)
            await server.wait_until(lambda s: s.num_connections == 1)
            second = await RawPeer.connect(address)  # no room for both: the older goes
            frames = await first.frames_until_closed()
        first.close()
        second.close()
        assert [f.kind for f in frames] == [Challenge.KIND, ErrorReply.KIND]
        shed = ErrorReply(*frames[1].header)
        assert shed.code == ErrorCode.PROTOCOL
        assert shed.details == {"again": True}
        assert "connect again" in shed.message
        tg.cancel_scope.cancel()


class _Gate:
    """A gate in front of the server at ``target``: after the first ``skip`` connections,
    the next ``shed`` that speak get what the server's gate sends a connection it shed
    to make room; every other connection is relayed to ``target``."""

    def __init__(self, target: tuple[str, int], shed: int, skip: int = 0, token: bool = True):
        self.target = target
        self.token = token  # the server's challenge comes first
        self.shed = shed
        self.skip = skip
        self.accepted = 0

    async def __call__(self, client: SocketStream) -> None:
        self.accepted += 1
        if self.accepted > self.skip and self.shed > 0:
            async with client:
                try:
                    # Its first frame, read: the close is then no reset, which could
                    # discard the refusal before the client reads it.
                    await client.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return  # it gave up before a word (a reconnect attempt superseded)
                self.shed -= 1
                again = {"again": True}
                refusal = ErrorReply(0, ErrorCode.PROTOCOL, "no room; connect again", again)
                challenge = _message(Challenge(new_nonce())) if self.token else b""
                await client.send(challenge + _message(refusal))
            return
        try:
            await _relay(self.target, [], [], client)
        except OSError:  # nothing listens there (between two servers)
            await client.aclose()


@pytest.mark.parametrize("shed", [2, 1000])
@pytest.mark.parametrize("token", [TOKEN, ""])
async def test_client_shed_by_the_gate_connects_again_until_its_timeout(
    token: str, shed: int
) -> None:
    async with anyio.create_task_group() as servers:
        server = await servers.start(functools.partial(serve_rendezvous, token=token or None))
        await _shed_then_served(_Gate(server.address, shed, token=bool(token)), token)
        servers.cancel_scope.cancel()


async def _shed_then_served(gate: _Gate, token: str) -> None:
    shed = gate.shed
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, gate)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        with anyio.fail_after(10):
            if shed == 2:  # shed twice, then served: the third connection is the one used
                conn = await connect_control("127.0.0.1", port, timeout=5, token=token)
                reply = await conn.request(StatusRequest)
                conn.close()
                assert (gate.accepted, gate.shed) == (3, 0)
                assert reply is not None
            else:  # shed every time: a timeout that says why, once the rank's time is up
                with pytest.raises(aiodist.RendezvousTimeout, match="to make room for others"):
                    await connect_control("127.0.0.1", port, timeout=1, token=token)
                assert gate.accepted > 2
        tg.cancel_scope.cancel()


async def test_member_shed_while_coming_back_after_a_restart_tries_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    serve = functools.partial(
        serve_rendezvous, token=TOKEN, state_dir=str(tmp_path / "state"), shutdown_timeout=1
    )
    async with listener, anyio.create_task_group() as tg:
        first = await tg.start(serve)
        gate = _Gate(first.address, shed=1, skip=1)  # the member's first try to come back
        tg.start_soon(listener.serve, gate)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        with anyio.fail_after(30):
            async with aiodist.open_process_group(
                f"tcp://127.0.0.1:{port}", world_size=1, group_name="shed-coming-back"
            ) as g:
                await g.store.set("before", b"1")
                await first.aclose("restarting")  # with its state kept: it comes back
                second = await tg.start(serve)
                gate.target = second.address
                await g.store.set("after", b"2")  # sent again once the member is back
                assert await g.store.get("before") == b"1"
        assert gate.shed == 0
        tg.cancel_scope.cancel()


# --- data plane ---------------------------------------------------------------------------

FORGED = [666.0] * 4


def _attacks(job: str, group_id: int, member: int = 0) -> dict[str, list[bytes]]:
    """Byte sequences a stranger sends to a rank's listener, claiming to be rank 0.

    ``member`` is the rank's number on its process's shared listener (0 on TCP).
    """
    data = _frame(
        Data.KIND,
        [MatchKind.P2P, group_id, 0, 0, ["float32", [4]]],
        torch.tensor(FORGED).numpy().tobytes(),
    )
    pid = os.getpid()
    return {
        "data without hello": [data],
        "hello without proof": [_frame(PeerHello.KIND, [job, 0, pid, member, None]), data],
        "wrong proof": [
            _frame(PeerHello.KIND, [job, 0, pid, member, new_nonce()]),
            b"await",  # read the acceptor's challenge first
            _frame(PeerAuth.KIND, [b"", b"\0" * 32]) + data,
        ],
        "data right after hello": [
            _frame(PeerHello.KIND, [job, 0, pid, member, new_nonce()]) + data
        ],
        # On a process's shared Unix-socket listener: a member that does not exist.
        "hello to no member": [
            _frame(PeerHello.KIND, [job, 0, pid, member + 1000, new_nonce()]) + data
        ],
    }


@pytest.mark.parametrize("scheme", ["tcp", "uds"])
async def test_stranger_cannot_deliver_data_to_a_rank(
    token_server: RendezvousServer, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if scheme == "tcp":  # ranks of a loopback server listen on TCP only without Unix sockets
        monkeypatch.setenv("AIODIST_UDS", "0")
    refused: dict[str, list[int]] = {}

    async def body(g: ProcessGroup) -> list[float]:
        if g.rank == 1:
            buf = torch.zeros(4)
            assert await aiodist.irecv(buf, src=0, group=g) == 0
        else:
            members = await g.session.members()
            (address,) = [a for a in members[1].addresses if a.startswith(scheme)]
            member = uds.member_of(address) if scheme == "uds" else 0
            for name, steps in _attacks("stranger-job", g.group_id, member).items():
                peer = await RawPeer.connect(address)
                got: list[int] = []
                for step in steps:
                    if step == b"await":
                        frame = await peer.next_frame()
                        assert frame is not None
                        got.append(frame.kind)
                    else:
                        await peer.send(step)
                got += [f.kind for f in await peer.frames_until_closed()]
                peer.close()
                refused[name] = got
            buf = torch.arange(4.0)
            await aiodist.isend(buf, dst=1, group=g)
        total = await aiodist.all_reduce(torch.ones(2), group=g)
        assert total.tolist() == [2.0, 2.0]
        return buf.tolist()

    with anyio.fail_after(20):
        outs = await run_ranks(token_server.address, 2, body, group_name="stranger-job")
    assert outs == [[0.0, 1.0, 2.0, 3.0]] * 2  # rank 1 got rank 0's data, not the forgery
    assert set(refused) == set(_attacks("x", 0))
    # Every stranger was cut off; the one that asked saw only the challenge.
    assert refused["wrong proof"] == [PeerAuth.KIND]
    assert all(kinds in ([], [PeerAuth.KIND]) for kinds in refused.values()), refused


def _planes(tokens: tuple[str, str], use_uds: bool) -> tuple[DataPlane, DataPlane]:
    planes = tuple(DataPlane("job", token=t) for t in tokens)
    for plane in planes:
        plane.use_uds = use_uds
    return planes  # type: ignore[return-value]


@pytest.mark.parametrize("use_uds", [False, True], ids=["tcp", "uds"])
@pytest.mark.parametrize("accept_token", [TOKEN, "another-token"], ids=["same", "impostor"])
async def test_connecting_rank_checks_the_acceptor_knows_the_token(
    use_uds: bool, accept_token: str
) -> None:
    a, b = _planes((TOKEN, accept_token), use_uds)
    addresses = {0: tuple(await a.listen("127.0.0.1")), 1: tuple(await b.listen("127.0.0.1"))}

    async def table() -> dict[int, tuple[str, ...]]:
        return addresses

    a.set_members(0, 2, table, [0, 0])
    b.set_members(1, 2, table, [0, 0])
    key = (MatchKind.P2P, 0, 0, 0)
    received = b.recv(0, key)
    try:
        with anyio.fail_after(10):
            if accept_token == TOKEN:
                await a.send(1, key, "meta", b"hello")
                msg = await received
                assert (msg.src, msg.meta, bytes(msg.data)) == (0, "meta", b"hello")
            else:
                with pytest.raises(AuthenticationError, match="could not prove") as refused:
                    await a.send(1, key, "meta", b"hello")
                assert refused.value.rank == 1
                # The impostor refuses rank 0 in turn: nothing reached its receive.
                with pytest.raises(AuthenticationError) as refused_back:
                    await received
                assert refused_back.value.rank == 0
                assert not a.routes
                assert not b.routes
    finally:
        received.cancel()
        await a.aclose()
        await b.aclose()


# --- reliability: the rendezvous server going away mid-job --------------------------------

ROOT = str(REPO)
GONE_WORKER = """
import json, sys
import anyio, torch
import aiodist

async def main() -> None:
    url, rank = sys.argv[1], int(sys.argv[2])
    await aiodist.init_process_group(init_method=url, world_size=2, rank=rank, group_name="gone")
    out = {"before": (await aiodist.all_reduce(torch.ones(2))).tolist()}
    print("ready", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)  # the server is gone by now
    ops = {
        "after": lambda: aiodist.all_reduce(torch.full((2,), 2.0)),
        "objects": lambda: aiodist.all_gather_object({"rank": rank}),
        "store": lambda: aiodist.get_store().set("k", b"v"),
    }
    for name, op in ops.items():
        try:
            await op()
            out[name] = "completed"
        except aiodist.DistError as exc:
            out[name] = [type(exc).__name__, str(exc)]
    with anyio.fail_after(10):
        await aiodist.destroy_process_group()
    print(json.dumps(out), flush=True)

anyio.run(main)
"""


async def _start_daemon(port: int) -> tuple[anyio.abc.Process, int]:
    proc = await anyio.open_process(
        [sys.executable, "-m", "aiodist", "serve", "--port", str(port), "--log-format", "json"],
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = await BufferedByteReceiveStream(proc.stdout).receive_until(b"\n", 1 << 16)
    return proc, int(json.loads(line)["port"])


@pytest.mark.slow
@asyncio_only
async def test_server_gone_mid_job_breaks_groups_naming_the_server_restart_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AIODIST_TOKEN", raising=False)
    script = tmp_path / "worker.py"
    script.write_text(GONE_WORKER)
    procs: list[anyio.abc.Process] = []
    try:
        with anyio.fail_after(60):
            daemon, port = await _start_daemon(0)
            procs.append(daemon)
            url = f"tcp://127.0.0.1:{port}"
            # A daemon may come back: ranks would wait for it. With no grace, they break at once.
            env = {**os.environ, "PYTHONPATH": ROOT, "AIODIST_SERVER_GRACE": "0"}
            workers = [
                await open_process([sys.executable, str(script), url, str(r)], env=env)
                for r in range(2)
            ]
            procs += workers
            streams = []
            for w in workers:
                assert w.stdout is not None
                streams.append(BufferedByteReceiveStream(w.stdout))
                assert await streams[-1].receive_until(b"\n", 1 << 16) == b"ready"
            daemon.kill()  # not a shutdown: the server just vanishes
            assert await daemon.wait() == -signal.SIGKILL
            for w in workers:
                assert w.stdin is not None
                await w.stdin.send(b"go\n")
            outs = []
            for w, stream in zip(workers, streams, strict=True):
                outs.append(json.loads(await stream.receive_until(b"\n", 1 << 16)))
                assert await w.wait() == 0

            # A new server on the same port serves new jobs.
            restarted, same_port = await _start_daemon(port)
            procs.append(restarted)
            assert same_port == port
            sums = await run_ranks(("127.0.0.1", port), 2, lambda g: g.store.add("n", 1))
            assert sorted(sums) == [1, 2]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
            with anyio.CancelScope(shield=True):
                await p.wait()
            await p.aclose()
    for rank, out in enumerate(outs):
        assert out["before"] == [2.0, 2.0]
        # Without its server a rank cannot learn that another failed: its groups break,
        # and every operation says why, naming the server.
        for name in ("after", "objects", "store"):
            kind, message = out[name]
            assert kind == "GroupBrokenError", (rank, name, out)
            assert f"rendezvous server at 127.0.0.1:{port}" in message
    assert all(p.returncode is not None for p in procs)


async def test_a_refused_client_still_reads_why_while_its_requests_keep_coming(
    token_server: RendezvousServer,
) -> None:
    # A client pipelines requests behind its proof. Closing on unread input would
    # reset the connection, and a reset may discard the refusal before it is read.
    with anyio.fail_after(10):
        peer, server_nonce = await _challenged(token_server)
        mine = new_nonce()
        await peer.send(_message(Hello(mine, client_proof("wrong", server_nonce, mine))))
        await token_server.wait_until(lambda s: s.auth_failures == 1)
        for req_id in range(1, 50):
            await peer.send(_message(StatusRequest(req_id)))
        frames = await peer.frames_until_closed()
    peer.close()
    assert [f.kind for f in frames] == [ErrorReply.KIND]
    assert "does not match" in ErrorReply(*frames[0].header).message
