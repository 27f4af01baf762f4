"""Master-worker mode: the master keeps every worker busy and fetches only the results.

    aiodist run -n 3 examples/master_worker_pipeline.py

Each worker gets its own batches of a small MLP's forward pass, issued without
waiting; the master reads back one number per batch, and overlaps its own
work (here: preparing the next batches) with theirs.
"""

from __future__ import annotations

import anyio
import torch

import aiodist
from aiodist import remote

BATCHES, SIZE = 24, 256


async def main() -> None:
    if not await aiodist.init_master_worker():
        return
    workers = list(range(1, aiodist.get_world_size()))
    torch.manual_seed(0)
    w1, w2 = torch.randn(SIZE, SIZE) / SIZE**0.5, torch.randn(SIZE, 1) / SIZE**0.5
    # The weights go to each worker once; the batches one by one.
    weights = {n: (remote.send(w1, node=n), remote.send(w2, node=n)) for n in workers}
    scores, batches = [], []
    for i in range(BATCHES):
        n = workers[i % len(workers)]
        batch = torch.randn(64, SIZE)  # the master's own work, beside the workers'
        batches.append(batch)
        h1, h2 = weights[n]
        hidden = torch.relu(remote.send(batch, node=n) @ h1)
        scores.append((hidden @ h2).mean())  # issued, not waited for
    busy = await remote.held_tensors()  # a sync point too: every worker ran its batches
    got = [(await s.fetch()).item() for s in scores]  # the only waits for values
    expected = [(torch.relu(b @ w1) @ w2).mean().item() for b in batches]
    assert all(abs(g - e) < 1e-4 for g, e in zip(got, expected, strict=True)), (got, expected)
    print(
        f"{BATCHES} batches issued to workers {workers} without waiting; tensors held there: {busy}"
    )
    print(f"first scores: {', '.join(f'{g:.4f}' for g in got[:4])} (as computed here)")
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main)
