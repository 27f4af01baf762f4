"""``aiodist run --replace-failed``: a rank killed mid-step is replaced, the others go on.

The replacement joins the running (elastic) job with the next free rank,
regroups with the survivors and receives the parameters by broadcast
(``examples/elastic_train.py --expect-replacement``).
"""

from __future__ import annotations

import ast
import re
import sys
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import ROOT
from tests.helpers.procs import json_lines, run

if TYPE_CHECKING:
    from pathlib import Path

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


# --- what a replacement joins, and when none is started ---------------------------------------

WORKER = ROOT / "tests" / "helpers" / "replace_worker.py"
LIMIT = 60.0  # the backstop, never the expected time


def _reports(stdout: str) -> list[dict[str, Any]]:
    """The workers' JSON lines, without the launcher's ``[rank N] `` prefixes."""
    return json_lines("\n".join(line.partition("] ")[2] for line in stdout.splitlines()))


def _replace_failed(mode: str) -> list[str]:
    launcher = [sys.executable, "-m", "aiodist", "run", "-n", "3", "--replace-failed"]
    return [*launcher, str(WORKER), mode]


async def test_replacement_arriving_after_the_job_ended_is_stopped_and_the_run_succeeds(
    tmp_path: Path,
) -> None:
    ended = {"REPLACE_ENDED": str(tmp_path / "ended")}
    result = await run(_replace_failed("late"), limit=LIMIT, env=ended)
    # Before: the replacement formed a new job of its own under the old name ("forming,
    # 1/3 joined") and waited for its members until the join timeout (30 minutes).
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting a replacement (1 of at most 16)" in result.stderr, result.stderr[-3000:]
    assert re.search(
        r"job 'run-\w+' ended before rank 2's replacement \(pid \d+\) joined it; "
        r"stopping the replacement",
        result.stderr,
    ), result.stderr[-3000:]
    assert "get_rank" not in result.stdout  # it never joined anything


async def test_replacements_that_fail_at_start_up_stop_after_three_with_backoff() -> None:
    result = await run(_replace_failed("startup"), limit=LIMIT)
    # Before: 16 replacements, one after the other, without a pause.
    assert result.stderr.count("starting a replacement") == 3, result.stderr[-3000:]
    assert "starting a replacement in 1 s (2 of at most 16)" in result.stderr
    assert "starting a replacement in 2 s (3 of at most 16)" in result.stderr
    assert re.search(
        r"rank 2's replacement \(pid \d+\) exited with code 1 before it joined job "
        r"'run-\w+': 3 replacements in a row failed at start-up; starting no more",
        result.stderr,
    ), result.stderr[-3000:]
    assert result.returncode == 1, result.stderr[-3000:]
    assert "stopped the other 2 ranks" in result.stderr


async def test_replacements_never_form_a_job_of_their_own_when_every_rank_died() -> None:
    result = await run(_replace_failed("all_die"), limit=LIMIT)
    # Before: the replacements formed a fresh job and waited in it (the join timeout).
    assert result.returncode == 128 + 9, result.stderr[-3000:]
    assert "get_rank" not in result.stdout, result.stdout[-3000:]
    assert "was killed by SIGKILL" in result.stderr.strip().splitlines()[-1]


async def test_replacement_keeps_its_job_rank_and_cannot_use_the_default_group_before_regroup() -> (
    None
):
    result = await run(_replace_failed("newcomer"), limit=LIMIT)
    assert result.returncode == 0, result.stderr[-3000:]
    (seen,) = [r for r in _reports(result.stdout) if "get_rank" in r]
    # Before: rank 0 of world 1 (a script's "if rank == 0: produce" made it a second producer).
    assert (seen["get_rank"], seen["get_world_size"]) == (3, 4), seen
    (tried,) = [r for r in _reports(result.stdout) if "error" in r or "all_reduce" in r]
    # Before: the all_reduce "succeeded" over a world of one.
    assert tried.get("error") == "GroupBrokenError", tried
    assert "regroup" in tried["message"], tried
