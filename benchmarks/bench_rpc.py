"""Time aiodist.rpc against torch.distributed.rpc (TensorPipe), side by side in one run.

Two ranks per system, all four processes up for the whole run: a master
(rank 0) that the parent drives over a pipe, and a worker (rank 1) that only
serves calls (aiodist: ``init_process_group`` then ``await rpc.shutdown()``;
torch: ``init_rpc`` then ``rpc.shutdown()``). Each system runs as its users
would write it: aiodist's master is async code on uvloop awaiting
``rpc.rpc_async``; torch's calls ``rpc_sync`` / ``rpc_async(...).wait()``.
Both call the same plain functions of this module.

Cases (``--cases``):

- ``noop``: round trip of a call to a plain function that returns None, one
  call after the other; time per call.
- ``noop_async`` (aiodist only, against torch's plain no-op): the same with a
  coroutine function, which aiodist awaits on the worker's loop instead of
  handing it to a thread.
- ``window``: calls per second to the plain no-op with 64 calls in flight.
- ``tensor``: round trip of a call whose argument is a 4 MiB float32 tensor
  (the function returns its element count); time per call.
- ``ps_step``: one training step against a parameter server (the worker holds
  a two-layer MLP), in plain code on both systems as torch's tutorials write
  it: within a distributed autograd context, the forward pass by ``rpc_sync``,
  ``dist_autograd.backward`` (the gradients go back to the server) and
  ``DistributedOptimizer.step`` (SGD there); time per step.
- ``batch``: ``BATCH`` calls at once to a function marked
  ``@rpc.functions.async_execution`` that answers them all with one future once
  the last has come (the batch-updating server's pattern); time per batch.

**Pairs.** The systems take turns batch by batch in alternating pairs (A B, B
A, A B, ...: each system goes first equally often), and each pair gives one
ratio aiodist/torch; the tables show each system's median over batches with
its min-max, and the median of the per-pair ratios with theirs (the spread).
While one system measures, the other's four processes are stopped
(``SIGSTOP``, then ``SIGCONT`` for its turn): TensorPipe's threads poll even
when idle (about 0.4 of a core per process here), which would otherwise slow
aiodist's turns on a small machine, and a stopped aiodist costs torch nothing
either. Each system's batch size is set from a checked warm-up so that a batch
lasts about ``--batch-ms``.

Goals (issue 23): a no-op round trip at most 0.5x TensorPipe's time, and at
least 2x its calls per second with 64 in flight.

Usage::

    python -m benchmarks.bench_rpc [--quick | --smoke] [--pairs K] [--batch-ms MS]

Results go to ``benchmarks/results/rpc.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import os
import signal
import socket
import statistics
import threading
import time
import traceback
import uuid
from typing import TYPE_CHECKING, Any, Final, Literal

from benchmarks._common import (
    Goal,
    format_table,
    goal_table,
    now,
    rank_context,
    summarize,
    write_results,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from multiprocessing.connection import Connection
    from multiprocessing.context import ForkServerContext, ForkServerProcess

    import torch

Mode = Literal["full", "quick", "smoke"]
System = Literal["aiodist", "torch"]
SYSTEMS: Final[tuple[System, System]] = ("aiodist", "torch")
CASES: Final = ("noop", "noop_async", "window", "tensor", "ps_step", "batch")
WINDOW: Final = 64
TENSOR_NUMEL: Final = 1 << 20  # float32: 4 MiB
PS_SHAPE: Final = (32, 256, 256, 10)  # batch rows, then the MLP's widths
BATCH: Final = 8
HOST: Final = "127.0.0.1"
STARTUP_TIMEOUT: Final = 120.0
BATCH_TIMEOUT: Final = 120.0
DEFAULT_PAIRS: Final[dict[Mode, int]] = {"full": 15, "quick": 7, "smoke": 1}
DEFAULT_BATCH_MS: Final[dict[Mode, float]] = {"full": 300.0, "quick": 150.0, "smoke": 30.0}


# --- the functions both systems call ----------------------------------------------------------


def noop() -> None:
    """The no-op call."""
    return None


async def anoop() -> None:
    """The no-op call as a coroutine function (aiodist awaits it on the worker's loop)."""
    return None


def numel(t: torch.Tensor) -> int:
    """The tensor case's function: a small result, so the argument is what travels."""
    return int(t.numel())


# The parameter server (rank 1) and the batcher, for ps_step and batch; _SYSTEM says whose
# RRef a rank makes (each rank runs one system).
_SYSTEM: list[System] = []
_STATE: dict[str, Any] = {}


def _ps_model() -> torch.nn.Module:
    model = _STATE.get("model")
    if model is None:
        import torch

        torch.manual_seed(0)
        _, width_in, hidden, out = PS_SHAPE
        model = _STATE["model"] = torch.nn.Sequential(
            torch.nn.Linear(width_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, out)
        )
    return model


def ps_param_rrefs() -> list[Any]:
    """RRefs to the server's parameters, for the master's DistributedOptimizer."""
    if _SYSTEM[0] == "torch":
        from torch.distributed.rpc import RRef
    else:
        from aiodist.rpc import RRef  # type: ignore[assignment]
    return [RRef(p) for p in _ps_model().parameters()]


def ps_forward(x: torch.Tensor) -> torch.Tensor:
    """The server's forward pass (run within the caller's autograd context)."""
    return _ps_model()(x)  # type: ignore[no-any-return]


def _batch_put(value: int) -> Any:
    """Answer ``BATCH`` calls with one future, completed by the last of them."""
    import torch

    with _STATE.setdefault("lock", threading.Lock()):
        got = _STATE.setdefault("got", [])
        future = _STATE.get("future")
        if future is None:
            future = _STATE["future"] = torch.futures.Future()
        got.append(value)
        if len(got) == BATCH:
            _STATE["got"], _STATE["future"] = [], None
            future.set_result(sum(got))
    return future


# torch's async_execution mark, which aiodist honours too: both systems call this one function.
_batch_put._wrapped_async_rpc_function = _batch_put  # type: ignore[attr-defined]


def _ps_steps(rpc: Any, dist_autograd: Any, optim_cls: Any, to: Any, iters: int) -> float:
    """``iters`` parameter-server steps in plain code (both systems' form of it)."""
    import torch

    opt = _STATE.get("opt")
    if opt is None:
        opt = _STATE["opt"] = optim_cls(torch.optim.SGD, rpc.rpc_sync(to, ps_param_rrefs), lr=1e-3)
    x = torch.randn(PS_SHAPE[0], PS_SHAPE[1])
    start = time.perf_counter()
    for _ in range(iters):
        with dist_autograd.context() as context_id:
            loss = rpc.rpc_sync(to, ps_forward, (x,)).sum()
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
    return time.perf_counter() - start


# --- the ranks ----------------------------------------------------------------------------------


def _rank_setup() -> None:
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def torch_main(conn: Connection | None, rank: int, port: int) -> None:
    """A TensorPipe rank: the master serves the parent's batches, the worker serves calls."""
    _rank_setup()
    _SYSTEM.append("torch")
    import torch.distributed.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://{HOST}:{port}", rpc_timeout=BATCH_TIMEOUT
    )
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options
    )
    if conn is not None:
        _serve_parent(conn, lambda case, iters: _torch_batch(rpc, case, iters))
    rpc.shutdown()


def _torch_batch(rpc: Any, case: str, iters: int) -> float:
    import torch

    if case == "ps_step":
        import torch.distributed.autograd as dist_autograd
        from torch.distributed.optim import DistributedOptimizer

        return _ps_steps(rpc, dist_autograd, DistributedOptimizer, "worker1", iters)
    if case == "batch":
        start = time.perf_counter()
        for _ in range(iters):
            futs = [rpc.rpc_async("worker1", _batch_put, (i,)) for i in range(BATCH)]
            if torch.futures.wait_all(futs) != [BATCH * (BATCH - 1) // 2] * BATCH:
                raise RuntimeError("wrong result")
        return time.perf_counter() - start
    fn = noop  # also for noop_async: torch cannot run a coroutine function
    if case == "tensor":
        t = torch.ones(TENSOR_NUMEL)
        start = time.perf_counter()
        for _ in range(iters):
            if rpc.rpc_sync("worker1", numel, (t,)) != TENSOR_NUMEL:
                raise RuntimeError("wrong result")
        return time.perf_counter() - start
    if case == "window":
        start = time.perf_counter()
        window: collections.deque[Any] = collections.deque()
        for _ in range(iters):
            if len(window) >= WINDOW:
                window.popleft().wait()
            window.append(rpc.rpc_async("worker1", fn))
        for fut in window:
            fut.wait()
        return time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(iters):
        rpc.rpc_sync("worker1", fn)
    return time.perf_counter() - start


def aiodist_main(conn: Connection | None, rank: int, port: int) -> None:
    """An aiodist rank (uvloop): the master serves the parent's batches; the worker serves calls."""
    _rank_setup()
    _SYSTEM.append("aiodist")
    import anyio
    import uvloop

    anyio.run(
        _aiodist_rank, conn, rank, port, backend_options={"loop_factory": uvloop.new_event_loop}
    )


async def _aiodist_rank(conn: Connection | None, rank: int, port: int) -> None:
    import anyio

    import aiodist
    import aiodist.rpc as rpc

    await aiodist.init_process_group(
        init_method=f"tcp://{HOST}:{port}",
        world_size=2,
        rank=rank,
        group_name=f"bench-rpc-{port}",
        timeout=BATCH_TIMEOUT,
        heartbeat_timeout=3600.0,  # stopped (SIGSTOP) during torch's turns
    )
    if conn is not None:
        conn.send("up")
        while True:
            try:
                command = await anyio.to_thread.run_sync(conn.recv)
            except EOFError:
                break
            if command is None:
                break
            try:
                conn.send(await _aiodist_batch(rpc, *command))
            except Exception as exc:
                conn.send(f"error: {''.join(traceback.format_exception_only(exc)).strip()}")
    await rpc.shutdown()
    await aiodist.destroy_process_group()


async def _aiodist_batch(rpc: Any, case: str, iters: int) -> float:
    import anyio
    import torch

    if case == "ps_step":  # plain code, as torch's: in a thread, off the event loop
        import aiodist.rpc.dist_autograd as dist_autograd
        from aiodist.rpc.optim import DistributedOptimizer

        return await anyio.to_thread.run_sync(
            _ps_steps, rpc, dist_autograd, DistributedOptimizer, 1, iters
        )
    if case == "batch":
        start = time.perf_counter()
        for _ in range(iters):
            works = [rpc.rpc_async(1, _batch_put, (i,)) for i in range(BATCH)]
            for work in works:
                if await work != BATCH * (BATCH - 1) // 2:
                    raise RuntimeError("wrong result")
        return time.perf_counter() - start
    fn = anoop if case == "noop_async" else noop
    if case == "tensor":
        t = torch.ones(TENSOR_NUMEL)
        start = time.perf_counter()
        for _ in range(iters):
            if await rpc.rpc_async(1, numel, (t,)) != TENSOR_NUMEL:
                raise RuntimeError("wrong result")
        return time.perf_counter() - start
    if case == "window":
        start = time.perf_counter()
        window: collections.deque[Any] = collections.deque()
        for _ in range(iters):
            if len(window) >= WINDOW:
                await window.popleft()
            window.append(rpc.rpc_async(1, fn))
        for work in window:
            await work
        return time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(iters):
        await rpc.rpc_async(1, fn)
    return time.perf_counter() - start


def _serve_parent(conn: Connection, batch: Any) -> None:
    conn.send("up")
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        if command is None:
            return
        try:
            conn.send(batch(*command))
        except Exception as exc:
            conn.send(f"error: {''.join(traceback.format_exception_only(exc)).strip()}")


# --- the parent ---------------------------------------------------------------------------------


class Pair:
    """One system's two ranks: the master driven over a pipe, the worker serving."""

    def __init__(self, ctx: ForkServerContext, system: System) -> None:
        self.system = system
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        target = aiodist_main if system == "aiodist" else torch_main
        parent_end, child_end = ctx.Pipe()
        self._conn = parent_end
        self._procs: list[ForkServerProcess] = []
        for rank, conn in ((0, child_end), (1, None)):
            proc = ctx.Process(
                target=target, args=(conn, rank, port), name=f"{system}-{rank}", daemon=True
            )
            proc.start()
            self._procs.append(proc)
        child_end.close()
        self.stopped = False

    def wait_up(self) -> None:
        if self._recv(STARTUP_TIMEOUT) != "up":
            raise RuntimeError(f"{self.system}: unexpected start-up message")

    def _recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.system} master did not answer within {timeout:.0f} s")
        return self._conn.recv()

    def batch(self, case: str, iters: int) -> float:
        self.resume()
        self._conn.send((case, iters))
        out = self._recv(BATCH_TIMEOUT)
        if isinstance(out, str):
            raise RuntimeError(f"{self.system} {case}: {out}")
        return float(out)

    def pause(self) -> None:
        if not self.stopped:
            for proc in self._procs:
                if proc.pid is not None:
                    os.kill(proc.pid, signal.SIGSTOP)
            self.stopped = True

    def resume(self) -> None:
        if self.stopped:
            for proc in self._procs:
                if proc.pid is not None:
                    os.kill(proc.pid, signal.SIGCONT)
            self.stopped = False

    def close(self) -> None:
        self.resume()
        with contextlib.suppress(OSError):
            self._conn.send(None)
        for proc in self._procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self._conn.close()


def _measure(pairs: dict[System, Pair], case: str, n_pairs: int, target: float) -> dict[str, Any]:
    """Warm both up, then ``n_pairs`` alternating pairs of batches; plain data."""
    iters: dict[System, int] = {}
    for system in SYSTEMS:
        pairs[SYSTEMS[1] if system == SYSTEMS[0] else SYSTEMS[0]].pause()
        warm = 8 * WINDOW if case == "window" else 20
        pairs[system].batch(case, warm)  # checks results, connects, fills caches
        once = pairs[system].batch(case, warm) / warm
        iters[system] = max(WINDOW if case == "window" else 5, min(100_000, round(target / once)))
    seconds: dict[System, list[float]] = {s: [] for s in SYSTEMS}
    ratios: list[float] = []
    for k in range(n_pairs):
        order = SYSTEMS if k % 2 == 0 else SYSTEMS[::-1]
        per_call: dict[System, float] = {}
        for system in order:
            pairs[order[1] if system == order[0] else order[0]].pause()
            per_call[system] = pairs[system].batch(case, iters[system]) / iters[system]
            seconds[system].append(per_call[system])
        ratios.append(per_call["aiodist"] / per_call["torch"])
    return {
        "case": case,
        "iters": iters,
        "per_call_s": seconds,
        "summary_s": {s: summarize(seconds[s]) for s in SYSTEMS},
        "time_ratios": ratios,
        "time_ratio": statistics.median(ratios),
        "ratio_summary": summarize(ratios),
    }


def bench(
    n_pairs: int, batch_ms: float, cases: Sequence[str] = CASES, mode: Mode = "full"
) -> dict[str, Any]:
    """Measure every case; plain data (ratios are aiodist/torch times: below 1 is faster)."""
    for key, value in {"RES_OPTIONS": "use-vc", "TORCH_CPP_LOG_LEVEL": "ERROR"}.items():
        os.environ.setdefault(key, value)  # see _servers.DNS_WORKAROUND
    os.environ.setdefault("AIODIST_JOB_ID", f"bench-rpc-{uuid.uuid4().hex[:8]}")
    ctx = rank_context()
    results: list[dict[str, Any]] = []
    started = now()
    with contextlib.ExitStack() as stack:
        pairs: dict[System, Pair] = {}
        for system in SYSTEMS:
            pairs[system] = Pair(ctx, system)
            stack.callback(pairs[system].close)
        for pair in pairs.values():
            pair.wait_up()
        for case in cases:
            try:
                results.append(_measure(pairs, case, n_pairs, batch_ms / 1e3))
            except (RuntimeError, TimeoutError, OSError) as exc:
                results.append({"case": case, "error": str(exc)})
    return {
        "config": {"pairs": n_pairs, "batch_ms": batch_ms, "window": WINDOW, "mode": mode},
        "results": results,
        "wall_s": now() - started,
    }


_TITLES: Final = {
    "noop": "no-op round trip",
    "noop_async": "no-op round trip, coroutine (torch: plain)",
    "window": f"no-op calls/s, {WINDOW} in flight",
    "tensor": "4 MiB tensor argument round trip",
    "ps_step": "parameter-server step (dist autograd, DistributedOptimizer)",
    "batch": f"async_execution batch of {BATCH} calls",
}


def _cell(case: str, s: Any) -> str:
    if s is None:
        return "-"
    if case == "window":
        return f"{1 / s.median:,.0f}/s ({1 / s.max:,.0f}-{1 / s.min:,.0f})"
    scale, unit = (1e3, "ms") if s.median >= 1e-3 else (1e6, "µs")
    return f"{s.median * scale:.1f} {unit} ({s.min * scale:.1f}-{s.max * scale:.1f})"


def rows(data: dict[str, Any]) -> list[list[str]]:
    """One row per case: aiodist, torch, ratio (spread); for the text and Markdown tables."""
    from benchmarks._common import as_summary

    out = []
    for res in data["results"]:
        case = res["case"]
        if "error" in res:
            out.append([_TITLES[case], f"failed: {res['error'][:60]}", "", ""])
            continue
        a = as_summary(res["summary_s"]["aiodist"])
        t = as_summary(res["summary_s"]["torch"])
        r = as_summary(res["ratio_summary"])
        assert r is not None
        if case == "window":
            ratio = f"{1 / res['time_ratio']:.2f}x calls/s ({1 / r.max:.2f}-{1 / r.min:.2f})"
        else:
            ratio = f"{res['time_ratio']:.2f}x time ({r.min:.2f}-{r.max:.2f})"
        out.append([_TITLES[case], _cell(case, a), _cell(case, t), ratio])
    return out


def render(data: dict[str, Any]) -> str:
    cfg = data["config"]
    head = (
        f"aiodist.rpc vs torch.distributed.rpc (TensorPipe), 2 ranks, {cfg['pairs']} alternating "
        f"pairs of ~{cfg['batch_ms']:.0f} ms batches; median (min-max); ratio = aiodist/torch "
        "per pair, its median (min-max)"
    )
    return head + "\n" + format_table(["case", "aiodist", "torch", "aiodist/torch"], rows(data))


def goal_list(data: dict[str, Any]) -> list[Goal]:
    by_case = {r["case"]: r for r in data["results"] if "error" not in r}
    rtt = by_case.get("noop", {}).get("time_ratio")
    window = by_case.get("window", {}).get("time_ratio")
    return [
        Goal.judge("rpc no-op round trip", "time aiodist/torch", "<=", 0.5, rtt, "issue 23"),
        Goal.judge(
            f"rpc calls/s, {WINDOW} in flight",
            "calls/s aiodist/torch",
            ">=",
            2.0,
            None if window is None or not window else 1 / window,
            "issue 23",
        ),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_rpc", description=__doc__)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--smoke", action="store_true")
    parser.add_argument("--pairs", type=int, help="alternating pairs of batches per case")
    parser.add_argument("--batch-ms", type=float, help="wanted duration of one batch")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = parser.parse_args(argv)
    mode: Mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    data = bench(
        args.pairs or DEFAULT_PAIRS[mode],
        args.batch_ms or DEFAULT_BATCH_MS[mode],
        args.cases,
        mode,
    )
    print(render(data))
    print(goal_table(goal_list(data)))
    print(f"results: {write_results('rpc', data)}")
    if any(math.isnan(r.get("time_ratio", 0.0)) for r in data["results"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
