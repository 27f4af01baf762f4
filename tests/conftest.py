from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

import anyio
import pytest
import uvloop

from aiodist import RendezvousServer, serve_rendezvous

# The suite's ranks leave torch.distributed alone unless a test asks for a backend (or
# for torch's default group, as tests/test_default_backend.py does): each bring-up costs
# an import of torch.distributed and a gloo mesh, seconds on a loaded 2-core machine.
os.environ.setdefault("AIODIST_TORCH_GROUP", "0")

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(
            ("asyncio", {"debug": True, "loop_factory": uvloop.new_event_loop}), id="uvloop"
        ),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return cast("tuple[str, dict[str, Any]]", request.param)


@pytest.fixture
async def server() -> AsyncIterator[RendezvousServer]:
    async with anyio.create_task_group() as tg:
        yield await tg.start(serve_rendezvous, "127.0.0.1", 0)  # port 0: the OS picks
        tg.cancel_scope.cancel()
