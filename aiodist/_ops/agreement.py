"""The one agreement: what every rank of a collective must agree on, and the check.

A collective's **signature** is the plain data its ranks must share: the
operation, the dtype, the shape, the reduce op, the root, and which algorithm
it runs (``signature``). Every message of a collective carries its sender's
signature as its ``meta``, and every receive checks it the moment the message
is in (``check``): a rank that finds another signature breaks the group with
``CollectiveMismatchError``, which every member hears at once (the group's
``PEER_ERROR``), instead of waiting or reducing garbage.

That catches every disagreement, on every rank, only if

1. ranks that disagree are sure to meet on some message: the **opening**. In
   every collective, rank ``r`` sends a message to ``r + 1`` at step ``OPEN``
   before it waits for anything, and posts the receive of ``r - 1``'s before
   it waits for anything. Two neighbours that called different things at the
   same place in the group's order (or the same thing with other arguments)
   meet there, whatever algorithms they picked; if any two ranks disagree,
   some two neighbours do. The rank that finds out breaks the group.
2. no rank reports success before it knows that every rank agreed: a rank
   completes only once it heard, directly or through messages sent after
   their senders heard, from every rank. Every message is checked on arrival,
   and a rank that finds a mismatch sends nothing more.

Algorithms in which every rank's data reaches every rank (all-reduce,
all-gather, reduce-scatter, all-to-all, barriers) have both by their own
messages: their first round sends to ``r + 1`` at step ``OPEN`` (a direct
exchange, a dissemination's first round, a ring's clear-to-send, a shared
memory segment's name), so the opening rides on it at no cost. One-way
algorithms (broadcast, gather, scatter, reduce, their object forms) run a
barrier on the signature beside their data instead (``Exchange``): one round
of header-only messages up to 3 ranks, ``log2 size`` rounds from 4.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import CollectiveMismatchError

if TYPE_CHECKING:
    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._plane.receives import Received

#: The step of the opening message of every collective (see the module docstring).
OPEN: Final = 0
#: Steps ``AGREE + k`` are the later rounds of a one-way operation's agreement.
AGREE: Final = 1 << 20
#: The signature's fields, in the order they are compared and reported.
FIELDS: Final = ("op", "dtype", "shape", "reduce_op", "root", "algorithm")

#: A signature as it travels: one value per field of ``FIELDS``.
Signature = list[Any]

_dtype_names: dict[Any, str] = {}


def dtype_name(t: torch.Tensor) -> str:
    """``float32`` for a float32 tensor (cached: called on every small message's path)."""
    dtype = t.dtype
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


def signature(
    op: str,
    tensor: torch.Tensor | None = None,
    *,
    shape: list[int] | None = None,
    reduce_op: str | None = None,
    root: int | None = None,
    algorithm: str | None = None,
) -> Signature:
    """The facts every rank of a collective must agree on, as plain data.

    ``tensor`` gives the dtype and shape; ``shape`` alone serves what has no
    tensor (an object list's length). ``root`` is a group rank.
    """
    if tensor is None:
        return [op, None, shape, reduce_op, root, algorithm]
    return [op, dtype_name(tensor), list(tensor.shape), reduce_op, root, algorithm]


def check(g: ProcessGroup, mine: Signature, msg: Received) -> None:
    """Raise ``CollectiveMismatchError`` if ``msg`` came from a rank that disagrees.

    A message may carry one value after the signature (``Exchange.send_now``'s
    ``extra``: what differs from pair to pair, such as an all_to_all part's shape).
    """
    theirs = msg.meta
    if theirs == mine:
        return
    if type(theirs) is list and len(theirs) == len(mine) + 1 and theirs[:-1] == mine:
        return
    raise mismatch(g, mine, theirs, msg.src)


def mismatch(g: ProcessGroup, mine: Signature, theirs: Any, src: int) -> CollectiveMismatchError:
    """The error for global rank ``src``'s signature ``theirs``: the first field that differs."""
    who = g.ranks.index(src) if src in g.ranks else src
    if type(theirs) is list:
        for name, a, b in zip(FIELDS, mine, theirs, strict=False):
            if a != b:
                values = {g.rank: a, who: b}
                shown = ", ".join(f"rank {r}: {v!r}" for r, v in sorted(values.items()))
                return CollectiveMismatchError(
                    f"ranks disagree on the {name} of collective {mine[0]!r} in group "
                    f"{g.name!r}: {shown}. Call collectives in the same order with matching "
                    "arguments on every rank.",
                    field=name,
                    values_by_rank=values,
                )
    return CollectiveMismatchError(
        f"rank {who} sent {theirs!r} for collective {mine!r} in group {g.name!r}",
        field="op",
        values_by_rank={g.rank: mine, who: theirs},
    )
