"""Scripts that end without ``destroy_process_group``, in real processes.

A script that falls off its end (async code returning from ``anyio.run`` /
``asyncio.run``, or plain code on ``aiodist.sync`` reaching interpreter exit)
must leave the job the way ``destroy_process_group`` does: exit 0 with nothing
on stderr but what it printed, torch's group destroyed, metric syncs still
pending completed on every rank.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from tests.helpers import ROOT
from tests.helpers.procs import Finished, alive, free_port, reports_by_rank, run

if TYPE_CHECKING:
    from pathlib import Path

    from aiodist import RendezvousServer

pytestmark = pytest.mark.slow


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the test's loop only starts processes (and the server fixture)


# Every worker prints one JSON line, {"rank", "pid", ...}, then ends WITHOUT destroying.
# argv: FLAVOR BACKEND [INIT_METHOD RANK WORLD]; with no init method, env:// (aiodist run).
WORKER = textwrap.dedent(
    """
    import atexit, json, os, sys

    out = {"pid": os.getpid()}
    print(json.dumps(out), flush=True)  # the test kills it by pid should it hang

    @atexit.register  # before aiodist is imported: it runs after aiodist's exit handlers
    def report():
        # Left the job and destroyed torch's group, without destroy_process_group.
        out.update(aiodist_initialized=aiodist.is_initialized(),
                   torch_initialized=torch.distributed.is_initialized())
        print(json.dumps(out), flush=True)

    import torch
    import torch.distributed
    import aiodist

    def torch_backend():
        up = torch.distributed.is_initialized()
        return str(torch.distributed.get_backend()) if up else None

    flavor, backend = sys.argv[1], None if sys.argv[2] == "none" else sys.argv[2]
    kwargs = {}
    if len(sys.argv) > 3:
        kwargs = {"init_method": sys.argv[3], "rank": int(sys.argv[4]),
                  "world_size": int(sys.argv[5])}

    if flavor == "sync":
        import aiodist.sync as dist

        dist.init_process_group(backend=backend, timeout=60, **kwargs)
        t = torch.ones(2) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        out.update(rank=dist.get_rank(), sum=t.tolist(),
                   objs=dist.all_gather_object(dist.get_rank()),
                   torch_backend=torch_backend())
    else:
        async def main():
            await aiodist.init_process_group(backend=backend, timeout=60, **kwargs)
            t = torch.ones(2) * (aiodist.get_rank() + 1)
            await aiodist.all_reduce(t)
            out.update(rank=aiodist.get_rank(), sum=t.tolist(),
                       objs=await aiodist.all_gather_object(aiodist.get_rank()),
                       torch_backend=torch_backend())

        if flavor == "anyio":
            import anyio

            anyio.run(main)
        elif flavor == "asyncio":
            import asyncio

            asyncio.run(main())
        else:  # a loop left open: the group is left at interpreter exit
            import asyncio

            asyncio.new_event_loop().run_until_complete(main())
    """
)

# Shows what would otherwise pass unseen: sockets and files never closed.
_ENV = {"PYTHONWARNINGS": "always::ResourceWarning", "PYTHONPATH": str(ROOT)}


async def _run(
    argv: list[str], limit: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Finished:
    return await run(argv, limit, {**_ENV, **(env or {})}, cwd)


def _assert_clean(result: Finished, world: int) -> dict[int, dict[str, Any]]:
    stdout, stderr = result.stdout, result.stderr
    assert result.returncode == 0, f"exit code {result.returncode}\n{stdout}\n{stderr}"
    assert stderr == "", f"stderr is not empty:\n{stderr}"
    reports = reports_by_rank(stdout)
    assert sorted(reports) == list(range(world)), stdout
    for rank, report in reports.items():
        _assert_left(report, world)
        assert not alive(report["pid"]), f"rank {rank} (pid {report['pid']}) is still running"
    return reports


def _assert_left(report: dict[str, Any], world: int) -> None:
    total = float(sum(range(1, world + 1)))
    assert report["sum"] == [total, total], report
    assert report["objs"] == list(range(world)), report
    assert not report["aiodist_initialized"], report
    assert not report["torch_initialized"], report


@pytest.mark.parametrize("world", [1, 4])  # alone, and with peers (2 ranks: the next test)
@pytest.mark.parametrize("backend", ["none", "gloo"])
@pytest.mark.parametrize("flavor", ["anyio", "sync"])
async def test_script_without_destroy_exits_cleanly_under_aiodist_run(
    tmp_path: Path, flavor: str, backend: str, world: int
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    argv = [sys.executable, "-m", "aiodist", "run", "-n", str(world), "--no-prefix"]
    started = time.monotonic()
    result = await _run([*argv, str(script), flavor, backend], limit=60)
    reports = _assert_clean(result, world)
    # torch's default group comes up with every job: on aiodist's plane unless asked for gloo.
    expected = "gloo" if backend == "gloo" else "aiodist"
    assert all(r["torch_backend"] == expected for r in reports.values()), reports
    # Leaving takes a round trip to the server, not a timeout (CPU build of torch: 1-3 s
    # to import, 4 ranks on 2 shared cores).
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("backend", ["none", "gloo"])
@pytest.mark.parametrize("flavor", ["asyncio", "open-loop"])
async def test_asyncio_without_destroy_exits_cleanly(
    tmp_path: Path, flavor: str, backend: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    argv = [sys.executable, "-m", "aiodist", "run", "-n", "2", "--no-prefix"]
    # A loop never closed is the script's own ResourceWarning: not shown for that one.
    env = {"PYTHONWARNINGS": "ignore::ResourceWarning"} if flavor == "open-loop" else None
    result = await _run([*argv, str(script), flavor, backend], limit=60, env=env)
    _assert_clean(result, 2)


@pytest.mark.parametrize("flavor", ["anyio", "sync"])
async def test_tcp_ranks_without_destroy_exit_cleanly_while_rank_0_hosts_the_server(
    tmp_path: Path, flavor: str
) -> None:
    # Rank 0 embeds the server (nothing listens at the port) and falls off its end
    # first; the server must outlive its loop until the others have left.
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    world, url = 3, f"tcp://127.0.0.1:{free_port()}"
    results: dict[int, Finished] = {}

    async def one(rank: int) -> None:
        argv = [sys.executable, str(script), flavor, "none", url, str(rank), str(world)]
        results[rank] = await _run(argv, limit=60)

    async with anyio.create_task_group() as tg:
        for rank in range(world):
            tg.start_soon(one, rank)
    for rank, result in results.items():
        reports = reports_by_rank(result.stdout)
        stderr = result.stderr
        assert result.returncode == 0, f"rank {rank}: {result.returncode}\n{stderr}"
        assert stderr == "", f"rank {rank} wrote to stderr:\n{stderr}"
        _assert_left(reports[rank], world)
        assert not alive(reports[rank]["pid"])


# --- peers of a rank that left -------------------------------------------------------------

PEER_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import anyio, torch
    import aiodist

    async def main():
        url, rank = sys.argv[1], int(sys.argv[2])
        await aiodist.init_process_group(init_method=url, rank=rank, world_size=2,
                                         group_name="left", timeout=10)
        await aiodist.barrier()
        if rank == 1:
            return  # leaves without destroy_process_group
        t = torch.empty(4)
        start = anyio.current_time()
        try:
            await aiodist.recv(t, src=1)  # rank 1 never sends
            out = {"error": None}
        except aiodist.DistError as exc:
            out = {"error": type(exc).__name__, "failed_rank": getattr(exc, "rank", None),
                   "message": str(exc)}
        out.update(rank=rank, pid=os.getpid(), seconds=anyio.current_time() - start)
        print(json.dumps(out), flush=True)

    anyio.run(main)
    """
)


async def test_peer_waiting_on_a_rank_that_exited_without_destroy_gets_rank_failed_error(
    server: RendezvousServer, tmp_path: Path
) -> None:
    import aiodist

    script = tmp_path / "worker.py"
    script.write_text(PEER_WORKER)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    results: dict[int, Finished] = {}

    async def one(rank: int) -> None:
        results[rank] = await _run([sys.executable, str(script), url, str(rank)], limit=45)

    async with anyio.create_task_group() as tg:
        for rank in range(2):
            tg.start_soon(one, rank)
    assert results[1].returncode == 0, results[1].stderr
    assert results[1].stderr == ""
    out = reports_by_rank(results[0].stdout)[0]
    assert out["error"] == aiodist.RankFailedError.__name__, out
    assert out["failed_rank"] == 1, out
    assert out["seconds"] < 5, out  # told of the leave, not timed out (timeout=10)


# --- metric syncs at the end ---------------------------------------------------------------

# argv: FLAVOR END STEPS; END is "exit" (fall off the end) or "destroy". Every sync's
# on_done records its values; rank 0's MetricsWriter writes metrics.jsonl in the cwd.
METRICS_WORKER = textwrap.dedent(
    """
    import atexit, json, os, sys

    flavor, end, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    seen, out = [], None
    print(json.dumps({"pid": os.getpid()}), flush=True)  # the test kills it should it hang

    @atexit.register  # before aiodist is imported: it runs after aiodist's exit handlers
    def report():
        out.close()
        print(json.dumps({"rank": rank, "pid": os.getpid(), "seen": seen}), flush=True)

    from aiodist.metrics import MetricAggregator, MetricsWriter

    def post(agg, rank):
        for step in range(steps):
            agg.update(1.0, n=rank + 1, step=step)
            agg.sync(on_done=lambda r, step=step: (seen.append([step, r["n"], r["step"]]),
                                                   out.write(r, step=step)))

    if flavor == "sync":
        import aiodist.sync as dist

        dist.init_process_group(timeout=60)
        dist.all_gather_object(None)  # connected (see the test)
        rank, out = dist.get_rank(), MetricsWriter("metrics.jsonl")
        post(MetricAggregator({"n": "sum"}), rank)
        if end == "destroy":
            dist.destroy_process_group()
    else:
        import anyio
        import aiodist

        async def main():
            global rank, out
            await aiodist.init_process_group(timeout=60)
            await aiodist.all_gather_object(None)  # connected (see the test)
            rank, out = aiodist.get_rank(), MetricsWriter("metrics.jsonl")
            post(MetricAggregator({"n": "sum"}), rank)
            if end == "destroy":
                await aiodist.destroy_process_group()

        anyio.run(main)
    """
)


@pytest.mark.parametrize("route", ["board", "data-plane"])
@pytest.mark.parametrize("end", ["exit", "destroy"])
@pytest.mark.parametrize("flavor", ["anyio", "sync"])
async def test_metric_syncs_posted_just_before_the_end_complete_on_every_rank(
    tmp_path: Path, flavor: str, end: str, route: str
) -> None:
    # The ranks are connected before the end: on the plain asyncio loop, a connection a
    # peer opens in the very last turns of a rank's loop can be lost with the accept
    # tasks that asyncio.run's end cancels (see aiodist/_group/lingering.py).
    script = tmp_path / "worker.py"
    script.write_text(METRICS_WORKER)
    world, steps = 2, 5
    env = {"AIODIST_METRICS_SHM": "1" if route == "board" else "0"}
    argv = [sys.executable, "-m", "aiodist", "run", "-n", str(world), "--no-prefix"]
    result = await _run([*argv, str(script), flavor, end, str(steps)], 60, env, cwd=tmp_path)
    stdout, stderr = result.stdout, result.stderr
    assert result.returncode == 0, f"{stdout}\n{stderr}"
    assert stderr == "", stderr
    reports = reports_by_rank(stdout)
    total = float(sum(range(1, world + 1)))
    for rank in range(world):
        # Every sync completed on every rank, with every rank's values, in call order.
        expected = [[step, total, float(step)] for step in range(steps)]
        assert reports[rank]["seen"] == expected, reports[rank]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["n"]) for row in rows] == [(s, total) for s in range(steps)]


# --- flush ---------------------------------------------------------------------------------

# argv: URL RANK FLAVOR. Rank 0 posts three syncs, flushes, and dies at once (os._exit:
# no exit handler, no leave); rank 1 must still get all three results.
FLUSH_WORKER = textwrap.dedent(
    """
    import json, os, sys
    from aiodist.metrics import MetricAggregator

    url, rank, flavor = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    late = rank == 1 and sys.argv[4] == "late"  # its later syncs only once rank 0 is gone
    kwargs = dict(init_method=url, rank=rank, world_size=2, group_name="flush", timeout=30)

    def results(works, wait):
        out = []
        for w in works:
            try:
                out.append(wait(w)["n"])
            except Exception as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        return out

    if flavor == "sync":
        import aiodist.sync as dist

        dist.init_process_group(**kwargs)
        dist.barrier()
        agg = MetricAggregator({"n": "sum"})
        works = []
        for step in range(3):
            agg.update(n=rank + 1)
            works.append(agg.sync())
            if late and step == 0:
                dist.membership(1, timeout=20)  # the view without rank 0
        if late:  # one rank 0 never made
            agg.update(n=2)
            works.append(agg.sync())
        if rank == 0:
            done = agg.flush()
            assert done.is_completed()  # the blocking form returns once flushed
            os._exit(0)
        out = results(works, lambda w: w.wait(timeout=20))
        print(json.dumps({"rank": rank, "pid": os.getpid(), "n": out}), flush=True)
        os._exit(0)  # rank 0 is gone: leaving is not what this test checks
    else:
        import anyio
        import aiodist

        async def main():
            await aiodist.init_process_group(**kwargs)
            await aiodist.barrier()
            agg = MetricAggregator({"n": "sum"})
            works = []
            for step in range(3):
                agg.update(n=rank + 1)
                works.append(agg.sync())
                if late and step == 0:
                    await aiodist.membership(1, timeout=20)  # the view without rank 0
            if late:  # one rank 0 never made
                agg.update(n=2)
                works.append(agg.sync())
            if rank == 0:
                await agg.flush()
                os._exit(0)

            async def wait(w):
                with anyio.fail_after(20):
                    return await w

            out = []
            for w in works:
                try:
                    out.append((await wait(w))["n"])
                except Exception as exc:
                    out.append(f"{type(exc).__name__}: {exc}")
            print(json.dumps({"rank": rank, "pid": os.getpid(), "n": out}), flush=True)
            os._exit(0)

        anyio.run(main)
    """
)


async def _flush_job(
    server: RendezvousServer, tmp_path: Path, flavor: str, route: str, late: bool
) -> list[Any]:
    """Rank 0 syncs three times, flushes and exits at once; rank 1's outcomes of its syncs."""
    script = tmp_path / "worker.py"
    script.write_text(FLUSH_WORKER)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    env = {"AIODIST_METRICS_SHM": "1" if route == "board" else "0"}
    results: dict[int, Finished] = {}

    async def one(rank: int) -> None:
        argv = [sys.executable, str(script), url, str(rank), flavor, "late" if late else "-"]
        results[rank] = await _run(argv, limit=45, env=env)

    async with anyio.create_task_group() as tg:
        for rank in range(2):
            tg.start_soon(one, rank)
    assert results[0].returncode == 0, results[0].stderr
    reports = reports_by_rank(results[1].stdout)
    assert 1 in reports, f"rank 1 reported nothing:\n{results[1].stderr}"
    n: list[Any] = reports[1]["n"]
    return n


@pytest.mark.parametrize("route", ["board", "data-plane"])
@pytest.mark.parametrize("flavor", ["anyio", "sync"])
async def test_flush_hands_syncs_to_the_peers_before_returning(
    server: RendezvousServer, tmp_path: Path, flavor: str, route: str
) -> None:
    assert await _flush_job(server, tmp_path, flavor, route, late=False) == [3.0, 3.0, 3.0]


@pytest.mark.parametrize("flavor", ["anyio", "sync"])
async def test_syncs_a_peer_flushed_before_it_failed_complete_on_a_rank_that_makes_them_later(
    server: RendezvousServer, tmp_path: Path, flavor: str
) -> None:
    # On the shared board, rank 0's flush returns once its records are written, not once
    # rank 1 made its syncs: rank 1 makes its last two only when rank 0 is gone (its group
    # broken), and they still complete from rank 0's records. The one rank 0 never made
    # fails, naming it.
    n = await _flush_job(server, tmp_path, flavor, "board", late=True)
    assert n[:3] == [3.0, 3.0, 3.0], n
    assert len(n) == 4, n
    assert n[3].startswith("RankFailedError: rank 0 "), n
