"""The ways real users start a job: torchrun, `aiodist run` on a shared daemon, many hosts.

Every test runs real launchers and ranks (``tests/helpers/launch_worker.py``) as
processes, under a time limit, and leaves none behind (``_procs.run`` kills
what outlives it). The two-host tests make two Linux network namespaces
joined by a veth pair (10.213.0.1 and 10.213.0.2, addresses that exist only
inside the namespaces this test creates), each process in its own UTS
namespace with its own host name, as on two machines; they skip where
namespaces cannot be made (not root, no ``ip`` or ``unshare``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from tests.helpers import HELPERS, ROOT
from tests.helpers import procs as _procs
from tests.helpers.daemon import TOKEN, asyncio_only, run_cli, serve, token_file

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

    from anyio.abc import SocketStream

    from tests.helpers.daemon import Daemon

pytestmark = [pytest.mark.slow, asyncio_only]

WORKER = str(HELPERS / "launch_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
AIODIST = [sys.executable, "-m", "aiodist"]
LIMIT = 60.0  # for one launch: the backstop, never the expected time


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIODIST_", "TORCHELASTIC_"))
        and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
    }
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


async def _run(argv: list[str], env: dict[str, str] | None = None) -> _procs.Finished:
    """Run ``argv`` to its end in a clean environment (``_procs.run`` merges os.environ)."""
    wrapped = ["env", "-i", *(f"{k}={v}" for k, v in _env(**(env or {})).items()), *argv]
    return await _procs.run(wrapped, LIMIT)


def _reports(stdout: str) -> dict[int, dict[str, Any]]:
    """The workers' reports by rank, with or without ``[rank N] `` prefixes."""
    out = {}
    for line in stdout.splitlines():
        _, _, payload = line.rpartition("] ") if line.startswith("[rank") else ("", "", line)
        with contextlib.suppress(json.JSONDecodeError):
            report = json.loads(payload)
            if isinstance(report, dict) and "rank" in report:
                out[report["rank"]] = report
    return out


def _assert_gathered(reports: dict[int, dict[str, Any]], modes: list[str], world: int) -> None:
    assert sorted(reports) == list(range(world)), reports
    expected = [[r, modes[r % len(modes)]] for r in range(world)]
    for rank, report in reports.items():
        assert report["world_size"] == world
        assert [entry[:2] for entry in report["gathered"]] == expected, (rank, report)
    assert len({r["pid"] for r in reports.values()}) == world


# --- torchrun -----------------------------------------------------------------------------

TORCHRUN_STYLES = {
    # The three ways torchrun is started on one host; every rank runs the script unchanged.
    "standalone": lambda port: ["--standalone"],
    "static": lambda port: ["--master-addr", "127.0.0.1", "--master-port", str(port)],
    "c10d": lambda port: [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "c10d-job",
    ],
}


@pytest.mark.parametrize(
    ("style", "modes"),
    [
        # Each way of joining is rank 0 (which embeds the server) in one of the styles.
        ("standalone", ["async", "sync", "init_dist"]),
        ("static", ["sync", "init_dist", "async"]),
        ("c10d", ["init_dist", "async", "sync"]),
        # Without the agent's store, worker rank 0 hosts torchrun's store, as torch does.
        ("c10d-own-store", ["async", "sync"]),
    ],
)
async def test_torchrun_runs_an_unchanged_script_in_each_rendezvous_style(
    style: str, modes: list[str]
) -> None:
    args = TORCHRUN_STYLES[style.removesuffix("-own-store")](_procs.free_port())
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if style.endswith("-own-store") else {}
    argv = [*TORCHRUN, *args, "--nproc-per-node", str(len(modes)), WORKER, ",".join(modes)]
    result = await _run(argv, env)
    assert result.returncode == 0, result.stderr
    reports = _reports(result.stdout)
    _assert_gathered(reports, modes, len(modes))
    assert {r["generation"] for r in reports.values()} == {0}


async def test_torchrun_rank_that_dies_fails_the_others_at_once_and_torchrun_reports_it() -> None:
    # torchrun stops the other workers once it sees one fail; --monitor-interval gives
    # rank 0 the time to report what it saw first (it sees it within milliseconds).
    argv = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--monitor-interval", "3"]
    result = await _run([*argv, WORKER, "async,sync", "fail"])
    assert result.returncode == 1  # torchrun's code for a failed worker
    assert "exitcode  : 3" in result.stderr  # torchrun's own summary names rank 1's code
    report = _reports(result.stdout)[0]
    assert (report["error"], report["failed_rank"]) == ("RankFailedError", 1)
    assert report["seconds"] < 3.0, report
    print(f"rank 0 learnt that rank 1 died after {report['seconds']:.3f} s")


async def test_torchrun_restart_starts_a_new_generation_of_the_job() -> None:
    argv = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    result = await _run([*argv, WORKER, "sync,async", "fail-once"])
    assert result.returncode == 0, result.stderr
    reports = _reports(result.stdout)
    _assert_gathered(reports, ["sync", "async"], 2)
    assert {r["generation"] for r in reports.values()} == {1}  # the second start


# --- aiodist run on a shared daemon -------------------------------------------------------


def _events(daemon: Daemon) -> list[dict[str, Any]]:
    """The job events the daemon logged so far (JSON lines on its stderr)."""
    return [
        json.loads(line)
        for line in daemon.lines["stderr"]
        if line.startswith("{") and '"event"' in line
    ]


async def _wait_events(
    daemon: Daemon, done: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    with anyio.fail_after(10):
        await daemon.wait_for_line("stderr", lambda _: done(_events(daemon)))
    return _events(daemon)


async def test_two_launches_on_one_daemon_get_jobs_of_their_own_and_status_lists_both(
    tmp_path: Path,
) -> None:
    gate_path = str(tmp_path / "gate")
    async with serve("--port", "0") as daemon:
        endpoint = f"{daemon.host}:{daemon.port}"
        argv = [*AIODIST, "run", "-n", "2", "--rdzv-endpoint", endpoint, WORKER, "async,sync"]
        results: list[_procs.Finished] = []
        gates: list[SocketStream] = []
        async with await anyio.create_unix_listener(gate_path) as listener:
            with anyio.fail_after(LIMIT):
                async with anyio.create_task_group() as tg:

                    async def launch() -> None:
                        results.append(await _run([*argv, "gate"], {"TEST_GATE": gate_path}))

                    tg.start_soon(launch)
                    tg.start_soon(launch)
                    # Rank 0 of each job connects once its job formed.
                    gates = [await listener.accept(), await listener.accept()]
                    status = await run_cli("status", "--port", str(daemon.port), "--json")
                    for gate in gates:
                        await gate.send(b"go")
            for gate in gates:
                await gate.aclose()
        assert status.returncode == 0, status.stderr
        jobs = json.loads(status.stdout)["jobs"]
        assert len(jobs) == 2
        assert len({job["name"] for job in jobs}) == 2  # no --rdzv-id: a fresh one each
        for job in jobs:
            assert (job["state"], job["generation"], job["joined"]) == ("running", 0, 2)
            assert sorted(m["rank"] for m in job["members"]) == [0, 1]
        for result in results:
            assert result.returncode == 0, result.stderr
            _assert_gathered(_reports(result.stdout), ["async", "sync"], 2)
        events = await _wait_events(
            daemon, lambda evs: sum(e["event"] == "job_finished" for e in evs) == 2
        )
        for name in (job["name"] for job in jobs):
            mine = [e for e in events if e["job"] == name]
            assert [e["event"] for e in mine] == [
                "job_created",
                "rank_joined",
                "rank_joined",
                "job_formed",
                "job_finished",
            ]
            assert mine[-1]["state"] == "succeeded"
            assert mine[-1]["seconds"] > 0


async def test_max_restarts_starts_every_rank_again_as_a_new_generation() -> None:
    async with serve("--port", "0") as daemon:
        endpoint = f"{daemon.host}:{daemon.port}"
        argv = [*AIODIST, "run", "-n", "2", "--max-restarts", "1", "--rdzv-endpoint", endpoint]
        result = await _run([*argv, "--rdzv-id", "flaky", WORKER, "async,sync", "fail-once"])
        assert result.returncode == 0, result.stderr
        # The launcher's own line, even if a rank's last line had no newline (before:
        # "the other 1 ranks").
        restart = (
            "exited with code 3; stopped the other 1 rank; restarting all 2 ranks (restart 1 of 1)"
        )
        assert any(
            line.startswith("aiodist run: rank 1 (pid ") and line.endswith(restart)
            for line in result.stderr.splitlines()
        ), result.stderr
        reports = _reports(result.stdout)
        _assert_gathered(reports, ["async", "sync"], 2)
        assert {r["generation"] for r in reports.values()} == {1}
        logged = await _wait_events(
            daemon, lambda evs: any(e.get("state") == "succeeded" for e in evs)
        )
        # Rank 0 of the first start may fail too: the launcher stops it once rank 1 died.
        events = [
            (e["event"], e["generation"], e.get("rank"), e.get("state") or e.get("previous_state"))
            for e in logged
            if e["event"] in ("job_created", "generation_restarted", "job_finished")
            or (e["event"] == "rank_failed" and e["rank"] == 1)
        ]
        assert events == [
            ("job_created", 0, None, None),
            ("rank_failed", 0, 1, None),
            ("job_finished", 0, None, "failed"),
            ("job_created", 1, None, None),
            ("generation_restarted", 1, None, "failed"),
            ("job_finished", 1, None, "succeeded"),
        ]


async def test_rdzv_endpoint_where_nothing_listens_on_this_host_is_hosted_by_the_launcher() -> None:
    endpoint = f"127.0.0.1:{_procs.free_port()}"
    argv = [*AIODIST, "run", "-n", "2", "--rdzv-endpoint", endpoint, WORKER, "sync,async"]
    result = await _run(argv)
    assert result.returncode == 0, result.stderr
    _assert_gathered(_reports(result.stdout), ["sync", "async"], 2)


async def test_rdzv_endpoint_with_a_token_file_and_without(tmp_path: Path) -> None:
    path = str(token_file(tmp_path))
    async with serve("--port", "0", "--token-file", path) as daemon:
        endpoint = f"{daemon.host}:{daemon.port}"
        argv = [*AIODIST, "run", "-n", "2", "--rdzv-endpoint", endpoint]
        with_token = await _run([*argv, "--token-file", path, WORKER, "async"])
        started = time.monotonic()
        without = await _run([*argv, WORKER, "async"])
        refused_after = time.monotonic() - started
    assert with_token.returncode == 0, with_token.stderr
    _assert_gathered(_reports(with_token.stdout), ["async"], 2)
    # Refused before any rank starts: the launcher proves the token first.
    assert without.returncode == 1
    assert without.stderr.strip().splitlines()[-1].startswith("aiodist run: the rendezvous "), (
        without.stderr
    )
    assert "requires a token" in without.stderr
    assert _reports(without.stdout) == {}
    assert refused_after < 10
    assert TOKEN not in with_token.stdout + with_token.stderr + without.stderr


async def test_rdzv_endpoint_that_is_not_an_aiodist_server_is_an_error_at_once() -> None:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:

        async def hang_up(stream: SocketStream) -> None:  # another protocol's server
            await stream.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, hang_up)
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
            argv = [*AIODIST, "run", "-n", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
            started = time.monotonic()
            result = await _run([*argv, WORKER, "async"])
            tg.cancel_scope.cancel()
    assert time.monotonic() - started < 10
    assert result.returncode == 1
    assert (
        f"aiodist run: something listens at --rdzv-endpoint 127.0.0.1:{port} but hung up"
        in result.stderr
    )
    assert _reports(result.stdout) == {}


# --- output -------------------------------------------------------------------------------

PROGRESS_SCRIPT = """
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print("{\\"pid\\": %d}" % os.getpid(), flush=True)
sys.stdout.write("\\r 50%|#####     |")
sys.stdout.flush()
signal.sigwait({signal.SIGUSR1})  # the test saw the partial line: finish it
sys.stdout.write("\\r100%|##########|\\n")
"""


async def test_run_shows_a_partial_line_at_once_with_its_rank_prefix(tmp_path: Path) -> None:
    script = tmp_path / "progress.py"
    script.write_text(PROGRESS_SCRIPT)
    proc = await anyio.open_process([*AIODIST, "run", "-n", "1", str(script)], env=_env())
    seen = b""
    try:
        assert proc.stdout is not None
        stdout = BufferedByteReceiveStream(proc.stdout)
        with anyio.fail_after(LIMIT):
            pid = json.loads((await stdout.receive_until(b"\n", 1 << 16)).split(b"] ", 1)[1])
            while b"50%|#####     |" not in seen:  # before the line ends
                seen += await stdout.receive()
            os.kill(pid["pid"], signal.SIGUSR1)
            async for chunk in stdout:
                seen += chunk
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
        with anyio.CancelScope(shield=True):
            await proc.aclose()
    assert seen == b"\r[rank 0]  50%|#####     |\r[rank 0] 100%|##########|\n"


# --- two hosts ----------------------------------------------------------------------------

HOST_A, HOST_B = "10.213.0.1", "10.213.0.2"


class TwoHosts:
    """Two network namespaces joined by a veth pair: the hosts ``a`` and ``b``."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = {"a": f"aiodist-{tag}-a", "b": f"aiodist-{tag}-b"}
        self.ifname = {"a": f"ad{tag}a", "b": f"ad{tag}b"}  # at most 15 characters
        self.address = {"a": HOST_A, "b": HOST_B}

    def create(self) -> None:
        a, b = self.ns["a"], self.ns["b"]
        for cmd in (
            ["ip", "netns", "add", a],
            ["ip", "netns", "add", b],
            [
                "ip",
                "link",
                "add",
                self.ifname["a"],
                "netns",
                a,
                "type",
                "veth",
                "peer",
                "name",
                self.ifname["b"],
                "netns",
                b,
            ],
            ["ip", "-n", a, "addr", "add", f"{HOST_A}/24", "dev", self.ifname["a"]],
            ["ip", "-n", b, "addr", "add", f"{HOST_B}/24", "dev", self.ifname["b"]],
            ["ip", "-n", a, "link", "set", self.ifname["a"], "up"],
            ["ip", "-n", b, "link", "set", self.ifname["b"], "up"],
            ["ip", "-n", a, "link", "set", "lo", "up"],
            ["ip", "-n", b, "link", "set", "lo", "up"],
        ):
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10)

    def delete(self) -> None:
        for ns in self.ns.values():  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)

    def on(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: in its network namespace, with its own host name."""
        return [
            "ip", "netns", "exec", self.ns[host],
            "unshare", "--uts", "sh", "-c", f'hostname host{host} && exec "$@"', "sh", *argv,
        ]  # fmt: skip


@pytest.fixture
def hosts() -> Iterator[TwoHosts]:
    if os.geteuid() != 0:
        pytest.skip("two hosts need network namespaces, which need root")
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"two hosts need network namespaces: {' and '.join(missing)} not found")
    pair = TwoHosts()
    try:
        try:
            pair.create()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot make network namespaces: {(exc.stderr or '').strip()}")
        yield pair
    finally:
        pair.delete()


async def _on_both(hosts: TwoHosts, argv: dict[str, list[str]], env: dict[str, dict[str, str]]):
    results: dict[str, _procs.Finished] = {}

    async def one(host: str) -> None:
        results[host] = await _run(hosts.on(host, argv[host]), env.get(host))

    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            for host in ("a", "b"):
                tg.start_soon(one, host)
    for host, result in results.items():
        assert result.returncode == 0, f"host {host}:\n{result.stderr}"
    return results


def _assert_two_hosts(reports: dict[int, dict[str, Any]], hosts_by_rank: list[str]) -> None:
    for report in reports.values():
        assert [entry[2] for entry in report["gathered"]] == hosts_by_rank, report


async def test_aiodist_run_two_nodes_on_two_hosts(hosts: TwoHosts) -> None:
    port = "29400"  # the namespaces are ours: every port in them is free
    common = [*AIODIST, "run", "-n", "2", "--nnodes", "2", "--master-port", port]
    argv = {
        # Node 0 finds its address from the interface, as GLOO_SOCKET_IFNAME would.
        "a": [*common, "--node-rank", "0", WORKER, "async,sync"],
        "b": [*common, "--node-rank", "1", "--master-addr", HOST_A, WORKER, "async,sync"],
    }
    env = {"a": {"AIODIST_SOCKET_IFNAME": hosts.ifname["a"]}}
    results = await _on_both(hosts, argv, env)
    reports = {**_reports(results["a"].stdout), **_reports(results["b"].stdout)}
    _assert_gathered(reports, ["async", "sync"], 4)
    _assert_two_hosts(reports, ["hosta", "hosta", "hostb", "hostb"])
    assert f"hosting the job's server on {HOST_A} without a token" in results["a"].stderr


async def test_torchrun_two_nodes_on_two_hosts(hosts: TwoHosts) -> None:
    common = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1"]
    common += ["--master-addr", HOST_A, "--master-port", "29400"]
    argv = {
        "a": [*common, "--node-rank", "0", WORKER, "sync,async"],
        "b": [*common, "--node-rank", "1", WORKER, "sync,async"],
    }
    results = await _on_both(hosts, argv, {})
    reports = {**_reports(results["a"].stdout), **_reports(results["b"].stdout)}
    _assert_gathered(reports, ["sync", "async"], 2)
    _assert_two_hosts(reports, ["hosta", "hostb"])
    # Rank 0 embedded the server on its address toward torchrun's store, not on loopback.
    assert f"embedded in this process listens on {HOST_A}:" in results["a"].stderr


@pytest.mark.parametrize("scheme", ["tcp", "file"])
async def test_init_method_across_two_hosts(hosts: TwoHosts, scheme: str, tmp_path: Path) -> None:
    # file://: the file is shared (one filesystem), and whichever process comes first
    # writes an address of its interface that the other host reaches.
    init = f"tcp://{HOST_A}:29400" if scheme == "tcp" else f"file://{tmp_path / 'rendezvous'}"
    argv = {host: [sys.executable, WORKER, "url"] for host in ("a", "b")}
    env = {
        host: {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "TEST_INIT_METHOD": init,
            "AIODIST_SOCKET_IFNAME": hosts.ifname[host],
        }
        for rank, host in enumerate(("a", "b"))
    }
    results = await _on_both(hosts, argv, env)
    reports = {**_reports(results["a"].stdout), **_reports(results["b"].stdout)}
    _assert_gathered(reports, ["url"], 2)
    _assert_two_hosts(reports, ["hosta", "hostb"])
    if scheme == "file":
        address = (tmp_path / "rendezvous").read_text().strip()
        assert address.rpartition(":")[0] in (HOST_A, HOST_B)
