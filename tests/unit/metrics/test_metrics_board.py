"""Metric syncs on the shared board (ranks of one host): real clients, real server, real memory.

In-process tests run every rank as a task of one loop (``run_ranks``); the
multi-process ones run real ranks as subprocesses against the test's own
rendezvous server, so each rank has its own environment and can really die.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import pytest
import torch

import aiodist
from aiodist._group.work import Work
from aiodist._metrics import board, slots
from aiodist._transport import shm
from aiodist.metrics import MetricAggregator
from aiodist.testing import run_ranks
from tests.helpers.workers import run_worker

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from aiodist import ProcessGroup, RendezvousServer
    from aiodist.metrics import MetricResults

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs Linux and a writable /dev/shm")


def _updates(agg: MetricAggregator, rank: int, step: int) -> None:
    agg.update(rank + 1, loss=float(step + rank), grad=float(rank) if rank % 2 else math.nan)
    agg.update(tok=float(step), peak=float(rank * step))
    if (step + rank) % 3 == 0:  # keys that come and go, on some ranks only
        agg.update(**{f"extra{step % 2}": float(rank)})


async def _run(server: RendezvousServer, world: int, steps: int) -> list[list[dict[str, Any]]]:
    async def body(g: ProcessGroup) -> list[dict[str, Any]]:
        agg = MetricAggregator({"tok": "sum", "peak": "max"}, group=g)
        works = []
        for step in range(steps):
            _updates(agg, g.rank, step)
            works.append(agg.sync())
            await anyio.lowlevel.checkpoint()
        out = []
        for w in works:
            r = await w
            out.append({"values": r.to_dict(), "counts": r.counts, "nonfinite": r.nonfinite})
        assert (agg._board is not None) == (os.environ.get("AIODIST_METRICS_SHM") != "0")
        return out

    with anyio.fail_after(60):
        return await run_ranks(server.address, world, body)


async def test_board_and_sockets_give_bitwise_the_same_results(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIODIST_METRICS_SHM", "1")
    on_board = await _run(server, 3, 20)
    monkeypatch.setenv("AIODIST_METRICS_SHM", "0")
    on_sockets = await _run(server, 3, 20)
    # NaN != NaN: compare the JSON text, where NaN is spelled out.
    assert json.dumps(on_board) == json.dumps([on_board[0]] * 3)
    assert json.dumps(on_board) == json.dumps(on_sockets)
    assert on_board[0][0]["values"]["tok"] == 0.0
    assert on_board[0][5]["values"]["tok"] == 15.0  # 3 ranks x step 5
    assert on_board[0][5]["nonfinite"] == {"grad": 2}  # ranks 0 and 2 send NaN


def _single_update(agg: MetricAggregator, rank: int, step: int) -> None:
    """One update per sync, the per-step case: numbers and one-element tensors of any dtype."""
    bad = math.inf if (rank + step) % 4 == 0 else math.nan if (rank + step) % 5 == 0 else 0.5
    agg.update(
        rank + step,
        loss=torch.tensor(0.25 * rank - step, dtype=torch.float32),
        norm=torch.tensor([float(step * rank)], dtype=torch.float64),
        tokens=torch.tensor(rank + 7 * step),  # an integer tensor
        peak=float(rank * step) - 3,
        low=bad,
        lr=1e-3 * (step + 1),
        **({"rare": float(rank)} if step % 3 == rank % 3 else {}),  # keys that come and go
    )


async def _run_single(server: RendezvousServer, world: int, steps: int) -> list[list[str]]:
    async def body(g: ProcessGroup) -> list[str]:
        agg = MetricAggregator(
            {"tokens": "sum", "peak": "max", "low": "min", "lr": "last"}, group=g
        )
        works = []
        for step in range(steps):
            _single_update(agg, g.rank, step)
            works.append(agg.sync())
            if step == 0:
                await works[0]  # the board is set up: later syncs write from here
        out = []
        for w in works:
            r = await w
            # NaN != NaN: compare the JSON text, where NaN is spelled out.
            out.append(json.dumps([r.to_dict(), r.counts, r.nonfinite], sort_keys=True))
        assert bool(agg._singles) == (agg._board is not None)  # the single records were used
        if agg._board is not None:  # a board's handle sets every field a Work has itself
            work = agg.sync()
            assert isinstance(work, board.BoardWork)
            assert all(hasattr(work, name) for name in Work.__slots__)
            await work
        return out

    with anyio.fail_after(60):
        return await run_ranks(server.address, world, body)


async def test_one_update_per_sync_gives_bitwise_what_sockets_give(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync every step writes its update as it came (``record.Single``): same values."""
    monkeypatch.setenv("AIODIST_METRICS_SHM", "1")
    on_board = await _run_single(server, 3, 2 * board.BATCH + 3)
    monkeypatch.setenv("AIODIST_METRICS_SHM", "0")
    on_sockets = await _run_single(server, 3, 2 * board.BATCH + 3)
    assert on_board == [on_board[0]] * 3
    assert on_board == on_sockets
    values, counts, nonfinite = json.loads(on_board[0][4])
    assert values["tokens"] == 0 + 28 + 1 + 28 + 2 + 28  # ranks 0-2 at step 4
    assert counts["loss"] == 4 + 5 + 6  # rank + step, summed
    assert values["lr"] == pytest.approx(5e-3)  # rank 0's
    assert nonfinite == {"low": 2}  # ranks 0 (inf) and 1 (NaN) at step 4


async def test_records_a_rank_left_queued_reach_the_others(server: RendezvousServer) -> None:
    """Ranks 1 and 2 sync and then only wait for rank 0, which awaits the sync's values."""
    got_them = anyio.Event()

    async def body(g: ProcessGroup) -> float | None:
        agg = MetricAggregator({"x": "sum"}, group=g)
        agg.update(x=0.0)
        await agg.sync()  # the board is set up
        agg.update(x=float(g.rank + 1))
        work = agg.sync()
        if g.rank:
            await got_them.wait()
            return None
        assert agg._board is not None
        value = (await work)["x"]  # the others' pollers write what they left queued
        got_them.set()
        return value

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 3, body, timeout=20)
    assert outs == [6.0, None, None]


async def test_handles_nobody_holds_are_skipped_and_their_callbacks_still_run(
    server: RendezvousServer,
) -> None:
    """Most handles are dropped at once (a rank that only logs); rank 0 keeps a few and
    gives others only an on_done callback: the board holds those until they ran."""
    n = 3 * slots.DEPTH

    async def body(g: ProcessGroup) -> tuple[dict[int, float], list[tuple[int, float]]]:
        agg = MetricAggregator({"x": "sum"}, group=g)
        agg.update(x=0.0)
        await agg.sync()  # the board is set up
        held: dict[int, Work[MetricResults]] = {}
        called: list[tuple[int, float]] = []
        last_ran = anyio.Event()

        def log(step: int) -> Callable[[MetricResults], None]:
            return lambda r: called.append((step, r["x"]))

        for step in range(n):
            agg.update(x=float(step))
            if step % 10 == 0:
                held[step] = agg.sync()
            elif step % 7 == 0 and g.rank == 0:
                agg.sync(on_done=log(step))
            else:
                agg.sync()
        agg.update(x=0.0)
        agg.sync(on_done=lambda _: last_ran.set())  # callbacks run in call order
        await last_ran.wait()
        return {step: (await w)["x"] for step, w in held.items()}, called

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 3, body)
    for values, _ in outs:
        assert values == {step: 3.0 * step for step in range(0, n, 10)}
    assert outs[0][1] == [(s, 3.0 * s) for s in range(n) if s % 7 == 0 and s % 10]
    assert outs[1][1] == outs[2][1] == []


async def test_more_syncs_in_flight_than_the_board_holds(server: RendezvousServer) -> None:
    """Fast ranks run 3 x DEPTH syncs ahead of a slow one: their writes queue, none is lost."""
    n = 3 * slots.DEPTH
    slow_may_go = anyio.Event()

    async def body(g: ProcessGroup) -> list[float]:
        agg = MetricAggregator({"step": "sum"}, group=g)
        agg.update(step=0.0)
        await agg.sync()  # the board is set up
        if g.rank == 1:
            await slow_may_go.wait()
        works = []
        for step in range(n):
            agg.update(step=float(step))
            works.append(agg.sync())
        if g.rank == 0:
            assert agg._board is not None
            b = agg._board
            assert len(b._backlog) + len(b._queued) >= n - slots.DEPTH  # the slow rank holds slots
            slow_may_go.set()
        return [(await w)["step"] for w in works]

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 3, body)
    assert outs == [[3.0 * step for step in range(n)]] * 3


@pytest.mark.parametrize("held", [True, False], ids=["awaited", "dropped"])
async def test_a_rank_that_stops_syncing_times_the_others_out(
    server: RendezvousServer, held: bool
) -> None:
    """Rank 1 stops syncing: rank 0's sync times out and breaks the group on both ranks,
    whether rank 0 awaits it or dropped its handle at once (then only its poller writes
    the record, and times it out)."""

    async def body(g: ProcessGroup) -> str:
        agg = MetricAggregator(group=g)
        agg.update(x=1.0)
        await agg.sync()
        if g.rank == 0:
            agg.update(x=2.0)
            work = agg.sync()
            if held:
                with pytest.raises(aiodist.DistTimeoutError, match=r"metrics\.sync.*timed out"):
                    await work
            del work
        with anyio.fail_after(30):
            await g.session.trouble()
        return type(g.error).__name__

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body, timeout=1.5)
    assert outs == ["DistTimeoutError", "DistTimeoutError"]


async def test_ranks_at_different_points_among_collectives_get_a_mismatch(
    server: RendezvousServer,
) -> None:
    """An all_reduce before the sync on rank 0 and after it on rank 1: both learn it."""

    async def body(g: ProcessGroup) -> tuple[str, dict[int, Any]]:
        agg = MetricAggregator({"x": "sum"}, group=g)
        agg.update(x=1.0)
        await agg.sync()  # the board is set up
        t = torch.ones(1)
        agg.update(x=2.0)
        if g.rank == 0:
            other = aiodist.all_reduce(t, group=g)  # takes a number before the sync ...
            work = agg.sync()
        else:
            work = agg.sync()
            other = aiodist.all_reduce(t, group=g)  # ... and after it here
        with pytest.raises(aiodist.CollectiveMismatchError, match="metrics sync") as caught:
            await work
        with pytest.raises(aiodist.DistError):
            await other  # never matched: it times out
        return caught.value.field, caught.value.values_by_rank

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body, timeout=1.5)
    assert outs[0] == outs[1]
    field, by_rank = outs[0]
    assert field == "seq"
    assert by_rank[0] == by_rank[1] + 1


async def test_too_many_metrics_for_one_slot_fail_on_every_rank(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> str:
        agg = MetricAggregator(group=g)
        agg.update(x=1.0)
        await agg.sync()
        n = 1 if g.rank else slots.MAX_RECORD_BYTES // 20  # rank 0 logs far too many
        agg.update(**{f"metric_{i:08d}": float(i) for i in range(n)})
        with pytest.raises(ValueError, match=r"rank 0 synced more metrics than fit") as caught:
            await agg.sync()
        agg.update(x=3.0)  # the board goes on
        assert (await agg.sync())["x"] == 3.0
        # Names alone longer than a slot (and than 64 KiB): the same error, on every rank.
        n = 1 if g.rank else 700
        agg.update(**{f"{'long_name_' * 10}{i:08d}": float(i) for i in range(n)})
        with pytest.raises(ValueError, match=r"rank 0 synced more metrics than fit"):
            await agg.sync()
        agg.update(x=4.0)
        assert (await agg.sync())["x"] == 4.0
        return str(caught.value)

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body)
    assert outs[0] == outs[1]


WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    import anyio
    import aiodist
    from aiodist.metrics import MetricAggregator

    async def main() -> None:
        url, rank, world, victim = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        await aiodist.init_process_group(init_method=url, world_size=world, rank=rank,
                                         group_name="board", timeout=30)
        agg = MetricAggregator({"n": "sum"})
        values = []
        for step in range(5):
            agg.update(n=float(rank + step))
            values.append((await agg.sync())["n"])
        out = {"rank": rank, "values": values, "board": agg._board is not None}
        if victim >= 0:
            await aiodist.barrier()
            if rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
            agg.update(n=1.0)
            try:
                await agg.sync()
                out["error"] = None
            except aiodist.DistError as exc:
                out["error"] = type(exc).__name__
                out["message"] = str(exc)
        await aiodist.destroy_process_group()
        print(json.dumps(out), flush=True)

    anyio.run(main)
    """
)


async def _run_workers(
    server: RendezvousServer, tmp_path: Path, world: int, victim: int, off: list[int]
) -> dict[int, dict[str, Any]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    outs: dict[int, dict[str, Any]] = {}

    async def one(rank: int) -> None:
        env = {"AIODIST_METRICS_SHM": "0" if rank in off else "1"}
        outs[rank] = await run_worker(script, [url, str(rank), str(world), str(victim)], env)

    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            for rank in range(world):
                tg.start_soon(one, rank)
    return outs


@pytest.mark.slow
async def test_syncs_of_ten_ranks_on_sockets_take_the_rounds_of_larger_groups(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # From 4 ranks on, a sync's rows travel in log2 rounds (and keys that come and go
    # make later syncs agree on keys again): every rank gets the same, right values.
    monkeypatch.setenv("AIODIST_METRICS_SHM", "0")
    out = await _run(server, 10, 6)
    assert json.dumps(out) == json.dumps([out[0]] * 10)
    for step in range(6):
        assert out[0][step]["values"]["tok"] == 10.0 * step
        assert out[0][step]["values"]["peak"] == 9.0 * step
        assert out[0][step]["counts"]["loss"] == sum(range(1, 11))  # ranks 0..9 weigh rank + 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the ranks run their own loops
@pytest.mark.parametrize("off", [[], [1]], ids=["all-on", "rank1-off"])
async def test_a_rank_without_the_board_sends_every_rank_to_sockets(
    server: RendezvousServer, tmp_path: Path, off: list[int]
) -> None:
    outs = await _run_workers(server, tmp_path, 3, -1, off)
    expected = [3.0 + 3 * step for step in range(5)]  # ranks 0, 1, 2 add rank + step
    for rank in range(3):
        assert outs[rank]["returncode"] == 0, outs[rank]
        assert outs[rank]["values"] == expected, outs[rank]
        assert outs[rank]["board"] == (not off), outs[rank]


async def test_syncs_a_rank_flushed_before_it_went_complete_on_the_others(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 flushes a sync and goes; rank 1 learns of its failure while its own record
    # of that sync is still queued (a step later than rank 0). The failure writes the
    # queued record before failing what is pending: the sync completes on rank 1.
    monkeypatch.setenv("AIODIST_METRICS_SHM", "1")
    flushed = anyio.Event()

    async def body(g: ProcessGroup) -> float:
        agg = MetricAggregator({"n": "sum"}, group=g)
        agg.update(n=0.0)
        await agg.sync()  # the board is set up on both
        agg.update(n=float(g.rank + 10))
        if g.rank == 0:
            work = agg.sync()
            await agg.flush()
            flushed.set()
        else:
            await flushed.wait()
            work = agg.sync()
            found = agg._board
            assert found is not None
            assert found._queued  # written only at the next look
            g.break_(aiodist.RankFailedError("rank 0 failed", rank=0), notify=False)
            found._poll()  # the poller's look: it finds the group broken
        return float((await work)["n"])

    with anyio.fail_after(30):
        assert await run_ranks(server.address, 2, body) == [21.0, 21.0]


async def test_after_a_member_failed_the_syncs_it_wrote_wait_for_the_live_ranks(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 flushes two syncs and fails; ranks 1 and 2 make theirs only after they heard,
    # rank 2 after rank 1 waits: both syncs still complete on both (every rank wrote them),
    # and the third, which rank 0 never made, fails on both at once.
    monkeypatch.setenv("AIODIST_METRICS_SHM", "1")
    flushed, made = anyio.Event(), anyio.Event()

    async def body(g: ProcessGroup) -> list[Any]:
        agg = MetricAggregator({"n": "sum"}, group=g)
        agg.update(n=0.0)
        await agg.sync()  # the board is set up on every rank
        if g.rank == 0:
            for _ in range(2):
                agg.update(n=1.0)
                agg.sync()
            await agg.flush()
            flushed.set()
            return []
        await flushed.wait()
        g.session.isolate_failure(0, "", 0, "gone in this test")
        if g.rank == 2:
            await made.wait()
        works = []
        for _ in range(3):
            agg.update(n=1.0)
            works.append(agg.sync())
        if g.rank == 1:
            made.set()
        out: list[Any] = []
        for w in works:
            try:
                out.append((await w)["n"])
            except aiodist.RankFailedError as exc:
                out.append(exc.rank)
        return out

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 3, body)
    assert outs[1:] == [[3.0, 3.0, 0], [3.0, 3.0, 0]]


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_rank_dying_fails_the_others_pending_syncs(
    server: RendezvousServer, tmp_path: Path
) -> None:
    victim = 2
    outs = await _run_workers(server, tmp_path, 3, victim, [])
    assert outs[victim]["returncode"] == -9
    for rank in (0, 1):
        out = outs[rank]
        assert out["returncode"] == 0, out
        assert out["board"], out
        assert out["error"] == "RankFailedError", out
        assert f"rank {victim}" in out["message"], out


async def _two_ranks(
    server: RendezvousServer, tmp_path: Path, source: str
) -> dict[int, dict[str, Any]]:
    """Run ``source`` as ranks 0 and 1 (url and rank as arguments); their last lines."""
    script = tmp_path / "worker2.py"
    script.write_text(source)
    url = f"tcp://{server.address[0]}:{server.address[1]}"
    outs: dict[int, dict[str, Any]] = {}

    async def one(rank: int) -> None:
        outs[rank] = await run_worker(script, [url, str(rank)], {"AIODIST_METRICS_SHM": "1"})

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for rank in range(2):
                tg.start_soon(one, rank)
    return outs


LEAVER = textwrap.dedent(
    """
    import json, sys
    import anyio
    import aiodist
    from aiodist.metrics import MetricAggregator

    async def main() -> None:
        url, rank = sys.argv[1], int(sys.argv[2])
        await aiodist.init_process_group(init_method=url, world_size=2, rank=rank,
                                         group_name="leaver", timeout=20)
        agg = MetricAggregator({"n": "sum"})
        agg.update(n=0.0)
        await agg.sync()  # the board is set up
        await aiodist.barrier()
        agg.update(n=float(rank + 10))
        work = agg.sync()  # queued on rank 1, which leaves at once
        out = {"rank": rank, "board": agg._board is not None}
        if rank == 0:
            out["n"] = (await work)["n"]
        await aiodist.destroy_process_group()
        print(json.dumps(out), flush=True)

    anyio.run(main)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the ranks run their own loops
async def test_a_rank_that_leaves_right_after_a_sync_writes_it_first(
    server: RendezvousServer, tmp_path: Path
) -> None:
    outs = await _two_ranks(server, tmp_path, LEAVER)
    assert outs[1]["returncode"] == 0, outs[1]
    assert outs[0] == {"rank": 0, "board": True, "n": 21.0, "returncode": 0}


AGAIN = textwrap.dedent(
    """
    import json, sys
    import anyio
    import aiodist
    from aiodist._group.world import get_default_group
    from aiodist.metrics import MetricAggregator

    async def main() -> None:
        url, rank = sys.argv[1], int(sys.argv[2])
        agg = MetricAggregator({"n": "sum"})  # on the default group, whichever it is
        out = []
        for round_ in range(2):
            await aiodist.init_process_group(init_method=url, world_size=2, rank=rank,
                                             group_name=f"again{round_}", timeout=20)
            for step in range(3):
                agg.update(n=float(rank + step + 10 * round_))
                out.append((await agg.sync())["n"])
            out.append(agg._board is not None and agg._board.group is get_default_group())
            await aiodist.destroy_process_group()
        print(json.dumps({"out": out}), flush=True)

    anyio.run(main)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the ranks run their own loops
async def test_an_aggregator_moves_to_a_new_default_group(
    server: RendezvousServer, tmp_path: Path
) -> None:
    outs = await _two_ranks(server, tmp_path, AGAIN)
    expected = [1.0, 3.0, 5.0, True, 21.0, 23.0, 25.0, True]
    assert outs[0] == {"out": expected, "returncode": 0}
    assert outs[1] == {"out": expected, "returncode": 0}


def _read(memory: slots.Slots, index: int) -> list[tuple[int, bytes | None]] | None:
    """Every rank's (seq, record) of sync ``index``, or None while one is missing."""
    if memory.complete() <= index:
        return None
    chunks = memory.copy(index, index + 1)
    return None if chunks is None else [chunk.record(index) for chunk in chunks]


def _record_at(memory: slots.Slots, index: int, rank: int) -> int:
    """Where ``rank``'s record of sync ``index`` (or its numbers) starts, once written."""
    mem, base = memory.memory, memory.slot(index, rank)
    rid = mem[base + slots._RUNS + index % slots.GROUP]
    kind, first, offset, size, _ = slots.RUN.unpack_from(
        mem, base + slots._TABLE + rid * slots.RUN.size
    )
    if kind == slots.VALUES:
        offset += ((index - first) & 0xFFFFFFFF) * size
    return base + slots._DATA + int(offset)


async def test_with_checksums_a_torn_slot_is_not_read(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where stores may be seen out of order (not x86), each slot carries a CRC."""
    monkeypatch.setattr(slots, "CHECKSUM", True)

    async def body(g: ProcessGroup) -> list[float]:
        agg = MetricAggregator({"x": "sum"}, group=g)
        sums = []
        for step in range(5):
            agg.update(x=float(step + g.rank))
            sums.append((await agg.sync())["x"])
        b = agg._board
        assert b is not None
        memory = b._slots
        assert _read(memory, 4) is not None  # sync 4, complete: every slot checks out
        data = _record_at(memory, 4, 1)
        memory.memory[data] ^= 0xFF  # rank 1's record of sync 4, torn
        torn = _read(memory, 4)
        memory.memory[data] ^= 0xFF
        assert torn is None
        assert _read(memory, 4) is not None
        return sums

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [[1.0, 3.0, 5.0, 7.0, 9.0]] * 2


async def test_boards_of_subgroups_and_of_two_aggregators_stay_apart(
    server: RendezvousServer,
) -> None:
    """Each aggregator has a board per group: interleaved syncs never see each other's slots."""

    async def body(world: ProcessGroup) -> tuple[list[float], list[float], list[float] | None]:
        low = await aiodist.new_group([0, 1, 2], parent=world)  # every rank calls new_group
        mine = world.rank if world.rank < 3 else None
        a = MetricAggregator({"x": "sum"}, group=world)
        b = MetricAggregator({"x": "sum"}, group=world)
        c = MetricAggregator({"x": "sum"}, group=low) if mine is not None else None
        got_a, got_b, got_c = [], [], []
        for step in range(6):
            a.update(x=float(step))
            b.update(x=100.0 * (world.rank + 1))
            wa, wb = a.sync(), b.sync()
            if c is not None:
                c.update(x=float(world.rank * step))
                got_c.append((await c.sync())["x"])
            got_a.append((await wa)["x"])
            got_b.append((await wb)["x"])
        assert a._board is not None
        assert b._board is not None
        assert a._board is not b._board
        if c is not None:
            assert c._board is not None
            assert c._board.group is low
        return got_a, got_b, got_c if c is not None else None

    with anyio.fail_after(60):
        outs = await run_ranks(server.address, 4, body)
    for rank, (got_a, got_b, got_c) in enumerate(outs):
        assert got_a == [4.0 * step for step in range(6)]
        assert got_b == [1000.0] * 6  # 100 * (1 + 2 + 3 + 4)
        assert got_c == (None if rank == 3 else [3.0 * step for step in range(6)])
