"""Busy-polling: a loop with a wait on keeps polling, without sleeping, for a short while.

A small message's round trip on one host is mostly the kernel waking the
receiver: a process asleep in ``epoll_wait`` is woken through the scheduler
(tens of microseconds on a virtual machine, most of it paid by the sender's
``write``), while one that polls sees the bytes within a microsecond or two.
MPI and NCCL poll for the same reason.

So while a task awaits a running ``Work``, the loop does not sleep: a callback
that puts itself back on the ready queue keeps the loop's poll at a zero
timeout (with uvloop and with asyncio's own loop), so a frame that arrives is
read in the same turn. The loop keeps running everything else meanwhile. It
stops once nothing awaits, or when a wait has lasted ``AIODIST_SPIN_US``
microseconds (default 200; 0 turns polling off): a long wait sleeps as
before, so an idle rank costs no CPU.

Each poll first yields the CPU to any runnable process on it
(``sched_yield``; a microsecond when there is none). That is not always
enough: a rank that sends wakes its peer on its own CPU (the kernel expects
a sender to sleep next), and there the scheduler may keep running the
poller, which then polls for its whole spin time while the peer it waits for
cannot run. So polling also watches whether it pays: after ``MISSES_TO_BACK_OFF``
waits in a row that outlasted their spin time, the next waits sleep at once
(``BACK_OFF_WAITS``, doubling each time it happens again, up to
``MAX_BACK_OFF_WAITS``), and a wait that ends while polling resets it. Ranks
on one CPU then take turns through the kernel (a few microseconds), and
ranks with more of them than CPUs stop burning time that others need.
While it backs off, every ``PROBE_EVERY``-th wait polls all the same: the
waits of a program change (large transfers, then small round trips between
two ranks), and one that polling catches ends the back-off at once.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Final

from aiodist import _settings

if TYPE_CHECKING:
    import asyncio

MISSES_TO_BACK_OFF: Final = 3
BACK_OFF_WAITS: Final = 64
MAX_BACK_OFF_WAITS: Final = 4096
PROBE_EVERY: Final = 16


def _spin_seconds() -> float:
    return _settings.SPIN_US.read() / 1e6


class Poller:
    """Keeps one loop polling while tasks wait (see the module's docstring)."""

    __slots__ = (
        "_back_off",
        "_deadline",
        "_loop",
        "_misses",
        "_running",
        "_skip",
        "_spin",
        "waiting",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._spin = _spin_seconds()
        self._deadline = 0.0
        self._running = False
        self._misses = 0  # waits in a row that outlasted their spin time
        self._back_off = BACK_OFF_WAITS  # waits to sleep through at the next back-off
        self._skip = 0  # waits still to sleep through at once
        self.waiting = 0  # tasks suspended on a running Work

    def wait_started(self) -> None:
        """A task suspends on a running ``Work``: poll for up to the spin time from now."""
        self.waiting += 1
        if not self._spin:
            return
        if self._skip:
            self._skip -= 1
            if self._skip % PROBE_EVERY:
                return
        self._deadline = time.monotonic() + self._spin
        if not self._running:
            self._running = True
            self._loop.call_soon(self._tick)

    def wait_ended(self) -> None:
        self.waiting -= 1
        if self._running and (self._misses or self._skip):  # it came while polling: it pays
            self._misses = self._skip = 0
            self._back_off = BACK_OFF_WAITS

    def _tick(self) -> None:
        if not self.waiting:
            self._running = False
            return
        if time.monotonic() > self._deadline:
            self._running = False
            if not self._skip:  # a probe's miss leaves the back-off as it is
                self._missed()
            return
        os.sched_yield()
        self._loop.call_soon(self._tick)

    def _missed(self) -> None:
        self._misses += 1
        if self._misses >= MISSES_TO_BACK_OFF:
            self._misses = 0
            self._skip = self._back_off
            self._back_off = min(2 * self._back_off, MAX_BACK_OFF_WAITS)


_pollers: dict[asyncio.AbstractEventLoop, Poller] = {}


def poller(loop: asyncio.AbstractEventLoop) -> Poller:
    """The ``Poller`` of ``loop`` (one per loop, made on first use)."""
    p = _pollers.get(loop)
    if p is None:
        if len(_pollers) > 64:  # loops of finished runs (tests run many)
            for old in [old for old in _pollers if old.is_closed()]:
                del _pollers[old]
        p = _pollers[loop] = Poller(loop)
    return p
