"""Hand-written twins of the few public names that answer plain code otherwise.

``aiodist.sync`` is generated from the async API; a query such as ``get_store``
is re-exported there unchanged unless it hands back something whose methods
are coroutines, or, for ``group.WORLD``, an aiodist group where plain torch
code needs torch's. Those names get a twin here, and ``gen_sync`` imports it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from aiodist._group import world
from aiodist._group.world import as_group, get_default_group
from aiodist._group.world import get_store as _get_store
from aiodist._ops import staging
from aiodist._ops.p2p import batch_isend_irecv as _batch_isend_irecv
from aiodist._sync import portal

if TYPE_CHECKING:
    from datetime import timedelta

    from aiodist._control.store import Store
    from aiodist._group.work import Work
    from aiodist._ops.p2p import P2POp

__all__ = ["BlockingStore", "GroupMember", "batch_isend_irecv", "get_store", "group"]


def torch_world() -> object:
    """The default group as plain torch code holds it.

    torch's default group when it rides aiodist's (``init_process_group`` made it
    so): a torch ``ProcessGroup`` that ``DistributedDataParallel`` and torch's
    functions take, and every ``aiodist.sync`` call too (``as_group``). Else,
    as in the async API, aiodist's default group; None when not initialised.
    """
    g = get_default_group()
    torch_dist = sys.modules.get("torch.distributed")
    if g is None or torch_dist is None or not torch_dist.is_initialized():
        return g
    pg = torch_dist.GroupMember.WORLD
    try:
        return pg if as_group(pg) is g else g
    except TypeError:  # torch's own group of another job
        return g


class GroupMember(world.GroupMember):
    """torch.distributed's group constants; ``WORLD`` is torch's default group (``torch_world``)."""

    _world = staticmethod(torch_world)


class group(world.group):
    """``group.WORLD``: torch's default group over aiodist's job (``torch_world``).

    Example:
        >>> model = DistributedDataParallel(model, process_group=aiodist.sync.group.WORLD)
    """

    _world = staticmethod(torch_world)


class BlockingStore:
    """The job's key-value store for plain code: ``Store``'s operations, blocking.

    Each call runs on aiodist's loop thread and returns its result, as
    ``torch.distributed.TCPStore`` does. Calling it on that thread raises
    ``RuntimeError`` (use the async ``Store`` there).

    Example:
        >>> store = aiodist.sync.get_store()
        >>> store.set("ready/0", "1")
        >>> store.wait(["ready/0", "ready/1"], timeout=60)
    """

    def __init__(self, store: Store) -> None:
        self.store = store  # the async Store, for code on the loop thread

    def set(self, key: str, value: str | bytes) -> None:
        """Set ``key`` to ``value`` (``str`` is encoded as UTF-8)."""
        portal.call(self.store.set, key, value)

    def get(self, key: str, timeout: float | timedelta | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` for it to be set."""
        return portal.call(self.store.get, key, timeout)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 if unset); return the new value."""
        return portal.call(self.store.add, key, amount)

    def wait(self, keys: list[str], timeout: float | timedelta | None = None) -> None:
        """Wait until every key in ``keys`` is set."""
        portal.call(self.store.wait, keys, timeout)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the value now stored."""
        return portal.call(self.store.compare_set, key, expected, desired)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return portal.call(self.store.delete_key, key)

    def num_keys(self) -> int:
        """Number of keys set in the job's store."""
        return portal.call(self.store.num_keys)

    def check(self, keys: list[str]) -> bool:
        """True if every key in ``keys`` is set (does not wait)."""
        return portal.call(self.store.check, keys)


def get_store() -> BlockingStore:
    """The job's key-value store, with blocking methods (see ``aiodist.get_store``).

    Raises:
        RuntimeError: Not initialised.
    """
    return BlockingStore(_get_store())


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work[Any]]:
    """Start every send and receive of ``p2p_op_list`` in order; return their running handles.

    The blocking twin of ``aiodist.batch_isend_irecv``: the operations start
    on aiodist's loop thread (in list order, with this thread's CUDA streams),
    and each handle's ``.wait()`` works from any thread.

    Example:
        >>> for w in aiodist.sync.batch_isend_irecv(ops): w.wait()
    """
    captured = staging.capture([p2p_op_list], {})
    with staging.caller_context(captured):
        return portal.run_sync(_batch_isend_irecv, p2p_op_list)
