"""Every change of a job's durable state, declared once: what the table's parts emit.

The parts of the job table (``jobs.py``: a job's membership, its store,
barriers and regroups) emit one record for each change a restart must not
lose, through the table's ``Outbox``; a server with a state directory writes
them (``durable.py``) before any reply of their batch leaves, and replays them
at start-up (``reattach.py``). A job's whole state is the same records
(``Job.records``): a snapshot, and the first records of a job once it forms.

Each record is declared as a wire message is (``_wire/headers.py``): its kind,
its fields with their types and ranges, checked when a state directory is read
back (a state directory is input, not trusted memory). A record travels as the
array ``[kind, *fields]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Final, TypeVar, dataclass_transform

from aiodist._wire.bounds import (
    MAX_WORLD_SIZE,
    Addresses,
    Generation,
    HeartbeatTimeout,
    HostName,
    Int,
    JobName,
    Len,
    Pid,
    Rank,
    Secret,
    U64Int,
)
from aiodist._wire.headers import Registry, message_header

if TYPE_CHECKING:
    from collections.abc import Callable

R = TypeVar("R")

#: The longest key and value a state directory may hold.
MAX_KEY_CHARS: Final = 1 << 20
MAX_VALUE_BYTES: Final = 1 << 30
MAX_TEXT_CHARS: Final = 1 << 16  # a failure's reason, an error's message

RECORDS: Final = Registry("record")


class Record:
    """The base of every durable record: ``job`` names the job it changes."""

    __slots__ = ()
    KIND: ClassVar[int]
    job: str


@dataclass_transform(frozen_default=True)
def record(code: int) -> Callable[[type[R]], type[R]]:
    """Declare a durable record of kind ``code``."""
    return RECORDS.declare(code, durable=True)


@record(1)
class JobFormed(Record):
    """Job ``job`` formed with ``min_world_size`` members (each a ``MemberAdded`` after it);
    ``max_world_size`` above 0: it is elastic, and grows by more ``MemberAdded``."""

    job: JobName
    generation: Generation
    min_world_size: Annotated[int, Int(1, MAX_WORLD_SIZE)]
    max_world_size: Annotated[int, Int(0, MAX_WORLD_SIZE)]


@record(2)
class MemberAdded(Record):
    """Rank ``rank`` of ``job``, as it joined (a rank is added in order: 0, 1, ...)."""

    job: JobName
    rank: Rank
    local_rank: Rank
    host: HostName
    pid: Pid
    addresses: Addresses
    heartbeat_timeout: HeartbeatTimeout
    secret: Secret


@record(3)
class KeySet(Record):
    """Store key ``key`` of ``job`` holds ``value`` now (None: it was deleted)."""

    job: JobName
    key: Annotated[str, Len(0, MAX_KEY_CHARS, "characters")]
    value: Annotated[bytes | None, Len(0, MAX_VALUE_BYTES, "bytes")]


@record(4)
class BarriersPassed(Record):
    """Every member of ``job`` reached each barrier below ``below``, and those in ``also``
    (a later call of one answers at once)."""

    job: JobName
    below: U64Int
    also: list[int]


@record(5)
class RankFailed(Record):
    job: JobName
    rank: Rank
    host: HostName
    pid: Pid
    reason: Annotated[str, Len(0, MAX_TEXT_CHARS, "characters")]


@record(6)
class RankLeft(Record):
    job: JobName
    rank: Rank
    host: HostName
    pid: Pid


@record(7)
class RegroupSettled(Record):
    """The regroup ``key`` of ``job`` was decided: every caller got ``ranks`` (``code`` 0),
    or the error ``code`` with ``message`` and ``details``."""

    job: JobName
    key: JobName
    ranks: list[int]
    code: U64Int
    message: Annotated[str, Len(0, MAX_TEXT_CHARS, "characters")]
    details: dict[str, Any]


@record(8)
class JobEnded(Record):
    """The generation ``generation`` of ``job`` ended: nothing of it is kept."""

    job: JobName
    generation: Generation


@record(9)
class StoreAnswered(Record):
    """Rank ``rank`` of ``job`` changed the store with request ``req_id``, an operation of
    kind ``op`` (``store.SET``, ``ADD``, ``COMPARE_SET``, ``DELETE``) whose answer says
    ``reply`` (``store.answer``): that request sent again is answered, not applied again.
    In the batch of the change itself, so a restart keeps both or neither."""

    job: JobName
    rank: Rank
    req_id: U64Int
    op: Annotated[int, Int(0, 3)]
    reply: Annotated[bytes | None, Len(0, MAX_VALUE_BYTES, "bytes")]


def encode_record(rec: Any) -> list[Any]:
    """``rec`` as the array a state file holds: ``[kind, *fields]``."""
    return [rec.KIND, *message_header(rec)]


def decode_record(row: Any) -> Any:
    """The record ``row`` holds (``encode_record``'s array), its types and ranges checked.

    Raises:
        ValueError: ``row`` is no record (a ``FieldError`` where a value is out of range).
    """
    if type(row) is not list or not row or type(row[0]) is not int:
        raise ValueError("a record is an array starting with its kind")
    return RECORDS.decode(row[0], row[1:])
