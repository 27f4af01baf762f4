"""``aiodist.rpc`` in real processes: a master (rank 0) and workers, each its own interpreter.

Each test runs one scenario of tests/helpers/rpc_worker.py on every rank (rank 0
embeds the rendezvous server) and checks the JSON line each rank prints. The
workers are nothing but ``init_process_group`` and ``rpc.shutdown``: they
serve the master's calls meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.helpers import HELPERS, ROOT
from tests.helpers.procs import free_port
from tests.helpers.warm import Proc, popen
from tests.helpers.warm import run as warm_run

pytestmark = pytest.mark.slow

WORKER = HELPERS / "rpc_worker.py"
HEARTBEAT_TIMEOUT = 2.0  # rpc_worker.py's


def _run(
    scenario: str,
    world: int = 3,
    *,
    env: dict[int, dict[str, str]] | None = None,
    timeout: float = 90,
    victim: int | None = None,
    daemon: bool = False,
) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` on ``world`` ranks; each rank's report (and ``returncode``).

    The victim of a death scenario may never exit by itself (a stopped process):
    it is killed once the others are done. With ``daemon``, the server is an
    ``aiodist serve`` of its own instead of rank 0's. No process outlives this call.
    """
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    base["PYTHONPATH"] = str(ROOT)
    procs: dict[int, Proc] = {}
    deadline = time.monotonic() + timeout
    try:
        if daemon:
            procs[-1] = server = popen(
                [sys.executable, "-m", "aiodist", "serve", "--port", str(port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=base,
            )
            assert server.stdout is not None
            assert "listening on" in server.stdout.readline()  # before any rank would embed one
        for rank in range(world):
            procs[rank] = popen(
                [sys.executable, str(WORKER), scenario, str(rank), str(world), str(port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**base, **(env or {}).get(rank, {})},
            )
        reports: dict[int, dict[str, Any]] = {}
        for rank in sorted(range(world), key=lambda r: r == victim):  # the victim last
            proc = procs[rank]
            if rank == victim and proc.poll() is None:
                proc.kill()
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = stdout.strip().splitlines()
            report: dict[str, Any] = json.loads(lines[-1]) if lines else {}
            report["returncode"] = proc.returncode
            report["stderr"] = stderr[-3000:]
            reports[rank] = report
        return reports
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        assert all(p.returncode is not None for p in procs.values())


def _ok(reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    for rank, report in reports.items():
        assert report["returncode"] == 0, f"rank {rank}: {report}"
        assert report["shutdown"] == "ok", report
    return reports[0]


def test_calls_return_values_of_every_kind_with_a_job_token() -> None:
    # With a token, every data-plane channel proves it: rpc rides authenticated channels.
    token = {"AIODIST_TOKEN": "rpc-test-token"}
    out = _ok(_run("values", env=dict.fromkeys(range(3), token)))
    assert out["plain"] == 5
    assert out["async_kwargs"] == 7
    assert out["returns_coroutine"] == 5
    assert out["self"] == "ab"
    assert out["builtin"] == 6
    # A plain function runs in an rpc thread, a coroutine function on the worker's loop.
    assert out["whoami"]["rank"] == 1
    assert out["whoami"]["thread"].startswith("aiodist-rpc")
    assert out["whoami"]["loop"] is False
    assert out["async_whoami"]["thread"] == "MainThread"
    assert out["types"] is True  # tuples, bytes, int keys, big ints: as sent
    assert out["point"] is True
    assert out["tensor_args"] == out["tensor_expected"]
    assert out["strided"] == out["strided_expected"]
    assert out["tensor_result"] is True
    assert out["mixed"] is True
    assert out["numpy"] is True
    assert out["nested_plain"] == 105
    assert out["nested_async"] == 1005
    assert out["from_thread"] == 42
    assert out["from_thread_async"] == 2
    assert "event-loop thread" in out["sync_on_loop"]
    assert out["many"] is True


def test_calls_run_concurrently_on_the_worker() -> None:
    out = _ok(_run("concurrency"))
    # Six plain calls met at a barrier of six: six threads at once; six coroutines alike.
    assert len(out["threads"]) == 6
    assert all(name.startswith("aiodist-rpc") for name in out["threads"])
    assert out["coroutines"] == [6] * 6
    # While a plain call blocks in its thread, other calls to that rank complete.
    assert out["meanwhile_async"] == 3
    assert out["meanwhile_plain"] == 7
    assert out["blocked_still_running"] is True
    assert out["blocked"] == "released"


def test_remote_errors_are_raised_on_the_caller_with_rank_and_traceback() -> None:
    reports = _run("errors", env={1: {"AIODIST_RPC_THREADS": "1"}})
    out = _ok(reports)
    kind, rank, message, exc_type = out["value"]
    assert (kind, rank, exc_type) == ("ValueError", 1, "ValueError")
    assert message.startswith("bad value 42")
    assert "on rank 1" in message
    assert "Remote traceback" in message
    assert 'raise ValueError("bad value 42")' in message  # the remote frame's source line
    assert "_rpc/serve.py" not in message  # serving machinery is left out
    assert "_rpc/threads.py" not in message
    assert out["custom"][:2] == ["CustomError", 1]
    assert out["custom_code"] == 7  # attributes survive
    # A type the caller cannot rebuild: RemoteError, naming the rank and the type.
    kind, rank, message, exc_type = out["local"]
    assert (kind, rank) == ("RemoteError", 1)
    assert exc_type.endswith("LocalError")
    assert "from a local class" in message
    # SystemExit on the worker must not stop the caller; the worker lives on.
    assert out["exit"][:2] == ["RemoteError", 1]
    assert out["key"][:2] == ["KeyError", 1]
    assert out["async"][:2] == ["ZeroDivisionError", 2]
    assert out["unpicklable_result"][:2] == ["TypeError", 2]
    assert "cannot be sent back" in out["unpicklable_result"][2]
    refused = out["refused"]
    assert refused["outside"][0] == "ValueError"
    assert "to=3 is not a rank of the job" in refused["outside"][1]
    assert refused["negative"][0] == "ValueError"
    assert refused["lambda"][0] == "TypeError"
    assert "lambda" in refused["lambda"][1]
    assert refused["argument"][0] == "TypeError"
    assert refused["not_callable"][0] == "TypeError"
    assert refused["huge_callable"][0] == "TypeError"
    assert "pass large data as arguments" in refused["huge_callable"][1]
    assert all(r[2] < 1.0 for r in refused.values())  # at once, not after a round trip
    assert out["usable_after"] == 3
    # A timeout: DistTimeoutError naming the rank, within the timeout, cancelled there.
    kind, rank, message, _ = out["timeout"]
    assert kind == "DistTimeoutError"
    assert "cancelled on rank 2" in message
    assert 0.45 <= out["timeout_s"] < 3.0  # (uvloop may fire a timer a hair early)
    assert out["cancelled_there"] is True
    assert out["queued_timeout"][0] == "DistTimeoutError"
    assert out["blocked"] == "released"
    assert out["started"] == []  # the timed-out plain call never started
    assert out["usable_after_timeout"] == 4


def test_rrefs_keep_objects_while_referenced_and_release_them() -> None:
    reports = _run("rrefs")
    out = _ok(reports)
    assert out["owner"] == [1, "rank1", True]
    assert out["is_owner"] is False
    assert out["add"] == [2, 5]
    assert out["get_name"] == "a"
    assert out["to_here"] == ["Tracked", "a", 5]
    assert out["remote_method"] == [1, "aa"]
    assert out["alive_while_held"] is True
    assert out["released"] is True
    assert out["kept_repr"].startswith("RRef(owner=1")
    assert out["alive_while_forwarded"] is True
    assert out["forwarded_use"] == 10
    assert out["released_forwarded"] is True
    assert out["method_after_drop"] == 4
    assert out["released_slow"] is True
    assert out["owned_left"] == 0
    assert out["local_value"] == "mine"
    assert out["local_value_direct"] == "mine"
    assert out["bad_to_here"][:2] == ["ValueError", 2]
    assert out["bad_method"][:2] == ["ValueError", 2]
    # Objects still referenced when rpc shuts down are dropped then.
    assert {"a", "b", "end", "end2"} <= set(reports[1]["deleted"])
    assert "mine" in reports[0]["deleted"]


@pytest.mark.parametrize("how", ["exit", "stop"])
def test_worker_death_fails_only_the_calls_to_it(how: str) -> None:
    # "exit": the process dies (its connections drop); "stop": it freezes (SIGSTOP),
    # so only its missed heartbeats tell. Either way within the heartbeat timeout.
    reports = _run("death", env={r: {"RPC_DEATH": how} for r in range(3)}, victim=2)
    out = reports[0]
    assert out["returncode"] == 0, out
    assert reports[2]["returncode"] == (17 if how == "exit" else -9)
    assert len(out["pending"]) == 5
    for kind, rank, message, _ in out["pending"]:
        assert kind == "RankFailedError", out
        assert rank == 2
        assert "rank 2" in message
    assert out["elapsed_s"] < HEARTBEAT_TIMEOUT + 3.0
    # Failure isolation: calls to the worker still alive go on, during and after.
    assert out["other"] == ["ok", "released"]
    assert out["after"] == ["ok", 2]
    assert out["to_dead"][:2] == ["RankFailedError", 2]
    # rpc.shutdown completes among the ranks still alive.
    assert out["shutdown"] == "ok"
    assert reports[1]["returncode"] == 0
    assert reports[1]["shutdown"] == "ok"


@pytest.mark.parametrize("how", ["exit", "stop"])
def test_shutdown_completes_among_the_ranks_alive_when_its_coordinator_dies(how: str) -> None:
    # Rank 0 coordinates rpc.shutdown; it dies (or freezes past the heartbeat timeout)
    # while the workers wait in it. The server, a daemon, lives on and names it failed.
    env = {"RPC_DEATH": how, "RPC_SHUTDOWN_TIMEOUT": "30"}
    reports = _run("coordinator-death", env=dict.fromkeys(range(3), env), victim=0, daemon=True)
    assert reports[0]["returncode"] == (17 if how == "exit" else -9)
    for rank in (1, 2):
        out = reports[rank]
        assert out["returncode"] == 0, out
        assert out["shutdown"] == "ok", out
        # Not the 30 s timeout: once the server declared rank 0 failed (the heartbeat
        # timeout for a frozen one), with room for a loaded machine.
        assert out["shutdown_s"] < HEARTBEAT_TIMEOUT + 10, out


def test_shutdown_completes_when_a_peer_leaves_without_it_after_rank_0_entered_it() -> None:
    # Rank 2 leaves the job (destroy_process_group, no rpc.shutdown) once rank 0, which
    # coordinates the shutdown, is in it; ranks 0 and 1 stop among themselves at once.
    env = {rank: {"RPC_SHUTDOWN_TIMEOUT": "30"} for rank in range(3)}
    reports = _run("leave-in-shutdown", env=env)
    assert reports[2]["left"] is True
    assert reports[2]["returncode"] == 0
    for rank in (0, 1):
        out = reports[rank]
        assert out["returncode"] == 0, out
        assert out["shutdown"] == "ok", out
        assert out["shutdown_s"] < 10, out  # not the 30 s timeout


EXIT_WORKER = HELPERS / "rpc_exit_worker.py"
EMBEDDED_SERVER_LINGER = 60.0  # what a failing rank 0 held its peers for when taken for a leave


@pytest.mark.parametrize("launcher", ["spawn", "process"])
def test_a_rank_failing_under_multiprocessing_is_told_to_its_peers_within_seconds(
    launcher: str,
) -> None:
    # Rank 0 hosts the rendezvous server and raises; mp.spawn turns that into
    # sys.exit(1), a multiprocessing.Process into exit code 1. Either is a failure,
    # told to rank 1 (in rpc.shutdown) at once, and rank 0 does not keep its server
    # up for the others: mp.spawn reports it within seconds, not after the linger.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env["PYTHONPATH"] = str(ROOT)
    done = warm_run(
        [sys.executable, str(EXIT_WORKER), launcher, str(free_port())],
        env=env,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # The peers hear that rank 0 failed: its error reaches the caller (spawn), and rank 1's
    # shutdown completes among the ranks alive (a handled break is logged at INFO only).
    if launcher == "spawn":
        assert "ValueError: rank 0 broke" in out["raised"]
        assert out["reported_after_s"] < EMBEDDED_SERVER_LINGER / 3, out
    else:
        assert out["exitcodes"] == [1, 0], out
        assert out["rank1"]["shutdown"] == "ok", out  # among the ranks alive
        assert out["elapsed_s"] < EMBEDDED_SERVER_LINGER / 3, out


def test_shutdown_waits_for_calls_in_flight_and_serves_meanwhile() -> None:
    reports = _run("shutdown")
    out = _ok(reports)
    assert out["all_done"] is True
    assert out["results"] == [
        "released",
        "released",
        "released",
        *[i + 1000 for i in range(5)],
        *[i + 100 for i in range(5)],
        2,
    ]
    assert out["after"][0] == "ClosedError"
    assert "rpc.shutdown() completed" in out["after"][2]
    assert out["rref_after"][0] == "ClosedError"
    assert out["second_shutdown"] is True
    assert "to-the-end" in reports[2]["deleted"]


def test_plain_code_uses_blocking_calls_and_a_blocking_shutdown() -> None:
    reports = _run("plain")
    for rank, report in reports.items():
        assert report["returncode"] == 0, f"rank {rank}: {report}"
        assert report["shutdown_done"] is True
    out = reports[0]
    assert out["rpc_sync"] == 3
    assert out["async_wait"] == 7
    assert out["method_sync"] == 5
    assert out["to_here"] == 5
    assert out["tensor"] == [float(1 << 18), [1 << 18], "torch.float32", True]
    assert out["error"] == ["CustomError", 7]
    assert "plain" in reports[2]["deleted"]


# --- worker names: init_rpc and get_worker_info, as torch names them ------------------------


def test_init_rpc_names_workers_and_calls_reach_them_by_name() -> None:
    reports = _run("named")
    for rank in range(3):
        assert reports[rank]["returncode"] == 0, reports[rank]
        assert reports[rank]["me"] == [f"trainer{rank}", rank]
    master = reports[0]
    assert master["by_name"] == {"rank": 1, "pg": False}  # an rpc world of its own
    assert master["by_info"] == 2
    assert master["info"] == ["trainer2", 2]
    assert "no rpc worker is named 'nobody'" in master["unknown"]
    assert "trainer0, trainer1, trainer2" in master["unknown"]


def test_init_rpc_awaited_on_the_loop_names_workers() -> None:
    reports = _run("named-async")
    for rank in range(3):
        assert reports[rank]["returncode"] == 0, reports[rank]
    assert [reports[r]["me"] for r in range(3)] == [[f"trainer{r}", r] for r in range(3)]
    assert reports[0]["by_name"] == 2


def test_init_rpc_with_a_name_given_twice_fails_on_every_rank() -> None:
    reports = _run("named-twice")
    for rank in range(3):
        assert reports[rank]["returncode"] == 0, reports[rank]
        message = reports[rank]["init_error"]
        assert "rpc worker names must be unique" in message
        assert "'same' by ranks [1, 2]" in message


# --- torch's forms and worlds: programs written for torch.distributed.rpc -----------------


def test_plain_code_gets_torch_futures_rrefs_and_async_execution() -> None:
    reports = _run("torch-forms")
    for rank in range(3):
        assert reports[rank]["returncode"] == 0, reports[rank]
        assert reports[rank]["pg"] is False  # init_rpc formed an rpc world of its own
        assert "rpc was shut down on this rank" in reports[rank]["after_shutdown"]
    out = reports[0]
    assert out["future"] == [True, [4.0, 4.0]]  # a torch Future: then() and wait()
    assert out["wait_all"] == [11, 12]
    assert out["collect_all"] == [2]
    assert out["done_value"] == [True, [2.0, 2.0]]
    # local_value() on the owner waits for an object still being made by rpc.remote().
    assert out["local_value_waits"] == 5
    assert out["owner"] == ["w1", 1, "w1"]
    assert out["to_here"] == 5
    assert out["mine"] == [True, "w0", True]
    assert out["mine_local"] is True
    assert out["mine_remote"] == ["Point", 1, 2, "w0", False]
    assert out["chained"] == [3.0, 3.0]  # async_execution chaining a call to w2
    assert out["batched"] == [[3, 7], [3, 7]]  # one future answered both calls
    assert out["batched_method"] == 40
    assert out["fails_later"][0] == "CustomError"
    assert "set on the future" in out["fails_later"][1]
    assert out["no_future"][0] == "TypeError"
    assert "must return a torch.futures.Future" in out["no_future"][1]
    assert "rpc_backend_options.device_maps is not supported" in out["refused"]


def test_init_rpc_forms_a_world_of_another_size_beside_the_process_group() -> None:
    rpc_port = str(free_port())
    reports = _run("two-worlds", env={rank: {"RPC_PORT": rpc_port} for rank in range(3)})
    for rank in range(3):
        assert reports[rank]["returncode"] == 0, reports[rank]
    assert reports[0]["w2"] == {"rank": 2, "pg": False}
    assert reports[0]["names"] == [0, 1, 2]
    for rank in (0, 1):
        assert reports[rank]["pg"] == [2, [2.0]]  # the process group of two, untouched
