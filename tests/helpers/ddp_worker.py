"""One rank of a plain torch DDP script, as users write it (``test_torch_backend.py``).

Usage: ``python tests/helpers/ddp_worker.py INIT [STEPS [KILL_AT]]`` under torchrun or
``aiodist run``.

INIT says how the job starts:

- ``gloo`` / ``aiodist``: ``torch.distributed.init_process_group(backend=INIT)``;
- ``default``: ``aiodist.sync.init_process_group()`` with no backend, then torch's
  code on the default group it brings up.

The script trains a small MLP with ``DistributedDataParallel(model)`` over a
``DistributedSampler`` for STEPS steps (a communication hook on the second
half: ``get_future().then``), and prints one JSON line: the rank, the backend
torch reports, the sampler's indices, the parameters after training (a hash
of their bytes) and what the hook saw.

With KILL_AT, the last rank kills itself (SIGKILL) inside DDP's backward of
that step, after its first bucket's all_reduce started; the others report the
error their ``backward()`` raised and how long it took.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def say(report: dict[str, Any]) -> None:
    # One write per line: the ranks share a pipe, and unbuffered, print() writes the
    # line and its newline apart, so that another rank's line may come between.
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


def main() -> int:
    init = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    torch.set_num_threads(1)
    if init == "default":
        import aiodist.sync

        aiodist.sync.init_process_group()
    else:
        if init == "aiodist":
            import aiodist  # registers the backend
        dist.init_process_group(backend=init)
    rank, world = dist.get_rank(), dist.get_world_size()
    say({"pid": os.getpid()})

    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 1, generator=gen))
    sampler: DistributedSampler[Any] = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    hooked: list[int] = []

    def hook(state, bucket):
        # As torch's allreduce_hook: divide, all_reduce, then the reduced bucket. (No
        # annotations: DDP checks them, and this module's are strings.)
        tensor = bucket.buffer().div_(dist.get_world_size())
        fut = dist.all_reduce(tensor, async_op=True).get_future()
        hooked.append(rank)
        return fut.then(lambda f: f.value()[0])

    losses = []
    batches = iter(loader)
    for step in range(steps):
        if step == steps // 2 and kill_at < 0:
            ddp.register_comm_hook(None, hook)
        if step == kill_at and rank == world - 1:
            # The first layer's gradient comes last in backward: its bucket's all_reduce
            # (the last layer's) is on its way when this rank dies.
            first: Any = model[0]
            first.weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        x, y = next(batches)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        began = time.monotonic()
        try:
            loss.backward()  # type: ignore[no-untyped-call]
        except Exception as exc:
            say(
                {
                    "rank": rank,
                    "step": step,
                    "error": type(exc).__name__,
                    "message": str(exc)[:2000],
                    "seconds": time.monotonic() - began,
                }
            )
            return 0
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    report = {
        "rank": rank,
        "world_size": world,
        "backend": str(dist.get_backend()),
        "indices": list(iter(sampler)),
        # Their exact bytes, hashed: a report stays one short line (ranks share a pipe).
        "params": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "hooked": len(hooked),
        "losses": losses,
    }
    say(report)
    if init == "default":
        import aiodist.sync

        aiodist.sync.destroy_process_group()
    else:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
