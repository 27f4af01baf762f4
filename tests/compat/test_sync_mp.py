"""``aiodist.sync`` in real processes: N ranks of plain code, each its own interpreter.

Each rank runs tests/helpers/sync_worker.py with torchrun-style variables; rank 0
embeds the rendezvous server at ``MASTER_ADDR:MASTER_PORT``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.helpers import HELPERS, ROOT
from tests.helpers.procs import free_port, last_reports
from tests.helpers.warm import Proc, popen

pytestmark = pytest.mark.slow

WORKER = HELPERS / "sync_worker.py"
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def _run_ranks(mode: str, world: int, *, torchrun_env: bool, timeout: float = 90) -> list[Any]:
    """Run ``world`` worker processes; return their JSON reports in rank order."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    base.update(
        PYTHONPATH=str(ROOT),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        AIODIST_HEARTBEAT_INTERVAL="0.2",
    )

    def start(rank: int) -> Proc:
        env = dict(base)
        if torchrun_env:
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
            )
        return popen(
            [sys.executable, str(WORKER), mode, str(rank), str(world)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )

    return last_reports(start, world, timeout)


def test_four_ranks_of_plain_code_run_collectives_handles_and_p2p() -> None:
    world = 4
    reports = _run_ranks("workload", world, torchrun_env=False)
    total = float(sum(range(world)))
    mean = sum(r + 1 for r in range(world)) / world
    for rank, out in enumerate(reports):
        assert out["rank"] == rank
        assert out["world_size"] == world
        assert out["backend"] == "gloo"
        assert out["is_main"] == (rank == 0)
        assert out["loop_threads"] == ["aiodist-loop"]
        assert out["results"][0] == [total] * 3
        assert out["results"][1] == [mean] * 2
        assert out["results"][2] == [{"rank": r} for r in range(world)]
        assert out["all_completed"]
        assert out["broadcast_object_list"] == ["cfg", {"lr": 0.1}]
        assert out["store"] == ["0", True]
        assert out["recv_from"] == (rank - 1) % world
        assert out["recv"] == [float((rank - 1) % world)] * 4
        assert out["sparse"] == [True, [1.0] * world + [float(world)]]
        if rank > 0:
            summed = [6.0, 6.0] if rank == 1 else None
            gathered = [1.0, 2.0, 3.0] if rank == 1 else None
            assert out["group_roots"] == [[3.0, 3.0], summed, gathered, 9.0 + rank], out
        assert out["method"] == [3 * total] * 2
        assert out["loop_threads_after"] == []  # destroy stopped the loop thread
        assert not out["initialized_after"]
    assert reports[0]["collect_results"] == [f"s{i}" for i in range(10)]
    assert all(out["collect_results"] is None for out in reports[1:])
    assert len({out["seed"] for out in reports}) == 1


def test_torch_and_aiodist_groups_each_go_where_the_other_is_expected() -> None:
    # Before, DDP refused aiodist.sync's group.WORLD (not a torch ProcessGroup), and
    # get_rank(torch's group) answered with a bound method.
    reports = _run_ranks("torch_groups", 3, torchrun_env=False)
    for rank, out in enumerate(reports):
        assert out["world_type"] == "AiodistProcessGroup"
        assert out["grad"] == [[2.0, 2.0, 2.0]]  # the mean of rank + 1 over 3 ranks
        assert out["queries"] == [rank, 3]
        # Before, mmengine's forms read torch's group as data and ran on the world.
        if rank < 2:
            assert out["pair"] == [[0, 1], 2.0, [0.0, 1.0], [0, 1]], out
        assert "group must be an aiodist process group" in out["not_a_group"], out
        assert "got [0, 1]" in out["not_a_group"]


def test_mmengine_docstring_examples_give_the_documented_results() -> None:
    reports = _run_ranks("mmengine", 2, torchrun_env=True)
    for rank, out in enumerate(reports):
        assert out["rank"] == rank
        assert out["local_rank"] == rank
        assert out["all_reduce"] == [4, 6]
        assert out["all_gather"] == [[1, 2], [3, 4]]
        assert out["gather"] == ([[1, 2], [3, 4]] if rank == 0 else [])
        assert out["broadcast"] == [1, 2]
        assert out["broadcast_object_list"] == "['foo', 12, {1: 2}]"
        assert out["all_reduce_dict"] == {"key1": [2, 4], "key2": [3, 5, 7]}
        assert out["all_reduce_dict_mean"] == [1.5]
        assert out["all_gather_object"] == "['foo', 12]"
        assert out["gather_object"] == ("['foo', 12]" if rank == 0 else "None")
        expected = "['foo', 24, {1: 2}, {'a': 'b'}]" if rank == 0 else "None"
        assert out["collect_results"] == expected
        assert out["all_reduce_params"] == [[1.5, 1.5], [1.5, 1.5, 1.5]]
        assert out["master_only"] == ([0] if rank == 0 else [])
    assert reports[0]["sync_random_seed"] == reports[1]["sync_random_seed"]


def test_ranks_that_never_destroy_the_group_exit_cleanly() -> None:
    reports = _run_ranks("no_destroy", 2, torchrun_env=False, timeout=60)
    for rank, out in enumerate(reports):
        assert out["rank"] == rank
        assert out["all_reduce"] == [2.0, 2.0]
        assert out["loop_threads"] == ["aiodist-loop"]
        # aiodist's exit handler destroyed the group and stopped the thread.
        assert out["at_exit"] == {"initialized": False, "loop_threads": []}


def test_ctrl_c_interrupts_a_blocked_call_at_once() -> None:
    port = free_port()
    code = (
        "import aiodist.sync as dist\n"
        f"dist.init_process_group(init_method='tcp://127.0.0.1:{port}', rank=0, world_size=2,"
        " timeout=100)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        # Rank 0 is blocked in init, waiting for rank 1, once its embedded server listens.
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline, "the embedded server never listened"
                time.sleep(0.05)  # polling another process's socket: no event to await
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=20)  # the join itself would wait 100 s
        assert "KeyboardInterrupt" in stderr
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
