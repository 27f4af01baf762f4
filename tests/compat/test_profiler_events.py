"""torch's profiler shows plain code's communication as it shows gloo's.

A training step profiled with ``torch.profiler`` (or the autograd profiler)
lists each collective and point-to-point call as an asynchronous event named
``{backend}:{call}`` with its inputs' shapes. ``aiodist.sync`` starts its
operations on its loop thread; the events are still recorded on the thread
that called, as torch's are. The same script runs on both, and the events
must be the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers import HELPERS, ROOT
from tests.helpers.procs import free_port, last_reports
from tests.helpers.warm import Proc, popen

pytestmark = pytest.mark.slow

WORKER = HELPERS / "profile_worker.py"


def _events(system: str) -> list[list[list[Any]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    env.update(
        PYTHONPATH=str(ROOT),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
        TORCH_CPP_LOG_LEVEL="ERROR",
    )

    def start(rank: int) -> Proc:
        return popen(
            [sys.executable, str(WORKER), system],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )

    return last_reports(start, 2, timeout=120)


def test_profiled_calls_record_the_events_gloo_records() -> None:
    torchs = _events("torch")
    ours = _events("aiodist")
    for rank in range(2):
        assert ours[rank] == torchs[rank], rank
    names = [name for name, *_ in ours[1]]
    assert names.count("gloo:all_reduce") == 4  # three calls, and all_reduce_coalesced
    assert "gloo:recvAnySource" in names
    assert all(is_async and count == 1 for _, is_async, count, _ in ours[0])
