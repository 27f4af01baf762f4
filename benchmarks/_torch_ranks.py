"""One rank of the torch backend benchmark (``bench_torch_backend``).

Usage: ``aiodist run -n N benchmarks/_torch_ranks.py OUT PARAMS`` (PARAMS: JSON with
``sizes``, ``palindromes``, ``batch_ms``, ``steps``).

The job starts as users start one, ``aiodist.sync.init_process_group()``: torch's
default group is on the aiodist backend. A gloo group over the same ranks stands
beside it (``new_group(backend="gloo")``), so both run in one process. Per size,
blocks of ``torch.distributed.all_reduce`` through the aiodist backend, through
gloo, and aiodist's own ``aiodist.sync.all_reduce`` alternate in palindromes
(backend, gloo, aiodist, aiodist, gloo, backend): the machine's drift falls on
each alike. Then a DDP training step (a small MLP, a small transformer) with
``DistributedDataParallel`` on the default group and on the gloo group, A B B
A. Every block starts after a barrier; rank 0 decides how many calls a block
holds (about ``batch_ms``) and writes the seconds per call of every block to OUT.
"""

from __future__ import annotations

import copy
import functools
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import aiodist.sync

if TYPE_CHECKING:
    from collections.abc import Callable

ORDER = ("backend", "gloo", "aiodist", "aiodist", "gloo", "backend")
DDP_ORDER = ("backend", "gloo", "gloo", "backend")


def _agree(value: int) -> int:
    box = [value]
    aiodist.sync.broadcast_object_list(box, src=0)
    return int(box[0])


def _collectives(gloo: Any, sizes: list[int], palindromes: int, batch_ms: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        calls: dict[str, Callable[[], object]] = {
            "backend": functools.partial(dist.all_reduce, t),
            "gloo": functools.partial(dist.all_reduce, t, group=gloo),
            "aiodist": functools.partial(aiodist.sync.all_reduce, t),
        }
        for call in calls.values():  # warm: connections up, buffers touched
            call()
        aiodist.sync.barrier()
        start = time.perf_counter()
        calls["gloo"]()
        iters = _agree(max(1, min(2000, int(batch_ms / 1e3 / (time.perf_counter() - start)))))
        blocks: list[list[Any]] = []
        for _ in range(palindromes):
            for system in ORDER:
                aiodist.sync.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    calls[system]()
                blocks.append([system, (time.perf_counter() - start) / iters])
        out[str(nbytes)] = {"iters": iters, "blocks": blocks}
    return out


def _models() -> dict[str, tuple[torch.nn.Module, Any]]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    layer = torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True)
    transformer = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return {
        "MLP 256-512-512-10, batch 64": (mlp, lambda: torch.randn(64, 256)),
        "transformer 2 x (d 128, 4 heads), batch 8 x 32": (
            transformer,
            lambda: torch.randn(8, 32, 128),
        ),
    }


def _ddp(gloo: Any, steps: int, pairs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (model, batch) in _models().items():
        params = sum(p.numel() for p in model.parameters())
        ddps = {
            "backend": DistributedDataParallel(model),
            # The same parameters, on gloo.
            "gloo": DistributedDataParallel(copy.deepcopy(model), process_group=gloo),
        }
        x = batch()

        def step(ddp: Any, x: torch.Tensor = x) -> None:
            ddp.zero_grad()
            ddp(x).float().pow(2).mean().backward()

        for ddp in ddps.values():  # warm: buckets built, graphs seen
            for _ in range(3):
                step(ddp)
        blocks: list[list[Any]] = []
        for _ in range(pairs):
            for system in DDP_ORDER:
                aiodist.sync.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    step(ddps[system])
                blocks.append([system, (time.perf_counter() - start) / steps])
        out[name] = {"params": params, "steps": steps, "blocks": blocks}
    return out


def main(out: Path, params: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    aiodist.sync.init_process_group()  # torch's default group: the aiodist backend
    assert dist.get_backend() == "aiodist", dist.get_backend()
    gloo = dist.new_group(backend="gloo")
    results = {
        "world_size": dist.get_world_size(),
        "all_reduce": _collectives(
            gloo, params["sizes"], params["palindromes"], params["batch_ms"]
        ),
        "ddp": _ddp(gloo, params["steps"], params["palindromes"]),
    }
    rank = dist.get_rank()
    aiodist.sync.destroy_process_group()
    if rank == 0:
        out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
