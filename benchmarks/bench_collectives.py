"""Time aiodist's collectives against torch.distributed (gloo), side by side in one run.

For each world size, two sets of N spawned processes start together: N gloo
ranks (``init_process_group("gloo")`` over a TCPStore on 127.0.0.1) and N
aiodist ranks (``open_process_group`` against an ``aiodist serve`` daemon,
uvloop, the async API as a user would call it). Both stay up for the whole
world size; the parent sends every case to one system, then the other
(alternating which goes first), so a busy machine slows both alike.

A case runs a warm-up that also checks the result, then ``repeats`` timed
batches of ``iters`` back-to-back calls, each batch after the system's own
barrier. A batch's time per call is the slowest rank's; the table shows the
median over batches and its min-max spread. Bandwidths follow nccl-tests:
``algbw = size / time`` and bus bandwidth ``busbw = algbw * factor`` with
factor ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather and
reduce_scatter (``size`` being the whole gathered or scattered buffer) and 1
for broadcast and point-to-point. Ratios are aiodist/gloo: below 1 means
aiodist is faster for times, above 1 means it moves more bytes per second for
bandwidths.

Memory: in fresh processes warmed up with a small all_reduce, each rank
resets its peak RSS (``/proc/self/clear_refs``), runs one 64 MiB all_reduce
and reports how far its RSS peaked above where it started, in tensor sizes,
and how much its proportional set size (PSS) grew, which counts shared memory
once across the ranks that map it (RSS counts it in full in each).

Usage::

    python -m benchmarks.bench_collectives [--quick] [--world-sizes 2 4] [--repeats K]

Results go to ``benchmarks/results/collectives.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import multiprocessing
import os
import socket
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Literal

from benchmarks._common import (
    format_table,
    now,
    peak_rss_bytes,
    pss_bytes,
    reset_peak_rss,
    summarize,
    write_results,
)
from benchmarks.bench_rendezvous import DNS_WORKAROUND, AiodistServer

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnContext, SpawnProcess

    from aiodist import ProcessGroup

System = Literal["gloo", "aiodist"]
SYSTEMS: Final[tuple[System, ...]] = ("gloo", "aiodist")
HOST: Final = "127.0.0.1"
KiB: Final = 1024
MiB: Final = 1024 * KiB
STARTUP_TIMEOUT: Final = 180.0
CASE_TIMEOUT: Final = 120.0  # seconds one case may take on every rank together
OP_TIMEOUT: Final = 300.0  # the systems' own operation timeout

ALL_REDUCE_SIZES: Final = tuple(4**k for k in range(1, 14))  # 4 B ... 64 MiB
QUICK_ALL_REDUCE_SIZES: Final = (4, 1 * KiB, 64 * KiB, 1 * MiB, 64 * MiB)
MOVE_SIZES: Final = (1 * KiB, 64 * KiB, 1 * MiB, 16 * MiB)
QUICK_MOVE_SIZES: Final = (1 * MiB,)
BIG_BYTES: Final = 64 * MiB
SMALL_OBJECT: Final = {"step": 100, "loss": 0.5, "acc": 0.75, "name": "resnet50"}


@dataclass(frozen=True, slots=True)
class Case:
    """One measurement: ``op`` on ``nbytes`` (or an object size), both systems."""

    op: str
    nbytes: int = 0
    label: str = ""

    @property
    def name(self) -> str:
        return f"{self.op} {self.label or _size(self.nbytes)}".strip()


@dataclass(frozen=True, slots=True)
class Run:
    """What the parent asks every rank to do: warm up (``iters`` None) or time batches."""

    case: Case
    iters: int | None
    repeats: int


@dataclass(slots=True)
class RankReport:
    seconds: list[float] = field(default_factory=list)  # per call, one per batch
    extra_bytes: int = 0  # memory case: peak RSS above the start
    pss_extra_bytes: int = 0  # memory case: proportional set size after, above before
    error: str = ""


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B" if nbytes else ""


def cases(quick: bool, only: Sequence[str] = ()) -> list[Case]:
    """Every case (whose op is in ``only``, if given), in the order both systems run them."""
    out = [Case("memory", BIG_BYTES, "all_reduce 64 MiB")]
    out += [Case("all_reduce", n) for n in (QUICK_ALL_REDUCE_SIZES if quick else ALL_REDUCE_SIZES)]
    for op in ("broadcast", "all_gather", "reduce_scatter"):
        out += [Case(op, n) for n in (QUICK_MOVE_SIZES if quick else MOVE_SIZES)]
    out += [
        Case("barrier"),
        Case("all_gather_object", 0, "small dict"),
        Case("all_gather_object", 1 * MiB, "1 MiB"),
        Case("broadcast_object_list", 0, "small dict"),
        Case("broadcast_object_list", 1 * MiB, "1 MiB"),
        Case("p2p_round_trip", 8),
        Case("p2p_bandwidth", BIG_BYTES),
    ]
    return [c for c in out if not only or c.op in only]


def bus_factor(op: str, n: int) -> float | None:
    """nccl-tests' bus-bandwidth factor, or None where a time is what matters."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "p2p_bandwidth"):
        return 1.0
    return None


# --- what each rank runs, for both systems ----------------------------------------------------


def _object(case: Case, rank: int) -> Any:
    if case.nbytes:
        return {"rank": rank, "blob": bytes([rank % 256]) * case.nbytes}
    return {**SMALL_OBJECT, "rank": rank}


def _inputs(case: Case, rank: int, n: int) -> Any:
    """The tensors (or objects) one rank passes; values make results checkable."""
    import torch

    numel = max(1, case.nbytes // 4)
    if case.op in ("all_reduce", "memory", "broadcast"):
        return torch.full((numel,), float(rank + 1))
    if case.op == "all_gather":
        return torch.full((max(1, numel // n),), float(rank + 1))
    if case.op == "reduce_scatter":
        part = max(1, numel // n)
        return [torch.full((part,), float(rank + 1 + i)) for i in range(n)]
    if case.op in ("all_gather_object", "broadcast_object_list"):
        return _object(case, rank)
    if case.op == "p2p_round_trip":
        return torch.full((2,), float(rank))  # 8 bytes
    if case.op == "p2p_bandwidth":
        return torch.full((numel,), float(rank))
    return None


def _check(case: Case, rank: int, n: int, data: Any, result: Any) -> None:
    """Raise AssertionError if the warm-up call computed the wrong thing."""
    import torch

    total = n * (n + 1) / 2
    if case.op in ("all_reduce", "memory"):
        assert torch.all(data == total), f"all_reduce gave {data[:4]}, expected {total}"
    elif case.op == "broadcast":
        assert torch.all(data == 1.0), "broadcast did not deliver rank 0's tensor"
    elif case.op == "all_gather":
        assert [float(t[0]) for t in result] == [r + 1.0 for r in range(n)], "all_gather"
    elif case.op == "reduce_scatter":
        assert torch.all(result == total + n * rank), f"reduce_scatter gave {result[:4]}"
    elif case.op == "all_gather_object":
        assert result == [_object(case, r) for r in range(n)], "all_gather_object"
    elif case.op == "broadcast_object_list":
        assert result == [_object(case, 0)] * 3, "broadcast_object_list"
    elif case.op in ("p2p_round_trip", "p2p_bandwidth") and rank in (0, 1):
        assert torch.all(result == float(1 - rank)), "point-to-point"


def _timed_ranks(case: Case, n: int) -> range:
    return range(2) if case.op.startswith("p2p") else range(n)


# --- gloo ranks --------------------------------------------------------------------------------


def _gloo_main(conn: Connection, rank: int, n: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{HOST}:{port}",
        rank=rank,
        world_size=n,
        timeout=timedelta(seconds=OP_TIMEOUT),
    )
    conn.send("up")
    while True:
        try:
            run: Run | None = conn.recv()
        except EOFError:
            break
        if run is None:
            break
        try:
            conn.send(_gloo_run(run, rank, n, torch, dist))
        except Exception as exc:
            conn.send(RankReport(error=_describe(exc)))
    dist.destroy_process_group()


def _gloo_call(
    case: Case, rank: int, n: int, data: Any, torch: Any, dist: Any
) -> Callable[[], Any]:
    op = case.op
    if op in ("all_reduce", "memory"):
        return lambda: dist.all_reduce(data)
    if op == "broadcast":
        return lambda: dist.broadcast(data, src=0)
    if op == "all_gather":
        outs = [torch.empty_like(data) for _ in range(n)]

        def all_gather() -> Any:
            dist.all_gather(outs, data)
            return outs

        return all_gather
    if op == "reduce_scatter":
        out = torch.empty_like(data[0])

        def reduce_scatter() -> Any:
            dist.reduce_scatter(out, data)
            return out

        return reduce_scatter
    if op == "barrier":
        return lambda: dist.barrier()
    if op == "all_gather_object":

        def all_gather_object() -> Any:
            out: list[Any] = [None] * n
            dist.all_gather_object(out, data)
            return out

        return all_gather_object
    if op == "broadcast_object_list":

        def broadcast_object_list() -> Any:
            items = [data] * 3 if rank == 0 else [None] * 3
            dist.broadcast_object_list(items, src=0)
            return items

        return broadcast_object_list
    if op in ("p2p_round_trip", "p2p_bandwidth"):
        reply = torch.empty_like(data) if op == "p2p_round_trip" else torch.empty(2)
        got = torch.empty_like(data)

        def p2p() -> Any:
            if rank == 0:
                w = dist.irecv(reply, 1)
                dist.isend(data, 1).wait()
                w.wait()
                return reply
            if rank == 1:
                dist.irecv(got, 0).wait()
                dist.isend(data[:2] if op == "p2p_bandwidth" else data, 0).wait()
                return got
            return None

        return p2p
    raise ValueError(f"unknown case {op}")


def _gloo_run(run: Run, rank: int, n: int, torch: Any, dist: Any) -> RankReport:
    case = run.case
    data = _inputs(case, rank, n)
    call = _gloo_call(case, rank, n, data, torch, dist)
    if case.op == "memory":
        dist.all_reduce(torch.ones(4))  # connections up, lazy buffers allocated
        gc.collect()
        pss = pss_bytes()
        base = reset_peak_rss()
        call()
        extra = peak_rss_bytes() - base
        _check(case, rank, n, data, data)
        return RankReport(extra_bytes=extra, pss_extra_bytes=pss_bytes() - pss)
    if rank not in _timed_ranks(case, n):
        return RankReport([0.0] * (1 if run.iters is None else run.repeats))
    # Point-to-point ranks line up with an untimed call: the others are not in it.
    sync = call if case.op.startswith("p2p") else dist.barrier
    if run.iters is None:
        result = call()
        _check(case, rank, n, data, result)
        sync()
        start = time.perf_counter()
        call()
        return RankReport([time.perf_counter() - start])
    seconds = []
    for _ in range(run.repeats):
        sync()
        start = time.perf_counter()
        for _ in range(run.iters):
            call()
        seconds.append((time.perf_counter() - start) / run.iters)
    return RankReport(seconds)


# --- aiodist ranks -----------------------------------------------------------------------------


def _aiodist_main(conn: Connection, rank: int, n: int, url: str, job: str) -> None:
    import anyio
    import uvloop

    anyio.run(
        _aiodist_rank,
        conn,
        rank,
        n,
        url,
        job,
        backend_options={"loop_factory": uvloop.new_event_loop},
    )


async def _aiodist_rank(conn: Connection, rank: int, n: int, url: str, job: str) -> None:
    import anyio

    from aiodist import open_process_group

    async with open_process_group(
        url, world_size=n, rank=rank, group_name=job, timeout=OP_TIMEOUT
    ) as g:
        conn.send("up")
        while True:
            try:
                run: Run | None = await anyio.to_thread.run_sync(conn.recv)
            except EOFError:
                break
            if run is None:
                break
            try:
                report = await _aiodist_run(run, g)
            except Exception as exc:
                report = RankReport(error=_describe(exc))
            conn.send(report)


def _aiodist_call(case: Case, g: ProcessGroup, data: Any) -> Callable[[], Awaitable[Any]]:
    import torch

    import aiodist

    op, rank = case.op, g.rank
    if op in ("all_reduce", "memory"):
        return lambda: aiodist.all_reduce(data, group=g)
    if op == "broadcast":
        return lambda: aiodist.broadcast(data, src=0, group=g)
    if op == "all_gather":
        return lambda: aiodist.all_gather(data, group=g)
    if op == "reduce_scatter":
        return lambda: aiodist.reduce_scatter(data, group=g)
    if op == "barrier":
        return lambda: aiodist.barrier(group=g)
    if op == "all_gather_object":
        return lambda: aiodist.all_gather_object(data, group=g)
    if op == "broadcast_object_list":

        async def broadcast_object_list() -> Any:
            items = [data] * 3 if rank == 0 else [None] * 3
            return await aiodist.broadcast_object_list(items, src=0, group=g)

        return broadcast_object_list
    if op in ("p2p_round_trip", "p2p_bandwidth"):
        reply = torch.empty_like(data) if op == "p2p_round_trip" else torch.empty(2)
        got = torch.empty_like(data)

        async def p2p() -> Any:
            if rank == 0:
                w = aiodist.irecv(reply, 1, group=g)
                await aiodist.isend(data, 1, group=g)
                await w
                return reply
            if rank == 1:
                await aiodist.irecv(got, 0, group=g)
                await aiodist.isend(data[:2] if op == "p2p_bandwidth" else data, 0, group=g)
                return got
            return None

        return p2p
    raise ValueError(f"unknown case {op}")


async def _aiodist_run(run: Run, g: ProcessGroup) -> RankReport:
    import torch

    import aiodist

    case, rank, n = run.case, g.rank, g.world_size
    data = _inputs(case, rank, n)
    call = _aiodist_call(case, g, data)
    if case.op == "memory":
        await aiodist.all_reduce(torch.ones(4), group=g)
        gc.collect()
        pss = pss_bytes()
        base = reset_peak_rss()
        await call()
        extra = peak_rss_bytes() - base
        _check(case, rank, n, data, data)
        return RankReport(extra_bytes=extra, pss_extra_bytes=pss_bytes() - pss)
    if rank not in _timed_ranks(case, n):
        return RankReport([0.0] * (1 if run.iters is None else run.repeats))

    async def sync() -> Any:
        if case.op.startswith("p2p"):  # an untimed call: the other ranks are not in it
            return await call()
        return await aiodist.barrier(group=g)

    if run.iters is None:
        result = await call()
        _check(case, rank, n, data, result)
        await sync()
        start = time.perf_counter()
        await call()
        return RankReport([time.perf_counter() - start])
    seconds = []
    for _ in range(run.repeats):
        await sync()
        start = time.perf_counter()
        for _ in range(run.iters):
            await call()
        seconds.append((time.perf_counter() - start) / run.iters)
    return RankReport(seconds)


def _describe(exc: BaseException, limit: int = 300) -> str:
    text = "".join(traceback.format_exception_only(exc)).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- the parent ---------------------------------------------------------------------------------


class Ranks:
    """N spawned ranks of one system, driven over pipes."""

    def __init__(self, ctx: SpawnContext, system: System, n: int, address: str) -> None:
        self.system, self.n = system, n
        self.error = ""
        self._procs: list[SpawnProcess] = []
        self._conns: list[Connection] = []
        job = f"bench-collectives-{n}-{uuid.uuid4().hex[:8]}"
        for rank in range(n):
            parent_end, child_end = ctx.Pipe()
            if system == "gloo":
                target, args = _gloo_main, (child_end, rank, n, int(address))
            else:
                target, args = _aiodist_main, (child_end, rank, n, address, job)  # type: ignore[assignment]
            proc = ctx.Process(target=target, args=args, name=f"{system}-{rank}", daemon=True)
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    def wait_up(self) -> None:
        try:
            for conn in self._conns:
                if self._recv(conn, STARTUP_TIMEOUT) != "up":
                    raise RuntimeError("a rank sent an unexpected start-up message")
        except (OSError, EOFError, TimeoutError, RuntimeError) as exc:
            self.fail(f"start-up: {_describe(exc)}")

    def _recv(self, conn: Connection, timeout: float) -> Any:
        if not conn.poll(timeout):
            raise TimeoutError(f"{self.system} rank did not answer within {timeout:.0f} s")
        return conn.recv()

    def run(self, run: Run) -> list[RankReport] | None:
        """Every rank's report, or None (and ``error`` set) if the system failed."""
        if self.error:
            return None
        try:
            for conn in self._conns:
                conn.send(run)
            deadline = now() + CASE_TIMEOUT
            reports: list[RankReport] = [
                self._recv(conn, max(0.0, deadline - now())) for conn in self._conns
            ]
        except (OSError, EOFError, TimeoutError) as exc:
            self.fail(_describe(exc))
            return None
        return reports

    def fail(self, error: str) -> None:
        self.error = error
        self.close()

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _measure(ranks: Ranks, case: Case, repeats: int, target: float) -> dict[str, Any]:
    """Warm up (checking the result), pick the batch size, time ``repeats`` batches."""
    timed = _timed_ranks(case, ranks.n)
    warm = ranks.run(Run(case, None, repeats))
    if warm is None:
        return {"error": ranks.error}
    errors = [f"rank {r}: {rep.error}" for r, rep in enumerate(warm) if rep.error]
    if errors:
        return {"error": errors[0]}
    if case.op == "memory":
        extra = max(rep.extra_bytes for rep in warm)
        pss = max(rep.pss_extra_bytes for rep in warm)
        return {
            "extra_bytes": extra,
            "extra_tensor_sizes": extra / case.nbytes,
            "pss_extra_bytes": pss,
            "pss_extra_tensor_sizes": pss / case.nbytes,
        }
    once = max(warm[r].seconds[0] for r in timed)
    iters = max(1, min(2000, round(target / max(once, 1e-6))))
    reports = ranks.run(Run(case, iters, repeats))
    if reports is None:
        return {"error": ranks.error}
    errors = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error]
    if errors:
        return {"error": errors[0]}
    per_batch = [max(reports[r].seconds[i] for r in timed) for i in range(repeats)]
    return {"iters": iters, "seconds": per_batch, "summary_s": summarize(per_batch)}


def bench(
    world_sizes: Sequence[int], repeats: int, target: float, quick: bool, only: Sequence[str] = ()
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        server = AiodistServer()
        server.start()
        stack.callback(server.stop)
        for n in world_sizes:
            started = now()
            sets = {
                "gloo": Ranks(ctx, "gloo", n, str(_free_port())),
                "aiodist": Ranks(ctx, "aiodist", n, f"tcp://{HOST}:{server.port}"),
            }
            for ranks in sets.values():
                stack.callback(ranks.close)
            for ranks in sets.values():
                ranks.wait_up()
            print(f"world size {n}: {2 * n} ranks up in {now() - started:.1f} s", flush=True)
            for i, case in enumerate(cases(quick, only)):
                row: dict[str, Any] = {"world_size": n, "case": case.name, "op": case.op}
                row["nbytes"] = case.nbytes
                order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
                for system in order:
                    row[system] = _measure(sets[system], case, repeats, target)
                _add_ratios(row, n)
                results.append(row)
                print(f"  {_line(row)}", flush=True)
            for ranks in sets.values():
                ranks.close()
    return {
        "config": {
            "world_sizes": list(world_sizes),
            "repeats": repeats,
            "batch_target_s": target,
            "quick": quick,
            "host": HOST,
            "aiodist_loop": "uvloop",
            "environment_overrides": {k: os.environ.get(k) for k in DNS_WORKAROUND},
        },
        "results": results,
    }


def _median(res: dict[str, Any]) -> float | None:
    summary = res.get("summary_s")
    return None if summary is None else float(summary.median)


def _add_ratios(row: dict[str, Any], n: int) -> None:
    if row["op"] == "memory":
        g, a = row["gloo"].get("extra_bytes"), row["aiodist"].get("extra_bytes")
        row["ratio"] = a / g if g and a is not None else None
        return
    g, a = _median(row["gloo"]), _median(row["aiodist"])
    row["time_ratio"] = a / g if a is not None and g else None
    factor = bus_factor(row["op"], n)
    if factor is None:
        return
    for system in SYSTEMS:
        t = _median(row[system])
        if t is not None:
            row[system]["busbw_gbps"] = row["nbytes"] / t * factor / 1e9
    if a is not None and g is not None:
        row["busbw_ratio"] = g / a  # same bytes: bandwidth ratio is the inverse time ratio


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.0f}" if us >= 100 else f"{us:.1f}"


def _cells(res: dict[str, Any], memory: bool) -> list[str]:
    if "error" in res:
        return [f"FAILED: {res['error'][:40]}", "", ""]
    if memory:
        return [
            f"{res['extra_bytes'] / MiB:.1f} MiB",
            f"{res['extra_tensor_sizes']:.2f}x",
            f"PSS {res['pss_extra_tensor_sizes']:.2f}x",
        ]
    s = res["summary_s"]
    bw = res.get("busbw_gbps")
    return [_us(s.median), f"{_us(s.min)}-{_us(s.max)}", "" if bw is None else f"{bw:.2f}"]


def _line(row: dict[str, Any]) -> str:
    parts = [f"N={row['world_size']} {row['case']:<28}"]
    for system in SYSTEMS:
        cells = _cells(row[system], row["op"] == "memory")
        parts.append(f"{system} {cells[0]}" + (f" ({cells[1]})" if cells[1] else ""))
    ratio = row.get("time_ratio", row.get("ratio"))
    if ratio is not None:
        parts.append(f"aiodist/gloo {ratio:.2f}")
    return "  ".join(parts)


def render(data: dict[str, Any]) -> str:
    headers = [
        "case",
        "gloo us",
        "gloo min-max",
        "gloo busbw",
        "aiodist us",
        "aiodist min-max",
        "aiodist busbw",
        "time a/g",
        "busbw a/g",
    ]
    out = []
    for n in data["config"]["world_sizes"]:
        rows = []
        for row in data["results"]:
            if row["world_size"] != n:
                continue
            memory = row["op"] == "memory"
            ratio = row.get("ratio") if memory else row.get("time_ratio")
            bw_ratio = row.get("busbw_ratio")
            rows.append(
                [
                    row["case"],
                    *_cells(row["gloo"], memory),
                    *_cells(row["aiodist"], memory),
                    "-" if ratio is None else f"{ratio:.2f}",
                    "-" if bw_ratio is None else f"{bw_ratio:.2f}",
                ]
            )
        out.append(f"world size {n} (busbw in GB/s; memory rows: extra peak RSS per rank)")
        out.append(format_table(headers, rows))
    out.append(goals(data))
    return "\n\n".join(out)


GOALS: Final = (
    ("all_gather_object small dict", "time_ratio", "<=", 0.1),
    ("barrier", "time_ratio", "<=", 0.2),
    ("all_reduce 4 B", "time_ratio", "<=", 0.5),
    ("all_reduce 64 MiB", "busbw_ratio", ">=", 1.5),
    ("p2p_round_trip 8 B", "time_ratio", "<=", 0.6),
)


def goals(data: dict[str, Any]) -> str:
    """The project's speed goals at the largest world size measured (4 by default)."""
    n = max(data["config"]["world_sizes"])
    rows = []
    for case, key, sense, limit in GOALS:
        row = next((r for r in data["results"] if r["world_size"] == n and r["case"] == case), None)
        value = None if row is None else row.get(key)
        if value is None:
            verdict = "not measured"
        else:
            met = value <= limit if sense == "<=" else value >= limit
            verdict = "met" if met else "MISSED"
        shown = "-" if value is None else f"{value:.3f}"
        rows.append([case, key, f"{sense} {limit}", shown, verdict])
    mem = next((r for r in data["results"] if r["world_size"] == n and r["op"] == "memory"), None)
    if mem is not None and "pss_extra_tensor_sizes" in mem["aiodist"]:
        # Proportional set size: shared pages count once across the ranks that map them
        # (peak RSS counts a peer's shared segment in full in every rank that reads it).
        value = max(mem["aiodist"]["pss_extra_tensor_sizes"], 0.0)
        verdict = "met" if value <= 1.1 else "MISSED"
        rows.append(
            ["memory all_reduce 64 MiB", "aiodist extra", "<= 1 tensor", f"{value:.2f}", verdict]
        )
    return f"goals at world size {n}\n" + format_table(
        ["case", "measure", "goal", "aiodist/gloo", "verdict"], rows
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks.bench_collectives``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_collectives", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], metavar="N")
    parser.add_argument("--repeats", type=int, default=None, metavar="K")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument(
        "--batch-ms", type=float, default=None, help="target time of one timed batch"
    )
    ops = sorted({c.op for c in cases(False)})
    parser.add_argument("--ops", nargs="+", choices=ops, default=[], help="run only these")
    parser.add_argument(
        "--no-dns-workaround",
        action="store_true",
        help=f"do not set {' '.join(f'{k}={v}' for k, v in DNS_WORKAROUND.items())}",
    )
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 5)
    target = (args.batch_ms or (10.0 if args.quick else 25.0)) / 1e3
    if min(args.world_sizes) < 2 or repeats < 1:
        parser.error("--world-sizes must be >= 2 and --repeats >= 1")
    if not args.no_dns_workaround:
        for key, value in DNS_WORKAROUND.items():
            os.environ.setdefault(key, value)  # spawned ranks inherit it (TCPStore's lookups)
    started = now()
    print(
        f"collectives, aiodist vs gloo, world sizes {args.world_sizes}, {repeats} batches of "
        f"~{target * 1e3:.0f} ms per case",
        flush=True,
    )
    data = bench(args.world_sizes, repeats, target, args.quick, args.ops)
    data["config"]["wall_s"] = now() - started
    path = write_results("collectives", data)
    print()
    print(render(data))
    print(f"\nresults: {path} ({data['config']['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
