"""aiodist: asyncio-first communication for distributed PyTorch.

Example:
    >>> await aiodist.init_process_group(init_method="tcp://127.0.0.1:29500",
    ...                                  world_size=4, rank=rank)
    >>> aiodist.get_rank(), aiodist.get_world_size()
"""

from __future__ import annotations

from aiodist._control.store import Store
from aiodist._errors import (
    AbortedError,
    AuthenticationError,
    ClosedError,
    CollectiveMismatchError,
    DistError,
    DistTimeoutError,
    GroupBrokenError,
    ProtocolError,
    RankFailedError,
    RendezvousError,
    RendezvousTimeout,
)
from aiodist._group.group import ProcessGroup
from aiodist._group.join import open_process_group
from aiodist._group.session import MemberInfo
from aiodist._group.work import Work
from aiodist._group.world import (
    get_backend,
    get_default_group,
    get_dist_info,
    get_local_rank,
    get_local_size,
    get_rank,
    get_store,
    get_world_size,
    is_distributed,
    is_initialized,
    is_main_process,
    master_only,
)
from aiodist._launch.init import destroy_process_group, init_dist, init_process_group
from aiodist._launch.launchers import infer_launcher
from aiodist._ops.groups import new_group
from aiodist._ops.movement import all_gather, all_to_all, barrier
from aiodist._ops.objects import (
    all_gather_object,
    broadcast_object_list,
    collect_results,
    gather_object,
    scatter_object_list,
    sync_random_seed,
)
from aiodist._ops.p2p import irecv, irecv_object, isend, isend_object, recv, send
from aiodist._ops.reductions import all_reduce, reduce, reduce_scatter
from aiodist._ops.rooted import broadcast, gather, scatter
from aiodist._ops.tensor_groups import all_reduce_dict, all_reduce_params
from aiodist._server.serve import RendezvousServer, serve_rendezvous

__version__ = "0.1.0"

__all__ = [
    "AbortedError",
    "AuthenticationError",
    "ClosedError",
    "CollectiveMismatchError",
    "DistError",
    "DistTimeoutError",
    "GroupBrokenError",
    "MemberInfo",
    "ProcessGroup",
    "ProtocolError",
    "RankFailedError",
    "RendezvousError",
    "RendezvousServer",
    "RendezvousTimeout",
    "Store",
    "Work",
    "__version__",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_dict",
    "all_reduce_params",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "collect_results",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_default_group",
    "get_dist_info",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_store",
    "get_world_size",
    "infer_launcher",
    "init_dist",
    "init_process_group",
    "irecv",
    "irecv_object",
    "is_distributed",
    "is_initialized",
    "is_main_process",
    "isend",
    "isend_object",
    "master_only",
    "new_group",
    "open_process_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "scatter_object_list",
    "send",
    "serve_rendezvous",
    "sync_random_seed",
]
