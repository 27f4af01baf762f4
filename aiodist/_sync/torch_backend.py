"""Registering ``"aiodist"`` as a torch.distributed backend, and torch's way into the job.

``import aiodist`` registers the backend with torch.distributed
(``Backend.register_backend``) without importing torch: at once if torch is
imported already, else the moment it is (``_AfterImport``, a one-shot import
hook), so the order of a script's imports does not matter and ``aiodist
serve`` stays free of torch.

torch calls ``create`` when it makes a group on the backend. For its default
group, in a process where aiodist's job is not up yet (a plain torch script:
``torch.distributed.init_process_group(backend="aiodist")`` under torchrun or
``aiodist run``), ``create`` joins the job first, as ``aiodist.sync``'s
``init_process_group`` does (from torchrun's variables), on aiodist's
background loop thread.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib.abc
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, TypeVar

from aiodist import _settings
from aiodist._group.work import wait_future
from aiodist._group.world import default_group_loop, get_default_group
from aiodist._launch.init import destroy_process_group, init_process_group
from aiodist._sync import portal
from aiodist._torch import default
from aiodist._torch.default import BACKEND

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from datetime import timedelta
    from importlib.machinery import ModuleSpec
    from types import ModuleType

T = TypeVar("T")


def register_with_torch() -> None:
    """Register the backend with torch.distributed now, or once torch.distributed is imported."""
    if "torch.distributed" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _register() -> None:
    import torch.distributed as dist

    if not dist.is_available() or BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers the backend once ``torch.distributed`` has been imported, then goes away."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "torch.distributed":
            return None
        sys.meta_path.remove(self)  # one shot; the other finders find the module itself
        spec = importlib.util.find_spec(fullname)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _register()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def create(opts: Any, backend_options: Any = None) -> Any:
    """torch's constructor of a group on the backend (``extended_api``: torch's options).

    Raises:
        RuntimeError, RendezvousError: The job could not be joined.
        ValueError: torch's rank and size are not this process's in aiodist's job.
    """
    from aiodist._torch.backend import create_default, create_subgroup

    ranks = list(opts.global_ranks_in_group)
    if ranks:  # a subgroup: torch calls this on its members only
        return _on_group_loop(
            create_subgroup, str(opts.group_id), ranks, opts.group_rank, opts.timeout
        )
    joined = get_default_group() is None
    if joined:
        _join(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    pg = create_default(opts.group_rank, opts.group_size, owns_job=joined)
    if joined:
        pg.leave_job = functools.partial(portal.call, destroy_process_group)
    return pg


def _on_group_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on the loop the default group lives on (torch calls from a thread)."""
    loop = default_group_loop()
    if loop is None:
        raise RuntimeError("aiodist's job is not running in this process")
    result: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            result.set_result(fn(*args))
        except BaseException as exc:
            result.set_exception(exc)

    loop.call_soon_threadsafe(run)
    return wait_future(result)


def _join(store: Any, rank: int, world_size: int, timeout: timedelta) -> None:
    """Join aiodist's job from torch's ``init_process_group``.

    Under a launcher that names the job's server (``aiodist run``) or hosts a
    store of its own (torchrun), from its variables (``env://``); otherwise
    through torch's store: rank 0 embeds the server and publishes it there.
    """
    env = os.environ
    launched = bool(_settings.SERVER.read(env) or env.get("TORCHELASTIC_RUN_ID"))
    default.joining_from_torch = True
    try:
        portal.call(
            init_process_group,
            init_method="env://" if launched else None,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            store=None if launched else store,
        )
    finally:
        default.joining_from_torch = False
