"""A process of the grow tests (``test_elastic_grow.py``): one JSON report line on stdout.

    python grow_worker.py URL ROLE MIN MAX TARGET

Roles:
    member    one of the MIN ranks the job forms with (rank assigned by the server).
    newcomer  joins the formed job: regroups with the members over its first view,
              receives the state by broadcast, then steps with them.
    late-newcomer  a newcomer that asks for its view only after a rank failed.
    dying     joins the formed job and kills itself (SIGKILL) once the next process
              joined, before it regroups.
    stranger  tries to join the formed job with a wrong token (AIODIST_TOKEN): it is
              refused before it can join, and reports the error.

Every rank runs the same loop: each step, an all_reduce(MAX) of [the latest epoch
this rank knows, rank 0's wish to stop] makes every rank agree on when to regroup
(over the view of the epoch after its group's, one epoch at a time) and when to
stop (rank 0: ten steps after the group reached TARGET ranks). After a regroup,
rank 0 broadcasts the state (a dict with a step count, and a tensor) to every rank
of the new group, newcomers included.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import anyio
import torch

import aiodist

HEARTBEAT_TIMEOUT = 2.0


def report(out: dict[str, Any]) -> None:
    print(json.dumps(out), flush=True)


def job_ranks() -> list[int]:
    group = aiodist.get_default_group()
    assert group is not None
    return list(group.ranks)


async def receive_state(state: dict[str, Any], w: torch.Tensor) -> dict[str, Any]:
    """Rank 0's state and tensor, on every rank of the (new) default group."""
    objs = [state if aiodist.get_rank() == 0 else None]
    await aiodist.broadcast_object_list(objs, src=0)
    await aiodist.broadcast(w, src=0)
    return dict(objs[0])  # type: ignore[arg-type]


async def main() -> None:
    url, role = sys.argv[1], sys.argv[2]
    lo, hi, target = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    if role == "stranger":
        os.environ["AIODIST_TOKEN"] = "not-the-token"
        try:
            await aiodist.init_process_group(
                init_method=url, world_size=lo, group_name="grow", max_world_size=hi, timeout=10
            )
        except aiodist.AuthenticationError as exc:
            report({"role": role, "refused": type(exc).__name__})
            return
        report({"role": role, "refused": None})
        return
    await aiodist.init_process_group(
        init_method=url,
        world_size=lo,
        group_name="grow",
        heartbeat_interval=0.1,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        max_world_size=hi,
    )
    if role == "late-newcomer":
        # Asks for its view only once a rank failed after its join: its own join's view
        # is still the one the members meet it at.
        async for view in aiodist.watch_membership():
            if view.left:
                break
        role = "newcomer"
    first = await aiodist.membership()
    out: dict[str, Any] = {
        "role": role,
        "pid": os.getpid(),
        "job_rank": job_ranks()[aiodist.get_rank()],
        "first_view": [first.epoch, list(first.ranks), list(first.joined)],
        "world_at_start": aiodist.get_world_size(),
    }
    if role == "dying":
        # Dies in the middle of the membership change: after the next process joined,
        # before it regrouped with anyone.
        await aiodist.membership(first.epoch + 1, timeout=30)
        report(out)
        os.kill(os.getpid(), signal.SIGKILL)
    state: dict[str, Any] = {"step": 0}
    w = torch.zeros(3)
    group_epoch = 0
    if role == "newcomer":
        await aiodist.regroup(first)
        group_epoch = first.epoch
        state = await receive_state(state, w)
        out["received"] = [state["step"], w.tolist()]
        out["joined_at"] = time.time()
    steps: list[list[float]] = []
    reached = None
    while True:
        view = await aiodist.membership()
        stop = float(
            aiodist.get_rank() == 0 and reached is not None and state["step"] >= reached + 10
        )
        agree = torch.tensor([float(view.epoch), stop])
        await aiodist.all_reduce(agree, op=aiodist.ReduceOp.MAX)
        if agree[1] > 0:
            break
        if agree[0] > group_epoch:
            # One epoch at a time: every rank of the group, and every newcomer (which
            # regrouped over the epoch of its join), takes the same steps.
            view = await aiodist.membership(group_epoch + 1, timeout=10)
            await aiodist.regroup(view)
            group_epoch = view.epoch
            state = await receive_state(state, w)
            out.setdefault("regroups", []).append([view.epoch, list(view.ranks)])
            continue
        t = torch.full((3,), float(aiodist.get_rank() + 1))
        await aiodist.all_reduce(t)
        w += t
        state["step"] += 1
        steps.append([state["step"], aiodist.get_world_size(), float(t[0])])
        if reached is None and aiodist.get_world_size() == target:
            reached = state["step"]
        await anyio.sleep(0.01)  # pacing: the newcomer joins while the members step
    out["rank"] = aiodist.get_rank()
    out["world"] = aiodist.get_world_size()
    out["group"] = job_ranks()  # the job's ranks of the default group
    out["steps"] = steps
    out["w"] = w.tolist()
    out["step"] = state["step"]
    report(out)
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main)
