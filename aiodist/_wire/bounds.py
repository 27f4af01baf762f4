"""The ranges a field's value may hold: the bounds a declaration names (``messages.py``).

A field of a message a peer sends says its range where it is declared, as
``typing.Annotated`` metadata (``timeout: Timeout``, ``rank: Annotated[int,
Int(-1, MAX_WORLD_SIZE - 1)]``); ``headers.py`` checks each one on decoding,
after the field's type and before anything acts on it. A timeout is a finite
number of seconds within ``[MIN_TIMEOUT, MAX_TIMEOUT]`` (a heartbeat timeout at
least ``MIN_HEARTBEAT_TIMEOUT``), a count or an id an integer within its range,
a string or a list no longer than its limit: NaN, infinities, zero, negatives
and absurd values never reach a deadline heap or a sweep interval. The same
bounds check what the server reads back from its state directory.

A value out of range raises ``FieldError`` naming the message, the field, the
value and the allowed range. It is a ``ProtocolError``: where the message is a
request (it has a ``req_id``), the server refuses that request alone and the
connection goes on; otherwise the connection is closed, as for any malformed
frame. Server-to-client messages declare no bounds: a client trusts only a
server that proved the token, and checks what it uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Final

from aiodist._errors import ProtocolError

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
U64: Final = 2**64 - 1
I64: Final = 2**63


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
class Seconds:
    lo: float
    hi: float = MAX_TIMEOUT

    def problem(self, value: Any) -> str | None:
        # ``not lo <= v <= hi`` is true for NaN too: every comparison with NaN is false.
        if not self.lo <= value <= self.hi:
            return f"a finite number of seconds in [{self.lo:.15g}, {self.hi:.15g}]"
        return None


@dataclass(frozen=True, slots=True)
class Int:
    lo: int
    hi: int

    def problem(self, value: Any) -> str | None:
        if not self.lo <= value <= self.hi:
            return f"an integer in [{self.lo}, {self.hi}]"
        return None


@dataclass(frozen=True, slots=True)
class Len:
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
class Name:
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
class Where:
    """``Heartbeat.where``: what each member of a connection is doing, bounded and typed."""

    def problem(self, value: Any) -> str | None:
        allowed = (
            f"at most {MAX_WHERE} entries [channel, op, op, sent], each op None or "
            f"[group, seq, name, seconds] with a group of at most {MAX_GROUP_NAME_CHARS} "
            f"and a name of at most {MAX_OP_NAME_CHARS} printable characters, sent "
            f"[messages, bytes] of integers in [0, {U64}]"
        )
        if len(value) > MAX_WHERE:
            return allowed
        for entry in value:
            if type(entry) is not list or len(entry) != 4:
                return allowed
            channel, current, last, sent = entry
            if type(channel) is not int or not 0 <= channel <= U64:
                return allowed
            if not (_op_ok(current) and _op_ok(last) and _sent_ok(sent)):
                return allowed
        return None


def _sent_ok(sent: Any) -> bool:
    # A member's data-plane counters since it joined: messages and bytes sent to its peers.
    return (
        type(sent) is list
        and len(sent) == 2
        and all(type(n) is int and 0 <= n <= U64 for n in sent)
    )


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
        and 0 <= seq < I64
        and type(name) is str
        and len(name) <= MAX_OP_NAME_CHARS
        and name.isprintable()
        and type(seconds) in (int, float)
        and 0.0 <= seconds <= MAX_TIMEOUT
    )


Bound = Seconds | Int | Len | Name | Where

# The fields many declarations share.
ReqId = Annotated[int, Int(0, U64)]
U64Int = Annotated[int, Int(0, U64)]
Timeout = Annotated[float, Seconds(MIN_TIMEOUT)]
HeartbeatTimeout = Annotated[float, Seconds(MIN_HEARTBEAT_TIMEOUT)]
JobName = Annotated[str, Name(1, MAX_GROUP_NAME_CHARS)]
HostName = Annotated[str, Name(0, MAX_HOST_CHARS)]
Pid = Annotated[int, Int(0, U64)]
Rank = Annotated[int, Int(0, MAX_WORLD_SIZE - 1)]
WorldSize = Annotated[int, Int(1, MAX_WORLD_SIZE)]
Generation = Annotated[int, Int(0, I64 - 1)]
Addresses = Annotated[list[str], Len(0, MAX_ADDRESSES, "items", each=MAX_ADDRESS_CHARS)]
Secret = Annotated[bytes, Len(0, MAX_SECRET_BYTES, "bytes")]
Nonce = Annotated[bytes, Len(0, MAX_NONCE_BYTES, "bytes")]
