"""Running a test's worker script as a real process that prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from pathlib import Path


async def run_worker(script: Path, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run ``script`` with ``args`` and extra ``env``; its last stdout line, parsed.

    The result also holds the ``returncode``; a worker that printed nothing (it
    was killed, or crashed) gives its ``stderr`` instead.
    """
    result = await anyio.run_process(
        [sys.executable, str(script), *args], check=False, env={**os.environ, **env}
    )
    lines = result.stdout.decode().strip().splitlines()
    out: dict[str, Any] = json.loads(lines[-1]) if lines else {"stderr": result.stderr.decode()}
    out["returncode"] = result.returncode
    return out
