"""The default process group and the queries every distributed script makes.

Names and non-distributed answers follow ``mmengine.dist`` and
``torch.distributed``: with nothing initialised, every query answers as world
size 1, rank 0, backend None, main process. ``init_process_group`` (in
``aiodist._launch``) installs the default group here; everything below the
launch layer reads it from here.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, overload

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Coroutine

    from aiodist._control.store import Store
    from aiodist._group.group import ProcessGroup

__all__ = [
    "DefaultGroup",
    "default_group_loop",
    "get_backend",
    "get_default_group",
    "get_dist_info",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_store",
    "get_world_size",
    "install_default",
    "is_distributed",
    "is_initialized",
    "is_main_process",
    "master_only",
    "take_default",
]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(slots=True)
class DefaultGroup:
    """The default group and the task that holds its ``open_process_group`` open."""

    group: ProcessGroup
    task: asyncio.Task[None]
    stop: asyncio.Event


_default: DefaultGroup | None = None


def install_default(default: DefaultGroup) -> None:
    """Make ``default`` the default group (``init_process_group`` calls this once formed)."""
    global _default
    if _default is not None:
        raise RuntimeError(
            "the default process group is already initialised; call destroy_process_group() first"
        )
    _default = default


def take_default() -> DefaultGroup | None:
    """Forget the default group and return it (``destroy_process_group`` tears it down)."""
    global _default
    default, _default = _default, None
    return default


def default_group_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop the default group lives on, or None when not initialised."""
    return None if _default is None else _default.task.get_loop()


def get_default_group() -> ProcessGroup | None:
    """The default (world) group, or None when not initialised."""
    return None if _default is None else _default.group


def _group(group: ProcessGroup | None) -> ProcessGroup | None:
    return group if group is not None else get_default_group()


def is_initialized() -> bool:
    """True once ``init_process_group`` has completed (and until destroyed)."""
    return _default is not None


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
