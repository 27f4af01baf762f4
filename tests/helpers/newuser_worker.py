"""A rank of the new-user failure tests (``test_new_user.py``): one mode per argv[1].

Every rank prints ``{"pid": ..., "rank": ...}`` first (the test kills it by pid
should it outlive the test), then runs its mode:

- ``hang``: rank 0 awaits an ``all_reduce`` that rank 1 never joins; rank 1 sleeps.
  The test sends SIGINT to rank 0 alone.
- ``crash``: rank 1 raises an uncaught ``ValueError``; rank 0 awaits an ``all_reduce``.
- ``exit1``: rank 1 calls ``sys.exit(1)``; rank 0 awaits an ``all_reduce``.
- ``sync_crash``: as ``crash``, on ``aiodist.sync``.
- ``plain_exit``: plain code on ``aiodist.sync``: the last rank calls ``sys.exit(3)``
  at module level (where no exit handler can see the code) while the others await an
  ``all_reduce``.
- ``ddp``: plain torch training code on ``aiodist.sync`` with no backend: DDP and
  ``DistributedSampler`` need torch's default group; reports what they saw.
- ``seed``: mmengine's own ``test_sync_random_seed`` on ``aiodist.sync``: with
  ``torch.tensor`` patched to return 1024, the seed is 1024 and torch.tensor was called.
- ``gloo_extra`` / ``gloo_shape``: with ``backend="gloo"``, rank 0 calls an extra
  ``all_reduce`` before a ``barrier`` / the ranks' tensors differ in shape; reports
  what each rank got.
- ``torch_extra`` / ``torch_shape``: the same in a plain torch script
  (``torch.distributed.init_process_group()``, torch's own calls) on the aiodist
  backend, with no setting.
- ``join``: only joins (``timeout`` from ``$NEWUSER_TIMEOUT``); reports the error and
  how long it took.

argv: MODE [INIT_METHOD RANK WORLD]; without an init method, env:// (``aiodist run``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch

import aiodist

MODE = sys.argv[1]
KWARGS: dict[str, Any] = {}
if len(sys.argv) > 2:
    KWARGS = {"init_method": sys.argv[2], "rank": int(sys.argv[3]), "world_size": int(sys.argv[4])}
RANK = int(os.environ.get("RANK", KWARGS.get("rank", -1)))


def report(**fields: object) -> None:
    print(json.dumps({"pid": os.getpid(), "rank": RANK, **fields}), flush=True)


async def join() -> None:
    t0 = time.monotonic()
    try:
        await aiodist.init_process_group(**KWARGS, timeout=float(os.environ["NEWUSER_TIMEOUT"]))
    except Exception as exc:
        report(error=type(exc).__name__, message=str(exc), after=time.monotonic() - t0)
        return
    report(joined=True)
    await aiodist.destroy_process_group()


async def main() -> None:
    await aiodist.init_process_group(**KWARGS)
    rank = aiodist.get_rank()
    await aiodist.barrier()
    report(ready=True)
    if rank == 1:
        if MODE == "crash":
            raise ValueError("boom in rank 1")
        if MODE == "exit1":
            sys.exit(1)
        await asyncio.sleep(300)
        return
    t0 = time.monotonic()
    try:
        await aiodist.all_reduce(torch.ones(2))
    except BaseException as exc:
        report(error=type(exc).__name__, message=str(exc), after=time.monotonic() - t0)
        raise


def sync_main() -> None:
    from aiodist import sync as dist

    dist.init_process_group(**KWARGS)
    rank = dist.get_rank()
    dist.barrier()
    report(ready=True)
    if rank == 1:
        raise ValueError("boom in rank 1")
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2))
    except BaseException as exc:
        report(error=type(exc).__name__, message=str(exc), after=time.monotonic() - t0)
        raise


def plain_exit_main() -> None:
    from aiodist import sync as dist

    dist.init_process_group()
    dist.barrier()
    report(ready=True)
    if dist.get_rank() == dist.get_world_size() - 1:
        sys.exit(3)
    dist.all_reduce(torch.ones(2))


def ddp_main() -> None:
    import torch.distributed
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.distributed import DistributedSampler

    from aiodist import sync as dist

    dist.init_process_group()  # no backend, as torch scripts do
    up = torch.distributed.is_initialized()
    out: dict[str, object] = {"torch_initialized": up}
    if up:
        rank = dist.get_rank()
        out["torch_backend"] = torch.distributed.get_backend()
        model = DistributedDataParallel(torch.nn.Linear(2, 1, bias=False))
        with torch.no_grad():
            model.module.weight.fill_(1.0)
        model(torch.full((1, 2), float(rank + 1))).sum().backward()
        out["grad"] = model.module.weight.grad.tolist()  # averaged over ranks by DDP
        data: Any = list(range(6))
        out["indices"] = list(DistributedSampler(data, shuffle=False))
    t = torch.ones(2)
    dist.all_reduce(t)  # aiodist's own call still works (on its data plane)
    out["all_reduce"] = t.tolist()
    report(**out)
    dist.destroy_process_group()
    report(torch_after_destroy=torch.distributed.is_initialized())


def seed_main() -> None:
    from unittest.mock import patch

    from aiodist import sync as dist

    dist.init_process_group()
    with patch.object(torch, "tensor", return_value=torch.tensor(1024)) as patched:
        seed = dist.sync_random_seed()
    report(seed=seed, called=patched.called)
    dist.destroy_process_group()


async def gloo_main() -> None:
    await aiodist.init_process_group(backend="gloo", timeout=20)
    rank = aiodist.get_rank()
    t0 = time.monotonic()
    try:
        if MODE == "gloo_extra":
            if rank == 0:
                await aiodist.all_reduce(torch.ones(2))
            await aiodist.barrier()
        else:
            await aiodist.all_reduce(torch.ones(2 + rank))
        report(ok=True, after=time.monotonic() - t0)
    except aiodist.DistError as exc:
        fields = getattr(exc, "values_by_rank", None)
        report(
            error=type(exc).__name__,
            message=str(exc),
            after=time.monotonic() - t0,
            field=getattr(exc, "field", None),
            values=repr(fields),
        )
    await aiodist.destroy_process_group()


def torch_main() -> None:
    import torch.distributed as dist

    dist.init_process_group(backend="aiodist", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    t0 = time.monotonic()
    try:
        if MODE == "torch_extra":
            if rank == 0:
                dist.all_reduce(torch.ones(2))
            dist.barrier()
        else:
            dist.all_reduce(torch.ones(2 + rank))
        report(ok=True, after=time.monotonic() - t0)
    except aiodist.DistError as exc:
        report(
            error=type(exc).__name__,
            message=str(exc),
            after=time.monotonic() - t0,
            field=getattr(exc, "field", None),
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    if MODE.startswith("sync_"):
        sync_main()
    elif MODE.startswith("gloo_"):
        asyncio.run(gloo_main())
    elif MODE.startswith("torch_"):
        torch_main()
    elif MODE == "plain_exit":
        plain_exit_main()
    elif MODE == "seed":
        seed_main()
    elif MODE == "ddp":
        ddp_main()
    elif MODE == "join":
        asyncio.run(join())
    else:
        asyncio.run(main())
