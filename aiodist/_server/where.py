"""Where every rank is: each member's latest reported operation, and who a collective waits on.

Each heartbeat of a member carries ``[channel, current, last]``
(``Heartbeat.where``, bounded and typed in ``_wire/bounds.py``): its oldest
unfinished operation and the collective it finished last, each
``[group, seq, name, seconds]``. ``heard`` keeps it on the ``Member``, with the
times turned into this server's clock (``since``, ``ended``), so that ages stay
right between heartbeats. ``positions`` reads a job: each rank's state and
operation, and for each collective some rank is in, the ranks inside it and
the ranks that have not entered it yet (with what they did last).

Sans-IO, like the job table: the caller gives the time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from aiodist._server.jobs import Job, Member

#: The most ranks a collective's ``waiting`` and ``not_entered`` list (the counts say all).
LISTED: Final = 64

__all__ = ["describe_wait", "heard", "member_position", "positions", "positions_line"]


def heard(member: Member, entry: list[Any], now: float) -> None:
    """Member ``member`` reported ``entry`` (``[channel, current, last]``) at ``now``."""
    _, current, last = entry
    member.position = (
        None if current is None else (current[0], current[1], current[2], now - current[3]),
        None if last is None else (last[0], last[1], last[2], now - last[3]),
    )


def _op(op: tuple[str, int, str, float] | None, now: float, key: str) -> dict[str, Any] | None:
    if op is None:
        return None
    group, seq, name, at = op
    return {"group": group, "seq": seq, "name": name, key: max(0.0, now - at)}


def member_position(member: Member, now: float) -> dict[str, Any]:
    """``{"op": ..., "last": ...}`` of one member (None where it reported nothing)."""
    if member.position is None:
        return {"op": None, "last": None}
    current, last = member.position
    return {"op": _op(current, now, "for"), "last": _op(last, now, "ago")}


def positions(job: Job, now: float) -> list[dict[str, Any]]:
    """The collectives some rank of ``job`` is in, with who is in and who has not entered.

    One ``{"group", "seq", "name", "waiting": [{"rank", "for"}], "not_entered":
    [{"rank", "last"}]}`` per (group, seq), oldest first. A rank *not entered* is
    a member of the group (every active member, for the job's world group; for
    another group, the members that reported an operation of it) that is not in
    that collective: it is behind (its last collective of that group has a lower
    number), or outside any operation.
    """
    members = [m for m in job.members if m.status == "active" and m.rank >= 0]
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
            if group != job.name and not _has_group(pos, group):
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


def describe_wait(call: dict[str, Any]) -> str:
    """One collective's line: ``all_reduce #1042 on group 'g': ranks 0, 1 waiting 12.3 s; ...``."""
    waiting = call["waiting"]
    ranks = ", ".join(str(w["rank"]) for w in waiting)
    longest = max((w["for"] for w in waiting), default=0.0)
    plural = "ranks" if len(waiting) > 1 else "rank"
    text = f"{call['name']} #{call['seq']} on group {call['group']!r}: {plural} {ranks} "
    text += f"waiting {longest:.1f} s"
    if (more := call.get("waiting_count", len(waiting)) - len(waiting)) > 0:
        text += f" (and {more} more ranks)"
    for n in call["not_entered"]:
        text += f"; rank {n['rank']} not entered"
        op, last = n.get("op"), n.get("last")
        if op is not None:
            text += (
                f" (in {op['name']} #{op['seq']} on group {op['group']!r} for {op['for']:.1f} s)"
            )
        elif last is not None:
            text += f" (last: {last['name']} #{last['seq']}, done {last['ago']:.1f} s ago)"
        else:
            text += " (no operation reported)"
    if (more := call.get("not_entered_count", 0) - len(call["not_entered"])) > 0:
        text += f"; {more} more ranks not entered"
    return text


def positions_line(job: dict[str, Any]) -> str:
    """Where each rank of a job's status snapshot is, in one line (no collective known)."""
    parts = []
    for m in job.get("members", []):
        op, last = m.get("op"), m.get("last")
        if op is not None:
            parts.append(f"rank {m['rank']} in {op['name']} #{op['seq']} for {op['for']:.1f} s")
        elif last is not None:
            parts.append(
                f"rank {m['rank']} idle (last: {last['name']} #{last['seq']}, "
                f"done {last['ago']:.1f} s ago)"
            )
        else:
            parts.append(f"rank {m['rank']} {m.get('status', '?')}")
    return "; ".join(parts)
