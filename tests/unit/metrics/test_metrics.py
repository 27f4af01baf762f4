"""aiodist.metrics: fused metric sync with real clients and the real server, in one loop."""

from __future__ import annotations

import json
import math
import random
import weakref
from typing import TYPE_CHECKING, Any

import anyio
import pytest
import torch

import aiodist
from aiodist.metrics import MetricAggregator, MetricResults, MetricsWriter
from aiodist.testing import run_ranks

if TYPE_CHECKING:
    from pathlib import Path

    from aiodist import ProcessGroup, RendezvousServer

REDUCTIONS = {"tok": "sum", "gmax": "max", "gmin": "min", "lr": "last"}


@pytest.fixture(params=["board", "sockets"], autouse=True)
def metrics_route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both routes: the shared board (one host) and the data plane."""
    monkeypatch.setenv("AIODIST_METRICS_SHM", "1" if request.param == "board" else "0")
    return str(request.param)


def _rank_updates(rank: int, round_: int) -> list[tuple[float, dict[str, Any]]]:
    """Uneven work per rank: rank r makes r + 2 updates, some metrics on some ranks only."""
    rng = random.Random(1000 * round_ + rank)
    out = []
    for i in range(rank + 2):
        weight = float(rng.randint(1, 9))
        values: dict[str, Any] = {
            "loss": rng.uniform(0, 3),
            "tok": torch.tensor([rng.uniform(0, 10) for _ in range(i + 1)]),
            "gmax": torch.tensor(rng.uniform(-5, 5)),
            "gmin": rng.uniform(-5, 5),
        }
        if rank % 2 == 0:
            values["acc"] = torch.tensor([rng.random() for _ in range(3)])
        if rank >= 1:
            values["lr"] = 0.1 * rank + i
        out.append((weight, values))
    return out


def _reference(world: int, round_: int) -> dict[str, tuple[float, float]]:
    """What the sync must give, computed from every rank's updates in plain Python."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    extremes: dict[str, float] = {}
    for rank in range(world):
        for weight, values in _rank_updates(rank, round_):
            for name, value in values.items():
                xs = value.tolist() if isinstance(value, torch.Tensor) else value
                xs = xs if isinstance(xs, list) else [xs]
                counts[name] = counts.get(name, 0.0) + weight * len(xs)
                if name in ("loss", "acc"):
                    sums[name] = sums.get(name, 0.0) + weight * sum(xs)
                elif name == "tok":
                    sums[name] = sums.get(name, 0.0) + sum(xs)
                elif name == "gmax":
                    extremes[name] = max([extremes.get(name, -math.inf), *xs])
                elif name == "gmin":
                    extremes[name] = min([extremes.get(name, math.inf), *xs])
    out = {}
    for name, count in counts.items():
        if name in ("loss", "acc"):
            out[name] = (sums[name] / count, count)
        elif name == "tok":
            out[name] = (sums[name], count)
        elif name in extremes:
            out[name] = (extremes[name], count)
        else:  # "last": the lowest rank's latest value
            out[name] = (_expected_last(world, round_), count)
    return out


def _expected_last(world: int, round_: int) -> float:
    for rank in range(world):
        ups = [v["lr"] for _, v in _rank_updates(rank, round_) if "lr" in v]
        if ups:
            return float(ups[-1])
    raise AssertionError("no rank updates lr")


def _check(results: MetricResults, world: int, round_: int) -> None:
    ref = _reference(world, round_)
    assert sorted(results) == sorted(ref)
    for name, (value, count) in ref.items():
        assert results[name] == pytest.approx(value, rel=1e-12), name
        assert results.counts[name] == pytest.approx(count), name
    assert results.nonfinite == {}


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 9, 17])  # 17: rounds past the star of 16
async def test_sync_matches_reference_with_uneven_counts_and_keys(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> list[MetricResults]:
        agg = MetricAggregator(REDUCTIONS, group=g)
        out = []
        for round_ in range(3):  # the key set agreed at round 0 is reused afterwards
            for weight, values in _rank_updates(g.rank, round_):
                agg.update(weight, **values)
            out.append(await agg.sync())
        return out

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, world_size, body)
    for per_rank in outs:
        for round_, results in enumerate(per_rank):
            _check(results, world_size, round_)
        assert [r.to_dict() for r in per_rank] == [r.to_dict() for r in outs[0]]


async def test_keys_that_appear_later_on_one_rank_are_reduced(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> list[dict[str, float]]:
        agg = MetricAggregator({"n": "sum"}, group=g)
        out = []
        for step in range(4):
            agg.update(loss=float(g.rank))
            if g.rank == 2 and step >= 2:
                agg.update(n=step)  # a new key on one rank, then the same one again
            if step == 3 and g.rank == 0:
                agg.update(eval_acc=0.5)
            out.append((await agg.sync()).to_dict())
        return out

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 3, body)
    expected = [
        {"loss": 1.0},
        {"loss": 1.0},
        {"loss": 1.0, "n": 2.0},
        {"loss": 1.0, "n": 3.0, "eval_acc": 0.5},
    ]
    assert outs == [expected] * 3


async def test_ranks_that_sync_at_call_time_and_ranks_that_queue_agree(
    server: RendezvousServer,
) -> None:
    # Rank 0 awaits every sync, so each later one starts at once from the known key set;
    # the others start them all before any finished, so theirs wait for their predecessor.
    async def body(g: ProcessGroup) -> list[dict[str, float]]:
        agg = MetricAggregator(REDUCTIONS, group=g)
        works = []
        for round_ in range(4):
            for weight, values in _rank_updates(g.rank, round_):
                agg.update(weight, **values)
            works.append(agg.sync())
            if g.rank == 0:
                await works[-1]
        return [(await w).to_dict() for w in works]

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 3, body)
    assert outs[1] == outs[0]
    assert outs[2] == outs[0]
    for round_, values in enumerate(outs[0]):
        ref = _reference(3, round_)
        assert values == pytest.approx({k: v for k, (v, _) in ref.items()}, rel=1e-12)


async def test_nan_and_inf_propagate_and_are_counted(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> MetricResults:
        agg = MetricAggregator({"peak": "max", "low": "min", "total": "sum"}, group=g)
        agg.update(loss=1.0, peak=float(g.rank), low=0.0, total=1.0, ok=2.0)
        if g.rank == 1:
            agg.update(loss=math.nan, peak=math.inf, total=torch.tensor([1.0, -math.inf]))
        if g.rank == 2:
            agg.update(low=torch.tensor([math.nan, 1.0]))
        return await agg.sync()

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 3, body)
    for r in outs:
        assert math.isnan(r["loss"])
        assert r["peak"] == math.inf
        assert math.isnan(r["low"])
        assert r["total"] == -math.inf
        assert r["ok"] == 2.0
        assert r.nonfinite == {"loss": 1, "peak": 1, "low": 1, "total": 1}
        assert "[non-finite: loss x1, low x1, peak x1, total x1]" in r.summary()


async def test_many_syncs_in_flight_resolve_in_order(server: RendezvousServer) -> None:
    n = 12

    async def body(g: ProcessGroup) -> list[dict[str, float]]:
        agg = MetricAggregator({"step": "max"}, group=g)
        works = []
        for step in range(n):
            agg.update(step=step, loss=float(step * g.world_size + g.rank))
            if step % 4 == 3:
                agg.update(**{f"extra{step}": float(g.rank)})  # key changes mid-flight
            works.append(agg.sync())
        # Another collective between them keeps its own place in the sequence.
        t = await aiodist.all_reduce(torch.ones(2), group=g)
        assert t.tolist() == [4.0, 4.0]
        return [(await w).to_dict() for w in works]

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 4, body)
    for step, got in enumerate(outs[0]):
        expected = {"step": float(step), "loss": step * 4 + 1.5}
        if step % 4 == 3:
            expected[f"extra{step}"] = 1.5
        assert got == expected
    assert outs == [outs[0]] * 4


async def test_on_done_and_every_call_back_without_awaiting(server: RendezvousServer) -> None:
    async def body(g: ProcessGroup) -> list[tuple[int, float]]:
        seen: list[tuple[int, float]] = []
        done = anyio.Event()

        def log(results: MetricResults) -> None:
            seen.append((len(seen), results["loss"]))

        agg = MetricAggregator(group=g, every=3, on_done=log)
        for step in range(9):
            agg.update(loss=float(step))
            started = agg.step()
            assert (started is None) == (step % 3 != 2)
        agg.update(loss=100.0)
        agg.sync(on_done=lambda r: done.set())
        await done.wait()  # the last callback fired: every earlier one too (chained)
        return seen

    with anyio.fail_after(30):
        outs = await run_ranks(server.address, 2, body)
    assert outs == [[(0, 1.0), (1, 4.0), (2, 7.0)]] * 2


async def test_failing_on_done_is_logged_and_the_work_still_resolves(
    server: RendezvousServer, caplog: pytest.LogCaptureFixture
) -> None:
    def bad(results: MetricResults) -> None:
        raise ValueError("logger down")

    async def body(g: ProcessGroup) -> float:
        agg = MetricAggregator(group=g)
        agg.update(loss=2.0)
        return (await agg.sync(on_done=bad))["loss"]

    with anyio.fail_after(30):
        assert await run_ranks(server.address, 2, body) == [2.0, 2.0]
    assert "on_done callback of a metrics sync raised" in caplog.text


@pytest.mark.parametrize("world_size", [2, 3])
async def test_different_reductions_for_one_metric_raise_on_every_rank(
    server: RendezvousServer, world_size: int
) -> None:
    async def body(g: ProcessGroup) -> BaseException | None:
        agg = MetricAggregator({"m": "max" if g.rank == 0 else "mean"}, group=g)
        agg.update(m=1.0)
        try:
            await agg.sync()
        except aiodist.DistError as exc:
            return exc
        return None

    with anyio.fail_after(30):
        errors = await run_ranks(server.address, world_size, body)
    for exc in errors:  # every rank names the same two ranks: the first and the first other
        assert isinstance(exc, aiodist.CollectiveMismatchError)
        assert exc.field == "reduction"
        assert exc.values_by_rank == {0: "max", 1: "mean"}


def test_not_initialised_resolves_to_local_values() -> None:
    agg = MetricAggregator({"n": "sum", "lr": "last"})
    agg.update(2, loss=1.0, n=3)
    agg.update(loss=torch.tensor([4.0, 7.0]), n=torch.tensor(1), lr=0.5)
    agg.update(lr=0.25)
    work = agg.sync()
    assert work.is_completed()
    results = work.wait()
    assert results.to_dict() == {"loss": (2 * 1.0 + 4.0 + 7.0) / 4, "n": 4.0, "lr": 0.25}
    assert results.counts == {"loss": 4.0, "n": 3.0, "lr": 2.0}  # weight 2, then 1
    assert agg.pending == []
    assert agg.sync().wait().to_dict() == {}


def test_a_lone_update_keeps_numbers_not_tensors_and_folds_into_later_ones() -> None:
    agg = MetricAggregator({"n": "sum"})
    loss = torch.tensor(2.0)
    alive = weakref.ref(loss)
    agg.update(4, loss=loss, n=3)
    del loss
    assert alive() is None  # read when updated; nothing keeps the tensor
    assert agg.pending == ["loss", "n"]
    with pytest.raises(TypeError, match="metric 'name' must be a number or a tensor"):
        agg.update(loss=1.0, name="x")
    assert agg.pending == ["loss", "n"]  # the first update is neither lost nor added twice
    agg.update(loss=torch.tensor([5.0, 8.0]), n=1)
    results = agg.sync().wait()
    assert results.to_dict() == {"loss": (4 * 2.0 + 5.0 + 8.0) / 6, "n": 4.0}
    assert results.counts == {"loss": 6.0, "n": 5.0}
    agg.update(x=1.0)
    agg.reset()
    assert agg.pending == []
    assert agg.sync().wait().to_dict() == {}


def test_bad_input_raises_before_accumulating() -> None:
    agg = MetricAggregator()
    with pytest.raises(TypeError, match="metric 'name' must be a number or a tensor"):
        agg.update(loss=1.0, name="x")
    assert agg.pending == []
    with pytest.raises(ValueError, match="weight must be >= 0"):
        agg.update(-1, loss=1.0)
    with pytest.raises(ValueError, match="weight must be one number"):
        agg.update(torch.ones(2), loss=1.0)
    with pytest.raises(ValueError, match="metric 'big' is an integer too large for a float"):
        agg.update(loss=1.0, big=10**400)  # a lone update, as a sync every step makes
    with pytest.raises(ValueError, match="weight is an integer too large for a float"):
        agg.update(10**400, loss=1.0)
    assert agg.pending == []
    agg.update(big=2**1023)  # past the quick range check, but a float holds it
    assert agg.sync().wait().to_dict() == {"big": 2.0**1023}
    agg.update(2**62, big=-(2**900))
    assert agg.sync().wait().to_dict() == {"big": -(2.0**900)}
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        MetricAggregator({"x": "median"})
    with pytest.raises(ValueError, match="every must be a positive"):
        MetricAggregator(every=0)


def test_writer_jsonl_and_csv_on_rank_zero_only(tmp_path: Path) -> None:
    results = MetricResults({"loss": (0.5, 4.0, 0), "acc": (math.nan, 2.0, 1)})
    with MetricsWriter(tmp_path / "m.jsonl", rank=0) as out:
        out.write(results, step=1)
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert row["step"] == 1
    assert row["loss"] == 0.5
    assert math.isnan(row["acc"])
    assert row["nonfinite"] == {"acc": 1}

    with MetricsWriter(tmp_path / "m.csv", rank=0) as out:
        out.write(results, step=1)
        out.write(MetricResults({"loss": (0.25, 1.0, 0)}), step=2)
        with pytest.raises(ValueError, match=r"metrics \['new'\] are not columns"):
            out.write(MetricResults({"new": (1.0, 1.0, 0)}), step=3)
    assert (tmp_path / "m.csv").read_text().splitlines() == [
        "step,acc,loss",
        "1,nan,0.5",
        "2,,0.25",
    ]

    with MetricsWriter(tmp_path / "other.jsonl", rank=1) as out:
        out.write(results, step=1)
    assert not (tmp_path / "other.jsonl").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_values_accumulate_on_the_device() -> None:
    agg = MetricAggregator({"peak": "max"})
    dev = torch.device("cuda")
    for i in range(5):
        agg.update(torch.tensor(2.0, device=dev), loss=torch.full((4,), float(i), device=dev))
        agg.update(peak=torch.tensor([float(i), -1.0], device=dev), cpu=1.0)
    results = agg.sync().wait()
    assert results.to_dict() == {"loss": 2.0, "peak": 4.0, "cpu": 1.0}
    assert results.counts["loss"] == 40.0
