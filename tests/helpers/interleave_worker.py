"""One rank of a job that interleaves p2p, refused collectives and good ones at random.

Usage: ``aiodist run -n 3 tests/helpers/interleave_worker.py SEED STEPS``. Every rank
draws the same schedule from ``SEED``; each step is one of:

- ``p2p``: rank ``a`` starts ``isend`` (or ``isend_object``) of a value unique to
  the step to rank ``b``, which starts the matching receive. Neither waits: the
  handles pile up across the steps that follow, refused collectives included.
- ``refused``: every rank calls ``all_gather`` (or ``all_gather_object``) and
  one rank's call fails its own checks (a wrong output list, an object that
  cannot be pickled), so it aborts the call on every rank.
- ``good``: ``all_reduce`` of values known in advance, checked at once.
- ``drain``: wait for every pending point-to-point handle and check its value.

The last line printed is a JSON report: operations started, values checked,
wrong values (each described) and unexpected errors.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
from typing import Any

import torch

import aiodist
from aiodist import AbortedError

UNPICKLABLE = threading.Lock()


async def main() -> None:
    seed, steps = int(sys.argv[1]), int(sys.argv[2])
    await aiodist.init_process_group()
    rank, world = aiodist.get_rank(), aiodist.get_world_size()
    rng = random.Random(seed)  # the same draws on every rank
    pending: list[tuple[Any, Any, Any, str]] = []  # (work, expected, read(), what)
    refused: list[tuple[Any, int, str]] = []  # (work, the rank that refused it, what)
    ops = checked = 0
    wrong: list[str] = []
    errors: list[str] = []

    async def drain() -> None:
        nonlocal checked
        for work, bad, what in refused:
            try:
                await work
                errors.append(f"{what}: succeeded on rank {rank}")
            except AbortedError as exc:
                checked += 1
                if exc.rank != bad:
                    errors.append(f"{what}: AbortedError names rank {exc.rank}, not {bad}")
        refused.clear()
        for work, expected, read, what in pending:
            try:
                got = await work
            except Exception as exc:
                errors.append(f"{what}: {type(exc).__name__}: {exc}")
                continue
            value = read(got)
            checked += 1
            if value != expected:
                wrong.append(f"{what}: got {value!r}, expected {expected!r}")
        pending.clear()

    w: Any
    for step in range(steps):
        kind = rng.choices(["p2p", "refused", "good", "drain"], [6, 2, 2, 1])[0]
        if kind == "p2p":
            a, b = rng.sample(range(world), 2)
            tag = rng.randrange(3)
            objects = rng.random() < 0.3
            value = float(step)
            what = f"step {step} {'object' if objects else 'tensor'} {a}->{b} tag {tag}"
            if rank == a:
                ops += 1
                if objects:
                    w = aiodist.isend_object({"step": step}, dst=b, tag=tag)
                    pending.append((w, None, lambda _: None, what + " (send)"))
                else:
                    w = aiodist.isend(torch.full((4,), value), dst=b, tag=tag)
                    pending.append((w, None, lambda _: None, what + " (send)"))
            elif rank == b:
                ops += 1
                if objects:
                    w = aiodist.irecv_object(src=a, tag=tag)
                    pending.append((w, {"step": step}, lambda got: got, what))
                else:
                    buf = torch.zeros(4)
                    w = aiodist.irecv(buf, src=a, tag=tag)
                    pending.append((w, [value] * 4, lambda _got, buf=buf: buf.tolist(), what))
        elif kind == "refused":
            # Started, not awaited: the p2p calls of the next steps start while it runs.
            bad = rng.randrange(world)
            objects = rng.random() < 0.5
            ops += 1
            what = f"step {step} refused {'all_gather_object' if objects else 'all_gather'}"
            try:
                if objects:
                    w = aiodist.all_gather_object(UNPICKLABLE if rank == bad else step)
                else:
                    size = world + 1 if rank == bad else world
                    outs = [torch.zeros(2) for _ in range(size)]
                    w = aiodist.all_gather(outs, torch.full((2,), float(rank)))
            except (ValueError, TypeError) as exc:
                checked += 1
                if rank != bad:
                    errors.append(f"{what}: {type(exc).__name__} on a good rank: {exc}")
            else:
                if rank == bad:
                    errors.append(f"{what}: the bad rank's call did not fail at once")
                refused.append((w, bad, what))
        elif kind == "good":
            ops += 1
            t = torch.full((3,), float(rank + step))
            await aiodist.all_reduce(t)
            expected = [float(sum(range(world)) + world * step)] * 3
            checked += 1
            if t.tolist() != expected:
                wrong.append(f"step {step} all_reduce: got {t.tolist()}, expected {expected}")
        else:
            await drain()
    await drain()
    await aiodist.barrier()
    report = {"rank": rank, "ops": ops, "checked": checked, "wrong": wrong, "errors": errors}
    print(json.dumps(report), flush=True)
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    asyncio.run(main())
