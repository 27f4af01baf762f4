"""One rank of a remote-call scenario, run as a subprocess by test_rpc.py.

Usage: ``python tests/helpers/rpc_worker.py SCENARIO RANK WORLD_SIZE PORT``. Rank 0
embeds the rendezvous server at ``tcp://127.0.0.1:PORT`` and is the master;
the others serve calls. Every rank prints one JSON line last. The functions
the master calls live here, at module level: every rank runs this same
script, so they are ``__main__.<name>`` everywhere.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import anyio
import numpy as np
import torch

import aiodist
import aiodist.rpc as rpc
import aiodist.sync as dist
from aiodist._rpc.agent import default_agent

# --- functions called remotely ----------------------------------------------------------------


def add(a: Any, b: Any) -> Any:
    return a + b


async def async_add(a: Any, b: Any = 0) -> Any:
    await asyncio.sleep(0.01)
    return a + b


def returns_coroutine(x: int) -> Any:
    return async_add(x, 1)  # a plain function handing back a coroutine: awaited there


def whoami() -> dict[str, Any]:
    return {
        "rank": aiodist.get_rank(),
        "thread": threading.current_thread().name,
        "loop": _on_loop(),
    }


async def async_whoami() -> dict[str, Any]:
    return {"rank": aiodist.get_rank(), "thread": threading.current_thread().name}


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def echo(x: Any) -> Any:
    return x


def tensor_stats(t: torch.Tensor) -> list[Any]:
    return [float(t.sum()), list(t.shape), str(t.dtype), t.is_contiguous()]


def scaled(t: torch.Tensor, k: float) -> torch.Tensor:
    return t * k


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


def swap(p: Point) -> Point:
    return Point(p.y, p.x)


def nested_plain(to: int, x: int) -> Any:
    # A plain function in an rpc thread makes a blocking call of its own.
    return rpc.rpc_sync(to, add, (x, 100))


async def nested_async(to: int, x: int) -> Any:
    return await rpc.rpc_async(to, add, (x, 1000))


# Concurrency: calls that return only once `n` of them run at the same time.
_BARRIERS: dict[str, threading.Barrier] = {}


class _Meeting:
    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.count = 0


_GATHER: dict[str, _Meeting] = {}


def meet_in_threads(name: str, n: int) -> str:
    barrier = _BARRIERS.setdefault(name, threading.Barrier(n))
    barrier.wait(timeout=20)  # BrokenBarrierError unless n run concurrently
    return threading.current_thread().name


async def meet_on_loop(name: str, n: int) -> int:
    meeting = _GATHER.setdefault(name, _Meeting())
    meeting.count += 1
    if meeting.count == n:
        meeting.event.set()
    await asyncio.wait_for(meeting.event.wait(), 20)
    return n


_RELEASE = threading.Event()


def block_until_released() -> str:
    if not _RELEASE.wait(30):
        raise TimeoutError("never released")
    return "released"


def release() -> None:
    _RELEASE.set()


# Errors.
class CustomError(Exception):
    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


def fail(kind: str) -> None:
    if kind == "value":
        raise ValueError("bad value 42")
    if kind == "custom":
        raise CustomError("custom failure", code=7)
    if kind == "local":

        class LocalError(Exception):  # neither importable nor picklable on the caller
            pass

        raise LocalError("from a local class")
    if kind == "exit":
        sys.exit(3)
    if kind == "key":
        raise KeyError("missing")


async def async_fail() -> None:
    await asyncio.sleep(0)
    raise ZeroDivisionError("async division")


def unpicklable_result() -> Any:
    return threading.Lock()


# Timeouts and cancellation.
_CANCELLED: dict[str, asyncio.Event] = {}
_STARTED: list[str] = []


async def wait_forever(key: str) -> None:
    event = _CANCELLED.setdefault(key, asyncio.Event())
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        event.set()
        raise


async def was_cancelled(key: str) -> bool:
    event = _CANCELLED.setdefault(key, asyncio.Event())
    await asyncio.wait_for(event.wait(), 10)
    return True


def record_start(key: str) -> str:
    _STARTED.append(key)
    return key


def started() -> list[str]:
    return list(_STARTED)


# Remote references.
_DELETED: list[str] = []
_KEPT: list[Any] = []


class Tracked:
    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0

    def __del__(self) -> None:
        _DELETED.append(self.name)

    def add(self, k: int) -> int:
        self.count += k
        return self.count

    async def get_name(self) -> str:
        await asyncio.sleep(0)
        return self.name

    def twice(self) -> str:
        return self.name * 2


class SlowTracked(Tracked):
    def __init__(self, name: str) -> None:
        time.sleep(0.3)  # still being made when the method call arrives
        super().__init__(name)


async def deleted(name: str) -> bool:
    # Releases travel on their own: give one a moment to arrive (no fixed sleep decides it).
    for _ in range(200):
        gc.collect()
        if name in _DELETED:
            return True
        await asyncio.sleep(0.05)
    return False


def deleted_now(name: str) -> bool:
    gc.collect()
    return name in _DELETED


def keep(ref: Any) -> str:
    _KEPT.append(ref)
    return repr(ref)


def use_kept(k: int) -> int:
    return int(_KEPT[0].rpc_sync().add(k))


def drop_kept() -> None:
    _KEPT.clear()
    gc.collect()


def owned_count() -> int:
    return len(default_agent("owned_count").server.owned)


# Death.
def die(how: str) -> None:
    if how == "exit":
        os._exit(17)
    os.kill(os.getpid(), signal.SIGSTOP)  # a frozen host: only heartbeats tell


# --- the scenarios ------------------------------------------------------------------------------


async def _outcome(work: Any) -> list[Any]:
    try:
        return ["ok", await work]
    except Exception as exc:
        cause = exc.__cause__
        return [
            type(exc).__name__,
            getattr(exc, "rank", getattr(cause, "rank", None)),
            str(exc),
            getattr(cause, "exc_type", getattr(exc, "exc_type", None)),
        ]


async def values(world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["plain"] = await rpc.rpc_async(1, add, (2, 3))
    out["async_kwargs"] = await rpc.rpc_async(2, async_add, (2,), {"b": 5})
    out["returns_coroutine"] = await rpc.rpc_async(1, returns_coroutine, (4,))
    out["self"] = await rpc.rpc_async(0, add, ("a", "b"))
    out["builtin"] = await rpc.rpc_async(1, sum, ([1, 2, 3],))
    out["whoami"] = await rpc.rpc_async(1, whoami)
    out["async_whoami"] = await rpc.rpc_async(1, async_whoami)
    sent = {"t": (1, 2.5, "x", None, b"\x00"), "l": [True, {3: 4}], "big": 2**70}
    got = await rpc.rpc_async(2, echo, (sent,))
    out["types"] = got == sent and isinstance(got["t"], tuple) and isinstance(got["t"][4], bytes)
    out["point"] = await rpc.rpc_async(1, swap, (Point(1, 2),)) == Point(2, 1)
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: travels beside the pickle
    small = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    strided = torch.arange(1 << 18, dtype=torch.float64).reshape(512, 512).t()  # 2 MiB view
    out["tensor_args"] = await rpc.rpc_async(1, tensor_stats, (big,))
    out["tensor_expected"] = [float(big.sum()), [1 << 20], "torch.float32", True]
    out["strided"] = await rpc.rpc_async(2, tensor_stats, (strided,))
    out["strided_expected"] = [float(strided.sum()), [512, 512], "torch.float64", True]
    back = await rpc.rpc_async(2, scaled, (big,), {"k": 2.0})
    out["tensor_result"] = bool(torch.equal(back, big * 2))
    mixed = await rpc.rpc_async(1, echo, ({"big": big, "small": small, "p": Point(0, 1)},))
    out["mixed"] = bool(torch.equal(mixed["big"], big) and torch.equal(mixed["small"], small))
    arr = np.arange(10, dtype=np.int16)
    out["numpy"] = bool(np.array_equal(await rpc.rpc_async(2, echo, (arr,)), arr))
    out["nested_plain"] = await rpc.rpc_async(1, nested_plain, (2, 5))
    out["nested_async"] = await rpc.rpc_async(2, nested_async, (1, 5))
    # Plain code in another thread: rpc_sync starts the call on the loop and blocks.
    out["from_thread"] = await anyio.to_thread.run_sync(lambda: rpc.rpc_sync(2, add, (40, 2)))
    out["from_thread_async"] = await anyio.to_thread.run_sync(
        lambda: rpc.rpc_async(1, add, (1, 1)).wait(timeout=30)
    )
    try:
        rpc.rpc_sync(1, add, (1, 2))
    except RuntimeError as exc:
        out["sync_on_loop"] = str(exc)
    many = [rpc.rpc_async(1 + i % (world - 1), add, (i, i)) for i in range(300)]
    out["many"] = [await w for w in many] == [2 * i for i in range(300)]
    return out


async def concurrency(world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n = 6
    threads = [rpc.rpc_async(1, meet_in_threads, ("t", n)) for _ in range(n)]
    out["threads"] = sorted({str(name) for name in [await w for w in threads]})
    coros = [rpc.rpc_async(2, meet_on_loop, ("c", n)) for _ in range(n)]
    out["coroutines"] = [await w for w in coros]
    # A plain call blocks in its thread; the loop and other calls go on meanwhile.
    blocked = rpc.rpc_async(1, block_until_released)
    out["meanwhile_async"] = await rpc.rpc_async(1, async_add, (1, 2))
    out["meanwhile_plain"] = await rpc.rpc_async(1, add, (3, 4))
    out["blocked_still_running"] = not blocked.is_completed()
    await rpc.rpc_async(1, release)
    out["blocked"] = await blocked
    return out


async def errors(world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("value", "custom", "local", "exit", "key"):
        out[kind] = await _outcome(rpc.rpc_async(1, fail, (kind,)))
    out["custom_code"] = None
    try:
        await rpc.rpc_async(1, fail, ("custom",))
    except CustomError as exc:
        out["custom_code"] = exc.code
    out["async"] = await _outcome(rpc.rpc_async(2, async_fail))
    out["unpicklable_result"] = await _outcome(rpc.rpc_async(2, unpicklable_result))
    # Refused at once, nothing sent; the job stays usable.
    refused: dict[str, Any] = {}
    for name, call in (
        ("outside", lambda: rpc.rpc_async(world, add, (1, 2))),
        ("negative", lambda: rpc.rpc_async(-1, add, (1, 2))),
        ("lambda", lambda: rpc.rpc_async(1, lambda: 1)),
        ("argument", lambda: rpc.rpc_async(1, echo, (threading.Lock(),))),
        ("not_callable", lambda: rpc.rpc_async(1, 42, ())),  # type: ignore[arg-type]
        ("huge_callable", lambda: rpc.rpc_async(1, functools.partial(echo, b"x" * (2 << 20)))),
    ):
        t0 = time.monotonic()
        try:
            call()  # type: ignore[no-untyped-call]
            refused[name] = "accepted"
        except (TypeError, ValueError) as exc:
            refused[name] = [type(exc).__name__, str(exc), time.monotonic() - t0]
    out["refused"] = refused
    out["usable_after"] = await rpc.rpc_async(1, add, (1, 2))
    # Timeouts: a coroutine is cancelled on the worker.
    t0 = time.monotonic()
    out["timeout"] = await _outcome(rpc.rpc_async(2, wait_forever, ("k",), timeout=0.5))
    out["timeout_s"] = time.monotonic() - t0
    out["cancelled_there"] = await rpc.rpc_async(2, was_cancelled, ("k",))
    # ...and a plain function that has not started yet never runs (one rpc thread on rank 1).
    blocked = rpc.rpc_async(1, block_until_released)
    queued = rpc.rpc_async(1, record_start, ("queued",), timeout=0.5)
    out["queued_timeout"] = await _outcome(queued)
    await rpc.rpc_async(1, release_async)
    out["blocked"] = await blocked
    out["started"] = await rpc.rpc_async(1, started)
    out["usable_after_timeout"] = await rpc.rpc_async(2, add, (2, 2))
    return out


async def release_async() -> None:
    _RELEASE.set()  # from the loop: rank 1's only rpc thread is the one blocked


async def rrefs(world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    a = rpc.remote(1, Tracked, ("a",))
    out["is_owner"] = a.is_owner()
    out["add"] = [await a.rpc_async().add(2), await a.rpc_async().add(3)]
    # Made by now: the owner answered remote() before the calls that waited for the object.
    out["owner"] = [a.owner().id, a.owner_name(), a.confirmed_by_owner()]
    out["get_name"] = await a.rpc_async().get_name()
    copy = await a.to_here()
    out["to_here"] = [type(copy).__name__, copy.name, copy.count]
    del copy
    twice = a.remote().twice()
    out["remote_method"] = [twice.owner().id, await twice.to_here()]
    del twice
    out["alive_while_held"] = not await rpc.rpc_async(1, deleted_now, ("a",))
    del a
    gc.collect()
    out["released"] = await rpc.rpc_async(1, deleted, ("a",))
    # A reference passed to another rank keeps the object alive after the creator drops its own.
    b = rpc.remote(1, Tracked, ("b",))
    out["kept_repr"] = await rpc.rpc_async(2, keep, (b,))
    del b
    gc.collect()
    out["alive_while_forwarded"] = not await rpc.rpc_async(1, deleted_now, ("b",))
    out["forwarded_use"] = await rpc.rpc_async(2, use_kept, (10,))
    await rpc.rpc_async(2, drop_kept)
    out["released_forwarded"] = await rpc.rpc_async(1, deleted, ("b",))
    # A call on an RRef keeps it alive until it completes, even if dropped meanwhile.
    slow = rpc.remote(1, SlowTracked, ("slow",))
    pending = slow.rpc_async().add(4)
    del slow
    gc.collect()
    out["method_after_drop"] = await pending
    out["released_slow"] = await rpc.rpc_async(1, deleted, ("slow",))
    out["owned_left"] = await rpc.rpc_async(1, owned_count)
    # Owned here; an error while making one; one still held when the job ends.
    mine = rpc.remote(0, Tracked, ("mine",))
    out["local_value"] = (await mine.to_here()).name
    out["local_value_direct"] = mine.local_value().name
    bad = rpc.remote(2, fail, ("value",))
    out["bad_to_here"] = await _outcome(bad.to_here())
    out["bad_method"] = await _outcome(bad.rpc_async().anything())
    out["kept_to_end"] = repr(rpc.remote(1, Tracked, ("end",)))
    _KEPT.append(rpc.remote(1, Tracked, ("end2",)))
    return out


async def death(world: int) -> dict[str, Any]:
    how = os.environ["RPC_DEATH"]
    out: dict[str, Any] = {}
    await rpc.rpc_async(2, add, (1, 1))  # connected
    pending: list[aiodist.Work[Any]] = [
        rpc.rpc_async(2, wait_forever, (f"p{i}",)) for i in range(3)
    ]
    pending.append(rpc.rpc_async(2, block_until_released))
    other = rpc.rpc_async(1, block_until_released)  # in flight on a worker that stays alive
    t0 = time.monotonic()
    dying = rpc.rpc_async(2, die, (how,))
    out["pending"] = [await _outcome(w) for w in [*pending, dying]]
    out["elapsed_s"] = time.monotonic() - t0
    # Failure isolation: rank 1 is unaffected by rank 2's death.
    await rpc.rpc_async(1, release)
    out["other"] = await _outcome(other)
    out["after"] = await _outcome_now(lambda: rpc.rpc_async(1, add, (1, 1)))
    out["to_dead"] = await _outcome_now(lambda: rpc.rpc_async(2, add, (1, 1)))
    return out


async def _outcome_now(start: Any) -> list[Any]:
    try:
        return await _outcome(start())
    except Exception as exc:
        return [type(exc).__name__, getattr(exc, "rank", None), str(exc), None]


async def shutdown_in_flight(world: int) -> dict[str, Any]:
    # The workers called shutdown first; these calls, and those they make, still complete.
    works: list[aiodist.Work[Any]] = [rpc.rpc_async(1, block_until_released) for _ in range(3)]
    works += [rpc.rpc_async(2, nested_async, (1, i)) for i in range(5)]
    works += [rpc.rpc_async(1, nested_plain, (2, i)) for i in range(5)]
    works.append(rpc.rpc_async(2, async_add, (1,), {"b": 1}))
    kept = rpc.remote(2, Tracked, ("to-the-end",))
    release_later = rpc.rpc_async(2, nested_release)  # rank 2 releases rank 1's calls
    await rpc.shutdown()
    out: dict[str, Any] = {"all_done": all(w.is_completed() for w in [*works, release_later])}
    out["results"] = [w.result() for w in works]
    out["after"] = await _outcome_now(lambda: rpc.rpc_async(1, add, (1, 1)))
    out["rref_after"] = await _outcome_now(lambda: kept.to_here())
    await rpc.shutdown()  # again: already done
    out["second_shutdown"] = True
    return out


async def nested_release() -> None:
    await asyncio.sleep(0.2)
    await rpc.rpc_async(1, release)


async def coordinator_death(world: int) -> dict[str, Any]:
    # The workers are in rpc.shutdown() already (rank 0 coordinates it): rank 0 dies.
    for dst in range(1, world):
        await rpc.rpc_async(dst, add, (dst, 1))  # connected
    die(os.environ["RPC_DEATH"])
    return {}


_GO: list[asyncio.Event] = []


def _go_event() -> asyncio.Event:
    if not _GO:
        _GO.append(asyncio.Event())
    return _GO[0]


async def go() -> None:
    _go_event().set()


async def leave_in_shutdown(world: int) -> dict[str, Any]:
    # Rank 2 leaves without rpc.shutdown once told to, which this call does as
    # rank 0 enters rpc.shutdown (main calls it next): the leave comes after.
    rpc.rpc_async(2, go)
    return {}


async def leaver(rank: int) -> None:
    """Rank 2 of "leave-in-shutdown": leave the job without rpc.shutdown when told to."""
    await _go_event().wait()
    print(json.dumps({"rank": rank, "left": True}), flush=True)
    await aiodist.destroy_process_group()


MASTERS = {
    "leave-in-shutdown": leave_in_shutdown,
    "values": values,
    "concurrency": concurrency,
    "errors": errors,
    "rrefs": rrefs,
    "death": death,
    "shutdown": shutdown_in_flight,
    "coordinator-death": coordinator_death,
}


async def main(scenario: str, rank: int, world: int, port: int) -> None:
    await aiodist.init_process_group(
        init_method=f"tcp://127.0.0.1:{port}",
        world_size=world,
        rank=rank,
        group_name=f"rpc-{scenario}",
        timeout=60,
        heartbeat_interval=0.2,
        heartbeat_timeout=2.0,
    )
    out: dict[str, Any] = {"rank": rank}
    if scenario == "leave-in-shutdown" and rank == 2:
        await leaver(rank)
        return
    if rank == 0:
        out.update(await MASTERS[scenario](world))
    t0 = time.monotonic()
    try:
        await rpc.shutdown(timeout=float(os.environ.get("RPC_SHUTDOWN_TIMEOUT", "60")))
        out["shutdown"] = "ok"
    except aiodist.DistError as exc:
        out["shutdown"] = [type(exc).__name__, getattr(exc, "rank", None), str(exc)]
    out["shutdown_s"] = time.monotonic() - t0
    gc.collect()
    out["deleted"] = sorted(_DELETED)
    print(json.dumps(out), flush=True)
    await aiodist.destroy_process_group()


def plain_main(rank: int, world: int, port: int) -> None:
    """Plain code on aiodist.sync: blocking calls, handles' wait(), a blocking shutdown."""
    dist.init_process_group(
        init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank, timeout=60
    )
    out: dict[str, Any] = {"rank": rank}
    if rank == 0:
        out["rpc_sync"] = rpc.rpc_sync(1, add, (1, 2))
        out["async_wait"] = rpc.rpc_async(2, async_add, (3,), {"b": 4}).wait(timeout=30)
        ref = rpc.remote(2, Tracked, ("plain",))
        out["method_sync"] = ref.rpc_sync().add(5)
        out["to_here"] = ref.to_here().count  # torch's form: blocks, returns the object
        out["tensor"] = rpc.rpc_sync(1, tensor_stats, (torch.ones(1 << 18),))
        try:
            rpc.rpc_sync(1, fail, ("custom",))
        except CustomError as exc:
            out["error"] = [type(exc).__name__, exc.code]
        del ref
    shutdown = rpc.shutdown()  # blocks until every rank called it
    out["shutdown_done"] = shutdown.is_completed()
    gc.collect()
    out["deleted"] = sorted(_DELETED)
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def named_whoami() -> dict[str, Any]:
    # init_rpc formed an rpc world of its own: no process group is up.
    return {"rank": rpc.get_worker_info().id, "pg": aiodist.is_initialized()}


async def async_named_whoami() -> dict[str, Any]:
    return named_whoami()


def _named_calls(rank: int, out: dict[str, Any]) -> None:
    """What the named scenarios check, as plain code (the async one runs it in a thread)."""
    me = rpc.get_worker_info()
    out["me"] = [me.name, me.id]
    if rank == 0:
        out["by_name"] = rpc.rpc_sync("trainer1", named_whoami)
        out["by_info"] = rpc.rpc_sync(rpc.get_worker_info("trainer2"), named_whoami)["rank"]
        out["info"] = [rpc.get_worker_info("trainer2").name, rpc.get_worker_info("trainer2").id]
        try:
            rpc.rpc_sync("nobody", named_whoami)
        except ValueError as exc:
            out["unknown"] = str(exc)


def named_main(scenario: str, rank: int, world: int, port: int) -> None:
    """``init_rpc`` with a name per rank, in plain code: torch's way of naming workers."""
    url = f"tcp://127.0.0.1:{port}"
    out: dict[str, Any] = {"rank": rank}
    name = "same" if scenario == "named-twice" and rank > 0 else f"trainer{rank}"
    try:
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=_Options(url))
    except ValueError as exc:
        out["init_error"] = str(exc)  # the rpc world is left on every rank
    else:
        _named_calls(rank, out)
        rpc.shutdown()
    print(json.dumps(out), flush=True)


async def named_async_main(rank: int, world: int, port: int) -> None:
    """The same, awaited on the job's loop."""
    url = f"tcp://127.0.0.1:{port}"
    await rpc.init_rpc(
        f"trainer{rank}", rank=rank, world_size=world, rpc_backend_options=_Options(url)
    )
    me = rpc.get_worker_info()
    out: dict[str, Any] = {"rank": rank, "me": [me.name, me.id]}
    if rank == 0:
        out["by_name"] = (await rpc.rpc_async("trainer2", async_named_whoami))["rank"]
    await rpc.shutdown()
    print(json.dumps(out), flush=True)


# --- torch's forms, in plain code (an rpc world of its own) -----------------------------------


def call_method(method: Any, rref: Any, *args: Any) -> Any:
    # Every torch example's helper: the object on its owner, right after rpc.remote().
    return method(rref.local_value(), *args)


def remote_to_here(rref: Any) -> list[Any]:
    # A copy of an RRef(value) owned by the master, fetched by a worker in a plain thread.
    obj = rref.to_here()
    return [type(obj).__name__, obj.x, obj.y, rref.owner_name(), rref.is_owner()]


@rpc.functions.async_execution
def add_chained(to: str, x: torch.Tensor, y: torch.Tensor, z: int) -> Any:
    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


class Batcher:
    """Answers ``n`` calls with one future (the batch-updating server's way)."""

    def __init__(self, n: int) -> None:
        self.n, self.lock = n, threading.Lock()
        self.got: list[int] = []
        self.future: Any = torch.futures.Future()

    @staticmethod
    @rpc.functions.async_execution
    def put(rref: Any, value: int) -> Any:
        self = rref.local_value()
        with self.lock:
            self.got.append(value)
            future = self.future
            if len(self.got) == self.n:
                future.set_result(sorted(self.got))
        return future

    @rpc.functions.async_execution
    def put_via_method(self, value: int) -> Any:
        future: Any = torch.futures.Future()
        future.set_result(value * 10)
        return future


@rpc.functions.async_execution
def fails_later() -> Any:
    future: Any = torch.futures.Future()
    future.set_exception(CustomError("set on the future", 11))
    return future


@rpc.functions.async_execution
def returns_no_future() -> int:
    return 3


def torch_forms(rank: int, world: int, port: int) -> dict[str, Any]:
    """Master and workers of an rpc world of its own, in plain code, as torch programs are."""
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=30, num_worker_threads=4
    )
    rpc.init_rpc(
        f"w{rank}",
        backend=rpc.BackendType.TENSORPIPE,
        rank=rank,
        world_size=world,
        rpc_backend_options=options,
    )
    out: dict[str, Any] = {"rank": rank, "pg": aiodist.is_initialized()}
    if rank == 0:
        fut = rpc.rpc_async("w1", torch.add, (torch.ones(2), 1))
        out["future"] = [isinstance(fut, torch.futures.Future), fut.then(_doubled).wait().tolist()]
        futs = [rpc.rpc_async(f"w{r}", add, (r, 10)) for r in (1, 2)]
        out["wait_all"] = torch.futures.wait_all(futs)
        collected = torch.futures.collect_all([rpc.rpc_async("w2", add, (1, 1))]).wait()
        out["collect_all"] = [f.value() for f in collected]
        out["done_value"] = [fut.done(), fut.value().tolist()]
        slow = rpc.remote("w1", SlowTracked, ("slow",))
        out["local_value_waits"] = rpc.rpc_sync(slow.owner(), call_method, (Tracked.add, slow, 5))
        out["owner"] = [slow.owner().name, slow.owner().id, slow.owner_name()]
        out["to_here"] = slow.to_here().count  # blocks, returns the object
        mine = rpc.RRef(Point(1, 2))
        out["mine"] = [mine.is_owner(), mine.owner().name, mine.confirmed_by_owner()]
        out["mine_local"] = mine.local_value() is mine.to_here()  # the object itself
        out["mine_remote"] = rpc.rpc_sync("w2", remote_to_here, (mine,))
        out["chained"] = rpc.rpc_sync("w1", add_chained, ("w2", torch.ones(2), 1, 1)).tolist()
        batcher = rpc.remote("w1", Batcher, (2,))
        puts = [rpc.rpc_async("w1", Batcher.put, (batcher, v)) for v in (7, 3)]
        out["batched"] = [f.wait() for f in puts]
        out["batched_method"] = rpc.remote("w2", Batcher, (1,)).rpc_sync().put_via_method(4)
        for name, fn in (("fails_later", fails_later), ("no_future", returns_no_future)):
            try:
                rpc.rpc_sync("w1", fn)
            except Exception as exc:
                out[name] = [type(exc).__name__, str(exc).splitlines()[0]]
        try:
            rpc.TensorPipeRpcBackendOptions(device_maps={"w1": {0: 0}})
        except ValueError as exc:
            out["refused"] = str(exc)
        del slow, mine, batcher
    rpc.shutdown()
    try:
        rpc.rpc_sync("w0", add, (1, 1))
    except aiodist.ClosedError as exc:
        out["after_shutdown"] = str(exc)
    return out


def _doubled(fut: Any) -> Any:
    return fut.value() * 2


def two_worlds(rank: int, world: int, port: int) -> dict[str, Any]:
    """Ranks 0 and 1 in a process group of two; ranks 0-2 in an rpc world of three."""
    out: dict[str, Any] = {"rank": rank}
    if rank < 2:
        dist.init_process_group(
            init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank, timeout=60
        )
    rpc_port = os.environ["RPC_PORT"]  # another rendezvous than the process group's
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    if rank == 0:
        out["w2"] = rpc.rpc_sync("w2", named_whoami)
        out["names"] = [rpc.get_worker_info(f"w{r}").id for r in range(world)]
    rpc.shutdown()
    if rank < 2:  # the process group was not touched
        ones = torch.ones(1)
        dist.all_reduce(ones)
        out["pg"] = [dist.get_world_size(), ones.tolist()]
        dist.destroy_process_group()
    return out


class _Options:
    """What torch's ``TensorPipeRpcBackendOptions`` carries that aiodist reads."""

    def __init__(self, init_method: str) -> None:
        self.init_method = init_method


if __name__ == "__main__":
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if scenario == "plain":
        plain_main(rank, world, port)
    elif scenario in ("named", "named-twice"):
        named_main(scenario, rank, world, port)
    elif scenario in ("torch-forms", "two-worlds"):
        body = torch_forms if scenario == "torch-forms" else two_worlds
        print(json.dumps(body(rank, world, port)), flush=True)
    elif scenario == "named-async":
        asyncio.run(named_async_main(rank, world, port))
    else:
        anyio.run(main, scenario, rank, world, port, backend_options={"use_uvloop": True})
