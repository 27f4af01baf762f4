"""``shrink_group``: the survivors of a group agree on a group without some ranks.

The agreement is the server's (``_server/regroups.py``): every survivor sends
the ranks it keeps, and every one gets the same list back, or the same error.
A rank that fails or leaves before the list is decided is left out of it; one
that fails after it breaks the new group, as any failure breaks a group. So
two survivors never end up in different groups.

Ranks are renumbered as torch renumbers them: the kept ranks, in their old
order, are ranks ``0 .. n-1`` of the new group. Shrinking the default group
replaces it: ``get_rank()``, ``get_world_size()``, every call without
``group=`` and ``aiodist.sync`` then use the new group, and a global rank
(``dst=``, ``src=``, ``new_group(ranks)``) means a rank of the new group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiodist._control.store import REPLY_GRACE, as_seconds
from aiodist._errors import ArgumentError, ArgumentTypeError, DistError, ProtocolError
from aiodist._group.group import ProcessGroup
from aiodist._group.world import get_default_group, group_or_default, replace_default_group
from aiodist._wire.messages import Regroup

if TYPE_CHECKING:
    from collections.abc import Sequence
    from datetime import timedelta

    from aiodist._group.session import Session

#: torch's flag values for ``shrink_flags``; aiodist has one way to shrink.
SHRINK_DEFAULT = 0
SHRINK_ABORT = 1


async def shrink_group(
    ranks_to_exclude: Sequence[int],
    group: ProcessGroup | None = None,
    shrink_flags: int = SHRINK_DEFAULT,
    pg_options: Any = None,
    *,
    timeout: float | timedelta | None = None,
) -> ProcessGroup:
    """Make a group of ``group``'s ranks without ``ranks_to_exclude`` (torch's ``shrink_group``).

    Every rank of ``group`` that stays calls it with the same ``ranks_to_exclude``
    (ranks of ``group``), typically after an operation failed with
    ``RankFailedError`` naming the rank that died. The survivors agree through
    the rendezvous server: a rank that fails or leaves while they shrink is
    left out too, so every caller gets the same group, or the same error.

    Args:
        ranks_to_exclude: Ranks of ``group`` (not global ranks) to leave out.
        group: The group to shrink; the default group if None (which the new
            group then replaces, as in torch).
        shrink_flags: torch's flags; accepted, aiodist has one way to shrink.
        pg_options: torch's backend options; accepted and not used.
        timeout: How long to wait for every survivor to call; the group's
            timeout if None.

    Returns:
        The new group: the ranks kept, in their old order, renumbered from 0.

    Raises:
        TypeError, ValueError: ``ranks_to_exclude`` holds a non-int, a duplicate,
            a rank not in ``group``, or this rank (checked before anything is sent).
        CollectiveMismatchError: Survivors called it with different ranks to keep
            (not counting ranks that are gone); every caller gets it.
        DistTimeoutError: Not every survivor called it within ``timeout``; every
            caller gets it, naming the ranks that did not call.
        RuntimeError: Not initialised.

    Cancellation:
        Cancelling the caller leaves its part in the agreement: the other
        survivors still get their answer.

    Example:
        >>> try:
        ...     await aiodist.all_reduce(grad)
        ... except aiodist.RankFailedError as exc:
        ...     await aiodist.shrink_group([exc.rank])   # the default group: ranks are global
    """
    old = group_or_default(group, "shrink_group")
    excluded = _check_excluded(ranks_to_exclude, old)
    session = old.session
    session.check_usable()
    # torch's default group of a job started without a backend serves torch's own code and
    # carries none of aiodist's calls: it does not keep aiodist's group from shrinking.
    if old.bridge is not None and old.bridge.devices:
        raise ArgumentError(
            f"{old!r} is bridged to torch.distributed (backend {old.backend!r}), whose group "
            "aiodist cannot shrink; start the job without a torch backend to shrink its groups"
        )
    keep = [old.ranks[i] for i in range(old.world_size) if i not in excluded]
    # The survivors' calls on one group are told apart by how many times it was shrunk,
    # as their collectives are by sequence numbers.
    old.shrinks += 1
    count = old.shrinks
    group_id = session.next_group_id()  # every survivor numbers its groups alike
    seconds = as_seconds(timeout, old.timeout)
    key = f"shrink/{old.group_id}/{count}"
    ranks = await agree(session, key, group_id, keep, seconds, what="shrink_group")
    return adopt_group(old, ranks, name=f"{old.name}/shrunk{count}", group_id=group_id)


async def agree(
    session: Session, key: str, group_id: int, keep: Sequence[int], seconds: float, *, what: str
) -> tuple[int, ...]:
    """Agree with the other members on the ranks of a new group (``Regroup``); return them."""
    proposal = list(keep)
    reply = await session.conn.request(
        lambda r: Regroup(r, key, group_id, proposal, seconds), timeout=seconds + REPLY_GRACE
    )
    if (
        type(reply) is not list
        or any(type(r) is not int or r not in keep for r in reply)
        or session.rank not in reply
    ):
        raise ProtocolError(
            f"the rendezvous server answered {what} with {reply!r}, not a list of the "
            f"ranks kept ({proposal}) with this rank's"
        )
    return tuple(reply)


def adopt_group(
    old: ProcessGroup, ranks: tuple[int, ...], *, name: str, group_id: int
) -> ProcessGroup:
    """The group the members agreed on, in place of ``old`` (the default group too)."""
    session = old.session
    new = ProcessGroup(session, ranks, name=name, group_id=group_id)
    new.timeout = old.timeout
    new.group_backend = old.group_backend
    session.groups[group_id] = new
    # A rank that failed after the decision, and whose notice came first: break it now,
    # as every other member does when its notice comes.
    for rank in ranks:
        gone = session.failed_ranks.get(rank) or session.plane.left.get(rank)
        if isinstance(gone, DistError) and new.error is None:
            new.break_(gone, notify=False)
    if old is get_default_group():
        session.numbering = ranks
        replace_default_group(old, new)
    return new


def _check_excluded(ranks: Sequence[int], group: ProcessGroup) -> set[int]:
    if isinstance(ranks, str | bytes) or not hasattr(ranks, "__iter__"):
        raise ArgumentTypeError(
            f"ranks_to_exclude must be a sequence of ints, got {type(ranks).__name__}"
        )
    if group.rank < 0:
        raise ArgumentError(f"this process is not a member of {group!r}")
    out: set[int] = set()
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool):
            raise ArgumentTypeError(f"ranks_to_exclude must be ints, got {r!r}")
        if not 0 <= r < group.world_size:
            raise ArgumentError(
                f"ranks_to_exclude holds {r}, not a rank of {group!r} (ranks 0 to "
                f"{group.world_size - 1}); they are ranks of the group, as in torch"
            )
        if r in out:
            raise ArgumentError(f"ranks_to_exclude must be distinct, got {list(ranks)}")
        out.add(r)
    if group.rank in out:
        raise ArgumentError(
            f"ranks_to_exclude holds this rank ({group.rank}): a rank that is left out does "
            "not call shrink_group (only the survivors do)"
        )
    return out
