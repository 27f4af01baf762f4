"""Agreements on a group's next membership (``shrink_group``), sans-IO.

Rules this module keeps (the job table in ``state.py`` feeds it):

- An agreement is keyed by (job, ``Regroup.key``). Each caller proposes the
  ranks it expects in the new group, its own among them, and the new
  group's id.
- A proposal is read without the members that are gone (failed or left): two
  survivors that heard of a second failure at different times still agree.
- The agreement is decided once every rank of every proposal that is not gone
  has called: every caller gets the same sorted list of ranks. A member that
  fails or leaves before that is left out (and no longer awaited); one that
  fails after it breaks the new group, as any failure breaks a group.
- A caller that comes after the decision gets the same answer; one that the
  others left out gets an error saying so.
- Proposals that differ (other ranks, or another group id) fail the
  agreement: every caller, and every later one with that key, gets the same
  ``MISMATCH`` error. So does its timeout (``TIMEOUT``, naming who never
  called). Never a split: nobody gets a list that another caller did not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiodist._errors import ErrorCode
from aiodist._server.jobs import BadRequest
from aiodist._wire.messages import ErrorReply, Regroup, Reply

if TYPE_CHECKING:
    from aiodist._server.jobs import ConnId, Job, Member

__all__ = ["Agreement", "Agreements"]

# Decided or failed agreements a job remembers (a late caller gets the same answer).
MAX_SETTLED: int = 256


@dataclass(eq=False, slots=True)
class Agreement:
    job: Job
    key: str
    group_id: int
    # rank -> (conn, req_id, proposal): who called, where its answer goes, what it proposed.
    calls: dict[int, tuple[ConnId, int, frozenset[int]]] = field(default_factory=dict)
    done: bool = False  # its deadline no longer applies (the heap skips it)


class Agreements:
    """The agreements of every job. Mixed into ``ServerState``."""

    def __init__(self) -> None:
        self._agreements: dict[Job, dict[str, Agreement]] = {}
        # (job, key) -> the answer every caller got: a Reply's value or an error triple.
        self._settled: dict[Job, dict[str, tuple[Any, ...]]] = {}

    # Provided by the table this is mixed into (declared for the type checker only).
    if TYPE_CHECKING:

        def _send(self, conn: ConnId, msg: Any) -> None: ...

        def _push_timer(self, when: float, target: Any) -> None: ...

        def _check_values(self, msg: Any) -> None: ...

    def _regroup(self, member: Member, msg: Regroup, now: float) -> None:
        self._check_values(msg)  # a finite timeout, before its deadline is computed
        job = member.job
        if not job.complete:
            raise BadRequest(ErrorCode.NOT_JOINED, f"job {job.name!r} has not formed yet")
        bad = [r for r in msg.members if not 0 <= r < job.world_size]
        if bad or member.rank not in msg.members or len(set(msg.members)) != len(msg.members):
            raise BadRequest(
                ErrorCode.BAD_REQUEST,
                f"Regroup.members must be distinct ranks in [0, {job.world_size}) that include "
                f"the caller's rank {member.rank}, got {msg.members}",
                {"field": "Regroup.members", "value": msg.members},
            )
        settled = self._settled.get(job, {}).get(msg.key)
        if settled is not None:
            if len(settled) == 1 and member.rank not in settled[0]:
                raise BadRequest(
                    ErrorCode.GROUP_BROKEN,
                    f"rank {member.rank} was left out: the other members already shrank this "
                    f"group to ranks {settled[0]} (their ranks_to_exclude named this rank); a "
                    "rank that is left out does not call shrink_group",
                    {"kept": settled[0]},
                )
            self._answer(member.conn, msg.req_id, settled)
            return
        agreements = self._agreements.setdefault(job, {})
        agreement = agreements.get(msg.key)
        if agreement is None:
            agreement = agreements[msg.key] = Agreement(job, msg.key, msg.group_id)
            self._push_timer(now + msg.timeout, agreement)
        agreement.calls[member.rank] = (member.conn, msg.req_id, frozenset(msg.members))
        if msg.group_id != agreement.group_id:
            self._settle(
                agreement,
                (
                    ErrorCode.MISMATCH,
                    f"shrink_group was called for different groups: group id "
                    f"{agreement.group_id} and {msg.group_id} (rank {member.rank}); every "
                    "survivor must make the same group calls in the same order",
                    {"field": "group_id", "values_by_rank": {}},
                ),
            )
            return
        self._try_decide(agreement)

    def _members_gone(self, job: Job) -> None:
        """A member of ``job`` failed or left: decide what no longer waits on it."""
        for agreement in list(self._agreements.get(job, {}).values()):
            self._try_decide(agreement)

    def _agreement_timed_out(self, agreement: Agreement) -> None:
        gone = _gone(agreement.job)
        wanted = set().union(*(p for _, _, p in agreement.calls.values())) - gone
        missing = sorted(wanted - agreement.calls.keys())
        self._settle(
            agreement,
            (
                ErrorCode.TIMEOUT,
                f"shrink_group of job {agreement.job.name!r} timed out: ranks {missing} never "
                f"called it (ranks {sorted(agreement.calls)} did); every survivor must call "
                "shrink_group with the same ranks_to_exclude",
                {"missing": missing},
            ),
        )

    def _jobs_ended(self, job: Job) -> None:
        for agreement in self._agreements.pop(job, {}).values():
            agreement.done = True
        self._settled.pop(job, None)

    # --- deciding ---------------------------------------------------------------------

    def _try_decide(self, agreement: Agreement) -> None:
        gone = _gone(agreement.job)
        for rank in [r for r in agreement.calls if r in gone]:
            del agreement.calls[rank]  # its answer has nowhere to go
        if not agreement.calls:
            return  # nobody waits; a later caller finds it, or it times out
        proposals = {rank: p - gone for rank, (_, _, p) in agreement.calls.items()}
        wanted = set().union(*proposals.values())
        if not wanted <= agreement.calls.keys():
            return  # someone still has to call
        first = next(iter(proposals.values()))
        if any(p != first for p in proposals.values()):
            shown = {rank: sorted(p) for rank, p in sorted(proposals.items())}
            self._settle(
                agreement,
                (
                    ErrorCode.MISMATCH,
                    f"shrink_group was called with different ranks to keep (without the "
                    f"ranks that are gone): {shown}; every survivor must call it with the "
                    "same ranks_to_exclude",
                    {"field": "ranks_to_exclude", "values_by_rank": shown},
                ),
            )
            return
        self._settle(agreement, (sorted(first),))

    def _settle(self, agreement: Agreement, answer: tuple[Any, ...]) -> None:
        agreement.done = True
        job = agreement.job
        self._agreements.get(job, {}).pop(agreement.key, None)
        settled = self._settled.setdefault(job, {})
        settled[agreement.key] = answer
        while len(settled) > MAX_SETTLED:
            del settled[next(iter(settled))]
        for conn, req_id, _ in agreement.calls.values():
            self._answer(conn, req_id, answer)

    def _answer(self, conn: ConnId, req_id: int, answer: tuple[Any, ...]) -> None:
        if len(answer) == 1:
            self._send(conn, Reply(req_id, answer[0]))
        else:
            code, message, details = answer
            self._send(conn, ErrorReply(req_id, code, message, details))


def _gone(job: Job) -> set[int]:
    """The ranks of ``job`` that failed or left."""
    return {r for r, *_ in job.failures} | job.left.keys()
