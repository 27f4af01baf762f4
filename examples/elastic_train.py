"""Data-parallel SGD that goes on when a worker dies, and takes in its replacement.

    aiodist run -n 4 examples/elastic_train.py
    aiodist run -n 4 --replace-failed examples/elastic_train.py --kill --expect-replacement

Every rank fits the same linear model to its own shard of data; gradients are
averaged with an all_reduce over the current default group. At ``--fail-at``
the last rank goes away: it leaves before the step (preempted; under
``aiodist run``, which stops every rank once one fails), or with ``--kill``
it kills itself with SIGKILL in the middle of the step's all_reduce, as the
OOM killer would (``tests/test_elastic_examples.py`` runs it so). The
survivors see ``RankFailedError`` naming it, agree on a smaller default group
over the job's next membership view (``regroup``), redo that step's
all_reduce over it, and train on.

With ``--expect-replacement`` (under ``aiodist run --replace-failed``, which starts a
replacement for the killed rank), the replacement joins the running job with
the next free rank: every step, the ranks agree on the latest membership epoch
any of them has seen (an all_reduce with MAX), and once it is past their
group's, all of them, the replacement included, regroup over the next view
and rank 0 broadcasts the parameters and the step to everyone. The survivors
train on until the replacement is in. Rank 0 prints the loss curve with the
failure and the join marked, and checks that training converged.
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


class _MembershipChanged(Exception):
    """Some rank saw a membership view past the group's: regroup before the step."""


async def main(steps: int, fail_at: int, kill: bool, lr: float, replace: bool) -> None:
    await aiodist.init_process_group()
    full = aiodist.get_world_size()
    w = torch.zeros(len(TRUE_W))
    curve: list[tuple[int, int, float]] = []  # step, world size, mean loss
    events: list[tuple[int, str]] = []
    step, group_epoch = 0, 0
    if aiodist.joined_late():  # a replacement: outside the default group until it regroups
        view = await aiodist.membership()
        await aiodist.regroup(view)
        group_epoch = view.epoch
        box: list[object] = [w, step]
        await aiodist.broadcast_object_list(box, src=0)  # the parameters, from rank 0
        w, step = box[0], box[1]  # type: ignore[assignment]
        full = aiodist.get_world_size()  # the group it joined is at full size again
    rank = aiodist.get_rank()
    victim = -1 if aiodist.joined_late() else full - 1  # a replacement is past its step
    x, y = shard(rank)
    back_at = step if aiodist.joined_late() else None  # the step the job is whole again
    while step < steps or (replace and (back_at is None or step < back_at + 20)):
        err = x @ w - y
        # The gradient and the loss in one all_reduce: one collective per step.
        packed = torch.cat([2 * x.T @ err / len(y), err.pow(2).mean().reshape(1)])
        try:
            if replace:  # every rank learns the latest epoch any rank has seen
                latest = torch.tensor([float((await aiodist.membership()).epoch)])
                await aiodist.all_reduce(latest, op=aiodist.ReduceOp.MAX)
                if latest.item() > group_epoch:
                    raise _MembershipChanged
            if rank == victim and step == fail_at:
                if kill:
                    aiodist.all_reduce(packed)  # its part is on its way...
                    await anyio.lowlevel.checkpoint()
                    os.kill(os.getpid(), signal.SIGKILL)  # ...and it dies mid-step
                await aiodist.destroy_process_group()  # or it leaves, as on preemption
                return
            await aiodist.all_reduce(packed)
        except (aiodist.RankFailedError, _MembershipChanged):  # every survivor hears it
            # One view at a time: every rank of the group, and a newcomer (which
            # regrouped over the view of its join), takes the same steps.
            view = await aiodist.membership(group_epoch + 1, timeout=60)
            await aiodist.regroup(view)  # every rank of the view gets the same group
            group_epoch = view.epoch
            # A step in flight may have completed on some survivors and not on others;
            # a newcomer has nothing yet: go on from rank 0's parameters and step.
            box = [w, step]
            await aiodist.broadcast_object_list(box, src=0)
            w, step = box[0], box[1]  # type: ignore[assignment]
            n = aiodist.get_world_size()
            events.extend((step, f"rank {r} gone, shrank to {n} ranks") for r in view.left)
            events.extend((step, f"rank {r} joined, grew to {n} ranks") for r in view.joined)
            if view.joined and n == full:
                back_at = step
            continue
        packed /= aiodist.get_world_size()
        w -= lr * packed[:-1]
        curve.append((step, aiodist.get_world_size(), packed[-1].item()))
        step += 1
        if replace and aiodist.get_world_size() < full:
            await anyio.sleep(0.01)  # pacing while the replacement starts
    if aiodist.get_rank() == 0:
        report(curve, events, w)
    await aiodist.destroy_process_group()


def report(
    curve: list[tuple[int, int, float]], events: list[tuple[int, str]], w: torch.Tensor
) -> None:
    for step, event in events:
        print(f"event: step {step}: {event}")
    marks: dict[int, list[str]] = {}  # a newcomer may join at the step of a failure
    for step, event in events:
        marks.setdefault(step, []).append(
            "a rank joined here" if "joined" in event else "a rank failed here"
        )
    every = max(1, len(curve) // 24)
    for step, world, value in curve:
        if step % every == 0 or step in marks or step - 1 in marks or step == curve[-1][0]:
            bar = "#" * min(60, round(value * 4))
            mark = f"  <- {', '.join(marks[step])}" if step in marks else ""
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
    parser.add_argument(
        "--expect-replacement",
        action="store_true",
        help="take in a replacement (aiodist run --replace-failed)",
    )
    args = parser.parse_args()
    anyio.run(main, args.steps, args.fail_at, args.kill, args.lr, args.expect_replacement)
