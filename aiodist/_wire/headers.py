"""Message headers: a message to its msgpack array and back, every field's type checked.

A header is the array of a message's fields in declaration order.
``decode_message`` validates every field's type before a dataclass is built, so
the server's state machine only ever sees well-typed messages: a peer that
sends a string where a rank belongs gets a ``ProtocolError``, not a crash three
layers down. ``MESSAGE_TYPES`` finds a kind's class; the checks are derived once
per class from its type hints. The values of a client's message are checked
next (``bounds``): a NaN timeout or a negative size is refused on decoding too.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from typing import TYPE_CHECKING, Any, Union, cast

from aiodist._wire.bounds import check_fields
from aiodist._wire.messages import (
    Authenticated,
    AuthStart,
    Barrier,
    Challenge,
    Channel,
    CloseChannel,
    DumpNotice,
    DumpRequest,
    ErrorReply,
    Heartbeat,
    Hello,
    Join,
    Leave,
    MemberFailed,
    MembersFailed,
    MembersJoined,
    MembersLeft,
    MembersRequest,
    MessageKind,
    Reattach,
    Regroup,
    Reply,
    ServerClosing,
    StatusRequest,
    StoreAdd,
    StoreCheck,
    StoreCompareSet,
    StoreDeleteKey,
    StoreGet,
    StoreNumKeys,
    StoreSet,
    StoreWait,
    Welcome,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["MESSAGE_TYPES", "decode_message", "message_fields", "message_header"]

MESSAGE_TYPES: dict[MessageKind, type[Any]] = {
    cls.KIND: cls
    for cls in (
        Join,
        Leave,
        Heartbeat,
        StoreSet,
        StoreGet,
        StoreAdd,
        StoreWait,
        StoreCompareSet,
        StoreDeleteKey,
        StoreNumKeys,
        StoreCheck,
        Barrier,
        Regroup,
        StatusRequest,
        DumpRequest,
        DumpNotice,
        MembersRequest,
        Reattach,
        AuthStart,
        Hello,
        Channel,
        CloseChannel,
        Challenge,
        Authenticated,
        Reply,
        Welcome,
        ErrorReply,
        MemberFailed,
        MembersFailed,
        MembersJoined,
        MembersLeft,
        ServerClosing,
    )
}

# (exact types allowed, or None for anything; exact types of list items, or None).
# Types are compared exactly, not with isinstance: msgpack decodes to exact builtin
# types, and a bool must not pass where an int (a rank, a size) belongs.
_Check = tuple[frozenset[type] | None, frozenset[type] | None]


def _checks_for(tp: Any) -> _Check:
    origin = typing.get_origin(tp)
    if tp is Any:
        return (None, None)
    if tp is float:
        return (frozenset((int, float)), None)
    if origin is list:
        (item,) = typing.get_args(tp)
        return (frozenset((list,)), None if item is Any else _checks_for(item)[0])
    if origin is dict:
        return (frozenset((dict,)), None)
    if origin in (Union, types.UnionType):
        allowed: frozenset[type] = frozenset()
        for arg in typing.get_args(tp):
            arg_allowed = _checks_for(arg)[0]
            assert arg_allowed is not None, "Any inside a union"
            allowed |= arg_allowed
        return (allowed, None)
    if tp is type(None):
        return (frozenset((type(None),)), None)
    assert isinstance(tp, type), tp
    return (frozenset((tp,)), None)


_FIELDS: dict[type[Any], tuple[tuple[str, _Check], ...]] = {}


def message_fields(cls: type[Any]) -> tuple[tuple[str, _Check], ...]:
    """(name, check) per field of a message class, computed once."""
    try:
        return _FIELDS[cls]
    except KeyError:
        hints = typing.get_type_hints(cls)
        fields = tuple((f.name, _checks_for(hints[f.name])) for f in dataclasses.fields(cls))
        _FIELDS[cls] = fields
        return fields


def decode_message(kind: int, header: object) -> Any:
    """Build the message of ``kind`` from its decoded msgpack header.

    Raises:
        ValueError: Unknown kind, wrong field count or a field of the wrong type.
        FieldError: A field of the right type holds a value out of its range
            (``bounds``); a ``ProtocolError`` whose ``req_id`` names the request.
    """
    cls = MESSAGE_TYPES.get(kind)  # type: ignore[call-overload]  # an int finds its IntEnum key
    if cls is None:  # unknown, or a data-plane kind (which has no message class)
        raise ValueError(f"unknown message kind {kind}")
    if not isinstance(header, list):
        raise ValueError(f"{cls.__name__} header must be an array, got {type(header).__name__}")
    fields = message_fields(cls)
    if len(header) != len(fields):
        raise ValueError(f"{cls.__name__} has {len(fields)} fields, frame carries {len(header)}")
    for value, (name, (allowed, items)) in zip(header, fields, strict=True):
        if allowed is not None and type(value) not in allowed:
            names = "/".join(sorted(t.__name__ for t in allowed))
            raise ValueError(f"{cls.__name__}.{name} must be {names}, got {type(value).__name__}")
        # map(type) runs in C: a wait on 1024 keys is checked in microseconds.
        if items is not None and not items.issuperset(map(type, cast("list[Any]", value))):
            raise ValueError(f"{cls.__name__}.{name} has items of the wrong type")
    check_fields(cls, header)
    return cls(*header)


_HEADERS: dict[type[Any], Callable[[Any], list[Any]]] = {}


def message_header(msg: Any) -> list[Any]:
    """The header array of ``msg`` (its fields in declaration order)."""
    try:
        return _HEADERS[type(msg)](msg)
    except KeyError:
        _HEADERS[type(msg)] = header = _header_getter(type(msg))
        return header(msg)


def _header_getter(cls: type[Any]) -> Callable[[Any], list[Any]]:
    # One attrgetter per class reads every field in C (a list comprehension of
    # getattr calls was a visible part of each request's cost).
    names = [name for name, _ in message_fields(cls)]
    if not names:
        return lambda msg: []
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda msg: [one(msg)]
    many = operator.attrgetter(*names)
    return lambda msg: list(many(msg))
