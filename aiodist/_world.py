"""The default process group and the queries every distributed script makes.

Names and non-distributed answers follow ``mmengine.dist`` and
``torch.distributed``: with nothing initialised, every query answers as world
size 1, rank 0, backend None, main process.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

from aiodist._collectives.objects import all_gather_object
from aiodist._errors import CollectiveMismatchError
from aiodist._group import ProcessGroup
from aiodist._join import open_process_group
from aiodist._launchers import infer_launcher, launcher_env
from aiodist._session import DEFAULT_TIMEOUT
from aiodist._store import as_seconds
from aiodist._torch_bridge import bridge_new_group, bring_up, parse_backend, tear_down

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Sequence
    from datetime import timedelta

    from aiodist._store import Store

__all__ = [
    "destroy_process_group",
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
    "is_distributed",
    "is_initialized",
    "is_main_process",
    "master_only",
    "new_group",
]

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(slots=True)
class _Runner:
    """The task that holds the default group's ``open_process_group`` open."""

    group: ProcessGroup
    task: asyncio.Task[None]
    stop: asyncio.Event


_runner: _Runner | None = None


async def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    *,
    world_size: int = -1,
    rank: int = -1,
    group_name: str = "",
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    heartbeat_interval: float | None = None,
    heartbeat_timeout: float | None = None,
    hostname: str | None = None,
) -> None:
    """Join the job and make it the default process group.

    Args:
        backend: ``None`` for aiodist's own data plane; ``"gloo"`` or ``"nccl"`` also
            bring up torch.distributed (see the torch bridge).
        init_method: ``tcp://HOST:PORT``, ``env://`` (default, torchrun's variables)
            or ``file:///shared/path``. With ``tcp://``, rank 0 (or any process with
            ``AIODIST_EMBED=1``) starts the server itself if none listens there.
        world_size: Number of ranks (default: ``$WORLD_SIZE``).
        rank: This rank (default: ``$RANK``); -1 lets the server assign one, keeping
            the ranks of each host contiguous.
        group_name: The job's name on a shared server.
        timeout: Seconds (or a ``timedelta``) to wait for the job to form, and the
            default timeout of every operation.
        heartbeat_interval: Seconds between heartbeats.
        heartbeat_timeout: Silence after which a rank is declared failed.
        hostname: The host this rank counts as when computing local ranks.

    With ``backend="gloo"``, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``, torch.distributed's
    default group is brought up too, through this job's store (no second port):
    tensor collectives on that backend's device then run on torch.distributed.

    Raises:
        RuntimeError: Already initialised; ``backend="nccl"`` without CUDA; or
            torch.distributed already initialised by other code.
        GroupBrokenError: torch.distributed could not bring its group up.
        RendezvousError: The job refused this process; the message says why.
        RendezvousTimeout: The job did not form within ``timeout``.

    Cancellation:
        Cancelling the caller abandons the join; nothing stays initialised.

    Example:
        >>> await aiodist.init_process_group(init_method="tcp://127.0.0.1:29500",
        ...                                  world_size=4, rank=rank)
    """
    global _runner
    if _runner is not None:
        raise RuntimeError(
            "the default process group is already initialised; call destroy_process_group() first"
        )
    seconds = as_seconds(timeout, DEFAULT_TIMEOUT)
    devices = parse_backend(backend)  # before joining: NCCL without CUDA fails here
    loop = asyncio.get_running_loop()
    started: asyncio.Future[ProcessGroup] = loop.create_future()
    stop = asyncio.Event()

    async def hold_open() -> None:
        try:
            async with open_process_group(
                init_method,
                world_size=world_size,
                rank=rank,
                group_name=group_name,
                timeout=seconds,
                backend=backend,
                heartbeat_interval=heartbeat_interval,
                heartbeat_timeout=heartbeat_timeout,
                hostname=hostname,
            ) as group:
                started.set_result(group)
                await stop.wait()
        except BaseException as exc:
            if not started.done():
                if isinstance(exc, asyncio.CancelledError):
                    started.cancel()
                else:
                    started.set_exception(exc)
                    return
            raise

    task = loop.create_task(hold_open(), name="aiodist-default-group")
    try:
        group = await started
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    _runner = _Runner(group, task, stop)
    if devices is not None:
        assert backend is not None
        try:
            await bring_up(group, backend, devices)
        except BaseException:
            await destroy_process_group()
            raise


async def init_dist(launcher: str, backend: str | None = None, **kwargs: Any) -> None:
    """Initialise from a launcher's environment, as ``mmengine.dist.init_dist`` does.

    Args:
        launcher: ``"pytorch"`` (torchrun, ``aiodist run``), ``"slurm"`` or ``"mpi"``;
            see ``infer_launcher``.
        backend: As for ``init_process_group``.
        **kwargs: ``port`` (Slurm) and any ``init_process_group`` keyword.

    Raises:
        ValueError: An unknown launcher.
        RendezvousError: The launcher's environment lacks a variable it needs.
    """
    port = kwargs.pop("port", None)
    num_gpus = 0
    if launcher == "slurm" and "SLURM_LOCALID" not in os.environ:
        import torch

        num_gpus = torch.cuda.device_count()
    os.environ.update(launcher_env(launcher, os.environ, port=port, num_gpus=num_gpus))
    await init_process_group(backend, "env://", **kwargs)


async def new_group(
    ranks: Sequence[int] | None = None,
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    *,
    parent: ProcessGroup | None = None,
) -> ProcessGroup:
    """Create a group of some ranks of the world, as ``torch.distributed.new_group`` does.

    Every rank of the world (of ``parent``) calls ``new_group`` with the same
    ``ranks``, in the same order as its other ``new_group`` calls, members or
    not (as in torch).
    Operations take ``group=`` the returned group; on a rank outside ``ranks``
    the group has ``rank == -1`` and operations on it raise ``ValueError``.

    Args:
        ranks: Global ranks of the members (sorted, as torch does); None for all.
        timeout: Default timeout of the group's operations; the world's if None.
        backend: When the parent group is bridged to torch.distributed, the torch
            backend of the new group (default: the parent's); otherwise recorded only.
        parent: The group to carve the new one from (the members of ``parent``
            call ``new_group``); the world group if None, as in torch.

    Returns:
        The new group; the world group's rank ``r`` is ``group.ranks.index(r)`` in it.

    Raises:
        TypeError, ValueError: ``ranks`` holds a non-int, a duplicate or an
            out-of-range rank (checked before anything is sent).
        CollectiveMismatchError: Ranks called ``new_group`` with different ``ranks``;
            the world group is then broken, since ranks no longer agree on groups.
        RuntimeError: Not initialised.

    Cancellation:
        Cancelling the caller does not cancel the world-wide agreement it started.

    Example:
        >>> evens = await aiodist.new_group([0, 2])
        >>> await aiodist.all_reduce(t, group=evens)
    """
    world = parent if parent is not None else get_default_group()
    if world is None:
        raise RuntimeError("new_group needs init_process_group first")
    world.check_usable()
    members = _check_group_ranks(ranks, world)
    session = world.session
    group_id = session.next_group_id()  # every rank numbers its groups in call order
    group = ProcessGroup(
        session, members, name=f"{session.group_name}/{group_id}", group_id=group_id
    )
    group.timeout = as_seconds(timeout, world.timeout)
    group.group_backend = backend
    session.groups[group_id] = group
    try:
        seen = await all_gather_object(members, group=world)
    except BaseException:
        del session.groups[group_id]
        raise
    if any(other != members for other in seen):
        exc = CollectiveMismatchError(
            f"new_group was called with different ranks: {_by_rank(seen)}; every rank "
            "must call new_group with the same ranks, in the same order",
            field="ranks",
            values_by_rank=dict(enumerate(seen)),
        )
        del session.groups[group_id]
        world.break_(exc, notify=False)  # every rank saw the same table: no notice needed
        raise exc
    if world.bridge is not None:
        await bridge_new_group(world, group, backend)
    return group


def _check_group_ranks(ranks: Sequence[int] | None, parent: ProcessGroup) -> list[int]:
    if ranks is None:
        return list(parent.ranks)
    allowed = set(parent.ranks)
    if isinstance(ranks, str | bytes) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"ranks must be a sequence of ints, got {type(ranks).__name__}")
    members = list(ranks)
    for r in members:
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"ranks must be ints, got {r!r} ({type(r).__name__})")
        if r not in allowed:
            raise ValueError(f"rank {r} is not a member of {parent!r}; ranks are global ranks")
    if len(set(members)) != len(members):
        raise ValueError(f"ranks must be distinct, got {members}")
    if not members:
        raise ValueError("ranks must name at least one rank")
    return sorted(members)


def _by_rank(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


async def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Leave the job and tear the default group down; a no-op when not initialised.

    With a group made by ``new_group``, only that group is destroyed: later
    operations on it raise ``ClosedError``. torch.distributed's groups brought
    up by the torch bridge go with them.

    Cancellation:
        Shielded: once called, the group is torn down even if the caller is cancelled.
    """
    global _runner
    if group is not None and group.group_id != 0:  # a group made by new_group
        await tear_down(group)
        group.close()
        return
    runner = _runner
    if runner is None or (group is not None and group is not runner.group):
        return
    _runner = None
    await asyncio.shield(tear_down(runner.group))
    runner.stop.set()
    await asyncio.shield(asyncio.gather(runner.task, return_exceptions=True))


def get_default_group() -> ProcessGroup | None:
    """The default (world) group, or None when not initialised."""
    return None if _runner is None else _runner.group


def _group(group: ProcessGroup | None) -> ProcessGroup | None:
    return group if group is not None else get_default_group()


def is_initialized() -> bool:
    """True once ``init_process_group`` has completed (and until destroyed)."""
    return _runner is not None


def is_distributed() -> bool:
    """True when initialised (mmengine's name for ``is_initialized``)."""
    return is_initialized()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: world); 0 when not initialised."""
    g = _group(group)
    return 0 if g is None else g.rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: world); 1 when not initialised."""
    g = _group(group)
    return 1 if g is None else g.world_size


def get_backend(group: ProcessGroup | None = None) -> str | None:
    """The backend ``init_process_group`` was given; None when not initialised."""
    g = _group(group)
    return None if g is None else g.backend


def get_local_rank() -> int:
    """This process's rank among the ranks of its host; 0 when not initialised."""
    g = get_default_group()
    return 0 if g is None else g.session.local_rank


def get_local_size() -> int:
    """Number of ranks on this host; 1 when not initialised."""
    g = get_default_group()
    return 1 if g is None else g.session.local_size


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
