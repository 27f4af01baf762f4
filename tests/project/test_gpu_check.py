"""``make gpu-check`` on a machine without a GPU: everything of it that runs on CPU.

Without CUDA the real make target must stop at once, with a message and no
summary. The rest is tested piece by piece with real processes and real
outputs: the parts runner (timeouts, keep-going, the time budget, strays in
sessions of their own, the fallback after a usage error), the readers of each
part's output (a real pytest run's, the benchmarks' JSON), the summary in both
forms, the plan of commands, and one run of the check itself with ``--device
cpu``. The GPU run itself is ``make gpu-check`` on a machine with a GPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_check
from benchmarks._gpu_parts import Part, PartResult, run_part, run_parts
from benchmarks._gpu_summary import (
    SCHEMA,
    build_summary,
    last_json_line,
    parse_busbw,
    parse_lag,
    parse_overlap,
    parse_pytest,
    write_summary,
)
from benchmarks.bridge_busbw import figures, parse_size, size_label
from tests.helpers import ROOT

BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)  # outside any venv
NO_GPU = not gpu_check.cuda_device_nodes()


def _py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} in JSON")

    return json.loads(text, parse_constant=refuse)


# --- without CUDA: fail at once -----------------------------------------------------------


@pytest.mark.skipif(not NO_GPU, reason="this machine has an NVIDIA driver")
def test_make_gpu_check_without_cuda_fails_at_once_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    began = time.monotonic()
    done = subprocess.run(
        ["make", "-s", "gpu-check", f"PYTHON={BASE_PYTHON}"],  # no .venv: the bare python
        cwd=ROOT,
        env={**env, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    took = time.monotonic() - began
    assert done.returncode != 0, done.stdout + done.stderr
    assert "no CUDA GPU on this machine" in done.stderr
    assert "nothing was run" in done.stderr
    assert took < 20  # at once: no part ran (a real run takes minutes)
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.skipif(not NO_GPU, reason="this machine has an NVIDIA driver")
def test_script_imports_with_the_standard_library_only_and_exits_2_without_cuda(
    tmp_path: Path,
) -> None:
    # -S: no site-packages at all; only the checkout, through PYTHONPATH, as `make` sets it.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(tmp_path)}
    env.pop("VIRTUAL_ENV", None)
    code = (
        "import sys, benchmarks.gpu_check, benchmarks._gpu_probe; "
        "assert 'torch' not in sys.modules and 'aiodist' not in sys.modules; "
        "sys.exit(benchmarks.gpu_check.main([]))"
    )
    done = subprocess.run(
        [BASE_PYTHON, "-S", "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == gpu_check.NO_CUDA_EXIT, done.stderr
    assert "no CUDA GPU" in done.stderr
    listed = subprocess.run(
        [BASE_PYTHON, "-S", "-m", "benchmarks.gpu_check", "--list"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert [line.split()[0] for line in listed.stdout.splitlines()] == list(gpu_check.PARTS)


def test_probe_reports_a_cpu_torch_without_failing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks._gpu_probe"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    probe = last_json_line(done.stdout)
    import torch

    assert probe["torch"] == torch.__version__
    assert probe["cuda_available"] is torch.cuda.is_available()
    assert probe["aiodist"].startswith(str(ROOT))
    assert set(probe["packages"]) >= {"anyio", "pytest", "pytest-timeout", "uvloop"}


# --- arguments and the plan --------------------------------------------------------------


def test_parse_args_defaults_to_every_part_and_to_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUT", "/tmp/somewhere")
    args = gpu_check.parse_args([])
    assert args.out == Path("/tmp/somewhere")
    assert args.parts == list(gpu_check.PARTS[1:])
    assert args.budget == gpu_check.DEFAULT_BUDGET < 480  # well under the 8 minutes
    assert args.device == "cuda"
    assert args.python == sys.executable
    monkeypatch.delenv("OUT")
    assert gpu_check.parse_args([]).out == gpu_check.DEFAULT_OUT


def test_parse_args_keeps_the_canonical_order_and_refuses_unknown_parts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = gpu_check.parse_args(["--parts", "lag-ws2,pytest-gpu", "--timeout", "lag-ws2=7"])
    assert args.parts == ["pytest-gpu", "lag-ws2"]
    assert args.timeout == [("lag-ws2", 7.0)]
    for bad in (["--parts", "pytest,lag-ws2"], ["--timeout", "lag-ws2"], ["--timeout", "x=1"]):
        with pytest.raises(SystemExit) as exc:
            gpu_check.parse_args(bad)
        assert exc.value.code == 2
    assert "unknown part(s) ['pytest']" in capsys.readouterr().err


def test_plan_runs_pytest_on_the_gpu_files_and_skips_nccl_parts_without_nccl(
    tmp_path: Path,
) -> None:
    args = gpu_check.parse_args(["--timeout", "busbw-ws2=33"])
    parts = {p.name: p for p in gpu_check.plan(args, tmp_path, {"nccl": False})}
    assert list(parts) == list(gpu_check.PARTS[1:])
    test = parts["pytest-gpu"]
    assert {
        "tests/unit/torch/test_cuda.py",
        "tests/unit/torch/test_torch_bridge.py",
        "tests/unit/metrics/test_metrics.py",
    } <= set(test.argv)
    assert test.argv[test.argv.index("-m") + 1 :][:3] == ("pytest", "-m", "gpu")
    assert "--continue-on-collection-errors" in test.argv
    assert test.fallback is not None
    assert "addopts=" in test.fallback
    assert test.result == tmp_path / "junit.xml"
    for name in ("overlap-nccl-ws1", "busbw-nccl-ws1", "lag-nccl-ws1"):
        assert parts[name].skip == "this torch has no NCCL"
    assert parts["busbw-ws2"].timeout == 33
    overlap = parts["overlap-plane-ws2"]
    assert overlap.argv[:6] == (sys.executable, "-m", "aiodist", "run", "-n", "2")
    assert "--device" in overlap.argv
    assert overlap.argv[overlap.argv.index("--device") + 1] == "cuda"
    assert overlap.result is not None
    assert overlap.argv[-2:] == ("--json", str(overlap.result))
    assert Path(overlap.env["PYTHONPATH"].split(os.pathsep)[0]).is_absolute()
    lag = gpu_check.plan(args, tmp_path, {"nccl": True})[-1]
    assert lag.name == "lag-nccl-ws1"
    assert not lag.skip
    assert lag.argv[lag.argv.index("--size-mib") + 1] == "256"
    assert float(lag.argv[lag.argv.index("--busy-ms") + 1]) > 0
    cpu = gpu_check.plan(gpu_check.parse_args(["--device", "cpu"]), tmp_path, {"nccl": True})
    assert [p.name for p in cpu if p.skip] == ["overlap-nccl-ws1", "busbw-nccl-ws1", "lag-nccl-ws1"]


def test_gpu_test_files_are_those_using_the_marker() -> None:
    files = gpu_check.gpu_test_files()
    assert "tests/unit/torch/test_cuda.py" in files
    assert "tests/project/test_gpu_check.py" not in files  # it names the marker only as text here
    for name in files:
        assert "mark.gpu" in (ROOT / name).read_text()


# --- the runner: real processes -----------------------------------------------------------


def test_a_hung_part_times_out_and_the_next_parts_still_run(tmp_path: Path) -> None:
    parts = [
        Part("hang", "sleeps", _py("import time; time.sleep(120)"), timeout=1.5),
        Part("fail", "fails", _py("import sys; print('RuntimeError: broke'); sys.exit(7)"), 30),
        Part("pass", "passes", _py("print('noise'); print('{\"x\": 1}')"), 30, last_json_line),
        Part("skip", "skipped", _py("raise SystemExit(1)"), 30, skip="not here"),
    ]
    seen: list[list[str]] = []
    with open(tmp_path / "log", "wb") as log:
        results = run_parts(
            parts, budget=60, log=log, progress=lambda rs: seen.append([r.status for r in rs])
        )
    assert [r.status for r in results] == ["timeout", "failed", "passed", "skipped"]
    hang, fail, ok, skip = results
    assert hang.returncode is None
    assert 1.5 <= hang.seconds < 10
    assert "timeout" in hang.note
    assert fail.returncode == 7
    assert "RuntimeError: broke" in fail.note
    assert ok.figures == {"x": 1}
    assert ok.output_tail.startswith("noise")
    assert skip.note == "not here"
    assert seen[0] == ["pending"] * 4
    assert seen[-1] == [r.status for r in results]
    text = (tmp_path / "log").read_text()
    assert "===== hang:" in text
    assert "(timed out)" in text
    assert "RuntimeError: broke" in text


def _spawn_stray(pid_file: Path, then: str) -> tuple[str, ...]:
    """A part whose child leaves the part's session (as ``aiodist run``'s ranks do)."""
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
        " start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        f"{then}\n"
    )
    return _py(code)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.parametrize("then", ["pass", "time.sleep(120)"], ids=["exits", "hangs"])
def test_processes_that_left_the_parts_session_are_killed(tmp_path: Path, then: str) -> None:
    pid_file = tmp_path / "pid"
    part = Part("stray", "leaves a child", _spawn_stray(pid_file, then), timeout=3)
    result = run_part(part)
    pid = int(pid_file.read_text())
    try:
        assert _gone(pid)
        assert len(result.leftovers) == 1
        assert result.leftovers[0].startswith(f"{pid} ")
        assert result.status == ("passed" if then == "pass" else "timeout")
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_the_part_in_flight_and_its_strays(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    hang = _spawn_stray(pid_file, "time.sleep(120)")
    driver = (
        "import signal, sys\n"
        "from benchmarks._gpu_parts import Part, run_parts\n"
        "from benchmarks.gpu_check import _interrupt\n"
        "signal.signal(signal.SIGTERM, _interrupt)\n"
        f"part = Part('hang', 'hangs', {hang!r}, timeout=100)\n"
        "try:\n"
        "    run_parts([part], budget=100)\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(130)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", driver], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the part never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
        assert _gone(int(pid_file.read_text()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid_file.exists() and not _gone(pid := int(pid_file.read_text())):
            os.kill(pid, signal.SIGKILL)


def test_the_budget_skips_parts_it_has_no_time_left_for() -> None:
    parts = [
        Part("slow", "sleeps", _py("import time; time.sleep(60)"), timeout=100),
        Part("next", "never started", _py("print(1)"), timeout=100),
    ]
    began = time.monotonic()
    results = run_parts(parts, budget=2.0, min_timeout=0.5)
    assert time.monotonic() - began < 15
    assert [r.status for r in results] == ["timeout", "skipped"]
    assert results[0].timeout_s == pytest.approx(2.0, abs=0.2)  # the budget, not its 100 s
    assert "out of time" in results[1].note


def test_a_usage_error_runs_the_fallback_and_says_why() -> None:
    usage = "import sys; print('ERROR: Unknown config option: anyio_mode'); sys.exit(4)"
    part = Part(
        "pytest-like",
        "usage error, then the fallback",
        _py(usage),
        timeout=30,
        parse=last_json_line,
        fallback=_py("print('{\"ok\": true}')"),
    )
    result = run_part(part)
    assert result.status == "passed"
    assert result.figures == {"ok": True}
    assert "Unknown config option: anyio_mode" in result.note
    assert "ran again without the project's options" in result.note
    assert result.command == list(part.fallback or ())


def test_a_part_whose_output_cannot_be_read_fails() -> None:
    result = run_part(Part("mute", "prints no JSON", _py("print('hello')"), 30, last_json_line))
    assert result.status == "failed"
    assert result.returncode == 0
    assert "could not read its results: ValueError" in result.note


def test_a_command_that_cannot_start_fails_without_raising() -> None:
    result = run_part(Part("missing", "no such program", ("/nonexistent/python3",), 30))
    assert result.status == "failed"
    assert result.returncode == 127
    assert "could not start" in result.note


# --- the readers ----------------------------------------------------------------------------

SAMPLE_TESTS = """
import pytest

def test_ok():
    pass

def test_bad():
    assert 1 == 2, "one is not two"

@pytest.mark.skipif(True, reason="needs CUDA")
def test_skip():
    pass

@pytest.mark.parametrize("backend", ["none", "gloo"])
def test_param(backend):
    assert backend != "gloo"

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_error(broken):
    pass
"""


@pytest.fixture(scope="module")
def pytest_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A real pytest run with the options gpu_check passes, on tests of every outcome."""
    where = tmp_path_factory.mktemp("sample")
    (where / "test_sample.py").write_text(SAMPLE_TESTS)
    (where / "pytest.ini").write_text("[pytest]\n")
    junit = where / "junit.xml"
    options = ["-v", "-rA", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *options, "test_sample.py"],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    return done.stdout, junit


def test_parse_pytest_lists_every_outcome_with_its_reason(pytest_run: tuple[str, Path]) -> None:
    output, junit = pytest_run
    got = parse_pytest(output, junit)
    assert got["counts"] == {"passed": 2, "failed": 2, "skipped": 1, "error": 1}
    tests = {t["id"]: t for t in got["tests"]}
    assert tests["test_sample.py::test_bad"]["message"].startswith("AssertionError: one is not two")
    assert tests["test_sample.py::test_skip"]["message"] == "needs CUDA"
    assert tests["test_sample.py::test_param[gloo]"]["outcome"] == "FAILED"
    assert tests["test_sample.py::test_param[none]"]["outcome"] == "PASSED"
    assert "fixture broke" in tests["test_sample.py::test_error"]["message"]
    assert all(isinstance(t["seconds"], float) for t in got["tests"])
    assert got["pytest_summary"].startswith("2 failed, 2 passed, 1 skipped, 1 error in ")


def test_parse_pytest_reads_a_run_cut_short(pytest_run: tuple[str, Path]) -> None:
    output, _ = pytest_run
    cut = output[: output.index("test_sample.py::test_param[none]")]  # killed mid-run
    got = parse_pytest(cut, None)
    assert got["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert got["pytest_summary"] == ""
    with pytest.raises(ValueError, match="no test outcomes"):
        parse_pytest("ERROR: usage: pytest [options]\n", None)


def test_parse_pytest_reports_collection_errors() -> None:
    output = "ERROR tests/test_peers.py - ImportError: cannot import name 'P2P'\n"
    got = parse_pytest(output + "===== 7 passed, 1 error in 80.12s (0:01:20) =====\n")
    why = "ImportError: cannot import name 'P2P'"
    assert got["collection_errors"] == [f"tests/test_peers.py: {why}"]
    assert got["pytest_summary"] == "7 passed, 1 error in 80.12s"


def test_parse_overlap_reads_the_json_and_falls_back_to_the_printed_lines(tmp_path: Path) -> None:
    result = tmp_path / "overlap.json"
    figures_written = {"world_size": 2, "backend": "none", "overlap": 0.012, "blocking": 0.02}
    result.write_text(json.dumps({**figures_written, "none": 0.01, "overlap_efficiency": 0.8}))
    printed = "[rank 0]  overlap:     12.0 ms/step, weights in sync\n" * 1
    got = parse_overlap(printed + "[rank 0] blocking:  20.0 ms/step, weights in sync\n", result)
    assert got["ms_per_step"] == pytest.approx({"overlap": 12.0, "blocking": 20.0, "none": 10.0})
    assert got["share_hidden"] == pytest.approx(0.8)
    assert got["modes_in_sync"] == 2
    text = (
        "[rank 0]  overlap:      9.5 ms/step, weights in sync\n"
        "[rank 0] blocking:     12.0 ms/step, weights in sync\n"
        "[rank 0]     none:     12.5 ms/step, weights drifted apart (no communication)\n"
        "[rank 0] overlap efficiency: nan% of comm time hidden\n"
    )
    got = parse_overlap(text, tmp_path / "missing.json")
    assert got["ms_per_step"] == {"overlap": 9.5, "blocking": 12.0, "none": 12.5}
    assert got["share_hidden"] is None  # no communication time to hide: nan
    result.write_text('{"world_size": 1, "overlap": 0.01, "overlap_efficiency": NaN}')
    assert parse_overlap("", result)["share_hidden"] is None
    with pytest.raises(ValueError, match="no step times"):
        parse_overlap("Traceback ...", None)


def _busbw_result(tmp_path: Path, world: int, systems: list[str]) -> Path:
    rows = []
    for nbytes in (parse_size("4KiB"), parse_size("1MiB")):
        row: dict[str, Any] = {"bytes": nbytes, "label": size_label(nbytes)}
        for i, system in enumerate(systems):
            row[system] = figures(nbytes, world, [0.001 * (i + 1), 0.002 * (i + 1)])
        if len(systems) == 2:
            row["aiodist_over_torch"] = row["aiodist"]["median_s"] / row["torch"]["median_s"]
        rows.append(row)
    data = {"device": "cuda", "device_name": "GPU", "backend": "nccl", "world_size": world}
    data.update(systems=systems, warmup=1, repeats=2, rows=rows, errors={})
    path = tmp_path / f"busbw{world}.json"
    path.write_text(json.dumps(data))
    return path


def test_parse_busbw_gives_bus_bandwidth_at_two_ranks_and_algbw_at_one(tmp_path: Path) -> None:
    two = parse_busbw("", _busbw_result(tmp_path, 2, ["aiodist", "torch"]))
    assert two["bandwidth"] == "busbw"
    last = two["rows"][-1]
    assert last["size"] == "1 MiB"
    assert last["aiodist_ms"] == pytest.approx(1.5)
    assert last["aiodist_gbps"] == pytest.approx(2**20 / 0.0015 / 1e9)  # x 2(n-1)/n = 1
    assert last["aiodist_over_torch"] == pytest.approx(0.5)
    one = parse_busbw("", _busbw_result(tmp_path, 1, ["aiodist"]))
    assert one["bandwidth"] == "algbw"
    assert one["rows"][0]["torch_ms"] is None
    with pytest.raises(ValueError, match="no result file"):
        parse_busbw("", tmp_path / "missing.json")


def test_busbw_helpers_follow_nccl_tests() -> None:
    sizes = [parse_size(s) for s in ("4KiB", "16MiB", "1GiB", "100")]
    assert sizes == [4096, 16 << 20, 1 << 30, 100]
    assert size_label(256 << 20) == "256 MiB"
    four = figures(1 << 20, 4, [0.001, 0.003, 0.002])
    assert four["median_s"] == 0.002
    assert four["busbw_gbps"] == pytest.approx(four["algbw_gbps"] * 1.5)
    assert figures(1 << 20, 1, [0.001])["busbw_gbps"] is None


def _lag_result(tmp_path: Path) -> Path:
    lag = {
        variant: {
            "op_median_ms": op,
            "op_min_ms": op,
            "op_max_ms": op,
            "lag_p50_ms": 0.1,
            "lag_p99_ms": p99,
            "lag_max_ms": p99,
            "ticks": ticks,
        }
        for variant, op, p99, ticks in (("naive", 90.0, 88.0, 3), ("bridged", 91.0, 0.4, 80))
    }
    data = {"size_mib": 256, "repeats": 3, "world_size": 2, "device": "cuda", "backend": "gloo"}
    path = tmp_path / "lag.json"
    path.write_text(json.dumps({**data, "busy_ms": 0.0, "loop_lag": lag}))
    return path


def test_parse_lag_names_the_blocking_call_and_the_awaited_one(tmp_path: Path) -> None:
    got = parse_lag("", _lag_result(tmp_path))
    assert got["blocking"]["lag_p99_ms"] == 88.0
    assert got["aiodist"]["lag_p99_ms"] == 0.4
    assert got["aiodist"]["ticks"] == 80
    assert got["size_mib"] == 256


# --- the summary ----------------------------------------------------------------------------


def test_summary_json_and_text_hold_every_part_and_the_headline(
    tmp_path: Path, pytest_run: tuple[str, Path]
) -> None:
    import datetime

    output, junit = pytest_run
    results = [
        PartResult("pytest-gpu", "pytest -m gpu", "failed", 1, 80.0, 210.0, ["pytest"]),
        PartResult("overlap-plane-ws2", "overlap", "passed", 0, 20.0, 90.0, ["aiodist"]),
        PartResult("busbw-ws2", "busbw", "passed", 0, 20.0, 90.0, ["aiodist"]),
        PartResult("lag-ws2", "lag", "timeout", None, 90.0, 90.0, ["bench"], note="stopped"),
        PartResult("lag-nccl-ws1", "lag", "pending"),
    ]
    results[0].figures = parse_pytest(output, junit)
    results[0].output_tail = "E   AssertionError: one is not two\n"
    results[1].figures = {"ms_per_step": {"overlap": 1.0}, "share_hidden": float("nan")}
    results[2].figures = parse_busbw("", _busbw_result(tmp_path, 2, ["aiodist", "torch"]))
    results[3].figures = parse_lag("", _lag_result(tmp_path))
    started = datetime.datetime.now(datetime.UTC)
    summary = build_summary(
        results,
        started=started,
        budget=420,
        command=["python3", "-m", "benchmarks.gpu_check"],
        environment={"python": "3.12.3", "cpu_count": 16},
        device={"name": "NVIDIA H100", "capability": "90", "memory_gib": 79.1, "torch": "2.11"},
        finished=True,
    )
    json_path, text_path = write_summary(tmp_path / "out", summary)
    data = _strict_json(json_path.read_text())  # NaN became null: strict JSON
    assert data["schema"] == SCHEMA
    assert data["status"] == "failed"
    assert data["failed_parts"] == ["pytest-gpu", "lag-ws2"]  # pending is not failed
    assert [p["name"] for p in data["parts"]] == [r.name for r in results]
    keys = {"name", "title", "status", "returncode", "seconds", "timeout_s", "command"}
    assert keys | {"figures", "note", "leftovers", "output_tail"} == set(data["parts"][0])
    head = data["headline"]
    assert head["tests"] == "1 error, 2 failed, 2 passed, 1 skipped"
    assert head["overlap_share_hidden"] == {"overlap-plane-ws2": None}
    assert head["busbw_gbps"]["busbw-ws2"]["size"] == "1 MiB"
    assert head["lag_p99_ms"]["lag-ws2"] == {"blocking": 88.0, "aiodist": 0.4}
    text = text_path.read_text()
    assert text.startswith("aiodist gpu-check: FAILED")
    assert "NVIDIA H100, sm_90, 79 GiB" in text
    assert "FAILED  test_sample.py::test_bad" in text
    assert "share of communication hidden behind compute: n/a" in text
    assert "aiodist/torch" in text
    assert "blocking call" in text
    assert "aiodist awaited" in text
    assert "E   AssertionError: one is not two" in text  # a failed part shows its last lines
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "gpu-check.json",
        "gpu-check.txt",
    ]


# --- the check itself, on CPU tensors -------------------------------------------------------


@pytest.mark.slow
def test_gpu_check_on_cpu_runs_the_overlap_busbw_and_lag_parts(tmp_path: Path) -> None:
    parts = "overlap-plane-ws2,busbw-ws2,lag-ws2"
    options = ["--device", "cpu", "--quick", "--parts", parts, "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *options],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    data = _strict_json((tmp_path / "gpu-check.json").read_text())
    assert data["status"] == "passed"
    by_name = {p["name"]: p for p in data["parts"]}
    assert list(by_name) == ["preflight", *parts.split(",")]
    assert by_name["preflight"]["figures"]["cuda_available"] is False
    overlap = by_name["overlap-plane-ws2"]["figures"]
    assert set(overlap["ms_per_step"]) == {"overlap", "blocking", "none"}
    assert overlap["modes_in_sync"] == 2
    busbw = by_name["busbw-ws2"]["figures"]
    assert [r["size"] for r in busbw["rows"]] == ["4 KiB", "64 KiB"]
    assert all(r["aiodist_gbps"] > 0 and r["torch_gbps"] > 0 for r in busbw["rows"])
    lag = by_name["lag-ws2"]["figures"]
    assert lag["aiodist"]["ticks"] > 0
    assert "gpu-check [4/4] lag-ws2: passed" in done.stdout
    assert "aiodist gpu-check: PASSED" in done.stdout
    log = (tmp_path / "gpu-check.log").read_text()
    assert log.count("===== ") == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gpu-check.json",
        "gpu-check.log",
        "gpu-check.txt",
    ]
