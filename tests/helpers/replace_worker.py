"""A rank of the ``--replace-failed`` tests (``test_elastic_replace.py``), one mode per argv[1].

Every process prints ``{"pid": ..., "rank": ..., "replacement": ...}`` first (the
test kills it by pid should it outlive the test). A replacement is a process
started without ``RANK`` (it joins the running job).

- ``late``: the last rank kills itself (SIGKILL) after the first barrier; the
  others wait ``$REPLACE_LINGER`` s (default 1) and end well; its replacement
  waits for the job to end (ranks 0 and 1 make ``$REPLACE_ENDED.<rank>`` once
  they left it) before it tries to join (the launcher stops it).
- ``startup``: a replacement exits 1 at once, before it joins; the last rank
  kills itself after the first barrier, the others wait for the test's end.
- ``all_die``: every rank kills itself after the first barrier.
- ``newcomer``: the last rank kills itself after the first barrier; the others
  wait for its replacement, which reports its rank and world size and then
  tries an ``all_reduce`` on the default group before any ``regroup``.

Ranks die only once every rank is past that barrier (the store says so).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

MODE = sys.argv[1]
REPLACEMENT = "RANK" not in os.environ
ENDED = os.environ.get("REPLACE_ENDED", "")  # late: the survivors' marks, once they left


def report(**fields: object) -> None:
    rank = int(os.environ.get("RANK", -1))
    line = {"pid": os.getpid(), "rank": rank, "replacement": REPLACEMENT, **fields}
    print(json.dumps(line), flush=True)


def main() -> None:
    report()
    if REPLACEMENT and MODE == "startup":
        sys.exit(1)
    if REPLACEMENT and MODE == "late":
        # Arrives after the job ended, however fast it started: the launcher must stop it.
        while not all(os.path.exists(f"{ENDED}.{rank}") for rank in (0, 1)):
            time.sleep(0.05)
    from aiodist import sync as dist

    dist.init_process_group()
    if REPLACEMENT:
        report(get_rank=dist.get_rank(), get_world_size=dist.get_world_size())
        if MODE == "newcomer":
            try:
                dist.all_reduce(torch.ones(1))
                report(all_reduce="ok")
            except Exception as exc:
                report(error=type(exc).__name__, message=str(exc))
        dist.destroy_process_group()
        return
    dist.barrier()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Ranks die only once every rank is past the barrier: one that left it and died at
    # once could fail a peer's barrier that had not read its message yet.
    store = dist.get_store()
    store.set(f"passed/{rank}", "1")
    store.wait([f"passed/{r}" for r in range(world)], timeout=60)
    if rank == world - 1 or MODE == "all_die":
        os.kill(os.getpid(), signal.SIGKILL)
    if MODE == "late":
        time.sleep(float(os.environ.get("REPLACE_LINGER", "1")))
        dist.destroy_process_group()
        open(f"{ENDED}.{os.environ['RANK']}", "w").close()  # a mark, empty
        return
    elif MODE == "newcomer":
        dist.membership(3, timeout=60)  # epochs: 1 the death, 2 the join, 3 its leave
    else:
        time.sleep(120)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
