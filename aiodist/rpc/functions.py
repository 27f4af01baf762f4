"""Decorators for functions that remote calls run (torch's ``torch.distributed.rpc.functions``)."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from aiodist._rpc.serve import ASYNC_MARK

__all__ = ["async_execution"]

F = TypeVar("F")


def async_execution(fn: F) -> F:
    """Mark a function that returns a ``torch.futures.Future``: the call answers when it completes.

    The function runs on the callee as any plain function (in one of its rpc
    threads) and returns a future at once, say from ``rpc.rpc_async(...).then(...)``
    or a ``torch.futures.Future()`` it completes later; the thread is free
    meanwhile, and the caller gets the future's value (or error) once it is
    set. With ``@staticmethod`` or ``@classmethod``, put this decorator inside.
    A coroutine function needs no decorator: it is awaited on the callee's loop.

    Example:
        >>> @rpc.functions.async_execution
        ... def add_then(to, x, y, z):
        ...     return rpc.rpc_async(to, torch.add, (x, y)).then(lambda f: f.wait() + z)
        >>> rpc.rpc_sync("worker1", add_then, ("worker2", torch.ones(2), 1, 1))
    """

    @functools.wraps(fn)  # type: ignore[arg-type]
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)  # type: ignore[operator]

    setattr(wrapper, ASYNC_MARK, fn)
    return wrapper  # type: ignore[return-value]
