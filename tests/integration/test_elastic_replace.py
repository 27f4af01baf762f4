"""``aiodist run --replace-failed``: a rank killed mid-step is replaced, the others go on.

The replacement joins the running (elastic) job with the next free rank,
regroups with the survivors and receives the parameters by broadcast
(``examples/elastic_train.py --expect-replacement``).
"""

from __future__ import annotations

import ast
import re
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers.procs import run

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "examples" / "elastic_train.py"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_replace_failed_starts_a_replacement_that_joins_and_gets_the_parameters() -> None:
    argv = [
        *(sys.executable, "-m", "aiodist", "run", "-n", "4", "--replace-failed"),
        *(str(SCRIPT), "--kill", "--expect-replacement", "--steps", "60", "--fail-at", "20"),
    ]
    result = await run(argv, limit=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The launcher replaced the killed rank once, and stopped nobody.
    assert re.search(
        r"rank 3's process \(pid \d+\) was killed by SIGKILL; starting a replacement "
        r"\(1 of at most 16\), the others go on",
        result.stderr,
    ), result.stderr[-3000:]
    assert "stopped the other" not in result.stderr
    # The survivors went on as three; the replacement joined with the next free rank (4),
    # and the four trained on from rank 0's parameters (the script checks convergence).
    assert re.search(r"\[rank 0\] event: step 2[01]: rank 3 gone, shrank to 3 ranks", result.stdout)
    assert re.search(r"\[rank 0\] event: step \d+: rank 4 joined, grew to 4 ranks", result.stdout)
    assert "<- a rank failed here" in result.stdout
    assert "<- a rank joined here" in result.stdout
    summary = next(ln for ln in result.stdout.splitlines() if "elastic train:" in ln)
    assert "world 4 -> 4" in summary


PIPELINE = SCRIPT.with_name("elastic_pipeline.py")


async def test_pipeline_workers_killed_and_replaced_process_every_item_exactly_once() -> None:
    argv = [
        *(sys.executable, "-m", "aiodist", "run", "-n", "4", "--replace-failed", str(PIPELINE)),
        *("--kill", "--expect-replacements", "2", "--items", "1500", "--cost", "0.005"),
        *("--fail-after", "100"),
    ]
    result = await run(argv, limit=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.count("starting a replacement") == 2, result.stderr[-3000:]
    line = next(ln for ln in result.stdout.splitlines() if "elastic pipeline:" in ln)
    # The script asserts exactly once and the results; both killed workers were replaced
    # by ranks 4 and 5, and the producer handed items to them.
    assert "1500 of 1500 items, each processed exactly once; workers gone: [2, 3]" in line
    assert "joined: [4, 5]" in line
    per_worker = ast.literal_eval(line.split("items per worker: ")[1])
    assert per_worker[4] > 0
    assert per_worker[5] > 0
    assert sum(per_worker.values()) == 1500
    assert re.search(r"3 workers again after \d+\.\d+ s", result.stdout)
