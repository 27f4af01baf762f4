"""The transport interface: what the data plane needs from TCP, Unix sockets, shared memory.

A transport knows how to *listen* on an address and *connect* to one; both sides
then hold a ``DataChannel`` that sends whole frames and hands received frames
to a ``FrameSink``. A new transport (shared memory, RDMA) is one new module
that provides ``listen``/``connect``, passes ``aiodist.testing.check_data_channel``
and is registered by name (``registry.py``). The interface is public:
``aiodist.transport`` re-exports it and documents it for users who write one.

Until the data plane's handshake is done (the peer proved the job's token, or
said a valid hello where there is none) a channel trusts nothing it receives:
it accepts only small header-only frames, parses none of its transport's own
frames, and on the accepting side costs its listener no more than the
``PreAuthLimits`` that ``listen`` was given allow (bytes, time, a share of the
unproved connections, the oldest shed first). ``handshake_done`` lifts all that.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Generator

    from aiodist._wire.frame import Buffer, Frame
    from aiodist._wire.preauth import PreAuthLimits


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

    def send_nowait(
        self, kind: int, header: object, payload: Buffer | None = None
    ) -> Awaitable[None] | None:
        """Send one frame as far as it goes now, in order with every other send.

        Returns None once the payload memory may be reused (the kernel took the
        frame: the usual case for a small one), else what to await (in a task)
        before reusing it. Raises ``OSError`` as ``send`` would.
        """

    def handshake_done(self) -> None:
        """The peer proved itself: lift the limits that held until now (again is fine).

        Until then, the channel decodes only small frames without payload
        (``PREAUTH_FRAME_LIMITS``), refuses its transport's own frames, and (on the
        accepting side) counts against its listener's ``PreAuthLimits``. The data
        plane calls it on both ends, each once its side of the handshake is
        done, right after writing its last handshake frame: what the peer sends
        next is then read under the full limits.
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

    async def listen(
        self,
        host: str,
        sink_factory: Callable[[], FrameSink],
        *,
        preauth: PreAuthLimits | None = None,
    ) -> Listener:
        """Listen; ``preauth`` bounds what an unproved connection may cost (default: a
        transport's own, e.g. ``preauth.PreAuthLimits()``)."""

    async def connect(self, address: str, sink: FrameSink) -> DataChannel: ...


def start_now(coro: Coroutine[Any, Any, None]) -> Awaitable[None] | None:
    """Run ``coro`` here up to its first wait: None if it finished, else the rest of it.

    The rest is to be awaited (in a task) and goes on exactly where ``coro``
    stopped; what ``coro`` raised before its first wait is raised here.
    """
    try:
        yielded = coro.send(None)
    except StopIteration:
        return None
    return _resume(coro, yielded)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, None], yielded: Any) -> Generator[Any, Any, None]:
    """Go on running ``coro``, which already ran up to yielding ``yielded`` to its driver."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # thrown in by the task (a cancellation): pass it on
            try:
                yielded = coro.throw(exc)
            except StopIteration:
                return
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration:
                return
