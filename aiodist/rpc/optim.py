"""``DistributedOptimizer`` over ``aiodist.rpc`` (torch's ``torch.distributed.optim``).

A program written for torch changes ``from torch.distributed.optim import
DistributedOptimizer`` to ``from aiodist.rpc.optim import DistributedOptimizer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiodist._rpc.contexts import GRAD_LOCK, context_of
from aiodist.rpc import RRef, rpc_async
from aiodist.rpc.dist_autograd import get_gradients

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer:
    """An optimizer of parameters that live on many workers, stepped with a context's gradients.

    Each worker that owns some of the parameters gets a local optimizer of
    ``optimizer_class`` over them (made there at construction); ``step``
    has each apply the gradients the distributed autograd context holds on
    that worker. Parameters with no gradient in the context are left as they
    are (as torch's functional optimizers do), and ``.grad`` is left alone.
    Steps on one worker are serialised (many trainers may step one parameter
    server), and never overlap a backward pass there. Plain code: it blocks,
    as torch's does.

    Args:
        optimizer_class: A ``torch.optim.Optimizer`` class, importable on every owner.
        params_rref: ``RRef``s to the parameters (``RRef(param)`` for local ones;
            ``RemoteModule.remote_parameters()``; RRefs returned by remote calls).
        *args: Passed to ``optimizer_class`` on each owner.
        **kwargs: Passed to ``optimizer_class`` on each owner.

    Example:
        >>> opt = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.05)
        >>> with dist_autograd.context() as cid:
        ...     dist_autograd.backward(cid, [loss])
        ...     opt.step(cid)
    """

    def __init__(
        self,
        optimizer_class: type[Any],
        params_rref: Sequence[RRef[Any]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        by_owner: dict[int, list[RRef[Any]]] = {}
        for rref in params_rref:
            by_owner.setdefault(rref.owner().id, []).append(rref)
        futures = [
            rpc_async(owner, _new_local_optimizer, (optimizer_class, rrefs, *args), kwargs)
            for owner, rrefs in by_owner.items()
        ]
        self.remote_optimizers: list[RRef[_LocalOptimizer]] = _wait_for_all(futures)

    def step(self, context_id: int) -> None:
        """Apply the gradients of context ``context_id`` on every owner; block until done.

        Raises:
            RuntimeError: No such context on this rank.
            Exception: What a worker's step raised.
        """
        context_of(context_id)
        _wait_for_all(
            [
                rpc_async(optim.owner().id, _local_optimizer_step, (optim, context_id))
                for optim in self.remote_optimizers
            ]
        )


class _LocalOptimizer:
    """The optimizer of one worker's parameters (kept there, behind an RRef)."""

    def __init__(
        self,
        optimizer_class: type[Any],
        params_rref: Sequence[RRef[Any]],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.params: list[torch.Tensor] = [rref.local_value() for rref in params_rref]
        self.optim = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = get_gradients(context_id)
        with GRAD_LOCK:  # the gradients stand in .grad for the step only
            kept = [p.grad for p in self.params]
            try:
                for p in self.params:
                    p.grad = grads.get(p)
                self.optim.step()
            finally:
                for p, grad in zip(self.params, kept, strict=True):
                    p.grad = grad


def _new_local_optimizer(
    optimizer_class: type[Any], params_rref: Sequence[RRef[Any]], *args: Any, **kwargs: Any
) -> RRef[_LocalOptimizer]:
    return RRef(_LocalOptimizer(optimizer_class, params_rref, *args, **kwargs))


def _local_optimizer_step(optim: RRef[_LocalOptimizer], context_id: int) -> None:
    optim.local_value().step(context_id)


def _wait_for_all(futures: list[Any]) -> list[Any]:
    """Every future's value; the last error raised once all are done (torch's)."""
    results: list[Any] = []
    error: Exception | None = None
    for future in futures:
        try:
            results.append(future.wait())
        except Exception as exc:
            results.append(exc)
            error = exc
    if error is not None:
        raise error
    return results
