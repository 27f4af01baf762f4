"""Remote calls between the ranks of a job: the master-worker mode, asynchronous.

Under ``torch.distributed.rpc``'s names: a program written for torch's rpc
runs with ``import torch.distributed.rpc as rpc`` changed to ``import
aiodist.rpc as rpc`` (and ``torch.distributed.autograd``,
``torch.distributed.optim.DistributedOptimizer``, ``torch.distributed.nn.RemoteModule``
to ``aiodist.rpc.dist_autograd``, ``aiodist.rpc.optim``, ``aiodist.rpc.nn``).
Calls ride the job ``init_process_group`` formed (no second rendezvous; ``to``
is a global rank, or a worker's name once ``init_rpc(name)`` named the ranks),
or the rpc world ``init_rpc`` forms of its own when asked for another size
or ``init_method``, or when no process group is up::

    import aiodist, aiodist.rpc as rpc

    await aiodist.init_process_group()
    if aiodist.get_rank() == 0:                               # the master
        total = await rpc.rpc_async(1, sum, ([1, 2, 3],))     # 6, computed on rank 1
        works = [rpc.rpc_async(r, train_shard, (r,)) for r in (1, 2, 3)]  # all at once
        losses = [await w for w in works]
        counter = rpc.remote(2, Counter)                      # Counter() lives on rank 2
        await counter.rpc_async().add(5)                      # a method call, run there
    await rpc.shutdown()                                      # every rank, master included

**Every rank serves calls** from ``init_process_group`` on, while its code
awaits anything else; a worker can be just ``init_process_group()`` and
``await rpc.shutdown()``. A coroutine function is awaited on the worker's
event loop; a plain function runs in a thread of the worker's rpc executor
(``AIODIST_RPC_THREADS``, default 16), so a slow call blocks neither the loop
nor other calls. Many calls may be in flight to one rank and to many; they
run concurrently there. (A group opened with ``open_process_group`` serves
from its first rpc use.)

**What travels.** A function is pickled by reference (its module and name:
define it at the top level of a module every rank imports, or of the script
``aiodist run`` starts on every rank); arguments and results travel as the
object collectives' values do, msgpack when plain and pickle otherwise, and a
CPU tensor of 64 KiB or more travels apart from them, from its own memory
into a fresh tensor's, never copied into a pickle.

**Two forms.** *Async code* (a task on the job's event loop) gets aiodist's:
``rpc_async`` and the methods of ``RRef.rpc_async()`` return an
``aiodist.Work``, ``rref.to_here()`` a ``Work`` too: ``await`` them.
Cancelling the task that awaits one does not cancel the call (as for every
aiodist operation); a ``timeout`` does. *Plain code* (any other thread: a
script on ``aiodist.sync``, a plain function served in an rpc thread) gets
torch's: ``rpc_async`` returns a ``torch.futures.Future`` (``then``,
``wait``, ``value``, ``done``, ``torch.futures.wait_all``; it can be awaited
too), ``rref.to_here()`` blocks and returns the object, ``rpc_sync``,
``RRef.rpc_sync()``, ``init_rpc`` and ``shutdown`` block, as torch's do.
Calls start on the job's loop thread either way. A blocking call on the
loop's own thread raises ``RuntimeError`` (it would deadlock): use the
``await`` forms there. A plain function running on a worker may itself make
calls with ``rpc_sync``: it runs in an executor thread; a function marked
``@rpc.functions.async_execution`` returns a future instead of waiting.

**Errors.** An exception raised by the remote function is raised by the
handle, of the same type where it can be rebuilt here (else ``RemoteError``),
its message naming the rank and carrying the remote traceback; its
``__cause__`` is a ``RemoteError`` with ``rank``, ``exc_type`` and
``remote_traceback``. A call past its ``timeout`` raises ``DistTimeoutError``
and is cancelled on the worker (a plain function already running in its
thread runs to its end; its result is dropped). A rank that dies fails every
pending call with ``RankFailedError`` naming it, within the heartbeat
timeout; as for every operation of the job, the job is then broken on every
rank. A destination outside the job, a function that cannot be pickled by
reference or arguments that cannot be pickled raise ``ValueError`` /
``TypeError`` at once, sending nothing; the job stays usable.

**Security.** rpc runs the code the caller names, with arguments it sends,
unpickled: any rank of the job can make any other run any function
importable there. As in torch.distributed.rpc, use it only between processes
that trust each other. Only members of the same job reach a rank's data plane,
and with a job token (``AIODIST_TOKEN``) only processes that prove it: the
token is what keeps other processes on the network or the host from running
code in your ranks. Without a token, anyone who can reach a rank's listening
addresses can.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
from typing import TYPE_CHECKING, Any, TypeVar, overload

from aiodist._errors import RemoteError
from aiodist._group.work import Work, running_loop, wait_future
from aiodist._group.world import get_default_group
from aiodist._rpc.agent import Agent, agent_for, default_agent
from aiodist._rpc.calls import prepare, timeout_seconds
from aiodist._rpc.names import (
    WorkerInfo,
    check_name,
    lookup,
    names_of,
    rank_of,
    register,
    registered,
)
from aiodist._rpc.options import (
    BackendType,
    RpcBackendOptions,
    RpcSettings,
    TensorPipeRpcBackendOptions,
    check_backend,
    settings_of,
)
from aiodist._rpc.rref import RRef, make_remote
from aiodist._rpc.wire import Op
from aiodist._rpc.world import close_world, open_world
from aiodist.rpc import functions

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
    from types import ModuleType

    from aiodist._group.group import ProcessGroup

__all__ = [
    "BackendType",
    "RRef",
    "RemoteError",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "functions",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

T = TypeVar("T")

# Submodules that import torch: loaded on first use (``rpc.dist_autograd``), or by import.
_LAZY = ("dist_autograd", "optim", "nn")


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_available() -> bool:
    """True: aiodist's rpc is always built (torch's ``rpc.is_available``)."""
    return True


def rpc_async(
    to: int | str | WorkerInfo,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Any:
    """Start ``fn(*args, **kwargs)`` on rank ``to``; a handle to its result.

    Args:
        to: The global rank that runs it (this rank too), or its name or
            ``WorkerInfo`` once ``init_rpc`` named the ranks.
        fn: A function importable on ``to`` (pickled by reference). A coroutine
            function is awaited on ``to``'s loop, a plain one runs in an executor
            thread there.
        args: Positional arguments (a tuple).
        kwargs: Keyword arguments.
        timeout: Seconds before the call fails and is cancelled on ``to``; None:
            the rpc timeout (``rpc_backend_options.rpc_timeout``, else the job's);
            0: none.

    Returns:
        In async code, a ``Work`` resolving to ``fn``'s result (a coroutine's,
        awaited); in plain code, a ``torch.futures.Future`` of it (awaitable too).

    Raises:
        ValueError: ``to`` is not a rank of the job; ``timeout`` < 0.
        TypeError: ``fn`` or the arguments cannot be pickled.
        RuntimeError: Neither ``init_rpc`` nor ``init_process_group`` was called.
        ClosedError: rpc was shut down, or the group destroyed.
        Exception: (from the handle) what ``fn`` raised, rebuilt (see the module docstring).
        DistTimeoutError: (from the handle) no result within ``timeout``.
        RankFailedError: (from the handle) a rank died before the call completed.

    Cancellation:
        Cancelling the awaiting task does not cancel the call; ``timeout`` does.

    Example:
        >>> loss = await aiodist.rpc.rpc_async(1, train_step, (batch,))
        >>> fut = rpc.rpc_async("worker1", torch.add, (x, 1))     # plain code
        >>> torch.futures.wait_all([fut])
    """
    agent = default_agent("rpc_async")
    dst = rank_of(agent.session, to)
    request = prepare(agent, Op.CALL, dst, fn, args, kwargs, timeout, _what("rpc_async", to))
    return agent.call(request)


@overload
def rpc_sync(
    to: int | str | WorkerInfo,
    fn: Callable[..., Coroutine[Any, Any, T]],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> T: ...
@overload
def rpc_sync(
    to: int | str | WorkerInfo,
    fn: Callable[..., T],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> T: ...
def rpc_sync(
    to: int | str | WorkerInfo,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on rank ``to`` and block for its result (plain code).

    See ``rpc_async`` for the arguments and errors.

    Raises:
        RuntimeError: Called on the job's event-loop thread (it would deadlock):
            ``await aiodist.rpc.rpc_async(...)`` there.

    Example:
        >>> total = aiodist.rpc.rpc_sync(1, sum, ([1, 2, 3],))
    """
    agent = default_agent("rpc_sync")
    _check_blocking(agent, "rpc_sync", "await aiodist.rpc.rpc_async(...)")
    dst = rank_of(agent.session, to)
    request = prepare(agent, Op.CALL, dst, fn, args, kwargs, timeout, _what("rpc_sync", to))
    return agent.launch(request).wait()


def remote(
    to: int | str | WorkerInfo,
    fn: Callable[..., T] | Callable[..., Coroutine[Any, Any, T]],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> RRef[T]:
    """Run ``fn(*args, **kwargs)`` on rank ``to``, which keeps the result; a reference to it.

    Returns at once. Rank ``to`` (the owner) keeps the object while any copy of
    the ``RRef`` is alive on any rank (references are counted), and drops it
    when the last one is dropped or rpc shuts down. An error ``fn`` raises is
    raised by ``to_here()`` and by the object's method calls.

    Args:
        to: The rank (or name, or ``WorkerInfo``) that runs ``fn`` and keeps its result.
        fn: As for ``rpc_async``.
        args: Positional arguments.
        kwargs: Keyword arguments.
        timeout: For making the object, as for ``rpc_async``.

    Raises:
        ValueError, TypeError, RuntimeError, ClosedError: As for ``rpc_async``, at once.

    Example:
        >>> model = aiodist.rpc.remote(0, Model)            # Model() on rank 0
        >>> params = await model.rpc_async().parameters_list()
        >>> copy = await model.to_here()
    """
    agent = default_agent("remote")
    return make_remote(agent, rank_of(agent.session, to), fn, args, kwargs, timeout)


def init_rpc(
    name: str,
    backend: object = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: object = None,
) -> Awaitable[None]:
    """Join the rpc world under ``name`` (torch's ``init_rpc``).

    Every rank calls it with a name of its own; afterwards ``to`` may be a
    rank, a name or a ``WorkerInfo`` in ``rpc_async``, ``rpc_sync`` and
    ``remote``, and ``get_worker_info`` answers. The rpc world is the default
    process group's job when one is up and ``init_rpc`` asks for nothing else
    (``rank`` and ``world_size`` as the group's or unset, no ``init_method``
    but ``env://``); otherwise it is a job of its own, formed here (``rank``
    and ``world_size`` as given, else from the launcher's environment;
    ``rpc_backend_options.init_method`` or ``env://``), of any size, beside
    the process group or without one: ``rpc.shutdown()`` leaves it. From plain
    code it blocks, as torch's does; in async code, await it. aiodist's own
    data plane carries the calls whatever ``backend`` says.

    Args:
        name: This rank's name, unique in the rpc world, at most 128 characters.
        backend: None or ``BackendType.TENSORPIPE`` (aiodist's or torch's).
        rank: This process's rank in the rpc world (-1: from the environment).
        world_size: The rpc world's size (None: from the environment).
        rpc_backend_options: ``TensorPipeRpcBackendOptions`` (aiodist's or torch's):
            ``init_method``, ``rpc_timeout`` (the calls' default timeout) and
            ``num_worker_threads`` are used; device maps, devices, transports and
            channels are refused.

    Returns:
        An awaitable done once every rank's name is known (done already in plain code).

    Raises:
        ValueError: ``name`` is empty, not a string or too long, or an option is
            refused (at once); two ranks gave the same name (every rank raises it).
        RuntimeError: ``init_rpc`` was called already (call ``rpc.shutdown()`` first).
        RendezvousError, RendezvousTimeout: The rpc world could not form.

    Example:
        >>> await aiodist.rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
        >>> await aiodist.rpc.rpc_async("worker1", sum, ([1, 2],))
    """
    check_name(name)
    check_backend(backend)
    settings = settings_of(rpc_backend_options)
    size = -1 if world_size is None else world_size
    if running_loop() is not None:
        return asyncio.ensure_future(_init_rpc(name, rank, size, settings))
    from aiodist._sync import portal

    portal.call(_init_rpc, name, rank, size, settings)
    return Work.completed(None, "rpc.init_rpc")


async def _init_rpc(name: str, rank: int, world_size: int, settings: RpcSettings) -> None:
    import aiodist

    group = _process_group_for(rank, world_size, settings)
    if group is None:
        group = await open_world(settings.init_method, rank, world_size)
    agent = agent_for(group.session)
    if registered(group.session):
        raise RuntimeError("init_rpc was called already on this rank; call rpc.shutdown() first")
    agent.configure(settings.timeout, settings.threads)
    try:
        names = await aiodist.all_gather_object(name, group=group)
        register(group.session, names, group.rank)
        # Every rank knows the names before any returns: a call made right after
        # init_rpc may use them on its callee (get_worker_info, a call by name).
        await aiodist.barrier(group=group)
    except BaseException:
        await close_world(group.session)
        raise


def _process_group_for(rank: int, world_size: int, settings: RpcSettings) -> ProcessGroup | None:
    """The default process group if the rpc world is its job, else None (a world of its own)."""
    g = get_default_group()
    if g is None or g.session.closed:
        return None
    if world_size not in (-1, g.world_size) or rank not in (-1, g.rank):
        return None
    if settings.init_method not in (None, "env://"):
        return None
    return g


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """A worker's name and rank (this rank's without ``worker_name``), as torch's.

    Raises:
        RuntimeError: ``init_rpc`` was not called.
        ValueError: No worker has that name.
    """
    table = names_of(default_agent("get_worker_info").session, "get_worker_info")
    return table.mine if worker_name is None else lookup(table, worker_name)


def shutdown(graceful: bool = True, timeout: float | None = None) -> Work[None]:
    """Stop rpc on this rank once every rank called this and no call is left anywhere.

    Serves calls until then (calls in flight, and calls they make, complete).
    Ranks that fail or leave meanwhile (the lowest rank alive, which checks,
    too) are not waited for: it completes among the ranks alive.
    Afterwards calls made here raise ``ClosedError``, calls to this rank fail
    with it, and every object this rank owns through an RRef is dropped. From
    plain code (not on the job's event-loop thread) it blocks until done, as
    torch's does; on the loop, await it. An rpc world of its own (see
    ``init_rpc``) is left then; a process group stays up: collectives still
    work, and ``destroy_process_group`` still ends the job. Call it on every
    rank before ``destroy_process_group``: calls made to a rank that left
    without it wait for their timeout.

    Args:
        graceful: False stops at once, without waiting for the other ranks:
            calls running here get ``ClosedError``, and so do this rank's
            pending calls.
        timeout: Seconds (None: the job's timeout; 0: none).

    Returns:
        Work resolving to None once stopped (already done in plain code).

    Raises:
        DistTimeoutError: (from the Work) not every rank called it, or calls kept
            running, within ``timeout``; rpc goes on serving (call
            ``destroy_process_group`` to stop it).
        DistError: (from the Work) this rank's own session broke meanwhile (it
            lost its server, or was declared failed itself).

    Cancellation:
        Cancelling the awaiting task does not cancel the shutdown.

    Example:
        >>> await aiodist.init_process_group()     # a worker's whole program
        >>> await aiodist.rpc.shutdown()
    """
    agent = default_agent("rpc.shutdown")
    seconds = timeout_seconds(timeout, agent.session.timeout)
    if _on_loop(agent):
        started = agent.shutdown(graceful, seconds)  # now: the waves start at the call
        return Work(asyncio.ensure_future(_leave_after(agent, started)), "rpc.shutdown")
    wait_future(asyncio.run_coroutine_threadsafe(_shutdown(agent, graceful, seconds), agent.loop))
    return Work.completed(None, "rpc.shutdown")


async def _shutdown(agent: Agent, graceful: bool, timeout: float | None) -> None:
    await _leave_after(agent, agent.shutdown(graceful, timeout))


async def _leave_after(agent: Agent, started: Work[None]) -> None:
    """Once rpc stopped here, leave the rpc world if it is one of its own."""
    await started
    await close_world(agent.session)


def _what(name: str, to: object) -> str:
    return f"{name}(to={to}, {{fn}})"  # prepare() puts the function's name in


def _on_loop(agent: Agent) -> bool:
    return threading.get_ident() == agent.thread


def _check_blocking(agent: Agent, name: str, instead: str) -> None:
    if _on_loop(agent):
        raise RuntimeError(
            f"aiodist.rpc.{name}() blocks, and was called on the job's event-loop thread where "
            f"it would deadlock; use `{instead}` there"
        )
