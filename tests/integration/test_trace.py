"""Timelines: AIODIST_TRACE on `make demo`'s job, `aiodist trace merge`, and `aiodist.trace()`."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
from aiodist._launch.trace import merge_traces
from aiodist.testing import run_ranks
from tests.helpers import ROOT
from tests.helpers.daemon import asyncio_only
from tests.helpers.procs import run

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow

# Every call the demo makes on the world group, by name (its subgroup adds more).
DEMO_CALLS = {
    "barrier",
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "collect_results_cpu",
    "sync_random_seed",
    "all_reduce_dict",
    "new_group",
}


def slices(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


@asyncio_only  # the demo's ranks choose their own loop
async def test_demo_trace_merges_into_one_process_per_rank(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    argv = [sys.executable, "-m", "aiodist", "run", "-n", "4", str(ROOT / "examples/demo.py")]
    done = await run(argv, 90, env={"AIODIST_TRACE": str(traces)}, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    merged = tmp_path / "job.json"
    cli = await anyio.run_process(
        [sys.executable, "-m", "aiodist", "trace", "merge", str(traces), "-o", str(merged)],
        check=False,
    )
    assert cli.returncode == 0, cli.stderr.decode()
    trace = json.loads(merged.read_text())  # valid JSON, one object
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    for e in slices(trace):
        assert {"name", "ts", "dur", "pid", "tid", "cat"} <= set(e), e
        assert e["dur"] >= 0
    # Per rank, the world group's calls in the order of their numbers: 1, 2, ... with no gap,
    # the same on every rank, and every call the demo makes among them.
    world: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for e in slices(trace):
        args = e["args"] if e["cat"] != "wait" else None
        if args is not None and args["seq"] and "/" not in args["group"]:
            world[e["pid"]].append((args["seq"], e["name"].split(" #")[0]))
            assert e["name"].endswith(f" #{args['seq']}")
            assert args["state"] == "done"
    calls = sorted(world[0])
    assert [seq for seq, _ in calls] == list(range(1, len(calls) + 1))
    assert {name for _, name in calls} == DEMO_CALLS
    for rank in range(1, 4):
        assert sorted(world[rank]) == calls
    # Point-to-point: each rank's isend and irecv, with its peer and bytes.
    for rank in range(4):
        p2p = [e for e in slices(trace) if e["pid"] == rank and e["cat"] == "p2p"]
        sends = [e for e in p2p if e["name"] == "isend"]
        assert sends, p2p
        assert sends[0]["args"]["peer"] == (rank + 1) % 4
        assert sends[0]["args"]["bytes"] == 12
    # Waits are slices of their own.
    waits = [e for e in slices(trace) if e["cat"] == "wait"]
    assert {e["pid"] for e in waits} == set(range(4))
    assert all(e["name"].startswith("wait ") and e["tid"] >= 1000 for e in waits)


async def test_trace_context_manager_writes_each_rank(
    server: aiodist.RendezvousServer, tmp_path: Path
) -> None:
    async def body(g: aiodist.ProcessGroup) -> None:
        await aiodist.all_reduce(torch.ones(2), group=g)

    # In one process the ranks share the context manager: each session made inside traces.
    with aiodist.trace(tmp_path):
        with anyio.fail_after(30):
            await run_ranks(server.address, 2, body)
    out, ranks = merge_traces(tmp_path, tmp_path / "merged.json")
    assert ranks == 2
    trace = json.loads(out.read_text())
    ops = sorted((e["pid"], e["name"]) for e in slices(trace) if e["cat"] == "collective")
    assert ops == [(0, "all_reduce #1"), (1, "all_reduce #1")]


def test_trace_merge_refuses_an_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no aiodist-trace"):
        merge_traces(tmp_path, tmp_path / "x.json")
