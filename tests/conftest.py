from __future__ import annotations

from typing import Any, cast

import pytest
import uvloop


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
