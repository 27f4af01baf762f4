"""aiodist.sync as a drop-in for torch.distributed and mmengine.dist: a differential test.

The same script (``dropin_worker.py``) runs on two ranks under the original
(torch.distributed on gloo; mmengine.dist on top of it) and under
``aiodist.sync`` on aiodist's data plane, calling every function on every
dtype gloo carries (and a few it does not), edge cases and bad input. Each
side is one process pair that makes every call in one launch. Results must be
equal and errors instances of the original's exception class (see
``dropin_compare.py``). ``python -m tests.test_dropin`` prints the table
``docs/guide/sync.md`` quotes.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from tests.helpers import HELPERS
from tests.helpers.dropin_compare import agree, dtype_of, function_of
from tests.helpers.procs import free_port
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from pathlib import Path

WORKER = HELPERS / "dropin_worker.py"
ROOT = WORKER.parent.parent
WORLD = 2
BOUND = 240.0  # seconds for all four launches; they take ~15 s on two busy cores

pytestmark = pytest.mark.slow


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the loop only waits for the processes: once is enough


async def _launch(side: str, suite: str) -> list[dict[str, Any]]:
    """Run the worker on ``WORLD`` ranks; return each rank's records."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DROPIN_RUN": uuid.uuid4().hex,
        "PYTHONWARNINGS": "ignore",
    }
    env.pop("LOCAL_RANK", None)
    outs: dict[int, dict[str, Any]] = {}

    async def one(rank: int) -> None:
        cmd = [sys.executable, str(WORKER), side, suite, init, str(rank), str(WORLD)]
        async with await open_process(cmd, env=env) as proc:
            try:
                async with anyio.create_task_group() as tg:
                    chunks: dict[str, list[bytes]] = {"out": [], "err": []}

                    async def drain(stream: Any, into: list[bytes]) -> None:
                        into.extend([chunk async for chunk in stream])

                    tg.start_soon(drain, proc.stdout, chunks["out"])
                    tg.start_soon(drain, proc.stderr, chunks["err"])
                    code = await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        stderr = b"".join(chunks["err"]).decode(errors="replace")
        lines = b"".join(chunks["out"]).decode().strip().splitlines()
        assert code == 0, f"{side}/{suite} rank {rank} exited {code}:\n{stderr[-3000:]}"
        assert lines, stderr[-3000:]
        outs[rank] = json.loads(lines[-1])

    async with anyio.create_task_group() as tg:
        for rank in range(WORLD):
            tg.start_soon(one, rank)
    return [outs[r] for r in range(WORLD)]


async def _compare(
    suite: str, side: str = "aiodist"
) -> tuple[Counter[str], set[str], set[tuple[str, str]], list[str]]:
    results: dict[str, list[dict[str, Any]]] = {}

    async def run(side: str) -> None:
        results[side] = await _launch(side, suite)

    async with anyio.create_task_group() as tg:
        for one in ("torch", side):
            tg.start_soon(run, one)
    verdicts: Counter[str] = Counter()
    functions: set[str] = set()
    pairs: set[tuple[str, str]] = set()
    problems = []
    for rank in range(WORLD):
        original, ours = results["torch"][rank], results[side][rank]
        assert original.keys() == ours.keys()
        for case in original:
            verdict = agree(original[case], ours[case])
            if verdict in ("equal", "same error", "extended", "both refuse"):
                verdicts[verdict] += 1
                if verdict in ("equal", "same error"):
                    functions.add(function_of(case))
                    pairs.add((function_of(case), dtype_of(case) or "-"))
            else:
                problems.append(f"rank {rank} {case}: {verdict}")
    return verdicts, functions, pairs, problems


async def test_aiodist_sync_matches_torch_distributed_on_gloo() -> None:
    with anyio.fail_after(BOUND):
        verdicts, functions, pairs, problems = await _compare("torch")
    assert not problems, "\n".join(problems)
    # The coverage cannot shrink unnoticed: every function on every dtype gloo carries.
    assert len(functions) >= 25, sorted(functions)
    assert len(pairs) >= 160, len(pairs)
    assert verdicts["same error"] >= 80, verdicts  # bad input, on every rank
    assert verdicts["extended"] > 0  # dtypes gloo refuses, which aiodist carries


async def test_torch_distributed_on_the_aiodist_backend_matches_gloo() -> None:
    """The same torch.distributed calls, on backend="aiodist" and on gloo: every kind."""
    with anyio.fail_after(BOUND):
        verdicts, functions, pairs, problems = await _compare("torch", "backend")
    # torch itself refuses monitored_barrier on any backend but gloo, before it reaches one.
    refused = "aiodist raised ValueError: monitored_barrier is only implemented for GLOO"
    assert [p for p in problems if refused not in p] == [], "\n".join(problems)
    assert len(functions) >= 25, sorted(functions)
    assert len(pairs) >= 160, len(pairs)
    assert verdicts["same error"] >= 80, verdicts
    assert verdicts["extended"] > 0  # dtypes gloo refuses, which aiodist carries


async def test_aiodist_sync_matches_mmengine_dist() -> None:
    pytest.importorskip("mmengine")
    with anyio.fail_after(BOUND):
        verdicts, functions, _, problems = await _compare("mmengine")
    assert not problems, "\n".join(problems)
    assert len(functions) >= 15, sorted(functions)
    assert verdicts["equal"] >= 200, verdicts
    assert verdicts["same error"] >= 14, verdicts


async def _table() -> None:  # pragma: no cover - run by hand for docs/guide/sync.md
    for suite in ("torch", "mmengine"):
        verdicts, functions, pairs, problems = await _compare(suite)
        print(
            f"{suite}: {len(functions)} functions, {len(pairs)} function x dtype pairs, "
            f"{sum(verdicts.values())} calls per side: {dict(verdicts)}; {len(problems)} differ"
        )
        for p in problems:
            print("  ", p)


if __name__ == "__main__":  # pragma: no cover
    anyio.run(_table)


MONITORED = """
import json, sys, time
from datetime import timedelta
import aiodist.sync as dist

init, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group(init_method=init, rank=rank, world_size=2, timeout=60)
store = dist.get_store()
pair = dist.new_group([0, 1])
out = {}
if rank == 0:
    try:
        dist.barrier(timeout=0)
    except ValueError as exc:
        barrier = str(exc)
    began = time.monotonic()
    try:
        dist.monitored_barrier(timeout=1.0)  # rank 1 never comes
    except Exception as exc:
        out = {"error": [c.__name__ for c in type(exc).__mro__], "ranks": exc.ranks,
               "seconds": time.monotonic() - began, "words": str(exc), "barrier": barrier}
    try:  # torch's method of a group, with no time to wait at all
        pair.monitored_barrier(timedelta(seconds=0))
    except RuntimeError as exc:
        out["method"] = str(exc)
    store.set("reported", "1")
else:
    store.wait(["reported"], timeout=60)
print(json.dumps(out), flush=True)
dist.destroy_process_group()
"""


async def test_monitored_barrier_in_real_processes_names_the_rank_that_never_came(
    tmp_path: Path,
) -> None:
    script = tmp_path / "monitored.py"
    script.write_text(MONITORED)
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    outs: list[dict[str, Any]] = []
    try:
        with anyio.fail_after(60):
            procs = [
                await open_process([sys.executable, str(script), init, str(r)], env=env)
                for r in range(WORLD)
            ]
            for proc in procs:
                assert proc.stdout is not None
                stdout = b"".join([chunk async for chunk in proc.stdout])
                assert await proc.wait() == 0
                outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    first = outs[0]
    # torch's monitored_barrier raises RuntimeError; aiodist's error is one, and a timeout.
    assert first["error"][:2] == ["BarrierTimeoutError", "DistTimeoutError"]
    assert "RuntimeError" in first["error"]
    assert first["ranks"] == [1]
    assert 0.9 < first["seconds"] < 4.0
    # torch's words lead, as gloo says them.
    assert first["words"].startswith("Rank 1 failed to pass monitoredBarrier in 1000 ms")
    # ``group.monitored_barrier(timeout)``, torch's method: blocks in plain code, takes 0.
    assert "Rank 1 failed to pass monitoredBarrier in 0 ms" in first["method"]
    assert "Rank 0 timed out in monitoredBarrier after 0 ms" in first["method"]
    assert "ranks [1] never arrived" in first["method"]
    # A plain barrier still wants time to wait.
    assert first["barrier"] == "timeout must be a number of seconds > 0, got 0", first
    assert outs[1] == {}
    assert all(proc.returncode == 0 for proc in procs)  # every process exited cleanly
