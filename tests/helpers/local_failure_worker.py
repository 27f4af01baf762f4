"""One rank of a job whose rank 1 fails locally in each kind of operation (test_local_failures).

Usage: ``python tests/helpers/local_failure_worker.py MODE URL RANK WORLD_SIZE`` with MODE
``async`` (the awaitable API) or ``sync`` (``aiodist.sync``). In every scenario
each rank starts a *first* call, in which rank 1 fails on its own rank (an
object that cannot be pickled, a bad argument), then a *second* call, and only
then waits for both: the way a rank's next call could take the failed call's
place. The last line printed is a JSON report: per scenario and rank, how the
first and second calls ended and how long the scenario took.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

import anyio
import torch

import aiodist

LOCK = threading.Lock()  # cannot be pickled
NOT_A_TENSOR: Any = "not a tensor"  # a bad argument, passed where a tensor belongs
LARGE = 1 << 20  # float32 elements: 4 MiB, the shared-memory path on one host


def ended(outcome: Any) -> Any:
    """A JSON-able record of a result, or of the error that ended the call."""
    if isinstance(outcome, BaseException):
        return ["error", type(outcome).__name__, getattr(outcome, "rank", None), str(outcome)]
    if isinstance(outcome, torch.Tensor):
        return ["ok", outcome.tolist() if outcome.numel() <= 8 else float(outcome.sum())]
    if isinstance(outcome, list) and outcome and isinstance(outcome[0], torch.Tensor):
        return ["ok", [x.tolist() for x in outcome]]
    if isinstance(outcome, dict):
        return ["ok", {k: v.tolist() for k, v in outcome.items()}]
    return ["ok", outcome]


async def settle(work: Any) -> Any:
    try:
        return ended(await work)
    except Exception as exc:
        return ended(exc)


def start(fn: Any) -> Any:
    """Call ``fn`` (which starts an operation); a local error is the outcome."""
    try:
        return fn()
    except Exception as exc:
        return exc


async def call(fn: Any) -> Any:
    """Start ``fn()`` and wait for it: how it ended, whether at the call or later."""
    w = start(fn)
    return ended(w) if isinstance(w, BaseException) else await settle(w)


async def pair(first: Any, second: Any) -> dict[str, Any]:
    """Start ``first()`` then ``second()``, then wait for both."""
    a = start(first)
    b = start(second)
    out = {}
    for name, w in (("first", a), ("second", b)):
        out[name] = ended(w) if isinstance(w, BaseException) else await settle(w)
    return out


async def scenarios(rank: int) -> dict[str, Any]:
    bad = rank == 1
    store = aiodist.get_store()
    report: dict[str, Any] = {}

    async def run(name: str, body: Any) -> None:
        began = time.monotonic()
        with anyio.fail_after(20):
            report[name] = await body()
        report[name]["seconds"] = time.monotonic() - began
        await aiodist.barrier()  # scenarios never overlap

    await run(
        "object",
        lambda: pair(
            lambda: aiodist.all_gather_object(LOCK if bad else f"first-{rank}"),
            lambda: aiodist.all_gather_object(f"second-{rank}"),
        ),
    )

    async def object_late() -> dict[str, Any]:
        # Ranks 0 and 2 make the call only after rank 1 aborted it: they fail at once.
        if bad:
            first = ended(start(lambda: aiodist.all_gather_object(LOCK)))
            await store.set("late/aborted", b"1")
            second = await settle(aiodist.all_gather_object(f"second-{rank}"))
            return {"first": first, "second": second}
        await store.wait(["late/aborted"])
        return await pair(
            lambda: aiodist.all_gather_object(f"first-{rank}"),
            lambda: aiodist.all_gather_object(f"second-{rank}"),
        )

    await run("object_late", object_late)
    await run(
        "broadcast_object",
        lambda: pair(
            lambda: aiodist.broadcast_object_list([LOCK if bad else None], src=1),
            lambda: aiodist.broadcast_object_list([f"second-{rank}"], src=1),
        ),
    )
    await run(
        "tensor_small",
        lambda: pair(
            lambda: aiodist.all_reduce(NOT_A_TENSOR if bad else torch.full((4,), 1.0 + rank)),
            lambda: aiodist.all_reduce(torch.full((4,), 100.0 + rank)),
        ),
    )
    await run(
        "tensor_large",
        lambda: pair(
            lambda: aiodist.all_reduce(torch.full((LARGE,), 1.0), op="band" if bad else "sum"),
            lambda: aiodist.all_reduce(torch.full((LARGE,), 10.0 + rank)),
        ),
    )
    await run(
        "tensor_rooted",
        lambda: pair(
            lambda: aiodist.broadcast(torch.full((3,), 1.0), src=7 if bad else 1),
            lambda: aiodist.broadcast(torch.full((3,), 20.0 + rank), src=1),
        ),
    )

    async def p2p_object() -> dict[str, Any]:
        if rank == 1:
            first = ended(start(lambda: aiodist.isend_object(LOCK, dst=0)))
            return {"first": first, "second": await settle(aiodist.isend_object("second", dst=0))}
        if rank == 0:
            return await pair(
                lambda: aiodist.irecv_object(src=1), lambda: aiodist.irecv_object(src=1)
            )
        return {}

    await run("p2p_object", p2p_object)

    async def p2p_tensor() -> dict[str, Any]:
        if rank == 1:
            first = ended(start(lambda: aiodist.isend(NOT_A_TENSOR, dst=0)))
            second = await settle(aiodist.isend(torch.full((3,), 7.0), dst=0))
            return {"first": first, "second": second}
        if rank == 0:
            a, b = torch.zeros(3), torch.zeros(3)
            out = await pair(lambda: aiodist.irecv(a, src=1), lambda: aiodist.irecv(b, src=1))
            out["second_tensor"] = b.tolist()
            return out
        return {}

    await run("p2p_tensor", p2p_tensor)

    async def p2p_receive_fails() -> dict[str, Any]:
        # The receiver's own first call fails: it still takes the first message.
        if rank == 1:
            await aiodist.isend(torch.full((2,), 1.0), dst=0)
            await aiodist.isend(torch.full((2,), 2.0), dst=0)
            return {}
        if rank == 0:
            t = torch.zeros(2)
            out = await pair(
                lambda: aiodist.irecv(NOT_A_TENSOR, src=1),
                lambda: aiodist.irecv(t, src=1),
            )
            out["second_tensor"] = t.tolist()
            return out
        return {}

    await run("p2p_receive_fails", p2p_receive_fails)

    sub = await aiodist.new_group([1, 2])

    async def subgroup() -> dict[str, Any]:
        if rank == 0:
            return {}
        return await pair(
            lambda: aiodist.all_gather_object(LOCK if bad else f"first-{rank}", group=sub),
            lambda: aiodist.all_gather_object(f"second-{rank}", group=sub),
        )

    await run("subgroup", subgroup)

    async def new_group() -> dict[str, Any]:
        first: Any
        try:
            await aiodist.new_group([0, 0] if bad else [0, 2])
            first = ["ok", None]
        except Exception as exc:
            first = ended(exc)
        g = await aiodist.new_group([0, 2])
        second: Any = ["ok", None]
        if rank != 1:
            second = await settle(aiodist.all_reduce(torch.full((1,), 1.0 + rank), group=g))
        return {"first": first, "second": second, "group_id": g.group_id}

    await run("new_group", new_group)
    await run(
        "composite",
        lambda: pair(
            lambda: aiodist.all_reduce_dict(
                {"a": NOT_A_TENSOR}
                if bad
                else {"a": torch.ones(2), "n": torch.ones(1, dtype=torch.int64)}
            ),
            lambda: aiodist.all_reduce_dict({"a": torch.full((2,), 1.0 + rank)}),
        ),
    )

    async def cancelled() -> dict[str, Any]:
        # Rank 1 makes its call first and cancels the task awaiting it while the call
        # cannot have finished (the others have not made theirs): it still runs its course.
        if bad:
            work = aiodist.all_gather_object(f"first-{rank}")
            task = asyncio.ensure_future(_await(work))
            await asyncio.sleep(0)  # one loop turn: the task is now awaiting the call
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            first: Any = ["cancelled", task.cancelled(), work.is_completed()]
            await store.set("cancelled/waited", b"1")
        else:
            await store.wait(["cancelled/waited"])
            first = await settle(aiodist.all_gather_object(f"first-{rank}"))
        return {"first": first, "second": await settle(aiodist.all_gather_object(f"second-{rank}"))}

    await run("cancelled", cancelled)

    # Ranks that disagree on what a many-tensor call reduces: a mismatch on every
    # rank (the group breaks), never a wait or a later call's data. Last: it breaks.
    everyone = await aiodist.new_group([0, 1, 2])

    async def composite_mismatch() -> dict[str, Any]:
        data = {"a": torch.ones(2)}
        if bad:
            data["n"] = torch.ones(1, dtype=torch.int64)
        first = await call(lambda: aiodist.all_reduce_dict(data, group=everyone))
        return {
            "first": first,
            "second": await call(lambda: aiodist.all_reduce(torch.ones(1), group=everyone)),
        }

    began = time.monotonic()
    with anyio.fail_after(20):
        report["composite_mismatch"] = await composite_mismatch()
    report["composite_mismatch"]["seconds"] = time.monotonic() - began
    return report


async def _await(work: Any) -> Any:
    return await work


async def main_async(url: str, rank: int, world: int) -> None:
    await aiodist.init_process_group(
        init_method=url, world_size=world, rank=rank, group_name="local-failures"
    )
    report = await scenarios(rank)
    print(json.dumps(report), flush=True)
    await aiodist.destroy_process_group()


def main_sync(url: str, rank: int, world: int) -> None:
    import aiodist.sync as dist

    dist.init_process_group(
        init_method=url, world_size=world, rank=rank, group_name="local-failures-sync"
    )
    bad = rank == 1
    report: dict[str, Any] = {}

    def run(name: str, first: Any, second: Any) -> None:
        began = time.monotonic()
        out = {}
        for key, fn in (("first", first), ("second", second)):
            try:
                out[key] = ended(fn())
            except Exception as exc:
                out[key] = ended(exc)
        out["seconds"] = time.monotonic() - began
        report[name] = out
        dist.barrier()

    run(
        "object",
        lambda: dist.all_gather_object(LOCK if bad else f"first-{rank}"),
        lambda: dist.all_gather_object(f"second-{rank}"),
    )
    # async_op=True: the first call's handle is held while the second starts.
    began = time.monotonic()
    handles: list[Any] = []
    out: dict[str, Any] = {}
    for key, obj in (("first", LOCK if bad else f"first-{rank}"), ("second", f"second-{rank}")):
        try:
            handles.append((key, dist.all_gather_object(obj, async_op=True)))
        except Exception as exc:
            out[key] = ended(exc)
    for key, work in handles:
        try:
            out[key] = ended(work.wait())
        except Exception as exc:
            out[key] = ended(exc)
    out["seconds"] = time.monotonic() - began
    report["object_async_op"] = out
    dist.barrier()
    run(
        "tensor_small",
        lambda: dist.all_reduce(NOT_A_TENSOR if bad else torch.full((4,), 1.0 + rank)),
        lambda: dist.all_reduce(torch.full((4,), 100.0 + rank)),
    )
    if rank in (0, 1):
        run(
            "p2p_object",
            (lambda: dist.isend_object(LOCK, dst=0)) if bad else (lambda: dist.irecv_object(src=1)),
            (lambda: dist.isend_object("second", dst=0))
            if bad
            else (lambda: dist.irecv_object(src=1)),
        )
    else:
        dist.barrier()
    sub = dist.new_group([1, 2])
    if rank != 0:
        run(
            "subgroup",
            lambda: dist.all_gather_object(LOCK if bad else f"first-{rank}", group=sub),
            lambda: dist.all_gather_object(f"second-{rank}", group=sub),
        )
    else:
        dist.barrier()
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, url, rank_, world_ = sys.argv[1:5]
    if mode == "async":
        options: dict[str, Any] = {}
        if os.environ.get("WORKER_LOOP") == "uvloop":
            import uvloop

            options["loop_factory"] = uvloop.new_event_loop
        anyio.run(main_async, url, int(rank_), int(world_), backend_options=options)
    else:
        main_sync(url, int(rank_), int(world_))
