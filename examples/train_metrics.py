"""A plain (blocking) training loop that logs metrics every step without waiting for them.

Run with ``aiodist run -n 4 examples/train_metrics.py [--steps N] [--log FILE]``.

Each rank trains a small MLP on its own shard of a synthetic regression task
(gradients averaged with ``all_reduce``). Every step it feeds loss, accuracy,
throughput and a few extremes to a ``MetricAggregator`` and starts one fused
sync; rank 0 prints the global values from the sync's callback while every
rank is already computing the next step. Some metrics exist on some ranks only
(``slow_batches``), or only on some steps (``eval_loss``).
"""

from __future__ import annotations

import argparse
import time

import torch

import aiodist.sync as dist
from aiodist.metrics import MetricAggregator, MetricResults, MetricsWriter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log", default=None, help="JSON-lines (or .csv) file written on rank 0")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    for p in model.parameters():  # start from rank 0's weights
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    true_w = torch.linspace(-1, 1, 16)

    writer = MetricsWriter(args.log) if args.log else None
    agg = MetricAggregator(
        {"samples": "sum", "grad_norm": "max", "min_loss": "min", "lr": "last"}, every=1
    )

    def report(step: int) -> None:
        def on_done(results: MetricResults) -> None:
            if rank == 0:
                print(results.summary(prefix=f"step {step:3d} | "), flush=True)
            if writer is not None:
                writer.write(results, step=step)

        agg.step(on_done=on_done)

    for step in range(args.steps):
        start = time.perf_counter()
        batch = 32 + 8 * rank  # uneven batches: the mean is weighted by sample count
        x = torch.randn(batch, 16)
        y = x @ true_w + 0.1 * torch.randn(batch)
        pred = model(x).squeeze(1)
        losses = (pred - y) ** 2
        loss = losses.mean()
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        dist.all_reduce(flat, op="mean")
        offset = 0
        for p in model.parameters():
            assert p.grad is not None
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()

        agg.update(
            batch,
            loss=loss.detach(),
            acc=((pred - y).abs() < 0.5).float().mean(),
            samples_per_s=batch / (time.perf_counter() - start),
        )
        agg.update(samples=batch, grad_norm=flat.norm(), min_loss=losses.detach(), lr=0.05)
        if rank == world - 1:
            agg.update(slow_batches=1)  # a metric only one rank reports
        if step % 5 == 4:
            agg.update(eval_loss=loss.detach() * 1.1)  # a metric only some steps have
        report(step)

    # Last sync, waited for: syncs resolve in call order, so every callback has run.
    agg.update(final_loss=loss.detach())
    final = agg.sync().wait(timeout=60)
    if rank == 0:
        print(final.summary(prefix="final    | "), flush=True)
    dist.destroy_process_group()
    if writer is not None:
        writer.close()


if __name__ == "__main__":
    main()
