"""One rank of the TLS benchmark (``bench_tls``): p2p and all_reduce of a large tensor.

Run as ``python -m benchmarks._tls_worker MODE RANK HOST PORT NBYTES ITERS``, MODE
``tls`` or ``clear`` (aiodist; ``AIODIST_TLS_*`` in the environment for ``tls``)
or ``gloo`` (torch.distributed). Rank 0 embeds the server (or gloo's store) at
HOST:PORT and prints one JSON line: seconds per p2p transfer and per all_reduce.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import torch


def _gloo(rank: int, host: str, port: int, numel: int, iters: int) -> dict[str, float]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=2)
    t = torch.ones(numel)
    out: dict[str, float] = {}
    for name in ("p2p", "all_reduce"):
        for warm in (True, False):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(1 if warm else iters):
                if name == "all_reduce":
                    dist.all_reduce(t)
                elif rank == 0:
                    dist.send(t, 1)
                else:
                    dist.recv(t, 0)
            dist.barrier()
            if not warm:
                out[name] = (time.perf_counter() - start) / iters
    dist.destroy_process_group()
    return out


async def _aiodist(rank: int, host: str, port: int, numel: int, iters: int) -> dict[str, float]:
    import aiodist

    await aiodist.init_process_group(
        init_method=f"tcp://{host}:{port}", rank=rank, world_size=2, group_name="bench-tls"
    )
    t = torch.ones(numel)
    out: dict[str, float] = {}
    for name in ("p2p", "all_reduce"):
        for warm in (True, False):
            await aiodist.barrier()
            start = time.perf_counter()
            for _ in range(1 if warm else iters):
                if name == "all_reduce":
                    await aiodist.all_reduce(t)
                elif rank == 0:
                    await aiodist.send(t, dst=1)
                else:
                    await aiodist.recv(t, src=0)
            await aiodist.barrier()
            if not warm:
                out[name] = (time.perf_counter() - start) / iters
    await aiodist.destroy_process_group()
    return out


def main() -> None:
    mode, rank, host, port, nbytes, iters = sys.argv[1:7]
    numel = int(nbytes) // 4
    args = (int(rank), host, int(port), numel, int(iters))
    out = _gloo(*args) if mode == "gloo" else asyncio.run(_aiodist(*args))
    if int(rank) == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
