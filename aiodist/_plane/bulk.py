"""Large point-to-point payloads: ready-to-send, clear-to-send, then the bytes.

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
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from aiodist._wire.frame import MiB
from aiodist._wire.keys import MatchKind

if TYPE_CHECKING:
    from aiodist._plane.link import Posted, Received
    from aiodist._plane.peers import DataPlane, Key

__all__ = ["BULK_MIN_BYTES", "Announced", "BulkTransfers"]

#: Point-to-point tensor payloads of at least this many bytes wait for clear-to-send.
BULK_MIN_BYTES: Final = 1 * MiB


@dataclass(slots=True, eq=False)
class Announced:
    """A large payload announced by ``src``: it moves once this rank clears it."""

    src: int
    group_id: int
    ident: int
    nbytes: int
    payload: asyncio.Future[Received] | None = None  # its receive, once cleared


class BulkTransfers:
    """Both ends of the clear-to-send exchange, for one data plane."""

    def __init__(self, plane: DataPlane) -> None:
        self._plane = plane
        self._ids = itertools.count()
        self._held: set[Announced] = set()  # announced, not yet matched nor cleared
        self._waiting = 0  # this rank's sends waiting for a clear-to-send
        # Receives peers posted for our sends: (dst, key, nbytes) -> how many.
        self._credits: dict[tuple[int, Key, int], int] = {}
        self.announcements = 0  # sends that had to announce (no credit): a statistic

    # --- sending ------------------------------------------------------------------------

    async def send(self, dst: int, key: Key, meta: Any, payload: memoryview) -> None:
        """Announce ``payload``, wait until ``dst`` clears it, then send it."""
        plane, group_id, ident = self._plane, key[1], next(self._ids)
        credit = (dst, key, payload.nbytes)
        if self._take_credit(credit):  # its receive is posted: no need to ask
            await plane.send_header(dst, [*key, meta], payload)
            return
        self.announcements += 1
        cleared = plane.recv(dst, (MatchKind.CLEAR, group_id, ident, 0))
        cleared.add_done_callback(_retrieve)  # a failure reaches the caller via await
        await plane.send_header(dst, [*key, meta, ident, payload.nbytes])
        self._waiting += 1
        try:
            for announced in list(self._held):  # break wait-for cycles (module docstring)
                self._clear(announced, None)
            if (await cleared).meta:  # that receive had sent a credit: take it back
                self._take_credit(credit)
        finally:
            self._waiting -= 1
        await plane.send_header(dst, [MatchKind.BULK, group_id, ident, 0, None], payload)

    def credited(self, dst: int, key: Key) -> None:
        """Rank ``dst`` posted a receive for a large payload: ``[CREDIT, group, tag, nbytes]``."""
        _, group_id, tag, nbytes = key
        credit = (dst, (MatchKind.P2P, group_id, tag, 0), nbytes)
        self._credits[credit] = self._credits.get(credit, 0) + 1

    def _take_credit(self, credit: tuple[int, Key, int]) -> bool:
        left = self._credits.get(credit, 0)
        if left <= 0:
            return False
        if left == 1:
            del self._credits[credit]
        else:
            self._credits[credit] = left - 1
        return True

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
            self._held.add(announced)

    def offer(self, src: int, posted: Posted) -> None:
        """A receive from ``src`` was posted and found nothing: credit ``src`` if it is large."""
        dest, plane = posted.dest, self._plane
        if dest is None or dest.nbytes < BULK_MIN_BYTES or src == plane.rank:
            return
        posted.credited = True
        _, group_id, tag, _ = posted.key
        plane._spawn(plane.send(src, (MatchKind.CREDIT, group_id, tag, dest.nbytes), None, None))

    def deliver(self, posted: Posted, msg: Received) -> None:
        """Complete ``posted`` with announced ``msg`` once its payload is in."""
        announced = msg.announced
        assert announced is not None
        self._held.discard(announced)
        if announced.payload is None:
            dest = posted.dest
            fits = dest is not None and dest.nbytes == announced.nbytes
            self._clear(announced, dest if fits else None, posted.credited)
        assert announced.payload is not None
        plane = self._plane

        def arrived(payload: asyncio.Future[Received]) -> None:
            if posted.settled:
                return
            if payload.cancelled():
                if posted.future is not None:
                    posted.future.cancel()
                else:
                    posted.settle(asyncio.CancelledError())
                return
            exc = payload.exception()
            if exc is not None:
                posted.settle(exc)
            else:
                plane._complete(posted, replace(msg, data=payload.result().data, announced=None))

        announced.payload.add_done_callback(arrived)

    def forget(self, group_id: int | None) -> None:
        """Stop holding announcements of ``group_id`` (all, if None): it broke or closed."""
        self._held = {a for a in self._held if group_id is not None and a.group_id != group_id}
        self._credits = {
            c: n for c, n in self._credits.items() if group_id is not None and c[1][1] != group_id
        }

    def _clear(self, announced: Announced, dest: memoryview | None, credited: bool = False) -> None:
        # Post the payload's receive first: it may follow the clear-to-send at once.
        self._held.discard(announced)
        plane, src = self._plane, announced.src
        group_id, ident = announced.group_id, announced.ident
        announced.payload = plane.recv(src, (MatchKind.BULK, group_id, ident, 0), dest)
        announced.payload.add_done_callback(_retrieve)
        plane._spawn(
            plane.send(src, (MatchKind.CLEAR, group_id, ident, 0), 1 if credited else 0, None)
        )


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
