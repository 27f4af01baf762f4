"""Mutual TLS on the wire: the server, its clients and the ranks' TCP data plane.

Real servers, real clients and real sockets on 127.0.0.1; the certificates come
from ``trustme``. A recording proxy in the middle (``tests/helpers/proxy.py``)
sees what a man in the middle would: never a payload, a pickle, the job's name
or a store key in clear; and a byte it changes fails the connection with an
error that names the peer. No downgrade: a TLS server refuses a clear client
at once, a clear server a TLS client, and each side refuses a certificate that
another CA signed.
"""

from __future__ import annotations

import functools
import http.client
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch
import trustme

import aiodist
from aiodist import (
    AuthenticationError,
    DistError,
    ProtocolError,
    RendezvousError,
    serve_rendezvous,
)
from aiodist._control.connection import ControlConnection, connect_control
from aiodist._control.rendezvous import parse_init_method
from aiodist._launch.placement import place_server
from aiodist._launch.run import LaunchSpec
from aiodist._plane import routes
from aiodist._transport import tls
from aiodist._wire.messages import StatusRequest
from aiodist.testing import run_ranks
from tests.helpers import ROOT
from tests.helpers.daemon import asyncio_only, run_cli, serve, token_file
from tests.helpers.procs import Finished, free_port, run
from tests.helpers.proxy import RecordingProxy
from tests.helpers.tls import TLS_VARIABLES, make_tls, tls_env

if TYPE_CHECKING:
    import ssl
    from collections.abc import AsyncIterator
    from pathlib import Path

    from aiodist import ProcessGroup, RendezvousServer

REFUSAL_BOUND = 5.0  # a refusal is a round trip or two: far below any timeout
SECRET_JOB = "job-name-5ecret"
SECRET_KEY = "store-key-5ecret"
PAYLOAD_BYTE = 0x5A  # the tensors below are full of it


class Pickled:
    """Not plain data: travels as a pickle, whose class name would show in clear."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.note = "pickled-5ecret"


@pytest.fixture(scope="module")
def job_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def job_tls(tmp_path: Path, job_ca: trustme.CA) -> dict[str, str]:
    return make_tls(tmp_path, "rank", job_ca)


@pytest.fixture
def use_tls(job_tls: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process's ranks and clients use TLS, and TCP between ranks (no Unix socket)."""
    for name, value in job_tls.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AIODIST_UDS", "0")
    monkeypatch.setenv("AIODIST_SHM", "0")
    monkeypatch.delenv("AIODIST_TRANSPORT", raising=False)
    monkeypatch.delenv("AIODIST_TOKEN", raising=False)
    return job_tls


@pytest.fixture
async def tls_server(tmp_path: Path, job_ca: trustme.CA) -> AsyncIterator[RendezvousServer]:
    config = tls.from_env(make_tls(tmp_path, "server", job_ca))
    async with anyio.create_task_group() as tg:
        yield await tg.start(functools.partial(serve_rendezvous, tls=config))
        tg.cancel_scope.cancel()


async def _exercise(g: ProcessGroup) -> list[Any]:
    """Tensors both ways, a pickled object, the store: everything a job sends."""
    t = torch.full((64 * 1024,), g.rank + 1, dtype=torch.float32)
    await aiodist.all_reduce(t, group=g)
    payload = torch.full((256 * 1024,), PAYLOAD_BYTE, dtype=torch.uint8)
    if g.rank == 0:
        await aiodist.send(payload, dst=1, group=g)
    else:
        got = torch.empty_like(payload)
        await aiodist.recv(got, src=0, group=g)
        assert torch.equal(got, payload)
    objs = await aiodist.all_gather_object(Pickled(g.rank), group=g)
    store = g.store
    await store.set(f"{SECRET_KEY}-{g.rank}", b"v")
    await aiodist.barrier(group=g)
    return [float(t[0]), [o.rank for o in objs], await store.get(f"{SECRET_KEY}-0")]


def _assert_nothing_in_clear(seen: bytes) -> None:
    assert len(seen) > 0, "the proxy saw no traffic: it was not in the path"
    for secret in (SECRET_JOB, SECRET_KEY, "pickled-5ecret", Pickled.__qualname__):
        assert secret.encode() not in seen, f"{secret!r} crossed the proxy in clear"
    assert bytes([PAYLOAD_BYTE]) * 64 not in seen, "tensor bytes crossed the proxy in clear"


# --- the server and its clients -----------------------------------------------------------


async def test_job_runs_over_tls_with_proxy_seeing_nothing_in_clear(
    use_tls: dict[str, str], tls_server: RendezvousServer
) -> None:
    proxy = await RecordingProxy(tls_server.address).start()
    try:
        with anyio.fail_after(30):
            outs = await run_ranks(proxy.address, 2, _exercise, group_name=SECRET_JOB)
    finally:
        await proxy.aclose()
    assert outs == [[3.0, [0, 1], b"v"]] * 2
    _assert_nothing_in_clear(bytes(proxy.seen))
    assert proxy.seen[:1] == b"\x16"  # a TLS handshake record


async def test_members_come_back_to_their_restarted_server_over_tls(
    use_tls: dict[str, str],
    tmp_path: Path,
    job_ca: trustme.CA,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The connection a member opens again after a daemon restart is TLS, as its first
    # was: a clear one would never pass the TLS server, and the job would fail once the
    # grace ran out (and show the job's name and store keys in clear on the way).
    monkeypatch.setenv("AIODIST_SERVER_GRACE", "10")
    config = tls.from_env(make_tls(tmp_path, "server", job_ca))
    serve = functools.partial(serve_rendezvous, tls=config, state_dir=str(tmp_path / "state"))
    first = anyio.CancelScope()
    first_gone, both_in, restarted = anyio.Event(), anyio.Event(), anyio.Event()
    started: list[int] = []

    async def first_server(*, task_status: anyio.abc.TaskStatus[RendezvousServer]) -> None:
        try:
            with first:
                await serve("127.0.0.1", 0, task_status=task_status)
        finally:
            first_gone.set()

    async def body(g: ProcessGroup) -> list[Any]:
        await aiodist.barrier(group=g)
        started.append(g.rank)
        if len(started) == 2:
            both_in.set()
        await restarted.wait()
        out = await _exercise(g)  # the store's requests need the server back
        conn = g.session.conn.connection
        assert isinstance(conn, ControlConnection)
        transport = conn.transport_or_none()
        assert transport is not None
        assert transport.get_extra_info("ssl_object") is not None
        return out

    with anyio.fail_after(40):
        async with anyio.create_task_group() as servers:
            port = (await servers.start(first_server)).address[1]
            async with anyio.create_task_group() as job:
                outs: list[list[Any]] = []

                async def ranks() -> None:
                    outs.extend(await run_ranks(("127.0.0.1", port), 2, body))

                job.start_soon(ranks)
                await both_in.wait()
                first.cancel()  # it tells its members it will come back, and stops
                await first_gone.wait()
                await servers.start(functools.partial(serve, "127.0.0.1", port))
                restarted.set()
            servers.cancel_scope.cancel()
    assert outs == [[3.0, [0, 1], b"v"]] * 2


async def _status(address: tuple[str, int], **kwargs: Any) -> None:
    conn = await connect_control(*address, timeout=20, **kwargs)
    try:
        await conn.request(StatusRequest, timeout=20)
    finally:
        conn.close()


def _clear_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*TLS_VARIABLES, "AIODIST_TOKEN"):
        monkeypatch.delenv(name, raising=False)


async def test_clear_client_is_refused_by_a_tls_server_at_once(
    tls_server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_env(monkeypatch)
    start = time.monotonic()
    with anyio.fail_after(30), pytest.raises(ProtocolError) as info:
        await _status(tls_server.address)
    assert time.monotonic() - start < REFUSAL_BOUND
    message = str(info.value)
    assert "requires TLS and this client spoke clear TCP" in message
    assert "AIODIST_TLS_CERT" in message


async def test_tls_client_is_refused_by_a_clear_server_at_once(
    server: RendezvousServer, job_tls: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_env(monkeypatch)
    start = time.monotonic()
    with anyio.fail_after(30), pytest.raises(AuthenticationError) as info:
        await _status(server.address, tls_config=tls.from_env(job_tls))
    assert time.monotonic() - start < REFUSAL_BOUND
    message = str(info.value)
    assert f"{server.address[0]}:{server.address[1]} answered in clear, not TLS" in message
    assert "--tls-cert" in message


async def test_tls_rank_refuses_a_clear_server_when_joining(
    server: RendezvousServer, use_tls: dict[str, str]
) -> None:
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    with anyio.fail_after(30), pytest.raises(AuthenticationError, match="answered in clear"):
        async with aiodist.open_process_group(url, world_size=2, rank=1, timeout=20):
            raise AssertionError("joined a clear server")


async def test_server_certificate_from_another_ca_is_refused(
    tmp_path: Path, job_tls: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_env(monkeypatch)
    stranger = tls.from_env(make_tls(tmp_path, "stranger"))  # its own CA, and trusts only it
    async with anyio.create_task_group() as tg:
        srv = await tg.start(functools.partial(serve_rendezvous, tls=stranger))
        with anyio.fail_after(30), pytest.raises(AuthenticationError) as info:
            await _status(srv.address, tls_config=tls.from_env(job_tls))
        tg.cancel_scope.cancel()
    assert "presented a certificate that AIODIST_TLS_CA (--tls-ca) does not trust" in str(
        info.value
    )


async def test_client_certificate_from_another_ca_is_refused_by_the_server(
    tmp_path: Path,
    tls_server: RendezvousServer,
    job_ca: trustme.CA,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _clear_env(monkeypatch)
    # Trusts the job's CA (so it accepts the server), but another CA signed its certificate.
    files = make_tls(tmp_path, "intruder")
    files["AIODIST_TLS_CA"] = make_tls(tmp_path, "job-ca-copy", job_ca)["AIODIST_TLS_CA"]
    caplog.set_level(logging.WARNING, "aiodist._transport.tls")
    with anyio.fail_after(30), pytest.raises(AuthenticationError) as info:
        await _status(tls_server.address, tls_config=tls.from_env(files))
    # The server's alert, or (if it was lost with the closing connection) its silence.
    assert "refused this process's" in str(info.value)
    assert "AIODIST_TLS_CERT" in str(info.value)
    assert any("certificate" in r.getMessage() for r in caplog.records)


# --- the ranks' data plane --------------------------------------------------------------


async def test_ranks_talk_tls_through_a_proxy_that_sees_nothing_in_clear(
    use_tls: dict[str, str], tls_server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxies: list[RecordingProxy] = []
    real_connect = tls.connect

    async def through_proxy(address: str, sink: Any, **kwargs: Any) -> Any:
        host, port = address.removeprefix("tls://").rsplit(":", 1)
        proxy = RecordingProxy((host, int(port)))
        proxies.append(proxy)  # before it starts: closed even if its start is cancelled
        await proxy.start()
        return await real_connect(f"tls://{proxy.address[0]}:{proxy.address[1]}", sink, **kwargs)

    monkeypatch.setattr(tls, "connect", through_proxy)  # the real transport, dialing the proxy
    published: list[tuple[str, ...]] = []

    async def body(g: ProcessGroup) -> list[Any]:
        published.append(tuple((await g.session.plane.addresses())[g.rank]))
        return await _exercise(g)

    try:
        with anyio.fail_after(30):
            outs = await run_ranks(tls_server.address, 2, body, group_name=SECRET_JOB)
    finally:
        for proxy in proxies:
            await proxy.aclose()
    assert outs == [[3.0, [0, 1], b"v"]] * 2
    assert proxies, "no rank dialed another over TLS"
    for addresses in published:  # no clear TCP address is ever published
        assert all(a.startswith("tls://") for a in addresses if "://" in a), addresses
    seen = b"".join(bytes(p.seen) for p in proxies)
    assert len(seen) > 256 * 1024  # the payload went through it
    _assert_nothing_in_clear(seen)


# uvloop's loop.close() hangs after one of its SSL transports failed a record's check
# (the test itself passes there): run on asyncio's loop only.
@asyncio_only
async def test_a_byte_changed_between_ranks_fails_the_connection_naming_the_peer(
    use_tls: dict[str, str],
    tls_server: RendezvousServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxies: list[RecordingProxy] = []
    real_connect = tls.connect

    async def through_proxy(address: str, sink: Any, **kwargs: Any) -> Any:
        host, port = address.removeprefix("tls://").rsplit(":", 1)
        # Well past the handshake: inside the payload's records.
        proxy = RecordingProxy((host, int(port)), tamper_at=200_000)
        proxies.append(proxy)
        await proxy.start()
        return await real_connect(f"tls://{proxy.address[0]}:{proxy.address[1]}", sink, **kwargs)

    monkeypatch.setattr(tls, "connect", through_proxy)
    caplog.set_level(logging.WARNING)

    async def body(g: ProcessGroup) -> str:
        payload = torch.full((1024 * 1024,), PAYLOAD_BYTE, dtype=torch.uint8)
        try:
            if g.rank == 0:
                await aiodist.send(payload, dst=1, group=g)
            else:
                await aiodist.recv(torch.empty_like(payload), src=0, group=g)
        except DistError as exc:
            return type(exc).__name__
        return "completed"

    try:
        with anyio.fail_after(30):
            outs = await run_ranks(tls_server.address, 2, body, timeout=15)
    finally:
        for proxy in proxies:
            await proxy.aclose()
    assert any(p.tampered.is_set() for p in proxies)
    # The receiver never takes a changed payload: its receive fails.
    assert outs[1] in {"RankFailedError", "GroupBrokenError", "ProtocolError"}, outs
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "failed its integrity check" in m and "the data-plane peer at 127.0.0.1:" in m
        for m in messages
    ), messages


def test_tls_rank_and_clear_rank_refuse_each_other_naming_the_rank(
    job_tls: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in job_tls.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(routes.TlsMismatch, match=r"rank 3 speaks clear TCP .*AIODIST_TLS_CERT"):
        routes.tls_route(3, ["tcp://10.0.0.2:4000"], local=False)
    mine, _ = routes.tls_route(3, ["tls://10.0.0.2:4000"], local=False)
    assert mine == ["tls://10.0.0.2:4000"]
    _clear_env(monkeypatch)
    with pytest.raises(routes.TlsMismatch, match=r"rank 5 requires TLS .*set AIODIST_TLS_CERT"):
        routes.tls_route(5, ["tls://10.0.0.2:4000"], local=False)
    # Same host, over the Unix socket both use: allowed (same-host paths stay as they are).
    assert routes.tls_route(5, ["uds:x#1", "tls://10.0.0.2:4000"], local=True)[0] == []


# --- configuration ------------------------------------------------------------------------


def test_bad_configuration_names_the_variable(tmp_path: Path, job_tls: dict[str, str]) -> None:
    some = {"AIODIST_TLS_CERT": job_tls["AIODIST_TLS_CERT"]}
    with pytest.raises(ValueError, match="AIODIST_TLS_KEY and AIODIST_TLS_CA are missing"):
        tls.from_env(some)
    missing = {**job_tls, "AIODIST_TLS_CA": str(tmp_path / "nope.pem")}
    with pytest.raises(ValueError, match=r"AIODIST_TLS_CA=.*nope\.pem.* cannot be read"):
        tls.from_env(missing)
    other_key = make_tls(tmp_path, "other")["AIODIST_TLS_KEY"]
    with pytest.raises(ValueError, match=r"AIODIST_TLS_KEY .* does not match AIODIST_TLS_CERT"):
        tls.from_env({**job_tls, "AIODIST_TLS_KEY": other_key})
    with pytest.raises(ValueError, match="--tls-ca is missing"):
        tls.config_from(job_tls["AIODIST_TLS_CERT"], job_tls["AIODIST_TLS_KEY"], None)
    assert tls.from_env({}) is None


def test_tls_init_method_needs_the_variables(
    job_tls: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="asks for TLS: set AIODIST_TLS_CERT"):
        parse_init_method("tls://127.0.0.1:29500", environ={})
    spec = parse_init_method("tls://127.0.0.1:29500", rank=0, world_size=2, environ=job_tls)
    assert (spec.scheme, spec.host, spec.port) == ("tcp", "127.0.0.1", 29500)


# --- the CLI: aiodist serve, status, run ------------------------------------------------------


def _flags(files: dict[str, str]) -> list[str]:
    return [
        "--tls-cert",
        files["AIODIST_TLS_CERT"],
        "--tls-key",
        files["AIODIST_TLS_KEY"],
        "--tls-ca",
        files["AIODIST_TLS_CA"],
    ]


@asyncio_only
async def test_serve_and_status_with_tls_flags(tmp_path: Path, job_ca: trustme.CA) -> None:
    server_files = make_tls(tmp_path, "daemon", job_ca)
    client_files = make_tls(tmp_path, "operator", job_ca)
    async with serve("--port", "0", *_flags(server_files)) as daemon:
        assert "mutual TLS required" in daemon.ready
        where = ["--host", daemon.host, "--port", str(daemon.port)]
        ok = await run_cli("status", *where, *_flags(client_files))
        assert ok.returncode == 0, ok.stderr
        assert "0 jobs" in ok.stdout or "no jobs" in ok.stdout
        by_env = await run_cli("status", *where, env=client_files)  # AIODIST_TLS_* as defaults
        assert by_env.returncode == 0, by_env.stderr
        clear = await run_cli("status", *where)
        assert clear.returncode != 0
        assert "requires TLS and this client spoke clear TCP" in clear.stderr


@asyncio_only
async def test_cli_names_the_flag_of_an_incomplete_tls_configuration(tmp_path: Path) -> None:
    files = make_tls(tmp_path, "half")
    for command in ("serve", "status"):
        result = await run_cli(command, "--tls-cert", files["AIODIST_TLS_CERT"])
        assert result.returncode == 2, result.stderr
        assert "--tls-key (AIODIST_TLS_KEY) and --tls-ca (AIODIST_TLS_CA) are missing" in (
            result.stderr
        )


@asyncio_only
async def test_run_with_tls_flags_runs_ranks_over_tls(tmp_path: Path, job_ca: trustme.CA) -> None:
    files = make_tls(tmp_path, "ranks", job_ca)
    script = tmp_path / "job.py"
    script.write_text(
        "import aiodist.sync as dist, torch\n"
        "dist.init_process_group()\n"
        "t = torch.ones(4) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "from aiodist._transport import tls\n"
        "print('SUM', float(t[0]), tls.from_env() is not None, flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    env = {"AIODIST_UDS": "0", "AIODIST_SHM": "0"}
    result = await run_cli("run", "-n", "2", *_flags(files), str(script), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("SUM 3.0 True") == 2, result.stdout


async def test_tls_transport_passes_the_data_channel_conformance_suite(
    use_tls: dict[str, str],
) -> None:
    from aiodist.testing import check_data_channel

    with anyio.fail_after(60):
        await check_data_channel(tls)


async def _until_it_fails(conn: Any) -> None:
    while True:  # requests until the changed byte arrives
        await conn.request(StatusRequest, timeout=20)


@asyncio_only
async def test_a_byte_changed_towards_the_server_fails_the_connection_naming_it(
    tls_server: RendezvousServer,
    job_tls: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _clear_env(monkeypatch)
    caplog.set_level(logging.WARNING)
    # Past the TLS handshake (a few KiB): inside the first requests' records.
    proxy = await RecordingProxy(tls_server.address, tamper_at=6000).start()
    try:
        conn = await connect_control(*proxy.address, timeout=20, tls_config=tls.from_env(job_tls))
        with anyio.fail_after(30), pytest.raises(DistError) as info:
            await _until_it_fails(conn)
        conn.close()
    finally:
        await proxy.aclose()
    assert proxy.tampered.is_set()
    where = f"{proxy.address[0]}:{proxy.address[1]}"
    assert where in str(info.value), info.value
    # The server names the connection and why it closed it (the client may only see it close).
    assert any(
        "failed its integrity check" in r.getMessage()
        and "the client at 127.0.0.1:" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


# --- torch's calls ------------------------------------------------------------------------

TORCH_JOB = """
import sys, torch, torch.distributed as dist
import aiodist.sync as aiodist_sync
backend = None if sys.argv[1] == "none" else sys.argv[1]
rank = int(sys.argv[3])
# Each rank counts as a host of its own: a job across two hosts, on this one.
aiodist_sync.init_process_group(
    backend=backend, init_method=sys.argv[2], rank=rank, world_size=2, hostname=f"host-{rank}"
)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
model(torch.ones(2, 4)).sum().backward()
t = torch.ones(4)
dist.all_reduce(t)
print("TORCH", dist.get_backend(), float(t[0]), flush=True)
aiodist_sync.destroy_process_group()
"""


@asyncio_only
@pytest.mark.parametrize(("backend", "warned"), [("none", False), ("gloo", True)])
async def test_a_tls_jobs_torch_calls_ride_its_plane_and_gloo_across_hosts_warns(
    tmp_path: Path, job_ca: trustme.CA, backend: str, warned: bool
) -> None:
    files = make_tls(tmp_path, "ranks", job_ca)
    script = tmp_path / "torch_job.py"
    script.write_text(TORCH_JOB)
    port = free_port()
    env = {**tls_env(files), "AIODIST_UDS": "0", "AIODIST_SHM": "0", "PYTHONPATH": str(ROOT)}
    outs: list[Finished] = []

    async def one(rank: int) -> None:
        argv = [sys.executable, str(script), backend, f"tcp://127.0.0.1:{port}", str(rank)]
        outs.append(await run(argv, 90, env))

    async with anyio.create_task_group() as tg:
        for rank in range(2):
            tg.start_soon(one, rank)
    for out in outs:
        assert out.returncode == 0, out.stderr[-3000:]
        # No backend: torch's DDP and all_reduce on the aiodist backend, over TLS.
        assert f"TORCH {'aiodist' if backend == 'none' else 'gloo'} 2.0" in out.stdout
        assert ("gloo's traffic between them is not encrypted" in out.stderr) is warned


async def test_launcher_joining_a_tls_server_without_tls_says_it_requires_tls(
    tls_server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _clear_env(monkeypatch)
    host, port = tls_server.address
    spec = LaunchSpec(["true"], nproc=1, rdzv_endpoint=f"{host}:{port}", job_id="j")
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            with pytest.raises(RendezvousError) as info:
                await place_server(spec, tg, None)
    message = str(info.value)
    # Before: "something listens ... but hung up on an aiodist status request; start a
    # rendezvous server there with `aiodist serve --port P`".
    assert "requires TLS" in message, message
    assert "AIODIST_TLS_CERT" in message, message
    assert "aiodist serve" not in message, message


# --- the daemon's metrics port: its dashboard and /metrics ---------------------------------


def _http_get(
    address: tuple[str, int], path: str, token: str, context: ssl.SSLContext | None = None
) -> tuple[int, bytes]:
    conn = (
        http.client.HTTPConnection(*address, timeout=10)
        if context is None
        else http.client.HTTPSConnection(*address, timeout=10, context=context)
    )
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@asyncio_only
async def test_dashboard_of_a_tls_daemon_speaks_tls_and_shows_no_token_in_clear(
    use_tls: dict[str, str],
    tmp_path: Path,
    job_ca: trustme.CA,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The page sends the job's token to the metrics port (Authorization: Bearer) and gets
    # back the jobs, their hosts and pids. It spoke clear HTTP beside a TLS server: anyone
    # on the path read the token that every rank and the server rest on, and the job data.
    token = "dashboard-5ecret-token"
    monkeypatch.setenv("AIODIST_TOKEN", token)
    files = make_tls(tmp_path, "daemon", job_ca)
    tokens = str(token_file(tmp_path, token))
    args = ["--port", "0", "--metrics-port", "0", "--token-file", tokens, *_flags(files)]
    context = tls.from_env(use_tls)
    assert context is not None
    with anyio.fail_after(60):
        async with serve(*args) as daemon:
            url = daemon.ready.split("metrics on ", 1)[1].split(",", 1)[0].strip()
            assert url.startswith("https://"), daemon.ready  # what the operator is told
            metrics = (daemon.host, int(url.split("://", 1)[1].split("/", 1)[0].rsplit(":")[1]))
            proxy = await RecordingProxy(metrics).start()
            seen: dict[str, tuple[int, bytes]] = {}

            async def body(g: ProcessGroup) -> None:
                await aiodist.barrier(group=g)
                if g.rank == 0:
                    seen["clear"] = await anyio.to_thread.run_sync(
                        _http_get, metrics, "/api/state", token
                    )
                    for path in ("/api/state", "/metrics"):
                        try:
                            seen[path] = await anyio.to_thread.run_sync(
                                _http_get, proxy.address, path, token, context.client_context()
                            )
                        except OSError as exc:  # a clear port answers a TLS hello so
                            seen[path] = (0, repr(exc).encode())
                await aiodist.barrier(group=g)

            try:
                await run_ranks(daemon.address, 2, body, group_name=SECRET_JOB)
            finally:
                await proxy.aclose()
    status, clear = seen["clear"]
    assert status == 400, (status, clear)  # a clear request gets no job data, and why
    assert SECRET_JOB.encode() not in clear, clear
    assert b"requires TLS" in clear, clear
    status, state = seen["/api/state"]
    assert status == 200, state
    assert SECRET_JOB.encode() in state, state
    status, scraped = seen["/metrics"]
    assert status == 200, scraped
    assert b"aiodist_joins_total 2.0" in scraped, scraped
    assert proxy.seen[:1] == b"\x16"  # a TLS handshake record
    assert token.encode() not in proxy.seen, "the token crossed the proxy in clear"
    assert SECRET_JOB.encode() not in proxy.seen, "the job's name crossed the proxy in clear"
