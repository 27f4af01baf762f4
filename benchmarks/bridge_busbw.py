"""Bus bandwidth of all_reduce on one device's tensors: aiodist beside torch.distributed.

Each rank of an ``aiodist run`` job all-reduces float32 tensors of each size
and times every call until the result is on the device (``await`` plus a
device synchronisation, the same for both systems). Which path aiodist takes
depends on ``--backend``:

- ``nccl`` (CUDA): the torch bridge, NCCL issued from the group's thread;
- ``gloo``: CPU tensors go to the gloo bridge; CUDA tensors are staged through
  host memory and ride aiodist's own data plane;
- ``none``: aiodist's data plane only (torch.distributed stays down).

When torch.distributed is up (``nccl``, ``gloo``), the same ranks then time
``torch.distributed.all_reduce`` on the same tensors: the counterpart measured
in the same run. Every call's result is checked, so a fast wrong answer cannot
pass for a fast one. On one GPU (``make gpu-check``): ``-n 1 --backend nccl``
and ``-n 2 --backend gloo`` (both ranks on GPU 0).

Usage::

    aiodist run -n 2 benchmarks/bridge_busbw.py --device cuda --backend gloo --json out.json

Rank 0 writes the figures (``--json``) and prints a table. Bus bandwidth
follows nccl-tests: algbw x 2(n-1)/n; at world size 1 only algbw means
something (nothing moves: it times the call's own cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

KiB = 1024
MiB = 1024 * KiB
DEFAULT_SIZES = (4 * KiB, 1 * MiB, 16 * MiB, 128 * MiB)
OP_TIMEOUT = 120.0  # the job's own operation timeout: a stuck collective ends as an error


def parse_size(text: str) -> int:
    """``"4KiB"``, ``"16MiB"``, ``"1GiB"`` or a plain number of bytes."""
    units = {"GIB": 1024 * MiB, "MIB": MiB, "KIB": KiB, "B": 1}
    upper = text.strip().upper()
    for unit, scale in units.items():
        if upper.endswith(unit):
            return int(float(upper.removesuffix(unit)) * scale)
    return int(upper)


def size_label(nbytes: int) -> str:
    for unit, scale in (("GiB", 1024 * MiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def figures(nbytes: int, world: int, seconds: Sequence[float]) -> dict[str, Any]:
    """Median, spread and bandwidths (GB/s, 1e9 bytes) of one system at one size."""
    median = statistics.median(seconds)
    algbw = nbytes / median / 1e9
    return {
        "median_s": median,
        "min_s": min(seconds),
        "max_s": max(seconds),
        "n": len(seconds),
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * 2 * (world - 1) / world if world > 1 else None,
    }


async def _rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as tdist

    import aiodist

    dev = torch.device(args.device)
    if dev.type == "cuda":  # LOCAL_RANK's GPU; ranks share it when there are fewer GPUs
        local = int(os.environ.get("LOCAL_RANK", "0"))
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    backend = None if args.backend == "none" else args.backend
    await aiodist.init_process_group(backend, timeout=args.op_timeout)
    rank, world = aiodist.get_dist_info()
    systems = ["aiodist", *(["torch"] if tdist.is_initialized() else [])]
    expected = float(world * (world + 1) // 2)
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    try:
        for nbytes in args.sizes:
            t = torch.empty(nbytes // 4, dtype=torch.float32, device=dev)
            row: dict[str, Any] = {"bytes": nbytes, "label": size_label(nbytes)}
            for system in systems:
                if system in errors:
                    continue
                seconds: list[float] = []
                try:
                    for i in range(args.warmup + args.repeats):
                        t.fill_(float(rank + 1))
                        sync()
                        await aiodist.barrier()  # every rank starts the call together
                        t0 = time.perf_counter()
                        if system == "aiodist":
                            await aiodist.all_reduce(t)
                        else:
                            tdist.all_reduce(t)
                        sync()
                        elapsed = time.perf_counter() - t0
                        ends = (float(t[0].item()), float(t[-1].item()))
                        if ends != (expected, expected):
                            raise RuntimeError(f"summed to {ends}, not {expected}")
                        if i >= args.warmup:
                            seconds.append(elapsed)
                except Exception as exc:  # recorded; the other system goes on
                    errors[system] = f"{size_label(nbytes)}: {type(exc).__name__}: {exc}"[:500]
                    continue
                row[system] = figures(nbytes, world, seconds)
            if "aiodist" in row and "torch" in row:
                row["aiodist_over_torch"] = row["aiodist"]["median_s"] / row["torch"]["median_s"]
            rows.append(row)
            del t
    finally:
        await aiodist.destroy_process_group()
    if rank != 0:
        return
    data = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "backend": args.backend,
        "world_size": world,
        "systems": systems,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "rows": rows,
        "errors": errors,
    }
    if args.json is not None:
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")  # noqa: ASYNC240 - once
    print(render(data))


def render(data: dict[str, Any]) -> str:
    """The rows as a text table (ms per call and GB/s for each system)."""
    from benchmarks._common import format_table

    world = data["world_size"]
    bw = "busbw" if world > 1 else "algbw"
    headers = ["size"]
    for system in data["systems"]:
        headers += [f"{system} ms", f"{system} {bw}"]
    headers.append("aiodist/torch")
    table = []
    for row in data["rows"]:
        cells: list[object] = [row["label"]]
        for system in data["systems"]:
            got = row.get(system)
            if got is None:
                cells += ["-", "-"]
            else:
                cells += [f"{got['median_s'] * 1e3:.3f}", f"{got[f'{bw}_gbps']:.2f}"]
        ratio = row.get("aiodist_over_torch")
        cells.append("-" if ratio is None else f"{ratio:.2f}x")
        table.append(cells)
    lines = [
        f"all_reduce, {world} rank(s), {data['device']} tensors, backend {data['backend']} "
        f"(GB/s = 1e9 bytes/s, median of {data['repeats']})",
        format_table(headers, table),
    ]
    lines += [f"error ({system}): {text}" for system, text in data["errors"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo", "none"])
    parser.add_argument(
        "--sizes",
        type=lambda text: [parse_size(x) for x in text.split(",")],
        default=list(DEFAULT_SIZES),
        help="comma-separated sizes: 4KiB,1MiB,...",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--op-timeout", type=float, default=OP_TIMEOUT)
    parser.add_argument("--json", default=None, help="rank 0 writes the figures here")
    args = parser.parse_args(argv)
    asyncio.run(_rank(args))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks._common
    raise SystemExit(main())
