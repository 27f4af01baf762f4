"""Master-worker mode, the original torch.distributed design's example in aiodist's names.

    aiodist run -n 3 examples/master_worker.py

Rank 0 is the master; ranks 1 and 2 hold its tensors and run its operations.
"""

from __future__ import annotations

import anyio
import torch

import aiodist
from aiodist import remote


async def main() -> None:
    if not await aiodist.init_master_worker():
        return  # a worker: it served the master until the master left
    x = remote.FloatTensor(20, 20).fill_(4)  # lives on worker 1
    y = remote.send(torch.randn(20, 20))  # copied to worker 1
    z = x + y  # runs there, at once: the master does not wait
    print(f"z lives on worker {z.get_node()}, device {z.get_device()}, shape {tuple(z.shape)}")
    if torch.cuda.is_available():
        z = z.cuda()  # moved to worker 1's GPU, there
    with remote.node(2):
        a = remote.FloatTensor(10).fill_(1)  # lives on worker 2
    b = (a * 2).sum() + z.mean()  # runs on worker 2: z's mean comes from worker 1 directly
    got = await z.fetch()  # the one kind of wait: a copy to the master
    print(f"z fetched: {tuple(got.shape)}, mean {got.mean():.4f}")
    print(f"b = 2 * 10 + mean(z) = {(await b.fetch()).item():.4f} (on worker {b.get_node()})")
    await aiodist.destroy_process_group()  # the workers stop and leave too


if __name__ == "__main__":
    anyio.run(main)
