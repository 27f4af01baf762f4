"""Master-worker mode: rank 0 makes tensors on the other ranks and operates on them there.

Start the job with ``aiodist.init_master_worker()``; on rank 0 (the master)::

    x = aiodist.remote.full((20, 20), 4.0)        # made on worker 1
    y = aiodist.remote.send(torch.randn(20, 20))  # copied to worker 1
    z = x + y                                     # runs there; z.get_node() == 1
    with aiodist.remote.node(2):
        a = aiodist.remote.FloatTensor(10)        # made on worker 2
    print(await z.fetch())                        # the one kind of wait: a copy here

Operations (operators, ``torch.*`` functions, tensor methods, in-place
methods, ``.cuda()``) return a ``RemoteTensor`` at once and run on the worker
that holds their first remote operand, in issue order on its current
``Stream``; shape and dtype are known on the master without asking. An
operand held by another worker is sent there by that worker. ``fetch``,
``synchronize`` and ``Event.synchronize`` are the sync points: an error of a
worker's operation is raised there, naming the operation and the worker. A
worker frees a tensor once the master's last handle to it is gone.

In plain code (``aiodist.sync.init_master_worker()``) the same calls work,
and the sync points block instead of returning a ``Work`` to await.
"""

from __future__ import annotations

from typing import Any

import torch

from aiodist._errors import ArgumentError, RemoteError
from aiodist._remote.master import (
    Event,
    RemoteTensor,
    Stream,
    current_node,
    current_stream,
    factory,
    held_tensors,
    node,
    send,
    stream,
    synchronize,
)

__all__ = [
    "BoolTensor",
    "ByteTensor",
    "DoubleTensor",
    "Event",
    "FloatTensor",
    "HalfTensor",
    "IntTensor",
    "LongTensor",
    "RemoteError",
    "RemoteTensor",
    "Stream",
    "arange",
    "current_node",
    "current_stream",
    "empty",
    "full",
    "held_tensors",
    "node",
    "ones",
    "rand",
    "randn",
    "send",
    "stream",
    "synchronize",
    "tensor",
    "zeros",
]


def zeros(*size: Any, **kwargs: Any) -> RemoteTensor:
    """``torch.zeros`` on the current worker (``node=`` to pick one)."""
    return factory(torch.zeros, size, kwargs)


def ones(*size: Any, **kwargs: Any) -> RemoteTensor:
    """``torch.ones`` on the current worker (``node=`` to pick one)."""
    return factory(torch.ones, size, kwargs)


def empty(*size: Any, **kwargs: Any) -> RemoteTensor:
    """``torch.empty`` on the current worker (``node=`` to pick one)."""
    return factory(torch.empty, size, kwargs)


def full(size: Any, fill_value: Any, **kwargs: Any) -> RemoteTensor:
    """``torch.full`` on the current worker (``node=`` to pick one)."""
    return factory(torch.full, (size, fill_value), kwargs)


def rand(*size: Any, **kwargs: Any) -> RemoteTensor:
    """``torch.rand`` on the current worker, from the worker's generator."""
    return factory(torch.rand, size, kwargs)


def randn(*size: Any, **kwargs: Any) -> RemoteTensor:
    """``torch.randn`` on the current worker, from the worker's generator."""
    return factory(torch.randn, size, kwargs)


def arange(*args: Any, **kwargs: Any) -> RemoteTensor:
    """``torch.arange`` on the current worker (``node=`` to pick one)."""
    return factory(torch.arange, args, kwargs)


def tensor(data: Any, **kwargs: Any) -> RemoteTensor:
    """``torch.tensor(data)`` made on the current worker (``data`` travels with the order)."""
    return factory(torch.tensor, (data,), kwargs)


def _typed(dtype: torch.dtype, name: str) -> Any:
    def make(*size: Any, device: Any = None, node: int | None = None) -> RemoteTensor:
        if any(not isinstance(n, int) or isinstance(n, bool) for n in size):
            raise ArgumentError(f"{name} takes sizes (ints), got {size!r}")
        return factory(torch.empty, size, {"dtype": dtype, "device": device, "node": node})

    make.__name__ = make.__qualname__ = name
    make.__doc__ = (
        f"An uninitialised {dtype} tensor on a worker, as the original design's "
        f"``torch.distributed.{name}(*size)``; ``device=1`` puts it on ``cuda:1`` there."
    )
    return make


FloatTensor = _typed(torch.float32, "FloatTensor")
DoubleTensor = _typed(torch.float64, "DoubleTensor")
HalfTensor = _typed(torch.float16, "HalfTensor")
LongTensor = _typed(torch.int64, "LongTensor")
IntTensor = _typed(torch.int32, "IntTensor")
ByteTensor = _typed(torch.uint8, "ByteTensor")
BoolTensor = _typed(torch.bool, "BoolTensor")
