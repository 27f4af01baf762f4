"""The heartbeat rules of a control connection, sans-IO: the caller gives the time."""

from __future__ import annotations

from aiodist._control.liveness import Liveness


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


def test_a_stopped_loop_reports_how_late_its_heartbeat_ran() -> None:
    rules = _beating(every=1.0)
    assert rules.stalled_for(0.5, running=True) == 0.0
    assert rules.stalled_for(31.0, running=True) == 30.0  # overdue right now
    rules.beat(31.0)
    rules.scheduled(31.0)
    assert rules.stalled_for(31.5, running=True) == 30.0  # and remembered
    assert rules.stalled_for(40.0, running=False) == 30.0
