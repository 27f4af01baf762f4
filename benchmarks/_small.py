"""Small messages at the loopback ceiling (issue 24): the cases, world sizes and goals.

An 8-byte point-to-point round trip, a barrier and a 4-byte all_reduce move
almost nothing: what they time is each system's per-call overhead, and how a
collective's schedule grows with the ranks. ``bench_collectives.bench`` runs
``SMALL_CASES`` (``case_list=``) at ``SMALL_WORLD_SIZES``, aiodist and gloo
side by side as for every collective; this module judges and tabulates the
result (the report's ``small`` section, ``bench_collectives --small``).

Goals, aiodist's time over gloo's at the same world size: the round trip at
most 0.6 at N=2 and 4, the barrier at most 0.2 at N=4, the all_reduce at most
0.5 at N=4 and 8; and the barrier growing as log(n): its time at the largest
world size measured (16 in a full run) over its time at 2 at most
log2(16)/log2(2) = 4. Gloo's growth is shown beside it, not judged.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Final

from benchmarks._collective_ranks import SYSTEMS, Case, Mode, System
from benchmarks._common import Goal, as_summary, format_table, goal_table

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "GOALS",
    "SMALL_CASES",
    "SMALL_WORLD_SIZES",
    "goal_list",
    "growth",
    "growth_world_size",
    "in_order",
    "median_s",
    "render",
    "result_row",
]

SMALL_CASES: Final = (Case("p2p_round_trip", 8), Case("barrier"), Case("all_reduce", 4))
SMALL_WORLD_SIZES: Final[dict[Mode, tuple[int, ...]]] = {
    "full": (2, 4, 8, 16),
    "quick": (2, 4, 8),
    "smoke": (2,),
}
SOURCE: Final = "issue 24"
# (case, world sizes, the most time aiodist/gloo may be there)
GOALS: Final[tuple[tuple[str, tuple[int, ...], float], ...]] = (
    ("p2p_round_trip 8 B", (2, 4), 0.6),
    ("barrier", (4,), 0.2),
    ("all_reduce 4 B", (4, 8), 0.5),
)
GROWTH_CASE: Final = "barrier"
GROWTH_WORLD_SIZE: Final = 16  # judged here when a run reaches no size above 2


def result_row(data: dict[str, Any], case: str, n: int) -> dict[str, Any] | None:
    """The result of ``case`` at world size ``n``, or None if it was not run."""
    return next((r for r in data["results"] if r["case"] == case and r["world_size"] == n), None)


def median_s(row: dict[str, Any] | None, system: System) -> float | None:
    """A system's median seconds per call in ``row`` (also from its JSON form)."""
    if row is None:
        return None
    s = as_summary(row[system].get("summary_s"))
    return None if s is None else s.median


def growth(data: dict[str, Any], case: str, system: System, n: int) -> float | None:
    """``case``'s time at world size ``n`` over its time at 2, for ``system``."""
    base = median_s(result_row(data, case, 2), system)
    t = median_s(result_row(data, case, n), system)
    return t / base if t is not None and base else None


def growth_world_size(data: dict[str, Any]) -> int:
    """The world size the growth goal is judged at: the largest measured above 2."""
    return max((n for n in data["config"]["world_sizes"] if n > 2), default=GROWTH_WORLD_SIZE)


def goal_list(data: dict[str, Any]) -> list[Goal]:
    """Issue 24's goals ("not measured" where a world size was not run)."""
    out = []
    for case, sizes, limit in GOALS:
        for n in sizes:
            row = result_row(data, case, n)
            value = None if row is None else row.get("time_ratio")
            out.append(
                Goal.judge(f"{case}, N={n}", "time aiodist/gloo", "<=", limit, value, SOURCE)
            )
    m = growth_world_size(data)
    out.append(
        Goal.judge(
            f"{GROWTH_CASE} growth, N=2 to {m}",
            f"aiodist time({m})/time(2)",
            "<=",
            math.log2(m) / math.log2(2),
            growth(data, GROWTH_CASE, "aiodist", m),
            SOURCE,
        )
    )
    return out


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def _fixed(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cells(row: dict[str, Any], system: System) -> list[str]:
    res = row[system]
    if "error" in res:
        return [f"FAILED: {str(res['error'])[:40]}", ""]
    s = as_summary(res.get("summary_s"))
    return ["-", ""] if s is None else [_us(s.median), s.spread(1e6)]


def in_order(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Case by case in ``SMALL_CASES`` order, each by world size: the growth reads down."""
    rank = {c.name: i for i, c in enumerate(SMALL_CASES)}
    return sorted(results, key=lambda r: (rank.get(r["case"], len(rank)), r["world_size"]))


def render(data: dict[str, Any], goals: bool = False) -> str:
    """The times and each case's growth from world size 2 (and ``goals``), as text."""
    rows = [
        [
            row["case"],
            str(row["world_size"]),
            *_cells(row, "gloo"),
            *_cells(row, "aiodist"),
            _fixed(row.get("time_ratio")),
            *(_fixed(growth(data, row["case"], s, row["world_size"])) for s in SYSTEMS),
        ]
        for row in in_order(data["results"])
    ]
    headers = [
        "case",
        "N",
        "gloo us",
        "gloo min-max",
        "aiodist us",
        "aiodist min-max",
        "time a/g",
        "gloo xN=2",
        "aiodist xN=2",
    ]
    text = (
        "small messages (xN=2: the time over the same case's at world size 2; "
        "log2(N) growth is 2, 3, 4 at N=4, 8, 16)\n" + format_table(headers, rows)
    )
    return f"{text}\n\ngoals ({SOURCE})\n{goal_table(goal_list(data))}" if goals else text
