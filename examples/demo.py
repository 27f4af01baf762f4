"""The aiodist demo: run with ``aiodist run -n 4 examples/demo.py`` (or ``make demo``).

Every rank joins the job, reports where it is, uses the job's key-value store,
and meets the others at a barrier.
"""

from __future__ import annotations

import os

import anyio

import aiodist


async def main() -> None:
    await aiodist.init_process_group()
    rank, world_size = aiodist.get_dist_info()
    print(
        f"joined: rank {rank} of {world_size}, local rank {aiodist.get_local_rank()} of "
        f"{aiodist.get_local_size()}, pid {os.getpid()}"
    )

    store = aiodist.get_store()
    await store.set(f"greeting/{rank}", f"hello from rank {rank}")
    arrivals = await store.add("arrivals", 1)
    await store.wait([f"greeting/{r}" for r in range(world_size)])
    if aiodist.is_main_process():
        greetings = [(await store.get(f"greeting/{r}")).decode() for r in range(world_size)]
        print(f"store: {len(greetings)} greetings: {greetings}")
    print(f"store: this rank was arrival number {arrivals}")

    await aiodist.get_default_group().session.barrier()  # type: ignore[union-attr]
    print("passed the barrier")
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    anyio.run(main)
