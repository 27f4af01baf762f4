"""A failing rank under torch.multiprocessing or multiprocessing, run by test_rpc.py.

Usage: ``python tests/helpers/rpc_exit_worker.py LAUNCHER PORT`` with LAUNCHER
``spawn`` (``torch.multiprocessing.spawn``, which turns the exception into
``sys.exit(1)``) or ``process`` (two ``multiprocessing.Process``es, fork). Two
workers in an rpc world of their own: rank 0, which hosts the rendezvous
server, raises after a first call; rank 1 is in ``rpc.shutdown()``. The parent
prints one JSON line: how long until it learnt of the failure, and what.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from typing import Any

from torch.multiprocessing.spawn import spawn

import aiodist.rpc as rpc


def ping() -> str:
    return "pong"


def work(rank: int, world: int, port: int, queue: Any = None) -> None:
    rpc.init_rpc(
        f"w{rank}",
        rank=rank,
        world_size=world,
        rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}"),
    )
    if rank == 0:
        rpc.rpc_sync("w1", ping)
        raise ValueError(f"rank 0 broke at {time.time()!r}")
    t0 = time.monotonic()
    try:
        rpc.shutdown()
        outcome = "ok"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    if queue is not None:
        queue.put({"shutdown": outcome, "shutdown_s": time.monotonic() - t0})


def _raised_at(message: str) -> float:
    return float(message.rsplit("broke at ", 1)[1].split()[0])


def main(launcher: str, port: int) -> None:
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    if launcher == "spawn":
        try:
            spawn(work, args=(2, port), nprocs=2, join=True)  # type: ignore[no-untyped-call]
        except Exception as exc:
            out["raised"] = f"{type(exc).__name__}: {exc}"
            out["reported_after_s"] = time.time() - _raised_at(str(exc))
        out["elapsed_s"] = time.monotonic() - t0
    else:
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        procs = [ctx.Process(target=work, args=(r, 2, port, queue)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        out["elapsed_s"] = time.monotonic() - t0
        out["exitcodes"] = [p.exitcode for p in procs]
        out["rank1"] = queue.get(timeout=5) if not queue.empty() else None
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("AIODIST_HEARTBEAT_TIMEOUT", "10")
    main(sys.argv[1], int(sys.argv[2]))
