"""A master-worker job (``tests/integration/test_master_worker.py``): ``CASE`` names what it checks.

Rank 0 (the master) runs the case and prints one JSON line ``{"rank": 0, "checks":
{name: "ok" or what went wrong}}``; each worker prints ``{"rank": r, "pid": ...,
"returned": ...}`` once ``init_master_worker`` returned (or what it raised).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import anyio
import torch

import aiodist
from aiodist import remote

CASE = sys.argv[1]
# torch's functions take remote tensors (``__torch_function__``); its stubs say Tensor only.
matmul: Any = torch.matmul
checks: dict[str, str] = {}


def same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)
    if isinstance(want, list | tuple):
        return (
            isinstance(got, list | tuple)
            and len(got) == len(want)
            and all(same(g, w) for g, w in zip(got, want, strict=True))
        )
    return bool(got == want)


def check(name: str, got: Any, want: Any) -> None:
    checks[name] = "ok" if same(got, want) else f"got {got!r}, want {want!r}"


def expect_error(name: str, fn: Any, kind: type[BaseException], *words: str) -> None:
    try:
        fn()
    except kind as exc:
        missing = [w for w in words if w not in str(exc)]
        checks[name] = "ok" if not missing else f"{exc!r} does not say {missing}"
    else:
        checks[name] = f"no {kind.__name__}"


async def raises(name: str, work: Any, kind: type[BaseException], *words: str) -> None:
    try:
        await work
    except kind as exc:
        missing = [w for w in words if w not in str(exc)]
        checks[name] = "ok" if not missing else f"{exc!r} does not say {missing}"
    else:
        checks[name] = f"no {kind.__name__}"


async def operations() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(5, 4), torch.randn(4, 3)
    # Made on a worker, or sent there; shape, dtype, node and device known at once.
    x = remote.send(a)
    y = remote.send(b)
    z = remote.FloatTensor(20, 20).fill_(4)
    check("metadata", (tuple(z.shape), z.dtype, z.get_node(), z.get_device()),
          ((20, 20), torch.float32, 1, -1))  # fmt: skip
    check("full", await remote.full((2, 3), 7.0).fetch(), torch.full((2, 3), 7.0))
    check("arange", await remote.arange(6).fetch(), torch.arange(6))
    check("zeros like the design", await z.fetch(), torch.full((20, 20), 4.0))
    # Operators, functions, methods, properties, several results, in place, indexing.
    check("operators", await (x * 2 - 1).fetch(), a * 2 - 1)
    check("matmul", await matmul(x, y).fetch(), torch.matmul(a, b))
    check("@", await (x @ y).fetch(), a @ b)
    check("method", await x.sum(dim=0).fetch(), a.sum(dim=0))
    check("property", await x.T.fetch(), a.T)
    values, indices = x.max(dim=1)
    check("two results", [await values.fetch(), await indices.fetch()], list(a.max(dim=1)))
    w = remote.send(a)
    w.add_(1).mul_(3)
    w[0] = 0.5
    local = (a + 1) * 3
    local[0] = 0.5
    check("in place", await w.fetch(), local)
    check("index", await w[1:3, 2].fetch(), local[1:3, 2])
    check("shape from values", await (x > 0).nonzero().fetch(), (a > 0).nonzero())
    check("query", (x.size(1), x.dim(), x.numel()), (4, 2, 20))
    # A shape mismatch raises at once, as torch's does; values need a fetch.
    expect_error("mismatch at once", lambda: x @ x, RuntimeError, "[5, 4] X [5, 4]")
    expect_error("item needs a fetch", lambda: x.sum().item(), RuntimeError, "fetch")
    # Operands on two workers: the result runs on the first's; the other moves there.
    with remote.node(2):
        c = remote.send(b) + 1
    check("other node", c.get_node(), 2)
    moved = matmul(x, c)
    check("moved operand", (moved.get_node(), await moved.fetch()), (1, torch.matmul(a, b + 1)))
    # Issue order within a stream: a chain whose result depends on its order.
    chain, expected = remote.ones(3), torch.ones(3)
    for step in range(60):
        if step % 2:
            chain.mul_(3)
            expected.mul_(3)
        else:
            chain.sub_(1)
            expected.sub_(1)
    check("stream order", await chain.fetch(), expected)
    # Events: worker 2's default stream and worker 1's wait for a slow stream of worker 2.
    slow = remote.Stream(2)
    with remote.node(2):
        result = remote.zeros(400, 400)
    with remote.stream(slow):
        big = remote.ones(400, 400) / 400
        for _ in range(40):
            big = torch.tanh(big @ big + 1)
        result.copy_(big)
        reached = remote.Event()
        reached.record()
    reached.wait(remote.current_stream(2))
    reached.wait(remote.current_stream(1))
    after = remote.zeros(1) + 1  # on worker 1, behind the wait
    local = torch.ones(400, 400) / 400
    for _ in range(40):
        local = torch.tanh(local @ local + 1)
    await after.fetch()
    check("event across workers", await reached.query(), True)  # reached before ``after`` ran
    # Worker 2's default stream pushes ``result`` once the slow stream wrote it.
    check("event on one worker", await (remote.zeros(400, 400, node=1) + result).fetch(), local)
    # A failure on a worker: raised at the sync points that meet it, naming both.
    bad = torch.linalg.cholesky(remote.zeros(3, 3) - 1)
    after_bad = bad + 1
    good = remote.ones(2) * 2
    await raises("error at fetch", bad.fetch(), aiodist.RemoteError, "cholesky", "worker 1")
    await raises("error of what uses it", after_bad.fetch(), aiodist.RemoteError, "cholesky")
    check("others go on", await good.fetch(), torch.full((2,), 2.0))
    await raises("error at synchronize", remote.synchronize(), aiodist.RemoteError, "cholesky")
    await remote.synchronize()
    checks["synchronize again"] = "ok"
    # A worker frees what the master dropped.
    before = await remote.held_tensors()
    extra = [remote.zeros(100) for _ in range(10)]
    during = await remote.held_tensors()
    del extra
    after_free = await remote.held_tensors()
    check("freed", (during[1] - before[1], after_free[1] - before[1]), (10, 0))


async def killed() -> None:
    alive = remote.ones(4, node=1)
    doomed = remote.ones(4, node=2) * 5
    check("before", await doomed.fetch(), torch.full((4,), 5.0))
    remote.full((1,), 9, dtype=torch.int64, node=2).apply_(os._exit)  # worker 2 dies
    pending = doomed + 1
    await raises("pending on the dead worker", pending.fetch(), aiodist.RankFailedError, "rank 2")
    await raises("held by the dead worker", doomed.fetch(), aiodist.RankFailedError, "rank 2")
    check("the others go on", await (alive * 3).fetch(), torch.full((4,), 3.0))
    later = remote.zeros(2, node=2)
    await raises("new on the dead worker", later.fetch(), aiodist.RankFailedError, "rank 2")


def plain() -> None:
    import aiodist.sync as dist

    if not dist.init_master_worker():
        print(json.dumps({"rank": int(os.environ["RANK"]), "pid": os.getpid(), "returned": False}))
        return
    a = torch.arange(6.0).reshape(2, 3)
    x = remote.send(a)
    check("plain fetch", (x * x).fetch(), a * a)
    with remote.node(2):
        y = remote.full((3,), 2.0)
    check("plain moved", (x @ y).fetch(), a @ torch.full((3,), 2.0))
    ev = remote.Event()
    ev.record(remote.current_stream(2))
    ev.synchronize()
    remote.synchronize()
    checks["plain sync points"] = "ok"
    print(json.dumps({"rank": 0, "checks": checks}), flush=True)
    dist.destroy_process_group()


async def main() -> None:
    started = time.monotonic()
    try:
        is_master = await aiodist.init_master_worker(timeout=60)
    except Exception as exc:
        print(json.dumps({"rank": int(os.environ["RANK"]), "raised": repr(exc)}), flush=True)
        return
    if not is_master:
        print(json.dumps({"rank": int(os.environ["RANK"]), "pid": os.getpid(), "returned": False}))
        return
    await {"operations": operations, "killed": killed}[CASE]()
    print(json.dumps({"rank": 0, "checks": checks, "s": time.monotonic() - started}), flush=True)
    await aiodist.destroy_process_group()


if __name__ == "__main__":
    if CASE == "plain":
        plain()
    else:
        anyio.run(main)
