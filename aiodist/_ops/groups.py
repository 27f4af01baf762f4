"""Making process groups: ``new_group``, an operation every rank of the parent calls."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiodist._control.store import as_seconds
from aiodist._errors import CollectiveMismatchError
from aiodist._group.group import ProcessGroup
from aiodist._group.world import get_default_group
from aiodist._ops.common import Slot
from aiodist._ops.objects import start_all_gather_object
from aiodist._wire import codec

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import timedelta

__all__ = ["new_group"]


async def new_group(
    ranks: Sequence[int] | None = None,
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    *,
    parent: ProcessGroup | None = None,
) -> ProcessGroup:
    """Create a group of some ranks of the world, as ``torch.distributed.new_group`` does.

    Every rank of the world (of ``parent``) calls ``new_group`` with the same
    ``ranks``, in the same order as its other ``new_group`` calls, members or
    not (as in torch).
    Operations take ``group=`` the returned group; on a rank outside ``ranks``
    the group has ``rank == -1`` and operations on it raise ``ValueError``.

    Args:
        ranks: Global ranks of the members (sorted, as torch does); None for all.
        timeout: Default timeout of the group's operations; the world's if None.
        backend: When the parent group is bridged to torch.distributed, the torch
            backend of the new group (default: the parent's); otherwise recorded only.
        parent: The group to carve the new one from (the members of ``parent``
            call ``new_group``); the world group if None, as in torch.

    Returns:
        The new group; the world group's rank ``r`` is ``group.ranks.index(r)`` in it.

    Raises:
        TypeError, ValueError: ``ranks`` holds a non-int, a duplicate or an
            out-of-range rank (checked before anything is sent).
        CollectiveMismatchError: Ranks called ``new_group`` with different ``ranks``;
            the world group is then broken, since ranks no longer agree on groups.
        RuntimeError: Not initialised.

    Cancellation:
        Cancelling the caller does not cancel the world-wide agreement it started.

    Example:
        >>> evens = await aiodist.new_group([0, 2])
        >>> await aiodist.all_reduce(t, group=evens)
    """
    world = parent if parent is not None else get_default_group()
    if world is None:
        raise RuntimeError("new_group needs init_process_group first")
    session = world.session
    with Slot(world, "new_group") as seq:
        # Every rank numbers its groups in call order, whatever fails next.
        group_id = session.next_group_id()
        members = _check_group_ranks(ranks, world)
        group_timeout = as_seconds(timeout, world.timeout)
        payload = codec.dumps(members)
    group = ProcessGroup(
        session, members, name=f"{session.group_name}/{group_id}", group_id=group_id
    )
    group.timeout = group_timeout
    group.group_backend = backend
    session.groups[group_id] = group
    try:
        seen = await start_all_gather_object(world, seq, payload)
    except BaseException:
        del session.groups[group_id]
        raise
    if any(other != members for other in seen):
        exc = CollectiveMismatchError(
            f"new_group was called with different ranks: {_by_rank(seen)}; every rank "
            "must call new_group with the same ranks, in the same order",
            field="ranks",
            values_by_rank=dict(enumerate(seen)),
        )
        del session.groups[group_id]
        world.break_(exc, notify=False)  # every rank saw the same table: no notice needed
        raise exc
    if world.bridge is not None:
        await world.bridge.new_group(group, backend)
    return group


def _check_group_ranks(ranks: Sequence[int] | None, parent: ProcessGroup) -> list[int]:
    if ranks is None:
        return list(parent.ranks)
    allowed = set(parent.ranks)
    if isinstance(ranks, str | bytes) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"ranks must be a sequence of ints, got {type(ranks).__name__}")
    members = list(ranks)
    for r in members:
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"ranks must be ints, got {r!r} ({type(r).__name__})")
        if r not in allowed:
            raise ValueError(f"rank {r} is not a member of {parent!r}; ranks are global ranks")
    if len(set(members)) != len(members):
        raise ValueError(f"ranks must be distinct, got {members}")
    if not members:
        raise ValueError("ranks must name at least one rank")
    return sorted(members)


def _by_rank(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
