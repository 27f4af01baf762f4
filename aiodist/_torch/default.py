"""torch.distributed's default group for a job started without a backend.

``torch.distributed.init_process_group()`` with no backend brings up
``cpu:gloo,cuda:nccl`` (gloo alone where CUDA or NCCL is missing), and code
written for torch relies on it: ``DistributedDataParallel``,
``DistributedSampler``, ``torch.distributed.all_reduce``. aiodist's
``init_process_group()`` with no backend does the same, at init (torch's
own code finds the group the moment it looks; there is no hook to bring it up
later), through the job's store. aiodist's own operations stay on its data
plane: the group serves torch's code, and carries none of aiodist's calls
(``backend="gloo"`` routes them to it).

``backend="aiodist"`` or ``AIODIST_TORCH_GROUP=0`` leave torch.distributed
alone (an async pipeline that never calls torch saves the gloo mesh: about
0.1 s on an idle machine, seconds on a loaded one). A process where
torch.distributed is already up, or not built, is left as it is.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from aiodist._torch.bridge import bring_up

if TYPE_CHECKING:
    from collections.abc import Mapping

    from aiodist._group.group import ProcessGroup

__all__ = ["PLANE_ONLY", "bring_up_default", "wants_default_group"]

logger = logging.getLogger(__name__)

#: The backend name that asks for aiodist's data plane alone (no torch group).
PLANE_ONLY = "aiodist"


def wants_default_group(backend: str | None, environ: Mapping[str, str] | None = None) -> bool:
    """True if joining with ``backend`` brings up torch's default group for torch's code."""
    env = os.environ if environ is None else environ
    return backend is None and env.get("AIODIST_TORCH_GROUP", "1") != "0"


def default_backend() -> str:
    """torch's default: ``cpu:gloo,cuda:nccl`` where CUDA and NCCL are there, else gloo."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


async def bring_up_default(world: ProcessGroup) -> None:
    """Bring up torch.distributed's default group for torch's code; route nothing to it.

    Raises:
        GroupBrokenError: torch could not bring its group up.
    """
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return  # no torch.distributed in this build, or other code brought it up
    backend = default_backend()
    logger.debug("bringing up torch.distributed's default group (%s)", backend)
    await bring_up(world, backend, {})
