"""What the blocking facade hands the loop thread with each call: the caller's device state.

``aiodist.sync`` runs every call on aiodist's loop thread, but a CUDA
tensor's *current stream* and the *current device* belong to the thread that
made the call. These doors (``submit``, ``call``) are ``portal``'s, with that
state captured on the caller's thread first (``staging.capture``) and handed
over as a context variable, which asyncio copies into the loop's callback
that starts the call. After ``init_process_group`` with NCCL the caller's
thread is put on the rank's GPU too (the loop's threads already are), as
mmengine's ``init_dist`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from aiodist._group.world import get_default_group
from aiodist._ops import staging
from aiodist._sync import portal

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from aiodist._group.work import Work

P = ParamSpec("P")
T = TypeVar("T")

_INITS = ("init_process_group", "init_dist")


def submit(
    fn: Callable[..., Work[T]], /, *args: Any, async_op: bool = False, **kwargs: Any
) -> Work[T] | T:
    """``portal.submit`` with the caller's streams handed to the loop thread."""
    captured = staging.capture(args, kwargs)
    if captured is None:
        return portal.submit(fn, *args, async_op=async_op, **kwargs)
    with staging.caller_context(captured):
        return portal.submit(fn, *args, async_op=async_op, **kwargs)


def call(fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``portal.call`` with the caller's streams handed over; after init, its device set."""
    captured = staging.capture(args, kwargs)
    if captured is None:
        result = portal.call(fn, *args, **kwargs)
    else:
        with staging.caller_context(captured):
            result = portal.call(fn, *args, **kwargs)
    if fn.__name__ in _INITS:
        adopt_device()
    return result


def adopt_device() -> None:
    """Put this thread on the CUDA device the torch bridge chose for this rank, if any."""
    g = get_default_group()
    index = getattr(g.bridge, "cuda_device", None) if g is not None else None
    if isinstance(index, int):
        import torch

        torch.cuda.set_device(index)
