"""Failure isolation: a failed member breaks only what needs it.

When the server says a member failed (``MemberFailed``), the session does not
break as a whole (as torch.distributed, gloo and MPI do): the groups that
contain the failed rank break on every member (each member hears the same
notice), and operations that need that rank fail with ``RankFailedError``
naming it. Point-to-point with other ranks, the store, remote calls to other
ranks and the groups without it go on. The survivors replace a broken group
with ``shrink_group`` (``_ops/shrink.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiodist._errors import RankFailedError

if TYPE_CHECKING:
    from aiodist._group.session import Session

__all__ = ["failed_error", "isolate_failure", "ranks_alive"]


def failed_error(rank: int, host: str, pid: int, reason: str) -> RankFailedError:
    """The error of what needs ``rank``, which failed."""
    where = f" (host {host}, pid {pid})" if host else ""
    return RankFailedError(
        f"rank {rank}{where} failed: {reason}; every group that contains it is broken on all "
        "its ranks, and operations that need it fail. Other ranks, groups without it and the "
        "store go on: call shrink_group to replace a broken group without it.",
        rank=rank,
        host=host,
        pid=pid,
        reason=reason,
    )


def isolate_failure(session: Session, rank: int, host: str, pid: int, reason: str) -> None:
    """Break what needs failed ``rank`` on this member, and nothing else."""
    if rank in session.failed_ranks or not 0 <= rank < session.world_size:
        return
    exc = failed_error(rank, host, pid, reason)
    session.failed_ranks[rank] = exc
    # Sends to it and receives from it fail now (its channels are dropped).
    session.plane.peer_failed(rank, exc)
    for group in list(session.groups.values()):
        if rank in group.ranks and group.error is None and not group.closed:
            # Every member of the group hears the same notice: no need to tell them.
            group.break_(exc, notify=False, keep_p2p=True)
    session.note_trouble()
    for hook in list(session.on_member_gone):
        hook(rank)


def ranks_alive(session: Session) -> list[int]:
    """The job's ranks that neither failed nor left, as this member knows them."""
    gone = session.failed_ranks.keys() | session.plane.left.keys()
    return [r for r in range(session.world_size) if r not in gone]
