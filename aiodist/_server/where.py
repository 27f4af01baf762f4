"""Where every rank is: each member's latest reported operation, and who a collective waits on.

Each heartbeat of a member carries ``[channel, current, last, sent]``
(``Heartbeat.where``, bounded and typed in ``_wire/bounds.py``): its oldest
unfinished operation and the collective it finished last, each
``[group, seq, name, seconds]`` (``sent`` is its traffic, ``traffic.py``).
``heard`` keeps them on the ``Member``, with the times turned into this
server's clock (``since``, ``ended``), so that ages stay right between
heartbeats. ``positions`` reads a job: each rank's state and operation, and
for each collective some rank is in, the ranks inside it and the ranks that
have not entered it yet (with what they did last). A client puts that in
words (``_control/status.py``).

Sans-IO, like the job table: the caller gives the time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Protocol

from aiodist._server.parts import MemberView

if TYPE_CHECKING:
    from collections.abc import Iterable


class _Member(MemberView, Protocol):
    position: tuple[Any, Any] | None


#: The most ranks a collective's ``waiting`` and ``not_entered`` list (the counts say all).
LISTED: Final = 64


def heard(member: _Member, entry: list[Any], now: float) -> None:
    """Member ``member`` reported ``entry`` (``[channel, current, last, sent]``) at ``now``."""
    _, current, last, _ = entry
    member.position = (
        None if current is None else (current[0], current[1], current[2], now - current[3]),
        None if last is None else (last[0], last[1], last[2], now - last[3]),
    )


def _op(op: tuple[str, int, str, float] | None, now: float, key: str) -> dict[str, Any] | None:
    if op is None:
        return None
    group, seq, name, at = op
    return {"group": group, "seq": seq, "name": name, key: max(0.0, now - at)}


def member_position(member: _Member, now: float) -> dict[str, Any]:
    """``{"op": ..., "last": ...}`` of one member (None where it reported nothing)."""
    if member.position is None:
        return {"op": None, "last": None}
    current, last = member.position
    return {"op": _op(current, now, "for"), "last": _op(last, now, "ago")}


def positions(job: str, present: Iterable[_Member], now: float) -> list[dict[str, Any]]:
    """The collectives some rank of job ``job`` (its members ``present``) is in, with who
    is in and who has not entered.

    One ``{"group", "seq", "name", "waiting": [{"rank", "for"}], "not_entered":
    [{"rank", "last"}]}`` per (group, seq), oldest first. A rank *not entered* is
    a member of the group (every active member, for the job's world group; for
    another group, the members that reported an operation of it) that is not in
    that collective: it is behind (its last collective of that group has a lower
    number), or outside any operation.
    """
    members = [m for m in present if m.status == "active" and m.rank >= 0]
    calls: dict[tuple[str, int], dict[str, Any]] = {}
    for m in members:
        if m.position is None or m.position[0] is None:
            continue
        group, seq, name, since = m.position[0]
        if not seq:  # point-to-point: no collective to wait in
            continue
        call = calls.setdefault(
            (group, seq),
            {"group": group, "seq": seq, "name": name, "waiting": [], "not_entered": []},
        )
        call["waiting"].append({"rank": m.rank, "for": max(0.0, now - since)})
    for (group, seq), call in calls.items():
        inside = {w["rank"] for w in call["waiting"]}
        for m in members:
            if m.rank in inside:
                continue
            pos = m.position
            if group != job and not _has_group(pos, group):
                continue
            current = None if pos is None else pos[0]
            if current is not None and current[0] == group and current[1] > seq:
                continue  # past it already (it ran it, the others did not finish yet)
            last = member_position(m, now)
            call["not_entered"].append({"rank": m.rank, "op": last["op"], "last": last["last"]})
        for key in ("waiting", "not_entered"):  # bounded: a job may have 10,000 ranks
            ranks = sorted(call[key], key=lambda w: w["rank"])
            call[f"{key}_count"] = len(ranks)
            call[key] = ranks[:LISTED]
    return sorted(calls.values(), key=lambda c: (c["group"], c["seq"]))


def _has_group(pos: Any, group: str) -> bool:
    return pos is not None and any(op is not None and op[0] == group for op in pos)
