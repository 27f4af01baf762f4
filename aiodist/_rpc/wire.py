"""Remote calls on the wire: message keys, operations, tensors set aside, errors.

Every rpc message is a data-plane message of kind ``RPC`` whose group field is
``RPC_GROUP``, which no process group uses: breaking or destroying a group
leaves remote calls alone, while a failed rank (which fails the whole session)
fails every pending one. ``call`` numbers a caller's calls from 1::

    request         (RPC, RPC_GROUP, 0, 0)          meta [op, call, target, tensors, extra(, grad)]
    its tensor i    (RPC, RPC_GROUP, -call, i + 1)  payload: tensor i's bytes
    reply           (RPC, RPC_GROUP, call, 0)       meta [status, tensors(, grad)]
    its tensor i    (RPC, RPC_GROUP, call, i + 1)   payload: tensor i's bytes

A request's payload holds the arguments, a reply's the result or the error,
both encoded by ``codec.dumps_split``: tensors of 64 KiB or more are set aside
and follow as messages of their own (``tensors`` lists their dtypes and
shapes), sent from the tensors' memory and received straight into fresh
tensors. Messages from one source with one key keep their order, and a
request's parts follow it on the same channel, so a receiver posts the parts'
receives when the request arrives and each part lands in place.

``grad``, present only within a distributed autograd context, is
``[context id, send id, indices of the tensors that require grad]``
(``contexts.outgoing``); those tensors are always set aside, whatever their
size, and enter the receiver's autograd graph (``contexts.incoming``).

Matching by ``(source, key)`` with ``call`` unique per caller means no call
ever receives another call's reply, even when one times out and its reply
comes late: every request gets exactly one reply, which its receive takes.
"""

from __future__ import annotations

import enum
import functools
import importlib
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiodist._errors import RemoteError
from aiodist._wire import codec
from aiodist._wire.codec import byte_view
from aiodist._wire.keys import MatchKind
from aiodist._wire.messages import Data

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from aiodist._plane.peers import DataPlane
    from aiodist._plane.receives import Received
    from aiodist._wire.keys import Key

RPC_GROUP: Final = -1
# Frames of the serving machinery, left out of the remote traceback (they precede the call's).
_SERVING_FILES: Final = (
    os.path.join(os.path.dirname(__file__), "serve.py"),
    os.path.join(os.path.dirname(__file__), "threads.py"),
)
REQUEST_KEY: Final[Key] = (MatchKind.RPC, RPC_GROUP, 0, 0)


class Op(enum.IntEnum):
    """What a request asks for."""

    CALL = 0  # target: the function's encoding; reply: its result
    REMOTE = 1  # as CALL, the result kept as the RRef ``extra`` names; reply: nothing
    METHOD = 2  # target: a method name of the object of RRef ``extra``; reply: its result
    METHOD_REMOTE = 3  # as METHOD, the result kept as RRef ``extra[1]``; reply: nothing
    TO_HERE = 4  # reply: the object of RRef ``extra``
    RELEASE = 5  # a reference to RRef ``extra[:2]`` of weight 2**-extra[2] went; no reply
    CANCEL = 6  # the caller gave up on its call ``extra``; no reply
    SHUTDOWN = 7  # a message of rpc.shutdown's termination waves (``extra``); no reply


class Status(enum.IntEnum):
    """How a call ended, in its reply."""

    OK = 0  # payload: the result (none for None)
    ERROR = 1  # payload: the error (see encode_error)
    CANCELLED = 2  # the caller cancelled it (a timeout): nobody waits for this reply
    CLOSED = 3  # the callee stopped serving (rpc.shutdown, destroy_process_group)


class Notices(Protocol):
    """What ``notify`` needs of the data plane."""

    def send_notice(self, dst: int, kind: int, header: list[Any]) -> None: ...


def notify(plane: Notices, dst: int, op: Op, extra: Any) -> None:
    """Send ``dst`` a request without payload or reply (``RELEASE``, ``CANCEL``, ``SHUTDOWN``)."""
    plane.send_notice(dst, Data.KIND, [*REQUEST_KEY, [int(op), 0, None, None, extra]])


def reply_key(call: int) -> Key:
    return (MatchKind.RPC, RPC_GROUP, call, 0)


def part_key(call: int, index: int, *, request: bool) -> Key:
    """The key of tensor ``index`` set aside by a request (or its reply)."""
    return (MatchKind.RPC, RPC_GROUP, -call if request else call, index + 1)


def tensor_meta(tensors: list[torch.Tensor]) -> list[list[Any]] | None:
    """What a receiver needs to allocate ``tensors``: ``[dtype, shape]`` each; None for none."""
    if not tensors:
        return None
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


def empty_tensors(meta: Any) -> list[torch.Tensor]:
    """Fresh tensors for the parts ``meta`` (from ``tensor_meta``) announces.

    Raises:
        ValueError: ``meta`` does not describe tensors.
    """
    import torch

    out = []
    for dtype_name, shape in meta:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype) or not all(type(n) is int for n in shape):
            raise ValueError(f"not a tensor description: {dtype_name!r} {shape!r}")
        out.append(torch.empty(shape, dtype=dtype))
    return out


def receive_parts(
    plane: DataPlane,
    src: int,
    call: int,
    meta: Any,
    *,
    request: bool,
    done: Callable[[list[torch.Tensor] | BaseException], None],
) -> None:
    """Post the receives of the tensors a message set aside; ``done`` gets them, or an error.

    ``done`` is called once, from the data plane's callbacks (so it must not raise).
    """
    try:
        tensors = empty_tensors(meta)
    except (TypeError, ValueError) as exc:
        done(exc)  # no receives posted: the parts, if any came, stay unmatched
        return
    views = [byte_view(t) for t in tensors]
    left = len(views)

    def arrived(index: int, msg: Received | BaseException) -> None:
        nonlocal left
        if left <= 0:
            return  # already failed
        if not isinstance(msg, BaseException) and msg.data.nbytes != views[index].nbytes:
            msg = ValueError(
                f"tensor {index} came with {msg.data.nbytes} bytes, not {views[index].nbytes}"
            )
        if isinstance(msg, BaseException):
            left = 0
            done(msg)
            return
        left -= 1
        if not left:
            done(tensors)

    for i, view in enumerate(views):
        plane.post(src, part_key(call, i, request=request), view, functools.partial(arrived, i))


async def send_parts(
    plane: DataPlane, dst: int, call: int, tensors: list[torch.Tensor], *, request: bool
) -> None:
    """Send the tensors a message set aside, after it, from their own memory."""
    for i, t in enumerate(tensors):
        src = t.detach() if t.requires_grad else t  # its bytes only: autograd records it
        if not src.is_contiguous():
            src = src.contiguous()
        await plane.send(dst, part_key(call, i, request=request), None, byte_view(src))


def encode_error(exc: BaseException) -> bytes:
    """The error a call raised, for its reply: type, message, traceback, attributes."""
    cls = type(exc)
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in _SERVING_FILES:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(cls, exc, tb)).rstrip()
    try:
        state: bytes | None = codec.dumps(dict(vars(exc))) if vars(exc) else None
    except Exception:  # an attribute that cannot be pickled: type and text still travel
        state = None
    return codec.dumps([cls.__module__, cls.__qualname__, str(exc), text, state])


def rebuild_error(data: Any, rank: int, what: str) -> Exception:
    """The exception to raise on the caller for an error reply from ``rank``.

    Its message is the remote one, then the rank and the remote traceback. It
    has the remote exception's type and attributes when that type can be
    imported here (made without calling its ``__init__``, which may take
    other arguments); otherwise it is a ``RemoteError``. Either way its
    ``__cause__`` is a ``RemoteError`` whose attributes say where it came from
    (``rank``, ``exc_type``, ``remote_traceback``). Exceptions that are not
    ``Exception``s there (``SystemExit``, ``KeyboardInterrupt``) become
    ``RemoteError``: they must not stop the caller.
    """
    try:
        module, qualname, text, tb, state = codec.loads(data)
        name = f"{module}.{qualname}" if module != "builtins" else qualname
    except Exception as exc:
        return RemoteError(
            f"{what} failed on rank {rank}, and its error could not be read here ({exc})",
            rank=rank,
        )
    message = f"{text}\n\n{what} raised {name} on rank {rank}. Remote traceback:\n{tb}"
    origin = RemoteError(
        f"{what} raised {name} on rank {rank}", rank=rank, exc_type=name, remote_traceback=tb
    )
    rebuilt = _same_type(module, qualname, message, state)
    if rebuilt is None:
        rebuilt = RemoteError(message, rank=rank, exc_type=name, remote_traceback=tb)
    rebuilt.__cause__ = origin
    return rebuilt


def _same_type(module: str, qualname: str, message: str, state: Any) -> Exception | None:
    """An exception of the remote type with ``message``; None if it cannot be made here."""
    try:
        cls: Any = sys.modules.get(module) or importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)  # a class local to a function has no path: fails here
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            return None
        exc: Exception = cls.__new__(cls)
        exc.args = (message,)
        if isinstance(state, bytes):
            attributes = codec.loads(state)
            if isinstance(attributes, dict):
                exc.__dict__.update(attributes)
    except Exception:
        return None
    return exc
