"""``init_master_worker``: join a job as its master (rank 0) or as one of its workers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from aiodist._group.world import get_default_group
from aiodist._launch.init import destroy_process_group, init_process_group

if TYPE_CHECKING:
    from datetime import timedelta


async def init_master_worker(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    group_name: str = "",
) -> bool:
    """Join the job in master-worker mode: rank 0 drives, the other ranks serve it.

    The job is joined as ``init_process_group`` joins it (same launchers, init
    methods, token and TLS). On rank 0 it returns True at once: the master
    makes tensors on the workers with ``aiodist.remote`` and operates on them.
    On every other rank it serves the master's orders until the master leaves
    the job (``destroy_process_group``, or the end of its event loop or
    process), then leaves the job itself and returns False.

    Its arguments are ``init_process_group``'s.

    Returns:
        True on the master, False on a worker once the job has ended.

    Raises:
        RankFailedError: On a worker: the master failed.

    Example:
        >>> if await aiodist.init_master_worker():
        ...     x = aiodist.remote.full((20, 20), 4.0)   # on worker 1
        ...     print(await (x + x).fetch())
    """
    await init_process_group(backend, init_method, timeout, world_size, rank, group_name=group_name)
    g = get_default_group()
    assert g is not None
    # Deferred: torch is imported by the master-worker side only, not by ``import aiodist``.
    from aiodist._remote import master, worker

    if g.rank == worker.MASTER:
        # The first operation on meta tensors readies torch's shape machinery, seconds of
        # CPU once per process: here, off the loop, which goes on serving the job (and
        # the rendezvous server, when this rank hosts it) meanwhile.
        await anyio.to_thread.run_sync(master.ready_shapes)
        master.install(g)
        return True
    try:
        await worker.serve(g)
    finally:
        await destroy_process_group()
    return False
