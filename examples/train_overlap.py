"""Data-parallel training in plain (sync) code, gradients all-reduced while backward runs.

Run with ``aiodist run -n 4 examples/train_overlap.py`` (gloo on CPU; ``--device cuda``
puts rank ``r`` on GPU ``LOCAL_RANK``, with ``--backend nccl``, or ``gloo``/``none``
to stage the CUDA gradients through host memory). Every rank
trains the same MLP on its own batches; each parameter's gradient all_reduce is
started as a handle the moment backward has produced it, so communication of
the last layers overlaps the backward pass of the first ones. Three modes, side
by side:

- ``overlap``: start each gradient's all_reduce during backward, wait before the step;
- ``blocking``: after backward, all_reduce each gradient and wait for it at once;
- ``none``: no communication (the compute-only floor; ranks drift apart).

Rank 0 prints the median step time per mode and the overlap efficiency: the
share of the blocking mode's communication time that overlapping hides,
``(blocking - overlap) / (blocking - none)``. ``--json PATH`` writes them.

The training loop is plain synchronous code on ``aiodist.sync``: aiodist's async
core runs on its background event-loop thread, and ``async_op=True`` returns the
running handle at once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import aiodist.sync as dist

if TYPE_CHECKING:
    from collections.abc import Sequence


def make_model(width: int, depth: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers).to(device)


def train(
    mode: str,
    steps: int,
    width: int,
    depth: int,
    batch: int,
    device: torch.device,
) -> tuple[list[float], float]:
    """Train for ``steps``; return the step times (seconds) and a checksum of the weights."""
    model = make_model(width, depth, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    pending: list[dist.Work[torch.Tensor]] = []

    def on_grad(p: torch.Tensor) -> None:  # runs in autograd as soon as p.grad is final
        assert p.grad is not None
        pending.append(dist.all_reduce(p.grad, "mean", async_op=True))

    hooks = []
    if mode == "overlap":
        hooks = [
            p.register_post_accumulate_grad_hook(on_grad)  # type: ignore[no-untyped-call]
            for p in model.parameters()
        ]
    times = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=gen).to(device)
        y = torch.randn(batch, 1, generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        if mode == "overlap":
            for work in pending:
                work.wait()
            pending.clear()
        elif mode == "blocking":
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad, "mean")
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    for h in hooks:
        h.remove()
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return times, checksum


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--modes", nargs="+", default=["overlap", "blocking", "none"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--backend", default="gloo", help="gloo, nccl, or none (aiodist's data plane)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="write rank 0's figures here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        # One GPU per rank of a host: LOCAL_RANK's (ranks share GPUs when there are fewer),
        # set before anything touches CUDA.
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    dist.init_process_group(None if args.backend == "none" else args.backend)
    try:
        rank, world = dist.get_dist_info()
        torch.set_num_threads(1)  # several ranks share this machine's cores
        figures: dict[str, Any] = {"world_size": world, "backend": args.backend}
        for mode in args.modes:
            times, checksum = train(
                mode, args.warmup + args.steps, args.width, args.depth, args.batch, device
            )
            sums = dist.all_gather_object(checksum)
            in_sync = len(set(sums)) == 1
            if mode != "none" and not in_sync:
                raise SystemExit(f"mode {mode}: ranks disagree on the weights: {sums}")
            figures[mode] = statistics.median(times[args.warmup :])
            if rank == 0:
                state = "in sync" if in_sync else "drifted apart (no communication)"
                print(f"{mode:>8}: {figures[mode] * 1e3:8.1f} ms/step, weights {state}")
        if rank == 0 and {"overlap", "blocking", "none"} <= figures.keys():
            comm = figures["blocking"] - figures["none"]
            hidden = figures["blocking"] - figures["overlap"]
            figures["overlap_efficiency"] = hidden / comm if comm > 0 else float("nan")
            print(f"overlap efficiency: {figures['overlap_efficiency']:.0%} of comm time hidden")
        if rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
