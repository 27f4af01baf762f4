"""Distributed autograd's contexts, and what the messages of remote calls record in them.

The mechanism is described in ``autograd``; this module holds its state on
one rank: the contexts by id, the current one (a context variable: per
thread, per task), the sends and recvs messages record (``outgoing`` on the
way out, ``incoming`` on the way in), and the local pass that runs backward
on this rank and says which gradients go on to which rank.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

# Context ids: the rank in the high bits, as torch's (worker id << 48).
_ID_BITS: Final = 48
#: Held while a pass sets leaves' ``.grad`` aside, and while DistributedOptimizer steps.
GRAD_LOCK: Final = threading.Lock()
#: The context the running code is in (torch's thread-local current context).
CURRENT: contextvars.ContextVar[Context | None] = contextvars.ContextVar(
    "aiodist_dist_autograd", default=None
)

_numbers = itertools.count(1)  # context numbers and send ids of this process
_contexts: dict[int, Context] = {}
_contexts_lock = threading.Lock()


class _Recv:
    """Tensors one message brought: the leaves behind their ``_RecvBackward``."""

    __slots__ = ("leaves", "send", "src")

    def __init__(self, src: int, send: int, leaves: list[torch.Tensor]) -> None:
        self.src, self.send, self.leaves = src, send, leaves


class Context:
    """One distributed autograd context on this rank."""

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.sends: dict[int, list[torch.Tensor]] = {}
        self.recvs: dict[int, tuple[_Recv, int]] = {}  # id(leaf) -> (its recv, its index)
        self.known: set[int] = set()  # ranks this context's messages went to
        self.lock = threading.Lock()

    def record_send(self, tensors: list[torch.Tensor], dst: int) -> int:
        send = next(_numbers)
        with self.lock:
            self.sends[send] = tensors
            self.known.add(dst)
        return send

    def record_recv(self, recv: _Recv) -> None:
        with self.lock:
            for i, leaf in enumerate(recv.leaves):
                self.recvs[id(leaf)] = (recv, i)

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        with self.lock:
            held = self.grads.get(leaf)
            self.grads[leaf] = grad if held is None else held + grad


# --- contexts ---------------------------------------------------------------------------


def enter(rank: int) -> Context:
    """A new context, current from now on (``dist_autograd.context().__enter__``).

    Raises:
        RuntimeError: A context is current already (torch allows one per thread).
    """
    if CURRENT.get() is not None:
        raise RuntimeError(
            "a distributed autograd context is current already; leave it before entering another"
        )
    ctx = Context((rank << _ID_BITS) | next(_numbers))
    with _contexts_lock:
        _contexts[ctx.id] = ctx
    CURRENT.set(ctx)
    return ctx


def context_of(context_id: int) -> Context:
    """The context ``context_id`` on this rank.

    Raises:
        RuntimeError: This rank has none (torch's message).
    """
    ctx = _contexts.get(context_id)
    if ctx is None:
        raise RuntimeError(f"Could not find autograd context with id: {context_id}")
    return ctx


def _get_or_make(context_id: int) -> Context:
    with _contexts_lock:
        ctx = _contexts.get(context_id)
        if ctx is None:
            ctx = _contexts[context_id] = Context(context_id)
        return ctx


def within(ctx: Context, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with ``ctx`` current (a served call, in its rpc thread)."""
    token = CURRENT.set(ctx)
    try:
        return fn(*args, **kwargs)
    finally:
        CURRENT.reset(token)


def drop(context_id: int) -> Context | None:
    """Forget context ``context_id`` on this rank; it, if it was here."""
    with _contexts_lock:
        return _contexts.pop(context_id, None)


# --- messages: what a call carries, and what its receiver makes of it -------------------


def outgoing(
    ctx: Context | None, tensors: list[torch.Tensor], dst: int, *, force: bool
) -> list[Any] | None:
    """The autograd part of a message to ``dst`` whose set-aside tensors are ``tensors``.

    ``[context id, send id (0: none), indices of the tensors that require grad]``,
    or None when the message carries no context (none is current, or nothing
    in it requires grad and ``force`` is off). Records the send.
    """
    if ctx is None:
        return None
    flags = [i for i, t in enumerate(tensors) if t.requires_grad]
    if not flags and not force:
        return None
    send = 0
    if flags:
        send = ctx.record_send([tensors[i] for i in flags], dst)
    else:
        with ctx.lock:
            ctx.known.add(dst)
    return [ctx.id, send, flags]


def parse_meta(meta: Any, tensors: int) -> tuple[int, int, list[int]]:
    """Check the autograd part of a message that set ``tensors`` tensors aside.

    Raises:
        ValueError: It is malformed.
    """
    if not (isinstance(meta, list) and len(meta) == 3):
        raise ValueError(f"malformed distributed autograd metadata: {meta!r}")
    context_id, send, flags = meta
    if type(context_id) is not int or type(send) is not int or not isinstance(flags, list):
        raise ValueError(f"malformed distributed autograd metadata: {meta!r}")
    if any(type(i) is not int or not 0 <= i < tensors for i in flags):
        raise ValueError(f"distributed autograd flags {flags!r} for {tensors} tensors")
    if flags and send <= 0:
        raise ValueError(f"distributed autograd metadata without a send id: {meta!r}")
    return context_id, send, flags


def incoming(meta: Any, src: int, tensors: list[torch.Tensor]) -> Context:
    """Take the autograd part of a message from ``src``: its context, its tensors in the graph.

    The flagged tensors of ``tensors`` are replaced, in place, by the outputs
    of a ``_RecvBackward`` whose inputs are fresh leaves (recorded as a recv).

    Raises:
        ValueError: The metadata is malformed.
    """
    context_id, send, flags = parse_meta(meta, len(tensors))
    ctx = _get_or_make(context_id)
    if flags:
        leaves = [tensors[i].requires_grad_() for i in flags]
        outputs = _recv_function().apply(*leaves)
        if len(flags) == 1:
            outputs = (outputs,)
        for i, out in zip(flags, outputs, strict=True):
            tensors[i] = out
        ctx.record_recv(_Recv(src, send, leaves))
    return ctx


_RECV: Any = None


def _recv_function() -> Any:
    """``_RecvBackward``: identity forward, identity backward (made on first use: torch)."""
    global _RECV
    if _RECV is None:
        import torch

        class _RecvBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *leaves: torch.Tensor) -> Any:
                ctx.set_materialize_grads(False)  # an unused output sends nothing back
                outs = tuple(leaf.detach() for leaf in leaves)  # the leaves' memory, no copy
                return outs[0] if len(outs) == 1 else outs

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                return grads

        _RECV = _RecvBackward
    return _RECV


# --- backward ---------------------------------------------------------------------------


def _leaves(roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves that require grad reachable from ``roots``, each once."""
    found: dict[int, torch.Tensor] = {}
    seen: set[Any] = set()
    stack: list[Any] = []
    for root in roots:
        if root.grad_fn is None:
            found[id(root)] = root
        else:
            stack.append(root.grad_fn)
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            if variable is not None:  # AccumulateGrad: a leaf
                found[id(variable)] = variable
            else:
                stack.append(nxt)
    return list(found.values())


def local_pass(
    ctx: Context, roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> list[tuple[int, int, list[torch.Tensor | None]]]:
    """Run backward here from ``roots``; the gradients to send on: ``(rank, send, grads)``."""
    import torch

    leaves = _leaves(roots)
    with GRAD_LOCK:
        kept = [leaf.grad for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None
        try:
            torch.autograd.backward(list(roots), list(grads), retain_graph=True)
            got = [leaf.grad for leaf in leaves]
        finally:
            for leaf, grad in zip(leaves, kept, strict=True):
                leaf.grad = grad
    onward: dict[int, tuple[_Recv, list[torch.Tensor | None]]] = {}
    for leaf, grad in zip(leaves, got, strict=True):
        if grad is None:
            continue
        hit = ctx.recvs.get(id(leaf))
        if hit is None:
            ctx.accumulate(leaf, grad)
            continue
        recv, index = hit
        entry = onward.get(id(recv))
        if entry is None:
            entry = onward[id(recv)] = (recv, [None] * len(recv.leaves))
        entry[1][index] = grad
    return [(recv.src, recv.send, sent) for recv, sent in onward.values()]
