"""``rpc.shutdown``: agreeing that every rank called it and no call is left anywhere.

A rank may stop serving only once no other rank can still need it: every
rank called ``shutdown`` (so none starts a call on its own any more) and no
call is running or on its way anywhere (a call being served may make
further calls, even after its caller had nothing left of its own).

The *coordinator* (the lowest rank alive: rank 0 while it lives) runs
*waves*. In each wave every rank waits until it is idle (no call of its own
pending, none being served), then reports two counters to the coordinator:
calls it made and requests it accepted, both only ever growing. Once the
coordinator has every report of a wave it tells every rank whether to stop:
yes when every rank reported the same counters as in the previous wave, else
it starts the next wave. Why that suffices (the four-counter method of
termination detection): between a rank's two reports it was idle at both
and its counters did not move, so it neither made nor accepted a call in
between; every wave-2 report comes after every wave-1 report, so at the
moment between them no rank was running anything and no request or reply was
on its way (a message in flight means its caller still waits, which is not
idle). Nothing can start again after that moment but a rank's own code, and
every rank has called ``shutdown``. Usually two waves: two round trips.

Ranks that fail or leave are not waited for: shutdown completes among the
ranks alive. When the coordinator itself goes, the next lowest rank alive
takes over and counts waves afresh: each rank reports to it anew (a wave of
the old coordinator answers nothing more), and a rank that the old one had
already told to stop reports its final counters, so the new one can reach
the same verdict (a stop, once true, stays true: nothing starts again).

Every rank serves calls until the verdict comes, and afterwards answers late
requests with ``ClosedError`` rather than leave them unanswered.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from typing import Any, Protocol

from aiodist._errors import DistError, DistTimeoutError
from aiodist._group.work import Work
from aiodist._rpc.wire import Notices, Op, notify

logger = logging.getLogger(__name__)


class _Kind(enum.IntEnum):
    REPORT = 0  # [REPORT, wave, calls made, requests accepted], to the coordinator
    VERDICT = 1  # [VERDICT, wave, stop], from the coordinator


class _Served(Protocol):
    served: int  # requests this rank accepted


class Host(Protocol):
    """What ``rpc.shutdown`` needs of its rank's agent (``agent.Agent``)."""

    rank: int
    loop: asyncio.AbstractEventLoop
    sent: int  # calls this rank made

    @property
    def plane(self) -> Notices: ...  # the data plane: a wave's messages

    @property
    def server(self) -> _Served: ...

    def closed_reason(self) -> DistError: ...

    def ranks_alive(self) -> list[int]: ...

    def alone(self) -> bool: ...  # every other rank failed or left

    def finish_shutdown(self, *, force: bool = False) -> None: ...

    async def wait_idle(self) -> None: ...


class Termination:
    """One rank's part in ``rpc.shutdown`` (and its coordination, while it is the coordinator)."""

    def __init__(self, agent: Host) -> None:
        self.agent = agent
        self.work: Work[None] | None = None  # this rank's shutdown, once called
        self._task: asyncio.Task[None] | None = None
        self._stopped = False  # told to stop: this rank's shutdown completes
        self._coordinator: int | None = None  # whom this rank's latest report went to
        self._wave = 0  # this rank's latest report to it
        self._verdicts: dict[tuple[int, int], asyncio.Future[bool]] = {}  # (coordinator, wave)
        # As the coordinator: the reports of each wave, and the latest wave decided.
        self._reports: dict[int, dict[int, tuple[int, int]]] = {}
        self._decided = 0

    def coordinator(self) -> int:
        """The lowest rank alive: rank 0 while it lives."""
        return min(self.agent.ranks_alive(), default=self.agent.rank)

    def start(self, timeout: float | None) -> Work[None]:
        """Begin this rank's shutdown (once); the handle resolves when every rank may stop."""
        if self.work is not None:
            return self.work
        agent = self.agent
        work: Work[None] = Work.pending(agent.loop, "rpc.shutdown")
        self.work = work
        self._task = agent.loop.create_task(self._run(timeout))

        def finished(task: asyncio.Task[None]) -> None:
            if task.cancelled():
                work.set_exception(agent.closed_reason())
            elif (exc := task.exception()) is not None:
                work.set_exception(exc)
            else:
                work.set_result(None)

        self._task.add_done_callback(finished)
        return work

    async def _run(self, timeout: float | None) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._waves()
        except TimeoutError:
            raise DistTimeoutError(self._late_message(timeout)) from None
        except DistError:
            # The session broke (a failing rank 0 took its server along) after every other
            # rank was known to have failed or left: no verdict was needed from anyone.
            if not self.agent.alone():
                raise
        self.agent.finish_shutdown()

    async def _waves(self) -> None:
        while not self._stopped:
            await self.agent.wait_idle()
            await self._verdict(self._report())

    def _late_message(self, timeout: float | None) -> str:
        coordinator = self.coordinator() if self._coordinator is None else self._coordinator
        if coordinator == self.agent.rank:
            got = self._reports.get(self._wave, {})
            late = [r for r in self.agent.ranks_alive() if r not in got]
            who = (
                f"ranks {late} had not called it or were still busy"
                if late
                else "calls kept coming"
            )
        else:
            who = (
                f"rank {coordinator}, which coordinates it, had not seen every rank "
                "call it with no call running"
            )
        return (
            f"rpc.shutdown() did not complete within {timeout} s: {who}. Calls are still "
            "served; call rpc.shutdown() on every rank, or destroy_process_group() to stop."
        )

    def _report(self) -> tuple[int, int]:
        """Report this rank's counters to the coordinator, in its next wave; that wave."""
        agent = self.agent
        coordinator = self.coordinator()
        if coordinator != self._coordinator:  # a new coordinator counts waves afresh
            self._coordinator, self._wave = coordinator, 0
        self._wave += 1
        key = (coordinator, self._wave)
        self._verdict(key)  # made before the coordinator (this rank, maybe) can answer
        counters = (agent.sent, agent.server.served)
        if coordinator == agent.rank:
            self._collect(agent.rank, self._wave, counters)
        else:
            self._tell(coordinator, [_Kind.REPORT, self._wave, *counters])
        return key

    def _verdict(self, key: tuple[int, int]) -> asyncio.Future[bool]:
        future = self._verdicts.get(key)
        if future is None:
            future = self._verdicts[key] = self.agent.loop.create_future()
        return future

    def on_message(self, src: int, extra: Any) -> None:
        """A wave's message from ``src`` (a request of op ``SHUTDOWN``)."""
        kind = _Kind(extra[0])
        wave = int(extra[1])
        if kind is _Kind.REPORT:
            # Kept even before this rank knows that it coordinates (a rank below it
            # failed, and the reporting rank heard of it first).
            self._collect(src, wave, (int(extra[2]), int(extra[3])))
            return
        stop = bool(extra[2])
        if src != self._coordinator or wave != self._wave:
            return  # from a coordinator this rank reports to no more, or a wave answered
        if self._stopped:
            if not stop:
                self._report()  # a later coordinator's waves need this rank's final counters
            return
        self._stopped = stop
        future = self._verdict((src, wave))
        if not future.done():
            future.set_result(stop)
        self._verdicts.pop((src, wave - 1), None)

    def _collect(self, src: int, wave: int, counters: tuple[int, int]) -> None:
        self._reports.setdefault(wave, {})[src] = counters
        self._decide(wave)

    def member_gone(self, rank: int) -> None:
        """``rank`` failed or left: nobody waits for it any more.

        If it was the coordinator of this rank's latest report, that report goes to
        the next one; if this rank now coordinates, it decides without ``rank``.
        """
        coordinator = self.coordinator()
        if self._coordinator is not None and coordinator != self._coordinator:
            if self._stopped:
                self._report()
            else:  # the wave is over unanswered: the next goes to the new coordinator
                future = self._verdicts.get((self._coordinator, self._wave))
                if future is not None and not future.done():
                    future.set_result(False)
        if coordinator == self.agent.rank:
            self._decide(self._decided + 1)

    def _decide(self, wave: int) -> None:
        got = self._reports.get(wave, {})
        alive = self.agent.ranks_alive()  # shutdown completes among the ranks still alive
        if (
            wave <= self._decided
            or self.coordinator() != self.agent.rank
            or not set(alive) <= got.keys()
        ):
            return
        got = {r: c for r, c in got.items() if r in alive}
        stop = self._reports.get(wave - 1) == got
        self._decided = wave
        self._reports[wave] = got
        self._reports.pop(wave - 1, None)
        logger.debug("rpc.shutdown wave %d complete: %s", wave, "stop" if stop else "again")
        for rank in alive:
            if rank == self.agent.rank:
                self.on_message(rank, [_Kind.VERDICT, wave, stop])
            else:
                self._tell(rank, [_Kind.VERDICT, wave, stop])

    def _tell(self, dst: int, extra: list[Any]) -> None:
        notify(self.agent.plane, dst, Op.SHUTDOWN, [int(x) for x in extra])

    def fail(self, exc: BaseException) -> None:
        """The session failed or closed: waiting for a verdict is over."""
        for future in self._verdicts.values():
            if not future.done():
                future.set_exception(exc)
                future.exception()  # retrieved: the shutdown task re-raises it
