"""Agreeing on the rendezvous server under torchrun, through torchrun's own store.

torchrun gives each worker ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` and its ``TORCHELASTIC_*`` variables, but what listens at
``MASTER_ADDR:MASTER_PORT`` is a torch ``TCPStore``, not an aiodist server:
with ``TORCHELASTIC_USE_AGENT_STORE=True`` (every rendezvous backend by
default) torchrun's agent on node 0 hosts it and every worker is a client;
otherwise worker rank 0 hosts it, as ``torch.distributed`` does
(``rendezvous._create_c10d_store``). So, under torchrun, rank 0 embeds an
aiodist server on a free port and publishes ``host:port`` in that store under
``aiodist/<run id>/<restart count>/server``; the other ranks wait for that key
and connect. No port is guessed, and a restart of the job by torchrun
(``--max-restarts``) publishes under a key of its own: the agent's store
outlives the workers, so a key from an earlier start must not be read.

torch is imported here only, when torchrun's environment is found: ``import
aiodist`` stays free of it. The store's calls block, so each runs in a daemon
thread of its own, abandoned if the caller is cancelled: bounded by its
timeout, it never holds up the loop nor, being a daemon, the process's exit. The
wait for rank 0's server polls the store (every ``STORE_POLL`` s), so that a
cancelled caller's thread ends at once instead of at the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

from aiodist._errors import RendezvousError, RendezvousTimeout

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

T = TypeVar("T")

#: The name of the threads the store's calls run in.
_THREAD: Final = "aiodist-torchrun-store"
#: Seconds between looks for rank 0's server in torchrun's store (a key set soon after start).
STORE_POLL: Final = 0.05

# Stores this process hosts (rank 0 without the agent's store): they must outlive the
# join, as torch's own do, since the other ranks may still be reading them.
_hosted: list[Any] = []
_HOW: Final = (
    "check that every worker was started by the same torchrun (or torchrun on every "
    "node with the same --rdzv-endpoint / --master-addr and --master-port)"
)


@dataclass(frozen=True, slots=True)
class Torchrun:
    """What torchrun told a worker about its run."""

    run_id: str
    restart_count: int
    use_agent_store: bool


def torchrun_env(environ: Mapping[str, str] | None = None) -> Torchrun | None:
    """torchrun's run, if this process is one of its workers (``TORCHELASTIC_RUN_ID`` set).

    Raises:
        RendezvousError: ``TORCHELASTIC_RESTART_COUNT`` is not an integer.
    """
    env = os.environ if environ is None else environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    restart_count = env_int(env, "TORCHELASTIC_RESTART_COUNT") or 0
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", str(True)) == str(True)
    return Torchrun(run_id or "none", restart_count, agent)


def env_int(environ: Mapping[str, str], name: str) -> int | None:
    """Environment variable ``name`` as an integer (None: unset or empty); RendezvousError
    if it is something else."""
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise RendezvousError(f"environment variable {name}={raw!r} is not an integer") from None


def server_key(run: Torchrun) -> str:
    """The store key under which rank 0 publishes the server of this start of the run."""
    return f"aiodist/{run.run_id}/{run.restart_count}/server"


def _tcp_store(
    host: str, port: int, rank: int, world_size: int, run: Torchrun, timeout: float
) -> Any:
    # Only under torchrun: `import aiodist` stays torch-free.
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    wait = datetime.timedelta(seconds=timeout)
    if run.use_agent_store:
        return TCPStore(host, port, is_master=False, timeout=wait)
    store = TCPStore(
        host,
        port,
        world_size,
        rank == 0,
        wait,
        wait_for_workers=False,
        multi_tenant=True,  # torch's own env:// store of this process shares it
    )
    if rank == 0:
        _hosted.append(store)
    return store


async def in_thread(fn: Callable[..., T], *args: object, name: str) -> T:
    """Run the blocking ``fn(*args)`` in a daemon thread named ``name``; await its result.

    Not ``asyncio.to_thread``: its executor refuses work once the interpreter is
    exiting, and joins its threads before the exit handlers that leave the job run;
    a daemon thread stuck in torch never holds the exit up.

    Cancellation:
        Cancelling the caller abandons the wait; the call runs to its end.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return  # the caller was cancelled: nobody waits for it
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(*args), None)
        except BaseException as exc:
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for it
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


async def open_store(
    host: str, port: int, rank: int, world_size: int, run: Torchrun, timeout: float
) -> Any:
    """Open torchrun's store at ``host:port`` (``MASTER_ADDR:MASTER_PORT``) as ``rank``.

    Raises:
        RendezvousError: The store cannot be reached.
    """
    where = f"{host}:{port}"
    try:
        return await in_thread(_tcp_store, host, port, rank, world_size, run, timeout, name=_THREAD)
    except RuntimeError as exc:  # torch's DistNetworkError / DistStoreError
        raise RendezvousError(
            f"cannot reach torchrun's store at MASTER_ADDR:MASTER_PORT={where} ({exc}); {_HOW}"
        ) from exc


async def publish_in(store: Any, key: str, server: tuple[str, int], where: str) -> None:
    """Write ``server``'s ``host:port`` under ``key`` in the torch store ``store``.

    Raises:
        RendezvousError: The store refused the write (``where`` names it).
    """
    value = f"{server[0]}:{server[1]}".encode()
    try:
        await in_thread(store.set, key, value, name=_THREAD)
    except RuntimeError as exc:
        raise RendezvousError(f"cannot write to {where} ({exc}); {_HOW}") from exc


async def find_in(
    store: Any, key: str, *, timeout: float, where: str, whose: str
) -> tuple[str, int]:
    """Wait for a server's ``host:port`` under ``key`` in the torch store ``store``.

    Raises:
        RendezvousTimeout: None came within ``timeout`` (``whose`` should have written it).
        RendezvousError: The store holds a malformed address.
    """

    abandoned = threading.Event()

    def wait_and_get() -> bytes:
        # Polled, not store.wait(): a wait cannot be taken back, and one abandoned by a
        # cancelled caller would hold its thread and connection for the whole timeout.
        deadline = time.monotonic() + timeout
        try:
            present = store.check([key])
        except RuntimeError:  # a store of the user's without check(): its wait, then
            store.wait([key], datetime.timedelta(seconds=timeout))
            return bytes(store.get(key))
        while not present:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no {key!r} within {timeout:g} s")
            if abandoned.wait(min(STORE_POLL, left)):
                raise RuntimeError("abandoned: the caller was cancelled")
            present = store.check([key])
        return bytes(store.get(key))

    try:
        value = await in_thread(wait_and_get, name=_THREAD)
    except RuntimeError as exc:
        raise RendezvousTimeout(
            f"{whose} published no aiodist server in {where} within {timeout:.1f} s; check "
            "that rank 0 runs and calls init_process_group too"
        ) from exc
    finally:
        abandoned.set()
    text = value.decode(errors="replace")
    server_host, _, server_port = text.rpartition(":")
    if not server_host or not server_port.isdecimal():
        raise RendezvousError(
            f"{where} holds {text!r} under {key!r}, not an aiodist server's host:port"
        )
    return server_host.strip("[]"), int(server_port)
