"""Busy-polling while a task awaits a running Work (aiodist/_group/polling.py), on real loops."""

from __future__ import annotations

import asyncio
import time

import pytest

from aiodist._group import polling
from aiodist._group.work import Work


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the poller's turns (each one a loop turn that did not sleep)."""
    count = [0]
    tick = polling.Poller._tick

    def counted(self: polling.Poller) -> None:
        count[0] += 1
        tick(self)

    monkeypatch.setattr(polling.Poller, "_tick", counted)
    return count


def _fresh_poller(monkeypatch: pytest.MonkeyPatch, spin_us: str) -> polling.Poller:
    monkeypatch.setenv("AIODIST_SPIN_US", spin_us)
    loop = asyncio.get_running_loop()
    p = polling.Poller(loop)
    monkeypatch.setitem(polling._pollers, loop, p)
    return p


async def _wait(seconds: float) -> float:
    """Await a Work that settles ``seconds`` from now; return the CPU time the wait took."""
    loop = asyncio.get_running_loop()
    work: Work[int] = Work.pending(loop, "test")
    loop.call_later(seconds, work.set_result, 5)
    cpu = time.process_time()
    assert await work == 5
    return time.process_time() - cpu


async def _outlast(p: polling.Poller) -> None:
    """Await a Work that settles only once the poller gave up on it (a miss, however
    slow the loop's turns on a loaded machine)."""
    loop = asyncio.get_running_loop()
    work: Work[int] = Work.pending(loop, "test")

    def settle() -> None:
        if p._running:
            loop.call_later(0.001, settle)
        else:
            work.set_result(5)

    loop.call_later(0.001, settle)
    assert await work == 5


async def test_a_wait_polls_then_sleeps(monkeypatch: pytest.MonkeyPatch, ticks: list[int]) -> None:
    p = _fresh_poller(monkeypatch, "2000")
    cpu = await _wait(0.1)
    assert ticks[0] > 0  # it polled
    # ... for 2 ms, then slept: far less CPU than the 100 ms the wait lasted.
    assert cpu < 0.05, cpu
    assert p.waiting == 0
    before = ticks[0]
    await asyncio.sleep(0.01)  # not a Work: nothing polls
    assert ticks[0] - before <= 1
    assert not p._running


async def test_spin_zero_never_polls(monkeypatch: pytest.MonkeyPatch, ticks: list[int]) -> None:
    p = _fresh_poller(monkeypatch, "0")
    await _wait(0.02)
    assert ticks[0] == 0
    assert p.waiting == 0


async def test_waits_that_outlast_polling_back_off_and_one_that_polling_catches_resets(
    monkeypatch: pytest.MonkeyPatch, ticks: list[int]
) -> None:
    p = _fresh_poller(monkeypatch, "100")
    for _ in range(polling.MISSES_TO_BACK_OFF):
        await _outlast(p)  # each outlasts its 100 µs of polling
    assert p._skip == polling.BACK_OFF_WAITS  # the next waits sleep at once
    before = ticks[0]
    await _wait(0.005)
    assert ticks[0] == before
    assert p._skip == polling.BACK_OFF_WAITS - 1
    # Once polling again, a wait that ends while it polls clears the misses.
    p._skip = 0
    await _outlast(p)
    assert p._misses == 1
    p._spin = 1.0  # however slow a loaded machine's next turns are, polling still runs
    loop = asyncio.get_running_loop()
    work: Work[None] = Work.pending(loop, "quick")
    loop.call_soon(work.set_result, None)
    await work
    assert p._misses == 0
    assert p._back_off == polling.BACK_OFF_WAITS


async def test_a_wait_that_polling_catches_while_backing_off_ends_the_back_off(
    monkeypatch: pytest.MonkeyPatch, ticks: list[int]
) -> None:
    # Long waits (large transfers, or more ranks than CPUs) backed it off as far as it
    # goes; then the program's waits turn short. Every PROBE_EVERY-th wait still polls,
    # and the first one that polling catches brings polling back for the waits after it.
    p = _fresh_poller(monkeypatch, "1000000")  # a probe polls until its wait ends
    p._skip = p._back_off = polling.MAX_BACK_OFF_WAITS
    loop = asyncio.get_running_loop()
    slept = 0
    while slept <= polling.PROBE_EVERY:
        before = ticks[0]
        work: Work[None] = Work.pending(loop, "quick")
        loop.call_soon(work.set_result, None)
        await work
        if ticks[0] > before:  # this one polled: it was the probe
            break
        slept += 1
    assert slept == polling.PROBE_EVERY - 1  # the waits before it slept at once
    assert p._skip == 0
    assert p._back_off == polling.BACK_OFF_WAITS
    before = ticks[0]
    await _wait(0.005)
    assert ticks[0] > before  # and the next wait polls


async def test_a_probe_that_misses_leaves_the_back_off_as_it_was(
    monkeypatch: pytest.MonkeyPatch, ticks: list[int]
) -> None:
    p = _fresh_poller(monkeypatch, "100")
    p._skip = polling.PROBE_EVERY + 2
    p._back_off = 2 * polling.BACK_OFF_WAITS
    await _wait(0.005)
    assert ticks[0] == 0  # it slept at once
    await _outlast(p)  # the probe: it polls, and the wait outlasts it
    assert ticks[0] > 0
    assert p._skip == polling.PROBE_EVERY
    assert (p._misses, p._back_off) == (0, 2 * polling.BACK_OFF_WAITS)


def test_a_bad_spin_setting_says_what_it_wants(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIODIST_SPIN_US", "fast")
    with pytest.raises(ValueError, match="AIODIST_SPIN_US='fast' is not a whole number"):
        polling._spin_seconds()
