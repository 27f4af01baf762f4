"""aiodist: asyncio-first communication for distributed PyTorch.

Example:
    >>> await aiodist.init_process_group(init_method="tcp://127.0.0.1:29500",
    ...                                  world_size=4, rank=rank)
    >>> aiodist.get_rank(), aiodist.get_world_size()
"""

from __future__ import annotations

from typing import Any

from aiodist._control.store import Store
from aiodist._errors import (
    AbortedError,
    AuthenticationError,
    BarrierTimeoutError,
    ClosedError,
    CollectiveMismatchError,
    DistError,
    DistTimeoutError,
    GroupBrokenError,
    ProtocolError,
    RankFailedError,
    RemoteError,
    RendezvousError,
    RendezvousTimeout,
)
from aiodist._group.group import ProcessGroup
from aiodist._group.join import open_process_group
from aiodist._group.session import MemberInfo
from aiodist._group.views import MembershipView
from aiodist._group.work import Work
from aiodist._group.world import (
    Backend,
    GroupMember,
    default_pg_timeout,
    get_backend,
    get_backend_config,
    get_debug_level,
    get_default_backend_for_device,
    get_default_group,
    get_dist_info,
    get_global_rank,
    get_group_rank,
    get_local_group,
    get_local_rank,
    get_local_size,
    get_node_local_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_store,
    get_world_size,
    group,
    is_available,
    is_backend_available,
    is_distributed,
    is_gloo_available,
    is_initialized,
    is_main_process,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
    master_only,
    set_debug_level,
)
from aiodist._group.world import torch_type as _torch_type
from aiodist._launch.init import destroy_process_group, init_dist, init_process_group
from aiodist._launch.launchers import infer_launcher
from aiodist._launch.trace import trace
from aiodist._ops.collect import (
    collect_results,
    collect_results_cpu,
    collect_results_gpu,
    sync_random_seed,
)
from aiodist._ops.devices import cast_data_device, get_comm_device, get_data_device
from aiodist._ops.groups import (
    init_local_group,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from aiodist._ops.movement import (
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_to_all,
    all_to_all_single,
    barrier,
    monitored_barrier,
)
from aiodist._ops.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from aiodist._ops.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from aiodist._ops.p2p_objects import (
    irecv_object,
    isend_object,
    recv_object_list,
    send_object_list,
)
from aiodist._ops.reduce_ops import ReduceOp, supports_complex
from aiodist._ops.reductions import all_reduce, reduce, reduce_scatter, reduce_scatter_tensor
from aiodist._ops.regroup import (
    joined_late,
    membership,
    regroup,
    watch_membership,
)
from aiodist._ops.rooted import broadcast, gather, scatter
from aiodist._ops.shrink import shrink_group
from aiodist._ops.tensor_groups import all_reduce_coalesced, all_reduce_dict, all_reduce_params
from aiodist._remote.start import init_master_worker
from aiodist._server.serve import RendezvousServer, serve_rendezvous
from aiodist._sync.torch_backend import register_with_torch
from aiodist._transport.registry import register_transport

__version__ = "0.1.0"

# torch.distributed's backend "aiodist": now, or when torch.distributed is imported.
register_with_torch()
del register_with_torch

#: torch.distributed's deprecated name of ``ReduceOp``.
reduce_op = ReduceOp
#: torch.distributed's other names of ``all_gather_into_tensor``/``reduce_scatter_tensor``.
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def __getattr__(name: str) -> Any:
    """torch.distributed's own types (``DebugLevel``, ``GradBucket``...), loaded on first use."""
    return _torch_type(__name__, name)


__all__ = [
    "AbortedError",
    "AuthenticationError",
    "Backend",
    "BarrierTimeoutError",
    "ClosedError",
    "CollectiveMismatchError",
    "DistError",
    "DistTimeoutError",
    "GroupBrokenError",
    "GroupMember",
    "MemberInfo",
    "MembershipView",
    "P2POp",
    "ProcessGroup",
    "ProtocolError",
    "RankFailedError",
    "ReduceOp",
    "RemoteError",
    "RendezvousError",
    "RendezvousServer",
    "RendezvousTimeout",
    "Store",
    "Work",
    "__version__",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_dict",
    "all_reduce_params",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "cast_data_device",
    "collect_results",
    "collect_results_cpu",
    "collect_results_gpu",
    "default_pg_timeout",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_backend_config",
    "get_comm_device",
    "get_data_device",
    "get_debug_level",
    "get_default_backend_for_device",
    "get_default_group",
    "get_dist_info",
    "get_global_rank",
    "get_group_rank",
    "get_local_group",
    "get_local_rank",
    "get_local_size",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_store",
    "get_world_size",
    "group",
    "infer_launcher",
    "init_dist",
    "init_local_group",
    "init_master_worker",
    "init_process_group",
    "irecv",
    "irecv_object",
    "is_available",
    "is_backend_available",
    "is_distributed",
    "is_gloo_available",
    "is_initialized",
    "is_main_process",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "isend",
    "isend_object",
    "joined_late",
    "master_only",
    "membership",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "open_process_group",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "register_transport",
    "regroup",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "serve_rendezvous",
    "set_debug_level",
    "shrink_group",
    "split_group",
    "supports_complex",
    "sync_random_seed",
    "trace",
    "watch_membership",
]
