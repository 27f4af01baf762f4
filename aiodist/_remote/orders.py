"""What the master tells a worker in master-worker mode, and what comes back.

The master sends each worker its orders in batches, one object message
(``Tag.REMOTE_ORDERS``) per batch, in issue order. An order is a tuple whose
first item is its ``Kind``:

- ``(OP, stream, func, args, kwargs, outs, whole, what)``: run ``func(*args,
  **kwargs)`` on ``stream``; in the arguments a ``Ref`` stands for a tensor of
  this worker and a ``Moved`` for one that another worker pushes here. ``outs``
  names the tensors of the result, in ``tree_flatten`` order (None: an input
  changed in place, already known); with ``whole``, ``outs``' one id names the
  whole result (its shape was not known in advance). ``what`` names the
  operation in errors.
- ``(FREE, ids)``: the master dropped its last handle to these tensors.
- ``(PUSH, stream, id, dst, transfer)``: send tensor ``id`` to worker ``dst``.
- ``(FETCH, stream, id, request)``: send tensor ``id`` to the master.
- ``(RECORD, stream, event)``: the event is reached once the stream gets here.
- ``(WAIT, stream, event, node)``: the stream waits for ``event`` of ``node``.
- ``(NOTIFY, event, node, request)``: tell ``node`` (the master with
  ``request``) once ``event`` is reached here; not ordered on a stream.
- ``(SYNC, request)``: answer once every stream got here, with the errors of
  the operations that failed since the last ``SYNC``.
- ``(QUERY, event, request)``: answer at once whether ``event`` is reached here.
- ``(HELD, request)``: answer once every stream got here, with how many tensors
  (and errors in their place) this worker holds.
- ``(STOP, request)``: answer once every stream got here, and stop serving.

Workers answer the master (``Tag.REMOTE_REPLIES``) with ``(request, value,
error)``, and tell each other (``Tag.REMOTE_TRANSFERS``) ``(TENSOR, transfer,
tensor, device, error)`` or ``(EVENT, event)``. Only ranks of the job send
these (they proved its token); the master is trusted as a remote call's caller is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from collections.abc import Callable


class Kind(enum.IntEnum):
    OP = 0
    FREE = 1
    PUSH = 2
    FETCH = 3
    RECORD = 4
    WAIT = 5
    NOTIFY = 6
    SYNC = 7
    STOP = 8
    HELD = 9
    QUERY = 10


#: Kinds of messages between workers.
TENSOR: Final = 0
EVENT: Final = 1


@dataclass(frozen=True, slots=True)
class Ref:
    """A tensor of the worker that runs the order."""

    id: int


@dataclass(frozen=True, slots=True)
class Moved:
    """A tensor that worker ``src`` pushes to the one that runs the order (``transfer``)."""

    transfer: int
    src: int


def keep(value: Any) -> Any:
    """The operation of ``aiodist.remote.send``: the tensor as it arrived."""
    return value


Rebuild: TypeAlias = "Callable[[list[Any]], tuple[tuple[Any, ...], dict[str, Any]]]"


def flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Rebuild]:
    """The leaves of a call's arguments, and how to put new ones in their places.

    Most calls have no nested arguments: their leaves are the arguments
    themselves (a pytree pass costs far more than the rest of an operation here).
    """
    if not any(type(x) in NESTED for x in args) and not any(
        type(x) in NESTED for x in kwargs.values()
    ):
        keys, k = tuple(kwargs), len(args)

        def flat(leaves: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            return tuple(leaves[:k]), dict(zip(keys, leaves[k:], strict=True))

        return [*args, *kwargs.values()], flat
    leaves, spec = tree_flatten((args, kwargs))

    def nested(new: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        rebuilt: tuple[tuple[Any, ...], dict[str, Any]] = tree_unflatten(new, spec)
        return rebuilt

    return leaves, nested


NESTED: Final = frozenset({tuple, list, dict})
