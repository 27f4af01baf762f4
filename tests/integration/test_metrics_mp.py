"""aiodist.metrics from plain code in real processes, launched with ``aiodist run``."""

from __future__ import annotations

import json
import sys
import textwrap
from typing import TYPE_CHECKING

import pytest

from tests.helpers import ROOT
from tests.helpers.warm import run as warm_run

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow


WORKER = textwrap.dedent(
    """
    import json
    import threading
    import time

    import torch

    import aiodist.sync as dist
    from aiodist.metrics import MetricAggregator

    dist.init_process_group(timeout=60)
    rank, world = dist.get_rank(), dist.get_world_size()
    called = []
    done = threading.Event()
    agg = MetricAggregator({"n": "sum", "peak": "max"})
    works = []
    for step in range(6):
        agg.update(rank + 1, loss=torch.tensor(float(step + rank)), n=1, peak=rank * step)
        if rank == 1 and step == 3:
            agg.update(only_one=7.0)
        works.append(agg.sync(on_done=lambda r: called.append(threading.current_thread().name)))
        torch.randn(64, 64) @ torch.randn(64, 64)  # compute while the syncs run
    agg.update(loss=float("inf"))
    last = agg.sync(on_done=lambda r: done.set())
    results = [w.wait(timeout=60).to_dict() for w in works]
    final = last.wait(timeout=60)
    assert done.wait(timeout=60)
    on_board = agg._board is not None

    # Callbacks run in call order, and all of them before a later sync's wait() returns,
    # whether the syncs went through the loop (the first ones) or straight to the board.
    orders = []
    for trial in range(8):
        seen = []
        agg = MetricAggregator(every=1)
        for step in range(6):
            agg.update(x=float(step))
            time.sleep(0.001 * (step % 3))  # some steps find the board ready, some do not
            agg.step(on_done=lambda r, step=step: seen.append(step))
        agg.update(x=1.0)
        agg.sync().wait(timeout=60)
        orders.append(list(seen))
    dist.destroy_process_group()
    print(json.dumps({
        "rank": rank,
        "results": results,
        "final": {"loss": str(final["loss"]), "nonfinite": final.nonfinite},
        "callback_threads": sorted(set(called)),
        "callbacks": len(called),
        "on_board": on_board,
        "orders": orders,
    }))
    """
)


def _aiodist_run(n: int, *args: str, timeout: float = 180) -> str:
    result = warm_run(
        [sys.executable, "-m", "aiodist", "run", "-n", str(n), "--no-prefix", *args],
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_plain_code_syncs_in_flight_with_callbacks(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    lines = [ln for ln in _aiodist_run(3, str(script)).splitlines() if ln.startswith("{")]
    reports = sorted((json.loads(ln) for ln in lines), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1, 2]
    weights = [1, 2, 3]
    for step in range(6):
        expected = {
            "loss": sum(w * (step + r) for r, w in enumerate(weights)) / sum(weights),
            "n": 3.0,
            "peak": float(2 * step),
        }
        if step == 3:
            expected["only_one"] = 7.0
        for report in reports:
            assert report["results"][step] == pytest.approx(expected)
    for report in reports:
        assert report["final"] == {"loss": "inf", "nonfinite": {"loss": 3}}
        assert report["callbacks"] == 6
        assert report["callback_threads"] == ["aiodist-loop"]
        assert report["on_board"]  # ranks of one host: the shared board
        assert report["orders"] == [list(range(6))] * 8


def test_train_metrics_example_logs_every_step(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    out = _aiodist_run(4, "examples/train_metrics.py", "--steps", "6", "--log", str(log))
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(steps) == 6, out
    assert any(ln.startswith("final    | final_loss=") for ln in out.splitlines()), out
    rows = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    for row in rows:
        assert row["samples"] == 32 + 40 + 48 + 56  # the sum over ranks' uneven batches
        assert row["slow_batches"] == 1  # reported by one rank only
        assert row["lr"] == 0.05
        assert 0 <= row["min_loss"] <= row["loss"]
        assert ("eval_loss" in row) == (row["step"] % 5 == 4)
