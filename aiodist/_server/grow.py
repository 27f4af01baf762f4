"""Elastic jobs: processes that join a formed job, sans-IO (the job table feeds it).

Rules this module keeps:

- A job is elastic when its members joined with ``max_world_size`` (torchrun's
  ``--nnodes MIN:MAX``): it forms with ``world_size`` members, as any job, and
  then admits a process that joins it under the same name while fewer than
  ``max_world_size`` members are alive.
- A newcomer gets the next free rank: the job's ranks so far, dead ones
  included, are never given again (a dead rank's number stays with its
  failure, so a late notice about it can never be read as one about the
  newcomer). The job's rank space (``Job.world_size``) grows by one.
- Each membership change of a formed job (a join, a failure, a leave) bumps
  the job's ``epoch``; leaves not yet announced are announced before a join.
  A join is announced to every member alive, the newcomer included, with the
  new view (``MembersJoined``: epoch, rank space, ranks alive, the newcomer);
  failures and leaves are announced as before, and members count them into
  their views in the same order.
- The newcomer proves the token as every member does (the connection's
  handshake, before a ``Join`` is read); it then forms groups with the others
  by a ``Regroup`` agreement (``elastic.py``), so a newcomer that dies while
  joining is left out the same way on every member.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, cast

import msgpack

from aiodist._errors import ErrorCode
from aiodist._server.jobs import BadRequest
from aiodist._wire.messages import MembersJoined, Packed, Welcome, pack_host_runs

if TYPE_CHECKING:
    from aiodist._server.jobs import ConnId, Job, Member
    from aiodist._wire.messages import Join

__all__ = ["Growth", "check_admission", "host_runs"]


def check_admission(job: Job, msg: Join) -> None:
    """Refuse ``msg``, a join of formed elastic ``job``, unless it can be admitted.

    Raises:
        BadRequest: The job is at its largest size, or the joiner asks for a rank
            or another largest size.
    """
    if msg.max_world_size != job.max_world_size:
        raise BadRequest(
            ErrorCode.WORLD_SIZE_MISMATCH,
            f"job {job.name!r} is elastic with at most {job.max_world_size} members, but this "
            f"process asked for {msg.max_world_size or 'a job that is not elastic'}; start "
            "every rank with the same MIN:MAX",
            {"world_sizes": [job.max_world_size, msg.max_world_size]},
        )
    if msg.rank >= 0:
        raise BadRequest(
            ErrorCode.BAD_REQUEST,
            f"job {job.name!r} has formed: a process that joins it gets the next free rank; "
            f"start it without a rank (it asked for {msg.rank})",
            {"rank": msg.rank},
        )
    alive = sum(1 for m in job.members if m.status == "active")
    if alive >= job.max_world_size:
        raise BadRequest(
            ErrorCode.JOB_FULL,
            f"elastic job {job.name!r} already has {alive} members alive, its largest size "
            f"({job.max_world_size}); join it again once a member is gone",
        )


def host_runs(members: list[Member]) -> tuple[Counter[str], list[list[int]]]:
    """Members per host, and the hosts of ``members`` as ``Welcome.host_runs``.

    Host ids number the hosts in the order they first appear; a job whose
    hosts all hold as many ranks is one run, whatever its size.
    """
    local_sizes = Counter(m.host for m in members)  # one pass, not O(N^2)
    host_index = {host: i for i, host in enumerate(local_sizes)}
    return local_sizes, pack_host_runs(host_index[m.host] for m in members)


class Growth:
    """Admitting newcomers to formed elastic jobs. Mixed into ``ServerState``."""

    # Provided by the table this is mixed into (declared for the type checker only).
    if TYPE_CHECKING:
        restartable: bool

        def _send(self, conn: ConnId, msg: Any) -> None: ...

        def _send_leave_notice(self, job: Job, now: float) -> None: ...

        def _send_failure_notice(self, job: Job, now: float) -> None: ...

    def _admit(self, member: Member, now: float) -> None:
        """Give ``member``, which joined formed elastic job, the next rank; tell everyone."""
        job = member.job
        if job.unannounced:
            # Leaves wait a moment to go out together: send them before the join, so
            # that every member counts the epochs in the server's order, and the
            # newcomer (whose first view is the join's) is not told of them.
            self._send_leave_notice(job, now)
        if job.unannounced_failures:  # the same for failures held back
            self._send_failure_notice(job, now)
        job.grown(member)
        used = {
            m.local_rank
            for m in job.members
            if m.host == member.host and m is not member and m.status == "active"
        }
        member.local_rank = min(set(range(len(used) + 1)) - used)
        member.done = True  # no join deadline: it is in
        member.status = "active"
        job.epoch += 1
        _, runs = host_runs(job.by_rank)
        alive = [m.rank for m in job.by_rank if m in job.members and m.status == "active"]
        self._send(
            member.conn,
            Welcome(
                member.join_req_id,
                member.rank,
                job.world_size,
                member.local_rank,
                sum(1 for m in job.members if m.host == member.host and m.status == "active"),
                runs,
                self.restartable,  # it re-attaches after a restart, as every member does
            ),
        )
        joined = [[member.rank, member.host, member.pid]]
        notice = MembersJoined(
            job.epoch, job.world_size, cast("list[int]", Packed(msgpack.packb(alive))), joined
        )
        for m in job.members:
            if m.status == "active":
                self._send(m.conn, notice)
