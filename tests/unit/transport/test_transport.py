"""Every data-plane transport passes the same conformance suite."""

from __future__ import annotations

import socket

import anyio
import pytest

from aiodist._transport import shm, shmring, tcp, uds
from aiodist.testing import check_data_channel

# Rings small enough that the suite's payloads wrap them many times, and one
# that sends every non-empty payload through shared memory.
SMALL_RINGS = shmring.ShmTransport(min_bytes=1, slot_bytes=4096, slots=2)


@pytest.mark.parametrize(
    "transport",
    [tcp, uds, shmring, SMALL_RINGS],
    ids=["tcp", "uds", "shm", "shm-small-rings"],
)
async def test_transport_passes_conformance_suite(transport: object) -> None:
    if transport is not tcp and not uds.available():
        pytest.skip("abstract Unix sockets need Linux")
    if transport in (shmring, SMALL_RINGS) and not shm.available():
        pytest.skip("needs a writable /dev/shm")
    with anyio.fail_after(30):
        await check_data_channel(transport)  # type: ignore[arg-type]


async def test_uds_addresses_are_abstract_and_unique() -> None:
    a = await uds.listen("", lambda: None)  # type: ignore[arg-type, return-value]
    b = await uds.listen("", lambda: None)  # type: ignore[arg-type, return-value]
    try:
        assert a.address.startswith("uds:aiodist-")
        assert a.address != b.address
    finally:
        a.close()
        b.close()


async def test_uds_listener_queues_a_burst_of_connects_beyond_the_loop_default_backlog() -> None:
    if not uds.available():
        pytest.skip("abstract Unix sockets need Linux")
    listener = await uds.listen("", lambda: None)  # type: ignore[arg-type, return-value]
    socks: list[socket.socket] = []
    try:
        # No await in between: the loop accepts none of them meanwhile, so each one
        # queues. A Unix socket refuses a connect beyond the backlog at once (EAGAIN);
        # the loop's default of 100 used to replace the listener's own.
        for _ in range(300):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setblocking(False)
            sock.connect("\0" + listener.address.removeprefix("uds:"))
    finally:
        for sock in socks:
            sock.close()
        listener.close()
