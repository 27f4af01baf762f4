"""A rank for the launch-path tests, started by torchrun, `aiodist run` or a test itself.

    python tests/helpers/launch_worker.py MODES [BEHAVIOUR]

MODES is a comma-separated list; rank r joins the way ``MODES[r % len(MODES)]``
says, with no arguments, as a script written for torchrun does:

- ``async``: ``await aiodist.init_process_group()``
- ``sync``: ``aiodist.sync.init_process_group()``
- ``init_dist``: ``await aiodist.init_dist("pytorch")``
- ``url``: ``await aiodist.init_process_group(init_method=$TEST_INIT_METHOD)``, rank and
  world size from ``RANK`` and ``WORLD_SIZE``

BEHAVIOUR:

- ``ok`` (default): gather ``[rank, mode, host]`` from every rank and report.
- ``fail``: rank 1 dies (``os._exit(3)``) once the job formed; the others report
  the error their gather raised, and how long it took.
- ``fail-once``: as ``fail`` in the first start (``TORCHELASTIC_RESTART_COUNT=0``),
  ``ok`` in the next.
- ``gate``: as ``ok``, but rank 0 first connects to the Unix socket ``$TEST_GATE``
  and waits for one byte (the test's word that it has looked at the running job).

Each process prints ``{"pid": ...}`` first (so a test can kill what outlives it),
then one JSON report.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

import anyio

import aiodist


def report(**fields: Any) -> None:
    # One write: ranks share torchrun's stdout, and a write below PIPE_BUF is never split.
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def gate() -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(os.environ["TEST_GATE"])
        sock.recv(1)


def main() -> int:
    modes = sys.argv[1].split(",")
    behaviour = sys.argv[2] if len(sys.argv) > 2 else "ok"
    rank = int(os.environ["RANK"])
    mode = modes[rank % len(modes)]
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    report(pid=os.getpid())
    if behaviour == "fail-once":
        behaviour = "fail" if generation == 0 else "ok"
    me = [rank, mode, socket.gethostname()]
    fields = {"rank": rank, "mode": mode, "generation": generation, "pid": os.getpid()}
    if mode == "sync":
        import aiodist.sync as dist

        dist.init_process_group()
        fields["world_size"] = dist.get_world_size()
        if behaviour == "gate" and rank == 0:
            gate()
        if behaviour == "fail" and rank == 1:
            os._exit(3)
        started = time.monotonic()
        try:
            fields["gathered"] = dist.all_gather_object(me)
        except aiodist.DistError as exc:
            return _failed(fields, exc, started)
        dist.destroy_process_group()
        report(**fields)
        return 0
    return int(anyio.run(_async_main, mode, behaviour, me, fields))


async def _async_main(mode: str, behaviour: str, me: list[Any], fields: dict[str, Any]) -> int:
    if mode == "async":
        await aiodist.init_process_group()
    elif mode == "init_dist":
        await aiodist.init_dist("pytorch")
    else:
        assert mode == "url", mode
        await aiodist.init_process_group(
            init_method=os.environ["TEST_INIT_METHOD"],
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    rank = aiodist.get_rank()
    fields["world_size"] = aiodist.get_world_size()
    if behaviour == "gate" and rank == 0:
        await anyio.to_thread.run_sync(gate)
    if behaviour == "fail" and rank == 1:
        os._exit(3)
    started = time.monotonic()
    try:
        fields["gathered"] = await aiodist.all_gather_object(me)
    except aiodist.DistError as exc:
        return _failed(fields, exc, started)
    await aiodist.destroy_process_group()
    report(**fields)
    return 0


def _failed(fields: dict[str, Any], exc: aiodist.DistError, started: float) -> int:
    report(
        **fields,
        error=type(exc).__name__,
        failed_rank=getattr(exc, "rank", None),
        message=str(exc),
        seconds=time.monotonic() - started,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
