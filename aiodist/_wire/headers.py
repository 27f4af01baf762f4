"""Declared messages: ``@message`` and the registries, headers and checks derived from it.

A message is declared once, as a class (``messages.py``)::

    @message(12, durable=True)
    class Barrier(Message):
        req_id: ReqId                                  # Annotated[int, Int(0, U64)]
        seq: Annotated[int, Int(0, U64)]
        timeout: Timeout

The decorator makes it a frozen, slotted dataclass and registers it under its
kind; everything else is derived from that one declaration, once per class:

- its kind (``Barrier.KIND``) and the decoder's table (``MESSAGES``): a second
  class under one kind is refused at import;
- its header: the array of its fields in declaration order (``message_header``),
  every field present;
- each field's type, checked exactly on decoding (msgpack decodes to exact
  builtin types, and a bool must not pass where an int belongs);
- each field's range, where ``Annotated`` names one (``bounds.py``), checked
  after its type: a request's own ``req_id`` first, so that a request with a
  bad field is refused alone;
- whether handling it may change the server's durable state (``DURABLE``):
  the job table asserts that no other message does.

``Registry`` is the same machinery for other declared records (the server's
durable records); ``MESSAGES`` is the wire's.
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, Union, cast, dataclass_transform

from aiodist._wire.bounds import Bound, FieldError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

M = TypeVar("M")

# (exact types allowed, or None for anything; exact types of list items, or None).
_Check = tuple[frozenset[type] | None, frozenset[type] | None]


class Message:
    """The base of every declared class: its kind, and whether it changes durable state."""

    __slots__ = ()
    KIND: ClassVar[int]
    DURABLE: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class _Spec:
    """What is derived from one declaration (computed on first use: the names its
    annotations use may be defined after it)."""

    cls: type[Any]
    names: tuple[str, ...]
    fields: tuple[tuple[str, _Check], ...]
    # (index, bound, "Class.field", whether None is allowed), in field order.
    bounds: tuple[tuple[int, Bound, str, bool], ...]
    header: Callable[[Any], list[Any]]
    # The object a header makes when every check passes; None: decode it the long
    # way, which says what is wrong (``_accepting``).
    accept: Callable[[object], Any]


class Registry:
    """Declared classes by kind (the wire's messages, the server's records), and their
    headers decoded and checked."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.classes: dict[int, type[Any]] = {}

    def declare(self, code: int, *, durable: bool = False) -> Callable[[type[M]], type[M]]:
        def register(cls: type[M]) -> type[M]:
            made = dataclasses.dataclass(frozen=True, slots=True)(cls)
            if code in self.classes:
                other = self.classes[code].__name__
                raise TypeError(f"{self.what} kind {code} declared twice: {other}, {cls.__name__}")
            made.KIND = code  # type: ignore[attr-defined]
            made.DURABLE = durable  # type: ignore[attr-defined]
            self.classes[code] = made
            return made

        return register

    def name(self, kind: int) -> str:
        cls = self.classes.get(kind)
        return f"kind-{kind}" if cls is None else cls.__name__

    def decode(self, kind: int, header: object) -> Any:
        """Build the declared object of ``kind`` from its decoded msgpack header.

        Raises:
            ValueError: Unknown kind, wrong field count or a field of the wrong type.
            FieldError: A field of the right type holds a value out of its range;
                a ``ProtocolError`` whose ``req_id`` names the request.
        """
        cls = self.classes.get(kind)
        if cls is None:
            raise ValueError(f"unknown {self.what} kind {kind}")
        spec = _spec(cls)
        made = spec.accept(header)
        return made if made is not None else _decode_checked(spec, header)


def _decode_checked(spec: _Spec, header: object) -> Any:
    """``Registry.decode`` the long way: each check in turn, each failure said in words."""
    cls = spec.cls
    if type(header) is not list:
        raise ValueError(f"{cls.__name__} header must be an array, got {type(header).__name__}")
    fields = spec.fields
    if len(header) != len(fields):
        raise ValueError(f"{cls.__name__} has {len(fields)} fields, frame carries {len(header)}")
    for value, (name, (allowed, items)) in zip(header, fields, strict=True):
        if allowed is not None and type(value) not in allowed:
            names = "/".join(sorted(t.__name__ for t in allowed))
            raise ValueError(f"{cls.__name__}.{name} must be {names}, got {type(value).__name__}")
        # map(type) runs in C: a wait on 1024 keys is checked in microseconds.
        if items is not None and not items.issuperset(map(type, cast("list[Any]", value))):
            raise ValueError(f"{cls.__name__}.{name} has items of the wrong type")
    _check_bounds(spec, header)
    return cls(*header)


MESSAGES: typing.Final = Registry("message")


@dataclass_transform(frozen_default=True)
def message(code: int, *, durable: bool = False) -> Callable[[type[M]], type[M]]:
    """Declare a wire message of kind ``code`` (see the module); ``durable``: handling it
    may change the server's durable state."""
    return MESSAGES.declare(code, durable=durable)


def decode_message(kind: int, header: object) -> Any:
    """``MESSAGES.decode``: the message of ``kind`` built from its header."""
    return MESSAGES.decode(kind, header)


_SPECS: dict[type[Any], _Spec] = {}


def _spec(cls: type[Any]) -> _Spec:
    try:
        return _SPECS[cls]
    except KeyError:
        pass
    hints = typing.get_type_hints(cls, include_extras=True)
    fields: list[tuple[str, _Check]] = []
    bounds: list[tuple[int, Bound, str, bool]] = []
    for index, f in enumerate(dataclasses.fields(cls)):
        tp = hints[f.name]
        if typing.get_origin(tp) is typing.Annotated:
            tp, *extras = typing.get_args(tp)
            shown, nullable = f"{cls.__name__}.{f.name}", _admits_none(tp)
            bounds.extend((index, bound, shown, nullable) for bound in extras)
        fields.append((f.name, _checks_for(tp)))
    # A request's own id first: once it passed, a bad field refuses that request alone.
    bounds.sort(key=lambda b: (not b[2].endswith(".req_id"), b[0]))
    names = tuple(name for name, _ in fields)
    accept = _accepting(cls, fields, bounds)
    spec = _SPECS[cls] = _Spec(cls, names, tuple(fields), tuple(bounds), _getter(names), accept)
    return spec


def _accepting(
    cls: type[Any], fields: list[tuple[str, _Check]], bounds: list[tuple[int, Bound, str, bool]]
) -> Callable[[object], Any]:
    """The checks of ``decode`` for one class, unrolled into one generated function.

    A header that passes every check (nearly all of them) is decoded in one call
    with no loop: about three times faster for a ``Barrier``. It answers None at
    the first check that fails, and ``decode`` then takes the long way, which
    finds the same failure and says what it is: the checks stay those of
    ``_spec``, and the errors are written once.
    """
    env: dict[str, Any] = {"cls": cls}
    values = [f"v{i}" for i in range(len(fields))]
    lines = [
        "def accept(h):",
        f"    if type(h) is not list or len(h) != {len(fields)}: return None",
    ]
    if values:
        lines.append(f"    {', '.join(values)}, = h")
    for i, (_, (allowed, items)) in enumerate(fields):
        if allowed is not None:
            env[f"A{i}"] = next(iter(allowed)) if len(allowed) == 1 else allowed
            test = "is not" if len(allowed) == 1 else "not in"
            lines.append(f"    if type(v{i}) {test} A{i}: return None")
        if items is not None:
            env[f"I{i}"] = items
            lines.append(f"    if not I{i}.issuperset(map(type, v{i})): return None")
    for j, (i, bound, _, nullable) in enumerate(bounds):
        env[f"B{j}"] = bound.problem
        unless_none = f"v{i} is not None and " if nullable else ""
        lines.append(f"    if {unless_none}B{j}(v{i}) is not None: return None")
    lines.append(f"    return cls({', '.join(values)})")
    # Built from the declaration alone: no peer's byte in it. Compiled first: ``exec`` of a
    # string resets CPython's note of an uncaught KeyboardInterrupt, and a class first
    # decoded while a process exits after Ctrl-C would make it exit 1, not by SIGINT.
    exec(compile("\n".join(lines), f"<decoder of {cls.__name__}>", "exec"), env)
    return cast("Callable[[object], Any]", env["accept"])


def _admits_none(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def _checks_for(tp: Any) -> _Check:
    origin = typing.get_origin(tp)
    if tp is Any:
        return (None, None)
    if tp is float:
        return (frozenset((int, float)), None)
    if origin is typing.Annotated:
        return _checks_for(typing.get_args(tp)[0])
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


def _check_bounds(spec: _Spec, values: Sequence[Any]) -> None:
    req_id = 0  # until the request's own id passed its check: then that request is refused
    for index, bound, name, nullable in spec.bounds:
        value = values[index]
        if nullable and value is None:
            continue
        if (allowed := bound.problem(value)) is not None:
            raise FieldError(req_id, name, value, allowed)
        if index == 0 and name.endswith(".req_id"):
            req_id = value


def check_message(msg: Any) -> None:
    """The range checks of decoding, for a message built in this process (the job table's
    own input: an embedded caller, a test).

    Raises:
        FieldError: A value is out of its range.
    """
    _check_bounds(_spec(type(msg)), message_header(msg))


def message_fields(cls: type[Any]) -> tuple[tuple[str, _Check], ...]:
    """(name, exact types allowed) per field of a declared class, in header order."""
    return _spec(cls).fields


def message_header(msg: Any) -> list[Any]:
    """The header array of ``msg`` (its fields in declaration order)."""
    try:
        return _SPECS[type(msg)].header(msg)
    except KeyError:
        return _spec(type(msg)).header(msg)


def _getter(names: tuple[str, ...]) -> Callable[[Any], list[Any]]:
    # One attrgetter per class reads every field in C (a list comprehension of
    # getattr calls was a visible part of each request's cost).
    if not names:
        return lambda msg: []
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda msg: [one(msg)]
    many = operator.attrgetter(*names)
    return lambda msg: list(many(msg))
