"""Rank 0 hosts the server and blocks its loop; rank 2 dies right after (``test_faults.py``).

Rank 0's loop stands still longer than ``STALL_GAP`` (a blocking call), so the
server it hosts stood still too and counts a connection lost right after as
reconnecting. Rank 0 then tells rank 2 to die and sends to it. Each rank prints
one JSON line: rank 0 what the send raised and whether point-to-point with
rank 1 still works.
"""

from __future__ import annotations

import json
import os
import sys
import time

import anyio
import torch

import aiodist
from aiodist._wire.timing import STALL_GAP


async def main() -> None:
    await aiodist.init_process_group(timeout=60)
    rank = aiodist.get_rank()
    await aiodist.barrier()
    if rank == 2:
        await aiodist.recv(torch.zeros(1), 0)  # the word to die
        os._exit(9)
    if rank == 1:
        got = torch.zeros(1)
        await aiodist.recv(got, 0)
        await aiodist.send(got + 1, 0)
        print(json.dumps({"rank": 1, "got": got.item()}), flush=True)
        return
    t0 = time.monotonic()
    time.sleep(STALL_GAP + 0.5)  # noqa: ASYNC251 - this loop (and the server's) stands still
    await aiodist.send(torch.zeros(1), 2)  # rank 2 dies on it
    error = ""
    try:
        for _ in range(1000):  # until the send finds it gone
            await aiodist.send(torch.zeros(1), 2)
            await anyio.sleep(0.01)
    except aiodist.DistError as exc:
        error = f"{type(exc).__name__}: {exc}"
    await aiodist.send(torch.full((1,), 41.0), 1)
    back = torch.zeros(1)
    await aiodist.recv(back, 1)
    took = time.monotonic() - t0
    print(json.dumps({"rank": 0, "error": error, "back": back.item(), "s": took}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # rank 2 is gone: leaving is not what this checks


anyio.run(main)
