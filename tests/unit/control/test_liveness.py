"""The heartbeat rules of a control connection, sans-IO: the caller gives the time."""

from __future__ import annotations

import math
from typing import Any

from aiodist._control.liveness import SERVER_STALL, Heartbeats, Liveness
from aiodist._wire.timing import STALL_GAP


def _beating(every: float = 1.0, timeout: float = 5.0) -> Liveness:
    rules = Liveness(now=0.0)
    rules.interval = every
    assert rules.watch(timeout)  # the first watch sends one at once
    assert not rules.watch(timeout * 2)  # later ones only lower the limit, if shorter
    assert rules.silence_limit == timeout
    rules.sent(0.0)
    rules.scheduled(0.0)
    return rules


def test_a_server_that_never_echoed_is_never_gone_for_silence() -> None:
    rules = _beating()
    for t in range(1, 60):
        assert rules.beat(float(t)) is None
        rules.sent(float(t))
        rules.scheduled(float(t))


def test_silence_counts_from_the_oldest_unanswered_heartbeat() -> None:
    rules = _beating(timeout=5.0)
    rules.echoed = True
    rules.last_heard = 0.5  # the echo of the first one
    for t in range(1, 6):
        assert rules.beat(float(t)) is None  # 1..5 s since the heartbeat of t=1
        rules.sent(float(t))
        rules.scheduled(float(t))
    assert rules.beat(6.5) == 5.5  # nothing heard since the heartbeat sent at t=1


class _Clock:
    """A loop as ``Heartbeats`` uses it: the time, and timers it never fires itself."""

    def __init__(self) -> None:
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Any) -> Any:
        return _Timer()


class _Timer:
    def cancel(self) -> None:
        pass


def test_a_stopped_loop_reports_how_late_its_heartbeat_ran() -> None:
    clock = _Clock()
    sent: list[float] = []
    beats = Heartbeats(clock, lambda: sent.append(clock.now), lambda s: None, lambda: False)  # type: ignore[arg-type]
    beats.start(1.0, None)
    assert sent == []  # the first goes one interval from now
    clock.now = 0.5
    assert beats.stalled_for() == 0.0
    clock.now = 31.0
    assert beats.stalled_for() == 30.0  # overdue right now, before its timer runs
    beats._beat()  # the timer, 30 s late
    assert sent == [31.0]
    clock.now = 31.5
    assert beats.stalled_for() == 30.0  # and remembered
    beats.stop()
    clock.now = 40.0
    assert beats.stalled_for() == 30.0


def test_a_server_heard_again_after_a_long_silence_may_have_stood_still() -> None:
    rules = _beating()
    for t in (0.5, 1.5, 2.5):  # echoes, one a second
        rules.heard(t)
    assert rules.resumed_at == -math.inf
    rules.heard(2.5 + SERVER_STALL)  # silent that long: it may have stood still
    assert rules.resumed_at == 2.5 + SERVER_STALL
    rules.heard(3.0 + SERVER_STALL)
    assert rules.resumed_at == 2.5 + SERVER_STALL  # when it ran again, not since
    assert rules.last_heard == 3.0 + SERVER_STALL
    # What the server counts as a stall, this connection does too (a little shorter: the
    # server's last word came before it stopped).
    assert SERVER_STALL < STALL_GAP
