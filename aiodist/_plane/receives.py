"""A receive and what settles it (sans-IO): ``Posted``, ``Received``, ``Announced``.

A ``Posted`` receive names a match key and, optionally, the memory its payload
goes to; it is settled once, through its callback, with the ``Received``
message that matched it or with the error that ended it. Everything that
waits on the data plane is one of these: the awaitable forms (``DataPlane.recv``)
are a callback that resolves a future.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiodist._errors import AbortedError

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._wire.keys import Key
    from aiodist._wire.messages import PeerAbort


@dataclass(slots=True, eq=False)
class Announced:
    """A large payload announced by ``src`` (see ``bulk.py``): it moves once cleared.

    ``outcome`` is its payload's arrival (or the error that ended it), once
    cleared and in; ``waiting`` the receive it completes then.
    """

    src: int
    group_id: int
    ident: int
    nbytes: int
    cleared: bool = False
    outcome: Received | BaseException | None = None
    waiting: Callable[[Received | BaseException], None] | None = None


@dataclass(slots=True)
class Received:
    """A matched message: who sent it, its metadata, and where its payload is.

    ``announced`` marks a large payload still at its sender (see ``bulk.py``);
    ``error`` a send that failed at its sender before its data left: the
    receive it matches fails with it.
    """

    src: int
    meta: Any
    data: memoryview
    announced: Announced | None = None
    error: BaseException | None = None


@dataclass(slots=True, eq=False)
class Posted:
    """A posted receive: its key, where its payload goes, and who takes the outcome."""

    dest: memoryview | None
    key: Key
    callback: Callable[[Received | BaseException], None] | None
    credited: bool = False  # its sender was told it is posted (see bulk.py)

    @property
    def settled(self) -> bool:
        """True once the outcome was handed over (a failure may come before the payload)."""
        return self.callback is None

    def settle(self, outcome: Received | BaseException) -> None:
        """Hand ``outcome`` to the callback, once; later outcomes are dropped."""
        callback = self.callback
        if callback is not None:
            self.callback = None  # at most once
            callback(outcome)


def aborted_message(src: int, abort: PeerAbort) -> Received:
    """The message a ``PeerAbort`` from ``src`` stands for: one that fails its receive."""
    rank, reason = abort.rank, abort.reason
    error = AbortedError(
        f"{abort.what} failed on rank {rank} before its data left ({reason}), so the receive "
        "it matched fails too. Fix that rank's call.",
        rank=rank,
        reason=reason,
    )
    return Received(src, None, memoryview(b""), error=error)
