"""The rpc world: the job remote calls ride, and the one ``init_rpc`` opens of its own.

Remote calls ride the default process group's job (``init_process_group``)
unless ``init_rpc`` asks for another world: a different size or rank, or an
``init_method`` of its own (as torch's rpc, whose world is independent of
the process group: two trainers' DDP group beside a four-worker rpc world).
Then ``open_world`` joins a job of its own, which no process group names:
it lives until ``rpc.shutdown()`` (``close_world``), the end of its event
loop (the holder is a ``LingeringTask``: the job is left, not dropped), or
the end of the program (``ending.at_exit``), where a program that fails
tells its peers so.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import anyio

from aiodist._group import ending
from aiodist._group.join import default_group_name, open_process_group
from aiodist._group.lingering import LingeringTask, hand_over, hold
from aiodist._group.session import DEFAULT_TIMEOUT
from aiodist._group.work import wait_future
from aiodist._group.world import default_group_loop, get_default_group

if TYPE_CHECKING:
    from aiodist._group.group import ProcessGroup
    from aiodist._group.session import Session

#: An rpc world of its own is a job named after the process group's, with this suffix.
RPC_JOB_SUFFIX: Final = "/rpc"


@dataclass(slots=True, eq=False)
class _World:
    group: ProcessGroup
    loop: asyncio.AbstractEventLoop
    task: LingeringTask[None]
    stop: asyncio.Event


_own: _World | None = None  # the world init_rpc opened, until the next one


def rpc_world() -> tuple[Session | None, asyncio.AbstractEventLoop | None]:
    """The session remote calls ride and its loop: the rpc world's own, else the default group's.

    An rpc world of its own answers even once closed, so that calls after
    ``rpc.shutdown()`` are refused rather than sent on the process group.
    """
    if _own is not None:
        return _own.group.session, _own.loop
    g = get_default_group()
    return (None, None) if g is None else (g.session, default_group_loop())


def is_open() -> bool:
    """True while an rpc world of its own is up (it keeps its event loop busy)."""
    return _own is not None and not _own.task.done()


async def open_world(
    init_method: str | None, rank: int, world_size: int, timeout: float | None = None
) -> ProcessGroup:
    """Join an rpc world of its own on the running loop; its world group.

    Raises:
        RuntimeError: An rpc world of its own is up already.
        RendezvousError, RendezvousTimeout: As ``init_process_group``.
    """
    global _own
    if is_open():
        raise RuntimeError("rpc is initialised already; call rpc.shutdown() first")
    loop = asyncio.get_running_loop()
    started: asyncio.Future[ProcessGroup] = loop.create_future()
    stop = asyncio.Event()
    base = default_group_name(os.environ)

    async def hold_open() -> None:
        try:
            async with open_process_group(
                init_method,
                world_size=world_size,
                rank=rank,
                group_name=base + RPC_JOB_SUFFIX,
                timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
                backend="aiodist",
            ) as group:
                started.set_result(group)
                await stop.wait()
        except BaseException as exc:
            if hand_over(started, exc):
                return
            raise

    def on_shutdown() -> None:  # the loop's end: leave (or fail, if the program is failing)
        if started.done() and not started.cancelled() and started.exception() is None:
            started.result().session.end_with(sys.exc_info()[1])
        stop.set()

    task = await hold(hold_open(), started, name="aiodist-rpc-world", on_shutdown=on_shutdown)
    group = started.result()
    _own = _World(group, loop, task, stop)
    ending.at_exit(_at_exit)
    return group


async def close_world(session: Session) -> None:
    """Leave the rpc world of its own whose session is ``session`` (a no-op for any other)."""
    world = _own
    if world is None or world.group.session is not session:
        return
    world.stop.set()
    await asyncio.shield(asyncio.gather(world.task, return_exceptions=True))


def _at_exit(exc: BaseException | None) -> None:
    """The program ends with the rpc world still up: leave it, or fail it if the program failed."""
    world = _own
    if world is None or world.task.done() or world.loop.is_closed():
        return
    session = world.group.session

    async def end() -> None:
        session.end_with(exc)
        with anyio.CancelScope(shield=True):
            await close_world(session)

    if world.loop.is_running():  # another thread's loop (aiodist.sync's)
        wait_future(asyncio.run_coroutine_threadsafe(end(), world.loop))
    else:
        world.loop.run_until_complete(end())
