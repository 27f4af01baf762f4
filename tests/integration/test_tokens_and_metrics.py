"""Job tokens and the Prometheus endpoint of `aiodist serve`, with real processes and sockets."""

from __future__ import annotations

import functools
import json
import urllib.request
from typing import TYPE_CHECKING

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

import aiodist
from aiodist import AuthenticationError, open_process_group
from aiodist._control.connection import connect_control
from aiodist._launch.daemon import read_token_file
from aiodist._wire.messages import StatusRequest
from aiodist.testing import run_ranks
from tests.helpers.daemon import TOKEN, asyncio_only, run_cli, serve, token_file

if TYPE_CHECKING:
    from pathlib import Path

    from aiodist import ProcessGroup


# --- tokens -------------------------------------------------------------------------------


@pytest.mark.slow
@asyncio_only
async def test_token_accepted_refused_and_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = token_file(tmp_path)
    async with serve("--port", "0", "--token-file", str(path), "--log-level", "debug") as d:
        assert "token required" in d.ready
        url = f"tcp://{d.host}:{d.port}"
        port = str(d.port)

        monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
        with anyio.fail_after(30):
            async with open_process_group(url, world_size=1, group_name="ok") as g:
                await g.store.set("k", b"v")
                assert await g.store.get("k") == b"v"

        for token, expected in [("wrong-token", "does not match"), (None, "requires a token")]:
            if token is None:
                monkeypatch.delenv("AIODIST_TOKEN")
            else:
                monkeypatch.setenv("AIODIST_TOKEN", token)
            with anyio.fail_after(30), pytest.raises(AuthenticationError, match=expected):
                # rank 1: the kind of member that would retry a refused connection
                async with open_process_group(url, world_size=2, rank=1, group_name="bad"):
                    pass

        refused = await run_cli("status", "--port", port, "--json")
        assert refused.returncode == 1
        # Refused at connect (the server's first word) or at the request, by timing.
        assert "refused" in refused.stderr or "requires a token" in refused.stderr
        assert "AIODIST_TOKEN" in refused.stderr
        accepted = await run_cli("status", "--port", port, "--json", env={"AIODIST_TOKEN": TOKEN})
        assert accepted.returncode == 0, accepted.stderr
        from_file = await run_cli("status", "--port", port, "--token-file", str(path))
        assert from_file.returncode == 0, from_file.stderr
        # The refused members never reached the job table.
        assert json.loads(accepted.stdout)["jobs"] == []
    logged = d.output()
    # One refusal per client (two members, one status query): none was retried.
    assert logged.count("refused a connection from 127.0.0.1:") == 3, logged
    assert logged.count("proof of the token does not match") == 1, logged
    assert "does not match" in logged
    assert TOKEN not in logged
    assert "wrong-token" not in logged


async def test_token_refusal_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIODIST_TOKEN", raising=False)
    async with anyio.create_task_group() as tg:
        server = await tg.start(functools.partial(aiodist.serve_rendezvous, token=TOKEN))
        url = f"tcp://{server.address[0]}:{server.address[1]}"
        with anyio.fail_after(10), pytest.raises(AuthenticationError, match="requires a token"):
            async with open_process_group(url, world_size=1, group_name="x"):
                pass
        monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
        with anyio.fail_after(10):
            outs = await run_ranks(server.address, 2, lambda g: g.store.add("n", 1))
        assert sorted(outs) == [1, 2]
        assert server.auth_failures == 1
        assert "x" not in server.state.jobs
        tg.cancel_scope.cancel()


async def test_embedded_server_requires_the_token_when_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIODIST_TOKEN", TOKEN)
    with anyio.fail_after(20):
        async with open_process_group(f"file://{tmp_path}/rdzv", world_size=1) as g:
            server = g.session.server
            assert server is not None  # this process embedded it
            assert server.token == TOKEN

            async def ask_without_token() -> None:
                conn = await connect_control(*server.address, timeout=5, token="")
                try:
                    await conn.request(StatusRequest, timeout=5)
                finally:
                    conn.close()

            # Refused at once: the server's challenge is its first word, and the
            # client's connect waits for that word (the probe that tells a server).
            with pytest.raises(AuthenticationError, match="requires a token"):
                await ask_without_token()


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize("with_token", [False, True], ids=["no-token", "token"])
async def test_serve_warns_on_public_address_without_token(
    tmp_path: Path, with_token: bool
) -> None:
    args = ["--host", "0.0.0.0", "--port", "0", "--log-level", "warning"]
    if with_token:
        args += ["--token-file", str(token_file(tmp_path))]
    async with serve(*args) as daemon:
        assert daemon.host == "0.0.0.0"
        assert await daemon.stop() == 0
    warned = any("without a token" in line for line in daemon.lines["stderr"])
    assert warned is not with_token, daemon.output()


@pytest.mark.slow
@asyncio_only
async def test_serve_reports_bad_token_file_and_busy_port(tmp_path: Path) -> None:
    missing = await run_cli("serve", "--port", "0", "--token-file", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert "cannot read the token file" in missing.stderr
    (tmp_path / "empty").write_text("\n")
    empty = await run_cli("serve", "--port", "0", "--token-file", str(tmp_path / "empty"))
    assert empty.returncode == 2
    assert "is empty" in empty.stderr
    async with serve("--port", "0") as daemon:
        busy = await run_cli("serve", "--port", str(daemon.port))
        assert busy.returncode == 1
        assert "cannot listen" in busy.stderr


def test_read_token_file_strips_and_warns_when_others_can_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    path.write_text("  abc  \nsecond line\n")
    path.chmod(0o644)
    assert read_token_file(str(path)) == "abc"
    assert "chmod 600" in caplog.text
    assert "abc" not in caplog.text


# --- metrics ------------------------------------------------------------------------------


async def _scrape(url: str) -> dict[str, float]:
    def get() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            return str(response.read().decode())

    text = await anyio.to_thread.run_sync(get)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


@pytest.mark.slow
@asyncio_only
async def test_metrics_endpoint_counts_a_job() -> None:
    async with serve("--port", "0", "--metrics-port", "0") as daemon:
        url = daemon.ready.split("metrics on ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:")
        before = await _scrape(url)
        assert before["aiodist_joins_total"] == 0
        assert before["aiodist_members"] == 0
        assert before["aiodist_jobs{state=running}"] == 0
        assert before["aiodist_server_info{version=" + aiodist.__version__ + "}"] == 1
        assert before["process_resident_memory_bytes"] > 0
        during: list[dict[str, float]] = []

        async def body(g: ProcessGroup) -> None:
            for _ in range(5):
                await g.store.add("counter", 1)
            await g.session.barrier()
            if g.rank == 0:
                during.append(await _scrape(url))
            await g.session.barrier()

        with anyio.fail_after(30):
            await run_ranks(daemon.address, 3, body, group_name="metrics-job")
            after = await _scrape(url)
    (mid,) = during
    assert mid["aiodist_members"] == 3
    assert mid["aiodist_jobs{state=running}"] == 1
    assert mid["aiodist_connections"] == 1  # the three ranks of this process share one
    assert after["aiodist_joins_total"] == 3
    assert after["aiodist_jobs_formed_total"] == 1
    assert after["aiodist_store_operations_total"] >= 15
    assert after["aiodist_members"] == 0  # the job ended and was dropped
    assert after["aiodist_received_bytes_total"] > before["aiodist_received_bytes_total"]
    assert after["aiodist_sent_bytes_total"] > mid["aiodist_sent_bytes_total"] > 0
    assert after["aiodist_rank_failures_total"] == 0
