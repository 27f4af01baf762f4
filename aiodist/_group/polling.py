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
(``sched_yield``; a microsecond when there is none): a polling rank never
holds back a peer that the scheduler placed on its CPU, the one whose message
it may be waiting for. That matters with more ranks than CPUs, and with two
ranks on two CPUs too, which the scheduler may put on one.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import asyncio

__all__ = ["Poller", "poller"]

DEFAULT_SPIN_US: Final = 200


def _spin_seconds() -> float:
    raw = os.environ.get("AIODIST_SPIN_US", "")
    try:
        us = int(raw) if raw.strip() else DEFAULT_SPIN_US
    except ValueError:
        raise ValueError(
            f"AIODIST_SPIN_US={raw!r} is not a whole number of microseconds (0 turns polling off)"
        ) from None
    return max(us, 0) / 1e6


class Poller:
    """Keeps one loop polling while tasks wait (see the module's docstring)."""

    __slots__ = ("_deadline", "_loop", "_running", "_spin", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._spin = _spin_seconds()
        self._deadline = 0.0
        self._running = False
        self.waiting = 0  # tasks suspended on a running Work

    def wait_started(self) -> None:
        """A task suspends on a running ``Work``: poll for up to the spin time from now."""
        self.waiting += 1
        if not self._spin:
            return
        self._deadline = time.monotonic() + self._spin
        if not self._running:
            self._running = True
            self._loop.call_soon(self._tick)

    def wait_ended(self) -> None:
        self.waiting -= 1

    def _tick(self) -> None:
        if not self.waiting or time.monotonic() > self._deadline or self._loop.is_closed():
            self._running = False
            return
        os.sched_yield()
        self._loop.call_soon(self._tick)


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
