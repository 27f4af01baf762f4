"""Hand-written blocking twins of the few public names that return async objects.

``aiodist.sync`` is generated from the async API; a query such as ``get_store``
is re-exported there unchanged unless it hands back something whose methods
are coroutines. Those names get a twin here, and ``gen_sync`` imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiodist._group.world import get_store as _get_store
from aiodist._ops import staging
from aiodist._ops.p2p import batch_isend_irecv as _batch_isend_irecv
from aiodist._sync import portal

if TYPE_CHECKING:
    from datetime import timedelta

    from aiodist._control.store import Store
    from aiodist._group.work import Work
    from aiodist._ops.p2p import P2POp

__all__ = ["BlockingStore", "batch_isend_irecv", "get_store"]


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
