"""Rendezvous with the real in-process server and several real clients on 127.0.0.1."""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import aiodist
from aiodist import (
    DistTimeoutError,
    ProcessGroup,
    RankFailedError,
    RendezvousError,
    RendezvousServer,
    RendezvousTimeout,
    open_process_group,
)
from aiodist._control.connection import ControlConnection
from aiodist._errors import ProtocolError
from aiodist._transport import uds
from aiodist._wire.frame import (
    NEED_DATA,
    PREFIX,
    PROTOCOL_VERSION,
    FrameDecoder,
    encode_message,
    frame_message,
)
from aiodist._wire.messages import Heartbeat, Join, StatusRequest, Welcome
from aiodist.testing import run_ranks
from tests.helpers.procs import free_port

if TYPE_CHECKING:
    from collections.abc import Awaitable
    from pathlib import Path


def _url(server: RendezvousServer) -> str:
    return f"tcp://{server.address[0]}:{server.address[1]}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
async def test_explicit_ranks_form_job_with_member_table(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> tuple[int, int, list[int]]:
        return g.rank, g.world_size, [m.rank for m in await g.session.members()]

    ranks = list(reversed(range(world_size)))  # join order differs from rank order
    with anyio.fail_after(10):
        outs = await run_ranks(server.address, world_size, body, ranks=ranks)
    assert outs == [(r, world_size, list(range(world_size))) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 4, 8])
async def test_automatic_ranks_are_distinct_and_complete(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> int:
        return g.rank

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, world_size, body)
    assert outs == list(range(world_size))


async def test_automatic_ranks_contiguous_per_host_with_local_ranks(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> tuple[str, int, int]:
        me = (await g.session.members())[g.rank]
        return me.host, g.session.local_rank, g.session.local_size

    hosts = ["node-b", "node-a", "node-b", "node-a", "node-b", "node-a"]
    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 6, body, hostnames=hosts)
    # Hosts are ordered by first join; ranks of one host are contiguous.
    assert [h for h, _, _ in outs] == ["node-b"] * 3 + ["node-a"] * 3
    assert [lr for _, lr, _ in outs] == [0, 1, 2, 0, 1, 2]
    assert {ls for _, _, ls in outs} == {3}


async def test_member_table_carries_published_addresses(server: RendezvousServer) -> None:
    async def one(rank: int) -> list[tuple[str, ...]]:
        async with open_process_group(
            _url(server),
            world_size=2,
            rank=rank,
            group_name="addr",
            addresses=[f"tcp://127.0.0.1:{4000 + rank}"],
        ) as g:
            return [m.addresses for m in await g.session.members()]

    results: list[list[tuple[str, ...]]] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for r in range(2):
                tg.start_soon(_append, results, one(r))
    assert results[0] == results[1]
    for rank, addresses in enumerate(results[0]):
        # The caller's addresses first, then the data plane's own listener: on a
        # loopback server every member is on this host, so a Unix socket only.
        assert addresses[0] == f"tcp://127.0.0.1:{4000 + rank}"
        assert [a for a in addresses[1:] if not a.startswith("shm:")] == [
            a for a in addresses[1:] if a.startswith("uds:aiodist-")
        ]
        assert len([a for a in addresses if a.startswith("uds:")]) == 1


async def test_ranks_listen_on_tcp_when_unix_sockets_are_off(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIODIST_UDS", "0")

    async def body(g: ProcessGroup) -> tuple[tuple[str, ...], list[float]]:
        out = await aiodist.all_gather_object(float(g.rank), group=g)
        return (await g.session.members())[g.rank].addresses, out

    with anyio.fail_after(10):
        results = await run_ranks(server.address, 2, body)
    for addresses, gathered in results:
        assert [a for a in addresses if not a.startswith("shm:")] == [
            a for a in addresses if a.startswith("tcp://127.0.0.1:")
        ]
        assert any(a.startswith("tcp://") for a in addresses)
        assert gathered == [0.0, 1.0]


async def test_ranks_of_other_hosts_on_a_loopback_server_talk_over_unix_sockets(
    server: RendezvousServer,
) -> None:
    # Host names say "two hosts", but a loopback server means one: the only address
    # each rank publishes is its Unix socket, and that is what peers connect to.
    async def body(g: ProcessGroup) -> tuple[set[int], list[float]]:
        out = await aiodist.all_gather_object(float(g.rank), group=g)
        families = {
            c._transport.get_extra_info("socket").family  # type: ignore[attr-defined]
            for c in g.session.plane.routes.values()
        }
        return families, out

    with anyio.fail_after(10):
        results = await run_ranks(server.address, 2, body, hostnames=["node-a", "node-b"])
    for families, gathered in results:
        assert families == {socket.AF_UNIX}
        assert gathered == [0.0, 1.0]


async def test_ranks_of_one_process_share_one_unix_listener(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> tuple[str, list[int]]:
        members = await g.session.members()
        (address,) = [a for a in members[g.rank].addresses if a.startswith("uds:")]
        gathered = await aiodist.all_gather_object(g.rank, group=g)  # through that listener
        return address, gathered

    with anyio.fail_after(10):
        results = await run_ranks(server.address, 3, body)
    addresses = [address for address, _ in results]
    assert len({uds.socket_name(a) for a in addresses}) == 1  # one listening socket
    members = [uds.member_of(a) for a in addresses]
    assert len(set(members)) == 3  # each rank its own member on it
    assert min(members) > 0
    assert [gathered for _, gathered in results] == [[0, 1, 2]] * 3


async def _append(out: list[Any], coro: Awaitable[Any]) -> None:
    out.append(await coro)


async def test_store_operations_follow_tcpstore(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> None:
        store = g.store
        if g.rank == 0:
            await store.set("a", "1")
            assert await store.add("counter", 5) == 5
            assert await store.compare_set("cas", b"", b"first") == b"first"
            assert await store.compare_set("cas", b"wrong", b"x") == b"first"
            assert await store.compare_set("cas", b"first", b"second") == b"second"
            assert await store.compare_set("missing", b"exp", b"x") == b"exp"
            await store.set("go", b"")
        else:
            assert await store.get("go") == b""  # waits for rank 0
            assert await store.get("a") == b"1"
            assert await store.add("counter", 2) == 7
            assert await store.get("counter") == b"7"
            assert await store.check(["a", "cas"]) is True
            assert await store.check(["a", "nope"]) is False
            assert await store.num_keys() == 4
            assert await store.delete_key("a") is True
            assert await store.delete_key("a") is False
            assert await store.num_keys() == 3

    with anyio.fail_after(10):
        await run_ranks(server.address, 2, body, ranks=[0, 1])


async def test_store_get_and_wait_time_out(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> None:
        with pytest.raises(DistTimeoutError, match="never"):
            await g.store.get("never", timeout=0.2)
        with pytest.raises(DistTimeoutError, match="missing"):
            await g.store.wait(["present", "missing"], timeout=0.2)

    async def setup(g: ProcessGroup) -> None:
        await g.store.set("present", b"x")
        await g.session.barrier()
        await body(g)

    with anyio.fail_after(10):
        await run_ranks(server.address, 2, setup)


async def test_store_wait_and_check_non_str_key_raise_type_error_and_send_nothing(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> None:
        with pytest.raises(TypeError, match="store keys are str, got bytes"):
            await g.store.wait(["ok", b"k"])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="store keys are str, got int"):
            await g.store.check(["ok", 1])  # type: ignore[list-item]
        await g.store.set("ok", b"1")  # the connection is still in order
        await g.store.wait(["ok"], timeout=5)

    with anyio.fail_after(10):
        await run_ranks(server.address, 1, body)


async def test_store_wait_on_a_list_changed_since_waits_on_its_new_keys(
    server: RendezvousServer,
) -> None:
    # Waits on the same keys reuse their packing; a list changed in place is packed anew.
    async def body(g: ProcessGroup) -> None:
        keys = ["first"]
        await g.store.set("first", b"1")
        await g.store.wait(keys)
        keys.append("second")
        with pytest.raises(DistTimeoutError, match="second"):
            await g.store.wait(keys, timeout=0.2)
        await g.store.wait(["first"])

    with anyio.fail_after(10):
        await run_ranks(server.address, 1, body)


async def test_store_wait_released_by_last_key(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> int:
        await g.store.set(f"k{g.rank}", str(g.rank))
        await g.store.wait([f"k{r}" for r in range(g.world_size)], timeout=5)
        return int(await g.store.get(f"k{(g.rank + 1) % g.world_size}"))

    with anyio.fail_after(10):
        assert await run_ranks(server.address, 4, body) == [1, 2, 3, 0]


async def test_barrier_waits_for_every_rank(server: RendezvousServer) -> None:
    arrived: list[int] = []
    passed: list[int] = []

    async def body(g: ProcessGroup) -> None:
        if g.rank == 2:  # the last rank arrives only once the others are waiting
            await g.store.wait([f"waiting/{r}" for r in range(g.world_size) if r != 2])
            assert passed == []
        arrived.append(g.rank)
        await g.store.set(f"waiting/{g.rank}", b"")
        await g.session.barrier()
        passed.append(g.rank)

    with anyio.fail_after(10):
        await run_ranks(server.address, 3, body)
    assert sorted(passed) == [0, 1, 2]
    assert arrived[-1] == 2


async def test_duplicate_rank_is_refused_and_job_stays_intact(server: RendezvousServer) -> None:
    async def join(rank: int) -> int:
        async with open_process_group(_url(server), world_size=2, rank=rank, group_name="dup") as g:
            return g.rank

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            results: list[int] = []
            tg.start_soon(_append, results, join(0))
            await server.wait_for_members("dup", 1)
            with pytest.raises(RendezvousError, match="rank 0 of job 'dup' is already taken"):
                await join(0)
            tg.start_soon(_append, results, join(1))
    assert sorted(results) == [0, 1]


async def test_world_size_mismatch_and_full_job_are_refused(server: RendezvousServer) -> None:
    url = _url(server)
    with anyio.fail_after(10):
        # While the job forms, another world size breaks it for every member waiting.
        waiting: list[RendezvousError] = []

        async def first() -> None:
            with pytest.raises(RendezvousError, match="disagree on world_size") as info:
                async with open_process_group(url, world_size=2, rank=0, group_name="j"):
                    pass
            waiting.append(info.value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await server.wait_for_members("j", 1)
            with pytest.raises(RendezvousError, match=r"1 joined with 2 .* with 3") as info:
                async with open_process_group(url, world_size=3, group_name="j"):
                    pass
        assert [str(e) for e in waiting] == [str(info.value)]
        assert "j" not in server.state.jobs

        # Once it formed, a stray joiner is refused and the job goes on.
        async with anyio.create_task_group() as tg:
            done = anyio.Event()

            async def member(rank: int) -> None:
                async with open_process_group(url, world_size=2, rank=rank, group_name="j"):
                    await done.wait()

            tg.start_soon(member, 0)
            tg.start_soon(member, 1)
            await server.wait_until(lambda s: "j" in s.state.jobs and s.state.jobs["j"].complete)
            with pytest.raises(RendezvousError, match="running with world_size 2, but this"):
                async with open_process_group(url, world_size=3, group_name="j"):
                    pass
            with pytest.raises(RendezvousError, match="already has all 2 members"):
                async with open_process_group(url, world_size=2, group_name="j"):
                    pass
            done.set()


async def test_rendezvous_times_out_naming_what_joined(server: RendezvousServer) -> None:
    with anyio.fail_after(10), pytest.raises(RendezvousTimeout, match="1 of 3 members joined"):
        async with open_process_group(_url(server), world_size=3, group_name="lonely", timeout=0.3):
            pass
    assert "lonely" not in server.state.jobs


async def test_two_jobs_share_one_server(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> bytes:
        await g.store.set("who", g.name)
        await g.session.barrier()
        return await g.store.get("who")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            a: list[list[bytes]] = []
            b: list[list[bytes]] = []
            tg.start_soon(_append, a, run_ranks(server.address, 3, body, group_name="job-a"))
            tg.start_soon(_append, b, run_ranks(server.address, 2, body, group_name="job-b"))
    assert a == [[b"job-a"] * 3]
    assert b == [[b"job-b"] * 2]
    assert server.state.jobs == {}  # both jobs' state dropped once their members left


async def test_members_of_one_process_share_one_connection(server: RendezvousServer) -> None:
    seen: list[int] = []

    async def body(g: ProcessGroup) -> int:
        await g.store.set(f"k{g.rank}", b"x")
        await g.session.barrier()
        seen.append(server.num_connections)  # every member of both jobs has joined
        await g.session.barrier()
        return g.rank

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            a: list[list[int]] = []
            b: list[list[int]] = []
            tg.start_soon(_append, a, run_ranks(server.address, 6, body, group_name="job-a"))
            tg.start_soon(_append, b, run_ranks(server.address, 2, body, group_name="job-b"))
    assert a == [list(range(6))]
    assert b == [[0, 1]]
    assert seen == [1] * 8  # eight members, one socket
    # The connection closed with its last member, and the server forgot every channel.
    await server.wait_until(lambda s: s.num_connections == 0)
    assert server.state.membership.conns == {}
    assert server._hub.conns == {}


async def test_own_connection_per_member_when_sharing_is_off(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIODIST_SHARED_CONTROL", "0")

    async def body(g: ProcessGroup) -> int:
        await g.session.barrier()
        count = server.num_connections
        await g.session.barrier()
        return count

    with anyio.fail_after(10):
        assert await run_ranks(server.address, 3, body) == [3, 3, 3]


async def test_disconnected_member_fails_the_others(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> str:
        await g.session.barrier()
        if g.rank == 1:
            g.session.conn.close()  # as if the process died: no Leave
            return "gone"
        await g.session.trouble()  # the server's notice breaks the group that holds it
        assert isinstance(g.error, RankFailedError)
        assert g.error.rank == 1
        # Only what needs rank 1 breaks: the session, its store and the others go on.
        assert g.session.error is None
        assert list(g.session.failed_ranks) == [1]
        await g.store.set(f"after/{g.rank}", b"1")
        assert await g.store.get(f"after/{g.rank}") == b"1"
        return "saw failure"

    with anyio.fail_after(10):
        outs = await run_ranks(server.address, 3, body)
    assert outs == ["saw failure", "gone", "saw failure"]


async def test_silent_member_is_declared_failed(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Heartbeats are a connection's: give each rank its own, so that one can go quiet.
    monkeypatch.setenv("AIODIST_SHARED_CONTROL", "0")

    async def body(g: ProcessGroup) -> int:
        if g.rank == 0:
            # Stop heartbeats: the member stays connected but silent.
            connection = g.session.conn.connection
            assert isinstance(connection, ControlConnection)
            connection.heartbeats.stop()
            await anyio.sleep_forever()
        await g.session.trouble()  # the server's notice breaks the group that holds it
        assert isinstance(g.error, RankFailedError)
        assert "missed heartbeats" in str(g.error)
        return g.error.rank

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            outs: list[list[int]] = []

            async def run() -> None:
                outs.append(
                    await run_ranks(
                        server.address,
                        2,
                        body,
                        ranks=[0, 1],
                        heartbeat_interval=0.05,
                        heartbeat_timeout=0.5,
                    )
                )

            tg.start_soon(run)
            await server.wait_until(lambda s: s.state.stats.failures == 1)
            tg.cancel_scope.cancel()
    assert server.state.stats.failures == 1


async def test_idle_members_stay_alive_on_heartbeats_alone(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> int:
        # Silent for four heartbeat timeouts: only the heartbeat timer speaks for it.
        await anyio.sleep(2.0)
        await g.session.barrier()
        return g.rank

    with anyio.fail_after(20):
        ranks = await run_ranks(
            server.address, 2, body, heartbeat_interval=0.05, heartbeat_timeout=0.5
        )
    assert ranks == [0, 1]
    assert server.state.stats.failures == 0


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x00" * 64,
        PREFIX.pack(b"AD", PROTOCOL_VERSION, 1, 2**31, 0),  # announces a 2 GiB header
        PREFIX.pack(b"AD", PROTOCOL_VERSION, 4, 0, 2**40),  # announces a 1 TiB payload
        PREFIX.pack(b"AD", PROTOCOL_VERSION, 1, 3, 0) + b"\xc1\xc1\xc1",  # undecodable msgpack
        PREFIX.pack(b"AD", PROTOCOL_VERSION, 1, 2, 0) + b"\x91\x01",  # Join with one field
        PREFIX.pack(b"AD", 9, 1, 0, 0),  # another protocol version
    ],
)
async def test_garbage_closes_only_that_connection(
    server: RendezvousServer, garbage: bytes
) -> None:
    loop = asyncio.get_running_loop()
    with anyio.fail_after(10):
        reader, writer = await asyncio.open_connection(*server.address)
        writer.write(garbage)
        await writer.drain()
        # The server answers with an error frame (or nothing) and closes the connection.
        await reader.read()
        writer.close()

        async def body(g: ProcessGroup) -> int:
            return g.rank

        assert await run_ranks(server.address, 2, body) == [0, 1]
    assert loop.is_running()


async def test_status_request_reports_jobs(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> dict:  # type: ignore[type-arg]
        await g.session.barrier()
        snap: dict = await g.session.conn.request(StatusRequest)  # type: ignore[type-arg]
        await g.session.barrier()
        return snap

    with anyio.fail_after(10):
        snaps = await run_ranks(server.address, 2, body, group_name="observed")
    (job,) = snaps[0]["jobs"]
    assert job["name"] == "observed"
    assert job["state"] == "running"
    assert sorted(m["rank"] for m in job["members"]) == [0, 1]


async def test_embedded_server_started_by_rank_zero() -> None:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"

    async def member(rank: int, out: list[int]) -> None:
        async with open_process_group(url, world_size=3, rank=rank, group_name="emb") as g:
            await g.store.set(f"r{rank}", b"")
            await g.store.wait(["r0", "r1", "r2"])
            out.append(g.session.server is not None)

    with anyio.fail_after(20):
        out: list[int] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(member, 1, out)  # non-zero ranks wait for the server to appear
            tg.start_soon(member, 2, out)
            tg.start_soon(member, 0, out)
    assert sorted(out) == [False, False, True]


async def test_env_rendezvous(monkeypatch: pytest.MonkeyPatch, server: RendezvousServer) -> None:
    monkeypatch.setenv("MASTER_ADDR", server.address[0])
    monkeypatch.setenv("MASTER_PORT", str(server.address[1]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("AIODIST_JOB_ID", "env-job")

    async def member(rank: int, out: list[tuple[int, int, str]]) -> None:
        async with open_process_group("env://", rank=rank) as g:
            out.append((g.rank, g.world_size, g.name))

    out: list[tuple[int, int, str]] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(member, 0, out)
            tg.start_soon(member, 1, out)
    assert sorted(out) == [(0, 2, "env-job"), (1, 2, "env-job")]


async def test_env_rendezvous_without_variables_says_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RendezvousError, match="MASTER_ADDR and MASTER_PORT"):
        async with open_process_group("env://", world_size=1, rank=0):
            pass


async def test_file_rendezvous_with_automatic_ranks(tmp_path: Path) -> None:
    path = tmp_path / "rdzv"

    async def member(out: list[int]) -> None:
        async with open_process_group(f"file://{path}", world_size=4, group_name="f") as g:
            await g.session.barrier()
            out.append(g.rank)

    out: list[int] = []
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(member, out)
    assert sorted(out) == [0, 1, 2, 3]
    # A second job on the same file replaces the stale address.
    out.clear()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(lambda: _file_member(path, out))
    assert sorted(out) == [0, 1]


async def test_file_rendezvous_refused_token_is_reported_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rdzv"
    url = f"file://{path}"
    monkeypatch.setenv("AIODIST_TOKEN", "the-job-token")
    with anyio.fail_after(20):
        async with open_process_group(url, world_size=1, group_name="first") as g:
            address = path.read_text()  # g's process embeds the server named there
            monkeypatch.setenv("AIODIST_TOKEN", "another-token")
            with pytest.raises(aiodist.AuthenticationError):
                async with open_process_group(url, world_size=1, group_name="stranger"):
                    pass
            assert path.read_text() == address  # the refusal did not replace the server
            monkeypatch.setenv("AIODIST_TOKEN", "the-job-token")
            async with open_process_group(url, world_size=1, group_name="second") as h:
                assert (g.rank, h.rank) == (0, 0)
                assert path.read_text() == address


async def _file_member(path: Path, out: list[int]) -> None:
    async with open_process_group(f"file://{path}", world_size=2, group_name="f2") as g:
        out.append(g.rank)


async def test_default_group_queries_and_teardown(server: RendezvousServer) -> None:
    assert not aiodist.is_initialized()
    assert aiodist.get_dist_info() == (0, 1)
    assert aiodist.get_backend() is None
    assert aiodist.is_main_process()
    assert (aiodist.get_local_rank(), aiodist.get_local_size()) == (0, 1)

    released = anyio.Event()

    async def other() -> None:
        async with open_process_group(_url(server), world_size=2, rank=0, group_name="dflt"):
            await released.wait()

    @aiodist.master_only
    def only_main() -> str:
        return "ran"

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            # "mpi" is recorded only; "gloo"/"nccl" would also bring up torch.distributed,
            # which needs one process per rank (see test_torch_bridge.py).
            await aiodist.init_process_group(
                "mpi", _url(server), world_size=2, rank=1, group_name="dflt"
            )
            try:
                assert aiodist.is_initialized()
                assert aiodist.get_dist_info() == (1, 2)
                assert aiodist.get_backend() == "mpi"
                assert not aiodist.is_main_process()
                assert only_main() is None
                with pytest.raises(RuntimeError, match="already initialised"):
                    await aiodist.init_process_group(init_method=_url(server), world_size=2)
            finally:
                await aiodist.destroy_process_group()
                released.set()
    assert not aiodist.is_initialized()
    assert only_main() == "ran"
    assert aiodist.get_rank() == 0


async def test_master_only_runs_on_main_process_only() -> None:
    calls: list[str] = []

    @aiodist.master_only
    def plain(x: int) -> int:
        calls.append("plain")
        return x + 1

    @aiodist.master_only
    async def coro(x: int) -> int:
        calls.append("coro")
        return x * 2

    assert plain(1) == 2
    assert await coro(3) == 6
    assert calls == ["plain", "coro"]


async def test_malformed_welcome_raises_protocol_error_and_hangs_up() -> None:
    # A server that answers the join with host runs covering 3 ranks of a 2-rank job.
    hung_up = anyio.Event()

    async def fake_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dec = FrameDecoder()
        join = None
        while not isinstance(join, Join):  # the member names its channel first
            while (event := dec.next_event()) is NEED_DATA:
                dec.receive_data(await reader.read(65536))
            join = frame_message(event)  # type: ignore[arg-type]
            if isinstance(join, Heartbeat):  # the client's probe: a server echoes it
                writer.writelines(encode_message(Heartbeat()))
        writer.writelines(encode_message(Welcome(join.req_id, 0, 2, 0, 2, [[0, 3]])))
        await reader.read()  # the client closes its end
        hung_up.set()
        writer.close()

    srv = await asyncio.start_server(fake_server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        with anyio.fail_after(10):
            with pytest.raises(ProtocolError, match=r"malformed Welcome.*covers 3 ranks"):
                async with open_process_group(f"tcp://127.0.0.1:{port}", world_size=2, rank=1):
                    pytest.fail("joined despite a malformed Welcome")
            await hung_up.wait()
    finally:
        srv.close()
