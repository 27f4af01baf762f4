"""The daemon's dashboard: its page, files and /api/state over real HTTP, and in a real browser."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import signal
import socket
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
from aiodist._control.connection import connect_control
from aiodist._server.dashboard import PAGE_JOBS, PAGE_MAX
from aiodist._server.metrics import MAX_REQUESTS, start_metrics
from aiodist._server.state import STATUS_JOBS
from aiodist._server.traffic import HISTORY_INTERVAL, HISTORY_POINTS
from aiodist._wire.messages import Join
from aiodist.testing import run_ranks
from tests.helpers import HELPERS
from tests.helpers.daemon import asyncio_only, run_cli, serve, token_file
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from aiodist._server.metrics import MetricsEndpoint

TOKEN = "dashboard-test-token"
WORKER = str(HELPERS / "observe_worker.py")


def get(
    address: tuple[str, int], path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(*address, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


async def fetch(address: tuple[str, int], path: str, **headers: str) -> tuple[int, Any, bytes]:
    return await anyio.to_thread.run_sync(lambda: get(address, path, headers))


@pytest.fixture
async def endpoint(server: aiodist.RendezvousServer) -> AsyncIterator[MetricsEndpoint]:
    ep = start_metrics(server, asyncio.get_running_loop(), "127.0.0.1", 0)
    try:
        yield ep
    finally:
        await anyio.to_thread.run_sync(ep.close)


@asyncio_only
async def test_page_and_files_are_served_with_a_strict_policy(endpoint: MetricsEndpoint) -> None:
    status, headers, body = await fetch(endpoint.address, "/")
    assert status == 200
    assert headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"
    assert b'<script src="/dashboard.js"' in body
    assert b"<script>" not in body  # no inline script: the policy would refuse it
    status, headers, js = await fetch(endpoint.address, "/dashboard.js")
    assert status == 200
    assert b"innerHTML" not in js  # every value is rendered as text
    status, _, _ = await fetch(endpoint.address, "/nope")
    assert status == 404
    status, _, metrics = await fetch(endpoint.address, "/metrics")
    assert status == 200
    assert b"aiodist_uptime_seconds" in metrics


@asyncio_only
async def test_state_lists_a_job_its_ranks_and_where_they_are(
    server: aiodist.RendezvousServer, endpoint: MetricsEndpoint
) -> None:
    entered = anyio.Event()
    release = anyio.Event()

    async def body(g: aiodist.ProcessGroup) -> None:
        await aiodist.barrier(group=g)
        if g.rank == 1:
            await release.wait()  # rank 1 stays out of the all_reduce for a while
        else:
            entered.set()
        await aiodist.all_reduce(torch.ones(2), group=g)

    async def watch() -> dict[str, Any]:
        await entered.wait()
        while True:
            status, _, raw = await fetch(endpoint.address, "/api/state")
            assert status == 200
            state = json.loads(raw)
            jobs = [j for j in state["jobs"] if j["name"] == "dash"]
            # The ranks' reports come every 0.05 s: one of rank 0's may still show the
            # barrier it has just left.
            if jobs and any(c["name"] == "all_reduce" for c in jobs[0]["waits"]):
                release.set()
                found: dict[str, Any] = jobs[0]
                return found
            await anyio.sleep(0.1)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: run_ranks(
                    server.address, 2, body, group_name="dash", heartbeat_interval=0.05
                )
            )
            job = await watch()
    assert job["state"] == "running"
    assert [m["rank"] for m in job["members"]] == [0, 1]
    assert all(m["pid"] == os.getpid() for m in job["members"])
    (call,) = job["waits"]
    assert call["name"] == "all_reduce"
    assert [w["rank"] for w in call["waiting"]] == [0]
    assert [n["rank"] for n in call["not_entered"]] == [1]
    assert job["traffic"]["messages_per_second"] >= 0
    _, _, raw = await fetch(endpoint.address, "/api/state")
    events = json.loads(raw)["events"]
    kinds = [e["event"] for e in events if e["job"] == "dash"]
    assert kinds[:2] == ["job_created", "rank_joined"]
    assert "job_formed" in kinds


@asyncio_only
async def test_state_shows_the_data_the_ranks_send_each_other(
    server: aiodist.RendezvousServer, endpoint: MetricsEndpoint
) -> None:
    # The ranks all_reduce 256 KiB tensors until the page's rates show it: the data
    # they move between themselves, as their heartbeats report it, not the few
    # control messages they send the server.
    nbytes = 256 * 1024
    seen = anyio.Event()

    async def body(g: aiodist.ProcessGroup) -> int:
        calls = 0
        while True:
            await aiodist.all_reduce(torch.ones(nbytes // 4), group=g)
            calls += 1
            # One stop flag, reduced with the data: every rank stops after the same call.
            stop = torch.tensor([1.0 if seen.is_set() else 0.0])
            await aiodist.all_reduce(stop, group=g)
            if stop.item() > 0:
                return calls

    async def watch() -> dict[str, Any]:
        while True:
            status, _, raw = await fetch(endpoint.address, "/api/state")
            assert status == 200
            jobs = [j for j in json.loads(raw)["jobs"] if j["name"] == "busy"]
            if jobs and jobs[0]["traffic"]["bytes_per_second"] >= 1024 * 1024:
                seen.set()
                found: dict[str, Any] = jobs[0]
                return found
            await anyio.sleep(0.2)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            results: list[list[int]] = []

            async def ranks() -> None:
                results.append(
                    await run_ranks(
                        server.address, 2, body, group_name="busy", heartbeat_interval=0.05
                    )
                )

            tg.start_soon(ranks)
            job = await watch()
    traffic = job["traffic"]
    assert traffic["messages_per_second"] > 0
    assert traffic["bytes"] >= nbytes  # at least one all_reduce's worth, in all
    history = job["history"]
    assert history["interval"] == HISTORY_INTERVAL
    assert 1 <= len(history["points"]) <= HISTORY_POINTS
    ago, messages, sent = history["points"][-1]
    assert 0 <= ago < 10 * HISTORY_INTERVAL
    assert (messages, sent) == (
        pytest.approx(traffic["messages_per_second"], abs=0.1),
        pytest.approx(traffic["bytes_per_second"], abs=1),
    )
    (calls,) = set(results[0])  # every rank stopped after the same call
    assert calls >= 1


@asyncio_only
async def test_state_shows_no_rank_for_a_member_of_a_forming_job(
    server: aiodist.RendezvousServer, endpoint: MetricsEndpoint
) -> None:
    # A member that let the server choose its rank has none until the job forms.
    conn = await connect_control(*server.address, timeout=10)
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                channel = conn.open_channel(lambda notice: None)

                def join(r: int) -> Join:
                    return Join(r, "forming", 2, -1, "host-a", 4242, [], 60.0, 30.0)

                tg.start_soon(partial(channel.request, join, timeout=30))
                while True:
                    _, _, raw = await fetch(endpoint.address, "/api/state")
                    jobs = json.loads(raw)["jobs"]
                    if jobs:
                        break
                    await anyio.sleep(0.1)
                tg.cancel_scope.cancel()
        (job,) = jobs
        assert job["state"] == "forming"
        assert [(m["rank"], m["pid"], m["status"]) for m in job["members"]] == [
            (None, 4242, "joining")
        ]
    finally:
        conn.close()


@asyncio_only
async def test_state_needs_the_token_when_the_daemon_has_one() -> None:
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            server = await tg.start(partial(aiodist.serve_rendezvous, "127.0.0.1", 0, token=TOKEN))

            ep = start_metrics(server, asyncio.get_running_loop(), "127.0.0.1", 0)
            try:
                status, _, raw = await fetch(ep.address, "/api/state")
                assert status == 401
                assert json.loads(raw) == {
                    "error": "this server requires its token",
                    "token_required": True,
                }
                status, _, _ = await fetch(ep.address, "/api/state", Authorization="Bearer wrong")
                assert status == 401
                status, _, raw = await fetch(
                    ep.address, "/api/state", Authorization=f"Bearer {TOKEN}"
                )
                assert status == 200
                assert json.loads(raw)["token_required"] is True
                status, _, _ = await fetch(ep.address, "/")  # the page itself holds no data
                assert status == 200
            finally:
                await anyio.to_thread.run_sync(ep.close)
            tg.cancel_scope.cancel()


@asyncio_only
@pytest.mark.slow
@pytest.mark.parametrize("with_token", [False, True])
async def test_serve_warns_when_its_dashboard_is_open_beyond_this_host(
    tmp_path: Path, with_token: bool
) -> None:
    args = ["--port", "0", "--metrics-host", "0.0.0.0", "--metrics-port", "0"]
    if with_token:
        args += ["--token-file", str(token_file(tmp_path))]
    with anyio.fail_after(30):
        async with serve(*args, "--log-level", "warning") as daemon:
            assert await daemon.stop() == 0
    warned = any("shows every job's name" in line for line in daemon.lines["stderr"])
    assert warned is not with_token, daemon.output()


@asyncio_only
async def test_idle_connections_cannot_keep_a_request_out(endpoint: MetricsEndpoint) -> None:
    # Every request slot is held by a connection that says nothing: a real request
    # takes the slot of the one that waited longest, and is answered.
    idle = [socket.create_connection(endpoint.address) for _ in range(MAX_REQUESTS)]
    try:
        with anyio.fail_after(20):
            status, _, _ = await fetch(endpoint.address, "/api/state")
        assert status == 200
    finally:
        for s in idle:
            s.close()


@asyncio_only
async def test_slow_requests_are_cut_at_the_whole_request_deadline(
    server: aiodist.RendezvousServer,
) -> None:
    # Clients that send a byte now and then, each well within the per-read timeout,
    # on every slot: they are cut once their request as a whole is late, and real
    # requests keep being answered meanwhile.
    deadline = 1.0
    ep = start_metrics(server, asyncio.get_running_loop(), "127.0.0.1", 0, request_timeout=deadline)
    slow = [socket.create_connection(ep.address) for _ in range(MAX_REQUESTS)]
    cut: list[float] = []
    started = anyio.current_time()

    async def dribble(s: socket.socket) -> None:
        s.setblocking(False)
        for _ in range(40):  # 8 s of a byte every 0.2 s, unless cut first
            try:
                s.send(b"G")
            except OSError:
                break
            with anyio.move_on_after(0.2):
                await anyio.wait_readable(s)
                try:
                    if s.recv(1) == b"":
                        break  # cut
                except OSError:
                    break
        cut.append(anyio.current_time() - started)

    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for s in slow:
                    tg.start_soon(dribble, s)
                for _ in range(3):
                    status, _, _ = await fetch(ep.address, "/api/state")
                    assert status == 200
    finally:
        for s in slow:
            s.close()
        await anyio.to_thread.run_sync(ep.close)
    assert len(cut) == MAX_REQUESTS
    assert max(cut) < 6.0, cut  # cut by the deadline, not by the end of their dribble


# --- a real browser -----------------------------------------------------------------------


def _browser() -> tuple[str, str] | None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


def _skip_reason() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    if _browser() is None:
        return "no chromium and chromedriver here (make browser installs them)"
    return None


# Per line box of each event's time cell, read by the page's own layout.
_TIME_LINES = """
const range = document.createRange();
return [...document.querySelectorAll("#events tbody tr td:first-child")].map((td) => {
  range.selectNodeContents(td);
  return new Set([...range.getClientRects()].map((r) => Math.round(r.top))).size;
});
"""


@asyncio_only
@pytest.mark.slow
@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
async def test_page_marks_the_rank_others_wait_for_and_shows_a_killed_rank(
    tmp_path: Path,
) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    found = _browser()
    assert found is not None
    chromium, chromedriver = found
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # Narrow: long event details must wrap, the time beside them must not.
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=760,1000"):
        options.add_argument(arg)
    options.add_argument("--lang=en-US")  # times read "10:42:07 AM": a space to wrap at
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env["AIODIST_HEARTBEAT_INTERVAL"] = "0.1"
    with anyio.fail_after(120):
        async with serve("--port", "0", "--metrics-port", "0") as daemon:
            line = daemon.ready
            page = line.split("metrics on ", 1)[1].strip().removesuffix("/metrics") + "/"
            driver = await anyio.to_thread.run_sync(
                lambda: webdriver.Chrome(options=options, service=Service(chromedriver))
            )
            procs = []
            conn = await connect_control("127.0.0.1", daemon.port, timeout=10)
            try:
                await anyio.to_thread.run_sync(driver.get, page)

                async def call(fn: Callable[[], Any]) -> Any:
                    return await anyio.to_thread.run_sync(fn)

                async def text() -> str:
                    return str(await call(lambda: driver.find_element(By.TAG_NAME, "body").text))

                async def rows(selector: str) -> list[Any]:
                    return list(await call(lambda: driver.find_elements(By.CSS_SELECTOR, selector)))

                async def until(selector: str) -> list[Any]:
                    # The page polls; so does the test, reading what the page shows.
                    while not (found := await rows(selector)):  # noqa: ASYNC110
                        await anyio.sleep(0.2)
                    return found

                # A member that let the server choose its rank: none until the job forms.
                def join(r: int) -> Join:
                    return Join(r, "forming", 2, -1, "host-f", 4242, [], 60.0, 90.0)

                async with anyio.create_task_group() as tg:
                    channel = conn.open_channel(lambda notice: None)
                    tg.start_soon(partial(channel.request, join, timeout=90))
                    (forming,) = await until('.job[data-job="forming"] tr[data-rank]')
                    cells = await call(lambda: forming.find_elements(By.TAG_NAME, "td"))
                    assert [c.text for c in cells[:4]] == ["\u2013", "host-f", "4242", "joining"]
                    tg.cancel_scope.cancel()

                url = f"tcp://127.0.0.1:{daemon.port}"
                for r in range(2):
                    argv = [sys.executable, WORKER, url, str(r), "2", "<b>web</b>", "sleep"]
                    procs.append(await open_process(argv, env=env))
                while "job <b>web</b> running" not in await text():  # noqa: ASYNC110
                    await anyio.sleep(0.2)  # shown as text, not markup
                # Rank 0 waits in the all_reduce; rank 1, outside it, is the one marked.
                job = '.job[data-job="<b>web</b>"]'
                (stuck,) = await until(f"{job} tr.stuck")
                assert await call(lambda: stuck.get_attribute("data-rank")) == "1"
                assert "not in all_reduce #2, which others wait in for" in await call(
                    lambda: stuck.text
                )
                assert await rows(f'{job} tr.stuck[data-rank="0"]') == []
                # The job's throughput, plotted from the server's history.
                await until(f"{job} figure.throughput svg polyline")
                caption = await rows(f"{job} figure.throughput figcaption")
                assert "data sent between ranks, last 1m00s: peak" in caption[0].text

                # Event details in words, on a time that stays on one line.
                details = [r.text for r in await rows("#events tbody td:last-child")]
                assert details
                assert not [d for d in details if "{" in d or '"' in d], details
                assert any(d.startswith("all 2 ranks joined from 1 host in ") for d in details)
                lines = await call(lambda: driver.execute_script(_TIME_LINES))
                assert lines
                assert set(lines) == {1}, lines

                shot = Path(os.environ.get("AIODIST_SCREENSHOT", tmp_path / "dashboard.png"))
                await anyio.to_thread.run_sync(driver.save_screenshot, str(shot))
                assert (await anyio.Path(shot).stat()).st_size > 0
                procs[1].send_signal(signal.SIGKILL)
                with anyio.fail_after(10):  # the page says so within seconds
                    while "rank_failed" not in await text():  # noqa: ASYNC110
                        await anyio.sleep(0.2)
                events = [r.text for r in await rows("#events tbody tr")]
                failed = [r for r in events if "rank_failed" in r]
                assert failed, events
                assert f"rank 1 on {socket.gethostname()} (pid {procs[1].pid}) failed" in failed[0]
            finally:
                conn.close()
                await anyio.to_thread.run_sync(driver.quit)
                for p in procs:
                    if p.returncode is None:
                        p.kill()
                with anyio.CancelScope(shield=True):
                    for p in procs:
                        await p.wait()


@asyncio_only
async def test_state_and_status_come_a_page_at_a_time_however_many_jobs(
    server: aiodist.RendezvousServer, endpoint: MetricsEndpoint
) -> None:
    # 300 one-rank jobs: a poll of the page carries one page of them, in the order
    # they came, and `aiodist status` lists a bounded number too; a job past the
    # first page is there on the next page, and `status --job` finds it.
    jobs = 300

    def join(i: int) -> Callable[[int], Join]:
        return lambda r: Join(r, f"many-{i:03d}", 1, 0, "host-a", 1000 + i, [], 60.0, 30.0)

    conn = await connect_control(*server.address, timeout=10)
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(jobs):
                    channel = conn.open_channel(lambda notice: None)
                    tg.start_soon(partial(channel.request, join(i), timeout=30))
            status, _, raw = await fetch(endpoint.address, "/api/state")
            assert status == 200
            state = json.loads(raw)
            assert (state["jobs_total"], state["offset"], state["limit"]) == (jobs, 0, PAGE_JOBS)
            assert [j["name"] for j in state["jobs"]] == [f"many-{i:03d}" for i in range(PAGE_JOBS)]
            assert len(raw) < 64 * 1024
            _, _, raw = await fetch(endpoint.address, "/api/state?offset=290&limit=100")
            names = [j["name"] for j in json.loads(raw)["jobs"]]
            assert names == [f"many-{i:03d}" for i in range(290, 300)]
            status, _, _ = await fetch(endpoint.address, f"/api/state?limit={PAGE_MAX + 1}")
            assert status == 400
            port = str(server.address[1])
            listed = await run_cli("status", "--port", port)
            assert f"{jobs} jobs" in listed.stdout
            assert f"... and {jobs - STATUS_JOBS} more jobs" in listed.stdout
            assert "many-299" not in listed.stdout
            one = await run_cli("status", "--port", port, "--job", "many-299", "--json")
            assert json.loads(one.stdout)["job"]["name"] == "many-299"
    finally:
        conn.close()
