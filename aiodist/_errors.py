"""The whole exception tree of aiodist, and its mapping to and from wire codes."""

from __future__ import annotations

import enum
import functools
from typing import Any, ClassVar, TypeVar

# Why an operation that needed a rank failed when that rank left the job cleanly.
LEFT_REASON = "left the job (destroy_process_group, or its program ended)"


class ErrorCode(enum.IntEnum):
    """How an error crosses the wire: the server's refusals and the peers' failures."""

    INTERNAL = 1
    PROTOCOL = 2
    RENDEZVOUS = 3
    AUTHENTICATION = 4
    TIMEOUT = 5
    RENDEZVOUS_TIMEOUT = 6
    GROUP_BROKEN = 7
    RANK_FAILED = 8
    MISMATCH = 9
    CLOSED = 10
    DUPLICATE_RANK = 11
    WORLD_SIZE_MISMATCH = 12
    JOB_FULL = 13
    BAD_REQUEST = 14
    NOT_JOINED = 15
    SERVER_CLOSING = 16
    ABORTED = 17
    REMOTE = 18


class DistError(RuntimeError):
    """Root of every error aiodist raises on purpose.

    A ``RuntimeError``, as torch.distributed's own errors are (``DistError``,
    ``DistBackendError``): code ported from torch that catches ``RuntimeError``
    around a collective catches aiodist's too.
    """

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    def wire_details(self) -> dict[str, Any]:
        """Structured attributes that travel with the error code."""
        return {}


class RendezvousError(DistError):
    """This process could not join the job (conflicting rank, world size, full job)."""

    code = ErrorCode.RENDEZVOUS


class AuthenticationError(RendezvousError):
    """The job's token was refused, or the other side could not prove it; never retried.

    ``rank`` names the peer that failed the data plane's handshake (None for the server).
    """

    code = ErrorCode.AUTHENTICATION

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def wire_details(self) -> dict[str, Any]:
        return {} if self.rank is None else {"rank": self.rank}


class DistTimeoutError(DistError, TimeoutError):
    """An operation did not finish within its timeout."""

    code = ErrorCode.TIMEOUT


class BarrierTimeoutError(DistTimeoutError):
    """A barrier's own timeout passed first on this rank; ``.ranks`` never arrived."""

    def __init__(self, message: str, *, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class RendezvousTimeout(RendezvousError, DistTimeoutError):
    """The job did not form within the rendezvous timeout."""

    code = ErrorCode.RENDEZVOUS_TIMEOUT


class GroupBrokenError(DistError):
    """The group is unusable, for every member; restart the job."""

    code = ErrorCode.GROUP_BROKEN


class RankFailedError(GroupBrokenError):
    """A member of the group died or stopped heartbeating."""

    code = ErrorCode.RANK_FAILED

    def __init__(
        self, message: str, *, rank: int, host: str = "", pid: int = 0, reason: str = ""
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.pid = pid
        self.reason = reason

    def wire_details(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "reason": self.reason}


class CollectiveMismatchError(DistError):
    """Ranks called a collective with inputs that disagree."""

    code = ErrorCode.MISMATCH

    def __init__(self, message: str, *, field: str, values_by_rank: dict[int, Any]) -> None:
        super().__init__(message)
        self.field = field
        self.values_by_rank = values_by_rank

    def wire_details(self) -> dict[str, Any]:
        return {"field": self.field, "values_by_rank": self.values_by_rank}


class AbortedError(DistError):
    """The call failed on another rank before that rank sent its part; the group is still usable.

    Every rank's call with that place in the group's order raises it (the
    failing rank raises its own error instead), so no call ever receives
    another call's data. ``rank`` is the global rank where it failed and
    ``reason`` its error, as ``"TypeError: cannot pickle ..."``.
    """

    code = ErrorCode.ABORTED

    def __init__(self, message: str, *, rank: int, reason: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason

    def wire_details(self) -> dict[str, Any]:
        return {"rank": self.rank, "reason": self.reason}


class RemoteError(DistError):
    """A remote call raised an exception of a type that cannot be rebuilt here.

    ``rank`` ran the call; ``exc_type`` is the remote exception's type
    (``"mymodule.MyError"``) and ``remote_traceback`` its traceback there. A
    rebuilt exception of the remote type has one as its ``__cause__``.
    """

    code = ErrorCode.REMOTE

    def __init__(
        self, message: str, *, rank: int, exc_type: str = "", remote_traceback: str = ""
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback

    def wire_details(self) -> dict[str, Any]:
        return {"rank": self.rank, "exc_type": self.exc_type}

    def __reduce__(self) -> tuple[Any, ...]:  # pickled with its keywords (master-worker replies)
        rebuild = functools.partial(
            RemoteError, rank=self.rank, exc_type=self.exc_type,
            remote_traceback=self.remote_traceback,
        )  # fmt: skip
        return rebuild, (str(self),)


class ProtocolError(DistError):
    """A malformed or oversized frame; only that connection is closed."""

    code = ErrorCode.PROTOCOL


class ClosedError(DistError):
    """You closed it, then used it."""

    code = ErrorCode.CLOSED


def counted(n: int, noun: str) -> str:
    """A count and its noun for messages: ``1 rank``, ``3 ranks``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def rank_left_error(rank: int, host: str = "", pid: int = 0) -> RankFailedError:
    """The error of an operation that needs ``rank`` after that rank left the job cleanly."""
    where = f" (host {host}, pid {pid})" if host else ""
    return RankFailedError(
        f"rank {rank}{where} {LEFT_REASON} while this operation waited on it; a rank must "
        "not leave before the operations that need it are done",
        rank=rank,
        host=host,
        pid=pid,
        reason=LEFT_REASON,
    )


# --- bad arguments, as the originals raise them ----------------------------------------------
# Bad arguments raise ValueError/TypeError before anything is sent. Code ported from
# torch.distributed catches what torch raises for the same input (its C++ checks raise
# RuntimeError), and code from mmengine.dist what mmengine asserts: these are both.


class ArgumentError(ValueError, RuntimeError):
    """A bad argument value; a ``RuntimeError`` too, as torch.distributed's checks raise."""


class ArgumentTypeError(TypeError, RuntimeError):
    """An argument of the wrong type or dtype; a ``RuntimeError`` too, as torch raises."""


class AssertedArgumentError(TypeError, AssertionError):
    """An argument mmengine.dist asserts on (``assert isinstance(data, list)``)."""


class AssertedValueError(ValueError, AssertionError):
    """An argument value mmengine.dist asserts on (``assert tmpdir is None``)."""


_BY_CODE: dict[ErrorCode, type[DistError]] = {
    cls.code: cls
    for cls in (
        DistError,
        RendezvousError,
        AuthenticationError,
        DistTimeoutError,
        RendezvousTimeout,
        GroupBrokenError,
        RankFailedError,
        CollectiveMismatchError,
        AbortedError,
        RemoteError,
        ProtocolError,
        ClosedError,
    )
}
# Codes that are finer-grained than the class they raise.
_BY_CODE.update(
    {
        ErrorCode.DUPLICATE_RANK: RendezvousError,
        ErrorCode.WORLD_SIZE_MISMATCH: RendezvousError,
        ErrorCode.JOB_FULL: RendezvousError,
        ErrorCode.BAD_REQUEST: DistError,
        ErrorCode.NOT_JOINED: DistError,
        ErrorCode.SERVER_CLOSING: RendezvousError,
    }
)


def from_wire(code: int, message: str, details: dict[str, Any] | None = None) -> DistError:
    """Rebuild the exception a peer or the server sent as (code, message, details)."""
    details = details or {}
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except ValueError:
        cls = DistError
    if cls is RankFailedError:
        return RankFailedError(
            message,
            rank=int(details.get("rank", -1)),
            host=str(details.get("host", "")),
            pid=int(details.get("pid", 0)),
            reason=str(details.get("reason", "")),
        )
    if cls is AbortedError:
        return AbortedError(
            message, rank=int(details.get("rank", -1)), reason=str(details.get("reason", ""))
        )
    if cls is RemoteError:
        return RemoteError(
            message, rank=int(details.get("rank", -1)), exc_type=str(details.get("exc_type", ""))
        )
    if cls is AuthenticationError:
        rank = details.get("rank")
        return AuthenticationError(message, rank=rank if type(rank) is int else None)
    if cls is CollectiveMismatchError:
        raw = details.get("values_by_rank", {})
        values = {int(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}
        return CollectiveMismatchError(
            message, field=str(details.get("field", "")), values_by_rank=values
        )
    return cls(message)


E = TypeVar("E", bound=BaseException)


def first_of(exc: BaseException, kind: type[E]) -> E | None:
    """The first ``kind`` in ``exc``, unwrapping the exception groups task groups raise."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := first_of(inner, kind)) is not None:
                return found
    return None


def first_line(exc: BaseException) -> str:
    """What error ``exc`` says first (its type's name if it says nothing)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def timeout_in_torch(where: str, exc: Exception) -> DistTimeoutError | None:
    """torch.distributed's error ``exc`` for the call ``where`` names, as aiodist's timeout
    if it says a timeout ran out (gloo's "Timed out waiting ...", "Application timeout
    ..."); else None."""
    text = first_line(exc)
    said = text.lower()
    if not (isinstance(exc, TimeoutError) or "timed out" in said or "timeout" in said):
        return None
    return DistTimeoutError(
        f"{where}: {text}; a rank may not have called it, or may be stuck. The group is broken "
        "on every rank."
    )
