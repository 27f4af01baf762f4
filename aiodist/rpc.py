"""Remote calls between the ranks of a job: the master-worker mode, asynchronous.

Under ``torch.distributed.rpc``'s names, over the job ``init_process_group``
formed (no second rendezvous; ``to`` is a global rank, or a worker's name once
``init_rpc(name)`` named the ranks, as torch's does)::

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

**Handles.** ``rpc_async``, ``RRef.to_here`` and the methods of
``RRef.rpc_async()`` return an ``aiodist.Work``: ``await`` it, or call
``.wait()`` from plain code. Cancelling the task that awaits it does not
cancel the call (as for every aiodist operation); a ``timeout`` does.

**Plain code** (``aiodist.sync``, or any thread that is not the job's event
loop's): the same functions work there, starting calls on the job's loop
thread. ``rpc_sync`` and ``RRef.rpc_sync()`` block, as torch's do;
``rpc_async(...).wait()``, ``rref.to_here().wait()``; ``shutdown()`` blocks.
A blocking call on the loop's own thread raises ``RuntimeError`` (it would
deadlock): use the ``await`` forms there. A plain function running on a worker
may itself make calls with ``rpc_sync``: it runs in an executor thread.

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
import threading
from typing import TYPE_CHECKING, Any, TypeVar, overload

from aiodist._errors import RemoteError
from aiodist._group.work import Work
from aiodist._rpc.agent import Agent, default_agent
from aiodist._rpc.calls import prepare
from aiodist._rpc.names import WorkerInfo, check_name, lookup, names_of, rank_of, register
from aiodist._rpc.rref import RRef, make_remote
from aiodist._rpc.wire import Op

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence

__all__ = [
    "RRef",
    "RemoteError",
    "WorkerInfo",
    "get_worker_info",
    "init_rpc",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

T = TypeVar("T")


@overload
def rpc_async(
    to: int | str | WorkerInfo,
    fn: Callable[..., Coroutine[Any, Any, T]],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Work[T]: ...
@overload
def rpc_async(
    to: int | str | WorkerInfo,
    fn: Callable[..., T],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Work[T]: ...
def rpc_async(
    to: int | str | WorkerInfo,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
) -> Work[Any]:
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
            the job's timeout (``init_process_group``'s); 0: none.

    Returns:
        Work resolving to ``fn``'s result (a coroutine's, awaited).

    Raises:
        ValueError: ``to`` is not a rank of the job; ``timeout`` < 0.
        TypeError: ``fn`` or the arguments cannot be pickled.
        RuntimeError: No process group is initialised.
        ClosedError: rpc was shut down, or the group destroyed.
        Exception: (from the Work) what ``fn`` raised, rebuilt (see the module docstring).
        DistTimeoutError: (from the Work) no result within ``timeout``.
        RankFailedError: (from the Work) a rank died before the call completed.

    Cancellation:
        Cancelling the awaiting task does not cancel the call; ``timeout`` does.

    Example:
        >>> loss = await aiodist.rpc.rpc_async(1, train_step, (batch,))
    """
    agent = default_agent("rpc_async")
    dst = rank_of(agent.session, to)
    request = prepare(agent, Op.CALL, dst, fn, args, kwargs, timeout, _what("rpc_async", to))
    return agent.launch(request)


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

    As ``rpc_async(...).wait()``; see ``rpc_async`` for the arguments and errors.

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
        to: The global rank that runs ``fn`` and keeps its result.
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
    """Name this rank for remote calls, joining the job first if need be (torch's).

    Every rank calls it with a name of its own; afterwards ``to`` may be a
    rank, a name or a ``WorkerInfo`` in ``rpc_async``, ``rpc_sync`` and
    ``remote``, and ``get_worker_info`` answers. When no process group is up,
    it first calls ``init_process_group`` (``rank`` and ``world_size`` as given,
    else from the launcher's environment; ``rpc_backend_options.init_method``
    when it has one). From plain code it blocks, as torch's does; in async
    code, await it. aiodist's own data plane carries the calls whatever
    ``backend`` says.

    Args:
        name: This rank's name, unique in the job, at most 128 characters.
        backend: Accepted for torch's signature; not used.
        rank: This process's rank (-1: from the environment).
        world_size: The job's size (None: from the environment).
        rpc_backend_options: Its ``init_method`` is used when the group is not up.

    Returns:
        An awaitable done once every rank's name is known (done already in plain code).

    Raises:
        ValueError: ``name`` is empty, not a string or too long (at once); two
            ranks gave the same name (every rank raises it).

    Example:
        >>> await aiodist.rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
        >>> await aiodist.rpc.rpc_async("worker1", sum, ([1, 2],))
    """
    check_name(name)
    init_method = getattr(rpc_backend_options, "init_method", None)
    if not isinstance(init_method, str):
        init_method = None
    size = -1 if world_size is None else world_size
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        import aiodist.sync as blocking

        if not blocking.is_initialized():
            blocking.init_process_group(init_method=init_method, rank=rank, world_size=size)
        names = blocking.all_gather_object(name)
        register(default_agent("init_rpc").session, names, blocking.get_rank())
        return Work.completed(None, "rpc.init_rpc")
    return asyncio.ensure_future(_init_rpc(name, rank, size, init_method))


async def _init_rpc(name: str, rank: int, world_size: int, init_method: str | None) -> None:
    import aiodist

    if not aiodist.is_initialized():
        await aiodist.init_process_group(init_method=init_method, rank=rank, world_size=world_size)
    names = await aiodist.all_gather_object(name)
    register(default_agent("init_rpc").session, names, aiodist.get_rank())


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
    Ranks that fail or leave meanwhile (rank 0, which checks, too) are not
    waited for: it completes among the ranks alive.
    Afterwards calls made here raise ``ClosedError``, calls to this rank fail
    with it, and every object this rank owns through an RRef is dropped. From
    plain code (not on the job's event-loop thread) it blocks until done, as
    torch's does; on the loop, await it. The process group stays up: collectives
    still work, and ``destroy_process_group`` still ends the job. Call it on
    every rank before ``destroy_process_group``: calls made to a rank that left
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
    if timeout is None:
        seconds: float | None = agent.session.timeout
    elif timeout < 0:
        raise ValueError(f"timeout must be >= 0 (0: none), got {timeout!r}")
    else:
        seconds = float(timeout) or None
    if _on_loop(agent):
        return agent.shutdown(graceful, seconds)
    asyncio.run_coroutine_threadsafe(_shutdown(agent, graceful, seconds), agent.loop).result()
    return Work.completed(None, "rpc.shutdown")


async def _shutdown(agent: Agent, graceful: bool, timeout: float | None) -> None:
    await agent.shutdown(graceful, timeout)


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
