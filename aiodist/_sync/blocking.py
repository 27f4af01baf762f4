"""Hand-written twins of the few public names that answer plain code otherwise.

``aiodist.sync`` is generated from the async API; a query such as ``get_store``
is re-exported there unchanged unless it hands back something whose methods
are coroutines, or, for ``group.WORLD``, an aiodist group where plain torch
code needs torch's. Those names get a twin here, and ``gen_sync`` imports it.
"""

from __future__ import annotations

import datetime
import sys
from typing import TYPE_CHECKING, Any

from aiodist._group import world
from aiodist._group.world import as_group, get_default_group
from aiodist._group.world import get_store as _get_store
from aiodist._ops import groups as _groups
from aiodist._ops import staging
from aiodist._ops.p2p import batch_isend_irecv as _batch_isend_irecv
from aiodist._sync import portal

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import timedelta

    from aiodist._control.store import Store
    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._ops.p2p import P2POp


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


def _as_torch(made: ProcessGroup, timeout: float | timedelta | None, desc: str | None) -> Any:
    """torch's group over ``made`` where torch's default group is over aiodist's job, else ``made``.

    Members get torch's group (``DistributedDataParallel`` takes it), the
    others torch's ``GroupMember.NON_GROUP_MEMBER``, on which every call does
    nothing, as in torch. On the ``aiodist`` backend, torch's ``new_group``
    runs here on every rank, as aiodist's did, and its group rides ``made``
    itself; bridged to another backend, aiodist's ``new_group`` made torch's.
    """
    default = get_default_group()
    if default is None or torch_world() is default:  # no torch group over aiodist's job
        return made
    if default.bridge is not None:  # torch's group came up with aiodist's (backend="gloo")
        bridge = made.bridge
        return world.GroupMember.NON_GROUP_MEMBER if bridge is None else bridge.torch_group
    import torch.distributed as dist

    from aiodist._torch.backend import riding

    if isinstance(timeout, int | float):
        timeout = datetime.timedelta(seconds=timeout)
    with riding(made):
        return dist.new_group(list(made.ranks), timeout=timeout, group_desc=desc)


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
    *,
    parent: ProcessGroup | None = None,
) -> Any:
    """Create a group of some ranks of the world, as ``torch.distributed.new_group`` does.

    Blocking twin of ``aiodist.new_group`` (see there). Where torch's default
    group rides aiodist's job (``init_process_group()`` made it so), the
    result is torch's group over the new aiodist group, which
    ``DistributedDataParallel(process_group=...)`` takes as every
    ``aiodist.sync`` call does; a rank outside ``ranks`` gets torch's
    ``GroupMember.NON_GROUP_MEMBER``. With ``backend``, ``parent`` or
    ``sort_ranks=False`` (which torch's ``new_group`` lacks), aiodist's group.

    Example:
        >>> evens = aiodist.sync.new_group([0, 2])
        >>> model = DistributedDataParallel(model, process_group=evens)
    """
    made = portal.call(
        _groups.new_group,
        ranks,
        timeout,
        backend,
        pg_options,
        use_local_synchronization,
        group_desc,
        device_id,
        sort_ranks,
        parent=parent,
    )
    if backend is not None or parent is not None or not sort_ranks:
        return made
    return _as_torch(made, timeout, group_desc)


def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """Split the world into groups of ``group_size`` consecutive ranks (torch's ``new_subgroups``).

    Blocking twin of ``aiodist.new_subgroups`` (see there); its groups are
    torch's as ``new_group``'s are.

    Example:
        >>> mine, groups = aiodist.sync.new_subgroups(2)
    """
    _, made = portal.call(
        _groups.new_subgroups, group_size, group, timeout, backend, pg_options, group_desc
    )
    return _mine(made, timeout, group_desc, backend is not None or group is not None)


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """Create one group per rank list; every rank calls it (torch's function of that name).

    Blocking twin of ``aiodist.new_subgroups_by_enumeration`` (see there); its
    groups are torch's as ``new_group``'s are.

    Example:
        >>> mine, groups = aiodist.sync.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    """
    _, made = portal.call(
        _groups.new_subgroups_by_enumeration,
        ranks_per_subgroup_list,
        timeout,
        backend,
        pg_options,
        group_desc,
    )
    return _mine(made, timeout, group_desc, backend is not None)


def _mine(
    made: list[ProcessGroup], timeout: float | timedelta | None, desc: str | None, keep: bool
) -> tuple[Any, list[Any]]:
    """(this rank's group, every group), torch's where ``_as_torch`` says (none if ``keep``)."""
    groups = made if keep else [_as_torch(g, timeout, desc) for g in made]
    mine = next((t for g, t in zip(made, groups, strict=True) if g.rank >= 0), None)
    return mine, groups
