"""Same-host shared memory: agreement between ranks, segment hygiene, the ring channel.

Multi-process tests run real ranks as subprocesses against the test's own
rendezvous server (the ``server`` fixture), so each rank has its own
environment (``AIODIST_SHM``) and can really die.
"""

from __future__ import annotations

import os
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from aiodist._transport import shm, shmrows
from tests.helpers.workers import run_worker

if TYPE_CHECKING:
    from pathlib import Path

    from aiodist import RendezvousServer

needs_shm = pytest.mark.skipif(not shm.available(), reason="needs Linux and a writable /dev/shm")
# Subprocess ranks run their own loops: the test's loop only waits, so one backend will do.
one_backend = pytest.mark.parametrize("anyio_backend", ["asyncio"])

MIXED_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import anyio, torch
    import aiodist
    from aiodist._group.world import get_default_group

    async def main() -> None:
        url, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        await aiodist.init_process_group(init_method=url, world_size=world, rank=rank,
                                         group_name="mixed", timeout=30)
        t = torch.arange(1 << 20, dtype=torch.float32) * (rank + 1)    # 4 MiB
        await aiodist.all_reduce(t)
        b = torch.full((1 << 19,), float(rank))                         # 2 MiB
        await aiodist.broadcast(b, src=1)
        plane = get_default_group().session.plane
        expected = torch.arange(1 << 20, dtype=torch.float32) * (world * (world + 1) / 2)
        out = {"rank": rank, "all_reduce_ok": bool(torch.equal(t, expected)),
               "broadcast_ok": bool(torch.all(b == 1.0)),
               "agreed": plane.shm_agreement.get(0)}
        await aiodist.destroy_process_group()
        print(json.dumps(out), flush=True)

    anyio.run(main)
    """
)


@needs_shm
@pytest.mark.slow
@one_backend
@pytest.mark.parametrize("off", [[], [1], [0, 2]], ids=["all-on", "rank1-off", "ranks02-off"])
async def test_shm_setting_mixed_across_ranks_falls_back_everywhere(
    server: RendezvousServer, tmp_path: Path, off: list[int]
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(MIXED_WORKER)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    world = 3
    outs: dict[int, dict[str, Any]] = {}

    async def one(rank: int) -> None:
        env = {"AIODIST_SHM": "0" if rank in off else "1"}
        outs[rank] = await run_worker(script, [url, str(rank), str(world)], env)

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for rank in range(world):
                tg.start_soon(one, rank)
    for rank, out in outs.items():
        assert out["returncode"] == 0, out
        assert out["all_reduce_ok"], out
        assert out["broadcast_ok"], out
        # Ranks with shared memory on learn the group's answer; those with it off never ask.
        assert out["agreed"] == (None if rank in off else not off), out


# --- segment hygiene ------------------------------------------------------------------------


def _segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(shm.SHM_DIR, name))


@needs_shm
def test_segments_are_private_to_their_user_whatever_the_umask() -> None:
    old = os.umask(0)
    try:
        seg = shm.create_segment(1 << 20)
    finally:
        os.umask(old)
    try:
        st = os.stat(os.path.join(shm.SHM_DIR, seg.name))
        assert st.st_mode & 0o777 == 0o600
        assert st.st_uid == os.getuid()
        assert seg.name.startswith(shm.segment_prefix())
    finally:
        seg.close()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, seg.name))


LEAKER = textwrap.dedent(
    """
    import os, sys
    from aiodist._transport import shm
    shm.SHM_DIR = sys.argv[1]  # the test's own directory (see below)
    seg = shm.create_segment(1 << 20)
    print(seg.name, flush=True)
    os._exit(0)  # no cleanup: as if killed
    """
)


@needs_shm
@one_backend
async def test_next_start_removes_segments_of_dead_processes_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiodist._plane.peers import DataPlane

    # Segments in a directory of this test's own: ranks that other tests start at the same
    # time sweep /dev/shm too, and could remove the dead process's file before this test looks.
    segments = tmp_path / "shm"
    segments.mkdir()
    monkeypatch.setattr(shm, "SHM_DIR", str(segments))
    script = tmp_path / "leaker.py"
    script.write_text(LEAKER)
    with anyio.fail_after(60):
        result = await anyio.run_process([sys.executable, str(script), str(segments)])
    stale = result.stdout.decode().strip()
    assert _segment_exists(stale), "the dead process left no segment to clean up"
    live = shm.create_segment(1 << 20)  # this process is alive: its file must stay
    try:
        DataPlane("next-job")  # a new rank starting on this host
        assert not _segment_exists(stale)
        assert _segment_exists(live.name)
    finally:
        live.close()


async def _three_with_a_victim(
    server: RendezvousServer, tmp_path: Path, source: str, victim: int
) -> dict[int, dict[str, Any]]:
    """Run ``source`` as 3 ranks of one job at ``server``, shared memory on (its argv: the
    server's URL, the rank, the world size, ``victim``); each rank's report."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    outs: dict[int, dict[str, Any]] = {}

    async def one(rank: int) -> None:
        args = [url, str(rank), "3", str(victim)]
        outs[rank] = await run_worker(script, args, {"AIODIST_SHM": "1"})

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for rank in range(3):
                tg.start_soon(one, rank)
    return outs


KILLED_WORKER = textwrap.dedent(
    """
    import glob, json, os, signal, sys
    import anyio, torch
    import aiodist
    from aiodist._transport import shm

    async def main() -> None:
        url, rank, world, victim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        await aiodist.init_process_group(init_method=url, world_size=world, rank=rank,
                                         group_name="killed", heartbeat_interval=0.1,
                                         heartbeat_timeout=2.0)
        out = {"rank": rank, "pid": os.getpid()}
        w = aiodist.all_reduce(torch.ones(1 << 24))  # 64 MiB, through shared memory
        if rank == victim:
            pattern = f"{shm.SHM_DIR}/{shm.segment_prefix()}*"
            with anyio.fail_after(30):
                while not glob.glob(pattern):  # die once this rank's segment exists
                    await anyio.sleep(0.001)
            out["segments"] = [os.path.basename(p) for p in glob.glob(pattern)]
            print(json.dumps(out), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            await w
            out["all_reduce"] = "completed"
        except aiodist.DistError as exc:
            out["all_reduce"] = [type(exc).__name__, getattr(exc, "rank", None)]
        await aiodist.destroy_process_group()
        print(json.dumps(out), flush=True)

    anyio.run(main)
    """
)


@needs_shm
@pytest.mark.slow
@one_backend
async def test_rank_killed_mid_shared_all_reduce_leaves_no_segment(
    server: RendezvousServer, tmp_path: Path
) -> None:
    victim = 1
    outs = await _three_with_a_victim(server, tmp_path, KILLED_WORKER, victim)
    assert outs[victim]["returncode"] == -9
    assert outs[victim]["segments"], "the victim died before making its segment"
    for rank, out in outs.items():
        if rank != victim:
            assert out["returncode"] == 0, out
            assert out["all_reduce"] == ["RankFailedError", victim], out
    left = [
        name
        for name in os.listdir(shm.SHM_DIR)
        for out in outs.values()
        if name.startswith(shm.segment_prefix(out["pid"]))
    ]
    assert left == []


SWEPT_WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    import anyio, torch
    import aiodist
    from aiodist._transport import shm, shmrows

    async def main() -> None:
        url, rank, world, victim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        await aiodist.init_process_group(init_method=url, world_size=world, rank=rank,
                                         group_name="swept", heartbeat_interval=0.1,
                                         heartbeat_timeout=2.0)
        g = aiodist.get_default_group()
        # Every pair connected (point to point: the board is not decided yet).
        for peer in range(world):
            if peer != rank:
                got = torch.empty(1)
                await aiodist.send(torch.ones(1), dst=peer) if rank < peer else None
                await aiodist.recv(got, src=peer)
                await aiodist.send(torch.ones(1), dst=peer) if rank > peer else None
        if rank == victim:
            await g.store.set("victim", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped, then killed: never runs again
        pid = int(await g.store.get("victim"))
        with open(f"/proc/{pid}/stat", "rb") as f:  # the victim is stopped before it is swept
            while f.read().rpartition(b")")[2].split()[0] != b"T":
                f.seek(0)
                await anyio.sleep(0.01)
        if rank == 0:  # as a survivor sweeps the segment of a rank that died
            table = await g.session.plane.addresses()
            os.unlink(os.path.join(shm.SHM_DIR, shmrows.name_in(table[victim])))
            await g.store.set("swept", "1")
        await g.store.get("swept")
        out = {"rank": rank}
        try:
            await aiodist.barrier()  # the first small collective: the board is decided now
            out["barrier"] = "completed"
        except Exception as exc:
            out["barrier"] = [type(exc).__name__, getattr(exc, "rank", None)]
        if rank == 0:
            os.kill(pid, signal.SIGKILL)
        print(json.dumps(out), flush=True)
        os._exit(0)

    anyio.run(main)
    """
)


@needs_shm
@pytest.mark.skipif(not shmrows.supported(), reason="the board needs x86-64 and /dev/shm")
@one_backend
async def test_a_peer_whose_rows_segment_was_swept_fails_the_board_as_a_failed_rank(
    server: RendezvousServer, tmp_path: Path
) -> None:
    # A rank dies before a group's first small collective, and a survivor that heard of
    # it first sweeps its rows segment: a rank that had not heard yet maps the segment
    # as it decides the board. It must fail naming the rank, as a send to it would, not
    # with the FileNotFoundError of a file that is gone.
    victim = 2
    outs = await _three_with_a_victim(server, tmp_path, SWEPT_WORKER, victim)
    assert outs[victim]["returncode"] == -9, outs
    for rank in range(victim):
        assert outs[rank]["barrier"] == ["RankFailedError", victim], outs


# --- the ring channel on the data plane -----------------------------------------------------


@needs_shm
async def test_same_host_peers_exchange_large_tensors_through_rings(
    server: RendezvousServer,
) -> None:
    import torch

    import aiodist
    from aiodist._transport.shmring import ShmChannel
    from aiodist.testing import run_ranks

    numel = 4 << 20  # 16 MiB each way at once: both rings wrap, neither waits on the other

    async def body(g: aiodist.ProcessGroup) -> tuple[bool, str]:
        peer = 1 - g.rank
        mine = torch.arange(numel, dtype=torch.float32) + g.rank
        got = torch.empty(numel)
        w = aiodist.irecv(got, peer, group=g)
        await aiodist.isend(mine, peer, group=g)
        await w
        expected = torch.arange(numel, dtype=torch.float32) + peer
        channel = g.session.plane.routes[peer]
        return bool(torch.equal(got, expected)), type(channel).__name__

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [(True, ShmChannel.__name__)] * 2


@needs_shm
async def test_shm_off_keeps_plain_unix_socket_channels(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import aiodist
    from aiodist._transport.stream import StreamChannel
    from aiodist.testing import run_ranks

    monkeypatch.setenv("AIODIST_SHM", "0")

    async def body(g: aiodist.ProcessGroup) -> tuple[float, type]:
        t = torch.full((1 << 20,), float(g.rank + 1))
        await aiodist.all_reduce(t, group=g)
        return float(t[0]), type(g.session.plane.routes[1 - g.rank])

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [(3.0, StreamChannel)] * 2


@needs_shm
@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_all_gather_through_shared_segments_matches_torch(
    server: RendezvousServer, world_size: int
) -> None:
    import glob

    import torch

    import aiodist
    from aiodist.testing import run_ranks

    async def body(g: aiodist.ProcessGroup) -> list[torch.Tensor]:
        outs = []
        for k in range(2):  # the second call reuses the segments mapped by the first
            x = torch.arange(1 << 18, dtype=torch.float64).view(512, 512) * (g.rank + 1) + k
            outs += await aiodist.all_gather(x.t(), group=g)  # non-contiguous input
        return outs

    with anyio.fail_after(60):
        results = await run_ranks(server.address, world_size, body)
    base = torch.arange(1 << 18, dtype=torch.float64).view(512, 512)
    expected = [(base * (r + 1) + k).t() for k in range(2) for r in range(world_size)]
    for outs in results:
        assert len(outs) == len(expected)
        for got, want in zip(outs, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not glob.glob(f"{shm.SHM_DIR}/{shm.segment_prefix()}*"), "segments left behind"


@needs_shm
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
async def test_reduce_scatter_through_shared_segments_matches_torch(
    server: RendezvousServer, world_size: int, op: str
) -> None:
    import glob

    import torch

    import aiodist
    from aiodist.testing import run_ranks

    def inputs(rank: int, k: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(100 * k + rank)
        return [torch.randn(384, 512, generator=gen) for _ in range(world_size)]  # 768 KiB each

    async def body(g: aiodist.ProcessGroup) -> tuple[list[torch.Tensor], bool]:
        outs = []
        for k in range(2):  # the second call reuses the segments mapped by the first
            parts = [x.t().contiguous().t() for x in inputs(g.rank, k)]  # non-contiguous
            outs.append(await aiodist.reduce_scatter(parts, op=op, group=g))
        return outs, g.group_id in g.session.plane.segments._own

    with anyio.fail_after(60):
        results = await run_ranks(server.address, world_size, body)
    for rank, (outs, used_segment) in enumerate(results):
        assert used_segment
        for k, got in enumerate(outs):
            stacked = torch.stack([inputs(r, k)[rank] for r in range(world_size)])
            want = {
                "max": stacked.max(dim=0).values,
                "sum": stacked.sum(dim=0),
                "mean": stacked.sum(dim=0) / world_size,
            }[op]
            torch.testing.assert_close(got, want)
    assert not glob.glob(f"{shm.SHM_DIR}/{shm.segment_prefix()}*"), "segments left behind"


@needs_shm
async def test_reduce_scatter_sizes_that_pick_different_paths_raise_on_every_rank(
    server: RendezvousServer,
) -> None:
    import torch

    import aiodist
    from aiodist.testing import run_ranks

    async def body(g: aiodist.ProcessGroup) -> str:
        numel = 1 << 18 if g.rank else 1 << 10  # 2 MiB (shared memory) against 8 KiB (sockets)
        with pytest.raises(aiodist.CollectiveMismatchError) as info:
            await aiodist.reduce_scatter([torch.ones(numel)] * 2, group=g)
        return info.value.field

    with anyio.fail_after(20):
        assert await run_ranks(server.address, 2, body) == ["shape", "shape"]
