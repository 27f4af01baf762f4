"""Starting and ending a job in a rank: ``init_process_group``, ``init_dist``, ``destroy``.

``init_process_group`` joins the job (``aiodist._group.join``), installs the
default group (``aiodist._group.world``) and, for a torch backend, brings up
torch.distributed through the torch bridge.

One task holds the default group open, on the loop that joined. Whatever ends
it ends it the same way (torch's groups torn down, then the job left as
``join`` leaves it): ``destroy_process_group``; the end of that loop
(``asyncio.run`` returning: the task is a ``LingeringTask``, which leaves
instead of being cancelled); or interpreter exit, for a loop still open (an
exit handler; ``aiodist.sync``'s loop thread has its own).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
from typing import TYPE_CHECKING, Any

import anyio

from aiodist._control.store import as_seconds
from aiodist._errors import ArgumentError
from aiodist._group.join import open_process_group, run_close_hooks
from aiodist._group.lingering import hand_over, hold
from aiodist._group.session import CLOSE_GRACE, DEFAULT_TIMEOUT
from aiodist._group.work import wait_future
from aiodist._group.world import (
    DefaultGroup,
    as_group,
    default_group_loop,
    get_default_group,
    install_default,
    is_initialized,
    take_default,
)
from aiodist._launch.launchers import launcher_env
from aiodist._rpc.agent import agent_for
from aiodist._torch.bridge import bring_up, parse_backend, tear_down
from aiodist._torch.default import bring_up_default, tear_down_default, wants_default_group

if TYPE_CHECKING:
    from datetime import timedelta

    from aiodist._group.group import ProcessGroup


async def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    *,
    heartbeat_interval: float | None = None,
    heartbeat_timeout: float | None = None,
    hostname: str | None = None,
    max_world_size: int | None = None,
) -> None:
    """Join the job and make it the default process group.

    Args:
        backend: ``None`` (torch's default) or ``"aiodist"``: aiodist's calls ride
            its own data plane, and so do torch's: torch.distributed's default group
            is brought up on the ``aiodist`` backend over this job
            (``cpu:aiodist,cuda:nccl``, ``aiodist`` alone without CUDA; off with
            ``AIODIST_TORCH_GROUP=0``), so ``DistributedDataParallel`` and
            ``torch.distributed.*`` run on aiodist's plane. ``"gloo"`` or ``"nccl"``
            bring torch's group up on that backend instead, and route aiodist's tensor
            collectives on its device there too (see the torch bridge).
        init_method: ``tcp://HOST:PORT``, ``env://`` (default, torchrun's variables)
            or ``file:///shared/path``. With ``tcp://``, rank 0 (or any process with
            ``AIODIST_EMBED=1``) starts the server itself if none listens there.
        world_size: Number of ranks (default: ``$WORLD_SIZE``).
        rank: This rank (default: ``$RANK``); -1 lets the server assign one, keeping
            the ranks of each host contiguous.
        group_name: The job's name on a shared server.
        timeout: Seconds (or a ``timedelta``) to wait for the job to form, and the
            default timeout of every operation (30 minutes if None, as torch's).
        store: A torch ``Store`` to meet through instead of ``init_method``, as
            torch takes one: rank 0 (``rank`` must be given) embeds the server and
            publishes its address there, the others read it.
        pg_options: torch's backend options; accepted and not used.
        device_id: A CUDA device (or its index) for this rank; with NCCL the bridge
            uses it instead of the rank's local rank.
        heartbeat_interval: Seconds between heartbeats.
        heartbeat_timeout: Silence after which a rank is declared failed.
        hostname: The host this rank counts as when computing local ranks.
        max_world_size: Make the job elastic (torchrun's ``--nnodes MIN:MAX``, with
            ``world_size`` the MIN): processes that join it after it formed get
            the next free rank and join the others with ``regroup`` (default
            ``$AIODIST_MAX_WORLD_SIZE``; 0: not elastic). See the elastic guide.

    With ``backend="gloo"``, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``, torch.distributed's
    default group is brought up too, through this job's store (no second port):
    tensor collectives on that backend's device then run on torch.distributed.

    Raises:
        RuntimeError: Already initialised; ``backend="nccl"`` without CUDA; or
            torch.distributed already initialised by other code.
        GroupBrokenError: torch.distributed could not bring its group up.
        RendezvousError: The job refused this process; the message says why.
        RendezvousTimeout: The job did not form within ``timeout``.

    Cancellation:
        Cancelling the caller abandons the join; nothing stays initialised.

    Example:
        >>> await aiodist.init_process_group(init_method="tcp://127.0.0.1:29500",
        ...                                  world_size=4, rank=rank)
    """
    if is_initialized():
        raise RuntimeError(
            "the default process group is already initialised; call destroy_process_group() first"
        )
    seconds = as_seconds(timeout, DEFAULT_TIMEOUT)
    devices = parse_backend(backend)  # before joining: NCCL without CUDA fails here
    loop = asyncio.get_running_loop()
    started: asyncio.Future[ProcessGroup] = loop.create_future()
    stop = asyncio.Event()
    default: DefaultGroup | None = None

    async def hold_open() -> None:
        try:
            async with open_process_group(
                init_method,
                world_size=world_size,
                rank=rank,
                group_name=group_name,
                timeout=seconds,
                backend=backend,
                heartbeat_interval=heartbeat_interval,
                heartbeat_timeout=heartbeat_timeout,
                hostname=hostname,
                max_world_size=max_world_size,
                store=store,
            ) as group:
                started.set_result(group)
                try:
                    await stop.wait()
                finally:
                    # destroy_process_group, the loop's end, or interpreter exit: one way out.
                    if default is not None:
                        _forget_default(default)
                    with anyio.CancelScope(shield=True):
                        await tear_down_default()
                        await tear_down(group)
        except BaseException as exc:
            if hand_over(started, exc):
                return
            raise

    def on_shutdown() -> None:
        # The loop's shutdown: asyncio.run returning, or its main task ending with an
        # exception (Ctrl-C included), which is then being raised (``_group.ending``).
        if default is not None:
            default.group.session.end_with(sys.exc_info()[1])
        stop.set()

    # The loop's shutdown (asyncio.run returning without destroy_process_group) leaves
    # the job the way destroy_process_group does, rather than cancelling the holder.
    task = await hold(hold_open(), started, name="aiodist-default-group", on_shutdown=on_shutdown)
    group = started.result()
    default = DefaultGroup(group, task, stop)
    install_default(default)
    agent_for(group.session)  # every rank serves remote calls from now on (aiodist.rpc)
    _leave_at_exit_of_this_process()
    try:
        if devices is not None:
            assert backend is not None
            await bring_up(group, backend, devices, device_id=device_id)
        elif wants_default_group(backend):
            # As torch: code written for it (DDP, DistributedSampler) finds its group.
            await bring_up_default(group)
    except BaseException:
        await destroy_process_group()
        raise


async def init_dist(
    launcher: str, backend: str | None = None, init_backend: str = "torch", **kwargs: Any
) -> None:
    """Initialise from a launcher's environment, as ``mmengine.dist.init_dist`` does.

    Args:
        launcher: ``"pytorch"`` (torchrun, ``aiodist run``), ``"slurm"`` or ``"mpi"``;
            see ``infer_launcher``.
        backend: As for ``init_process_group`` (mmengine's default is ``"nccl"``;
            aiodist's is its own data plane, which carries CUDA tensors too).
        init_backend: mmengine's ``"torch"``; DeepSpeed's and ColossalAI's
            initialisation are not aiodist's to run.
        **kwargs: ``port`` (Slurm) and any ``init_process_group`` keyword
            (``timeout`` in seconds, as mmengine takes it).

    Raises:
        ValueError: An unknown launcher or ``init_backend``.
        RendezvousError: The launcher's environment lacks a variable it needs.
    """
    if init_backend != "torch":
        raise ArgumentError(f'supported "init_backend" is "torch", but got {init_backend}')
    port = kwargs.pop("port", None)
    num_gpus = 0
    if launcher == "slurm" and "SLURM_LOCALID" not in os.environ:
        import torch

        num_gpus = torch.cuda.device_count()
    os.environ.update(launcher_env(launcher, os.environ, port=port, num_gpus=num_gpus))
    await init_process_group(backend, "env://", **kwargs)


async def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Leave the job and tear the default group down; a no-op when not initialised.

    With a group made by ``new_group``, only that group is destroyed: later
    operations on it raise ``ClosedError``. torch.distributed's groups brought
    up by the torch bridge go with them. Metric syncs still queued are pushed
    out first and complete on every rank (bounded by 30 s), as do operations
    already started.

    A process that never calls it leaves the same way when the event loop the
    group lives on ends (``asyncio.run`` / ``anyio.run`` returning) or, failing
    that, at interpreter exit: its peers see it leave, not fail.

    Cancellation:
        Shielded: once called, the group is torn down even if the caller is cancelled.
    """
    group = as_group(group)
    if group is not None and group.group_id != 0:  # a group made by new_group
        # Its metric syncs still queued reach every member first (its close hooks).
        await asyncio.shield(run_close_hooks([group], min(group.timeout, CLOSE_GRACE)))
        await tear_down(group)
        group.close()
        return
    if group is not None and group is not get_default_group():
        return
    default = take_default()
    if default is None:
        return
    # The holder tears torch's group down, then leaves the job (``hold_open``).
    default.stop.set()
    await asyncio.shield(asyncio.gather(default.task, return_exceptions=True))


def _forget_default(default: DefaultGroup) -> None:
    """Forget ``default`` if it is still the default group (its holder is ending)."""
    if get_default_group() is default.group:
        take_default()


_installed_by = 0  # the pid of the process that installed the default group


def _leave_at_exit_of_this_process() -> None:
    global _installed_by
    _installed_by = os.getpid()


@atexit.register  # at import: it runs after the exit handlers registered later
def _leave_at_exit() -> None:
    """Leave the job at interpreter exit if the default group is still up.

    Async code whose loop is still open (``loop.run_until_complete(main())``
    without closing it) gets here, as does a loop running in a thread of its
    own; ``asyncio.run`` leaves at its own end, and ``aiodist.sync`` in its
    loop thread's exit handler. A forked child never leaves its parent's job.
    """
    loop = default_group_loop()
    if loop is None or loop.is_closed() or _installed_by != os.getpid():
        return
    if loop.is_running():  # another thread's loop
        wait_future(asyncio.run_coroutine_threadsafe(destroy_process_group(), loop))
    else:
        loop.run_until_complete(destroy_process_group())
