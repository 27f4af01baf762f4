"""A token is never downgraded: whoever holds one refuses a side that cannot prove it.

A client holding a token refuses a rendezvous server that requires none, and a
rank holding one refuses a peer that cannot prove it, whichever of the two
connected. Each refusal is an ``AuthenticationError`` that comes within
seconds (not at a timeout) and is never retried. ``aiodist serve`` takes its
token from ``AIODIST_TOKEN`` when no token file is given, as clients do.
"""

from __future__ import annotations

import functools
import json
import textwrap
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
from aiodist import AuthenticationError, open_process_group, serve_rendezvous
from aiodist._control.connection import connect_control
from aiodist._errors import from_wire
from aiodist._plane.core import PeerState
from aiodist._plane.peers import DataPlane
from aiodist._wire.keys import MatchKind
from aiodist._wire.messages import StatusRequest
from aiodist.testing import run_ranks
from tests.helpers import ROOT as REPO
from tests.helpers.daemon import TOKEN, asyncio_only, run_cli, serve, token_file
from tests.helpers.workers import run_worker

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from aiodist import ProcessGroup, RendezvousServer

ROOT = str(REPO)
# Every refusal here is one round trip: far below any timeout that could end it too.
REFUSAL_BOUND = 5.0
DOWNGRADE = "did not prove the job token"


@pytest.fixture
def no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODIST_TOKEN", raising=False)


@pytest.fixture
async def token_server(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RendezvousServer]:
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
    async with anyio.create_task_group() as tg:
        yield await tg.start(functools.partial(serve_rendezvous, token=TOKEN))
        tg.cancel_scope.cancel()


# --- control plane: a client with a token, a server without -------------------------------


@pytest.mark.parametrize("who", ["connection", "rank 1", "rank 0"])
async def test_client_with_token_refuses_a_tokenless_server_at_once(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch, who: str
) -> None:
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
    url = f"tcp://{server.address[0]}:{server.address[1]}"

    async def attempt() -> None:
        if who == "connection":
            conn = await connect_control(*server.address, timeout=60, token=TOKEN)
            conn.close()  # not reached: connecting is refused
        else:
            # Rank 1 retries what it may; rank 0 would embed a server if none listened.
            rank = int(who[-1])
            async with open_process_group(url, world_size=2, rank=rank, timeout=60):
                pass

    start = time.monotonic()
    # The timeouts are long: only the refusal can end this within the bound.
    with anyio.fail_after(REFUSAL_BOUND), pytest.raises(AuthenticationError) as info:
        await attempt()
    elapsed = time.monotonic() - start
    assert DOWNGRADE in str(info.value)
    assert f"server at {server.address[0]}:{server.address[1]}" in str(info.value)
    assert info.value.rank is None  # the server, not a peer
    assert elapsed < REFUSAL_BOUND
    assert server.state.jobs == {}  # nothing was joined
    with anyio.fail_after(5):
        await server.wait_until(lambda s: s.num_connections == 0)


async def test_client_without_token_still_uses_a_tokenless_server(
    server: RendezvousServer, no_token: None
) -> None:
    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 2, lambda g: g.store.add("n", 1))
    assert sorted(outs) == [1, 2]


async def _status_without_token(address: tuple[str, int]) -> None:
    conn = await connect_control(*address, timeout=5, token="")
    try:
        await conn.request(StatusRequest, timeout=5)
    finally:
        conn.close()


async def test_tcp_rank0_with_token_embeds_a_server_that_requires_it(
    monkeypatch: pytest.MonkeyPatch, free_tcp_port: int
) -> None:
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
    url = f"tcp://127.0.0.1:{free_tcp_port}"
    with anyio.fail_after(20):
        async with open_process_group(url, world_size=1, rank=0) as g:
            embedded = g.session.server
            assert embedded is not None  # nothing listened: rank 0 started it
            assert embedded.token == TOKEN
            # Refused on connecting (the server's challenge answers the probe) or at the
            # first request, whichever the client reads first.
            with pytest.raises(AuthenticationError, match="requires a token"):
                await _status_without_token(embedded.address)
            await embedded.wait_until(lambda s: s.auth_failures == 1)


async def test_file_rendezvous_with_token_refuses_the_tokenless_server_it_names(
    server: RendezvousServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rdzv"
    address = f"{server.address[0]}:{server.address[1]}\n"
    path.write_text(address)
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
    with anyio.fail_after(REFUSAL_BOUND), pytest.raises(AuthenticationError, match=DOWNGRADE):
        async with open_process_group(f"file://{path}", world_size=1, timeout=60):
            pass
    assert path.read_text() == address  # a live server: not replaced, not joined
    assert server.state.jobs == {}


# --- `aiodist serve`, `aiodist status`, `aiodist run` --------------------------------------


@pytest.mark.slow
@asyncio_only
async def test_tokenless_daemon_is_refused_by_clients_with_a_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serve("--port", "0") as d:
        assert "token required" not in d.ready
        await d.wait_for_line("stderr", lambda line: "no token is required" in line)
        port = str(d.port)
        url = f"tcp://{d.host}:{d.port}"

        monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
        start = time.monotonic()
        with anyio.fail_after(REFUSAL_BOUND), pytest.raises(AuthenticationError, match=DOWNGRADE):
            async with open_process_group(url, world_size=2, rank=1, timeout=60):
                pass
        assert time.monotonic() - start < REFUSAL_BOUND

        refused = await run_cli("status", "--port", port, "--json", env={"AIODIST_TOKEN": TOKEN})
        assert refused.returncode == 1
        assert DOWNGRADE in refused.stderr
        assert DOWNGRADE in json.loads(refused.stdout)["error"]  # --json: JSON, failure or not
        open_status = await run_cli("status", "--port", port, "--json")
        assert open_status.returncode == 0, open_status.stderr
        assert json.loads(open_status.stdout)["jobs"] == []  # the refused member never joined
    # The server tells its operator why those clients went away.
    assert d.output().count("holds a token but this server requires none") == 2, d.output()


@pytest.mark.slow
@asyncio_only
async def test_daemon_takes_its_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serve("--port", "0", "--log-format", "json", env={"AIODIST_TOKEN": TOKEN}) as d:
        assert json.loads(d.ready)["token_required"] is True
        logged = await d.wait_for_line("stderr", lambda line: "token is required" in line)
        assert "from AIODIST_TOKEN" in json.loads(logged)["message"]
        url = f"tcp://{d.host}:{d.port}"
        port = str(d.port)

        monkeypatch.delenv("AIODIST_TOKEN", raising=False)
        with anyio.fail_after(10), pytest.raises(AuthenticationError, match="requires a token"):
            async with open_process_group(url, world_size=2, rank=1, group_name="open"):
                pass
        monkeypatch.setenv("AIODIST_TOKEN", "wrong-token")
        with anyio.fail_after(10), pytest.raises(AuthenticationError, match="does not match"):
            async with open_process_group(url, world_size=2, rank=1, group_name="wrong"):
                pass
        monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
        with anyio.fail_after(10):
            async with open_process_group(url, world_size=1, group_name="ok") as g:
                await g.store.set("k", b"v")
                assert await g.store.get("k") == b"v"

        without = await run_cli("status", "--port", port, "--json")
        assert without.returncode == 1
        assert "requires a token" in without.stderr
        with_token = await run_cli("status", "--port", port, "--json", env={"AIODIST_TOKEN": TOKEN})
        assert with_token.returncode == 0, with_token.stderr
        assert json.loads(with_token.stdout)["jobs"] == []
    logged_all = d.output()
    assert TOKEN not in logged_all
    assert "wrong-token" not in logged_all
    # Refused: the tokenless member, the wrong token, the tokenless status query.
    assert logged_all.count("refused a connection from 127.0.0.1:") == 3, logged_all


@pytest.mark.slow
@asyncio_only
async def test_daemon_token_file_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = token_file(tmp_path)
    async with serve("--port", "0", "--token-file", str(path), env={"AIODIST_TOKEN": "env"}) as d:
        assert "token required" in d.ready
        logged = await d.wait_for_line("stderr", lambda line: "token is required" in line)
        assert f"from the token file {path}" in logged
        url = f"tcp://{d.host}:{d.port}"
        monkeypatch.setenv("AIODIST_TOKEN", "env")
        with anyio.fail_after(10), pytest.raises(AuthenticationError, match="does not match"):
            async with open_process_group(url, world_size=2, rank=1):
                pass
        monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
        with anyio.fail_after(10):
            async with open_process_group(url, world_size=1) as g:
                assert await g.store.add("n", 1) == 1
    assert TOKEN not in d.output()


RUN_SCRIPT = textwrap.dedent(
    """
    import json, os
    import anyio
    import aiodist
    from aiodist._control.connection import connect_control
    from aiodist._wire.messages import StatusRequest

    async def main() -> None:
        host, port = os.environ["AIODIST_SERVER"].rsplit(":", 1)  # MASTER_PORT: torch's store
        conn = await connect_control(host, int(port), timeout=10, token="")
        try:
            await conn.request(StatusRequest, timeout=10)
            tokenless = "served"
        except aiodist.AuthenticationError as exc:
            tokenless = str(exc)
        finally:
            conn.close()
        await aiodist.init_process_group()
        ranks = await aiodist.all_gather_object(aiodist.get_rank())
        await aiodist.destroy_process_group()
        print(json.dumps({"tokenless": tokenless, "ranks": ranks}), flush=True)

    anyio.run(main)
    """
)


@pytest.mark.slow
@asyncio_only
async def test_run_hosts_a_server_that_requires_the_token(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(RUN_SCRIPT)
    env = {"AIODIST_TOKEN": TOKEN, "PYTHONPATH": ROOT}
    result = await run_cli("run", "-n", "2", "--no-prefix", str(script), env=env)
    assert result.returncode == 0, result.stderr
    outs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(outs) == 2, result.stdout
    for out in outs:
        assert "requires a token" in out["tokenless"]  # the launcher's server wants TOKEN
        assert out["ranks"] == [0, 1]  # and the ranks, holding it, joined


# --- data plane: a rank with a token, a peer that cannot prove it -------------------------


def _planes(tokens: tuple[str | None, str | None], use_uds: bool) -> tuple[DataPlane, DataPlane]:
    planes = tuple(DataPlane("job", token=t) for t in tokens)  # None: $AIODIST_TOKEN, unset
    for plane in planes:
        plane.use_uds = use_uds
    return planes  # type: ignore[return-value]


async def _members(a: DataPlane, b: DataPlane) -> None:
    addresses = {0: tuple(await a.listen("127.0.0.1")), 1: tuple(await b.listen("127.0.0.1"))}

    async def table() -> dict[int, tuple[str, ...]]:
        return addresses

    a.set_members(0, 2, table, [0, 0])
    b.set_members(1, 2, table, [0, 0])


@pytest.mark.parametrize("use_uds", [False, True], ids=["tcp", "uds"])
async def test_connecting_rank_refuses_an_acceptor_without_the_token(
    use_uds: bool, no_token: None
) -> None:
    a, b = _planes((TOKEN, None), use_uds)
    await _members(a, b)
    key = (MatchKind.P2P, 0, 0, 0)
    waiting = a.recv(1, key)  # an operation of rank 0 that needs rank 1
    try:
        start = time.monotonic()
        with anyio.fail_after(REFUSAL_BOUND), pytest.raises(AuthenticationError) as info:
            await a.send(1, key, "meta", b"hello")
        assert time.monotonic() - start < REFUSAL_BOUND
        assert info.value.rank == 1
        assert "holds no token" in str(info.value)
        with pytest.raises(AuthenticationError) as waited:
            await waiting  # the refusal reached what waited on rank 1
        assert waited.value is info.value
        # Refused for good: neither a send nor a receive tries again.
        with pytest.raises(AuthenticationError):
            await a.send(1, key, "meta", b"again")
        with pytest.raises(AuthenticationError):
            await a.recv(1, key)
        assert not a.routes
        assert a.peers[1].state is PeerState.FAILED  # no channel, and no attempt under way
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize("use_uds", [False, True], ids=["tcp", "uds"])
@pytest.mark.parametrize("peer_token", [None, "another-token"], ids=["none", "another"])
async def test_accepting_rank_refuses_a_connector_without_the_token(
    use_uds: bool, peer_token: str | None, no_token: None
) -> None:
    a, b = _planes((TOKEN, peer_token), use_uds)
    await _members(a, b)
    key = (MatchKind.P2P, 0, 0, 0)
    waiting = a.recv(1, key)  # rank 0 only receives: rank 1 is the one who connects
    try:
        start = time.monotonic()
        with anyio.fail_after(REFUSAL_BOUND):
            sent: list[BaseException | None] = []
            try:
                await b.send(0, key, "meta", b"forged?")
                sent.append(None)
            except (AuthenticationError, ConnectionError) as exc:
                # Without a token, rank 1 is bound by no rule: it may just see rank 0
                # drop the connection before (or after) its frame went out.
                sent.append(exc)
            with pytest.raises(AuthenticationError) as info:
                await waiting
        assert time.monotonic() - start < REFUSAL_BOUND
        assert info.value.rank == 1  # rank 0 names the peer it refused
        if peer_token is None:
            assert "holds no token" in str(info.value)
        else:
            # Rank 1 holds a token too, and refused rank 0's proof in turn.
            (refused_by_b,) = sent
            assert isinstance(refused_by_b, AuthenticationError)
            assert refused_by_b.rank == 0
            assert "holds another one" in str(info.value)
        assert not a.matcher.take_posted_where(lambda k: True)  # no receive left hanging
    finally:
        await a.aclose()
        await b.aclose()


async def _mixed_tokens_body(g: ProcessGroup, op: str) -> dict[str, Any]:
    """Rank 1's data plane holds another token than the job's: each side refuses the other."""
    if g.rank == 1:
        g.session.plane.token = "another-token"
    start = time.monotonic()
    try:
        if op == "p2p":  # rank 0 only sends, rank 1 only receives
            t = torch.ones(4)
            if g.rank == 0:
                await aiodist.isend(t, dst=1, group=g)
            else:
                await aiodist.irecv(t, src=0, group=g)
        else:
            await aiodist.all_reduce(torch.ones(4), group=g)
    except AuthenticationError as exc:
        first: Any = (exc.rank, str(exc), time.monotonic() - start)
    else:
        first = None
    try:  # the group is broken: the next collective fails at once, with the same error
        await aiodist.all_gather_object(g.rank, group=g)
    except AuthenticationError as exc:
        after: Any = exc.rank
    else:
        after = None
    # On the server, so it still works: neither rank leaves (which would end the
    # other's wait another way) before both have their answer.
    await g.session.barrier()
    return {"first": first, "after": after}


@pytest.mark.parametrize(("op", "world"), [("p2p", 2), ("all_reduce", 2), ("all_reduce", 3)])
@pytest.mark.parametrize("uds", ["1", "0"], ids=["uds", "tcp"])
async def test_rank_with_another_token_is_refused_on_both_sides(
    token_server: RendezvousServer, monkeypatch: pytest.MonkeyPatch, op: str, world: int, uds: str
) -> None:
    monkeypatch.setenv("AIODIST_UDS", uds)
    with anyio.fail_after(20):
        outs = await run_ranks(
            token_server.address, world, functools.partial(_mixed_tokens_body, op=op), timeout=60
        )
    others = set(range(world)) - {1}
    for rank, out in enumerate(outs):
        assert out["first"] is not None, (rank, out)
        refused, message, elapsed = out["first"]
        # Rank 1 holds another token: every other rank names it, and it names one of them
        # (with three ranks, rank 2 may hear it from rank 0, over the wire).
        assert refused == 1 if rank != 1 else refused in others
        assert f"rank {refused}" in message
        assert elapsed < REFUSAL_BOUND
        assert out["after"] == refused


def test_authentication_error_keeps_the_rank_across_the_wire() -> None:
    sent = AuthenticationError("rank 3 could not prove the token", rank=3)
    received = from_wire(sent.code, str(sent), sent.wire_details())
    assert type(received) is AuthenticationError
    assert received.rank == 3
    server_side = from_wire(sent.code, "refused", AuthenticationError("refused").wire_details())
    assert isinstance(server_side, AuthenticationError)
    assert server_side.rank is None


MIXED_WORKER = textwrap.dedent(
    """
    import json, sys, time
    import anyio, torch
    import aiodist
    from aiodist._group.world import get_default_group

    async def main() -> None:
        url, rank = sys.argv[1], int(sys.argv[2])
        await aiodist.init_process_group(init_method=url, world_size=2, rank=rank,
                                         group_name="mixed")
        if rank == 1:  # its data plane holds another token than the one the server took
            get_default_group().session.plane.token = "another-token"
        out = {"rank": rank}
        start = time.monotonic()
        t = torch.ones(4)
        try:  # the group's timeout is the 30-minute default: only the refusal ends this
            if rank == 0:
                await aiodist.isend(t, dst=1)
            else:
                await aiodist.irecv(t, src=0)
            out["p2p"] = "completed"
        except aiodist.DistError as exc:
            out["p2p"] = [type(exc).__name__, getattr(exc, "rank", None), str(exc)]
        out["elapsed"] = time.monotonic() - start
        try:
            await aiodist.all_reduce(t)
            out["all_reduce"] = "completed"
        except aiodist.DistError as exc:
            out["all_reduce"] = [type(exc).__name__, getattr(exc, "rank", None)]
        await get_default_group().session.barrier()  # on the server: both stay till here
        with anyio.fail_after(30):
            await aiodist.destroy_process_group()
        print(json.dumps(out), flush=True)

    anyio.run(main)
    """
)


@pytest.mark.slow
@asyncio_only
async def test_ranks_in_processes_refuse_a_peer_with_another_token(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(MIXED_WORKER)
    outs: dict[int, dict[str, Any]] = {}
    async with serve("--port", "0", env={"AIODIST_TOKEN": TOKEN}) as d:
        url = f"tcp://{d.host}:{d.port}"
        # Without torch's group: its bring-up in init may connect the two planes (with
        # the right token) before rank 1 takes another one, and the send goes through.
        env = {"AIODIST_TOKEN": TOKEN, "PYTHONPATH": ROOT, "AIODIST_TORCH_GROUP": "0"}

        async def one(rank: int) -> None:
            outs[rank] = await run_worker(script, [url, str(rank)], env)

        with anyio.fail_after(60):  # run_process kills a worker still running at the end
            async with anyio.create_task_group() as tg:
                for rank in range(2):
                    tg.start_soon(one, rank)
        status = await run_cli("status", "--port", str(d.port), "--json", env=env)
    for rank, out in outs.items():
        assert out["returncode"] == 0, out
        kind, refused, message = out["p2p"]
        assert kind == "AuthenticationError", out
        assert refused == 1 - rank
        assert f"rank {refused}" in message
        assert out["elapsed"] < REFUSAL_BOUND
        assert out["all_reduce"] == ["AuthenticationError", refused]
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["jobs"] == []  # both left the job
