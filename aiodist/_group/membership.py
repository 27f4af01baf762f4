"""Failure isolation: a failed member breaks only what needs it.

When the server says a member failed (``MemberFailed``), the session does not
break as a whole (as torch.distributed, gloo and MPI do): the groups that
contain the failed rank break on every member (each member hears the same
notice), and operations that need that rank fail with ``RankFailedError``
naming it. Point-to-point with other ranks, the store, remote calls to other
ranks and the groups without it go on. The survivors replace a broken group
with ``shrink_group`` (``_ops/shrink.py``).

The session applies it (``Session.isolate_failure``, which keeps the ranks
that failed); this module says what every member tells of a failed rank.
"""

from __future__ import annotations

from aiodist._errors import RankFailedError


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
