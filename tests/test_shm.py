"""Same-host shared memory: agreement between ranks, segment hygiene, the ring channel.

Multi-process tests run real ranks as subprocesses against the test's own
rendezvous server (the ``server`` fixture), so each rank has its own
environment (``AIODIST_SHM``) and can really die.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from aiodist._transport import shm

if TYPE_CHECKING:
    from pathlib import Path

    from aiodist import RendezvousServer

needs_shm = pytest.mark.skipif(not shm.available(), reason="needs Linux and a writable /dev/shm")
# Subprocess ranks run their own loops: the test's loop only waits, so one backend will do.
one_backend = pytest.mark.parametrize("anyio_backend", ["asyncio"])

MIXED_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import anyio, torch
    import aiodist
    from aiodist._world import get_default_group

    async def main() -> None:
        url, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        await aiodist.init_process_group(init_method=url, world_size=world, rank=rank,
                                         group_name="mixed", timeout=30)
        t = torch.arange(1 << 20, dtype=torch.float32) * (rank + 1)    # 4 MiB
        await aiodist.all_reduce(t)
        b = torch.full((1 << 19,), float(rank))                         # 2 MiB
        await aiodist.broadcast(b, src=1)
        plane = get_default_group().session.plane
        expected = torch.arange(1 << 20, dtype=torch.float32) * (world * (world + 1) / 2)
        out = {"rank": rank, "all_reduce_ok": bool(torch.equal(t, expected)),
               "broadcast_ok": bool(torch.all(b == 1.0)),
               "agreed": plane.shm_agreement.get(0)}
        await aiodist.destroy_process_group()
        print(json.dumps(out), flush=True)

    anyio.run(main)
    """
)


async def _run_worker(script: Path, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    result = await anyio.run_process(
        [sys.executable, str(script), *args], check=False, env={**os.environ, **env}
    )
    lines = result.stdout.decode().strip().splitlines()
    assert lines, result.stderr.decode()
    out: dict[str, Any] = json.loads(lines[-1])
    out["returncode"] = result.returncode
    return out


@needs_shm
@pytest.mark.slow
@one_backend
@pytest.mark.parametrize("off", [[], [1], [0, 2]], ids=["all-on", "rank1-off", "ranks02-off"])
async def test_shm_setting_mixed_across_ranks_falls_back_everywhere(
    server: RendezvousServer, tmp_path: Path, off: list[int]
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(MIXED_WORKER)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    world = 3
    outs: dict[int, dict[str, Any]] = {}

    async def one(rank: int) -> None:
        env = {"AIODIST_SHM": "0" if rank in off else "1"}
        outs[rank] = await _run_worker(script, [url, str(rank), str(world)], env)

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for rank in range(world):
                tg.start_soon(one, rank)
    for rank, out in outs.items():
        assert out["returncode"] == 0, out
        assert out["all_reduce_ok"], out
        assert out["broadcast_ok"], out
        # Ranks with shared memory on learn the group's answer; those with it off never ask.
        assert out["agreed"] == (None if rank in off else not off), out
