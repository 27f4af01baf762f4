"""Making process groups: ``new_group``, an operation every rank of the parent calls."""

from __future__ import annotations

from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from aiodist._control.store import as_seconds
from aiodist._errors import (
    ArgumentError,
    ArgumentTypeError,
    AssertedValueError,
    CollectiveMismatchError,
    counted,
)
from aiodist._group.group import ProcessGroup
from aiodist._group.world import (
    get_default_group,
    get_local_group,
    group_or_default,
    install_local_group,
)
from aiodist._ops.objects import start_all_gather_object
from aiodist._ops.requests import Op, Request
from aiodist._ops.run import Slot, record
from aiodist._wire import codec

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import timedelta


async def new_group(
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
) -> ProcessGroup:
    """Create a group of some ranks of the world, as ``torch.distributed.new_group`` does.

    Every rank of the world (of ``parent``) calls ``new_group`` with the same
    ``ranks``, in the same order as its other ``new_group`` calls, members or
    not (as in torch).
    Operations take ``group=`` the returned group; on a rank outside ``ranks``
    the group has ``rank == -1``, and collectives on it return at once without
    doing anything (as in torch).

    Args:
        ranks: Global ranks of the members; None for all.
        timeout: Default timeout of the group's operations; the world's if None.
        backend: When the parent group is bridged to torch.distributed, the torch
            backend of the new group (default: the parent's); otherwise recorded only.
        pg_options: torch's backend options; accepted and not used.
        use_local_synchronization: torch's flag letting non-members skip the call;
            aiodist needs every rank of ``parent`` to call ``new_group`` anyway.
        group_desc: A description; the group's name ends with it.
        device_id: torch's device hint; accepted and not used.
        sort_ranks: Sort ``ranks`` (group rank order), as torch does; False keeps
            the order given.
        parent: The group to carve the new one from (the members of ``parent``
            call ``new_group``); the world group if None, as in torch.

    Returns:
        The new group; global rank ``r`` is ``group.ranks.index(r)`` in it.

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
    (group,) = await new_groups(
        [ranks], timeout, backend, parent=parent, sort_ranks=sort_ranks, desc=group_desc
    )
    return group


async def new_groups(
    rank_lists: Sequence[Sequence[int] | None],
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    *,
    parent: ProcessGroup | None = None,
    sort_ranks: bool = True,
    desc: str | None = None,
    disjoint: bool = False,
) -> list[ProcessGroup]:
    """Create a group per entry of ``rank_lists`` in one call (one place in the parent's order)."""
    world = group_or_default(parent, "new_group")
    session = world.session
    called = perf_counter_ns()
    with Slot(world, "new_group") as seq:
        # Every rank numbers its groups in call order, whatever fails next.
        ids = [session.next_group_id() for _ in rank_lists]
        tables = [_check_group_ranks(r, world, sort_ranks) for r in rank_lists]
        if disjoint:
            seen_ranks: set[int] = set()
            for table in tables:
                if seen_ranks & set(table):
                    raise ArgumentError(f"rank lists must not overlap, got {list(rank_lists)}")
                seen_ranks |= set(table)
        group_timeout = as_seconds(timeout, world.timeout)
        payload = codec.dumps(tables)
    suffix = f"/{desc}" if desc else ""
    groups = [
        ProcessGroup(session, members, name=f"{session.group_name}/{gid}{suffix}", group_id=gid)
        for gid, members in zip(ids, tables, strict=True)
    ]
    for group in groups:
        group.timeout = group_timeout
        group.group_backend = backend
        session.groups[group.group_id] = group
    try:
        agreeing = start_all_gather_object(
            world,
            seq,
            Request(op=Op.ALL_GATHER_OBJECT, description="new_group", payload=payload),
            name="new_group",
        )
        record(world, agreeing, "new_group", seq, None, called)
        seen = await agreeing
    except BaseException:
        for group in groups:
            session.groups.pop(group.group_id, None)
        raise
    if any(other != tables for other in seen):
        shown = seen if len(tables) > 1 else [other[0] for other in seen]
        exc = CollectiveMismatchError(
            f"new_group was called with different ranks: {_by_rank(shown)}; every rank "
            "must call new_group with the same ranks, in the same order",
            field="ranks",
            values_by_rank=dict(enumerate(shown)),
        )
        for group in groups:
            session.groups.pop(group.group_id, None)
        world.break_(exc, notify=False)  # every rank saw the same table: no notice needed
        raise exc
    if world.bridge is not None:
        for group in groups:
            await world.bridge.new_group(group, backend)
    return groups


async def new_subgroups(
    group_size: int | None = None,
    group: ProcessGroup | None = None,
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup, list[ProcessGroup]]:
    """Split the world into groups of ``group_size`` consecutive ranks (torch's ``new_subgroups``).

    Every rank calls it. By default ``group_size`` is the number of CUDA
    devices, as in torch (an error without CUDA).

    Args:
        group_size: Ranks per group; must divide the world size.
        group: The group to split; the world if None.
        timeout: Default timeout of the groups' operations.
        backend: As for ``new_group``.
        pg_options: Accepted for torch's signature.
        group_desc: A description for the groups' names.

    Returns:
        ``(this rank's group, every group)``.

    Raises:
        ValueError: ``group_size`` missing without CUDA, not positive, larger than
            the world, or not a divisor of its size.

    Example:
        >>> mine, groups = await aiodist.new_subgroups(2)
    """
    parent = group_or_default(group, "new_subgroups")
    if group_size is None:
        import torch

        if not torch.cuda.is_available():
            raise ArgumentError(
                "Default group size only takes effect when CUDA is available; pass group_size"
            )
        group_size = torch.cuda.device_count()
    world_size = parent.world_size
    if group_size <= 0:
        raise ArgumentError(f"The arg 'group_size' ({group_size}) must be positive")
    if group_size > world_size:
        raise ArgumentError(
            f"The arg 'group_size' ({group_size}) must not exceed the world size ({world_size})"
        )
    if world_size % group_size != 0:
        raise ArgumentError(f"The world size ({world_size}) must be divisible by '{group_size=}'")
    tables = [
        [parent.global_rank(r) for r in range(start, start + group_size)]
        for start in range(0, world_size, group_size)
    ]
    groups = await new_groups(tables, timeout, backend, parent=group, desc=group_desc)
    mine = _mine(groups)
    assert mine is not None  # the groups cover every rank of the parent
    return mine, groups


async def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: float | timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[ProcessGroup | None, list[ProcessGroup]]:
    """Create one group per rank list; every rank calls it (torch's function of that name).

    Args:
        ranks_per_subgroup_list: Disjoint lists of global ranks.
        timeout: Default timeout of the groups' operations.
        backend: As for ``new_group``.
        pg_options: Accepted for torch's signature.
        group_desc: A description for the groups' names.

    Returns:
        ``(this rank's group or None, every group)``.

    Raises:
        ValueError: An empty list, or lists that share a rank.

    Example:
        >>> mine, groups = await aiodist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    """
    if not ranks_per_subgroup_list:
        raise ArgumentError("The arg 'ranks_per_subgroup_list' cannot be empty")
    groups = await new_groups(
        list(ranks_per_subgroup_list), timeout, backend, desc=group_desc, disjoint=True
    )
    return _mine(groups), groups


async def split_group(
    parent_pg: ProcessGroup | None = None,
    split_ranks: list[list[int]] | None = None,
    timeout: float | timedelta | None = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> ProcessGroup | None:
    """Split ``parent_pg`` into disjoint groups; return this rank's (torch's ``split_group``).

    Every rank of ``parent_pg`` calls it with the same ``split_ranks``.

    Returns:
        The group this rank is in, or None when it is in none.

    Raises:
        ValueError: No ``split_ranks``, or lists that share a rank.

    Example:
        >>> mine = await aiodist.split_group(split_ranks=[[0, 1], [2, 3]])
    """
    if not split_ranks:
        raise ArgumentError("split_ranks cannot be None or empty")
    groups = await new_groups(
        split_ranks, timeout, backend, parent=parent_pg, desc=group_desc, disjoint=True
    )
    return _mine(groups)


async def init_local_group(node_rank: int, num_gpus_per_node: int) -> None:
    """Make mmengine's local group: the ranks ``node_rank * n ... (node_rank + 1) * n - 1``.

    Every rank calls it with its own node's rank and the same ``num_gpus_per_node``
    (``n``); every node's group is made on every rank (one call), so nodes need
    not agree on anything but ``n``. ``get_local_group()``, ``get_local_rank()``
    and ``get_local_size()`` then answer from it.

    Raises:
        AssertionError: The local group exists already (as mmengine asserts).
        ValueError: This rank is not among its node's ranks.

    Example:
        >>> await aiodist.init_local_group(node_rank, torch.cuda.device_count())
    """
    world = get_default_group()
    if world is None:
        raise RuntimeError("init_local_group needs init_process_group first")
    if world_local_group() is not None:
        raise AssertedValueError("the local process group exists already")
    n = num_gpus_per_node
    if not isinstance(n, int) or n <= 0:
        raise ArgumentError(f"num_gpus_per_node must be a positive int, got {n!r}")
    mine = list(range(node_rank * n, (node_rank + 1) * n))
    if world.session.rank not in mine:
        raise ArgumentError(
            f"rank {world.session.rank} is not in node {node_rank}'s ranks {mine} with "
            f"num_gpus_per_node={n}"
        )
    tables = [
        list(range(start, min(start + n, world.world_size)))
        for start in range(0, world.world_size, n)
    ]
    groups = await new_groups(tables, desc="local")
    local = _mine(groups)
    assert local is not None
    install_local_group(local)


def _mine(groups: list[ProcessGroup]) -> ProcessGroup | None:
    return next((g for g in groups if g.rank >= 0), None)


def world_local_group() -> ProcessGroup | None:
    """The local group made by ``init_local_group``, or None (not made, or not initialised)."""
    try:
        return get_local_group()
    except RuntimeError:
        return None


def _check_group_ranks(
    ranks: Sequence[int] | None, parent: ProcessGroup, sort_ranks: bool = True
) -> list[int]:
    if ranks is None:
        return list(parent.ranks)
    allowed = set(parent.ranks)
    numbering = parent.session.numbering  # the default group was shrunk: global ranks renumbered
    if numbering is not None and not isinstance(ranks, str | bytes) and hasattr(ranks, "__iter__"):
        ranks = [_job_rank(r, numbering) for r in ranks]
    if isinstance(ranks, str | bytes) or not hasattr(ranks, "__iter__"):
        raise ArgumentTypeError(f"ranks must be a sequence of ints, got {type(ranks).__name__}")
    members = list(ranks)
    for r in members:
        if not isinstance(r, int) or isinstance(r, bool):
            raise ArgumentTypeError(f"ranks must be ints, got {r!r} ({type(r).__name__})")
        if r not in allowed:
            raise ArgumentError(f"rank {r} is not a member of {parent!r}; ranks are global ranks")
    if len(set(members)) != len(members):
        raise ArgumentError(f"ranks must be distinct, got {members}")
    if not members:
        raise ArgumentError("ranks must name at least one rank")
    return sorted(members) if sort_ranks else members


def _job_rank(rank: object, numbering: tuple[int, ...]) -> Any:
    """The job rank of global ``rank`` after shrink_group renumbered the default group."""
    if not isinstance(rank, int) or isinstance(rank, bool):
        return rank  # refused with the others
    if not 0 <= rank < len(numbering):
        raise ArgumentError(
            f"rank {rank} is not a global rank: the default group has "
            f"{counted(len(numbering), 'rank')} since shrink_group renumbered them"
        )
    return numbering[rank]


def _by_rank(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
