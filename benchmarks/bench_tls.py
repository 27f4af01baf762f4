"""TLS against clear TCP against gloo between two hosts: two network namespaces on a veth.

p2p and all_reduce of 64 MiB between two ranks, one in each namespace (so the
data plane is TCP, as between hosts): aiodist with mutual TLS (``AIODIST_TLS_*``,
certificates made with openssl), aiodist in clear, and torch.distributed's
gloo. Each run is a fresh pair of processes; the modes run in alternating
order (TLS, clear, gloo, gloo, clear, TLS per round) so that drift on a shared
machine falls on all of them. Reported: the median throughput of each mode
over its runs, with its spread (min to max), and TLS as a share of clear (the
goal of issue 35: at least 50 %).

Network namespaces need root and ``ip``; without them the section says so and
measures nothing.

    python -m benchmarks.bench_tls [--rounds N] [--iters N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Final

from benchmarks._common import Goal

__all__ = ["bench", "goal_list", "render"]

ROOT: Final = Path(__file__).resolve().parents[1]
HOST_A: Final = "10.201.0.1"
HOST_B: Final = "10.201.0.2"
PORT: Final = 29611
NBYTES: Final = 64 * 1024 * 1024
MODES: Final = ("tls", "clear", "gloo")
RUN_TIMEOUT: Final = 300.0


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "openssl") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found"
    return None


class _Namespaces:
    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = (f"adtls-{tag}-a", f"adtls-{tag}-b")
        self.ifname = (f"at{tag}a", f"at{tag}b")

    def create(self) -> None:
        a, b = self.ns
        ia, ib = self.ifname
        for cmd in (
            ["ip", "netns", "add", a],
            ["ip", "netns", "add", b],
            ["ip", "link", "add", ia, "netns", a, "type", "veth", "peer", "name", ib, "netns", b],
            ["ip", "-n", a, "addr", "add", f"{HOST_A}/24", "dev", ia],
            ["ip", "-n", b, "addr", "add", f"{HOST_B}/24", "dev", ib],
            ["ip", "-n", a, "link", "set", ia, "up"],
            ["ip", "-n", b, "link", "set", ib, "up"],
            ["ip", "-n", a, "link", "set", "lo", "up"],
            ["ip", "-n", b, "link", "set", "lo", "up"],
        ):
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10)

    def delete(self) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _certificates(directory: Path) -> dict[str, str]:
    """A CA and one certificate signed by it, made as the security page says."""
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        ["openssl", "req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=bench CA"],
        ["openssl", "req", *curve, "-keyout", "rank.key", "-out", "rank.csr", "-subj", "/CN=rank"],
        ["openssl", "x509", "-req", "-in", "rank.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
         "-CAcreateserial", "-out", "rank.pem", "-days", "2"],
    ):  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, cwd=directory, timeout=60)
    return {
        "AIODIST_TLS_CERT": str(directory / "rank.pem"),
        "AIODIST_TLS_KEY": str(directory / "rank.key"),
        "AIODIST_TLS_CA": str(directory / "ca.pem"),
    }


def _run_pair(
    spaces: _Namespaces, mode: str, iters: int, tls_env: dict[str, str], port: int
) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIODIST_", "GLOO_"))}
    env.update({"AIODIST_UDS": "0", "AIODIST_SHM": "0", "PYTHONPATH": str(ROOT)})
    if mode == "tls":
        env.update(tls_env)
    procs = []
    for rank, ns in enumerate(spaces.ns):
        e = {**env, "GLOO_SOCKET_IFNAME": spaces.ifname[rank]}
        argv = [sys.executable, "-m", "benchmarks._tls_worker", mode, str(rank), HOST_A,
                str(port), str(NBYTES), str(iters)]  # fmt: skip
        procs.append(
            subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv],
                env=e,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=RUN_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"{mode} rank failed ({p.returncode}): {err[-2000:]}")
    line = outs[0][0].strip().splitlines()[-1]
    return dict(json.loads(line))


def bench(rounds: int = 2, iters: int = 5) -> dict[str, Any]:
    """Run ``rounds`` rounds of (TLS, clear, gloo, gloo, clear, TLS); throughput in GB/s."""
    reason = unavailable()
    if reason is not None:
        return {"skipped": reason}
    spaces = _Namespaces()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    order = [*MODES, *reversed(MODES)]
    port = PORT
    try:
        spaces.create()
    except (subprocess.CalledProcessError, OSError) as exc:
        spaces.delete()
        return {"skipped": f"network namespaces are not permitted here ({exc})"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tls_env = _certificates(Path(tmp))
            for _ in range(rounds):
                for mode in order:
                    port += 1  # a fresh port per run: no TIME_WAIT in the way
                    runs[mode].append(_run_pair(spaces, mode, iters, tls_env, port))
    finally:
        spaces.delete()
    results = []
    for op in ("p2p", "all_reduce"):
        row: dict[str, Any] = {"op": op, "nbytes": NBYTES}
        for mode in MODES:
            rates = [NBYTES / r[op] / 1e9 for r in runs[mode]]
            row[mode] = {
                "median_gbps": statistics.median(rates),
                "min_gbps": min(rates),
                "max_gbps": max(rates),
                "runs": len(rates),
            }
        row["tls_over_clear"] = row["tls"]["median_gbps"] / row["clear"]["median_gbps"]
        row["tls_over_gloo"] = row["tls"]["median_gbps"] / row["gloo"]["median_gbps"]
        results.append(row)
    return {"rounds": rounds, "iters": iters, "order": order, "results": results}


def goal_list(data: dict[str, Any]) -> list[Goal]:
    """Issue 35's goal: TLS at least 50 % of clear TCP."""
    rows = {r["op"]: r for r in data.get("results", [])}
    return [
        Goal.judge(
            f"{op} 64 MiB, 2 hosts (veth)",
            "throughput TLS/clear",
            ">=",
            0.5,
            rows[op]["tls_over_clear"] if op in rows else None,
            "issue 35",
        )
        for op in ("p2p", "all_reduce")
    ]


def render(data: dict[str, Any]) -> str:
    """The rows as a text table: median GB/s and spread per mode, and the ratios."""
    if "skipped" in data:
        return f"TLS benchmark skipped: {data['skipped']}"
    lines = [
        f"two network namespaces on a veth pair; {data['rounds']} rounds of "
        f"{' '.join(data['order'])}, {data['iters']} transfers per run; GB/s median [min-max]",
        f"{'op':<12} {'TLS':>20} {'clear':>20} {'gloo':>20} {'TLS/clear':>10} {'TLS/gloo':>9}",
    ]
    for r in data["results"]:
        cells = [
            f"{r[m]['median_gbps']:.2f} [{r[m]['min_gbps']:.2f}-{r[m]['max_gbps']:.2f}]"
            for m in MODES
        ]
        lines.append(
            f"{r['op']:<12} {cells[0]:>20} {cells[1]:>20} {cells[2]:>20} "
            f"{r['tls_over_clear']:>10.2f} {r['tls_over_gloo']:>9.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    data = bench(args.rounds, args.iters)
    print(render(data))
    for goal in goal_list(data):
        print(f"{goal.name}: {goal.measure} {goal.target}: {goal.value} ({goal.verdict})")


if __name__ == "__main__":
    main()
