"""Small collectives through shared memory: every rank's row on a board, no message.

``exchange_rows`` (barriers, small all_reduces, the openings of one-way
operations, metric syncs) costs each rank mostly the Python that handles each
message, not the bytes. When every rank of a group runs on one host with
shared memory on, the exchange goes through memory instead: each rank writes
its row, with its signature, into a slot of its own rows segment
(``_transport.shmrows``) and reads every other rank's from theirs. No message
is sent or handled; a rank looks for the rows on the event loop, polling while
a wait is young and backing off to a timer once it is not.

**Which groups.** Every rank publishes its rows segment among its addresses,
and every rank reads the same member table: a group takes the board when all
its ranks are on this host, agreed on shared memory (``shared.agreed``), and
published a segment, and when the host has a CPU for every ``RANKS_PER_CPU``
of them (the same answer on every rank). Until a rank knows the
answer, its exchanges wait in a queue, in call order.

**The agreement.** A rank's slot carries its signature; a rank is done only
once it read every rank's row and found each signature equal to its own
(else ``CollectiveMismatchError``, which breaks the group). A rank that
called something else at the same place in the group's order may be on
sockets instead (another algorithm): every rank on the board posts the
receive of ``r - 1``'s opening message (``OPEN``) for as long as it waits
there, and such a message fails the call (the agreement's rule 1: ranks that
disagree meet on some neighbour pair).

**Slots.** A row is found by its key (group and sequence number), so ranks
may start operations in different orders (a call staged from a device starts
late). A slot is written again once every reader acknowledged the row in it
(or its operation failed: a failed operation's row is never needed, and a
reader re-checks the key after copying). A row longer than a slot goes in two
steps: its signature through the board, then its bytes over sockets.

**Failure.** A rank that dies or breaks the group fails the posted opening
receive, which fails the operation; a member's abort fails it the same way
(``ProcessGroup.abort_remote``); a timed-out operation is dropped at the next
look. A failed operation takes its row off the board (its slot's key is
cleared), so a rank that makes the call late cannot complete it with the rows
of ranks that failed it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from struct import Struct
from typing import TYPE_CHECKING, Any, Final, Protocol

import msgpack

from aiodist import _settings
from aiodist._errors import ProtocolError
from aiodist._group.lingering import linger
from aiodist._ops import agreement
from aiodist._ops.agreement import OPEN
from aiodist._transport import shmrows
from aiodist._transport.shmrows import ACKS, ASLEEP, ROW_MAX, SIG_MAX, SLOT_HEAD, SLOTS, TAGS
from aiodist._wire.keys import MatchKind

if TYPE_CHECKING:
    from collections.abc import Callable

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._ops.agreement import Signature
    from aiodist._plane.peers import DataPlane
    from aiodist._plane.receives import Posted, Received

logger = logging.getLogger(__name__)

#: The steps of a row too long for a slot, sent over sockets once its signature agreed.
BIG_STEP: Final = 5 << 20
#: How long a rank sleeps between looks when no bell comes (a slot it waits for is freed
#: without one): the bells wake it otherwise.
SLEEP: Final = 5e-3

#: Groups of more ranks than this per CPU of the host keep to sockets: the ranks that
#: poll crowd out the ones still to write, where a socket's sleeper costs nothing (16
#: ranks on 2 cores: a 4-byte all_reduce took 5.4-10.5 ms on the board, 4.0 ms over
#: sockets; 8 ranks: 0.46-0.67 ms against 0.83; ``bench_collectives --small``).
RANKS_PER_CPU: Final = 4

_TAGS: Final = Struct(f"={SLOTS}q")
_KEY: Final = Struct("=q")
_SIG_AT: Final = SLOT_HEAD.size
_ROW_AT: Final = _SIG_AT + SIG_MAX
_OFF: Final = "off"  # a group whose exchanges keep to sockets
_BELL: Final = (MatchKind.BELL, 0, 0, 0)
_fence_lock = threading.Lock()


class Exchange(Protocol):
    """What the board needs of an ``exchange.Exchange``."""

    g: ProcessGroup
    work: Work[Any]
    seq: int
    mine: Signature

    def fail(self, exc: BaseException) -> None: ...


class Sockets(Protocol):
    """``exchange_rows`` over the data plane (what a group off the board runs)."""

    def __call__(
        self,
        ex: Any,
        data: memoryview,
        done: Callable[[memoryview], None],
        *,
        step: int = ...,
        later: int | None = ...,
        fold: Callable[[memoryview], memoryview] | None = ...,
    ) -> None: ...


def take(
    ex: Exchange,
    data: memoryview,
    done: Callable[[memoryview], None],
    fold: Callable[[memoryview], memoryview] | None,
    later: int | None,
    sockets: Sockets,
) -> bool:
    """``exchange_rows(ex, data, done, fold=fold)`` on the group's board; False: it has none."""
    g = ex.g
    board = g.rows
    if board is _OFF or ex.work.is_completed():
        return False
    if board is None:
        board = g.rows = _open(g, sockets)
        if board is _OFF:
            return False
    assert isinstance(board, Board)
    board.take(ex, data, done, fold, later)
    return True


def _open(g: ProcessGroup, sockets: Sockets) -> Board | str:
    plane = g.session.plane
    if (
        plane.rows is None
        or g.world_size < 2
        or g.world_size > RANKS_PER_CPU * (os.cpu_count() or 1)
        or max(g.ranks) >= shmrows.MAX_RANKS
        or not plane.all_local(g.ranks)
    ):
        return _OFF  # every rank sees one of these alike (the member table)
    board = Board(g, sockets)
    g.spawn(linger(board.resolve()))  # not cancelled by its loop's end: calls wait on it
    return board


class _Side:
    """This rank's side of every board: its slots, and the looks for rows still to come.

    While a row it waits for is missing, a rank looks again on every turn of its
    loop for ``AIODIST_SPIN_US`` (giving the CPU away between looks: the rank
    that has yet to write may be waiting for it), then sleeps: it says so in
    its segment (``asleep``), looks once more, and waits for a bell, which
    every rank that writes a row rings to the members it finds asleep. A store
    fence on both sides (a lock's round trip) means that either the writer
    sees the sleeper's flag or the sleeper's last look sees the row.
    """

    def __init__(self, plane: DataPlane, loop: asyncio.AbstractEventLoop) -> None:
        assert plane.rows is not None
        self.mem = memoryview(plane.rows.memory)
        self.loop = loop
        self.owner: list[_Op | None] = [None] * SLOTS  # what each slot holds
        self.next = 0  # where looking for a free slot starts
        self.ops: list[_Op] = []  # written or waiting for a slot, in the order taken
        self.ticking = False  # a look is due (soon, or when the sleep ends)
        self.spin = _settings.SPIN_US.read() / 1e6
        self.deadline = 0.0
        self.sleep: asyncio.TimerHandle | None = None
        self.bells = 0  # rung to peers (``ring``)
        plane.on_bell = self.wake

    def add(self, op: _Op) -> None:
        self.ops.append(op)
        op.step(self)
        if op.state == 0:
            os.sched_yield()  # written: a rank still to write may be waiting for this CPU
            op.step(self)
        if op.state == 0:
            self.wake()

    def wake(self) -> None:
        """Look now, and poll again for a while (a bell rang, or an op was added)."""
        self.deadline = time.monotonic() + self.spin
        if self.sleep is not None:
            self.sleep.cancel()
            self.sleep = None
            self._awake()
            self.ticking = False
        if not self.ticking and self.ops:
            self.ticking = True
            self.loop.call_soon(self.tick)

    def tick(self) -> None:
        self.sleep = None
        self._look()
        if not self.ops:
            self.ticking = False
            self._awake()
            return
        if time.monotonic() < self.deadline:
            os.sched_yield()  # a rank still to write may be waiting for this CPU
            self.loop.call_soon(self.tick)
            return
        if not _KEY.unpack_from(self.mem, ASLEEP)[0]:
            _KEY.pack_into(self.mem, ASLEEP, 1)
            _fence()
            self._look()  # once more, now that writers see the flag
            if not self.ops:
                self.ticking = False
                self._awake()
                return
        self.sleep = self.loop.call_later(SLEEP, self.tick)

    def _look(self) -> None:
        ops = self.ops
        for op in ops if len(ops) == 1 else list(ops):
            op.step(self)

    def _awake(self) -> None:
        if _KEY.unpack_from(self.mem, ASLEEP)[0]:
            _KEY.pack_into(self.mem, ASLEEP, 0)

    def ring(self, plane: DataPlane, rank: int) -> None:
        """Wake ``rank``, which is asleep waiting for rows (a header-only message)."""
        self.bells += 1
        try:
            rest = plane.send_now(rank, _BELL, None, None)
        except Exception:  # the peer is gone: its own failure is reported elsewhere
            return
        if rest is not None:
            plane.spawn(rest)

    def free_slot(self) -> int:
        """A slot no reader needs any more, or -1."""
        for k in range(SLOTS):
            i = (self.next + k) % SLOTS
            held = self.owner[i]
            if held is None or held.acknowledged(self, i):
                self.owner[i] = None
                self.next = (i + 1) % SLOTS
                return i
        return -1


_sides: weakref.WeakKeyDictionary[DataPlane, _Side] = weakref.WeakKeyDictionary()


def _side(plane: DataPlane) -> _Side:
    side = _sides.get(plane)
    if side is None:
        side = _sides[plane] = _Side(plane, asyncio.get_running_loop())
    return side


class Board:
    """One group's board: its members' rows segments, and what waits until it is decided."""

    def __init__(self, g: ProcessGroup, sockets: Sockets) -> None:
        self.g = g
        self.sockets = sockets
        self.ready = False
        self.mems: list[memoryview] = []  # group rank -> its rows segment
        # (exchange, row, done, fold, later) of each exchange taken before the board was decided
        self.queue: list[tuple[Exchange, bytes, Callable[[memoryview], None], Any, int | None]] = []

    async def resolve(self) -> None:
        """Decide, as every rank does, whether the group takes the board; run what waited."""
        g, plane = self.g, self.g.session.plane
        try:
            table = await plane.addresses()
            names = [shmrows.name_in(table.get(r, ())) for r in g.ranks]
            on = await plane.shares_memory(g.group_id, g.ranks) and all(names)
            if on:
                me = g.session.rank
                # A peer's rows are read only once it proved the job's token, as its
                # messages would be: a channel to each, proved (or refused) as sockets do.
                await asyncio.gather(*(_prove(plane, r) for r in g.ranks if r != me))
                for r, name in zip(g.ranks, names, strict=True):
                    assert name is not None
                    self.mems.append(await _mapped(plane, r, name) if r != me else _own(plane))
        except BaseException as exc:  # the session broke, a peer was refused or is gone
            g.rows = _OFF
            queue, self.queue = self.queue, []
            for ex, *_ in queue:
                ex.fail(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.ready = on
        g.rows = self if on else _OFF
        queue, self.queue = self.queue, []
        for ex, row, done, fold, later in queue:
            if on:
                self._start(ex, row, done, fold, later)
            else:
                self.sockets(ex, memoryview(row), done, later=later, fold=fold)

    def take(
        self,
        ex: Exchange,
        data: memoryview,
        done: Callable[[memoryview], None],
        fold: Callable[[memoryview], memoryview] | None,
        later: int | None,
    ) -> None:
        if self.ready:
            self._start(ex, bytes(data), done, fold, later)
        else:
            self.queue.append((ex, bytes(data), done, fold, later))

    def _start(
        self,
        ex: Exchange,
        row: bytes,
        done: Callable[[memoryview], None],
        fold: Callable[[memoryview], memoryview] | None,
        later: int | None,
    ) -> None:
        key = shmrows.key(ex.g.group_id, ex.seq)
        sig = msgpack.packb(ex.mine)
        if not key or len(sig) > SIG_MAX:  # the same on every rank that agrees
            self.sockets(ex, memoryview(row), done, later=later, fold=fold)
            return
        _side(self.g.session.plane).add(_Op(self, ex, key, sig, row, done, fold))


class _Op:
    """One exchange on a board: its row, written once a slot is free, and its readers' rows."""

    __slots__ = (
        "board",
        "done",
        "ex",
        "fold",
        "found",
        "key",
        "posted",
        "row",
        "sig",
        "slot",
        "state",
    )

    def __init__(
        self,
        board: Board,
        ex: Exchange,
        key: int,
        sig: bytes,
        row: bytes,
        done: Callable[[memoryview], None],
        fold: Callable[[memoryview], memoryview] | None,
    ) -> None:
        self.board, self.ex, self.key, self.sig, self.row = board, ex, key, sig, row
        self.done, self.fold = done, fold
        self.slot = -1
        self.found: list[int] = []  # the slot of each rank's row, as far as seen
        self.state = 0  # 0 running, 1 done (its slot waits for acknowledgements), 2 failed
        g = ex.g
        # A neighbour that took sockets for this call: its opening fails the call here.
        prev = g.ranks[(g.rank - 1) % g.world_size]
        plane = g.session.plane
        self.posted: Posted | None = plane.post(
            prev, (MatchKind.COLLECTIVE, g.group_id, ex.seq, OPEN), None, self._socket_peer
        )

    def _socket_peer(self, msg: Received | BaseException) -> None:
        self.posted = None
        if self.state:
            return
        try:
            if isinstance(msg, BaseException):
                # The group broke, or r - 1 left or failed. Rows that are all in were
                # written before (a rank that finished this call and left wrote its row
                # first); and a call whose r - 1 wrote its row does not wait on it any
                # more (it took the board: nothing comes over sockets either).
                g = self.ex.g
                self.step(_side(g.session.plane))
                if self.state:
                    return
                broken = g.error is not None or g.closed or g.session.error is not None
                prev = self.board.mems[(g.rank - 1) % g.world_size]
                if not broken and self.key in _TAGS.unpack_from(prev, TAGS):
                    return
                raise msg
            if msg.meta != self.ex.mine:
                agreement.check(self.ex.g, self.ex.mine, msg)
            raise ProtocolError(
                f"rank {msg.src} sent its part of call {self.ex.seq} of group "
                f"{self.ex.g.name!r} over sockets where the group agreed on shared memory"
            )
        except Exception as exc:
            self.state = 2
            self.ex.fail(exc)

    def acknowledged(self, side: _Side, i: int) -> bool:
        """Whether every other member took this op's row from slot ``i`` (or never will)."""
        if self.state != 1:
            return self.state == 2 or self.ex.work.is_completed()
        g = self.ex.g
        if g.error is not None or g.closed:
            return True  # a reader still at it finds the row changed (``_read``) and fails
        me, plane = g.session.rank, g.session.plane
        at = ACKS + (me * SLOTS + i) * 8
        gone = plane.gone
        for r, mem in zip(g.ranks, self.board.mems, strict=True):
            if r != me and r not in gone and _KEY.unpack_from(mem, at)[0] != self.key:
                return False
        return True

    def step(self, side: _Side) -> None:
        """Write the row once a slot is free; finish once every rank's row is in."""
        ex = self.ex
        if ex.work.is_completed() or self.state:
            self._end(side, failed=True)
            return
        g = ex.g
        if self.slot < 0:
            i = side.free_slot()
            if i < 0:
                return
            self.slot = i
            side.owner[i] = self
            at = shmrows.slot_at(i)
            mem = side.mem
            sig, row = self.sig, self.row
            n = len(row)
            SLOT_HEAD.pack_into(mem, at, len(sig), n)
            mem[at + _SIG_AT : at + _SIG_AT + len(sig)] = sig
            if n <= ROW_MAX:
                mem[at + _ROW_AT : at + _ROW_AT + n] = row
            _KEY.pack_into(mem, TAGS + i * 8, self.key)  # last: the slot is whole now
            _fence()
            me, mems = g.rank, self.board.mems
            for r, peer in enumerate(mems):
                if r != me and _KEY.unpack_from(peer, ASLEEP)[0]:
                    side.ring(g.session.plane, g.ranks[r])
        key, me, mems, found = self.key, g.rank, self.board.mems, self.found
        for r in range(len(found), len(mems)):  # from the first row not seen at the last look
            if r == me:
                found.append(self.slot)
                continue
            tags = _TAGS.unpack_from(mems[r], TAGS)
            if key not in tags:
                return
            found.append(tags.index(key))
        try:
            rows = self._read(found)
        except Exception as exc:
            self.state = 2
            ex.fail(exc)
            self._end(side, failed=True)
            return
        if rows is None:  # a row was written again while read: its call failed, the group breaks
            found.clear()
            return
        self.state = 1
        self._end(side, failed=False)
        n = len(self.row)
        try:
            if n > ROW_MAX:  # the signatures agreed: the bytes go over sockets
                self.board.sockets(
                    ex, memoryview(self.row), self.done, step=BIG_STEP, fold=self.fold
                )
            else:
                fold = self.fold
                self.done(rows if fold is None else fold(rows))
        except Exception as exc:
            ex.fail(exc)

    def _read(self, found: list[int]) -> memoryview | None:
        """Every rank's row, checked, in one staging buffer; None if one changed meanwhile."""
        g, sig, row = self.ex.g, self.sig, self.row
        n = len(row)
        big = n > ROW_MAX
        me, mems = g.rank, self.board.mems
        staging = memoryview(bytearray(0 if big else len(mems) * n))
        for r, (mem, i) in enumerate(zip(mems, found, strict=True)):
            if r == me:
                if not big:
                    staging[r * n : (r + 1) * n] = row
                continue
            at = shmrows.slot_at(i)
            sig_len, nbytes = SLOT_HEAD.unpack_from(mem, at)
            if sig_len > SIG_MAX or mem[at + _SIG_AT : at + _SIG_AT + sig_len] != sig:
                raise self._mismatch(r, mem, at, sig_len)
            if nbytes != n:
                raise ProtocolError(f"rank {g.ranks[r]} wrote a row of {nbytes} bytes, not {n}")
            if not big:
                staging[r * n : (r + 1) * n] = mem[at + _ROW_AT : at + _ROW_AT + n]
        key, mine = self.key, self.board.mems[me]
        for r, (mem, i) in enumerate(zip(mems, found, strict=True)):
            if r != me and _KEY.unpack_from(mem, TAGS + i * 8)[0] != key:
                return None
        for r, i in enumerate(found):  # every row was whole: they may be written again
            if r != me:
                _KEY.pack_into(mine, ACKS + (g.ranks[r] * SLOTS + i) * 8, key)
        return staging

    def _mismatch(self, r: int, mem: memoryview, at: int, sig_len: int) -> Exception:
        g = self.ex.g
        if sig_len > SIG_MAX:
            return ProtocolError(f"rank {g.ranks[r]} wrote a signature of {sig_len} bytes")
        try:
            theirs = msgpack.unpackb(bytes(mem[at + _SIG_AT : at + _SIG_AT + sig_len]))
        except Exception as exc:
            return ProtocolError(f"rank {g.ranks[r]} wrote an unreadable signature: {exc}")
        return agreement.mismatch(g, self.ex.mine, theirs, g.ranks[r])

    def _end(self, side: _Side, *, failed: bool) -> None:
        if failed:
            self.state = 2
            i = self.slot
            if i >= 0 and side.owner[i] is self:
                # Its row goes off the board: a rank that makes the call late (it heard
                # nothing of the failure yet) must not find every row and complete it
                # where this rank failed it (timed out); it waits for the group's error.
                _KEY.pack_into(side.mem, TAGS + i * 8, 0)
        posted = self.posted
        if posted is not None:
            self.posted = None
            g = self.ex.g
            g.session.plane.withdraw(g.ranks[(g.rank - 1) % g.world_size], posted)
        if self in side.ops:
            side.ops.remove(self)


def _fence() -> None:
    """A full memory fence: the stores before it are seen before the loads after it."""
    with _fence_lock:  # a locked instruction each way
        pass


async def _prove(plane: DataPlane, rank: int) -> None:
    """Connect to ``rank`` (the token handshake), unless connected; fail as a send would."""
    if rank not in plane.routes:
        try:
            await plane.connect(rank)
        except OSError as exc:
            raise await plane.unreachable(rank, exc) from None


def _own(plane: DataPlane) -> memoryview:
    assert plane.rows is not None
    return memoryview(plane.rows.memory)


async def _mapped(plane: DataPlane, rank: int, name: str) -> memoryview:
    # Kept among the plane's peer segments, under a key no group has (ids are >= 0).
    return memoryview((await plane.peer_segment(-1, rank, name, shmrows.NBYTES)).memory)
