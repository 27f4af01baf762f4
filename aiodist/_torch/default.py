"""torch.distributed's default group for a job started without a backend: aiodist's own.

``torch.distributed.init_process_group()`` with no backend brings up
``cpu:gloo,cuda:nccl``, and code written for torch relies on that group:
``DistributedDataParallel``, ``DistributedSampler``,
``torch.distributed.all_reduce``. aiodist's ``init_process_group()`` with no
backend (or ``backend="aiodist"``) brings it up at init (torch's code finds
the group the moment it looks; there is no hook to bring it up later) on the
``aiodist`` backend (``backend.py``): ``cpu:aiodist,cuda:nccl`` where CUDA and
NCCL are there, ``aiodist`` alone elsewhere. One world: torch's calls ride
aiodist's data plane and membership, with no second mesh.

``AIODIST_TORCH_GROUP=0`` leaves torch.distributed alone (an async pipeline
that never calls torch saves importing it). A process where
torch.distributed is already up, or not built, is left as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING

from aiodist import _settings
from aiodist._control.torchrun import in_thread

if TYPE_CHECKING:
    from collections.abc import Mapping

    from aiodist._group.group import ProcessGroup

logger = logging.getLogger(__name__)

#: The name of the threads torch's default group is brought up and torn down in.
_THREAD = "aiodist-torch-group"

#: The backend name of aiodist's own (``torch.distributed`` backend ``"aiodist"``).
BACKEND = "aiodist"

#: The store torch's default group was brought up with: torch holds only its C++ half,
#: so the Python object must live as long as torch's groups (``new_group`` uses it).
_store: object = None

#: True while torch's ``init_process_group`` joins aiodist's job itself (``_sync``'s
#: ``torch_backend.create``): torch is bringing its group up, aiodist must not.
joining_from_torch = False


def is_aiodist(backend: str | None) -> bool:
    """True if ``backend`` means aiodist's own: None, ``"aiodist"``, ``"cpu:aiodist,..."``."""
    if backend is None:
        return True
    parts = dict(p.strip().rpartition(":")[::2] for p in backend.lower().split(","))
    return parts.get("", parts.get("cpu")) == BACKEND


def wants_default_group(backend: str | None, environ: Mapping[str, str] | None = None) -> bool:
    """True if joining with ``backend`` brings up torch's default group on aiodist's backend."""
    env = os.environ if environ is None else environ
    if joining_from_torch or not _settings.TORCH_GROUP.read(env):
        return False
    return is_aiodist(backend)


def default_backend() -> str:
    """``cpu:aiodist,cuda:nccl`` where CUDA and NCCL are there, else ``aiodist``."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and dist.is_nccl_available():
        return f"cpu:{BACKEND},cuda:nccl"
    return BACKEND


async def bring_up_default(world: ProcessGroup) -> None:
    """Bring up torch.distributed's default group on the aiodist backend, over ``world``.

    All of it in a thread, imports included: importing torch takes seconds on a
    busy machine, and the loop must go on serving the job (its heartbeats) meanwhile.

    Raises:
        GroupBrokenError: torch could not bring its group up.
    """
    from aiodist._errors import GroupBrokenError

    loop = asyncio.get_running_loop()
    backend = "the aiodist backend"

    def bring_up() -> None:
        nonlocal backend
        import torch.distributed as dist

        from aiodist._torch.store import LoopStore

        if not dist.is_available() or dist.is_initialized():
            return  # no torch.distributed in this build, or other code brought it up
        backend = default_backend()
        logger.debug("bringing up torch.distributed's default group (%s)", backend)
        global _store
        _store = store = LoopStore(world, loop)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=world.rank,
            world_size=world.world_size,
            timeout=timedelta(seconds=world.timeout),
        )

    try:
        await in_thread(bring_up, name=_THREAD)
    except Exception as exc:
        raise GroupBrokenError(
            f"torch.distributed.init_process_group({backend!r}) on aiodist's job failed: {exc}"
        ) from exc


async def tear_down_default() -> None:
    """Destroy torch's default group if it is aiodist's (the job is being left).

    Not when torch's own ``destroy_process_group`` is what leaves the job: it is
    tearing torch's groups down already.

    Cancellation:
        The caller should shield it: torch's groups go on being destroyed in a thread.
    """
    import sys

    if "torch.distributed" not in sys.modules:
        return

    import torch.distributed as dist

    from aiodist._torch.backend import AiodistProcessGroup

    if not dist.is_available() or not dist.is_initialized():
        return
    pg = dist.distributed_c10d._get_default_group()
    if isinstance(pg, AiodistProcessGroup) and not pg.destroying:
        with contextlib.suppress(TimeoutError):  # a group stuck in torch is abandoned
            await asyncio.wait_for(
                asyncio.shield(in_thread(dist.destroy_process_group, name=_THREAD)), 5.0
            )
    global _store
    _store = None
