"""Every data-plane transport passes the same conformance suite."""

from __future__ import annotations

import anyio
import pytest

from aiodist._transport import tcp, uds
from aiodist.testing import check_data_channel


@pytest.mark.parametrize("transport", [tcp, uds], ids=["tcp", "uds"])
async def test_transport_passes_conformance_suite(transport: object) -> None:
    if transport is uds and not uds.available():
        pytest.skip("abstract Unix sockets need Linux")
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
