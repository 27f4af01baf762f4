"""Calls a rank makes: prepared in the caller's thread, then pending until their reply.

``prepare`` checks a call and encodes it where it is made (plain code's thread
included): a bad destination, a function that cannot be pickled by reference
or arguments that cannot be pickled raise there, before anything is sent. The
agent (``rpc.py``) then starts it on the loop and keeps a ``Call`` record until
its reply comes (the calls that take the default timeout are timed out by one
``inflight.Deadlines``, as a group's operations are).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiodist._rpc.contexts import CURRENT, outgoing
from aiodist._rpc.wire import Op
from aiodist._wire import codec

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Mapping, Sequence

    import torch

    from aiodist._group.work import Work

# Functions kept encoded (here) and decoded (on callees): a program calls few distinct ones.
_FUNCTIONS_KEPT: Final = 1024
_CACHEABLE = (types.FunctionType, types.BuiltinFunctionType, type)
_encoded_functions: dict[Any, tuple[bytes, str]] = {}  # fn -> its encoding, its name
# A function's encoding travels in the request's header, which receivers bound (16 MiB).
MAX_FUNCTION_BYTES: Final = 1024 * 1024


@dataclass(slots=True)
class Request:
    """A call prepared in the caller's thread: checked and encoded, not sent yet."""

    to: int
    op: Op
    target: Any  # the function's encoding, or a method name
    payload: bytes | None  # the arguments
    tensors: list[torch.Tensor]  # set aside by the arguments' encoding
    extra: Any
    timeout: float | None  # None: no timeout
    what: str  # the call, as error messages name it
    keep: object = None  # kept alive until the call completes (the RRef a method call is on)
    grad: Any = None  # distributed autograd's part of the request (``autograd.outgoing``)


def describe(fn: object) -> str:
    """``module.qualname`` of a function, for messages."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module != "builtins" else str(name)


def _encode_function(fn: object) -> tuple[bytes, str]:
    """``fn``'s encoding (by reference) and its name; cached for plain functions."""
    try:
        hit = _encoded_functions.get(fn)
    except TypeError:  # unhashable: encoded every time
        hit = None
    if hit is not None:
        return hit
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    try:
        data = codec.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"{describe(fn)} cannot be sent to another rank: rpc pickles a function by "
            "reference (its module and name), so define it at the top level of a module that "
            f"every rank imports, not as a lambda or inside a function ({exc})"
        ) from exc
    if len(data) > MAX_FUNCTION_BYTES:
        raise TypeError(
            f"{describe(fn)} pickles to {len(data)} bytes (at most {MAX_FUNCTION_BYTES}): pass "
            "large data as arguments, not inside the callable"
        )
    hit = (data, describe(fn))
    remember(_encoded_functions, fn, fn, hit)
    return hit


def remember(cache: dict[Any, Any], key: Any, fn: object, value: Any) -> None:
    """Keep ``value`` in a function cache if ``fn`` pickles by reference; empty it when full."""
    if isinstance(fn, _CACHEABLE):
        if len(cache) >= _FUNCTIONS_KEPT:
            cache.clear()
        cache[key] = value


def timeout_seconds(timeout: float | None, default: float | None) -> float | None:
    """An rpc ``timeout`` as seconds: None is ``default``, 0 is none, < 0 a ``ValueError``."""
    if timeout is None:
        return default
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 (0: none), got {timeout!r}")
    return float(timeout) or None


class Caller(Protocol):
    """What ``prepare`` needs of the agent a call is for."""

    @property
    def world_size(self) -> int: ...  # the job's ranks so far: an elastic job grows

    default_timeout: float | None


def prepare(
    agent: Caller,
    op: Op,
    to: object,
    target: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    timeout: float | None,
    what: str,
    extra: Any = None,
) -> Request:
    """Check and encode a call (in the caller's thread).

    ``what`` names the call in messages; for ``CALL`` and ``REMOTE`` (whose
    ``target`` is the function), ``"{fn}"`` in it stands for the function's name.

    Raises:
        TypeError: ``to`` is not an int, ``fn`` or an argument cannot be pickled.
        ValueError: ``to`` is not a rank of the job, or ``timeout`` is negative.
    """
    if not isinstance(to, int) or isinstance(to, bool):
        raise TypeError(f"to must be an int rank, got {type(to).__name__}")
    if not 0 <= to < agent.world_size:
        raise ValueError(f"to={to} is not a rank of the job (its ranks: 0-{agent.world_size - 1})")
    seconds = timeout_seconds(timeout, agent.default_timeout)
    if op is Op.CALL or op is Op.REMOTE:
        target, name = _encode_function(target)
        what = what.replace("{fn}", name)
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    tensors: list[torch.Tensor] = []
    payload = None
    context = CURRENT.get()  # a distributed autograd context: tensors that require grad
    if args or kwargs:
        try:
            payload = codec.dumps_split(
                [tuple(args), kwargs or None], tensors, grad=context is not None
            )
        except Exception as exc:
            raise TypeError(f"the arguments of {what} cannot be pickled: {exc}") from exc
    # Every call made in a context carries it, as torch's do: the callee's result may need it.
    grad = None if context is None else outgoing(context, tensors, to, force=True)
    return Request(to, op, target, payload, tensors, extra, seconds, what, grad=grad)


@dataclass(slots=True, eq=False)
class Call:
    """A call this rank made, until its reply came (even after it timed out)."""

    work: Work[Any]
    to: int
    what: str
    timeout: float | None
    timer: asyncio.TimerHandle | None = None
    sending: asyncio.Task[None] | None = None  # the rest of its request, if not sent at once
    # An RRef whose object the call uses: dropping it only after the reply means its
    # release reaches the owner after the call is served there.
    keep: object = None
