"""``aiodist run``: host the rendezvous server, start N ranks, supervise them.

Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) so that
``init_process_group()`` with no arguments just works. Output lines are prefixed
with the rank. When one rank fails, the others are stopped and the launcher
exits with the failed rank's code.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from typing import Final

import anyio

from aiodist._server.serve import serve_rendezvous

__all__ = ["launch"]

STOP_GRACE: Final = 5.0


async def _pump(stream: asyncio.StreamReader, prefix: str) -> None:
    out = sys.stdout
    while line := await stream.readline():
        out.write(prefix + line.decode(errors="replace"))
        out.flush()


async def launch(
    cmd: list[str],
    *,
    nproc: int,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    prefix: bool = True,
) -> int:
    """Run ``cmd`` as ``nproc`` ranks; return 0, or the exit code of the first rank that failed."""
    if nproc < 1:
        print(f"aiodist run: -n must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    async with anyio.create_task_group() as tg:
        server = await tg.start(serve_rendezvous, master_addr, master_port)
        job_id = f"run-{uuid.uuid4().hex[:12]}"
        procs: list[asyncio.subprocess.Process] = []
        width = len(str(nproc - 1))
        for rank in range(nproc):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                MASTER_ADDR=server.address[0],
                MASTER_PORT=str(server.address[1]),
                AIODIST_JOB_ID=job_id,
                PYTHONUNBUFFERED="1",
            )
            proc = await asyncio.create_subprocess_exec(
                *cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            procs.append(proc)
            assert proc.stdout is not None
            tg.start_soon(_pump, proc.stdout, f"[rank {rank:>{width}}] " if prefix else "")

        def forward(sig: int) -> None:
            for p in procs:
                if p.returncode is None:
                    p.send_signal(sig)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, forward, sig)
        try:
            failed = await _supervise(procs)
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await _stop_all(procs)
        tg.cancel_scope.cancel()
    if failed is None:
        return 0
    rank, code = failed
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    print(
        f"aiodist run: rank {rank} (pid {procs[rank].pid}) {how}; stopped the other "
        f"{nproc - 1} ranks",
        file=sys.stderr,
    )
    return 128 - code if code < 0 else code


async def _supervise(procs: list[asyncio.subprocess.Process]) -> tuple[int, int] | None:
    pending = {asyncio.ensure_future(p.wait()): rank for rank, p in enumerate(procs)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                rank = pending.pop(fut)
                if fut.result() != 0:
                    return rank, fut.result()
        return None
    finally:
        for fut in pending:
            fut.cancel()


async def _stop_all(procs: list[asyncio.subprocess.Process]) -> None:
    for p in procs:
        if p.returncode is None:
            p.terminate()
    with anyio.move_on_after(STOP_GRACE):
        for p in procs:
            await p.wait()
    for p in procs:
        if p.returncode is None:
            p.kill()
            await p.wait()
