"""Distributed autograd over ``aiodist.rpc`` (torch's ``torch.distributed.autograd``).

A program written for torch changes ``import torch.distributed.autograd as
dist_autograd`` to ``import aiodist.rpc.dist_autograd as dist_autograd``::

    with dist_autograd.context() as context_id:
        out = rpc.rpc_sync("ps", forward, (ps_rref, x))    # the graph spans the ranks
        loss = loss_fn(out, y)
        dist_autograd.backward(context_id, [loss])        # gradients flow back over rpc
        grads = dist_autograd.get_gradients(context_id)   # {tensor: gradient}, this rank's
        opt.step(context_id)                               # DistributedOptimizer

Within a context, every remote call that carries tensors which require grad
records where they went, and the tensors a call brings in are part of the
receiver's graph; ``backward`` runs the local graph, sends the gradients that
reach those tensors back to the rank that sent them, which runs its part, and
so on, then returns once every rank's part is done. Gradients are kept in the
context on each rank (``get_gradients``), not in ``.grad``, so concurrent
contexts (many trainers sharing a parameter server) never mix. The gradients
are torch's for the same model and inputs.

As torch's: one context at a time per thread; a remote function runs within
its caller's context; leaving the context drops it on every rank it reached.
Unlike torch's, ``backward`` keeps the graph (``retain_graph`` is accepted
and always true): a tensor sent twice, or both sent and used here, needs its
graph for every pass; it is freed with the tensors that hold it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiodist._group.work import Work
from aiodist._rpc import autograd
from aiodist._rpc.agent import default_agent
from aiodist._rpc.contexts import context_of, enter

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import TracebackType

    import torch

    from aiodist._rpc.agent import Agent
    from aiodist._rpc.contexts import Context

__all__ = ["backward", "context", "get_gradients"]


class context:
    """A distributed autograd context: ``with dist_autograd.context() as context_id:``.

    Raises:
        RuntimeError: (on entering) rpc is not initialised, or a context is
            current already in this thread (or task).
    """

    def __init__(self) -> None:
        self._context: Context | None = None
        self._agent: Agent | None = None

    def __enter__(self) -> int:
        self._agent = default_agent("dist_autograd.context")
        self._context = enter(self._agent.rank)
        return self._context.id

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._context is not None:
            autograd.exit_context(self._context, self._agent)
            self._context = None


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> Any:
    """Run backward from ``roots`` through every rank the context's calls reached.

    Gradients of this rank's leaves (parameters, tensors made with
    ``requires_grad=True``) accumulate in the context here, those of other
    ranks' leaves there; ``.grad`` is left alone.

    Args:
        context_id: The context (``with dist_autograd.context() as context_id``).
        roots: Scalar tensors to start from (each with gradient 1), e.g. ``[loss]``.
        retain_graph: Accepted for torch's signature; the graph is always kept.

    Returns:
        None once done, in plain code (it blocks, as torch's does); in async code,
        a ``Work`` to await (the local part runs in a worker thread).

    Raises:
        RuntimeError: No such context on this rank; a root does not require grad.
        ValueError: A root is not a scalar.
        Exception: What a rank's part raised (a failed rank: ``RankFailedError``).

    Example:
        >>> with dist_autograd.context() as cid:
        ...     loss = rpc.rpc_sync("worker1", model_forward, (x,)).sum()
        ...     dist_autograd.backward(cid, [loss])
    """
    agent = default_agent("dist_autograd.backward")
    if agent.in_async_code():
        return Work(asyncio.ensure_future(_backward(agent, context_id, roots)), "backward")
    for fut in autograd.backward(agent, context_id, roots):
        fut.wait()
    return None


async def _backward(agent: Agent, context_id: int, roots: Sequence[torch.Tensor]) -> None:
    # The local pass in a thread (it computes); its calls are then torch Futures to await.
    for fut in await asyncio.to_thread(autograd.backward, agent, context_id, roots):
        await fut


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients accumulated in the context on this rank: ``{tensor: gradient}``.

    Raises:
        RuntimeError: No such context on this rank.
    """
    ctx = context_of(context_id)
    with ctx.lock:
        return dict(ctx.grads)
