"""Write a data-plane transport of your own: the DataChannel interface, public.

Ranks exchange their messages over *data channels*, one connection per peer
pair, made by a *transport*. aiodist ships three (``tcp``, ``uds``: Unix
sockets, ``shm``: Unix sockets whose large payloads go through shared-memory
rings); as the original torch.distributed design promised, you may add your
own, "so they can easily achieve the lowest overhead possible in their setup"
(a fabric's own library, a checksum on a flaky link, an encrypted tunnel).

**The interface.** A transport is any object with (``Transport``)::

    scheme: str                                     # its addresses start "scheme:"
    async def listen(host, sink_factory, *, preauth=None) -> Listener
    async def connect(address, sink) -> DataChannel

``listen`` binds on ``host`` (the numeric address this rank reaches the
rendezvous server from) and returns a ``Listener`` whose ``address`` peers
pass to ``connect``; each connection it accepts gets a fresh sink from
``sink_factory()``. Both ends then hold a ``DataChannel``:

- ``send(kind, header, payload=None)``: one frame, whole, in order with every
  other send on the channel; returns once ``payload``'s memory may be reused.
- ``send_nowait(...)``: the same as far as it goes now: None when done, else
  an awaitable that finishes it (awaited in a task, in order).
- ``handshake_done()``: called by the data plane on both ends once the peer
  proved itself. Before that, a channel reads only small frames without payload
  (``PREAUTH_FRAME_LIMITS``) and an accepted one counts against its listener's
  ``PreAuthLimits`` (bytes, deadline, how many wait; ``Admission`` does it all):
  a stranger who connects costs a rank only that much.
- ``close()`` (what was sent is still delivered), ``abort()``, and ``peer`` (a
  name for log lines).

and hands what arrives to its ``FrameSink``: ``frame_received(channel, frame)``
when a frame's header is in (it returns the memory the payload must land in,
often the destination tensor's own), ``payload_received(channel, frame)``
once that memory holds it, ``channel_closed(channel, exc)`` once, at the end
(``exc`` None for a clean close at a frame boundary, else why). Frames are
what ``encode_frame`` makes and ``FrameDecoder`` reads back: a transport may
carry them as they are, or wrap them (``examples/crc_transport.py`` adds a
length and a CRC32 and uses asyncio streams).

**Check it** with ``aiodist.testing.check_data_channel(transport)``: frames of
every size both ways, payload memory reuse, concurrent senders, order, close
and abort, and the limits before the handshake.

**Use it.** Every rank of the job registers it under one name before it
joins, and the job names it::

    aiodist.register_transport("crc", CrcTransport())   # or the entry point group
    # AIODIST_TRANSPORT=crc           every rank listens on crc only
    # AIODIST_TRANSPORT=crc,tcp       crc first; peers that lack it use TCP

``AIODIST_TRANSPORT`` (``open_process_group(transport=...)``) names what each
rank listens on, in order; each rank publishes those addresses, and a rank
connecting to a peer uses the first of the peer's addresses whose scheme it
has a transport for. An installed package can provide one through the entry
point group ``aiodist.transports`` instead of a call.
"""

from __future__ import annotations

from aiodist._transport.admission import Admission
from aiodist._transport.base import DataChannel, FrameSink, Listener, Transport
from aiodist._transport.registry import (
    ENTRY_POINT_GROUP,
    register_transport,
    registered,
    unregister_transport,
)
from aiodist._wire.frame import PREFIX, Frame, FrameDecoder, Limits, encode_frame
from aiodist._wire.preauth import PREAUTH_FRAME_LIMITS, PreAuthLimits

__all__ = [
    "ENTRY_POINT_GROUP",
    "PREAUTH_FRAME_LIMITS",
    "PREFIX",
    "Admission",
    "DataChannel",
    "Frame",
    "FrameDecoder",
    "FrameSink",
    "Limits",
    "Listener",
    "PreAuthLimits",
    "Transport",
    "encode_frame",
    "register_transport",
    "registered",
    "unregister_transport",
]
