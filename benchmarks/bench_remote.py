"""Master-worker mode against remote calls: operations per second on a tensor held by a worker.

One job of two ranks (``init_master_worker``): the master (rank 0) updates a
16-element tensor that lives on the worker (rank 1), three ways, in one run:

- ``remote``: ``x.add_(1)`` on an ``aiodist.remote`` tensor, issued without
  waiting, then ``remote.synchronize()``; reported as operations issued per
  second (the master's own cost) and completed per second (until synchronized);
- ``rpc one by one``: ``await rpc.rpc_async(1, add_one, ("x",))`` for each
  update, the asyncio spelling of ``rpc_sync`` in a loop (the same update of a
  tensor the worker holds);
- ``rpc_async``: all the calls of a batch at once, then every answer awaited.

The cases take turns batch by batch, in alternating order (A B C, C B A, ...);
each row gives the median over batches with the min-max, and the ratios of
remote to each rpc case per round (median, min-max).

Usage::

    python -m benchmarks.bench_remote [--rounds R] [--ops K] [--calls C]

Results go to ``benchmarks/results/remote.json``.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from typing import TYPE_CHECKING, Any, Final

from benchmarks._common import (
    Goal,
    as_summary,
    format_table,
    rank_context,
    summarize,
    write_results,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = ["CASES", "bench", "figure", "goal_list", "render"]

CASES: Final = ("remote issued", "remote done", "rpc one by one", "rpc_async")
_HELD: dict[str, Any] = {}


def add_one(key: str) -> None:
    """The rpc cases' update, run on the worker: its tensor ``key`` += 1."""
    import torch

    t = _HELD.get(key)
    if t is None:
        t = _HELD[key] = torch.zeros(16)
    t.add_(1)


async def _master(rounds: int, ops: int, calls: int) -> dict[str, list[float]]:
    import aiodist.rpc as rpc
    from aiodist import remote

    x = remote.zeros(16, node=1)
    per_second: dict[str, list[float]] = {case: [] for case in CASES}

    async def with_remote() -> None:
        start = time.perf_counter()
        for _ in range(ops):
            x.add_(1)
        issued = time.perf_counter()
        await remote.synchronize(1)
        done = time.perf_counter()
        per_second["remote issued"].append(ops / (issued - start))
        per_second["remote done"].append(ops / (done - start))

    async def one_by_one() -> None:
        start = time.perf_counter()
        for _ in range(calls):
            await rpc.rpc_async(1, add_one, ("x",))
        per_second["rpc one by one"].append(calls / (time.perf_counter() - start))

    async def at_once() -> None:
        start = time.perf_counter()
        works = [rpc.rpc_async(1, add_one, ("x",)) for _ in range(calls)]
        for w in works:
            await w
        per_second["rpc_async"].append(calls / (time.perf_counter() - start))

    order = [with_remote, one_by_one, at_once]
    await with_remote()  # warm: the shape cache, the connections
    await one_by_one()
    for values in per_second.values():
        values.clear()
    for r in range(rounds):
        for case in order if r % 2 == 0 else order[::-1]:
            await case()
    total = ops * (rounds + 1)
    got = (await x.fetch())[0].item()
    if got != total:
        raise RuntimeError(f"the worker's tensor is {got}, not {total}: an update was lost")
    return per_second


async def _rank(rank: int, port: int, rounds: int, ops: int, calls: int) -> dict[str, Any]:
    import aiodist

    is_master = await aiodist.init_master_worker(
        init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=120
    )
    if not is_master:
        return {}
    per_second = await _master(rounds, ops, calls)
    await aiodist.destroy_process_group()
    return per_second


def _rank_main(rank: int, port: int, rounds: int, ops: int, calls: int, out: Connection) -> None:
    """A rank's process, forked by ``rank_context``: its result, or its error, to ``out``."""
    import anyio

    try:
        out.send(anyio.run(_rank, rank, port, rounds, ops, calls))
    except BaseException as exc:
        out.send(RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise


def bench(
    rounds: int = 7, ops: int = 4000, calls: int = 1000, timeout: float = 600
) -> dict[str, Any]:
    """Run the job; per case, operations per second (median, min, max over rounds)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_context()
    ends = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, rounds, ops, calls, ends[r][1]), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        got: list[Any] = []
        for rank, (recv_end, send_end) in enumerate(ends):
            send_end.close()
            if not recv_end.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"rank {rank} gave no result within {timeout:g} s")
            try:
                got.append(recv_end.recv())
            except EOFError:
                raise RuntimeError(f"rank {rank} exited without a result") from None
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for value in got:
        if isinstance(value, BaseException):
            raise RuntimeError(f"a rank failed: {value}")
    per_second: dict[str, list[float]] = got[0]
    ratios = {
        f"remote done / {case}": [
            a / b for a, b in zip(per_second["remote done"], per_second[case], strict=True)
        ]
        for case in ("rpc one by one", "rpc_async")
    }
    return {
        "config": {"rounds": rounds, "ops": ops, "calls": calls},
        "per_second": {case: summarize(v) for case, v in per_second.items()},
        "ratios": {name: summarize(v) for name, v in ratios.items()},
    }


def figure(obj: Any, *, ratio: bool = False) -> str:
    """A summary as the tables show it: ``median (min-max)``."""
    s = as_summary(obj)
    if s is None:
        return "-"
    if ratio:
        return f"{s.median:.1f}x ({s.min:.1f}-{s.max:.1f})"
    return f"{s.median:,.0f} ({s.min:,.0f}-{s.max:,.0f})"


def render(data: dict[str, Any]) -> str:
    rows = [[case, figure(data["per_second"][case])] for case in CASES]
    text = format_table(["case", "operations/s, median (min-max)"], rows)
    ratio_rows = [[name, figure(s, ratio=True)] for name, s in data["ratios"].items()]
    return text + "\n\n" + format_table(["ratio", "median (min-max)"], ratio_rows)


def goal_list(data: dict[str, Any]) -> list[Goal]:
    """Issue 48 sets no figure; the report shows remote against rpc one by one."""
    s = as_summary(data["ratios"]["remote done / rpc one by one"])
    return [
        Goal.judge(
            "master-worker updates",
            "ops/s remote / rpc one by one",
            ">=",
            1,
            None if s is None else s.median,
            "issue 48",
        )
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ops", type=int, default=4000)
    parser.add_argument("--calls", type=int, default=1000)
    args = parser.parse_args(argv)
    data = bench(args.rounds, args.ops, args.calls)
    path = write_results("remote", data)
    print(render(data))
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
