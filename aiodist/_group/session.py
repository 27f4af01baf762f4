"""A rank's membership in a job: the session that all its groups share.

A *session* is this process's membership in one job: its control connection,
the job's store, heartbeats, the member table, and (once the data plane joins
in) the channels to its peers. It hears of failed members from the server and
of lost connections from the data plane, decides who failed, and breaks its
groups with the same error on every rank. It sees its groups through
``SessionGroup``, what it needs of them: ``group.py``'s ``ProcessGroup``
builds on the session, never the other way round (``join.py`` makes the world
group once the session is made). Closing it lets
started operations finish, leaves the job, and keeps an embedded server up
while other members still use it.

A member that *left* (closed its session: ``destroy_process_group``) has not
failed: the server tells the others (``MembersLeft``), and so does its goodbye
on the data channels it had. Nothing breaks for the ranks that do not need it;
an operation that waits on it, or starts later and needs it, fails at once with
``RankFailedError`` naming it (``rank_left_error``). A session that loses its
rendezvous server (the server's process died, or went silent for the heartbeat
timeout) can no longer learn that other ranks failed: it breaks every group
with the control connection's error, which names the server. A server that
may come back (a daemon) is waited for instead, for the grace period: a peer
lost meanwhile is not blamed until the server, back, has had its time to
say who failed (``_await_verdict``), so every member reaches the same verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

import anyio

from aiodist import _settings
from aiodist._control.channel import ServerAway, ServerBack, ServerLost
from aiodist._control.store import REPLY_GRACE, Store
from aiodist._errors import (
    AbortedError,
    AuthenticationError,
    ClosedError,
    DistError,
    GroupBrokenError,
    ProtocolError,
    RankFailedError,
    counted,
    from_wire,
    rank_left_error,
)
from aiodist._group import dumps, tracefile
from aiodist._group.ending import failure_of, interrupted
from aiodist._group.lingering import linger
from aiodist._group.membership import failed_error
from aiodist._group.recorder import Recorder, new_recorder
from aiodist._group.views import Views
from aiodist._wire.bounds import MAX_WORLD_SIZE
from aiodist._wire.messages import (
    Barrier,
    DumpNotice,
    Leave,
    MemberFailed,
    MembersFailed,
    MembersJoined,
    MembersLeft,
    MembersRequest,
    PeerError,
)
from aiodist._wire.timing import STALL_WINDOW, reattach_window

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from aiodist._control.channel import ControlChannel, Notice
    from aiodist._group.inflight import Deadlines
    from aiodist._plane.peers import DataPlane
    from aiodist._server.serve import RendezvousServer
    from aiodist._wire.messages import Welcome

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT: Final = 1800.0  # torch's default process-group timeout
DEFAULT_HEARTBEAT_INTERVAL: Final = _settings.HEARTBEAT_INTERVAL.default
DEFAULT_HEARTBEAT_TIMEOUT: Final = _settings.HEARTBEAT_TIMEOUT.default
# A loop late by more than this many heartbeat timeouts was silent past the server's sweep:
# the server declared its members failed (see Session._declared_failed).
STALL_FACTOR: Final = 1.25
# How long closing waits for operations already started (peers may need our part).
CLOSE_GRACE: Final = 30.0
# How long closing waits for the server to take note that this member left.
LEAVE_TIMEOUT: Final = 5.0
# How long a process that embeds the server keeps it up for the other members.
EMBEDDED_SERVER_LINGER: Final = 60.0
#: The group id of the job's world group (``join.py`` makes it with the session).
WORLD_GROUP_ID: Final = 0


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """One member of the job, as the rendezvous server reported it."""

    rank: int
    local_rank: int
    host: str
    pid: int
    addresses: tuple[str, ...]


class SessionGroup(Protocol):
    """What the session needs of each of its groups (``group.ProcessGroup``).

    The session breaks them when a member fails or a peer says so, fails a
    call a member aborted, and closes them with itself; the rest of a group
    (its operations, its numbering, torch's side) is the group's own.
    """

    ranks: Sequence[int]  # the job's rank of each group rank
    error: DistError | None  # what broke it; None while usable
    keeps_p2p: bool  # broken by a member's failure: point-to-point goes on
    closed: bool
    deadlines: Deadlines  # its operations in flight

    def break_(self, exc: DistError, *, notify: bool = True, keep_p2p: bool = False) -> None:
        """Mark the group unusable with ``exc`` here and (``notify``) on every member."""
        ...

    def abort_remote(self, seq: int, exc: AbortedError) -> None:
        """A member aborted call ``seq``: fail it here, now or when it is made."""
        ...

    def on_close(self, method: Callable[[], object]) -> None:
        """Call the bound ``method`` (held weakly) when the group or its session closes."""
        ...

    def run_close_hooks(self) -> list[asyncio.Future[Any]]:
        """Run the close hooks registered so far; return the futures they returned."""
        ...


class Session:
    """This process's membership in a job (shared by all its groups)."""

    def __init__(
        self,
        conn: ControlChannel,
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
        # The flight recorder (recorder.py); each heartbeat says where this rank is, and
        # what its data plane sent.
        self.recorder: Recorder | None = new_recorder(welcome.rank, group_name)
        conn.where = self._where
        if self.recorder is not None:
            dumps.register(self.recorder)  # SIGUSR1 writes it
        self.error: DistError | None = None
        self.closed = False
        self._barrier_seq = 0
        self._group_ids = itertools.count(1)
        self.inflight: set[asyncio.Task[None]] = set()
        self._members: list[MemberInfo] | None = None
        self.heartbeat_timeout = heartbeat_timeout
        self._trouble = asyncio.Event()  # set with the first error of the session or a group
        self._news = asyncio.Event()  # set (and replaced) on trouble and when a member leaves
        self._left_info: dict[int, tuple[str, int]] = {}  # members that left: host, pid
        self.failed_ranks: dict[int, RankFailedError] = {}  # members that failed (membership.py)
        # Called with its rank when a member failed or left (ranks_alive() changed).
        self.on_member_gone: list[Callable[[int], object]] = []
        # After shrink_group replaced the default group: the global rank a user names ->
        # the job's rank (its data-plane address); None while they are the same.
        self.numbering: tuple[int, ...] | None = None
        self.abandoned = False  # close without waiting for operations in flight
        self.failed_reason = ""  # why this rank failed (its program's end), told on leaving
        self._left = False
        self._members_loading: asyncio.Future[list[MemberInfo]] | None = None
        # Membership views (views.py): epoch 0 is the job as it formed; a newcomer's
        # first view (-1 until then) comes with the server's notice of its join.
        self.views = Views(0, range(self.world_size))
        self.hostname = ""  # the host this member joined as (newcomers' local ranks)
        self.joined_late = False  # it joined the job after it formed (admitted())
        try:
            host_ids = welcome.host_ids()
        except ValueError as exc:
            raise ProtocolError(f"the rendezvous server sent a malformed Welcome: {exc}") from None
        plane.set_members(self.rank, self.world_size, self._peer_table, host_ids)
        plane.on_peer_lost = self._peer_lost
        plane.on_peer_left = self._peer_left
        plane.on_peer_error = self._peer_error
        plane.on_peer_refused = self._peer_refused
        # Its groups by id; the world group (WORLD_GROUP_ID) first, put here by ``join.py``.
        self.groups: dict[int, SessionGroup] = {}

    def _where(self) -> list[Any]:
        # ``Heartbeat.where``'s entry of this member (but its channel): ``[current, last, sent]``.
        position = self.recorder.where() if self.recorder is not None else [None, None]
        return [*position, self.plane.sent()]

    def admitted(self) -> None:
        """This process joined a formed elastic job: its default group is not formed yet.

        Its first view comes with the server's notice of its join; it forms a group
        with the others when they all call ``regroup`` over that view. Until then its
        rank is the job rank it was given (never a world of its own, where a script's
        ``if rank == 0`` would make it a second rank 0), and a collective on the
        default group raises an error that says to regroup; point-to-point by job
        rank goes on.
        """
        self.views = Views(-1, [self.rank])
        self.joined_late = True
        self.world.error = GroupBrokenError(
            f"this process joined job {self.group_name!r} after it formed, as rank "
            f"{self.rank}: the default group holds it only once every rank calls regroup "
            "over the view of its join; call `await aiodist.regroup(await "
            "aiodist.membership())` (aiodist.sync: `regroup(membership())`) before a "
            "collective on the default group"
        )
        self.world.keeps_p2p = True

    @property
    def world(self) -> SessionGroup:
        """The job's world group (``join.py`` makes it once the session is made)."""
        return self.groups[WORLD_GROUP_ID]

    def next_group_id(self) -> int:
        return next(self._group_ids)

    def number_groups_from(self, first: int) -> None:
        """Number the next groups from ``first`` (after ``regroup``: a newcomer's count
        of groups made before it came would differ from the others')."""
        self._group_ids = itertools.count(first)

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
            self._members_loading = loading = linger(self._load_members())
            # Its callers see its error through the shield; one that is gone (a
            # leave cancelled it, the loop ended) must not leave it unretrieved.
            loading.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(self._members_loading)

    def forget_members(self) -> None:
        """The job grew: fetch the member table again on next use."""
        self._members = None
        self._members_loading = None

    async def _load_members(self) -> list[MemberInfo]:
        # The job may grow while the table comes (``forget_members``: the notice can be
        # handled before this task resumes with the reply): that table is not kept.
        mine = asyncio.current_task()
        try:
            table: Any = await self.conn.request(MembersRequest, timeout=self.timeout + REPLY_GRACE)
            members = [
                MemberInfo(int(r), int(lr), str(h), int(p), tuple(a)) for r, lr, h, p, a in table
            ]
        except BaseException:
            if self._members_loading is mine:
                self._members_loading = None  # the next caller tries again
            raise
        if self._members_loading is mine:
            self._members = members
        return members

    async def _peer_table(self) -> dict[int, tuple[str, ...]]:
        return {m.rank: m.addresses for m in await self.members()}

    async def _peer_lost(self, rank: int, reason: str) -> BaseException | None:
        """Decide who failed when the data connection to ``rank`` broke; return the error.

        A broken connection is a symptom: ``rank`` may have died, or left because
        another rank died (it then told us, but its notice may be lost with the
        connection). The server is the authority: wait for its verdict
        (``_await_verdict``) before blaming ``rank`` on the data plane's evidence alone.
        """
        if (stalled := self._declared_failed()) is not None:
            return stalled
        # Groups broken before (a failure the survivors went on from) explain nothing now.
        before = {id(g) for g in self.groups.values() if g.error is not None}

        def newly_broken() -> DistError | None:
            return next(
                (
                    g.error
                    for g in self.groups.values()
                    if g.error is not None and id(g) not in before
                ),
                None,
            )

        await self._await_verdict(
            lambda: self.error is not None or rank in self.plane.left or newly_broken() is not None
        )
        left = self.plane.left.get(rank)
        if self.error is None and left is not None:
            # It left or failed (its goodbye may have been lost with a reset connection):
            # only what needs it fails.
            self.plane.peer_left(rank, left)
            return left
        broken = newly_broken()
        if self.error is None and broken is not None:
            # A member's notice explained it (say, a mismatch made everyone leave):
            # the peer did not fail, and the session stays as usable as it was.
            return broken
        if self.error is None:
            # A peer that connected to us may be lost before we ever fetched the table.
            m = next((m for m in self._members or () if m.rank == rank), None)
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

    async def _await_verdict(self, decided: Callable[[], bool]) -> None:
        """Return once ``decided()``, or once the server had its time to decide and did not.

        The server's notice of a failed member usually arrives within milliseconds:
        it gets the heartbeat timeout. It says nothing while it is away (this
        connection reconnects) or stands still (silent: counted as away after the
        heartbeat timeout), so no time counts meanwhile. Back, it gets its re-attach
        window (a rank that died meanwhile is declared failed at its end, on every
        member alike: it counts as away, not failed, a member it lost while it was
        gone or stood still) and the heartbeat timeout more. A server that does not
        come back within the grace period fails every member with the same error.
        """
        loop = asyncio.get_running_loop()
        hb, liveness = self.heartbeat_timeout, self.conn.liveness
        since = loop.time()  # the server's time to decide counts from here
        deadline = since + hb
        # A server that stood still just before (one this rank's loop hosts stands still
        # with it) counts a connection lost within STALL_WINDOW of its return as
        # reconnecting: its verdict on that member comes a re-attach window later.
        late = liveness.resumed_at + STALL_WINDOW + reattach_window(hb)
        if late > since:
            deadline = late + hb
        was_away = False
        while not decided():
            if self.conn.server_away:
                was_away = True
                await self._news.wait()  # ServerBack, or ServerLost (self.error) wakes it
                continue
            now = loop.time()
            if was_away or liveness.resumed_at > since:  # back, or running again
                since = now if was_away else liveness.resumed_at
                deadline = since + reattach_window(hb) + hb
                was_away = False
            if now >= deadline:
                if liveness.last_heard > since:
                    return  # it was there all along, and named nobody
                since, deadline = now, now + hb  # silent: its heartbeat watch judges it
                continue
            with anyio.move_on_after(deadline - now):
                await self._news.wait()

    def _peer_refused(self, exc: AuthenticationError) -> None:
        """A peer failed the data plane's token handshake: break every group it is in.

        The peer lives, so no server notice will come: the groups' members hear it
        from this rank, as from a failed collective.
        """
        for group in list(self.groups.values()):
            if exc.rank in group.ranks:
                group.break_(exc)

    def _peer_error(self, src: int, notice: PeerError) -> None:
        group_id = notice.group_id
        try:
            error = from_wire(notice.code, notice.message, notice.details)
            seq = int(notice.details["seq"]) if isinstance(error, AbortedError) else 0
        except (ValueError, TypeError, KeyError):
            logger.warning("ignoring a malformed error notice from rank %d", src)
            return
        # A member registers a new group before any rank can finish making it, so
        # a notice for a group unknown here is for one this rank destroyed already.
        group = self.groups.get(group_id)
        if group is None:
            logger.debug("ignoring an error notice from rank %d: no group %r", src, group_id)
        elif isinstance(error, AbortedError):
            group.abort_remote(seq, error)
        elif isinstance(error, RankFailedError) and error.rank == self.rank:
            # A member heard that this rank failed: it ran again after the server's verdict
            # (or it told the server so itself, as its program ended: no news).
            if not self.failed_reason:
                self.fail(self._failed_itself(error.reason, self.conn.stalled_for()))
        else:
            group.break_(error, notify=False)

    async def _retell_breaks(self) -> None:
        """Before the goodbyes: tell each peer this rank has a channel to why a group of
        theirs broke here (a disagreement, a timeout; not a member's failure or leave).

        A member still waiting in the call that broke then reads the reason before this
        rank's goodbye (one channel, in order). Otherwise the goodbye can overtake the
        notice of the rank that found the reason (another channel), and the call fails
        with "rank r left the job" instead: a rank that learned of a disagreement from
        group rank 0 (``exchange_rows``) and ended its program at once.
        """
        routes = self.plane.routes
        with anyio.move_on_after(LEAVE_TIMEOUT):  # a stopped peer's full socket waits no longer
            for group_id, group in list(self.groups.items()):
                exc = group.error
                if exc is None or isinstance(exc, RankFailedError | ClosedError):
                    continue
                notice = PeerError(group_id, exc.code, str(exc), exc.wire_details())
                for rank in group.ranks:
                    if rank != self.rank and rank in routes:
                        with contextlib.suppress(OSError, DistError):
                            await self.plane.send_error(rank, notice)

    def _declared_failed(self) -> DistError | None:
        """This session's error if its loop stopped long enough for the server to fail it.

        Asked when a peer went away or left: a rank that was stopped (SIGSTOP, a
        debugger, a blocking call on its loop) finds, once it runs again, its peers
        gone or saying goodbye because they were told that it failed. It must say
        so, not blame them.
        """
        if self.error is None:
            stalled = self._stall_error()
            if stalled is None:
                return None
            self.fail(stalled)
        return self.error

    def _stall_error(self) -> RankFailedError | None:
        stall = self.conn.stalled_for()
        # Silent at least that long: past the timeout plus the server's sweep period (a
        # quarter of it at most), the server has declared this rank failed for certain.
        if stall <= STALL_FACTOR * self.heartbeat_timeout:
            return None
        return self._failed_itself(f"its event loop stopped for {stall:.1f} s", stall)

    def _failed_itself(self, reason: str, stall: float) -> RankFailedError:
        """The error of a rank the server declared failed, as that rank tells it."""
        stalled = stall > self.heartbeat_timeout / 2
        why = (
            f"its event loop stopped for {stall:.1f} s (the process was suspended, as by "
            "SIGSTOP or a debugger, or a call blocked the loop), longer than the heartbeat "
            f"timeout of {self.heartbeat_timeout:.1f} s"
            if stalled
            else reason
        )
        advice = (  # for a stalled loop only: other verdicts have causes of their own
            " Restart the job, and keep the loop free of blocking calls (or raise "
            "AIODIST_HEARTBEAT_TIMEOUT)."
            if stalled
            else " Restart the job."
        )
        return RankFailedError(
            f"this rank ({self.rank}, pid {os.getpid()}) was declared failed by the "
            f"rendezvous server: {why}; group {self.group_name!r} is broken on all ranks." + advice,
            rank=self.rank,
            pid=os.getpid(),
            reason=reason,
        )

    async def _peer_left(self, rank: int) -> BaseException:
        """The error of operations that need ``rank``, which said goodbye on a data channel."""
        if (stalled := self._declared_failed()) is not None:
            return stalled
        if rank not in self._left_info:
            with contextlib.suppress(DistError):  # without the table, the rank is named alone
                m = (await self.members())[rank]
                self._left_info.setdefault(rank, (m.host, m.pid))
        host, pid = self._left_info.get(rank, ("", 0))
        return rank_left_error(rank, host, pid)

    def _members_left(self, members: list[Any]) -> None:
        if self._declared_failed() is not None:
            return  # they left because this rank was declared failed
        for entry in members:
            try:
                rank, host, pid = entry
                if type(rank) is not int or type(host) is not str or type(pid) is not int:
                    raise TypeError
            except (TypeError, ValueError):
                logger.warning("ignoring a malformed notice of a member that left: %r", entry)
                continue
            if rank == self.rank or not 0 <= rank < self.world_size:
                continue
            self._left_info[rank] = (host, pid)
            self.views.gone(rank)
            self.plane.peer_left(rank, rank_left_error(rank, host, pid))
            for hook in list(self.on_member_gone):
                hook(rank)
        self._wake()

    def _members_joined(self, notice: MembersJoined) -> None:
        """The server admitted newcomers: grow this member's view of the job."""
        try:
            joined = [(int(r), str(h)) for r, h, _ in notice.joined]
            ranks = [int(r) for r in notice.ranks]
        except (TypeError, ValueError):
            logger.warning("ignoring a malformed notice of members that joined: %r", notice)
            return
        if notice.world_size > self.world_size and notice.world_size <= MAX_WORLD_SIZE:
            plane = self.plane
            old = plane.host_ids
            ids = [old[r] for r in range(self.world_size)]
            fresh = max(ids, default=0) + 1
            hosts = dict(joined)
            for rank in range(self.world_size, notice.world_size):
                if hosts.get(rank) == self.hostname:
                    ids.append(ids[self.rank] if self.rank < len(ids) else fresh)
                else:
                    ids.append(fresh)  # another host (or one this member does not know)
                    fresh += 1
            self.world_size = notice.world_size
            self.forget_members()  # the table is fetched again, newcomers' addresses with it
            plane.grow(notice.world_size, ids)
        self.views.joined(notice.epoch, ranks, [r for r, _ in joined])

    def isolate_failure(self, rank: int, host: str, pid: int, reason: str) -> None:
        """Break what needs failed ``rank`` on this member, and nothing else (``membership``)."""
        if rank in self.failed_ranks or not 0 <= rank < self.world_size:
            return
        exc = failed_error(rank, host, pid, reason)
        self.failed_ranks[rank] = exc
        # Sends to it and receives from it fail now (its channels are dropped).
        self.plane.peer_failed(rank, exc)
        for group in list(self.groups.values()):
            if rank in group.ranks and group.error is None and not group.closed:
                # Every member of the group hears the same notice: no need to tell them.
                group.break_(exc, notify=False, keep_p2p=True)
        self.note_trouble()
        for hook in list(self.on_member_gone):
            hook(rank)

    def ranks_alive(self) -> list[int]:
        """The job's ranks that neither failed nor left, as this member knows them."""
        gone = self.failed_ranks.keys() | self.plane.left.keys()
        return [r for r in range(self.world_size) if r not in gone]

    def _wake(self) -> None:
        news, self._news = self._news, asyncio.Event()
        news.set()

    def on_notice(self, notice: Notice) -> None:
        if isinstance(notice, DumpNotice):
            dumps.request_dump(self.recorder, "aiodist status --dump", notice.request)
        elif isinstance(notice, MembersLeft):
            self._members_left(notice.members)
        elif isinstance(notice, ServerLost):
            if not self.closed:
                self.fail(notice.error)  # it names the server, and says what it means
        elif isinstance(notice, ServerAway | ServerBack):
            self._wake()  # a wait for the server's verdict stops or starts counting
        elif isinstance(notice, MembersJoined):
            self._members_joined(notice)
        elif isinstance(notice, MembersFailed):
            try:
                failures = notice.each()
            except ValueError as exc:
                logger.warning("ignoring a malformed notice of failed members: %s", exc)
                return
            for failure in failures:
                self.on_notice(failure)
        elif isinstance(notice, MemberFailed):
            if notice.rank == self.rank:  # told of itself: it ran again after the verdict
                if not self.failed_reason:  # else the echo of its own word, as it ends
                    self.fail(self._failed_itself(notice.reason, self.conn.stalled_for()))
                return
            if notice.rank in self.failed_ranks:
                return  # told again (a re-attached member hears every failure of its job)
            self.views.gone(notice.rank)
            # Only what needs it breaks (failure isolation, membership.py).
            self.isolate_failure(notice.rank, notice.host, notice.pid, notice.reason)

    def note_trouble(self) -> None:
        """A group of this session broke: wake whoever waits for the first sign of trouble."""
        if not self._trouble.is_set():
            dumps.on_failure(self.recorder, "a group broke")
        self._trouble.set()
        self._wake()

    async def trouble(self) -> None:
        """Return once this session or one of its groups has had an error."""
        await self._trouble.wait()

    def fail(self, exc: DistError) -> None:
        """Mark every group of this session broken with ``exc`` (the first error wins)."""
        if self.error is None:
            self.error = exc
            logger.error("%s", exc)
            if not self._trouble.is_set():
                dumps.on_failure(self.recorder, f"{type(exc).__name__}: {exc}")
            self._trouble.set()
            self._wake()
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

    def abandon(self) -> None:
        """Make closing fail the operations in flight at once, instead of letting them finish.

        For a process being interrupted (Ctrl-C in a blocking call): it will not wait
        for peers that may never come. The peers learn that this rank left.
        """
        self.abandoned = True

    def end_with(self, exc: BaseException | None) -> None:
        """The program is ending with ``exc`` uncaught (None: normally); see ``ending``.

        An exception, a non-zero ``sys.exit`` or Ctrl-C: closing fails what is in
        flight at once. The peers hear that this rank failed, and why (Ctrl-C:
        that it left, as ``abandon`` has it).
        """
        reason = failure_of(exc)
        if reason is not None:
            self.failed_reason = reason
        if reason is not None or interrupted(exc):
            self.abandon()

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        for g in list(self.groups.values()):
            g.run_close_hooks()
        # A receive that no one may ever match would hold the close for the whole
        # timeout: fail point-to-point receives now, as torch's destroy does.
        self.plane.fail_p2p(ClosedError(f"process group {self.group_name!r} was destroyed"))
        running = [w for g in self.groups.values() for w in g.deadlines.running()]
        if self.abandoned:
            closed = ClosedError(
                f"process group {self.group_name!r} was destroyed while this operation ran "
                "(the process was interrupted)"
            )
            for g in self.groups.values():
                # Broken quietly: the peers hear that this rank left, not this.
                g.error = g.error or closed
            self.plane.fail(closed)
            for w in running:
                w.set_exception(closed)
            for task in list(self.inflight):
                task.cancel()
        elif self.inflight or running:
            # Sends and collectives already started complete for the peers' sake (bounded).
            with anyio.move_on_after(min(self.timeout, CLOSE_GRACE)):
                await asyncio.gather(*self.inflight, *running, return_exceptions=True)
        for g in self.groups.values():
            g.deadlines.close()
        if self.recorder is not None and self.recorder.trace_dir is not None:
            tracefile.write_trace(self.recorder, self.recorder.trace_dir)  # AIODIST_TRACE
        # A rank that failed tells the server first, and says no goodbye: its peers see
        # the connection drop and hear from the server that it failed, and why.
        failed = bool(self.failed_reason)
        if failed:
            await self._leave()
        # A rank that lost its server does not leave cleanly (the server cannot hear it):
        # no goodbye, so that its peers learn why from their own server connection.
        bye = self.conn.error is None and not failed
        if bye:
            await self._retell_breaks()
        await self.plane.aclose(bye=bye)
        await self._leave()
        self.conn.close()
        if self.server is not None and not self.abandoned:
            # Others may still be using the server this process embeds: wait for them.
            server = self.server
            with anyio.move_on_after(EMBEDDED_SERVER_LINGER) as scope:
                await server.wait_until(lambda s: not s.state.jobs)
            if scope.cancelled_caught:
                logger.warning(
                    "stopping the embedded rendezvous server while %s still use it",
                    counted(len(server.state.jobs), "job"),
                )

    async def _leave(self) -> None:
        """Tell the server this member leaves (or failed: ``failed_reason``); once."""
        if not self.conn.closed and not self._left:
            self._left = True
            reason = self.failed_reason
            with contextlib.suppress(DistError):  # DistTimeoutError included
                await self.conn.request(lambda r: Leave(r, reason), timeout=LEAVE_TIMEOUT)
