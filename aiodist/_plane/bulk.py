"""Large point-to-point payloads, sans-IO: ready-to-send, clear-to-send, then the bytes.

A tensor sent with ``isend`` of at least ``BULK_MIN_BYTES`` does not travel
at once (as gloo's and MPI's rendezvous protocols do): a payload that arrived
before its receive was posted would have to be buffered in fresh memory and
copied again. Instead, on the data plane::

    sender                                      receiver
    DATA [P2P, group, tag, 0, meta, id, n]  ->  matched like any message (its key,
                                                in send order); held while unmatched
                                            <-  DATA [CLEAR, group, id, 0, None]
                                                once a matching receive is posted
    DATA [BULK, group, id, 0, None] + n bytes -> lands in the receive's own memory

The clear-to-send and the payload are ordinary messages with keys of their own
(the same header-only "ready" message the collectives' rings send), matched by
the plane's ``Matcher``: nothing here blocks a channel, so other messages keep
flowing while a payload waits for its receive, and a failure that fails a
group's posted receives fails the waiting sender (its clear-to-send) and the
waiting receiver (its payload) alike.

Credits: a receiver that is ahead need not wait for an announcement. Posting
a large receive from a named source sends it ``DATA [CREDIT, group, tag,
nbytes, None]``; a send of that size and key that finds a credit goes at once,
with no announcement, and lands in the posted receive. A credit whose receive
was matched by an announcement after all is taken back by the clear-to-send
(its ``meta`` is 1; both travel the same channel, the credit first). Credits
are hints: a stale one (the receive failed, or a smaller message with the same
key took it) sends a payload eagerly, which the receiver buffers as before.

Cycles: two ranks that each ``await send(big)`` to the other before posting
their receives would wait for each other's clear-to-send for ever. So while
this rank itself waits for a clear-to-send, announcements it holds (and those
that arrive) are cleared at once, into a buffer, as if the payload had come
unannounced: such programs behave as they do without rendezvous.

Everything here is callbacks and the plane's one receive (``post``); what
it sends goes out through the plane's ``send_to`` action. The sender's waits
(for its announcement to leave, for the clear-to-send) are ``DataPlane``'s.
"""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiodist._plane.receives import Received
from aiodist._wire.frame import MiB
from aiodist._wire.keys import MatchKind
from aiodist._wire.messages import Data, PeerAnnounce

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._plane.matching import Matcher
    from aiodist._plane.receives import Announced, Posted
    from aiodist._wire.keys import Key

#: Point-to-point tensor payloads of at least this many bytes wait for clear-to-send.
BULK_MIN_BYTES: Final = 1 * MiB


class _Plane(Protocol):
    """What the transfers need of their data plane (``core.PlaneCore``)."""

    rank: int
    matcher: Matcher[Posted, Received]

    def post(
        self,
        src: int | None,
        key: Key,
        dest: memoryview | None,
        callback: Callable[[Received | BaseException], None],
    ) -> Posted: ...

    def complete(self, posted: Posted, msg: Received) -> None: ...

    def send_to(self, rank: int, kind: int, header: list[Any]) -> None: ...


class BulkTransfers:
    """Both ends of the clear-to-send exchange, for one data plane."""

    def __init__(self, plane: _Plane) -> None:
        self._plane = plane
        self._ids = itertools.count()
        self.held: set[Announced] = set()  # announced, not yet matched nor cleared
        self._waiting = 0  # this rank's sends waiting for a clear-to-send
        # Receives peers posted for our sends: (dst, key, nbytes) -> how many.
        self.credits: dict[tuple[int, Key, int], int] = {}
        self.announcements = 0  # sends that had to announce (no credit): a statistic

    # --- sending ------------------------------------------------------------------------

    def take_credit(self, dst: int, key: Key, nbytes: int) -> bool:
        """True (and the credit used) if ``dst`` posted a receive for this payload already."""
        credit = (dst, key, nbytes)
        left = self.credits.get(credit, 0)
        if left <= 0:
            return False
        if left == 1:
            del self.credits[credit]
        else:
            self.credits[credit] = left - 1
        return True

    def announce(
        self,
        dst: int,
        key: Key,
        meta: Any,
        nbytes: int,
        cleared: Callable[[Received | BaseException], None],
    ) -> tuple[PeerAnnounce, list[Any]]:
        """Post the receive of ``dst``'s clear-to-send (its outcome goes to ``cleared``).

        Returns what to send: the announcement now, the payload's ``DATA`` header once
        cleared. A clear-to-send whose ``meta`` is 1 took back a credit:
        ``take_credit`` it.
        """
        group_id, ident = key[1], next(self._ids)
        self.announcements += 1
        self._plane.post(dst, (MatchKind.CLEAR, group_id, ident, 0), None, cleared)
        return PeerAnnounce(*key, meta, ident, nbytes), [MatchKind.BULK, group_id, ident, 0, None]

    def wait_started(self) -> None:
        """This rank waits for a clear-to-send: clear what it holds (module docstring)."""
        self._waiting += 1
        for announced in list(self.held):
            self._clear(announced, None)

    def wait_ended(self) -> None:
        self._waiting -= 1

    def credited(self, dst: int, key: Key) -> None:
        """Rank ``dst`` posted a receive for a large payload: ``[CREDIT, group, tag, nbytes]``."""
        _, group_id, tag, nbytes = key
        credit = (dst, (MatchKind.P2P, group_id, tag, 0), nbytes)
        self.credits[credit] = self.credits.get(credit, 0) + 1

    # --- receiving ----------------------------------------------------------------------

    def announced(self, key: Key, msg: Received) -> None:
        """A ready-to-send ``msg`` arrived: match it like the message it stands for."""
        plane, src, announced = self._plane, msg.src, msg.announced
        assert announced is not None
        posted = plane.matcher.arrive(src, key)
        if posted is not None:
            self.deliver(posted, msg)
            return
        plane.matcher.buffer(src, key, msg)
        if self._waiting:
            self._clear(announced, None)
        else:
            self.held.add(announced)

    def offer(self, src: int, posted: Posted) -> None:
        """A receive from ``src`` was posted and found nothing: credit ``src`` if it is large."""
        dest, plane = posted.dest, self._plane
        if dest is None or dest.nbytes < BULK_MIN_BYTES or src == plane.rank:
            return
        posted.credited = True
        _, group_id, tag, _ = posted.key
        header = [MatchKind.CREDIT, group_id, tag, dest.nbytes, None]
        plane.send_to(src, Data.KIND, header)

    def deliver(self, posted: Posted, msg: Received) -> None:
        """Complete ``posted`` with announced ``msg`` once its payload is in."""
        announced = msg.announced
        assert announced is not None
        self.held.discard(announced)
        if not announced.cleared:
            dest = posted.dest
            fits = dest is not None and dest.nbytes == announced.nbytes
            self._clear(announced, dest if fits else None, posted.credited)
        landed = functools.partial(self._landed_into, posted, msg)
        if announced.outcome is None:
            announced.waiting = landed
        else:
            landed(announced.outcome)

    def forget(self, group_id: int | None) -> None:
        """Stop holding announcements of ``group_id`` (all, if None): it broke or closed."""
        self.held = {a for a in self.held if group_id is not None and a.group_id != group_id}
        self.credits = {
            c: n for c, n in self.credits.items() if group_id is not None and c[1][1] != group_id
        }

    def _clear(self, announced: Announced, dest: memoryview | None, credited: bool = False) -> None:
        # Post the payload's receive first: it may follow the clear-to-send at once.
        self.held.discard(announced)
        announced.cleared = True
        plane, src = self._plane, announced.src
        group_id, ident = announced.group_id, announced.ident
        landed = functools.partial(self._landed, announced)
        plane.post(src, (MatchKind.BULK, group_id, ident, 0), dest, landed)
        header = [MatchKind.CLEAR, group_id, ident, 0, 1 if credited else 0]
        plane.send_to(src, Data.KIND, header)

    @staticmethod
    def _landed(announced: Announced, outcome: Received | BaseException) -> None:
        waiting, announced.waiting = announced.waiting, None
        if waiting is None:
            announced.outcome = outcome  # cleared before its receive came: kept for it
        else:
            waiting(outcome)

    def _landed_into(
        self, posted: Posted, msg: Received, outcome: Received | BaseException
    ) -> None:
        if posted.settled:
            return  # failed while its payload was arriving: the operation reported that
        if isinstance(outcome, BaseException):
            posted.settle(outcome)
        else:
            self._plane.complete(posted, Received(msg.src, msg.meta, outcome.data))
