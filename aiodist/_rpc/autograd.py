"""Distributed autograd: gradients that flow back along the remote calls that carried tensors.

torch's design (``torch.distributed.autograd``), on aiodist's remote calls:

- **Contexts.** ``dist_autograd.context()`` makes a context with an id unique
  in the rpc world (``rank << 48 | n``) and makes it current for the code
  inside (a context variable: per thread, per task). A call made while a
  context is current carries its id (as torch's Python calls do, whether or
  not its arguments require grad: its result may); the callee
  runs the function within the same context (made there on first sight), so
  the calls it makes carry it on, and its reply carries it back.
- **Send and recv.** Tensors that require grad travel set aside (never
  pickled), flagged. The sender keeps them in the context under a send id
  (a *send*: where gradients for them will arrive); the receiver makes them
  fresh leaves behind an identity function, ``_RecvBackward``, so the
  tensors the function gets are ordinary non-leaf tensors of its graph, and
  records which leaves came from which send (a *recv*).
- **Backward.** ``dist_autograd.backward(context_id, roots)`` runs a local
  pass from the roots (``torch.autograd.backward``, with the leaves' ``.grad``
  set aside under a lock and restored after, so that nothing outside the
  context sees a gradient, while hooks on the leaves, such as DDP's, run as
  they do in torch's engine). The gradients that reach parameters and other
  leaves are accumulated in the context (``get_gradients``); those that
  reach a recv's leaves go to the rank that sent them, as a remote call of
  ``_propagate``, which runs a local pass there from that send's tensors,
  and so on. Each call answers once its pass and the calls that pass made
  are done, so ``backward`` returns once the whole graph is done.
- **Release.** Leaving the context drops it here and on every rank it
  reached (each tells the ranks it reached in turn).

One difference from torch's engine, which runs one graph task per context
and rank: here each gradient that arrives runs a pass of its own. Backward is
linear, so the gradients are the same; passes keep the graph (``retain_graph``
internally) because two sends may share part of it. The graph is freed with
the tensors that hold it (the context's sends, the program's own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiodist._rpc.agent import default_agent
from aiodist._rpc.calls import prepare
from aiodist._rpc.contexts import CURRENT, Context, context_of, drop, local_pass
from aiodist._rpc.serve import ASYNC_MARK
from aiodist._rpc.wire import Op

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from aiodist._rpc.agent import Agent


def exit_context(ctx: Context, agent: Agent | None) -> None:
    """Leave ``ctx``: not current any more, dropped here and on the ranks it reached."""
    if CURRENT.get() is ctx:
        CURRENT.set(None)
    _release(ctx.id, agent)


def _release(context_id: int, agent: Agent | None) -> None:
    ctx = drop(context_id)
    if ctx is None or agent is None:
        return
    for rank in sorted(ctx.known):
        if rank == agent.rank:
            continue
        try:
            request = prepare(
                agent,
                Op.CALL,
                rank,
                _release_here,
                (context_id,),
                None,
                None,
                "dist_autograd.release",
            )
            agent.launch(request)  # nobody waits: a rank that stopped serving has nothing to drop
        except Exception:
            return


def _release_here(context_id: int) -> None:
    """Drop context ``context_id`` on this rank and on the ranks it reached (a remote call)."""
    _release(context_id, default_agent("dist_autograd"))


def propagate(agent: Agent, ctx: Context, onward: list[tuple[int, int, list[Any]]]) -> list[Any]:
    """Send each rank its gradients (``local_pass``'s); the calls' handles (torch Futures)."""
    token = CURRENT.set(None)  # gradients are no part of the graph: they carry no context
    try:
        return [
            agent.call(
                prepare(
                    agent,
                    Op.CALL,
                    rank,
                    _propagate,
                    (ctx.id, send, grads),
                    None,
                    None,
                    f"dist_autograd.backward(context {ctx.id}) to rank {rank}",
                )
            )
            for rank, send, grads in onward
        ]
    finally:
        CURRENT.reset(token)


def _propagate(context_id: int, send: int, grads: list[Any]) -> Any:
    """Gradients for send ``send`` arrived (a remote call): run the pass here, then onwards.

    Marked ``async_execution``: the thread is free while the ranks it sends to work.
    """
    import torch

    ctx = context_of(context_id)
    sent = ctx.sends.get(send)
    if sent is None:
        raise RuntimeError(f"autograd context {context_id} has no send {send} on this rank")
    pairs = [(t, g) for t, g in zip(sent, grads, strict=True) if g is not None]
    done: Any = torch.futures.Future()
    if not pairs:
        done.set_result(None)
        return done
    onward = local_pass(ctx, [t for t, _ in pairs], [g for _, g in pairs])
    if not onward:
        done.set_result(None)
        return done
    return torch.futures.collect_all(propagate(default_agent("dist_autograd"), ctx, onward)).then(
        _check_all
    )


setattr(_propagate, ASYNC_MARK, _propagate)


def _check_all(collected: Any) -> None:
    for fut in collected.value():
        fut.value()  # raises the first error


def backward(agent: Agent, context_id: int, roots: Sequence[torch.Tensor]) -> list[Any]:
    """The initiator's pass (``dist_autograd.backward``); the handles of the calls it started.

    Raises:
        RuntimeError: No such context here.
        TypeError, ValueError: A root is not a scalar tensor that requires grad.
    """
    import torch

    ctx = context_of(context_id)
    if isinstance(roots, torch.Tensor) or not roots:
        raise TypeError("roots must be a non-empty list of tensors")
    for root in roots:
        if not isinstance(root, torch.Tensor):
            raise TypeError(f"roots must be tensors, got {type(root).__name__}")
        if not root.requires_grad:
            raise RuntimeError(
                "element 0 of tensors does not require grad and does not have a grad_fn"
            )
        if root.numel() != 1:
            raise ValueError(
                f"every root must be a scalar (one element), got shape {list(root.shape)}"
            )
    onward = local_pass(ctx, list(roots), [torch.ones_like(r) for r in roots])
    return propagate(agent, ctx, onward) if onward else []
