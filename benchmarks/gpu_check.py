"""``make gpu-check``: aiodist's GPU path, checked in one run whenever a GPU is at hand.

Runs, in order, each part with its own timeout and all of them within one
budget (7 minutes by default), going on to the next part whatever the last
one did:

1. ``preflight``: torch, CUDA, NCCL and the packages of the python that runs
   the check; a small kernel on the GPU; ``import aiodist`` from the checkout.
2. ``pytest-gpu``: ``pytest -m gpu`` on the test files that use the marker.
3. ``overlap-*``: ``examples/train_overlap.py --device cuda``, the share of the
   communication hidden behind compute: 2 ranks on aiodist's data plane
   (CUDA tensors staged through host memory), and 1 rank with NCCL.
4. ``busbw-*``: ``benchmarks/bridge_busbw.py``, all_reduce on CUDA tensors:
   NCCL through the bridge at world size 1 (the call's own cost), and at world
   size 2 on the one GPU, aiodist's data plane beside torch's gloo.
5. ``lag-*``: ``benchmarks/bench_bridge.py --lag-only``: the event loop's tick
   lag (p99) while a 256 MiB all_reduce runs, awaited vs a blocking call: gloo
   at world size 2, and NCCL at world size 1 behind 20 ms of queued GPU work.

The summary goes to ``$OUT`` (or ``--out``, else ``benchmarks/results/gpu/``):
``gpu-check.json``, ``gpu-check.txt`` (rewritten after every part) and
``gpu-check.log`` (every part's output). The text summary is printed last.

Without CUDA it stops at once with exit code 2 and writes nothing; with
``--device cpu`` it runs the parts it can on CPU tensors instead (to try the
check itself on a machine without a GPU). Exit code 1: some part failed.

Only the standard library and the checkout: ``PYTHONPATH=. python3 -m
benchmarks.gpu_check``, no install step (the GPU machine reaches no registry).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks._common import environment
from benchmarks._gpu_parts import Part, PartResult, run_part, run_parts
from benchmarks._gpu_summary import (
    build_summary,
    last_json_line,
    parse_busbw,
    parse_lag,
    parse_overlap,
    parse_pytest,
    render_text,
    write_summary,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    Parse = Callable[[str, Path | None], dict[str, Any]]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu"
DEFAULT_BUDGET = 420.0  # seconds for every part together: well under 8 minutes
TEST_TIMEOUT = 90  # pytest-timeout's limit per test: a hung test fails, the rest run
OP_TIMEOUT = 45  # the benchmark jobs' own operation timeout, under their part's
#: Each part's own limit in seconds (``--timeout NAME=SECONDS`` changes one).
TIMEOUTS: dict[str, float] = {
    "preflight": 90,
    "pytest-gpu": 210,
    "overlap-plane-ws2": 90,
    "overlap-nccl-ws1": 60,
    "busbw-nccl-ws1": 60,
    "busbw-ws2": 90,
    "lag-ws2": 90,
    "lag-nccl-ws1": 60,
}
PARTS = tuple(TIMEOUTS)
LAG_MIB = 256
BUSY_MS = 20.0
NO_CUDA_EXIT = 2
# A decorator, a ``pytestmark`` or an entry of its list: the marker in use, not its name in text.
_GPU_MARK = re.compile(r"^\s*(?:@|pytestmark\s*=\s*\[?\s*)?pytest\.mark\.gpu\b", re.MULTILINE)


def cuda_device_nodes() -> list[str]:
    """The NVIDIA driver's files on this machine; none means no GPU (checked without torch)."""
    found = sorted(glob.glob("/dev/nvidia[0-9]*"))
    found += [p for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version") if os.path.exists(p)]
    return found


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu-check", description="aiodist's GPU path in one run (make gpu-check)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else DEFAULT_OUT,
        help="where the summary goes (default: $OUT, else benchmarks/results/gpu)",
    )
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds in all")
    parser.add_argument(
        "--parts",
        type=_names,
        default=list(PARTS[1:]),
        help=f"comma-separated, in this order: {','.join(PARTS[1:])} (preflight always runs)",
    )
    parser.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        type=_timeout,
        help="change one part's own limit",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: run what can run on CPU tensors (to try the check without a GPU)",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer steps")
    parser.add_argument("--python", default=sys.executable, help="the python that runs the parts")
    parser.add_argument("--list", action="store_true", help="print the parts and exit")
    return parser.parse_args(argv)


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    return [n for n in PARTS if n in names and n != "preflight"]


def _timeout(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in PARTS or not seconds:
        raise argparse.ArgumentTypeError(f"expected PART=SECONDS with PART in {', '.join(PARTS)}")
    try:
        return name, float(seconds)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {seconds!r}") from None


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """The test files that use the ``gpu`` marker (a broken file elsewhere cannot stop them)."""
    found = [
        str(p.relative_to(root))
        for p in sorted((root / "tests").rglob("test_*.py"))
        if _GPU_MARK.search(p.read_text(errors="replace"))
    ]
    return found or ["tests"]


def part_env(device: str) -> dict[str, str]:
    """The parts' environment additions: the checkout on the path, absolute wherever they run."""
    path = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    if device == "cuda":  # NCCL's warnings say why a communicator would not come up
        env["NCCL_DEBUG"] = os.environ.get("NCCL_DEBUG", "WARN")
    return env


def preflight(args: argparse.Namespace) -> Part:
    return Part(
        "preflight",
        "torch, CUDA, NCCL and packages of the python that runs the check",
        (args.python, "-m", "benchmarks._gpu_probe"),
        dict(TIMEOUTS, **dict(args.timeout))["preflight"],
        parse=last_json_line,
        env=part_env(args.device),
    )


def plan(args: argparse.Namespace, tmp: Path, probe: dict[str, Any]) -> list[Part]:
    """The parts ``args`` asks for, in order; ``probe`` is what the preflight found."""
    py, device, quick = args.python, args.device, args.quick
    limits = dict(TIMEOUTS, **dict(args.timeout))
    env = part_env(device)
    no_nccl = (
        "--device cpu: NCCL needs CUDA"
        if device != "cuda"
        else ""
        if probe.get("nccl")
        else "this torch has no NCCL"
    )
    run = [py, "-m", "aiodist", "run"]

    def result(name: str) -> Path:
        return tmp / f"{name}.json"

    junit = tmp / "junit.xml"
    files = gpu_test_files()
    pytest_opts = ["-m", "gpu", "-v", "-rA", "-p", "no:cacheprovider"]
    pytest_opts += ["--continue-on-collection-errors", f"--junitxml={junit}"]
    pytest_opts += ["-o", f"timeout={TEST_TIMEOUT}"]
    no_project_opts = ["-o", "addopts=", "-W", "ignore::pytest.PytestConfigWarning"]
    overlap_opts = ["--steps", "3", "--warmup", "1", "--width", "64"] if quick else []
    sizes = ["--sizes", "4KiB,64KiB", "--repeats", "2"] if quick else []
    lag_mib, lag_repeats = (4, 1) if quick else (LAG_MIB, 3)

    def part(name: str, title: str, argv: list[str], parse: Parse, skip: str = "") -> Part:
        argv += ["--json", str(result(name))]
        return Part(name, title, tuple(argv), limits[name], parse, result(name), env=env, skip=skip)

    def overlap(name: str, n: int, backend: str, skip: str = "") -> Part:
        script = ["examples/train_overlap.py", "--device", device, "--backend", backend]
        title = f"examples/train_overlap.py --device {device} --backend {backend}, {n} rank(s)"
        argv = [*run, "-n", str(n), *script, *overlap_opts]
        return part(name, title, argv, parse_overlap, skip)

    def busbw(name: str, n: int, backend: str, skip: str = "") -> Part:
        script = ["benchmarks/bridge_busbw.py", "--device", device, "--backend", backend]
        title = f"all_reduce on {device} tensors, {n} rank(s), backend {backend}, vs torch"
        argv = [*run, "-n", str(n), *script, "--op-timeout", str(OP_TIMEOUT), *sizes]
        return part(name, title, argv, parse_busbw, skip)

    def lag(name: str, n: int, backend: str, busy: float, skip: str = "") -> Part:
        bench = [py, "-m", "benchmarks.bench_bridge", "--lag-only", "--device", device]
        title = f"loop lag during a {lag_mib} MiB all_reduce, {n} rank(s), {backend}"
        argv = [*bench, "--backend", backend, "-n", str(n), "--size-mib", str(lag_mib)]
        argv += ["--repeats", str(lag_repeats), "--busy-ms", str(busy)]
        argv += ["--timeout", str(max(limits[name] - 5, 5))]
        return part(name, title, argv, parse_lag, skip)

    parts = {
        "pytest-gpu": Part(
            "pytest-gpu",
            "pytest -m gpu: " + " ".join(files),
            (py, "-m", "pytest", *pytest_opts, *files),
            limits["pytest-gpu"],
            parse_pytest,
            junit,
            fallback=(py, "-m", "pytest", *no_project_opts, *pytest_opts, *files),
            env=env,
        ),
        "overlap-plane-ws2": overlap("overlap-plane-ws2", 2, "none"),
        "overlap-nccl-ws1": overlap("overlap-nccl-ws1", 1, "nccl", no_nccl),
        "busbw-nccl-ws1": busbw("busbw-nccl-ws1", 1, "nccl", no_nccl),
        "busbw-ws2": busbw("busbw-ws2", 2, "gloo"),
        "lag-ws2": lag("lag-ws2", 2, "gloo", 0.0),
        "lag-nccl-ws1": lag("lag-nccl-ws1", 1, "nccl", 0.0 if quick else BUSY_MS, no_nccl),
    }
    return [parts[name] for name in args.parts]


def nvidia_smi() -> dict[str, Any]:
    """The driver's view of GPU 0 (name, driver, memory in use), or {} without nvidia-smi."""
    query = "name,driver_version,memory.used,memory.total"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = [f.strip() for f in done.stdout.splitlines()[0].split(",")] if done.stdout else []
    if len(fields) != 4:
        return {"nvidia_smi": done.stdout.strip()[:300]}
    return {"smi_name": fields[0], "driver": fields[1], "memory_used_mib": fields[2]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name in PARTS:
            print(f"{name:<18} {TIMEOUTS[name]:>4.0f} s")
        return 0
    if args.device == "cuda" and not cuda_device_nodes():
        print(
            "gpu-check: no CUDA GPU on this machine (no NVIDIA driver: /dev/nvidia*, "
            "/proc/driver/nvidia); nothing was run. Run `make gpu-check` on a machine with a "
            "GPU, or pass --device cpu to try the check itself on CPU tensors.",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT
    started = datetime.datetime.now(datetime.UTC)
    args.out.mkdir(parents=True, exist_ok=True)
    given = sys.argv[1:] if argv is None else list(argv)
    command = [Path(args.python).name, "-m", "benchmarks.gpu_check", *given]
    device: dict[str, Any] = {}
    env = environment()
    results: list[PartResult] = []

    def write(current: list[PartResult], finished: bool = False) -> None:
        summary = build_summary(
            current,
            started=started,
            budget=args.budget,
            command=command,
            environment=env,
            device=device,
            finished=finished,
        )
        write_summary(args.out, summary)

    with open(args.out / "gpu-check.log", "wb") as log, tempfile.TemporaryDirectory() as tmp:
        first = run_part(preflight(args), args.budget, cwd=ROOT, log=log)
        probe = first.figures
        device.update({k: v for k, v in probe.items() if k != "packages"}, **nvidia_smi())
        env["packages"] = probe.get("packages")
        shown = _progress([first], 0, 1 + len(args.parts))
        results = [first]
        if args.device == "cuda" and not probe.get("cuda_available"):
            why = probe.get("error") or "; ".join(probe.get("cuda_warnings") or [])
            first.status = "failed"
            first.note = (first.note + "; " if first.note else "") + (
                f"torch sees no CUDA device: {why or 'torch.cuda.is_available() is False'}"
            )
            write([first], finished=True)
            print(
                f"gpu-check: torch {probe.get('torch')} in {args.python} sees no CUDA GPU "
                f"({first.note}); nothing else was run. Summary: {args.out}",
                file=sys.stderr,
            )
            return NO_CUDA_EXIT
        parts = plan(args, Path(tmp), probe)
        left = args.budget - first.seconds

        def progress(current: list[PartResult]) -> None:
            nonlocal results, shown
            results = [first, *current]
            shown = _progress(results, shown, len(results))
            write(results)

        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            run_parts(parts, left, cwd=ROOT, log=log, progress=progress)
        except KeyboardInterrupt:  # the part in flight was stopped; keep what was measured
            write(results, finished=True)
            print("gpu-check: interrupted; summary so far in", args.out, file=sys.stderr)
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
        device["memory_used_mib_after"] = nvidia_smi().get("memory_used_mib")
        write(results, finished=True)
    print(render_text(_read(args.out)))
    print(f"gpu-check: summary in {args.out}/gpu-check.{{txt,json,log}}")
    return 0 if all(r.ok for r in results) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM, as from a runner's timeout: stop the part, then report


def _progress(results: list[PartResult], shown: int, total: int) -> int:
    """Print one line for each part done since the first ``shown``; return how many are done."""
    done = [r for r in results if r.status != "pending"]
    for i, r in enumerate(done[shown:], start=shown + 1):
        note = f" ({r.note[:120]})" if r.note and r.status != "passed" else ""
        print(f"gpu-check [{i}/{total}] {r.name}: {r.status} in {r.seconds:.1f} s{note}")
    sys.stdout.flush()
    return len(done)


def _read(out: Path) -> dict[str, Any]:
    import json

    value = json.loads((out / "gpu-check.json").read_text())
    assert isinstance(value, dict)
    return value


if __name__ == "__main__":
    raise SystemExit(main())
