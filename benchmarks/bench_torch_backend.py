"""torch.distributed's calls through the aiodist backend against gloo, and DDP on each, in one run.

Ranks (``aiodist run -n N benchmarks/_torch_ranks.py``, N = 2 and 4) start as
users do, with aiodist's ``init_process_group()``: torch's default group is on
the aiodist backend, and a gloo group over the same ranks stands beside it.
Per message size (the collectives table's), ``torch.distributed.all_reduce``
through the backend, through gloo and aiodist's own ``all_reduce`` alternate
in palindromes of blocks (backend, gloo, aiodist, aiodist, gloo, backend); each
palindrome gives the ratios backend/gloo and backend/aiodist (the backend's
overhead over aiodist's own API), reported as medians with their spread.
Then a DDP training step (a small MLP, a small transformer, CPU) with
``DistributedDataParallel`` on the default group and on the gloo group, A B
B A, as the ratio of step times.

Usage::

    python -m benchmarks.bench_torch_backend [--quick | --smoke] [--world-sizes 2 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from benchmarks._collective_ranks import SIZES
from benchmarks._common import Goal, format_table, summarize

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["PLANS", "bench", "goal_list", "render"]

RANKS: Final = Path(__file__).with_name("_torch_ranks.py")
#: Per mode: palindromes per case, block length (ms), DDP steps per block, world sizes.
PLANS: Final[dict[str, dict[str, Any]]] = {
    "full": {"sizes": SIZES["full"], "palindromes": 5, "batch_ms": 60.0, "steps": 10},
    "quick": {"sizes": SIZES["quick"], "palindromes": 3, "batch_ms": 30.0, "steps": 5},
    "smoke": {"sizes": SIZES["smoke"], "palindromes": 1, "batch_ms": 5.0, "steps": 1},
}


def bench(
    mode: str = "full", world_sizes: Sequence[int] = (2, 4), timeout: float = 1200.0
) -> dict[str, Any]:
    """Run the ranks at each world size; return every block and the ratios."""
    plan = dict(PLANS[mode])
    plan["sizes"] = list(plan["sizes"])
    data: dict[str, Any] = {"mode": mode, "plan": plan, "world_sizes": {}}
    for n in world_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "blocks.json"
            cmd = [sys.executable, "-m", "aiodist", "run", "-n", str(n), str(RANKS)]
            subprocess.run(
                [*cmd, str(out), json.dumps(plan)],
                check=True,
                timeout=timeout,
                stdout=subprocess.DEVNULL,
            )
            raw: dict[str, Any] = json.loads(out.read_text())
        data["world_sizes"][str(n)] = {
            "all_reduce": {size: _ratios(c["blocks"], 6) for size, c in raw["all_reduce"].items()},
            "ddp": {
                name: {**_ratios(c["blocks"], 4), "params": c["params"]}
                for name, c in raw["ddp"].items()
            },
            "raw": raw,
        }
    return data


def _ratios(blocks: Sequence[Sequence[Any]], span: int) -> dict[str, Any]:
    """Per palindrome of ``span`` blocks: each system's time per call and the ratios."""
    per: dict[str, list[float]] = {}
    vs_gloo, vs_aiodist = [], []
    for i in range(0, len(blocks) - span + 1, span):
        times: dict[str, float] = {}
        for system, seconds in blocks[i : i + span]:
            times[system] = times.get(system, 0.0) + seconds / 2
        for system, seconds in times.items():
            per.setdefault(system, []).append(seconds)
        vs_gloo.append(times["backend"] / times["gloo"])
        if "aiodist" in times:
            vs_aiodist.append(times["backend"] / times["aiodist"])
    out: dict[str, Any] = {}
    for system, samples in per.items():
        s = summarize(samples)
        out[f"{system}_us"] = None if s is None else s.median * 1e6
    for name, samples in (("vs_gloo", vs_gloo), ("vs_aiodist", vs_aiodist)):
        s = summarize(samples)
        if s is not None:
            out[name] = {"median": s.median, "min": s.min, "max": s.max}
    out["palindromes"] = len(vs_gloo)
    return out


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _ratio(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def render(data: dict[str, Any]) -> str:
    """A table of all_reduce per world size, and one of the DDP step."""
    parts = []
    for n, ws in data["world_sizes"].items():
        rows = []
        for size, c in ws["all_reduce"].items():
            overhead = c["backend_us"] - c["aiodist_us"]
            rows.append(
                [
                    _size(int(size)),
                    f"{c['backend_us']:.1f}",
                    f"{c['gloo_us']:.1f}",
                    f"{c['aiodist_us']:.1f}",
                    _ratio(c.get("vs_gloo")),
                    _ratio(c.get("vs_aiodist")),
                    f"{overhead:+.1f}",
                ]
            )
        headers = [
            "size",
            "backend us",
            "gloo us",
            "aiodist API us",
            "backend/gloo",
            "backend/aiodist API",
            "backend - API us",
        ]
        title = (
            f"torch.distributed.all_reduce through the aiodist backend vs gloo, {n} ranks "
            "(medians over palindromes; spread in brackets)"
        )
        parts.append(f"{title}\n{format_table(headers, rows)}")
    rows = []
    for n, ws in data["world_sizes"].items():
        for name, c in ws["ddp"].items():
            rows.append(
                [
                    name,
                    n,
                    f"{c['params']:,}",
                    f"{c['backend_us'] / 1e3:.2f}",
                    f"{c['gloo_us'] / 1e3:.2f}",
                    _ratio(c.get("vs_gloo")),
                ]
            )
    headers = ["model", "ranks", "params", "aiodist ms/step", "gloo ms/step", "aiodist/gloo"]
    parts.append(
        "DistributedDataParallel training step on the aiodist backend vs gloo (CPU, A B B A)\n"
        + format_table(headers, rows)
    )
    return "\n\n".join(parts)


def goal_list(data: dict[str, Any]) -> list[Goal]:
    """No goal is set for these figures: the report shows the ratios."""
    del data
    return []


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: ``python -m benchmarks.bench_torch_backend``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_torch_backend")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true")
    group.add_argument("--smoke", action="store_true")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path, default=None, help="write the data as JSON here")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    data = bench(mode, args.world_sizes)
    if args.out is not None:
        args.out.write_text(json.dumps(data))
    print(render(data))


if __name__ == "__main__":
    main()
