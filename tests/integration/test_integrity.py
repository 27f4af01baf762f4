"""No call gets another call's data, and the faults of one call stay in that call.

Regressions of an adversarial probe: point-to-point after a refused collective,
tensors torch calls contiguous with odd strides, the blocking facade's
init/destroy cycles, a rank that was stopped and resumed, and the privacy of
``collect_results`` parts. Real processes where the fault needs them.
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
from aiodist import AbortedError
from aiodist._ops.collect import write_private
from aiodist.testing import run_ranks
from tests.helpers import HELPERS, ROOT
from tests.helpers.procs import json_lines, reports_by_rank, run, run_job
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from pathlib import Path

    from aiodist import ProcessGroup, RendezvousServer

INTERLEAVE = HELPERS / "interleave_worker.py"
SWAPPED = HELPERS / "swapped_worker.py"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("seed", [11, 12, 13])
async def test_p2p_interleaved_with_refused_collectives_gets_every_value(seed: int) -> None:
    # 1500 steps: about 3,300 operations over the 3 ranks, a third of them receives
    # started before a refused collective's abort reaches their rank.
    ranks = await run_job([sys.executable, str(INTERLEAVE), str(seed), "1500"], 3, 120, _env())
    assert [r.returncode for r in ranks] == [0, 0, 0], [r.stderr[-3000:] for r in ranks]
    reports = [r for rank in ranks for r in json_lines(rank.stdout) if "ops" in r]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2], [r.stdout[-2000:] for r in ranks]
    for r in reports:
        assert r["wrong"] == [], r
        assert r["errors"] == [], r
        assert r["checked"] == r["ops"], r
    assert sum(r["ops"] for r in reports) > 3000


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "case", ["tensor-16", "tensor-256k", "tensor-4m", "objects", "mixed", "rooted"]
)
async def test_swapped_collectives_raise_the_mismatch_on_every_rank_at_once(
    world: int, case: str
) -> None:
    # Rank 0 calls A then B, the others B then A: whatever the sizes (direct exchange,
    # socket ring, shared memory) and kinds (tensors, objects, one-way), every rank's
    # first call fails with CollectiveMismatchError within seconds, not the timeout (60 s).
    ranks = await run_job([sys.executable, str(SWAPPED), case], world, 60, _env())
    reports = reports_by_rank("".join(r.stdout for r in ranks))
    assert sorted(reports) == list(range(world)), [
        (r.stdout[-2000:], r.stderr[-3000:]) for r in ranks
    ]
    for r in reports.values():
        assert r["raised"] == "CollectiveMismatchError", r
        assert r["field"] in ("op", "algorithm", "shape", "root"), r
        assert r["seconds"] < 10, r


async def test_p2p_started_after_a_refused_collective_is_untouched_by_its_abort(
    server: RendezvousServer,
) -> None:
    # The probe's case: rank 1 refuses an all_gather that rank 0 is still in, and
    # the receives rank 0 posts meanwhile must get exactly rank 1's sends.
    n = 20

    async def body(g: ProcessGroup) -> Any:
        if g.rank == 1:
            with pytest.raises(ValueError, match="one tensor per rank"):
                aiodist.all_gather([torch.zeros(1)] * 3, torch.zeros(1), group=g)
            sends = [aiodist.isend(torch.full((2,), float(i)), dst=0, group=g) for i in range(n)]
            for w in sends:
                await w
            return None
        gather = aiodist.all_gather([torch.zeros(1)] * 2, torch.zeros(1), group=g)
        bufs = [torch.zeros(2) for _ in range(n)]
        recvs = [aiodist.irecv(b, src=1, group=g) for b in bufs]
        with pytest.raises(AbortedError) as info:
            await gather
        assert info.value.rank == 1
        assert [await w for w in recvs] == [1] * n
        return [b.tolist() for b in bufs]

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs[0] == [[float(i)] * 2 for i in range(n)]


def _odd_strided() -> list[torch.Tensor]:
    # Contiguous for torch, but with a stride view(torch.uint8) refuses.
    one = torch.tensor([3.5, -1.0], dtype=torch.bfloat16)[::2]
    column = torch.tensor([[2.0, 9.0], [4.0, 9.0]], dtype=torch.bfloat16)[:1, :1]
    assert one.is_contiguous()
    assert column.is_contiguous()
    return [one, column]


async def test_contiguous_tensors_with_odd_strides_travel_everywhere(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> Any:
        one, column = _odd_strided()
        t = one.clone() if g.rank else one  # rank 0 reduces the strided view itself
        await aiodist.all_reduce(t, group=g)
        objs = await aiodist.all_gather_object(column, group=g)
        if g.rank == 0:
            await aiodist.isend(one, dst=1, group=g)
            return t.tolist(), [o.tolist() for o in objs]
        got = torch.zeros(1, dtype=torch.bfloat16)
        await aiodist.irecv(got, src=0, group=g)
        return t.tolist(), [o.tolist() for o in objs], got.tolist()

    with anyio.fail_after(20):
        outs = await run_ranks(server.address, 2, body)
    assert outs[0] == ([7.0], [[[2.0]], [[2.0]]])
    assert outs[1] == ([7.0], [[[2.0]], [[2.0]]], [7.0])  # rank 0 sent its reduced view


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_sync_init_destroy_cycles_free_their_loops(tmp_path: Path) -> None:
    script = tmp_path / "cycles.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, gc, json, socket
            import psutil
            import aiodist.sync as dist

            def port():
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    return s.getsockname()[1]

            proc = psutil.Process()
            for i in range(400):
                if i == 50:
                    gc.collect()
                    base = proc.memory_info().rss
                dist.init_process_group(
                    init_method=f"tcp://127.0.0.1:{port()}", rank=0, world_size=1
                )
                dist.destroy_process_group()
            gc.collect()
            loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]
            growth = (proc.memory_info().rss - base) / 2**20
            print(json.dumps({"loops": len(loops), "growth_mib": growth, "fds": proc.num_fds()}))
            """
        )
    )
    done = await run([sys.executable, str(script)], limit=120, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    (report,) = json_lines(done.stdout)
    assert report["loops"] <= 1, report  # was one per cycle, each with its listener
    assert report["growth_mib"] < 30, report  # was about 0.25 MiB a cycle: 87 MiB here
    assert report["fds"] < 32, report


STOPPED = """
import asyncio, json, os
import torch, aiodist

async def main():
    await aiodist.init_process_group()
    rank = aiodist.get_rank()
    t = torch.ones(2)
    await aiodist.all_reduce(t)
    print(json.dumps({"pid": os.getpid(), "ready": rank}), flush=True)
    try:
        if rank == 1:
            os.kill(os.getpid(), 19)  # SIGSTOP: the test resumes it after its peer is done
            await aiodist.irecv(torch.zeros(1), src=0, tag=5)  # rank 0 sends nothing more
        else:
            await aiodist.all_reduce(t)  # rank 1 stopped: the server declares it failed
        outcome = {"ok": True}
    except aiodist.RankFailedError as exc:
        outcome = {"error": str(exc), "blamed": exc.rank}
    print(json.dumps({"rank": rank, **outcome}), flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_rank_resumed_after_being_declared_failed_blames_itself(tmp_path: Path) -> None:
    script = tmp_path / "stopped.py"
    script.write_text(STOPPED)
    env = _env(AIODIST_HEARTBEAT_INTERVAL="0.2", AIODIST_HEARTBEAT_TIMEOUT="1")
    argv = [sys.executable, "-m", "aiodist", "run", "-n", "2", "--no-prefix", str(script)]
    out = bytearray()
    with anyio.fail_after(60):
        async with await open_process(argv, env=env) as proc:
            try:
                assert proc.stdout is not None
                pids: dict[int, int] = {}
                reports: dict[int, dict[str, Any]] = {}
                async for chunk in proc.stdout:
                    out += chunk
                    for r in json_lines(out[: out.rfind(b"\n") + 1].decode()):
                        if "ready" in r:
                            pids[r["ready"]] = r["pid"]
                        elif "rank" in r:
                            reports[r["rank"]] = r
                    if 0 in reports and 1 in pids and 1 not in reports:
                        # Rank 0 was told rank 1 failed and is done: wake rank 1 up.
                        os.kill(pids[1], signal.SIGCONT)
                        pids.pop(1)
                await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                for pid in pids.values():
                    with _gone():
                        os.kill(pid, signal.SIGKILL)
    assert reports[0]["blamed"] == 1, reports
    assert reports[1]["blamed"] == 1, reports  # itself, not rank 0 that left after
    assert "this rank (1" in reports[1]["error"], reports
    assert "declared failed" in reports[1]["error"], reports


class _gone:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is ProcessLookupError


def test_collect_results_parts_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    part = tmp_path / "shared" / "part_0.pkl"
    old = os.umask(0)
    try:
        write_private(str(part), b"results")
        assert stat.S_IMODE(part.stat().st_mode) == 0o600
        assert stat.S_IMODE(part.parent.stat().st_mode) == 0o700
        part.chmod(0o666)  # a part an earlier run left behind
        write_private(str(part), b"again")
    finally:
        os.umask(old)
    assert stat.S_IMODE(part.stat().st_mode) == 0o600
    assert part.read_bytes() == b"again"
    link = tmp_path / "shared" / "part_1.pkl"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match=r"symbolic|Too many levels"):
        write_private(str(link), b"x")
    assert not (tmp_path / "elsewhere").exists()
