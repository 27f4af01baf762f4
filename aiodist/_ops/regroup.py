"""Elastic jobs: membership views and ``regroup``, the group over a view.

A process that joins a formed elastic job (``init_process_group(...,
max_world_size=MAX)``) gets the next free rank, which ``get_rank()`` answers,
and its default group is not formed until it regroups: a collective on it raises
an error that says so. Every member sees the job's membership as a sequence of views
(``membership``, ``watch_membership``; ``_group/views.py``). The members of a
view, newcomers included, form the new default group with ``regroup(view)``:
an agreement through the server (the one ``shrink_group`` uses), so a member
or newcomer that dies meanwhile is left out on every caller alike, and every
caller gets the same group or the same error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import anyio

from aiodist._control.store import as_seconds
from aiodist._errors import ArgumentError, DistTimeoutError
from aiodist._group.views import MembershipView
from aiodist._group.world import get_default_group
from aiodist._ops.shrink import adopt_group, agree

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Coroutine
    from datetime import timedelta

    from aiodist._group.group import ProcessGroup
    from aiodist._group.session import Session

# The group id of the group formed over view ``e`` is ``REGROUP_IDS + e * REGROUP_STRIDE``:
# every member, newcomers included, computes the same one, and numbers the groups it
# makes after it from there (``Session.number_groups_from``).
REGROUP_IDS: Final = 1 << 40
REGROUP_STRIDE: Final = 1 << 20


def _session(what: str) -> Session:
    group = get_default_group()
    if group is None:
        raise RuntimeError(f"{what} needs init_process_group first")
    return group.session


async def membership(epoch: int | None = None, *, timeout: float | None = None) -> MembershipView:
    """Return the job's membership view: the latest, or the first at or past ``epoch``.

    Args:
        epoch: None for the latest view this rank knows (in a newcomer that has
            not regrouped yet, the view of its own join: the one the members,
            stepping one epoch at a time, meet it at, whatever changed since);
            an epoch to wait for the view of that epoch (or the first later one
            this rank kept).
        timeout: Seconds to wait for that epoch (forever if None).

    Returns:
        The view: ``epoch``, ``ranks`` alive (ranks of the job), ``joined``, ``left``.

    Raises:
        RuntimeError: Not initialised.
        DistTimeoutError: No such view came within ``timeout``.

    Cancellation:
        Cancelling the caller only stops its wait.

    Example:
        >>> view = await aiodist.membership()
        >>> view.epoch, view.ranks
        (1, (0, 1, 2, 3))
    """
    views = _session("membership").views
    if epoch is None:
        return views.join_view or views.current
    return await _with_timeout(views.after(epoch - 1), timeout)


def joined_late() -> bool:
    """Return True in a process that joined its elastic job after the job formed.

    Such a process (a replacement for a failed rank, a node past MIN) has the
    job rank it was given (``get_rank()``; ``get_world_size()`` is the job's rank
    space), and its default group is not formed yet: a collective on it raises
    ``GroupBrokenError`` until it calls ``regroup`` over its first view with the
    others; then it receives the state they hold (``broadcast_object_list``).
    Point-to-point by job rank works before that.

    Raises:
        RuntimeError: Not initialised.

    Example:
        >>> if aiodist.joined_late():
        ...     await aiodist.regroup(await aiodist.membership())
    """
    return _session("joined_late").joined_late


async def watch_membership() -> AsyncIterator[MembershipView]:
    """Yield every membership view of the job from the latest one on, in epoch order.

    A view comes when a rank joins, fails or leaves; a watcher that falls far
    behind (over 64 views) skips to the oldest one kept.

    Raises:
        RuntimeError: Not initialised.

    Example:
        >>> async for view in aiodist.watch_membership():
        ...     if view.joined:
        ...         break
    """
    async for view in _session("watch_membership").views.watch():
        yield view


async def regroup(
    view: MembershipView | None = None, *, timeout: float | timedelta | None = None
) -> ProcessGroup:
    """Form the new default group over a membership view, with the newcomers.

    Every rank of ``view`` calls it with the same view (a newcomer with the view
    of its own join, which ``membership()`` returns to it): the old members
    and the newcomers agree through the server. A rank that fails or leaves
    before the agreement is left out on every caller alike; one that fails
    after it breaks the new group, as any failure does.

    Args:
        view: The view to form the group over; the latest this rank knows if None.
        timeout: How long to wait for every rank of ``view`` to call (the
            default group's timeout if None).

    Returns:
        The new default group: the ranks of ``view`` still alive, in order,
        renumbered from 0. ``get_rank()``, ``get_world_size()``, every call
        without ``group=`` and ``aiodist.sync`` follow it.

    Raises:
        ValueError: This rank is not in ``view``.
        CollectiveMismatchError: The callers passed views with other ranks.
        DistTimeoutError: Not every rank of ``view`` called in time; every
            caller gets it, naming the ranks that did not.
        RuntimeError: Not initialised.

    Cancellation:
        Cancelling the caller leaves its part in the agreement: the others
        still get their answer.

    Example:
        >>> view = await aiodist.membership(epoch)     # the epoch every rank agreed on
        >>> await aiodist.regroup(view)
        >>> await aiodist.broadcast_object_list(state, src=0)   # the newcomer gets it
    """
    old = get_default_group()
    if old is None:
        raise RuntimeError("regroup needs init_process_group first")
    session = old.session
    session.check_usable()
    view = view if view is not None else session.views.current
    if not isinstance(view, MembershipView):
        raise TypeError(f"view must be a MembershipView, got {type(view).__name__}")
    if session.rank not in view.ranks:
        raise ArgumentError(
            f"this rank ({session.rank} of the job) is not in the view of epoch {view.epoch} "
            f"(ranks {list(view.ranks)}): only the ranks of a view call regroup over it"
        )
    group_id = REGROUP_IDS + view.epoch * REGROUP_STRIDE
    seconds = as_seconds(timeout, old.timeout)
    ranks = await agree(
        session, f"regroup/{view.epoch}", group_id, view.ranks, seconds, what="regroup"
    )
    session.number_groups_from(group_id + 1)
    session.views.join_view = None  # a member now: its latest view is the one to go by
    name = f"{session.group_name}/epoch{view.epoch}"
    return adopt_group(old, ranks, name=name, group_id=group_id)


async def _with_timeout(
    wait: Coroutine[Any, Any, MembershipView], timeout: float | None
) -> MembershipView:
    try:
        with anyio.fail_after(timeout):
            return await wait
    except TimeoutError:
        raise DistTimeoutError(
            f"no membership view came within {timeout} s: no rank joined, failed or left"
        ) from None
