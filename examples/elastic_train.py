"""Data-parallel SGD that goes on when a worker dies.

    aiodist run -n 4 examples/elastic_train.py

Every rank fits the same linear model to its own shard of data; gradients are
averaged with an all_reduce over the current default group. At ``--fail-at``
the last rank goes away: it leaves before the step (preempted; under
``aiodist run``, which stops every rank once one fails), or with ``--kill``
it kills itself with SIGKILL in the middle of the step's all_reduce, as the
OOM killer would (``tests/test_elastic_examples.py`` runs it so). The
survivors see ``RankFailedError`` naming it, agree on a smaller default group
with ``shrink_group``, redo that step's all_reduce over it, and train on.
Rank 0 prints the loss curve with the failure marked, and checks that
training converged.
"""

from __future__ import annotations

import argparse
import os
import signal

import anyio
import anyio.lowlevel
import torch

import aiodist

TRUE_W = torch.tensor([2.0, -3.0, 0.5, 1.0])


def shard(rank: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(n, len(TRUE_W), generator=gen)
    return x, x @ TRUE_W + 0.01 * torch.randn(n, generator=gen)


async def main(steps: int, fail_at: int, kill: bool, lr: float) -> None:
    await aiodist.init_process_group()
    rank, victim = aiodist.get_rank(), aiodist.get_world_size() - 1
    x, y = shard(rank)
    w = torch.zeros(len(TRUE_W))
    curve: list[tuple[int, int, float]] = []  # step, world size, mean loss
    events: list[str] = []
    step = 0
    while step < steps:
        err = x @ w - y
        # The gradient and the loss in one all_reduce: one collective per step.
        packed = torch.cat([2 * x.T @ err / len(y), err.pow(2).mean().reshape(1)])
        if rank == victim and step == fail_at:
            if kill:
                aiodist.all_reduce(packed)  # its part is on its way...
                await anyio.lowlevel.checkpoint()
                os.kill(os.getpid(), signal.SIGKILL)  # ...and it dies mid-step
            await aiodist.destroy_process_group()  # or it leaves, as on preemption
            return
        try:
            await aiodist.all_reduce(packed)
        except aiodist.RankFailedError as exc:  # every survivor hears it, naming the rank
            await aiodist.shrink_group([exc.rank])  # and every one gets the same group
            # A step in flight may have completed on some survivors and not on others:
            # go on from rank 0's parameters and step, the same on every survivor.
            box: list[object] = [w, step]
            await aiodist.broadcast_object_list(box, src=0)
            w, step = box[0], box[1]  # type: ignore[assignment]
            events.append(
                f"step {step}: rank {exc.rank} gone, shrank to {aiodist.get_world_size()} ranks"
            )
            continue
        packed /= aiodist.get_world_size()
        w -= lr * packed[:-1]
        curve.append((step, aiodist.get_world_size(), packed[-1].item()))
        step += 1
    if rank == 0:
        report(curve, events, w, fail_at)
    await aiodist.destroy_process_group()


def report(
    curve: list[tuple[int, int, float]], events: list[str], w: torch.Tensor, at: int
) -> None:
    for event in events:
        print(f"event: {event}")
    every = max(1, len(curve) // 24)
    for step, world, value in curve:
        if step % every == 0 or step in (at, at + 1) or step == curve[-1][0]:
            bar = "#" * min(60, round(value * 4))
            mark = "  <- a rank failed here" if step == at else ""
            print(f"step {step:3d}  world {world}  loss {value:10.6f}  {bar}{mark}")
    first, last = curve[0][2], curve[-1][2]
    dist = (w - TRUE_W).norm().item()
    print(
        f"elastic train: {len(curve)} steps, loss {first:.4f} -> {last:.6f}, "
        f"|w - w*| {dist:.4f}, world {curve[0][1]} -> {curve[-1][1]}"
    )
    assert last < first / 100, "the loss did not fall"
    assert dist < 0.05, "the weights did not converge"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--fail-at", type=int, default=40)
    parser.add_argument("--kill", action="store_true", help="SIGKILL instead of leaving")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    anyio.run(main, args.steps, args.fail_at, args.kill, args.lr)
