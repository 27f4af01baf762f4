"""The transport interface: what the data plane needs from TCP, Unix sockets, shared memory.

A transport knows how to *listen* on an address and *connect* to one; both sides
then hold a ``DataChannel`` that sends whole frames and hands received frames
to a ``FrameSink``. A new transport (shared memory, RDMA) is one new module
that provides ``listen``/``connect`` and passes ``aiodist.testing.check_data_channel``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._wire.frame import Buffer, Frame

__all__ = ["DataChannel", "FrameSink", "Listener", "Transport"]


class FrameSink(Protocol):
    """Receives what arrives on a channel (implemented by the data plane)."""

    def frame_received(self, channel: DataChannel, frame: Frame) -> memoryview | None:
        """A frame's header arrived; return writable memory of ``frame.payload_nbytes``
        bytes for its payload (None when it has none)."""

    def payload_received(self, channel: DataChannel, frame: Frame) -> None:
        """The whole frame, payload included, is in the memory returned above."""

    def channel_closed(self, channel: DataChannel, exc: Exception | None) -> None:
        """The channel closed: cleanly (``exc`` None) or not."""


class DataChannel(Protocol):
    """One connection to one peer, carrying frames both ways, in order."""

    peer: str

    async def send(self, kind: int, header: object, payload: Buffer | None = None) -> None:
        """Send one frame; returns once the payload memory may be reused.

        Cancellation:
            Cancelling mid-frame aborts the channel (its state is unknown).
        """

    def close(self) -> None:
        """Close the channel; frames already sent are still delivered."""

    def abort(self) -> None:
        """Drop the channel at once."""


class Listener(Protocol):
    """A listening endpoint; ``address`` is what peers pass to ``connect``."""

    address: str

    def close(self) -> None: ...


class Transport(Protocol):
    """A module-like object: ``listen`` and ``connect`` for one address scheme."""

    scheme: str

    async def listen(self, host: str, sink_factory: Callable[[], FrameSink]) -> Listener: ...

    async def connect(self, address: str, sink: FrameSink) -> DataChannel: ...
