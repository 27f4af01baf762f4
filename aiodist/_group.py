"""Process groups: joining a job, heartbeats, and the group's shared state.

A *session* is this process's membership in one job: its control connection,
the job's store, heartbeats, the member table, and (once the data plane joins
in) the channels to its peers. Its *world* group spans every rank; groups made
with ``new_group`` are subsets that share the session.

Heartbeats are a timer of the control connection, stopped when it closes; an
embedded server lives in an anyio task group owned by ``open_process_group``
(made only when this process may embed one). Nothing outlives the ``async with``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio

from aiodist._errors import (
    ClosedError,
    DistError,
    ProtocolError,
    RankFailedError,
    from_wire,
)
from aiodist._inflight import Deadlines, start_task
from aiodist._peers import DataPlane
from aiodist._rendezvous import (
    RendezvousSpec,
    connect_rendezvous,
    may_embed,
    parse_init_method,
)
from aiodist._store import REPLY_GRACE, Store
from aiodist._wire.messages import (
    Barrier,
    Join,
    Leave,
    MemberFailed,
    MembersRequest,
    Welcome,
)
from aiodist._work import Work

if TYPE_CHECKING:
    from collections.abc import (
        AsyncIterator,
        Awaitable,
        Callable,
        Coroutine,
        Iterator,
        Sequence,
    )

    from anyio.abc import TaskGroup

    from aiodist._control import ControlConnection, Notice
    from aiodist._server.serve import RendezvousServer
    from aiodist._torch_bridge import GroupBridge

__all__ = [
    "DEFAULT_HEARTBEAT_INTERVAL",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "MemberInfo",
    "ProcessGroup",
    "Session",
    "open_process_group",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT: Final = 1800.0  # torch's default process-group timeout
DEFAULT_HEARTBEAT_INTERVAL: Final = 1.0
DEFAULT_HEARTBEAT_TIMEOUT: Final = 10.0
# How long closing waits for operations already started (peers may need our part).
CLOSE_GRACE: Final = 30.0
# How long closing waits for the server to take note that this member left.
LEAVE_TIMEOUT: Final = 5.0
# How long a process that embeds the server keeps it up for the other members.
EMBEDDED_SERVER_LINGER: Final = 60.0


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """One member of the job, as the rendezvous server reported it."""

    rank: int
    local_rank: int
    host: str
    pid: int
    addresses: tuple[str, ...]


class Session:
    """This process's membership in a job (shared by all its groups)."""

    def __init__(
        self,
        conn: ControlConnection,
        welcome: Welcome,
        *,
        group_name: str,
        timeout: float,
        backend: str | None,
        server: RendezvousServer | None,
        plane: DataPlane,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
    ) -> None:
        self.conn = conn
        self.plane = plane
        self.group_name = group_name
        self.timeout = timeout
        self.backend = backend
        self.server = server
        self.rank = welcome.rank
        self.world_size = welcome.world_size
        self.local_rank = welcome.local_rank
        self.local_size = welcome.local_size
        self.store = Store(conn, timeout)
        self.error: DistError | None = None
        self.closed = False
        self._barrier_seq = 0
        self._group_ids = itertools.count(1)
        self.inflight: set[asyncio.Task[None]] = set()
        self._members: list[MemberInfo] | None = None
        self.heartbeat_timeout = heartbeat_timeout
        self._trouble = asyncio.Event()  # set with the first error of the session or a group
        self._members_loading: asyncio.Future[list[MemberInfo]] | None = None
        try:
            host_ids = welcome.host_ids()
        except ValueError as exc:
            raise ProtocolError(f"the rendezvous server sent a malformed Welcome: {exc}") from None
        plane.set_members(self.rank, self.world_size, self._peer_table, host_ids)
        plane.on_peer_lost = self._peer_lost
        plane.on_peer_error = self._peer_error
        self.world = ProcessGroup(self, range(self.world_size), name=group_name, group_id=0)
        self.groups: dict[int, ProcessGroup] = {0: self.world}

    def next_group_id(self) -> int:
        return next(self._group_ids)

    async def members(self) -> list[MemberInfo]:
        """Every member of the job in rank order: host, pid and data-plane addresses.

        Fetched from the server on first use and kept: joining does not hand the
        whole table to every rank, which would cost O(N^2) for N ranks.

        Cancellation:
            Cancelling the caller leaves the fetch running for other callers.
        """
        if self._members is not None:
            return self._members
        if self._members_loading is None:
            self._members_loading = asyncio.ensure_future(self._load_members())
        return await asyncio.shield(self._members_loading)

    async def _load_members(self) -> list[MemberInfo]:
        try:
            table: Any = await self.conn.request(MembersRequest, timeout=self.timeout + REPLY_GRACE)
            members = [
                MemberInfo(int(r), int(lr), str(h), int(p), tuple(a)) for r, lr, h, p, a in table
            ]
        except BaseException:
            self._members_loading = None  # the next caller tries again
            raise
        self._members = members
        return members

    async def _peer_table(self) -> dict[int, tuple[str, ...]]:
        return {m.rank: m.addresses for m in await self.members()}

    async def _peer_lost(self, rank: int, reason: str) -> DistError | None:
        """Decide who failed when the data connection to ``rank`` broke; return the error.

        A broken connection is a symptom: ``rank`` may have died, or left because
        another rank died (it then told us, but its notice may be lost with the
        connection). The server is the authority: its notice of a failed member
        usually arrives within milliseconds, so wait for it (up to the heartbeat
        timeout) before blaming ``rank`` on the data plane's evidence alone.
        """
        if self.error is None:
            with anyio.move_on_after(self.heartbeat_timeout):
                await self._trouble.wait()
        broken = next((g.error for g in self.groups.values() if g.error is not None), None)
        if self.error is None and broken is not None:
            # A member's notice explained it (say, a mismatch made everyone leave):
            # the peer did not fail, and the session stays as usable as it was.
            return broken
        if self.error is None:
            # A peer that connected to us may be lost before we ever fetched the table.
            m = self._members[rank] if self._members is not None else None
            where = f" (host {m.host}, pid {m.pid})" if m is not None else ""
            self.fail(
                RankFailedError(
                    f"rank {rank}{where} failed: {reason}; group "
                    f"{self.group_name!r} is broken on all ranks. Restart the job.",
                    rank=rank,
                    host=m.host if m is not None else "",
                    pid=m.pid if m is not None else 0,
                    reason=reason,
                )
            )
        return self.error

    def _peer_error(self, src: int, header: Any) -> None:
        try:
            group_id, code, message, details = header
            group = self.groups[group_id]
        except (ValueError, TypeError, KeyError):
            logger.warning("ignoring a malformed error notice from rank %d", src)
            return
        group.break_(from_wire(code, message, details), notify=False)

    def on_notice(self, notice: Notice) -> None:
        if isinstance(notice, MemberFailed):
            self.fail(
                RankFailedError(
                    f"rank {notice.rank} (host {notice.host}, pid {notice.pid}) failed: "
                    f"{notice.reason}; group {self.group_name!r} is broken on all ranks. "
                    "Restart the job.",
                    rank=notice.rank,
                    host=notice.host,
                    pid=notice.pid,
                    reason=notice.reason,
                )
            )

    def fail(self, exc: DistError) -> None:
        """Mark every group of this session broken with ``exc`` (the first error wins)."""
        if self.error is None:
            self.error = exc
            logger.error("%s", exc)
            self._trouble.set()
        self.plane.fail(self.error)

    def check_usable(self) -> None:
        if self.closed:
            raise ClosedError(
                f"process group {self.group_name!r} was destroyed; call init_process_group again"
            )
        if self.error is not None:
            raise self.error

    async def barrier(self, timeout: float | None = None) -> None:
        """Wait until every member reached this barrier (server-side)."""
        self.check_usable()
        self._barrier_seq += 1
        seq = self._barrier_seq
        seconds = self.timeout if timeout is None else timeout
        await self.conn.request(lambda r: Barrier(r, seq, seconds), timeout=seconds + REPLY_GRACE)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        # A receive that no one may ever match would hold the close for the whole
        # timeout: fail point-to-point receives now, as torch's destroy does.
        self.plane.fail_p2p(ClosedError(f"process group {self.group_name!r} was destroyed"))
        running = [w for g in self.groups.values() for w in g.deadlines.running()]
        if self.inflight or running:
            # Sends and collectives already started complete for the peers' sake (bounded).
            with anyio.move_on_after(min(self.timeout, CLOSE_GRACE)):
                await asyncio.gather(*self.inflight, *running, return_exceptions=True)
        for g in self.groups.values():
            g.deadlines.close()
        await self.plane.aclose()
        if not self.conn.closed:
            with contextlib.suppress(DistError):  # DistTimeoutError included
                await self.conn.request(Leave, timeout=LEAVE_TIMEOUT)
        self.conn.close()
        if self.server is not None:
            # Others may still be using the server this process embeds: wait for them.
            server = self.server
            with anyio.move_on_after(EMBEDDED_SERVER_LINGER) as scope:
                await server.wait_until(lambda s: not s.state.jobs)
            if scope.cancelled_caught:
                logger.warning(
                    "stopping the embedded rendezvous server while %d jobs still use it",
                    len(server.state.jobs),
                )


class ProcessGroup:
    """A set of ranks that communicate together.

    Attributes:
        rank: This process's rank within the group.
        world_size: Number of ranks in the group.
        ranks: The global rank of each group rank.
    """

    def __init__(self, session: Session, ranks: Sequence[int], *, name: str, group_id: int) -> None:
        self._session = session
        self.ranks = ranks  # the world's is a range: O(1) lookups in a job of any size
        self.name = name
        self.group_id = group_id
        self.world_size = len(ranks)
        self.rank = ranks.index(session.rank) if session.rank in ranks else -1
        self.timeout = session.timeout
        self.group_backend: str | None = None  # new_group(backend=...); else the session's
        self.bridge: GroupBridge | None = None  # torch.distributed's side of this group, if any
        self.error: DistError | None = None
        self.closed = False
        self._seq = 0
        self._seq_lock = threading.Lock()
        self._index: dict[int, int] | None = None  # global rank -> group rank, on first use
        self.deadlines = Deadlines(self)  # one timer for the timeouts of all its operations

    def check_usable(self) -> None:
        """Raise the error that broke this group (or its session), if any."""
        self._session.check_usable()
        if self.closed:
            raise ClosedError(f"{self!r} was destroyed; create a new group with new_group")
        if self.error is not None:
            raise self.error
        if self.rank < 0:
            raise ValueError(f"this process (rank {self._session.rank}) is not in {self!r}")

    def close(self) -> None:
        """Destroy this group (not the session): its pending receives fail, later calls raise."""
        if self.closed:
            return
        self.closed = True
        self._session.groups.pop(self.group_id, None)
        self._session.plane.fail(ClosedError(f"{self!r} was destroyed"), self.group_id)
        self.deadlines.close()

    def break_(self, exc: DistError, *, notify: bool = True) -> None:
        """Mark this group unusable with ``exc`` on this rank and (``notify``) on every member."""
        if self.error is not None:
            return
        self.error = exc
        logger.error("group %r broken: %s", self.name, exc)
        self._session._trouble.set()
        plane = self._session.plane
        plane.fail(exc, self.group_id)
        if notify:
            header = [self.group_id, exc.code, str(exc), exc.wire_details()]
            for rank in self.ranks:
                if rank != self._session.rank:
                    self._spawn(self._notify(rank, header))

    async def _notify(self, rank: int, header: list[Any]) -> None:
        with contextlib.suppress(OSError, DistError):
            await self._session.plane.send_error(rank, header)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._session.inflight.add(task)
        task.add_done_callback(self._session.inflight.discard)

    def start(
        self, description: str, op: Callable[[int], Awaitable[T]], *, collective: bool = True
    ) -> Work[T]:
        """Run ``op(seq)`` as this group's next operation and return its handle.

        The sequence number is taken now, at call time, so every rank numbers its
        operations in the same order however tasks are scheduled. A timeout or an
        error that makes the operation impossible breaks the group for every member.
        """
        loop, work, seq = self.begin(description, collective=collective, timed=False)
        start_task(self, loop, work, op, seq, collective)
        return work

    def begin(
        self, description: str, *, collective: bool = True, timed: bool = True
    ) -> tuple[asyncio.AbstractEventLoop, Work[Any], int]:
        """Take the next operation's handle and sequence number, for a callback-driven op.

        The caller settles the handle itself (``_inflight.fail`` on errors); with
        ``timed`` it fails with ``DistTimeoutError`` after the group's timeout.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                f"{description} must be called from the event loop that joined the job; "
                "from plain code use aiodist.sync"
            ) from None
        self.check_usable()
        # Point-to-point takes no sequence number: not every rank calls it.
        seq = self.next_seq() if collective else self._seq
        work: Work[Any] = Work.pending(loop, f"{description}#{seq}")
        if timed:
            self.deadlines.add(loop, work, None)
        return loop, work, seq

    def next_seq(self) -> int:
        """Take the group's next sequence number (under a lock: metric syncs on the
        shared board take theirs from the training loop's thread)."""
        with self._seq_lock:
            self._seq += 1
            return self._seq

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def group_rank_of(self, rank: object, name: str) -> int:
        """The group rank of global ``rank``: ``src``/``dst`` are global ranks, as in torch.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is not a member of this group.
        """
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"{name} must be an int rank, got {type(rank).__name__}")
        if isinstance(self.ranks, range):
            if rank in self.ranks:
                return self.ranks.index(rank)
        else:
            if self._index is None:
                self._index = {r: i for i, r in enumerate(self.ranks)}
            if rank in self._index:
                return self._index[rank]
        raise ValueError(
            f"{name}={rank} is not a member of {self!r} (its global ranks: "
            f"{_ranges(self.ranks)}); {name} is a global rank, as in torch.distributed"
        )

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name!r} rank {self.rank} of {self.world_size}>"

    @property
    def session(self) -> Session:
        return self._session

    @property
    def backend(self) -> str | None:
        return self.group_backend or self._session.backend

    @property
    def store(self) -> Store:
        return self._session.store


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``: short even for large groups."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _default_group_name(environ: dict[str, str] | os._Environ[str]) -> str:
    return environ.get("AIODIST_JOB_ID") or environ.get("TORCHELASTIC_RUN_ID") or "default"


@contextlib.asynccontextmanager
async def open_process_group(
    init_method: str | None = None,
    *,
    world_size: int = -1,
    rank: int = -1,
    group_name: str = "",
    timeout: float = DEFAULT_TIMEOUT,
    backend: str | None = None,
    heartbeat_interval: float | None = None,
    heartbeat_timeout: float | None = None,
    hostname: str | None = None,
    addresses: list[str] | None = None,
) -> AsyncIterator[ProcessGroup]:
    """Join a job and yield its world group; leave the job on exit.

    Args:
        init_method: ``tcp://HOST:PORT``, ``env://`` (default) or ``file:///path``.
        world_size: Number of ranks; required unless the environment gives it.
        rank: This process's rank, or -1 to let the server assign one.
        group_name: The job's name on the server (default ``$AIODIST_JOB_ID`` or
            ``"default"``); jobs sharing a server need distinct names.
        timeout: Seconds to wait for the job to form; also the default timeout of
            every operation.
        backend: Recorded for ``get_backend``; the torch bridge brings it up.
        heartbeat_interval: Seconds between heartbeats (``AIODIST_HEARTBEAT_INTERVAL``).
        heartbeat_timeout: Silence after which the server declares this rank failed
            (``AIODIST_HEARTBEAT_TIMEOUT``).
        hostname: The host this rank counts as for local ranks (default: this
            machine's name; never resolved).
        addresses: Data-plane addresses to publish to the other members.

    Raises:
        RendezvousError: The job refused this process (conflicting rank or world size).
        RendezvousTimeout: The job did not form within ``timeout``.

    Cancellation:
        Cancelling while joining abandons the join; the server drops this member.
    """
    env = os.environ
    spec = parse_init_method(init_method, rank=rank, world_size=world_size)
    if spec.world_size < 1:
        raise ValueError(
            f"world_size must be given (>= 1), got {spec.world_size}: pass world_size= or set "
            "WORLD_SIZE"
        )
    if not -1 <= spec.rank < spec.world_size:
        raise ValueError(f"rank must be in [0, {spec.world_size}) or -1, got {spec.rank}")
    interval = heartbeat_interval or float(
        env.get("AIODIST_HEARTBEAT_INTERVAL", DEFAULT_HEARTBEAT_INTERVAL)
    )
    hb_timeout = heartbeat_timeout or float(
        env.get("AIODIST_HEARTBEAT_TIMEOUT", DEFAULT_HEARTBEAT_TIMEOUT)
    )
    if not 0 < interval < hb_timeout:
        raise ValueError(
            f"heartbeat_interval ({interval}) must be > 0 and below heartbeat_timeout "
            f"({hb_timeout})"
        )
    name = group_name or _default_group_name(env)
    args = (spec, name, timeout, backend, interval, hb_timeout, hostname, addresses)
    if not may_embed(spec, env):
        # Nothing to run beside the member (heartbeats are a timer): no task group.
        async with _joined(None, *args) as group:
            yield group
        return
    with _unwrap_single_error():
        async with anyio.create_task_group() as tg:
            async with _joined(tg, *args) as group:
                yield group


@contextlib.contextmanager
def _unwrap_single_error() -> Iterator[None]:
    # Task groups wrap every error in an ExceptionGroup; a caller that gets one
    # error (RendezvousError, or its own) should see it plainly.
    try:
        yield
    except BaseExceptionGroup as group:
        errors = _flatten(group)
        if len(errors) == 1:
            raise errors[0] from errors[0].__cause__
        raise


def _flatten(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_flatten(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


@contextlib.asynccontextmanager
async def _joined(
    tg: TaskGroup | None,
    spec: RendezvousSpec,
    name: str,
    timeout: float,
    backend: str | None,
    interval: float,
    hb_timeout: float,
    hostname: str | None,
    addresses: list[str] | None,
) -> AsyncIterator[ProcessGroup]:
    session_box: list[Session] = []

    def on_notice(notice: Notice) -> None:
        if session_box:
            session_box[0].on_notice(notice)

    conn, server = await connect_rendezvous(spec, tg, timeout=timeout, on_notice=on_notice)
    plane = DataPlane(name)
    try:
        published = [*(addresses or []), *await plane.listen(conn.local_host)]
        host, pid = hostname or socket.gethostname(), os.getpid()
        conn.start_heartbeats(interval)
        welcome: Any = await conn.request(
            lambda r: Join(
                r, name, spec.world_size, spec.rank, host, pid, published, hb_timeout, timeout
            ),
            timeout=timeout + REPLY_GRACE,
        )
        session = Session(  # ProtocolError if the Welcome is malformed
            conn,
            welcome,
            group_name=name,
            timeout=timeout,
            backend=backend,
            server=server,
            plane=plane,
            heartbeat_timeout=hb_timeout,
        )
    except BaseException:
        conn.close()
        with anyio.CancelScope(shield=True):
            await plane.aclose()
        raise
    if spec.local_rank is not None:
        session.local_rank = spec.local_rank  # the launcher's word wins, as in torch
    if spec.local_world_size is not None:
        session.local_size = spec.local_world_size
    session_box.append(session)
    try:
        yield session.world
    finally:
        with anyio.CancelScope(shield=True):
            await session.aclose()
        if tg is not None:
            tg.cancel_scope.cancel()  # the embedded server, if this process started one
