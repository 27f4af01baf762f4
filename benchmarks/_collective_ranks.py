"""What each rank of ``bench_collectives`` runs: the cases, for gloo and for aiodist.

Both systems run the same cases with the same inputs; the warm-up call of each
case checks its result, so a fast wrong answer cannot pass for a fast one.
A rank answers every ``Run`` the parent sends over its pipe with a
``RankReport``: seconds per call for each timed batch, or the memory figures.
"""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, Literal

from benchmarks._common import peak_rss_bytes, pss_bytes, reset_peak_rss

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from multiprocessing.connection import Connection

    from aiodist import ProcessGroup

System = Literal["gloo", "aiodist"]
SYSTEMS: Final[tuple[System, ...]] = ("gloo", "aiodist")
HOST: Final = "127.0.0.1"
KiB: Final = 1024
MiB: Final = 1024 * KiB
STARTUP_TIMEOUT: Final = 180.0
CASE_TIMEOUT: Final = 120.0  # seconds one case may take on every rank together
OP_TIMEOUT: Final = 60.0  # the systems' own operation timeout: fires before CASE_TIMEOUT

Mode = Literal["full", "quick", "smoke"]
TENSOR_OPS: Final = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
# Message sizes of the four tensor collectives, per mode: 4 B ... 64 MiB in powers of 4
# (the full sweep), every third of them (quick), two points for a plot (smoke).
SIZES: Final[dict[Mode, tuple[int, ...]]] = {
    "full": tuple(4**k for k in range(1, 14)),
    "quick": (4, 256, 16 * KiB, 1 * MiB, 64 * MiB),
    "smoke": (4, 64 * KiB),
}
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


def cases(mode: Mode = "full", only: Sequence[str] = ()) -> list[Case]:
    """Every case of ``mode`` (whose op is in ``only``, if given), in the order both run them.

    ``smoke`` is the smallest run that still exercises every kind of row: no
    memory case and no 64 MiB transfer.
    """
    out = [] if mode == "smoke" else [Case("memory", BIG_BYTES, "all_reduce 64 MiB")]
    out += [Case(op, n) for op in TENSOR_OPS for n in SIZES[mode]]
    out += [Case("barrier"), Case("all_gather_object", 0, "small dict")]
    if mode != "smoke":
        out += [
            Case("all_gather_object", 1 * MiB, "1 MiB"),
            Case("broadcast_object_list", 0, "small dict"),
            Case("broadcast_object_list", 1 * MiB, "1 MiB"),
        ]
    out.append(Case("p2p_round_trip", 8))
    if mode != "smoke":
        out.append(Case("p2p_bandwidth", BIG_BYTES))
    return [c for c in out if not only or c.op in only]


def moved_bytes(case: Case, n: int) -> int:
    """The bytes a case's call really moves (nccl-tests' ``size``).

    All_gather and reduce_scatter split ``nbytes`` into ``n`` whole float32
    parts, at least one element each: below ``4 * n`` bytes the buffer grows.
    """
    if case.op in ("all_gather", "reduce_scatter"):
        return max(1, case.nbytes // 4 // n) * n * 4
    return case.nbytes


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


def timed_ranks(case: Case, n: int) -> range:
    return range(2) if case.op.startswith("p2p") else range(n)


# --- gloo ranks --------------------------------------------------------------------------------


def gloo_main(conn: Connection, rank: int, n: int, port: int) -> None:
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
            conn.send(RankReport(error=describe(exc)))
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
    if rank not in timed_ranks(case, n):
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


def aiodist_main(conn: Connection, rank: int, n: int, url: str, job: str) -> None:
    import anyio
    import torch  # noqa: F401  # before joining, as scripts do: `import aiodist` leaves torch out
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
                report = RankReport(error=describe(exc))
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
    if rank not in timed_ranks(case, n):
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


def describe(exc: BaseException, limit: int = 300) -> str:
    text = "".join(traceback.format_exception_only(exc)).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."
