"""A rank that dies in the middle of the job, in real processes.

The rendezvous server runs in the test's own loop (the ``server`` fixture); the
ranks are subprocesses, so one can really die (``os._exit``) while the others
are inside a collective with it.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from tests.helpers import ROOT
from tests.helpers.procs import reports_by_rank, run, run_job
from tests.helpers.warm import open_process

if TYPE_CHECKING:
    from pathlib import Path

    from aiodist import RendezvousServer

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    import anyio, torch
    import aiodist

    async def main() -> None:
        url, rank, world, victim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        await aiodist.init_process_group(init_method=url, world_size=world, rank=rank,
                                         group_name="faults", heartbeat_interval=0.1,
                                         heartbeat_timeout=2.0)
        t = torch.ones(1 << 18)
        await aiodist.all_reduce(t)  # every rank completes one collective
        # ...before the victim may die: its last bytes could still be on their way
        # when the server's notice of its death arrives, and the notice wins.
        await aiodist.barrier()
        out = {"rank": rank, "pid": os.getpid(), "first": float(t[0])}
        mode = os.environ.get("FAULT_MODE", "exit")
        ops = [
            ("all_reduce", lambda: aiodist.all_reduce(torch.ones(1 << 24))),  # 64 MiB
            ("all_gather_object", lambda: aiodist.all_gather_object({"rank": rank})),
        ]
        if mode == "gather":  # the victim dies in the middle of an object gather
            ops.reverse()
        if str(rank) == victim:
            print(json.dumps(out), flush=True)
            if mode == "gather":
                aiodist.all_gather_object(b"x" * (8 << 20))  # starts sending 8 MiB...
                await anyio.sleep(0)  # ...one loop turn in, then dies
                os._exit(17)
            if mode == "stop":  # a frozen host: connections stay open, heartbeats stop
                os.kill(os.getpid(), signal.SIGSTOP)
            os._exit(17)  # dies while the others are inside the next collective
        for name, start in ops:
            try:
                await start()
                out[name] = "completed"
            except aiodist.DistError as exc:
                out[name] = [type(exc).__name__, getattr(exc, "rank", None),
                             getattr(exc, "host", None), getattr(exc, "pid", None), str(exc)]
        print(json.dumps(out), flush=True)
        await aiodist.destroy_process_group()

    anyio.run(main)
    """
)


async def _run_rank(
    script: Path, url: str, rank: int, world: int, victim: int, env: dict[str, str]
) -> dict[str, Any]:
    args = [sys.executable, str(script), url, str(rank), str(world), str(victim)]
    result = await run(args, limit=60, env=env)
    lines = result.stdout.strip().splitlines()
    assert lines, result.stderr
    out: dict[str, Any] = json.loads(lines[-1])
    out["returncode"] = result.returncode
    return out


@pytest.mark.parametrize("path", ["shm", "ring"])  # same-host shared memory, or sockets
@pytest.mark.parametrize(("world", "victim"), [(3, 1), (4, 0)])
async def test_rank_dying_mid_collective_fails_survivors_with_its_rank(
    server: RendezvousServer, tmp_path: Path, world: int, victim: int, path: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    outs: dict[int, dict[str, Any]] = {}

    async def one(rank: int) -> None:
        env = {"AIODIST_SHM": "1" if path == "shm" else "0"}
        outs[rank] = await _run_rank(script, url, rank, world, victim, env)

    # The operation's own timeout is the 30-minute default: only failure detection
    # (a dropped data-plane connection or missed heartbeats) can end this in time.
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for rank in range(world):
                tg.start_soon(one, rank)

    dead = outs[victim]
    assert dead["returncode"] == 17
    for rank, out in outs.items():
        assert out["first"] == float(world)
        if rank == victim:
            continue
        assert out["returncode"] == 0
        for name in ("all_reduce", "all_gather_object"):
            kind, failed_rank, host, pid, message = out[name]
            assert kind == "RankFailedError", out
            assert failed_rank == victim
            assert f"rank {victim}" in message
            # The server's notice names the host and pid; a dropped peer connection
            # that wins the race may know only the rank.
            assert pid in (dead["pid"], 0)
            assert isinstance(host, str)


JOINER = textwrap.dedent(
    """
    import json, sys
    import anyio
    import aiodist

    async def main() -> None:
        url, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        try:
            await aiodist.init_process_group(init_method=url, world_size=world, rank=rank,
                                             group_name="forming", timeout=4.0)
            print(json.dumps({"joined": True}), flush=True)
        except aiodist.DistError as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)

    anyio.run(main)
    """
)


async def test_rank_dying_during_rendezvous_leaves_a_clear_timeout(
    server: RendezvousServer, tmp_path: Path
) -> None:
    # World of 3: rank 0 waits, rank 2 joins and is killed before the job forms,
    # rank 1 never comes. Rank 0 must not wait forever nor count the dead rank.
    script = tmp_path / "joiner.py"
    script.write_text(JOINER)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    args = [sys.executable, str(script), url]
    with anyio.fail_after(60):
        async with await open_process([*args, "0", "3"]) as waiter:
            async with await open_process([*args, "2", "3"]) as victim:
                await server.wait_for_members("forming", 2)
                victim.kill()
                await victim.wait()
            await server.wait_until(
                lambda s: [m.requested_rank for m in s.state.jobs["forming"].members] == [0]
            )
            assert waiter.stdout is not None
            out = json.loads(await waiter.stdout.receive())
            assert await waiter.wait() == 0
    assert out["error"] == "RendezvousTimeout"
    assert "1 of 3 members joined (rank 0)" in out["message"]
    assert server.state.jobs == {}  # the forming job's state was dropped


@pytest.mark.parametrize("mode", ["gather", "stop"])
async def test_rank_dying_mid_gather_or_freezing_fails_survivors(
    server: RendezvousServer, tmp_path: Path, mode: str
) -> None:
    # "gather": the victim dies a loop turn into sending its part of an object gather.
    # "stop": SIGSTOP, as a host that drops off the network: only heartbeats tell.
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    env = {**os.environ, "FAULT_MODE": mode}
    outs: dict[int, dict[str, Any]] = {}

    async def survivor(rank: int) -> None:
        outs[rank] = await _run_rank(script, url, rank, 3, 2, {"FAULT_MODE": mode})

    args = [sys.executable, str(script), url, "2", "3", "2"]
    with anyio.fail_after(90):
        async with await open_process(args, env=env) as victim:
            try:
                async with anyio.create_task_group() as tg:
                    for rank in (0, 1):
                        tg.start_soon(survivor, rank)
            finally:
                if victim.returncode is None:
                    victim.kill()  # a frozen victim never exits by itself
                await victim.wait()
    for rank in (0, 1):
        gather, after = outs[rank]["all_gather_object"], outs[rank]["all_reduce"]
        if mode == "gather" and gather == "completed":
            pass  # the victim's whole part reached this rank before it died: a valid gather
        else:
            assert tuple(gather[:2]) == ("RankFailedError", 2), outs[rank]
        assert tuple(after[:2]) == ("RankFailedError", 2), outs[rank]
        if mode == "stop":
            assert "heartbeat" in gather[4], outs[rank]


PAIR_WORKER = textwrap.dedent(
    """
    import os, signal, sys
    import anyio
    from aiodist import open_process_group

    async def main() -> None:
        url = sys.argv[1]
        passed = []

        async def member(rank: int) -> None:
            async with open_process_group(url, world_size=3, rank=rank, group_name="pair",
                                          heartbeat_interval=0.1, heartbeat_timeout=1.0) as g:
                await g.session.barrier()
                passed.append(rank)
                if len(passed) == 2:  # both ranks of this process are in: freeze it
                    os.kill(os.getpid(), signal.SIGSTOP)
                await anyio.sleep_forever()

        async with anyio.create_task_group() as tg:
            tg.start_soon(member, 0)
            tg.start_soon(member, 1)

    anyio.run(main)
    """
)


async def test_a_frozen_process_fails_every_rank_it_hosts(
    server: RendezvousServer, tmp_path: Path
) -> None:
    # Ranks 0 and 1 share their process's control connection, and so its heartbeats:
    # when the process freezes, the server declares both failed; rank 2 is told.
    from aiodist import RankFailedError, open_process_group

    script = tmp_path / "pair.py"
    script.write_text(PAIR_WORKER)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    with anyio.fail_after(60):
        async with await open_process([sys.executable, str(script), url]) as pair:
            try:
                async with open_process_group(
                    url,
                    world_size=3,
                    rank=2,
                    group_name="pair",
                    heartbeat_interval=0.1,
                    heartbeat_timeout=1.0,
                ) as g:
                    await g.session.barrier()
                    assert server.num_connections == 2  # one per process
                    # The server's notice breaks the group that holds them (the store goes on).
                    await g.session.trouble()
                    assert isinstance(g.error, RankFailedError)
                    assert "missed heartbeats" in str(g.error)
                    assert g.error.rank in (0, 1)
                    await server.wait_until(lambda s: s.state.stats.failures == 2)
            finally:
                pair.kill()  # a frozen process never exits by itself
                await pair.wait()


STALLED_HOST = str(ROOT / "tests" / "helpers" / "stalled_host_worker.py")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the ranks run their own loops
async def test_a_rank_that_dies_just_after_its_hosts_loop_stood_still_fails_alone() -> None:
    # Rank 0 hosts the server and blocks its loop past STALL_GAP: the server stood still
    # with it, and counts rank 2's connection, lost right after, as reconnecting (its
    # verdict comes a re-attach window later). Rank 0, finding rank 2 unreachable, waits
    # for that verdict instead of giving up after the heartbeat timeout and breaking its
    # whole session: only what needs rank 2 fails, and rank 0 and rank 1 go on.
    ranks = await run_job(
        [sys.executable, STALLED_HOST], 3, limit=90, env={"AIODIST_HEARTBEAT_TIMEOUT": "5"}
    )
    reports: dict[int, dict[str, Any]] = {}
    for finished in ranks:
        reports.update(reports_by_rank(finished.stdout))
    assert 0 in reports, ranks[0].stderr[-3000:]
    error = reports[0]["error"]
    assert error.startswith("RankFailedError: rank 2 "), error
    assert "Other ranks, groups without it and the store go on" in error, error
    assert reports[0]["back"] == 42.0
    assert reports[1]["got"] == 41.0
    assert ranks[2].returncode == 9


LATE = textwrap.dedent(
    """
    import json, os, sys
    import anyio, torch
    import aiodist

    async def main() -> None:
        await aiodist.init_process_group(timeout=2)
        rank = aiodist.get_rank()
        out = {"rank": rank}
        await aiodist.all_reduce(torch.ones(2))  # every rank: the board is open
        out["board"] = type(aiodist.get_default_group().rows).__name__
        if rank == 2:
            # Busy on the loop's own thread past the others' timeout: it hears of
            # nothing until it has made the call (here, until both gave up on it).
            told = b""
            while len(told) < 2:
                with open(os.environ["LATE_FIFO"], "rb") as fifo:
                    told += fifo.read()
        t = torch.full((2,), float(rank + 1))
        try:
            await aiodist.all_reduce(t)
            out["late"] = t.tolist()
        except aiodist.DistError as exc:
            out["late"] = f"{type(exc).__name__}: {exc}"
        if rank != 2:
            with open(os.environ["LATE_FIFO"], "wb") as fifo:
                fifo.write(b"x")
        print(json.dumps(out), flush=True)
        await aiodist.destroy_process_group()

    anyio.run(main)
    """
)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the ranks run their own loops
async def test_a_call_that_timed_out_on_the_board_fails_on_the_rank_that_makes_it_late(
    tmp_path: Path,
) -> None:
    # Before: ranks 0 and 1 timed out waiting for rank 2 in an all_reduce on the shared
    # memory board, and rank 2, making the call later, found both their rows still
    # there and completed it with their data, the sum [6.0, 6.0]: one call, a result on
    # one rank and DistTimeoutError on the others. Over sockets rank 2 failed too.
    script = tmp_path / "late.py"
    script.write_text(LATE)
    fifo = tmp_path / "late.fifo"
    os.mkfifo(fifo)
    ranks = await run_job([sys.executable, str(script)], 3, limit=60, env={"LATE_FIFO": str(fifo)})
    reports: dict[int, dict[str, Any]] = {}
    for finished in ranks:
        assert finished.returncode == 0, finished.stderr[-3000:]
        reports.update(reports_by_rank(finished.stdout))
    for rank in range(3):
        assert reports[rank]["board"] == "Board", reports[rank]
        late = reports[rank]["late"]
        assert isinstance(late, str), (rank, late)  # not the sum of the others' rows
        assert late.startswith("DistTimeoutError: "), (rank, late)
        assert "all_reduce" in late, (rank, late)
