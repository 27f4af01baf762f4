"""Plain torch DDP that goes on when a rank dies, and takes in its replacement.

    aiodist run -n 4 --replace-failed examples/elastic_ddp.py

The training code is torch's own: ``DistributedDataParallel(model)``,
``torch.distributed.all_reduce``, ``broadcast_object_list``. It runs on the
default group that aiodist's ``init_process_group()`` brings up, whose calls
ride aiodist's data plane and membership. At ``--kill-at`` the last rank kills
itself (SIGKILL) inside DDP's backward, as the OOM killer would: the others'
``backward()`` raises torch's ``RuntimeError`` naming it (the next call on the
group raises aiodist's ``RankFailedError`` itself). Every rank of the job's
next membership view then calls ``regroup`` (torch's group is renumbered
underneath) and wraps the model again: ``DistributedDataParallel`` broadcasts
rank 0's parameters as it starts, to the survivors and, once ``aiodist run
--replace-failed`` started it, to the replacement, which joins with the next
free rank. Every step, the ranks agree on the latest membership epoch any of
them has seen (an ``all_reduce`` with MAX), so they regroup at the same step.
Rank 0 prints the loss curve with the kill and the join marked.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import aiodist
import aiodist.sync as elastic

TRUE_W = torch.linspace(-1.0, 1.0, 16)


def batch(rank: int, step: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, len(TRUE_W), generator=gen)
    return x, torch.tanh(x @ TRUE_W).unsqueeze(1)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same start everywhere; DDP broadcasts rank 0's anyway
    return torch.nn.Sequential(
        torch.nn.Linear(len(TRUE_W), 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )


class _MembershipChanged(Exception):
    """A rank saw a membership view past the group's: regroup before the step."""


def main(steps: int, kill_at: int, lr: float, after: int) -> None:
    elastic.init_process_group()  # torch's default group, on aiodist's membership
    full = dist.get_world_size()
    model = make_model()
    step, group_epoch = 0, 0
    back_at: int | None = None  # the step the job was whole again
    curve: list[tuple[int, int, float]] = []  # step, world size, mean loss
    events: list[tuple[int, str]] = []
    victim = full - 1
    if elastic.joined_late():  # a replacement: alone until it regroups with the others
        view = elastic.membership()
        elastic.regroup(view)
        group_epoch, victim = view.epoch, -1
        ddp, step, full = rejoin(model, step, full)
        back_at = step
    else:
        ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    # Past --steps until the replacement is in, and --after steps with it.
    while step < steps or (back_at is None and step < 20 * steps) or step < (back_at or 0) + after:
        rank = dist.get_rank()
        x, y = batch(rank, step)
        try:
            latest = torch.tensor([float(elastic.membership().epoch)])
            dist.all_reduce(latest, op=dist.ReduceOp.MAX)
            if latest.item() > group_epoch:
                raise _MembershipChanged
            if rank == victim and step == kill_at:  # dies in backward, its first bucket sent
                first: Any = model[0]  # type: ignore[index]
                first.weight.register_hook(lambda _: os.kill(os.getpid(), signal.SIGKILL))
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            try:
                loss.backward()  # type: ignore[no-untyped-call]
            except RuntimeError:
                dist.barrier()  # the group's own error if a rank failed (RankFailedError)
                raise
            opt.step()
            mean = loss.detach().reshape(1)
            dist.all_reduce(mean)
        except (aiodist.RankFailedError, _MembershipChanged):
            # One view at a time: every rank of the group, and a newcomer (which
            # regrouped over the view of its join), takes the same steps.
            view = elastic.membership(group_epoch + 1, timeout=60)
            elastic.regroup(view)  # torch's group is renumbered underneath
            group_epoch = view.epoch
            del ddp  # its reducer may be mid-step: a new one, from rank 0's parameters
            ddp, step, full = rejoin(model, step, full)
            n = dist.get_world_size()
            events.extend((step, f"rank {r} killed, {n} ranks go on") for r in view.left)
            events.extend((step, f"rank {r} joined, {n} ranks again") for r in view.joined)
            if view.joined and n == full:
                back_at = step
            continue
        curve.append((step, dist.get_world_size(), mean.item() / dist.get_world_size()))
        step += 1
        if dist.get_world_size() < full:
            time.sleep(0.05)  # pacing while the replacement starts
    if dist.get_rank() == 0:
        report(curve, events)
    elastic.destroy_process_group()


def rejoin(model: torch.nn.Module, step: int, full: int) -> tuple[Any, int, int]:
    """Wrap ``model`` for the new group; everyone takes rank 0's parameters and step."""
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters as it starts
    box: list[Any] = [step, full]
    dist.broadcast_object_list(box, src=0)  # a step in flight may have ended apart
    return ddp, int(box[0]), int(box[1])


def report(curve: list[tuple[int, int, float]], events: list[tuple[int, str]]) -> None:
    for step, event in events:
        print(f"event: step {step}: {event}")
    marks: dict[int, list[str]] = {}  # a replacement may join at the step of the kill
    for step, event in events:
        marks.setdefault(step, []).append(
            "a rank was killed here" if "killed" in event else "a rank joined here"
        )
    every = max(1, len(curve) // 20)
    for step, world, value in curve:
        if step % every == 0 or step in marks or step == curve[-1][0]:
            bar = "#" * min(60, round(value * 200))
            mark = f"  <- {', '.join(marks[step])}" if step in marks else ""
            print(f"step {step:3d}  world {world}  loss {value:9.6f}  {bar}{mark}")
    first, last = curve[0][2], curve[-1][2]
    print(
        f"elastic ddp: {len(curve)} steps, loss {first:.4f} -> {last:.4f}, "
        f"world {curve[0][1]} -> {curve[-1][1]}"
    )
    assert last < first / 2, "the loss did not fall"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--after", type=int, default=10, help="steps once the job is whole")
    args = parser.parse_args()
    main(args.steps, args.kill_at, args.lr, args.after)
