"""Setting up a shared board (``_metrics.board``) inside an aggregator's first sync.

Set-up (``open_board``) runs inside the aggregator's first sync on the group:
group rank 0 creates the segment (``shm.create_segment``: ``0600``, named after
its pid, so a crashed creator's file is removed by the others) and sends its
name; each rank maps it and answers whether it could (and whether
``AIODIST_METRICS_SHM`` lets it); rank 0 unlinks the file and tells everyone
the outcome. Any "no" sends every rank down the socket path, together.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

from aiodist import _settings
from aiodist._metrics import slots
from aiodist._metrics.board import Board
from aiodist._ops import shared
from aiodist._transport import shm

if TYPE_CHECKING:
    from aiodist._ops.exchange import Exchange

logger = logging.getLogger(__name__)

_STEP: Final = 3 << 10  # set-up messages: after the fused path's three phases


def enabled() -> bool:
    """``AIODIST_METRICS_SHM`` (default on): whether this rank offers the shared board."""
    return _settings.METRICS_SHM.read()


async def open_board(ex: Exchange) -> Board | None:
    """Set up the shared board inside ``ex``, the aggregator's first sync on its group.

    Returns the same kind of answer on every rank: a board each, or None each.
    """
    g = ex.g
    if g.world_size < 2 or not await shared.agreed(g):
        return None
    nbytes = slots.nbytes(g.world_size)
    others = range(1, g.world_size)
    segment: shm.Segment | None = None
    try:
        if g.rank == 0:
            if enabled():
                try:
                    segment = shm.create_segment(nbytes)
                except OSError as exc:
                    logger.warning("metrics sync falls back to sockets: %s", exc)
            offer = segment.name.encode() if segment is not None else b""
            for r in others:
                await ex.send(r, _STEP, offer)
            answers = [await ex.recv(r, _STEP + 1) for r in others]
            ok = segment is not None and all(bytes(m.data) == b"1" for m in answers)
            if segment is not None:
                segment.unlink()  # every rank mapped it, or none will use it
            for r in others:
                await ex.send(r, _STEP + 2, b"1" if ok else b"0")
        else:
            msg = await ex.recv(0, _STEP)
            name = bytes(msg.data).decode()
            if name and enabled():
                try:
                    segment = shm.map_segment(name, nbytes)
                except (OSError, ValueError) as exc:
                    logger.warning("metrics sync falls back to sockets: %s", exc)
            await ex.send(0, _STEP + 1, b"1" if segment is not None else b"0")
            go = await ex.recv(0, _STEP + 2)
            ok = segment is not None and bytes(go.data) == b"1"
    except BaseException:
        if segment is not None:
            segment.close()
        raise
    if not ok:
        if segment is not None:
            segment.close()
        return None
    assert segment is not None
    return Board(g, segment)
