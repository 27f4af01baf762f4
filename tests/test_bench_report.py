"""The benchmark report keeps working: ``python -m benchmarks.report --smoke`` end to end.

The smoke run measures for real (spawned gloo and aiodist ranks, ``aiodist
serve``, a TCPStore master, a load round) at world size 2 with two message
sizes and one repeat; these tests check what it writes, not how fast anything
was. The plot is checked only where matplotlib (the ``bench`` extra) is installed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks._collective_ranks import SIZES, TENSOR_OPS, Case, cases, moved_bytes
from benchmarks._common import Goal

ROOT = Path(__file__).resolve().parent.parent
SMOKE_TIMEOUT = 100.0  # seconds; the run takes about 20 on two busy cores


@pytest.fixture(scope="module")
def smoke(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("report")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.report", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT,
        check=False,
    )
    return out, proc


def _rows(markdown: str, first_cell: str) -> list[list[str]]:
    rows = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            rows.append(cells)
    return rows


@pytest.mark.slow
def test_report_smoke_writes_every_table_with_both_systems(smoke: Any) -> None:
    out, proc = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (out / "report.md").read_text()
    for heading in (
        "## Goals",
        "## Collectives vs torch.distributed gloo",
        "### World size 2",
        "## Rendezvous at scale vs torch TCPStore",
        "## Server load",
    ):
        assert heading in md
    assert "_Not run: not part of --smoke" in md  # bridge and metrics say why they are absent
    duration = re.compile(r"^\d[\d.]* (µs|ms|s)$")
    for op in TENSOR_OPS:
        rows = _rows(md, op)
        assert len(rows) == len(SIZES["smoke"]), (op, rows)
        for row in rows:
            # op, size, aiodist time, gloo time, ratio, aiodist busbw, gloo busbw, ratio
            assert duration.match(row[2]), row
            assert duration.match(row[3]), row
            assert float(row[4].strip("*")) > 0, row
    assert duration.match(_rows(md, "barrier")[0][1])
    rendezvous = _rows(md, "4")[0]
    assert duration.match(rendezvous[1]), rendezvous
    assert duration.match(rendezvous[2]), rendezvous


@pytest.mark.slow
def test_report_smoke_json_holds_every_measurement(smoke: Any) -> None:
    out, proc = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "smoke"
    assert report["environment"]["cpu_count"] >= 1
    results = report["sections"]["collectives"]["data"]["results"]
    assert {r["case"] for r in results} == {c.name for c in cases("smoke")}
    for row in results:
        for system in ("aiodist", "gloo"):
            summary = row[system]["summary_s"]
            assert summary["n"] == 1, (row["case"], system)
            assert summary["median"] > 0, (row["case"], system)
    (rdv,) = report["sections"]["rendezvous"]["data"]["results"]
    assert rdv["world_size"] == 4
    assert rdv["aiodist"]["summary_s"]["median"] > 0
    assert rdv["tcpstore"]["summary_s"]["median"] > 0
    (load,) = report["sections"]["load"]["data"]["rounds"]
    assert load["held_at_once"] == 20
    assert load["jobs_formed"] == 2
    assert {g["name"] for g in report["goals"]} >= {"barrier, N=4", "rendezvous N=1024"}
    assert (out / "collectives.json").is_file()


@pytest.mark.slow
def test_report_smoke_times_remote_calls_against_tensorpipe(smoke: Any) -> None:
    out, proc = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "## Remote calls vs torch.distributed.rpc (TensorPipe)" in (out / "report.md").read_text()
    )
    report = json.loads((out / "report.json").read_text())
    results = report["sections"]["rpc"]["data"]["results"]
    assert [r["case"] for r in results] == ["noop", "noop_async", "window", "tensor"]
    for row in results:
        assert "error" not in row, row
        for system in ("aiodist", "torch"):
            assert row["summary_s"][system]["n"] == 1, (row["case"], system)
            assert row["summary_s"][system]["median"] > 0, (row["case"], system)
        assert row["time_ratio"] > 0
    names = {g["name"] for g in report["goals"]}
    assert {"rpc no-op round trip", "rpc calls/s, 64 in flight"} <= names


@pytest.mark.slow
def test_report_smoke_plots_bus_bandwidth(smoke: Any) -> None:
    pytest.importorskip("matplotlib")
    out, proc = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    png = out / "busbw_ws2.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000  # four panels with curves, not an empty canvas
    assert "](busbw_ws2.png)" in (out / "report.md").read_text()


def test_full_sweep_covers_4_bytes_to_64_mib_for_every_tensor_op() -> None:
    full = cases("full")
    for op in TENSOR_OPS:
        sizes = sorted(c.nbytes for c in full if c.op == op)
        assert sizes == [4**k for k in range(1, 14)], op  # 4 B ... 64 MiB


@pytest.mark.parametrize(
    ("op", "nbytes", "n", "moved"),
    [
        ("all_gather", 4, 4, 16),  # one float per rank at least
        ("reduce_scatter", 64, 4, 64),
        ("reduce_scatter", 40, 4, 32),  # whole float32 parts only
        ("all_reduce", 4, 4, 4),
    ],
)
def test_moved_bytes_counts_whole_float_parts(op: str, nbytes: int, n: int, moved: int) -> None:
    assert moved_bytes(Case(op, nbytes), n) == moved


def test_goal_judges_both_senses_and_a_missing_value() -> None:
    assert Goal.judge("x", "m", "<=", 0.5, 0.4).met is True
    assert Goal.judge("x", "m", ">=", 2.0, 1.9).verdict == "MISSED"
    assert Goal.judge("x", "m", "<", 2.0, None).verdict == "not measured"


@pytest.mark.slow
def test_metrics_bench_runs_every_variant_and_reports_intervals() -> None:
    """A few steps of each metrics variant on two ranks: every figure the report reads."""
    from benchmarks import bench_metrics

    data = bench_metrics.bench(2, 4, 1, large=None, pairs=4, block=2, timeout=SMOKE_TIMEOUT)
    small = data["configs"]["small"]
    assert set(small["step_seconds"]) == set(bench_metrics.VARIANTS)
    assert len(small["paired_ratios"]) == 4
    low, high = small["paired_interval"]
    assert low <= small["paired_ratio"] <= high
    assert set(small["reference"]) == {"read", "local"}
    assert all(len(r) == 4 for r in small["reference_ratios"].values())
    assert "reference local/none" in bench_metrics.render(data)
    [goal] = bench_metrics.goal_list(data)
    assert goal.value == small["paired_ratio"]
