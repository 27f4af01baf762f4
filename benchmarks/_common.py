"""Small helpers shared by the benchmark scripts: clocks, summaries, tables, JSON results.

Benchmarks print their own tables (unlike the library, where only ``_launch/cli.py``
prints) and write machine-readable results to ``benchmarks/results/``, which git
ignores.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from collections.abc import Sequence
    from multiprocessing.context import ForkServerContext

__all__ = [
    "RESULTS_DIR",
    "Goal",
    "Summary",
    "as_summary",
    "environment",
    "format_table",
    "goal_table",
    "jsonable",
    "now",
    "peak_rss_bytes",
    "pss_bytes",
    "raise_fd_limit",
    "rank_context",
    "reset_peak_rss",
    "rss_bytes",
    "summarize",
    "write_results",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def now() -> float:
    """Seconds on a clock that every process of this machine shares.

    ``time.monotonic`` is ``CLOCK_MONOTONIC`` on Linux and macOS: one process
    can stamp a start and another an end, and the difference is meaningful.
    """
    return time.monotonic()


@dataclass(frozen=True, slots=True)
class Summary:
    """Median and spread of repeated measurements, in the samples' unit."""

    median: float
    min: float
    max: float
    n: int

    def spread(self, scale: float = 1.0, digits: int = 1) -> str:
        """``"min-max"`` scaled (e.g. by 1000 for seconds to ms)."""
        return f"{self.min * scale:.{digits}f}-{self.max * scale:.{digits}f}"


def as_summary(obj: Summary | dict[str, Any] | None) -> Summary | None:
    """A Summary, also from its JSON form (a dict), so results can be re-read from a file."""
    if obj is None or isinstance(obj, Summary):
        return obj
    return Summary(float(obj["median"]), float(obj["min"]), float(obj["max"]), int(obj["n"]))


def summarize(samples: Sequence[float]) -> Summary | None:
    """Median, min and max of ``samples``; None when there are none."""
    if not samples:
        return None
    return Summary(statistics.median(samples), min(samples), max(samples), len(samples))


@dataclass(frozen=True, slots=True)
class Goal:
    """One of the project's goals, and where a run landed against it."""

    name: str  # what was measured: "all_reduce 64 MiB, N=4"
    measure: str  # how: "busbw aiodist/gloo"
    target: str  # "<= 0.5", ">= 2"
    value: float | None  # None: not measured in this run
    met: bool | None  # None: not measured
    source: str = ""  # where the goal was set

    @classmethod
    def judge(
        cls,
        name: str,
        measure: str,
        sense: Literal["<", "<=", ">=", ">"],
        limit: float,
        value: float | None,
        source: str = "",
    ) -> Goal:
        """Compare ``value`` with ``limit``; a missing value is "not measured"."""
        met = None
        if value is not None:
            met = {
                "<": value < limit,
                "<=": value <= limit,
                ">=": value >= limit,
                ">": value > limit,
            }[sense]
        return cls(name, measure, f"{sense} {limit:g}", value, met, source)

    @property
    def verdict(self) -> str:
        return "not measured" if self.met is None else "met" if self.met else "MISSED"


def goal_table(goals: Sequence[Goal]) -> str:
    """The goals as a plain-text table."""
    rows = [
        [g.name, g.measure, g.target, "-" if g.value is None else f"{g.value:.3g}", g.verdict]
        for g in goals
    ]
    return format_table(["case", "measure", "goal", "value", "verdict"], rows)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def raise_fd_limit(wanted: int) -> int:
    """Raise this process's open-file limit towards ``wanted`` (capped at the hard limit).

    Child processes inherit the new limit. Returns the soft limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def rss_bytes() -> int:
    """This process's resident set size now (Linux)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The highest resident set size since start-up or the last ``reset_peak_rss`` (Linux)."""
    return _status_kib("VmHWM") * 1024


def pss_bytes() -> int:
    """This process's proportional set size: shared pages divided among their mappers (Linux)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/smaps_rollup has no Pss line")


def reset_peak_rss() -> int:
    """Reset the peak RSS to the current RSS (``clear_refs`` 5, Linux >= 4.0); return it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_bytes()


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),  # others' work on a shared machine shows
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    info["git_commit"] = git_commit()
    for name in ("torch", "anyio", "uvloop", "msgpack"):
        try:
            info[name] = version(name)
        except PackageNotFoundError:
            info[name] = None
    return info


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def git_commit() -> str | None:
    """The checked-out commit (with ``+dirty`` if files changed), or None outside git."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def write_results(name: str, data: dict[str, Any], out: Path = RESULTS_DIR) -> Path:
    """Write ``data`` (plus ``environment()``) to ``{out}/{name}.json``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = {"benchmark": name, "environment": environment(), **data}
    path.write_text(json.dumps(payload, indent=2, default=jsonable) + "\n")
    return path


def jsonable(obj: object) -> object:
    """``json.dumps``' ``default=``: the benchmarks' dataclasses as dicts."""
    if isinstance(obj, Summary | Goal):
        return asdict(obj)
    raise TypeError(f"cannot write {type(obj).__name__} as JSON")


def rank_context() -> ForkServerContext:
    """Where the benchmarks' processes start: forked from one that imported torch and aiodist.

    Spawned, each paid their import (about 2.5 s of CPU) before its first line; a
    benchmark times what its processes do once started, which the start method
    does not touch, and starts gloo's and aiodist's ranks alike.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "aiodist"])
    return ctx
