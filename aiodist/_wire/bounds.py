"""The values a field of a client's message may hold (``headers`` checks their types).

Every number and size the rendezvous server reads from a client is checked
here, on decoding, before anything acts on it: a timeout is a finite number of
seconds within ``[MIN_TIMEOUT, MAX_TIMEOUT]`` (a heartbeat timeout at least
``MIN_HEARTBEAT_TIMEOUT``), a count or an id is an integer within its range, a
string or a list no longer than its limit. NaN, infinities, zero, negatives
and absurd values never reach a deadline heap or a sweep interval.

A value out of range raises ``FieldError`` naming the message, the field, the
value and the allowed range. It is a ``ProtocolError``: where the message is a
request (it has a ``req_id``), the server refuses that request alone and the
connection goes on; otherwise the connection is closed, as for any malformed
frame. Server-to-client messages have no entry: a client trusts only a server
that proved the token, and checks what it uses.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import ProtocolError
from aiodist._wire.messages import (
    Barrier,
    Channel,
    CloseChannel,
    DumpRequest,
    Heartbeat,
    Hello,
    Join,
    Leave,
    MembersRequest,
    Reattach,
    Regroup,
    StatusRequest,
    StoreAdd,
    StoreCheck,
    StoreCompareSet,
    StoreDeleteKey,
    StoreGet,
    StoreNumKeys,
    StoreSet,
    StoreWait,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "MAX_ADDRESSES",
    "MAX_GROUP_NAME_CHARS",
    "MAX_HOST_CHARS",
    "MAX_OP_NAME_CHARS",
    "MAX_SECRET_BYTES",
    "MAX_TIMEOUT",
    "MAX_WHERE",
    "MAX_WORLD_SIZE",
    "MIN_HEARTBEAT_TIMEOUT",
    "MIN_TIMEOUT",
    "FieldError",
    "check_fields",
    "check_message",
]

#: The longest timeout anything may ask for: a year, in seconds.
MAX_TIMEOUT: Final = 365 * 86400.0
#: The shortest store, barrier or join timeout (a shorter one fails at once anyway).
MIN_TIMEOUT: Final = 0.001
#: The shortest heartbeat timeout: the server sweeps for silent members a quarter of it.
MIN_HEARTBEAT_TIMEOUT: Final = 0.1
MAX_WORLD_SIZE: Final = 2**31 - 1  # torch's ranks are int32
MAX_GROUP_NAME_CHARS: Final = 256
MAX_HOST_CHARS: Final = 1024
MAX_REASON_CHARS: Final = 1024  # a failed member's reason (Leave.reason)
MAX_ADDRESSES: Final = 64
MAX_ADDRESS_CHARS: Final = 4096
MAX_NONCE_BYTES: Final = 256
#: ``Heartbeat.where``: entries (members of one connection), and an operation's name.
MAX_WHERE: Final = 1024
MAX_OP_NAME_CHARS: Final = 64
MAX_SECRET_BYTES: Final = 64  # a member's re-attach secret (``Join.secret``)
_U64: Final = 2**64 - 1
_I64: Final = 2**63


class FieldError(ProtocolError):
    """A field of a well-typed message holds a value outside its allowed range.

    Attributes:
        req_id: The request it belongs to, to be refused alone; 0 when the
            message is no request (then the connection is closed).
        field: ``Class.field``, as the message names it.
        value: The value received.
        allowed: The allowed range, in words.
    """

    def __init__(self, req_id: int, field: str, value: object, allowed: str) -> None:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"{field} must be {allowed}, got {shown}")
        self.req_id = req_id
        self.field = field
        self.value = value
        self.allowed = allowed

    def wire_details(self) -> dict[str, Any]:
        # Numbers travel back, but not NaN or an infinity (no JSON reader takes them).
        value = self.value
        if type(value) is float and not math.isfinite(value):
            value = repr(value)
        elif type(value) is not int and type(value) is not float:
            value = None
        return {"field": self.field, "value": value, "allowed": self.allowed}


@dataclass(frozen=True, slots=True)
class _Seconds:
    lo: float
    hi: float = MAX_TIMEOUT

    def problem(self, value: Any) -> str | None:
        # ``not lo <= v <= hi`` is true for NaN too: every comparison with NaN is false.
        if not self.lo <= value <= self.hi:
            return f"a finite number of seconds in [{self.lo:.15g}, {self.hi:.15g}]"
        return None


@dataclass(frozen=True, slots=True)
class _Int:
    lo: int
    hi: int

    def problem(self, value: Any) -> str | None:
        if not self.lo <= value <= self.hi:
            return f"an integer in [{self.lo}, {self.hi}]"
        return None


@dataclass(frozen=True, slots=True)
class _Len:
    lo: int
    hi: int
    unit: str  # "characters", "bytes", "items"
    each: int = 0  # with items: the most characters of each (strings)

    def problem(self, value: Any) -> str | None:
        if not self.lo <= len(value) <= self.hi:
            return f"of {self.lo} to {self.hi} {self.unit} (it has {len(value)})"
        if self.each and any(len(item) > self.each for item in value):
            return f"a list of strings of at most {self.each} characters each"
        return None


@dataclass(frozen=True, slots=True)
class _Name:
    """A name shown to operators (a host, a job, a group): printable characters only."""

    lo: int
    hi: int

    def problem(self, value: Any) -> str | None:
        if not self.lo <= len(value) <= self.hi:
            return f"of {self.lo} to {self.hi} characters (it has {len(value)})"
        if not value.isprintable():
            return "printable characters only (no control characters)"
        return None


@dataclass(frozen=True, slots=True)
class _Where:
    """``Heartbeat.where``: what each member of a connection is doing, bounded and typed."""

    def problem(self, value: Any) -> str | None:
        allowed = (
            f"at most {MAX_WHERE} entries [channel, op, op], each op None or "
            f"[group, seq, name, seconds] with a group of at most {MAX_GROUP_NAME_CHARS} "
            f"and a name of at most {MAX_OP_NAME_CHARS} printable characters"
        )
        if len(value) > MAX_WHERE:
            return allowed
        for entry in value:
            if type(entry) is not list or len(entry) != 3:
                return allowed
            channel, current, last = entry
            if type(channel) is not int or not 0 <= channel <= _U64:
                return allowed
            if not (_op_ok(current) and _op_ok(last)):
                return allowed
        return None


def _op_ok(op: Any) -> bool:
    if op is None:
        return True
    if type(op) is not list or len(op) != 4:
        return False
    group, seq, name, seconds = op
    return (
        type(group) is str
        and len(group) <= MAX_GROUP_NAME_CHARS
        and group.isprintable()
        and type(seq) is int
        and 0 <= seq < _I64
        and type(name) is str
        and len(name) <= MAX_OP_NAME_CHARS
        and name.isprintable()
        and type(seconds) in (int, float)
        and 0.0 <= seconds <= MAX_TIMEOUT
    )


_Bound = _Seconds | _Int | _Len | _Name | _Where
_REQ_ID: Final = _Int(0, _U64)
_TIMEOUT: Final = _Seconds(MIN_TIMEOUT)

# Server-bound messages: field -> allowed values. A message's ``req_id`` is checked
# first, so that a request with a bad field can be refused by its id.
_BOUNDS: Final[dict[type[Any], dict[str, _Bound]]] = {
    Join: {
        "req_id": _REQ_ID,
        "group_name": _Name(1, MAX_GROUP_NAME_CHARS),
        "world_size": _Int(1, MAX_WORLD_SIZE),
        "rank": _Int(-1, MAX_WORLD_SIZE - 1),
        "host": _Name(0, MAX_HOST_CHARS),
        "pid": _Int(0, _U64),
        "addresses": _Len(0, MAX_ADDRESSES, "items", each=MAX_ADDRESS_CHARS),
        "heartbeat_timeout": _Seconds(MIN_HEARTBEAT_TIMEOUT),
        "timeout": _TIMEOUT,
        "generation": _Int(0, _I64 - 1),
        "secret": _Len(0, MAX_SECRET_BYTES, "bytes"),
        "max_world_size": _Int(0, MAX_WORLD_SIZE),
    },
    Reattach: {
        "req_id": _REQ_ID,
        "group_name": _Name(1, MAX_GROUP_NAME_CHARS),
        "generation": _Int(0, _I64 - 1),
        "world_size": _Int(1, MAX_WORLD_SIZE),
        "rank": _Int(0, MAX_WORLD_SIZE - 1),
        "local_rank": _Int(0, MAX_WORLD_SIZE - 1),
        "host": _Name(0, MAX_HOST_CHARS),
        "pid": _Int(0, _U64),
        "addresses": _Len(0, MAX_ADDRESSES, "items", each=MAX_ADDRESS_CHARS),
        "heartbeat_timeout": _Seconds(MIN_HEARTBEAT_TIMEOUT),
        "secret": _Len(0, MAX_SECRET_BYTES, "bytes"),
    },
    Leave: {"req_id": _REQ_ID, "reason": _Len(0, MAX_REASON_CHARS, "characters")},
    Heartbeat: {"where": _Where()},
    StoreSet: {"req_id": _REQ_ID},
    StoreGet: {"req_id": _REQ_ID, "timeout": _TIMEOUT},
    StoreAdd: {"req_id": _REQ_ID, "amount": _Int(-_I64, _I64 - 1)},  # TCPStore's int64
    StoreWait: {"req_id": _REQ_ID, "timeout": _TIMEOUT},
    StoreCompareSet: {"req_id": _REQ_ID},
    StoreDeleteKey: {"req_id": _REQ_ID},
    StoreNumKeys: {"req_id": _REQ_ID},
    StoreCheck: {"req_id": _REQ_ID},
    Barrier: {"req_id": _REQ_ID, "seq": _Int(0, _U64), "timeout": _TIMEOUT},
    Regroup: {
        "req_id": _REQ_ID,
        "key": _Name(1, MAX_GROUP_NAME_CHARS),
        "group_id": _Int(0, _U64),
        "members": _Len(1, MAX_WORLD_SIZE, "items"),
        "timeout": _TIMEOUT,
    },
    StatusRequest: {"req_id": _REQ_ID, "job": _Name(0, MAX_GROUP_NAME_CHARS)},
    DumpRequest: {
        "req_id": _REQ_ID,
        "job": _Name(1, MAX_GROUP_NAME_CHARS),
    },
    MembersRequest: {"req_id": _REQ_ID},
    Hello: {
        "nonce": _Len(0, MAX_NONCE_BYTES, "bytes"),
        "proof": _Len(0, MAX_NONCE_BYTES, "bytes"),
    },
    Channel: {"channel": _Int(0, _U64)},
    CloseChannel: {"channel": _Int(0, _U64)},
}

# Per class: (index in the header, bound, "Class.field"), in field order.
_CHECKS: dict[type[Any], tuple[tuple[int, _Bound, str], ...]] = {}


def _checks(cls: type[Any]) -> tuple[tuple[int, _Bound, str], ...]:
    try:
        return _CHECKS[cls]
    except KeyError:
        pass
    names = [f.name for f in dataclasses.fields(cls)]
    bounds = _BOUNDS.get(cls, {})
    assert set(bounds) <= set(names), (cls, bounds)
    assert "req_id" not in bounds or names[0] == "req_id", cls
    checks = tuple((names.index(name), b, f"{cls.__name__}.{name}") for name, b in bounds.items())
    _CHECKS[cls] = checks
    return checks


def check_fields(cls: type[Any], values: Sequence[Any]) -> None:
    """Check the values of a ``cls`` message's fields (its type-checked header), in order.

    Raises:
        FieldError: A value is out of its range.
    """
    req_id = 0  # until the request's own id passed its check: then that request is refused
    for index, bound, name in _checks(cls):
        value = values[index]
        if (allowed := bound.problem(value)) is not None:
            raise FieldError(req_id, name, value, allowed)
        if bound is _REQ_ID:
            req_id = value


def check_message(msg: Any) -> None:
    """``check_fields`` for a message built in this process (the job table's own checks).

    Raises:
        FieldError: A value is out of its range.
    """
    cls = type(msg)
    if checks := _checks(cls):
        values = [None] * (max(index for index, _, _ in checks) + 1)
        for index, _, name in checks:
            values[index] = getattr(msg, name.partition(".")[2])
        check_fields(cls, values)
