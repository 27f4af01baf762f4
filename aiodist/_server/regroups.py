"""A job's regroups: agreements on a group's next membership (``shrink_group``, ``regroup``).

Rules this part of a job keeps:

- An agreement is keyed by ``Regroup.key``. Each caller proposes the ranks it
  expects in the new group, its own among them, and the new group's id.
- A proposal is read without the members that are gone (failed or left): two
  survivors that heard of a second failure at different times still agree.
- The agreement is decided once every rank of every proposal that is not gone
  has called: every caller gets the same sorted list of ranks. A member that
  fails or leaves before that is left out (and no longer awaited); one that
  fails after it breaks the new group, as any failure breaks a group.
- A caller that comes after the decision gets the same answer (the job keeps
  the last ``MAX_SETTLED``, and a restart keeps them: ``RegroupSettled``); one
  that the others left out gets an error saying so.
- Proposals that differ (other ranks, or another group id) fail the
  agreement: every caller, and every later one with that key, gets the same
  ``MISMATCH`` error. So does its timeout (``TIMEOUT``, naming who never
  called). Never a split: nobody gets a list that another caller did not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import ErrorCode
from aiodist._server.parts import BadRequest, handles
from aiodist._server.records import RegroupSettled
from aiodist._wire.messages import ErrorReply, Regroup, Reply

if TYPE_CHECKING:
    from aiodist._server.parts import ConnId, JobView, MemberView, Outbox
    from aiodist._server.records import Record

#: Decided or failed agreements a job remembers (a late caller gets the same answer).
MAX_SETTLED: Final = 256


@dataclass(frozen=True, slots=True)
class Answer:
    """What every caller of one agreement got: ``ranks`` (``code`` 0), or an error."""

    ranks: list[int]
    code: int = 0
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to(self, req_id: int) -> Reply | ErrorReply:
        if not self.code:
            return Reply(req_id, self.ranks)
        return ErrorReply(req_id, self.code, self.message, self.details)


@dataclass(eq=False, slots=True)
class Agreement:
    key: str
    group_id: int
    # rank -> (conn, req_id, proposal): who called, where its answer goes, what it proposed.
    calls: dict[int, tuple[ConnId, int, frozenset[int]]] = field(default_factory=dict)
    done: bool = False  # its deadline no longer applies (the heap skips it)


class Regroups:
    """The agreements of one job: those pending, and the answers of those settled."""

    def __init__(self, job: JobView, out: Outbox) -> None:
        self._job = job
        self._out = out
        self._pending: dict[str, Agreement] = {}
        self._settled: dict[str, Answer] = {}

    @handles(Regroup)
    def propose(self, member: MemberView, msg: Regroup, now: float) -> None:
        self._out.check(msg)  # a finite timeout, before its deadline is computed
        job = self._job
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
        settled = self._settled.get(msg.key)
        if settled is not None:
            if not settled.code and member.rank not in settled.ranks:
                raise BadRequest(
                    ErrorCode.GROUP_BROKEN,
                    f"rank {member.rank} was left out: the other members already shrank this "
                    f"group to ranks {settled.ranks} (their ranks_to_exclude named this rank); "
                    "a rank that is left out does not call shrink_group",
                    {"kept": settled.ranks},
                )
            self._out.send(member.conn, settled.to(msg.req_id))
            return
        agreement = self._pending.get(msg.key)
        if agreement is None:
            agreement = self._pending[msg.key] = Agreement(msg.key, msg.group_id)
            self._out.at(now + msg.timeout, agreement, self._timed_out)
        agreement.calls[member.rank] = (member.conn, msg.req_id, frozenset(msg.members))
        if msg.group_id != agreement.group_id:
            self._settle(
                agreement,
                Answer(
                    [],
                    ErrorCode.MISMATCH,
                    f"shrink_group was called for different groups: group id "
                    f"{agreement.group_id} and {msg.group_id} (rank {member.rank}); every "
                    "survivor must make the same group calls in the same order",
                    {"field": "group_id", "values_by_rank": {}},
                ),
            )
            return
        self._try_decide(agreement)

    def members_gone(self) -> None:
        """A member failed or left: decide what no longer waits on it."""
        for agreement in list(self._pending.values()):
            self._try_decide(agreement)

    def ended(self) -> None:
        """The job ended: nothing pending waits any longer."""
        for agreement in self._pending.values():
            agreement.done = True
        self._pending.clear()

    def records(self) -> list[Record]:
        return [_record(self._job.name, key, answer) for key, answer in self._settled.items()]

    def restore(self, key: str, answer: Answer) -> None:
        """Replay ``RegroupSettled``: a later caller gets ``answer``."""
        self._keep(key, answer)

    # --- deciding ---------------------------------------------------------------------

    def _timed_out(self, agreement: Agreement, now: float) -> None:
        job = self._job
        gone = job.gone()
        wanted = set().union(*(p for _, _, p in agreement.calls.values())) - gone
        missing = sorted(wanted - agreement.calls.keys())
        self._settle(
            agreement,
            Answer(
                [],
                ErrorCode.TIMEOUT,
                f"shrink_group of job {job.name!r} timed out: ranks {missing} never "
                f"called it (ranks {sorted(agreement.calls)} did); every survivor must call "
                "shrink_group with the same ranks_to_exclude",
                {"missing": missing},
            ),
        )

    def _try_decide(self, agreement: Agreement) -> None:
        gone = self._job.gone()
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
                Answer(
                    [],
                    ErrorCode.MISMATCH,
                    f"shrink_group was called with different ranks to keep (without the "
                    f"ranks that are gone): {shown}; every survivor must call it with the "
                    "same ranks_to_exclude",
                    {"field": "ranks_to_exclude", "values_by_rank": shown},
                ),
            )
            return
        self._settle(agreement, Answer(sorted(first)))

    def _settle(self, agreement: Agreement, answer: Answer) -> None:
        agreement.done = True
        self._pending.pop(agreement.key, None)
        self._keep(agreement.key, answer)
        self._out.record(self._job, _record(self._job.name, agreement.key, answer))
        for conn, req_id, _ in agreement.calls.values():
            self._out.send(conn, answer.to(req_id))

    def _keep(self, key: str, answer: Answer) -> None:
        settled = self._settled
        settled.pop(key, None)
        settled[key] = answer
        while len(settled) > MAX_SETTLED:
            del settled[next(iter(settled))]


def _record(job: str, key: str, answer: Answer) -> RegroupSettled:
    return RegroupSettled(job, key, answer.ranks, answer.code, answer.message, answer.details)
