"""``rpc.shutdown``'s waves when ranks, the coordinator among them, go away mid-way.

Each rank's ``Termination`` runs as in a job, on one loop; what the data plane
would carry between them is handed over on the next turn of the loop, and a
test decides which messages a rank that dies still gets out. The real
processes (``test_rpc.py``) show the common case; here, the interleavings a
real job produces only now and then: the coordinator dying after it told
some ranks to stop, or to go on, but not the others.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from aiodist._errors import ClosedError, DistError
from aiodist._rpc.shutdown import Termination

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._group.work import Work

REPORT, VERDICT = 0, 1


@dataclass
class _Served:
    served: int = 0


@dataclass
class Rank:
    """What ``Termination`` needs of its agent (``shutdown.Host``), for one rank of ``Job``."""

    job: Job
    rank: int
    sent: int = 0
    server: _Served = field(default_factory=_Served)
    gone: set[int] = field(default_factory=set)  # what this rank knows: ranks failed or left
    finished: bool = False

    def __post_init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.plane = self  # send_notice is all Termination asks of the plane
        self.termination = Termination(self)

    @property
    def world_size(self) -> int:
        return len(self.job.ranks)

    def closed_reason(self) -> DistError:
        return ClosedError(f"rank {self.rank} closed")

    def ranks_alive(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.gone]

    def alone(self) -> bool:
        return self.ranks_alive() == [self.rank]

    def finish_shutdown(self, *, force: bool = False) -> None:
        self.finished = True

    async def wait_idle(self) -> None:
        return

    def send_notice(self, dst: int, kind: Any, header: list[Any]) -> None:
        extra = header[-1][4]
        self.job.sent.append((self.rank, dst, list(extra)))
        self.job.moving()
        if self.rank in self.job.dead or not self.job.delivers(self.rank, dst, extra):
            return
        self.loop.call_soon(self.job.deliver, self.rank, dst, extra)

    def hears_gone(self, rank: int) -> None:
        self.gone.add(rank)
        self.termination.member_gone(rank)


class Job:
    """``n`` ranks; ``delivers(src, dst, extra)`` says whether a message gets through."""

    def __init__(self, n: int) -> None:
        self.sent: list[tuple[int, int, list[int]]] = []
        self._moved = asyncio.Event()
        self.dead: set[int] = set()
        self.delivers: Callable[[int, int, list[int]], bool] = lambda src, dst, extra: True
        self.ranks = [Rank(self, r) for r in range(n)]

    def deliver(self, src: int, dst: int, extra: list[int]) -> None:
        if dst not in self.dead:
            self.ranks[dst].termination.on_message(src, extra)
        self.moving()

    def kill(self, rank: int) -> None:
        self.dead.add(rank)
        self.moving()

    def moving(self) -> None:
        """Something was sent, delivered or killed: wake ``moved``."""
        self._moved.set()
        self._moved = asyncio.Event()

    async def moved(self) -> None:
        await self._moved.wait()

    def verdicts(self, src: int) -> list[tuple[int, list[int]]]:
        return [(dst, extra) for s, dst, extra in self.sent if s == src and extra[0] == VERDICT]


async def _until(job: Job, condition: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not condition():
            await job.moved()


async def _done(works: list[Work[None]]) -> None:
    with anyio.fail_after(5):
        for w in works:
            await w  # raises if one failed


async def test_shutdown_completes_among_the_ranks_alive_in_two_waves() -> None:
    job = Job(3)
    works = [r.termination.start(None) for r in job.ranks]
    await _done(works)
    assert all(r.finished for r in job.ranks)
    # Rank 0 tells itself at once; the others by message: wave 1 "again", wave 2 "stop".
    assert [extra[1:] for _, extra in job.verdicts(0)] == [[1, 0]] * 2 + [[2, 1]] * 2


async def test_coordinator_dead_before_any_verdict_the_next_rank_takes_over() -> None:
    job = Job(3)
    job.kill(0)  # it never answers the reports the others send it
    works = [r.termination.start(None) for r in job.ranks[1:]]
    await _until(job, lambda: sum(1 for s, d, _ in job.sent if d == 0) == 2)
    job.ranks[2].hears_gone(0)  # rank 2 hears first: it reports to rank 1 at once
    await _until(job, lambda: any(d == 1 and s == 2 and e[1] == 1 for s, d, e in job.sent))
    assert not works[0].is_completed()
    job.ranks[1].hears_gone(0)
    await _done(works)
    assert job.ranks[1].finished
    assert job.ranks[2].finished


@pytest.mark.parametrize("told", [1, 2], ids=["the-next-coordinator", "another-rank"])
async def test_coordinator_dead_after_telling_one_rank_to_stop(told: int) -> None:
    job = Job(4)

    def delivers(src: int, dst: int, extra: list[int]) -> bool:
        if src == 0 and extra[0] == VERDICT and extra[2] == 1:  # the stop verdict
            if dst == told:
                job.kill(0)  # it dies right after: the others never hear it
                return True
            return False
        return True

    job.delivers = delivers
    works = [r.termination.start(None) for r in job.ranks]
    await _done([works[told]])
    assert [works[r].is_completed() for r in (1, 2, 3)] == [r == told for r in (1, 2, 3)]
    for r in (3, 2, 1):  # each hears of it in its own time
        job.ranks[r].hears_gone(0)
    await _done(works[1:])
    assert all(job.ranks[r].finished for r in (1, 2, 3))


async def test_coordinator_dead_after_telling_one_rank_to_go_on() -> None:
    job = Job(3)

    def delivers(src: int, dst: int, extra: list[int]) -> bool:
        if src == 0 and extra[0] == VERDICT and extra[1] == 1:
            if dst == 2:
                job.kill(0)  # wave 1's "again" reached rank 2 (which reports wave 2 to
                return True  # a dead rank), not rank 1
            return False
        return True

    job.delivers = delivers
    works = [r.termination.start(None) for r in job.ranks]
    await _until(job, lambda: 0 in job.dead)
    job.ranks[1].hears_gone(0)
    job.ranks[2].hears_gone(0)
    await _done(works[1:])


async def test_a_rank_that_stopped_and_left_is_not_waited_for_by_the_next_coordinator() -> None:
    job = Job(3)

    def delivers(src: int, dst: int, extra: list[int]) -> bool:
        if src == 0 and extra[0] == VERDICT and extra[2] == 1:
            if dst == 2:
                job.kill(0)
                return True
            return False
        return True

    job.delivers = delivers
    works = [r.termination.start(None) for r in job.ranks]
    await _done([works[2]])
    job.kill(2)  # it stopped, then left the job before it heard of rank 0
    job.ranks[1].hears_gone(0)
    job.ranks[1].hears_gone(2)
    await _done(works[1:2])
    assert job.ranks[1].finished


@pytest.mark.parametrize("others_gone", [True, False])
async def test_a_session_breaking_fails_the_shutdown_unless_every_other_rank_was_gone(
    others_gone: bool,
) -> None:
    """A failing rank 0 that hosted the server takes it along: rank 1, still waiting for
    rank 0's verdict, completes alone if it knew rank 0 had failed, else fails."""
    job = Job(2)
    job.kill(0)  # never answers
    work = job.ranks[1].termination.start(None)
    await _until(job, lambda: any(src == 1 for src, _, _ in job.sent))  # its wave-1 report
    if others_gone:
        job.ranks[1].gone.add(0)  # heard of the failure, but no wave ran since
    job.ranks[1].termination.fail(ClosedError("the server went away"))
    if others_gone:
        await _done([work])
        assert job.ranks[1].finished
    else:
        with anyio.fail_after(5), pytest.raises(ClosedError, match="the server went away"):
            await work
