"""The default process group and the queries every distributed script makes.

Names and non-distributed answers follow ``mmengine.dist`` and
``torch.distributed``: with nothing initialised, every query answers as world
size 1, rank 0, backend None, main process; where the environment says this
process is one of several ranks (a launcher's ``WORLD_SIZE`` > 1), the first
such answer also logs one warning naming the missing ``init_process_group``
(forgotten, or not awaited). ``init_process_group`` (in
``aiodist._launch``) installs the default group here; everything below the
launch layer reads it from here.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, ParamSpec, TypeGuard, TypeVar, overload

from aiodist._errors import ArgumentError, ArgumentTypeError
from aiodist._group.group import ProcessGroup
from aiodist._group.session import DEFAULT_TIMEOUT

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Coroutine

    from aiodist._control.store import Store

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(slots=True)
class DefaultGroup:
    """The default group and the task that holds its ``open_process_group`` open."""

    group: ProcessGroup
    task: asyncio.Task[None]
    stop: asyncio.Event


_default: DefaultGroup | None = None
_local: ProcessGroup | None = None  # mmengine's local group (init_local_group)
_outside: ProcessGroup | None = None  # torch's NON_GROUP_MEMBER, as aiodist names it

#: torch.distributed's default timeout of a group's operations (aiodist's, as a timedelta).
default_pg_timeout: Final = timedelta(seconds=DEFAULT_TIMEOUT)


class _WorldMeta(type):
    """Gives ``GroupMember.WORLD`` (and ``group.WORLD``) its live value, as torch's does."""

    def _world(cls) -> object:
        # What WORLD answers: aiodist.sync's twins answer torch's group instead.
        return get_default_group()

    @property
    def WORLD(cls) -> Any:
        """The default (world) group; None when not initialised."""
        return cls._world()


class GroupMember(metaclass=_WorldMeta):
    """torch.distributed's group constants: ``WORLD`` (live), ``NON_GROUP_MEMBER``."""

    NON_GROUP_MEMBER: Final = -100


class group(metaclass=_WorldMeta):
    """``group.WORLD``: the default (world) group, None when not initialised (as in torch).

    Example:
        >>> aiodist.get_rank(aiodist.group.WORLD)
    """


class Backend(str):
    """A backend's name, lower case, with torch.distributed's constants (``Backend.GLOO``)."""

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise ArgumentError(f"Backend name must be a string, but got: {name!r}")
        return super().__new__(cls, name.lower())


def install_default(default: DefaultGroup) -> None:
    """Make ``default`` the default group (``init_process_group`` calls this once formed)."""
    global _default
    if _default is not None:
        raise RuntimeError(
            "the default process group is already initialised; call destroy_process_group() first"
        )
    _default = default


def replace_default_group(old: ProcessGroup, new: ProcessGroup) -> None:
    """Make ``new`` the default group in place of ``old`` (``shrink_group`` of the default)."""
    if _default is not None and _default.group is old:
        _default.group = new


def take_default() -> DefaultGroup | None:
    """Forget the default group and return it (``destroy_process_group`` tears it down)."""
    global _default, _local, _outside
    default, _default = _default, None
    _local = _outside = None  # groups of its job
    return default


def install_local_group(local: ProcessGroup) -> None:
    """Make ``local`` mmengine's local group (``init_local_group`` calls this once)."""
    global _local
    _local = local


def default_group_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop the default group lives on, or None when not initialised."""
    return None if _default is None else _default.task.get_loop()


def get_default_group() -> ProcessGroup | None:
    """The default (world) group, or None when not initialised."""
    return None if _default is None else _default.group


def as_group(group: object) -> ProcessGroup | None:
    """The aiodist group ``group`` names; None stays None.

    An aiodist group is itself. A torch.distributed group over this job names
    the aiodist group under it: torch's groups on the ``aiodist`` backend
    (``aiodist.sync``'s ``group.WORLD``, a DDP's ``process_group``) and the
    torch groups a bridged group brought up (``backend="gloo"``/``"nccl"``).
    torch's ``GroupMember.NON_GROUP_MEMBER`` (what torch's ``new_group`` gives
    a rank outside the group) names a group this rank is not in: calls on it
    do nothing there, as in torch.

    Raises:
        TypeError: ``group`` is neither (a torch group of another job, a rank list).
    """
    if group is None or type(group) is ProcessGroup:
        return group
    rides = getattr(group, "aiodist_group", None)  # _torch.backend.AiodistProcessGroup
    if callable(rides):
        g = rides()
        if g is None:
            raise RuntimeError(f"{group!r} has been destroyed: its aiodist job is gone")
        return g  # type: ignore[no-any-return]
    default = get_default_group()
    if type(group) is int and group == GroupMember.NON_GROUP_MEMBER:
        return _non_member(default)
    if default is not None:
        for g in list(default.session.groups.values()):
            if isinstance(g, ProcessGroup) and g.bridge and g.bridge.torch_group is group:
                return g
    raise ArgumentTypeError(
        f"group must be an aiodist process group (group.WORLD, or one new_group made) or a "
        f"torch.distributed group over aiodist's job, got {group!r}; a torch group of "
        "another backend goes to torch.distributed's own functions"
    )


def _non_member(default: ProcessGroup | None) -> ProcessGroup:
    """A group of the job that this rank is outside of (``rank == -1``), for torch's sentinel."""
    global _outside
    if default is None:
        raise RuntimeError(
            "group is torch's GroupMember.NON_GROUP_MEMBER, but aiodist's default group is "
            "not initialised; call init_process_group() first"
        )
    if _outside is None or _outside.session is not default.session:
        _outside = ProcessGroup(default.session, (), name=f"{default.name}/non-member", group_id=-1)
    return _outside


def is_group(x: object) -> TypeGuard[ProcessGroup]:
    """True for a group ``as_group`` may take: aiodist's, or torch.distributed's.

    For the forms that take a group in another argument's place (mmengine's
    ``all_gather(data, group)``).
    """
    if type(x) is ProcessGroup:
        return True
    torch_dist = sys.modules.get("torch.distributed")
    return torch_dist is not None and isinstance(x, torch_dist.ProcessGroup)


def group_or_default(group: object, what: str) -> ProcessGroup:
    """``group``'s aiodist group, or the default group: ``what`` needs one.

    Raises:
        RuntimeError: No ``group`` and not initialised.
    """
    g = as_group(group) if group is not None else get_default_group()
    if g is None:
        raise RuntimeError(f"{what} needs a process group: call init_process_group() first")
    return g


def resolve_group(group: object) -> ProcessGroup | None:
    """``group``'s aiodist group, else the default group, else None (not initialised)."""
    return as_group(group) if group is not None else default_group_for()


_warned_alone = False


def default_group_for(call: str | None = None) -> ProcessGroup | None:
    """The default group for a call without ``group=``; None: it answers as a world of one.

    Before ``init_process_group``, in a process a launcher started as one of
    several ranks (``WORLD_SIZE`` > 1), the first such call logs a warning:
    each rank would otherwise compute alone, in silence.
    """
    global _warned_alone
    g = get_default_group()
    if g is None and not _warned_alone:
        size = os.environ.get("WORLD_SIZE", "")
        if size.isdecimal() and int(size) > 1:
            _warned_alone = True
            what = call or sys._getframe(2).f_code.co_name  # the query: get_rank, ...
            logger.warning(
                "%s() answered as a world of one rank: init_process_group was not called "
                "(or not awaited) in this process, but WORLD_SIZE=%s says it is one of %s "
                "ranks; call `await aiodist.init_process_group()` (aiodist.sync: "
                "`init_process_group()`) first",
                what,
                size,
                size,
            )
    return g


def is_initialized() -> bool:
    """True once ``init_process_group`` has completed (and until destroyed)."""
    return _default is not None


def is_distributed() -> bool:
    """True when initialised (mmengine's name for ``is_initialized``)."""
    return is_initialized()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: world); 0 when not initialised."""
    g = resolve_group(group)
    return 0 if g is None else g.rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: world); 1 when not initialised.

    -1 on a process outside ``group``, as torch.distributed answers.
    """
    g = resolve_group(group)
    if g is None:
        return 1
    return g.world_size if g.rank >= 0 else -1


def get_backend(group: ProcessGroup | None = None) -> str | None:
    """The backend ``init_process_group`` was given; None when not initialised.

    A torch.distributed group (``_get_default_group()``, a DDP's) is answered
    by torch: its backend is torch's to name.
    """
    torch_dist = sys.modules.get("torch.distributed")
    if torch_dist is not None and isinstance(group, torch_dist.ProcessGroup):
        return str(torch_dist.get_backend(group))
    g = resolve_group(group)
    return None if g is None else g.backend


def get_group_rank(group: ProcessGroup | None, global_rank: int) -> int:
    """The rank in ``group`` of global rank ``global_rank`` (torch.distributed's query).

    Raises:
        ValueError: ``group`` is None, or ``global_rank`` is not a member of it.
    """
    g = _registered(group)
    if g is get_default_group():
        return global_rank  # torch answers the world group without checking
    return g.group_rank_of(global_rank, "global_rank")


def get_global_rank(group: ProcessGroup | None, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (torch.distributed's query).

    Raises:
        ValueError: ``group`` is None, or it has no rank ``group_rank``.
    """
    g = _registered(group)
    if g is get_default_group():
        return group_rank
    if not isinstance(group_rank, int) or not 0 <= group_rank < g.world_size:
        raise ArgumentError(f"Group rank {group_rank} is not part of group {g!r}")
    return _renumbered(g, g.global_rank(group_rank))


def get_process_group_ranks(group: ProcessGroup | None) -> list[int]:
    """The global ranks of ``group``'s members, in group rank order (None: the world).

    Raises:
        ValueError: Not initialised.
    """
    g = _initialized(group)
    if g is get_default_group():
        return list(range(g.world_size))
    return [_renumbered(g, r) for r in g.ranks]


def _renumbered(g: ProcessGroup, job_rank: int) -> int:
    """The global rank a user knows job rank ``job_rank`` by (it changes with shrink_group)."""
    numbering = g.session.numbering
    return job_rank if numbering is None else numbering.index(job_rank)


def _initialized(group: object) -> ProcessGroup:
    """``resolve_group(group)``, raising torch's error when not initialised."""
    g = resolve_group(group)
    if g is None:
        raise ArgumentError(
            "Default process group has not been initialized, call init_process_group"
        )
    return g


def _registered(group: object) -> ProcessGroup:
    g = as_group(group)
    if g is None:
        raise ArgumentError(
            "Group None is not registered, please create group with new_group (or pass group.WORLD)"
        )
    return g


def get_pg_count() -> int:
    """How many process groups this process has (the default one too); 0 when not initialised."""
    g = get_default_group()
    return 0 if g is None else len(g.session.groups)


def get_backend_config(group: ProcessGroup | None = None) -> str:
    """Which backend carries each device's tensors, as ``"cpu:gloo,cuda:aiodist"``.

    ``aiodist`` is aiodist's own data plane (CUDA tensors staged through host
    memory); ``gloo``/``nccl`` the torch bridge.

    Raises:
        ValueError: Not initialised.
    """
    g = _initialized(group)
    devices = dict.fromkeys(("cpu", "cuda"), "aiodist")
    carried = getattr(g.bridge, "devices", None)
    if isinstance(carried, dict):
        devices.update(carried)
    return ",".join(f"{device}:{name}" for device, name in devices.items())


def get_default_backend_for_device(device: Any) -> str:
    """torch.distributed's default backend for ``device`` (``"cpu"`` -> ``"gloo"``, ...)."""
    import torch.distributed as dist

    return str(dist.get_default_backend_for_device(device))


def is_available() -> bool:
    """True: aiodist is always available (``torch.distributed.is_available``)."""
    return True


def is_gloo_available() -> bool:
    """True if torch was built with gloo (the torch bridge's CPU backend)."""
    import torch.distributed as dist

    return bool(dist.is_gloo_available())


def is_nccl_available() -> bool:
    """True if torch was built with NCCL (the torch bridge's CUDA backend)."""
    import torch.distributed as dist

    return bool(dist.is_nccl_available())


def is_mpi_available() -> bool:
    """True if torch was built with MPI (aiodist never bridges it)."""
    import torch.distributed as dist

    return bool(dist.is_mpi_available())


def is_ucc_available() -> bool:
    """True if torch was built with UCC (aiodist never bridges it)."""
    import torch.distributed as dist

    return bool(dist.is_ucc_available())


def is_xccl_available() -> bool:
    """True if torch was built with XCCL (aiodist never bridges it)."""
    import torch.distributed as dist

    return bool(dist.is_xccl_available())


def is_backend_available(backend: str) -> bool:
    """True if torch was built with ``backend``."""
    import torch.distributed as dist

    return bool(dist.is_backend_available(backend))


def get_debug_level() -> Any:
    """torch.distributed's debug level (``TORCH_DISTRIBUTED_DEBUG``): a ``DebugLevel``.

    aiodist's own data plane always checks that ranks agree on each collective's
    signature (op, dtype, shape, root), whatever the level; torch checks it only
    at ``DETAIL``, which is what this returns for torch's own groups.
    """
    import torch.distributed as dist

    return dist.get_debug_level()  # type: ignore[attr-defined]


def set_debug_level(level: Any) -> None:
    """Set torch.distributed's debug level (a ``DebugLevel``), as ``TORCH_DISTRIBUTED_DEBUG`` does.

    It governs torch's own groups and DDP's logging; aiodist's data plane checks
    every collective's signature whatever the level.
    """
    import torch.distributed as dist

    dist.set_debug_level(level)  # type: ignore[attr-defined]


#: torch.distributed's own types, offered unchanged by ``aiodist`` and ``aiodist.sync``
#: under their names: code written for torch.distributed names them (a comm hook's
#: ``bucket: dist.GradBucket``, ``dist.DebugLevel.DETAIL``, a store of its own such as
#: ``dist.TCPStore(...)``, ``dist.init_device_mesh("cpu", (2,))`` over torch's default
#: group). Loaded on first use, so that importing aiodist does not import torch.
TORCH_TYPES: Final = frozenset(
    {
        "BuiltinCommHookType",
        "DebugLevel",
        "DeviceMesh",
        "FileStore",
        "GradBucket",
        "HashStore",
        "PrefixStore",
        "TCPStore",
        "init_device_mesh",
    }
)


def torch_type(module: str, name: str) -> Any:
    """A module's ``__getattr__``: torch.distributed's ``name``, one of ``TORCH_TYPES``."""
    if name in TORCH_TYPES:
        import torch.distributed as dist

        return getattr(dist, name)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def is_torchelastic_launched() -> bool:
    """True if this process was started by torchelastic (``TORCHELASTIC_RUN_ID`` is set)."""
    return os.getenv("TORCHELASTIC_RUN_ID") is not None


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """``$LOCAL_RANK``, else ``fallback_rank`` (torch.distributed's query).

    Raises:
        RuntimeError: Neither is there.
    """
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment; pass fallback_rank to run without a launcher"
    )


def get_local_group() -> ProcessGroup | None:
    """mmengine's local group (the ranks of this host); None when not initialised.

    Raises:
        RuntimeError: Initialised, but ``init_local_group`` was not called.
    """
    if get_default_group() is None:
        return None
    if _local is None:
        raise RuntimeError(
            "Local process group is not created, please use `init_local_group` to set it up"
        )
    return _local


def get_local_rank() -> int:
    """This process's rank among the ranks of its host; 0 when not initialised.

    Its rank in the local group once ``init_local_group`` made one (as mmengine);
    before that, from the hosts the ranks joined from (mmengine raises there).
    """
    g = get_default_group()
    if g is None:
        return 0
    return _local.rank if _local is not None else g.session.local_rank


def get_local_size() -> int:
    """Number of ranks on this host; 1 when not initialised (see ``get_local_rank``)."""
    g = get_default_group()
    if g is None:
        return 1
    return _local.world_size if _local is not None else g.session.local_size


def get_dist_info(group: ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``; ``(0, 1)`` when not initialised."""
    return get_rank(group), get_world_size(group)


def is_main_process(group: ProcessGroup | None = None) -> bool:
    """True on rank 0 of ``group``, and when not initialised."""
    return get_rank(group) == 0


def get_store() -> Store:
    """The job's key-value store (TCPStore's operations, awaitable).

    Raises:
        RuntimeError: Not initialised.
    """
    g = get_default_group()
    if g is None:
        raise RuntimeError("no process group: call init_process_group() first")
    return g.store


@overload
def master_only(
    func: Callable[P, Coroutine[Any, Any, R]],
) -> Callable[P, Coroutine[Any, Any, R | None]]: ...
@overload
def master_only(func: Callable[P, R]) -> Callable[P, R | None]: ...
def master_only(func: Callable[P, Any]) -> Callable[P, Any]:
    """Run ``func`` on the main process only; elsewhere return None.

    Works on plain and ``async def`` functions.

    Example:
        >>> @master_only
        ... def save(path): ...
    """
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
            if is_main_process():
                return await func(*args, **kwargs)
            return None

        return async_wrapper

    @functools.wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
        if is_main_process():
            return func(*args, **kwargs)
        return None

    return wrapper
