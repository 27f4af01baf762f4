"""Sans-IO tests of what an unproved connection may cost (``Gate``) and of ``LogBudget``."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiodist._wire.preauth import (
    MIN_PENDING,
    PREAUTH_FRAME_LIMITS,
    Gate,
    LogBudget,
    PreAuthLimits,
)

# --- PreAuthLimits ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"max_bytes": 0}, id="no-bytes"),
        pytest.param({"max_pending": 0}, id="no-room"),
        pytest.param({"deadline": 0.0}, id="no-time"),
        pytest.param({"deadline": float("nan")}, id="nan-deadline"),
        pytest.param({"deadline": float("inf")}, id="inf-deadline"),
    ],
)
def test_preauth_limits_out_of_range_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="pre-authentication limits out of range"):
        PreAuthLimits(**kwargs)  # type: ignore[arg-type]


def test_preauth_frame_limits_allow_a_handshake_and_no_payload() -> None:
    assert PREAUTH_FRAME_LIMITS.max_payload_bytes == 0
    assert 256 <= PREAUTH_FRAME_LIMITS.max_header_bytes <= 64 * 1024


# --- Gate ------------------------------------------------------------------------------------


def test_gate_full_sheds_the_oldest_first() -> None:
    gate: Gate[str] = Gate(PreAuthLimits(max_pending=3))
    assert [gate.admit(c, now=float(i)) for i, c in enumerate("abc")] == [[], [], []]
    assert gate.admit("d", now=3.0) == ["a"]
    assert gate.admit("e", now=4.0) == ["b"]
    assert len(gate) == 3
    assert "a" not in gate
    assert all(c in gate for c in "cde")


def test_gate_sheds_the_silent_before_those_that_spoke() -> None:
    gate: Gate[str] = Gate(PreAuthLimits(max_pending=3))
    for i, conn in enumerate("abc"):
        gate.admit(conn, now=float(i))
    gate.spoke("a")  # a real client's first frame: it is in its handshake
    assert gate.admit("d", now=3.0) == ["b"]
    assert gate.admit("e", now=4.0) == ["c"]
    gate.spoke("d")
    gate.spoke("e")
    # Every one spoke: the oldest goes.
    assert gate.admit("f", now=5.0) == ["a"]


def test_gate_talking_peer_survives_any_number_of_silent_strangers() -> None:
    gate: Gate[int] = Gate(PreAuthLimits(max_pending=8, deadline=10.0))
    gate.admit(-1, now=0.0)
    gate.spoke(-1)
    shed = [c for i in range(10_000) for c in gate.admit(i, now=i * 1e-4)]
    assert -1 in gate
    assert len(shed) == 10_000 - 7
    gate.passed(-1)  # its proof came: out of the gate
    assert -1 not in gate
    assert len(gate) == 7


def test_gate_charge_counts_bytes_until_over_the_budget() -> None:
    gate: Gate[str] = Gate(PreAuthLimits(max_bytes=100))
    gate.admit("a", now=0.0)
    assert gate.charge("a", 60)
    assert gate.charge("a", 40)  # exactly at the budget
    assert not gate.charge("a", 1)
    gate.admit("b", now=0.0)
    assert not gate.charge("b", 101)


def test_gate_charge_ignores_connections_outside() -> None:
    gate: Gate[str] = Gate(PreAuthLimits(max_bytes=10))
    gate.admit("a", now=0.0)
    gate.passed("a")
    assert gate.charge("a", 10**9)  # proved: no budget
    assert gate.charge("never-admitted", 10**9)


def test_gate_expired_returns_those_past_their_deadline_oldest_first() -> None:
    gate: Gate[str] = Gate(PreAuthLimits(deadline=10.0))
    for i, conn in enumerate("abcd"):
        gate.admit(conn, now=float(i))
    gate.passed("b")
    assert gate.next_deadline() == 10.0
    assert gate.expired(now=9.9) == []
    assert gate.expired(now=12.0) == ["a", "c"]
    assert gate.next_deadline() == 13.0
    gate.left("d")
    assert gate.next_deadline() is None
    assert gate.expired(now=100.0) == []


def test_gate_expired_connection_is_not_shed_again() -> None:
    gate: Gate[str] = Gate(PreAuthLimits(max_pending=2, deadline=1.0))
    gate.admit("a", now=0.0)
    gate.admit("b", now=0.5)
    assert gate.expired(now=1.2) == ["a"]
    assert gate.admit("c", now=1.3) == []
    assert gate.admit("d", now=1.4) == ["b"]


OPS = st.sampled_from(["admit", "spoke", "passed", "left", "tick"])


@given(st.lists(st.tuples(OPS, st.integers(0, 30)), max_size=200), st.integers(1, 6))
def test_gate_never_holds_more_than_max_pending_and_each_leaves_once(
    ops: list[tuple[str, int]], max_pending: int
) -> None:
    gate: Gate[int] = Gate(PreAuthLimits(max_pending=max_pending, deadline=5.0))
    inside: set[int] = set()
    now = 0.0
    for op, conn in ops:
        now += 0.5
        if op == "admit" and conn not in inside:
            shed = gate.admit(conn, now)
            assert set(shed) <= inside
            inside -= set(shed)
            inside.add(conn)
        elif op == "spoke":
            gate.spoke(conn)
        elif op in ("passed", "left"):
            getattr(gate, op)(conn)
            inside.discard(conn)
        elif op == "tick":
            gone = gate.expired(now)
            assert set(gone) <= inside
            inside -= set(gone)
        assert len(gate) == len(inside) <= max_pending
        assert all(c in gate for c in inside)


# --- LogBudget -------------------------------------------------------------------------------

SUMMARY = re.compile(
    r"^(\d+) more refused connections? in the last 10\.0 s not logged one by one \((.*)\)$"
)


def _counts(summary: str) -> tuple[int, dict[str, int]]:
    match = SUMMARY.match(summary)
    assert match is not None, summary
    by_reason = dict(part.split(": ") for part in match.group(2).split(", "))
    return int(match.group(1)), {k: int(v) for k, v in by_reason.items()}


def test_log_budget_burst_in_full_then_one_summary_with_counts() -> None:
    log = LogBudget(burst=5, interval=10.0)
    lines: list[str] = []
    full = 0
    for i in range(2000):
        show, summary = log.note(i * 0.001, "shed" if i % 3 else "bad magic")
        full += show
        if summary is not None:
            lines.append(summary)
    assert full == 5
    assert lines == []  # the interval is not over
    assert log.due() == 10.0
    assert log.flush(9.99) is None
    summary = log.flush(10.0)
    assert summary is not None
    total, by_reason = _counts(summary)
    assert total == 1995
    assert sum(by_reason.values()) == 1995
    assert by_reason["shed"] == sum(1 for i in range(5, 2000) if i % 3)
    assert log.due() is None
    assert log.flush(100.0) is None  # said once


def test_log_budget_each_interval_gets_its_burst_and_its_summary() -> None:
    log = LogBudget(burst=2, interval=10.0)
    shown = [log.note(t, "deadline") for t in (0.0, 1.0, 2.0, 3.0)]
    assert [s for s, _ in shown] == [True, True, False, False]
    show, summary = log.note(12.0, "deadline")  # a new interval: its first line in full
    assert show
    assert summary is not None
    assert _counts(summary) == (2, {"deadline": 2})


def test_log_budget_summary_folds_many_reasons_into_other() -> None:
    log = LogBudget(burst=0, interval=1.0)
    for i in range(20):
        log.note(0.0, f"reason {i}")
    summary = log.flush(1.0)
    assert summary is not None
    total, by_reason = _counts(summary.replace("1.0 s", "10.0 s"))
    assert total == 20
    assert len(by_reason) == LogBudget.MAX_REASONS + 1
    assert by_reason["other"] == 20 - LogBudget.MAX_REASONS


def test_log_budget_nothing_held_back_is_never_due() -> None:
    log = LogBudget(burst=3, interval=10.0)
    log.note(0.0, "shed")
    assert log.due() is None
    assert log.flush(50.0) is None


def test_pending_cap_grows_with_the_open_files_between_its_floor_and_most() -> None:
    def cap(files: int | None) -> int:
        return PreAuthLimits.for_open_files(files, share=4, most=4096, deadline=5.0).max_pending

    assert cap(256) == MIN_PENDING  # never below the floor
    assert cap(1024) == 256  # a burst of 200 real clients is not shed at 1,024 files
    assert cap(1 << 20) == 4096
    assert cap(None) == 4096  # no limit known: the most
    assert PreAuthLimits.for_open_files(1024, share=4, most=9, deadline=5.0).deadline == 5.0
