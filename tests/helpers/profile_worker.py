"""One rank of a profiled script: ``profile_worker.py aiodist|torch [--kineto]``.

torchrun's variables say where the job meets. It makes torch.distributed's
calls (``dist`` is ``aiodist.sync`` or ``torch.distributed``, gloo) under
torch's autograd profiler (``--kineto``: ``torch.profiler``) and prints, as
its last line, the communication events recorded on this thread: name,
whether asynchronous, count and input shapes, in the order they started. (Not
``reduce_scatter``: gloo has none, and torch records the all_reduce it runs
instead.)
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import Any

import torch

if sys.argv[1] == "aiodist":
    import aiodist.sync as dist
else:
    import torch.distributed as dist  # type: ignore[no-redef]


def calls(rank: int) -> None:
    t = torch.ones(2, 3)
    dist.all_reduce(t)
    dist.all_reduce(torch.ones(4, dtype=torch.complex64))
    dist.broadcast(torch.ones(5), src=0)
    dist.reduce(torch.ones(6), dst=0)
    dist.all_gather([torch.zeros(3) for _ in range(2)], torch.ones(3))
    dist.all_gather_into_tensor(torch.zeros(8), torch.ones(4))
    dist.all_reduce_coalesced([torch.ones(2), torch.ones(3, 3)])
    dist.all_to_all_single(torch.zeros(4), torch.ones(4))
    dist.all_to_all([torch.zeros(2), torch.zeros(2)], [torch.ones(2), torch.ones(2)])
    dist.gather(torch.ones(3), [torch.zeros(3), torch.zeros(3)] if rank == 0 else None, dst=0)
    dist.scatter(torch.zeros(2), [torch.ones(2), torch.ones(2)] if rank == 0 else None, src=0)
    work = dist.all_reduce(torch.ones(7), async_op=True)
    work.wait()
    peer = 1 - rank
    if rank == 0:
        dist.send(torch.ones(3), dst=peer)
        dist.recv(torch.zeros(3, 2), src=peer)
        dist.isend(torch.ones(9), dst=peer).wait()
    else:
        dist.recv(torch.zeros(3), src=peer)
        dist.send(torch.ones(3, 2), dst=peer)
        dist.irecv(torch.zeros(9)).wait()  # from any rank
    dist.barrier()


def events(recorded: list[Any]) -> list[list[Any]]:
    mine = [e for e in recorded if e.name.startswith("gloo:")]
    mine.sort(key=lambda e: e.time_range.start)
    return [[e.name, e.is_async, e.count, e.input_shapes] for e in mine]


def main() -> None:
    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    # torch.profiler.profile records through the same callbacks, but its first use
    # costs seconds of CPU: the suite runs the autograd profiler only.
    prof: Any
    if "--kineto" in sys.argv:
        with torch.profiler.profile(record_shapes=True) as prof:
            calls(rank)
        recorded = prof.events()
    else:
        with torch.autograd.profiler.profile(record_shapes=True) as prof:
            calls(rank)
        recorded = prof.function_events
    dist.destroy_process_group()
    print(json.dumps(events(list(recorded))), flush=True)


if __name__ == "__main__":
    main()
