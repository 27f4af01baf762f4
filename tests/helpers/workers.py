"""Running a test's worker script as a real process that prints one JSON line."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from tests.helpers.procs import run

if TYPE_CHECKING:
    from pathlib import Path

LIMIT = 120.0  # seconds; the callers bound their own waits more tightly


async def run_worker(script: Path, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run ``script`` with ``args`` and extra ``env`` (forked warm); its last stdout line, parsed.

    The result also holds the ``returncode``; a worker that printed nothing (it
    was killed, or crashed) gives its ``stderr`` instead.
    """
    result = await run([sys.executable, str(script), *args], LIMIT, env=env)
    lines = result.stdout.strip().splitlines()
    out: dict[str, Any] = json.loads(lines[-1]) if lines else {"stderr": result.stderr}
    out["returncode"] = result.returncode
    return out
