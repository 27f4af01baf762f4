"""What every part of the job table builds on: the outbox it acts through, the job it
belongs to, how it refuses a request and names the messages it handles.

Every part of the table (a job's store, barriers, regroups and notices; the
membership; re-attachment) is handed the table's one ``Outbox`` and acts only
through it, so the table stays sans-IO:

- ``send`` and ``close``: actions the asyncio shell takes (``take_actions``),
  in order, one write per connection for a whole batch;
- ``at``: a deadline in the one heap (``next_deadline``, ``fire_due``); a
  target whose ``done`` is set by then is skipped, so nothing is ever removed
  from the heap but by popping it;
- ``record``: a change of durable state (``records.py``), kept for the state
  directory (``take_records``) when the job is durable; every change is
  counted (``changes``), kept or not, so the table can check that only a
  message declared ``durable`` made one.

Every timeout is checked before it reaches ``at`` (``_wire/bounds.py``): the heap
holds finite deadlines only (one NaN breaks a heap's order for every job).

A part answers the messages it declares with ``@handles`` (``handlers`` finds
them), and refuses one by raising ``BadRequest``: that request alone gets the
error. ``JobView`` is what a job's parts read of the job that owns them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from aiodist._errors import ErrorCode
from aiodist._wire.bounds import FieldError
from aiodist._wire.headers import check_message

if TYPE_CHECKING:
    from collections.abc import Callable

F = TypeVar("F", bound="Callable[..., None]")

ConnId = int


@dataclass(frozen=True, slots=True)
class Send:
    conn: ConnId
    msg: Any


@dataclass(frozen=True, slots=True)
class Close:
    conn: ConnId
    reason: str


class Target(Protocol):
    """What a deadline is for: once ``done``, its deadline no longer applies."""

    done: bool


class MemberView(Protocol):
    """What the parts read of a member (``jobs.Member``)."""

    @property
    def conn(self) -> ConnId: ...
    @property
    def rank(self) -> int: ...
    @property
    def host(self) -> str: ...
    @property
    def pid(self) -> int: ...
    @property
    def status(self) -> str: ...


class JobView(Protocol):
    """What a job's parts read of the job that owns them (``jobs.Job``)."""

    name: str
    world_size: int
    complete: bool
    logged: bool  # the state directory holds it: its changes are recorded
    failures: list[tuple[int, str, int, str]]
    left: dict[int, tuple[str, int]]

    def gone(self) -> set[int]: ...


class Outbox:
    """The actions, deadlines and durable records of one job table."""

    def __init__(self) -> None:
        self._actions: list[Send | Close] = []
        self._records: list[Any] = []
        # (when, sequence, target, fire): compared in C, the sequence breaking ties, so
        # that neither targets nor callbacks are ever compared (a heap of dataclasses
        # compared in Python cost a 4K-rank join storm 96K __lt__ calls).
        self._timers: list[tuple[float, int, Target, Callable[[Any, float], None]]] = []
        self._seq = itertools.count()
        self.changes = 0  # records made so far, kept or not
        # The message in hand came from the wire: its values were checked on decoding.
        self.decoded: object = None

    # --- what the parts do ---------------------------------------------------------------

    def send(self, conn: ConnId, msg: Any) -> None:
        self._actions.append(Send(conn, msg))

    def close(self, conn: ConnId, reason: str) -> None:
        self._actions.append(Close(conn, reason))

    def at(self, when: float, target: Target, fire: Callable[[Any, float], None]) -> None:
        """Call ``fire(target, now)`` at ``when`` unless ``target.done`` by then."""
        assert math.isfinite(when), when
        heapq.heappush(self._timers, (when, next(self._seq), target, fire))

    def record(self, job: JobView, rec: Any) -> None:
        """``rec`` changed ``job``'s durable state: keep it if the state directory holds it."""
        self.changes += 1
        if job.logged:
            self._records.append(rec)

    def check(self, msg: Any) -> None:
        """``check_values``, unless ``msg`` was checked on decoding already: before a
        deadline is computed from it."""
        if msg is not self.decoded:
            check_values(msg)

    # --- what the table hands on -----------------------------------------------------------

    def take_actions(self) -> list[Send | Close]:
        actions, self._actions = self._actions, []
        return actions

    def take_records(self) -> list[Any]:
        records, self._records = self._records, []
        return records

    def next_deadline(self) -> float | None:
        timers = self._timers
        while timers and timers[0][2].done:
            heapq.heappop(timers)
        return timers[0][0] if timers else None

    def fire_due(self, now: float) -> None:
        """Fire every deadline up to ``now`` whose target is not done."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, target, fire = heapq.heappop(timers)
            if not target.done:
                fire(target, now)

    @property
    def deadlines(self) -> list[float]:
        """When the deadlines in the heap fall, done ones included (they go once they come
        up, or once ``next_deadline`` passes them)."""
        return [when for when, *_ in self._timers]


class BadRequest(Exception):
    """A request refused alone: its sender gets this error, the connection goes on."""

    def __init__(self, code: ErrorCode, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.details = details or {}


def check_values(msg: Any) -> None:
    """Refuse a request whose values are out of range (``_wire/bounds.py``).

    Messages from the wire were checked on decoding; this guards the table's
    own input (an embedded caller, a test) before a deadline is computed.

    Raises:
        BadRequest: A field is out of range; the message names it.
    """
    try:
        check_message(msg)
    except FieldError as exc:
        raise BadRequest(ErrorCode.BAD_REQUEST, str(exc), exc.wire_details()) from None


def handles(*kinds: type[Any]) -> Callable[[F], F]:
    """Mark a part's method as the one that answers messages of ``kinds``."""

    def mark(method: F) -> F:
        method.handles = kinds  # type: ignore[attr-defined]
        return method

    return mark


def handlers(part: object) -> dict[type[Any], Callable[..., None]]:
    """The messages ``part`` answers (its ``@handles`` methods), bound to it."""
    return {kind: getattr(part, name) for kind, name in handled(type(part)).items()}


_HANDLED: dict[type[Any], dict[type[Any], str]] = {}


def handled(cls: type[Any]) -> dict[type[Any], str]:
    """The messages the parts of class ``cls`` answer, and the name of the method of each."""
    found = _HANDLED.get(cls)
    if found is None:
        found = _HANDLED[cls] = {}
        for name, method in vars(cls).items():
            for kind in getattr(method, "handles", ()):
                assert kind not in found, f"{kind.__name__} handled twice by {cls.__name__}"
                found[kind] = name
    return found
