"""The torch bridge: init_process_group(backend="gloo") in real processes, one per rank.

gloo needs one process per rank, so every scenario runs in spawned workers that
join through a real ``aiodist serve`` daemon and print their results as JSON;
the tests compare them with references computed here with torch. One spawn of
three workers runs every non-destructive scenario (torch's import dominates the
cost on two cores); the failure scenario gets its own pair. NCCL tests are
marked ``gpu`` and skip without CUDA.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest
import torch

import aiodist
from tests.helpers import ROOT
from tests.helpers.warm import popen

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

WORLD = 3
N_ORDERED = 50

WORKER = textwrap.dedent(
    """
    import asyncio, json, os, sys, traceback
    import torch, torch.distributed as dist
    import aiodist

    url, rank, world, mode, loop_kind = sys.argv[1:6]
    rank, world = int(rank), int(world)

    def x(r, shape=(2, 3), dtype=torch.float32):  # rank r's input, as the tests compute it
        return (torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r).to(dtype)

    async def collectives(out):
        # Counts torch's all_to_all_single calls (the bridge reads it on first use).
        torch_calls = []
        torch_all_to_all_single = dist.all_to_all_single
        def counted(*args, **kwargs):
            torch_calls.append(1)
            return torch_all_to_all_single(*args, **kwargs)
        dist.all_to_all_single = counted
        g = aiodist.get_default_group()
        out["bridged"] = g.bridge is not None
        for op in ("sum", "mean", "product", "min", "max"):
            t = x(rank)
            assert await aiodist.all_reduce(t, op=op) is t
            out[f"all_reduce_{op}"] = t.tolist()
        t = torch.tensor([rank + 1, 6, 3], dtype=torch.int64)
        out["all_reduce_bxor"] = (await aiodist.all_reduce(t, op="bxor")).tolist()
        t = x(rank).t()  # not contiguous: the result must land in t itself
        await aiodist.all_reduce(t)
        out["all_reduce_strided"] = t.tolist()
        t = x(rank)
        out["reduce"] = (await aiodist.reduce(t, dst=1, op="max")).tolist()
        outs = await aiodist.reduce_scatter([x(rank) * (i + 1) for i in range(world)], op="sum")
        out["reduce_scatter"] = outs.tolist()
        t = x(rank)
        out["broadcast"] = (await aiodist.broadcast(t, src=2)).tolist()
        out["gather"] = [p.tolist() for p in await aiodist.gather(x(rank), dst=0)]
        parts = [x(i) for i in range(world)] if rank == 1 else None
        out["scatter"] = (await aiodist.scatter(torch.empty(2, 3), parts, src=1)).tolist()
        out["all_gather"] = [p.tolist() for p in await aiodist.all_gather(x(rank))]
        # Nothing so far touched aiodist's data plane: no peer connection was opened.
        out["data_plane_peers"] = len(g.session.plane.routes)
        store = aiodist.get_store()  # nobody starts all_to_all (which uses it) before all counted
        await store.set(f"counted/{rank}", b"")
        await store.wait([f"counted/{r}" for r in range(world)])
        sent = [torch.full((rank + 1, i + 1), float(10 * rank + i)) for i in range(world)]
        out["all_to_all"] = [p.tolist() for p in await aiodist.all_to_all(sent)]
        # Uneven splits: rank r sends i + 1 elements to rank i, receives r + 1 from each.
        single = torch.empty(world * (rank + 1))
        before = len(torch_calls)
        sent = torch.cat([torch.full((i + 1,), float(10 * rank + i)) for i in range(world)])
        got = await aiodist.all_to_all_single(
            single, sent, [rank + 1] * world, [i + 1 for i in range(world)]
        )
        out["all_to_all_single"] = [got is single, single.tolist(), len(torch_calls) - before]
        dist.all_to_all_single = torch_all_to_all_single

    async def ordered(out):
        works = [aiodist.all_reduce(torch.full((i + 1,), float(rank + i)))
                 for i in range(N_ORDERED)]
        out["ordered"] = [(await w).tolist() for w in works]

    async def ticker(out):
        store = aiodist.get_store()
        t = torch.ones(4 * 1024 * 1024)  # 16 MiB
        if rank == 0:
            w = aiodist.all_reduce(t)
            ticks = 0
            while ticks < 5:  # rank 1 has not joined the collective: the loop must run
                await asyncio.sleep(0.001)
                ticks += 1
            out["done_before_peer"] = w.is_completed()
            await store.set("ticker/go", b"1")
            while not w.is_completed():
                await asyncio.sleep(0.001)
                ticks += 1
            await w
            out["ticks"] = ticks
        else:
            await store.get("ticker/go")
            await aiodist.all_reduce(t)
        out["ticker_value"] = t[:2].tolist()

    async def subgroups(out):
        evens = await aiodist.new_group([0, 2])
        out["sub_rank"] = evens.rank
        if evens.rank >= 0:
            out["sub_bridged"] = evens.bridge is not None and evens.bridge.torch_group is not None
            t = x(rank)
            out["sub_all_reduce"] = (await aiodist.all_reduce(t, group=evens)).tolist()
            out["sub_broadcast"] = (await aiodist.broadcast(x(rank), src=2, group=evens)).tolist()
        t = x(rank)  # the world still works after a subgroup was made
        out["world_after_sub"] = (await aiodist.all_reduce(t)).tolist()
        await aiodist.destroy_process_group(evens)
        out["sub_destroyed"] = evens.bridge is None

    async def failure(out):
        store = aiodist.get_store()
        if rank == 1:
            await store.get("failure/issued")
            os._exit(0)  # dies with rank 0's collective pending in gloo
        w = aiodist.all_reduce(torch.ones(8))
        await store.set("failure/issued", b"1")
        try:
            await w
        except aiodist.DistError as exc:
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
            out["cause"] = type(exc.__cause__).__name__
            out["cause_module"] = type(exc.__cause__).__module__

    async def stuck(out):
        # Rank 1 never makes the call: rank 0's bridged all_reduce hangs in torch until
        # the group's (short) timeout, which must end it, name it, and mark it stuck.
        store = aiodist.get_store()
        g = aiodist.get_default_group()
        if rank == 1:
            await store.get("stuck/reported", timeout=60)
            return
        import time
        began = time.monotonic()
        try:
            await aiodist.all_reduce(torch.ones(8))
        except aiodist.DistError as exc:
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
        out["seconds"] = time.monotonic() - began
        out["stuck"] = g.bridge.stuck
        await store.set("stuck/reported", b"1")

    async def nccl(out):
        t = torch.full((4, 5), float(rank + 1), device="cuda")
        await aiodist.all_reduce(t)
        out["nccl_all_reduce"] = t.tolist()  # .tolist() syncs: the Work said it is usable
        t = torch.full((3,), float(rank), device="cuda")
        out["nccl_broadcast"] = (await aiodist.broadcast(t, src=world - 1)).tolist()
        parts = await aiodist.all_gather(torch.full((2,), float(rank), device="cuda"))
        out["nccl_all_gather"] = [p.tolist() for p in parts]
        cpu = torch.ones(3)  # CPU tensors ride aiodist's data plane under NCCL
        out["nccl_cpu_all_reduce"] = (await aiodist.all_reduce(cpu)).tolist()

    async def main():
        backend = "nccl" if mode == "nccl" else "gloo"
        await aiodist.init_process_group(backend, init_method=url, world_size=world, rank=rank,
                                         group_name="bridge-" + mode,
                                         timeout=2.0 if mode == "stuck" else 30,
                                         heartbeat_interval=0.2, heartbeat_timeout=5.0)
        out = {"rank": rank, "torch_initialized": dist.is_initialized(),
               "torch_rank": dist.get_rank(), "torch_world": dist.get_world_size()}
        steps = {"all": [collectives, ordered, ticker, subgroups], "failure": [failure],
                 "nccl": [nccl], "stuck": [stuck]}[mode]
        for step in steps:
            try:
                await step(out)
            except Exception:
                out[step.__name__ + "_error"] = traceback.format_exc()
        await aiodist.destroy_process_group()
        out["torch_initialized_after"] = dist.is_initialized()
        print(json.dumps(out), flush=True)

    if loop_kind == "uvloop":
        import uvloop
        uvloop.run(main())
    else:
        asyncio.run(main())
    """
).replace("N_ORDERED", str(N_ORDERED))


def _x(r: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r


@pytest.fixture(scope="module")
def daemon() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiodist", "serve", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        seen = []
        for _ in range(20):  # log lines (stderr, merged) may come before the address
            line = proc.stdout.readline()  # the bound address, printed once listening
            seen.append(line)
            if "listening on" in line or not line:
                break
        assert "listening on" in line, seen
        yield "tcp://" + line.rsplit(" ", 1)[1].strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def _run_workers(
    tmp: Path, url: str, mode: str, world: int, loop_kind: str, expect_ok: range
) -> list[dict[str, Any]]:
    script = tmp / f"bridge_worker_{mode}.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        popen(
            [sys.executable, str(script), url, str(r), str(world), mode, loop_kind],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for r in range(world)
    ]
    outs: list[dict[str, Any]] = []
    try:
        for r, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=90)
            if r in expect_ok:
                assert p.returncode == 0, stderr
                outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


@pytest.fixture(scope="module")
def results(daemon: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("bridge")
    outs = _run_workers(tmp, daemon, "all", WORLD, "asyncio", range(WORLD))
    for out in outs:  # a scenario that raised fails every test, with its traceback
        errors = {k: v for k, v in out.items() if k.endswith("_error")}
        assert not errors, "\n".join(errors.values())
    return outs


pytestmark = pytest.mark.slow


def test_init_process_group_gloo_brings_up_torch_through_the_job_store(
    results: list[dict[str, Any]],
) -> None:
    for rank, out in enumerate(results):
        assert out["torch_initialized"] is True
        assert (out["torch_rank"], out["torch_world"]) == (rank, WORLD)
        assert out["bridged"] is True


def test_destroy_process_group_tears_torch_down(results: list[dict[str, Any]]) -> None:
    assert [out["torch_initialized_after"] for out in results] == [False] * WORLD


def test_every_tensor_collective_matches_a_torch_reference(results: list[dict[str, Any]]) -> None:
    xs = torch.stack([_x(r) for r in range(WORLD)])
    for rank, out in enumerate(results):
        close = torch.testing.assert_close
        close(torch.tensor(out["all_reduce_sum"]), xs.sum(0))
        close(torch.tensor(out["all_reduce_mean"]), xs.mean(0))
        close(torch.tensor(out["all_reduce_product"]), xs.prod(0))
        close(torch.tensor(out["all_reduce_min"]), xs.min(0).values)
        close(torch.tensor(out["all_reduce_max"]), xs.max(0).values)
        ints = [torch.tensor([r + 1, 6, 3]) for r in range(WORLD)]
        assert out["all_reduce_bxor"] == (ints[0] ^ ints[1] ^ ints[2]).tolist()
        close(torch.tensor(out["all_reduce_strided"]), xs.sum(0).t())
        expected_reduce = xs.max(0).values if rank == 1 else _x(rank)
        close(torch.tensor(out["reduce"]), expected_reduce)
        close(torch.tensor(out["reduce_scatter"]), xs.sum(0) * (rank + 1))
        close(torch.tensor(out["broadcast"]), _x(2))
        if rank == 0:
            close(torch.tensor(out["gather"]), xs)
        else:
            assert out["gather"] == []
        close(torch.tensor(out["scatter"]), _x(rank))
        close(torch.tensor(out["all_gather"]), xs)
        for src, part in enumerate(out["all_to_all"]):
            close(torch.tensor(part), torch.full((src + 1, rank + 1), float(10 * src + rank)))
        expected = [float(10 * src + rank) for src in range(WORLD) for _ in range(rank + 1)]
        # It ran on the bridge's torch group, as all_to_all does.
        assert out["all_to_all_single"] == [True, expected, 1]


def test_tensor_collectives_bypass_the_data_plane(results: list[dict[str, Any]]) -> None:
    assert [out["data_plane_peers"] for out in results] == [0] * WORLD


def test_fifty_concurrent_all_reduces_complete_in_call_order(
    results: list[dict[str, Any]],
) -> None:
    for out in results:
        got = out["ordered"]
        assert len(got) == N_ORDERED
        for i, values in enumerate(got):  # op i has i+1 elements: a reorder cannot pass
            assert values == [float(sum(r + i for r in range(WORLD)))] * (i + 1)


def test_loop_keeps_ticking_while_a_bridged_all_reduce_waits(
    results: list[dict[str, Any]],
) -> None:
    assert results[0]["done_before_peer"] is False
    assert results[0]["ticks"] >= 5
    for out in results:
        assert out["ticker_value"] == [float(WORLD)] * 2


def test_new_group_is_bridged_and_destroyed_with_its_torch_group(
    results: list[dict[str, Any]],
) -> None:
    assert [out["sub_rank"] for out in results] == [0, -1, 1]
    for rank in (0, 2):
        out = results[rank]
        assert out["sub_bridged"] is True
        torch.testing.assert_close(torch.tensor(out["sub_all_reduce"]), _x(0) + _x(2))
        torch.testing.assert_close(torch.tensor(out["sub_broadcast"]), _x(2))
    for out in results:
        assert out["sub_destroyed"] is True
        torch.testing.assert_close(
            torch.tensor(out["world_after_sub"]),
            sum((_x(r) for r in range(WORLD)), torch.zeros(2, 3)),
        )


def test_torch_failure_surfaces_as_dist_error_with_torch_cause(daemon: str, tmp_path: Path) -> None:
    (out,) = _run_workers(tmp_path, daemon, "failure", 2, "uvloop", range(1))
    assert "failure_error" not in out, out.get("failure_error")
    assert out["error"] in ("GroupBrokenError", "DistTimeoutError", "RankFailedError")
    if "torch.distributed" not in out["message"]:
        # The server's word that rank 1 died came before gloo's error (two busy cores):
        # the same failure, named by the rendezvous server instead.
        assert out["error"] == "RankFailedError", out
        assert out["message"].startswith("rank 1 "), out
    else:
        assert out["cause"] in ("RuntimeError", "DistBackendError", "DistNetworkError")
    assert out["torch_initialized_after"] is False


def test_a_collective_stuck_in_torch_ends_at_the_group_timeout_naming_it(
    daemon: str, tmp_path: Path
) -> None:
    (out, _) = _run_workers(tmp_path, daemon, "stuck", 2, "asyncio", range(2))
    assert "stuck_error" not in out, out.get("stuck_error")
    assert out["error"] == "DistTimeoutError", out
    assert "all_reduce(op=sum)" in out["message"]
    assert out["stuck"] == "all_reduce(op=sum)"  # NCCL's communicator is aborted there
    assert 1.5 < out["seconds"] < 6.0  # the 2 s timeout, not torch's or the default


async def test_nccl_without_cuda_fails_before_joining() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        await aiodist.init_process_group("nccl", init_method="tcp://127.0.0.1:1", world_size=2)
    assert not aiodist.is_initialized()


@pytest.mark.gpu
def test_nccl_collectives_on_cuda_tensors(daemon: str, tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    world = min(2, torch.cuda.device_count())
    outs = _run_workers(tmp_path, daemon, "nccl", world, "asyncio", range(world))
    for rank, out in enumerate(outs):
        assert "nccl_error" not in out, out.get("nccl_error")
        assert out["nccl_all_reduce"] == [[float(sum(range(1, world + 1)))] * 5] * 4
        assert out["nccl_broadcast"] == [float(world - 1)] * 3
        assert out["nccl_all_gather"] == [[float(r)] * 2 for r in range(world)]
        assert out["nccl_cpu_all_reduce"] == [float(world)] * 3
        assert out["torch_initialized_after"] is False, rank


async def test_unbridgeable_backend_fails_before_joining() -> None:
    with pytest.raises(ValueError, match="cannot bridge backend 'cuda:gloo'"):
        await aiodist.init_process_group("cuda:gloo", init_method="tcp://127.0.0.1:1", world_size=2)
    assert not aiodist.is_initialized()
