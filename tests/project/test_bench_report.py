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
from typing import TYPE_CHECKING, Any

import pytest

from benchmarks import _small, bench_remote, bench_rpc
from benchmarks._collective_ranks import SIZES, TENSOR_OPS, Case, cases, moved_bytes
from benchmarks._common import Goal, Summary
from benchmarks._report_md import render_report
from tests.helpers import ROOT

if TYPE_CHECKING:
    from pathlib import Path

SMOKE_TIMEOUT = 300.0  # seconds; the run takes 50-65 on two busy cores, over 100 when loaded


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
def test_report_smoke_times_small_messages_at_world_size_2(smoke: Any) -> None:
    out, proc = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (out / "report.md").read_text()
    assert "## Small messages vs torch.distributed gloo, 2 to 16 ranks" in md
    report = json.loads((out / "report.json").read_text())
    results = report["sections"]["small"]["data"]["results"]
    assert [(r["case"], r["world_size"]) for r in results] == [
        (c.name, 2) for c in _small.SMALL_CASES
    ]
    for row in results:
        assert row["time_ratio"] > 0, row
    goals = {g["name"]: g for g in report["goals"] if g["source"] == "issue 24"}
    assert goals["p2p_round_trip 8 B, N=2"]["value"] == results[0]["time_ratio"]
    assert goals["barrier growth, N=2 to 16"]["met"] is None  # smoke runs world size 2 only
    assert (out / "small.json").is_file()


@pytest.mark.slow
def test_report_smoke_times_remote_calls_against_tensorpipe(smoke: Any) -> None:
    out, proc = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "## Remote calls vs torch.distributed.rpc (TensorPipe)" in (out / "report.md").read_text()
    )
    report = json.loads((out / "report.json").read_text())
    results = report["sections"]["rpc"]["data"]["results"]
    assert [r["case"] for r in results] == list(bench_rpc.CASES)
    assert {"ps_step", "batch"} <= set(bench_rpc.CASES)  # the programs' steps, not calls only
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


def _small_row(case: str, n: int, aiodist_s: float, gloo_s: float) -> dict[str, Any]:
    return {
        "world_size": n,
        "case": case,
        "op": case.split()[0],
        "aiodist": {"summary_s": Summary(aiodist_s, aiodist_s * 0.9, aiodist_s * 1.2, 5)},
        "gloo": {"summary_s": Summary(gloo_s, gloo_s, gloo_s * 1.1, 5)},
        "time_ratio": aiodist_s / gloo_s,
    }


def _small_data() -> dict[str, Any]:
    """Small-message results as ``bench_collectives.bench`` returns them, made up."""
    sizes = (2, 4, 8, 16)
    results = [_small_row("barrier", n, 20e-6 * k, 100e-6 * k * k) for k, n in enumerate(sizes, 1)]
    results += [_small_row("p2p_round_trip 8 B", n, 60e-6, 120e-6) for n in sizes]
    results += [_small_row("all_reduce 4 B", n, 50e-6 * n, 90e-6 * n) for n in sizes]
    # The other way round, as a crashed system leaves it: no summary, an error.
    results[-1]["aiodist"] = {"error": "RankFailedError: rank 3 died"}
    results[-1]["time_ratio"] = None
    return {
        "config": {"world_sizes": list(sizes), "repeats": 5, "batch_target_s": 0.04},
        "results": results,
    }


def test_small_goals_judge_ratios_and_barrier_growth() -> None:
    goals = {g.name: g for g in _small.goal_list(_small_data())}
    assert set(goals) == {
        "p2p_round_trip 8 B, N=2",
        "p2p_round_trip 8 B, N=4",
        "barrier, N=4",
        "all_reduce 4 B, N=4",
        "all_reduce 4 B, N=8",
        "barrier growth, N=2 to 16",
    }
    assert all(g.source == "issue 24" for g in goals.values())
    assert goals["p2p_round_trip 8 B, N=2"].value == pytest.approx(0.5)
    assert goals["p2p_round_trip 8 B, N=2"].met is True
    assert goals["barrier, N=4"].value == pytest.approx(40 / 400)
    assert goals["all_reduce 4 B, N=8"].verdict == "MISSED"  # 0.556 > 0.5
    growth = goals["barrier growth, N=2 to 16"]
    assert growth.value == pytest.approx(4.0)  # 80 µs / 20 µs
    assert (growth.target, growth.met) == ("<= 4", True)
    assert _small.growth(_small_data(), "barrier", "gloo", 16) == pytest.approx(16.0)


def test_small_goals_grow_to_the_largest_world_size_run() -> None:
    data = _small_data()
    data["config"]["world_sizes"] = [2, 4, 8]
    data["results"] = [r for r in data["results"] if r["world_size"] <= 8]
    goals = {g.name: g for g in _small.goal_list(data)}
    assert goals["barrier growth, N=2 to 8"].target == "<= 3"
    data["results"] = [r for r in data["results"] if r["world_size"] == 2]
    data["config"]["world_sizes"] = [2]
    goals = {g.name: g for g in _small.goal_list(data)}
    assert goals["barrier growth, N=2 to 16"].verdict == "not measured"
    assert goals["barrier, N=4"].verdict == "not measured"


def test_small_section_renders_a_row_per_case_and_world_size() -> None:
    data = _small_data()
    report = {
        "command": "python -m benchmarks.report --sections small",
        "mode": "full",
        "environment": {"date": "today", "git_commit": "abc"},
        "wall_s": 60.0,
        "sections": {"small": {"data": data, "wall_s": 60.0}},
    }
    md = render_report(report, _small.goal_list(data), {})
    assert "## Small messages vs torch.distributed gloo, 2 to 16 ranks" in md
    barrier = _rows(md, "barrier")
    # case, N, aiodist, gloo, aiodist/gloo, aiodist x N=2, gloo x N=2
    assert [r[1] for r in barrier] == ["2", "4", "8", "16"]
    assert barrier[3][2:] == [
        "80.0 µs (72.0-96.0)",
        "1.60 ms (1.60-1.76)",
        "**0.05**",
        "4.00",
        "16.00",
    ]
    assert _rows(md, "all_reduce 4 B")[3][2].startswith("failed: RankFailedError")
    assert "Barrier growth from N=2 to N=16: aiodist 4.00x, gloo 16.00x" in md
    # Its goals table, in the section as well as at the top of the report.
    assert len(_rows(md, "barrier growth, N=2 to 16")) == 2
    assert "**MISSED**" in _rows(md, "all_reduce 4 B, N=8")[0]
    # The text tables (bench_collectives --small) hold the same rows.
    text = _small.render(data, goals=True)
    assert "barrier growth, N=2 to 16" in text
    assert "FAILED: RankFailedError" in text


def test_small_set_runs_three_cases_up_to_16_ranks() -> None:
    from benchmarks.report import PLANS

    assert [c.name for c in _small.SMALL_CASES] == [
        "p2p_round_trip 8 B",
        "barrier",
        "all_reduce 4 B",
    ]
    assert {m: p.small_world_sizes for m, p in PLANS.items()} == {
        "full": (2, 4, 8, 16),
        "quick": (2, 4, 8),
        "smoke": (2,),
    }


def test_metrics_small_step_goal_at_world_size_2() -> None:
    from benchmarks import bench_metrics

    data = {"config": {"ranks": 2}, "configs": {"small": {"paired_ratio": 1.015}}}
    goal = bench_metrics.small_step_goal(data, "issue 24")
    assert (goal.name, goal.target, goal.met, goal.source) == (
        "metrics small step, N=2",
        "<= 1.02",
        True,
        "issue 24",
    )


@pytest.mark.slow
def test_pingpong_times_and_profiles_the_round_trip_under_aiodist_run() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "aiodist",
            "run",
            "-n",
            "2",
            "--no-prefix",
            "benchmarks/pingpong.py",
            "--iters",
            "200",
            "--repeats",
            "2",
            "--profile",
            "--top",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in (0, 1):
        line = next(x for x in out.stdout.splitlines() if x.startswith(f"rank {rank}: 8-byte"))
        times = [float(t) for t in line.split(":")[-1].split()]
        assert len(times) == 2, line
        assert all(t > 0 for t in times), line
    assert "calls for 200 round trips" in out.stdout
    assert "aiodist/_" in out.stdout  # the profile shows aiodist's own frames


def test_sim_source_addresses_are_one_per_simulated_host() -> None:
    from benchmarks.rdzv_sim import RANKS_PER_HOST, source_address

    hosts = 65536 // RANKS_PER_HOST
    addresses = {source_address(h * RANKS_PER_HOST) for h in range(hosts)}
    assert len(addresses) == hosts
    assert source_address(0) == source_address(RANKS_PER_HOST - 1)
    assert all(a.startswith("127.") and ".0" not in a.split(".", 1)[1] for a in addresses)


@pytest.mark.slow
def test_sim_runs_both_servers_and_times_their_cpu() -> None:
    from benchmarks.rdzv_sim import render_sim, sim_bench

    data = sim_bench([64], 1, workers=2, timeout=60.0)
    (row,) = data["results"]
    for system in ("aiodist", "tcpstore"):
        assert row[system]["errors"] == [], row[system]
        assert row[system]["summary_s"].median > 0
        assert row[system]["server_cpu_s"].median > 0  # the server's own work, in the clock
        assert row[system]["clients_cpu_s"].median > 0
        assert row[system]["server_wait_s"].median >= 0  # what the machine's load cost it
    assert row["server_cpu_ratio_tcpstore_over_aiodist"] > 0
    (line,) = [x for x in render_sim(data).splitlines() if x.startswith("64 ")]
    assert "x" in line


@pytest.mark.slow
def test_sim_runs_aiodist_ranks_sharing_connections_past_the_open_files_limit() -> None:
    from benchmarks.rdzv_sim import render_sim, sim_bench

    # 64 ranks need 64 + 256 descriptors alone, 8 + 256 sharing connections: TCPStore
    # cannot run, aiodist runs with a simulated host's ranks on one connection.
    data = sim_bench([64], 1, workers=2, open_files=300)
    (row,) = data["results"]
    assert "open-files limit is 300" in row["tcpstore"]["errors"][0]
    assert row["aiodist"]["errors"] == [], row["aiodist"]
    assert row["aiodist_ranks_per_connection"] == 8
    assert row["aiodist"]["summary_s"].median > 0  # every one of the 64 passed the barrier
    assert "64 (8 ranks per aiodist connection)" in render_sim(data)


@pytest.mark.slow
def test_torch_backend_bench_times_the_backend_gloo_and_aiodists_api() -> None:
    from benchmarks import bench_torch_backend

    data = bench_torch_backend.bench("smoke", (2,))
    ws = data["world_sizes"]["2"]
    for c in ws["all_reduce"].values():
        assert min(c["backend_us"], c["gloo_us"], c["aiodist_us"]) > 0, c
        assert c["vs_gloo"]["median"] > 0, c
    assert len(ws["ddp"]) == 2
    text = bench_torch_backend.render(data)
    assert "DistributedDataParallel training step" in text


@pytest.mark.slow
def test_remote_bench_measures_the_three_ways_and_loses_no_update() -> None:
    # The worker's tensor must hold every update of every case (bench raises if not).
    data = bench_remote.bench(rounds=2, ops=200, calls=40, timeout=120)
    for case in bench_remote.CASES:
        summary = data["per_second"][case]
        assert summary is not None
        assert summary.n == 2
        assert summary.median > 0
    assert set(data["ratios"]) == {"remote done / rpc one by one", "remote done / rpc_async"}
    text = bench_remote.render(data)
    assert "remote issued" in text
    assert "rpc one by one" in text
    goal = bench_remote.goal_list(data)[0]
    assert goal.value is not None
