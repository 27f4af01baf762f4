"""Shared-memory segments for ranks on one host: ``/dev/shm`` files, mapped once, reused.

Collectives between ranks of one host can read each other's data in place
instead of copying it through a socket twice (in and out of the kernel). Each
rank owns at most one segment per process group, grown when an operation
needs more, and used by one operation at a time: each operation takes a
``Turn`` when it is called, so turns go in call order, which is the same on
every rank (an order in which tasks happen to run need not be). Peers map a
segment by the name the owner sends them over the data plane, and keep the
mapping for later operations. The owner unlinks the file as soon as every peer
has mapped it (within the operation that made it); the memory is freed once
the last mapping closes.

Hygiene: files are created ``0600`` (other users cannot open them, whatever
the umask) and named ``aiodist-<uid>-<pid namespace>-<pid>-<random>``, so a
file left by a rank that crashed inside an operation can be told from a live
one: ``remove_stale`` unlinks those whose creating process is gone (or a
zombie). Survivors call it when a rank fails and when they close, and every
new data plane calls it (skipped when ``/dev/shm`` has not changed since the
process last looked): nothing accumulates in ``/dev/shm``.

Messages still go over the data channels: this module only holds memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import mmap
import os
import platform
import secrets
import stat
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from aiodist import _settings

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SHM_DIR: Final = "/dev/shm"
#: Segments grow in steps of this many bytes, so slightly larger tensors reuse them.
ROUND_BYTES: Final = 1 << 20
_MAX_NAME_CHARS: Final = 255  # a file name's limit


def available() -> bool:
    """Linux with a writable ``/dev/shm``, unless ``AIODIST_SHM=0``."""
    return _settings.SHM.read() and _dev_shm_writable()


@functools.cache
def _dev_shm_writable() -> bool:
    # Asked by every rank as it joins: the answer does not change within a process.
    return (
        sys.platform.startswith("linux") and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)
    )


#: Whether other processes see this machine's stores in the order they were made (x86's
#: total store order): then a count or tag stored after the bytes it covers is all the
#: ordering a reader of shared memory needs. Elsewhere readers check what they read.
STORES_IN_ORDER: Final = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}


def capability() -> str:
    """What a rank that will use shared memory publishes among its addresses: ``shm:<uid>``.

    Ranks use shared memory only with peers that published the same string:
    the same user (segments are private to their owner), and ``AIODIST_SHM``
    not set to 0 there.
    """
    return f"shm:{os.getuid()}"


@functools.cache
def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_prefix(pid: int | None = None) -> str:
    """The name every segment made by process ``pid`` (default: this one) starts with."""
    return f"aiodist-{os.getuid()}-{_pid_namespace()}-{os.getpid() if pid is None else pid}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (dead, not yet reaped by its parent) maps nothing any more
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


# /dev/shm's modification time when this process last listed it (see remove_stale).
_swept_mtime_ns: int | None = None


def remove_stale(*, if_changed: bool = False) -> list[str]:
    """Unlink this user's segments (in this pid namespace) whose creator is dead; return them.

    Another user's files, and files of processes in another pid namespace
    (whose liveness cannot be told from here), are never touched.

    With ``if_changed`` (a new data plane starting), nothing is listed when no
    file came or went in ``/dev/shm`` since this process last looked: one
    ``stat`` instead of a listing, so a process that starts many members pays
    the sweep once. A file whose creator died since is swept at the next change,
    or when a rank fails or a plane closes after a failure (those always list).
    """
    global _swept_mtime_ns
    head = f"aiodist-{os.getuid()}-{_pid_namespace()}-"
    removed = []
    try:
        mtime_ns = os.stat(SHM_DIR).st_mtime_ns  # before listing: a change after it shows next time
        if if_changed and mtime_ns == _swept_mtime_ns:
            return []
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    _swept_mtime_ns = mtime_ns
    for name in names:
        if not name.startswith(head):
            continue
        pid = name[len(head) :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    if removed:
        logger.info("removed %d shared segments left by dead processes", len(removed))
    return removed


@dataclass(eq=False)
class Segment:
    """One mapped segment: ``name`` (the file under ``/dev/shm``) and ``nbytes``."""

    name: str
    nbytes: int
    memory: mmap.mmap
    linked: bool = False

    def tensor(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-d tensor of ``numel`` elements of ``dtype`` over the segment's first bytes."""
        import torch

        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        assert nbytes <= self.nbytes
        return torch.frombuffer(self.memory, dtype=torch.uint8, count=nbytes).view(dtype)

    def unlink(self) -> None:
        """Remove the file (peers that mapped it keep their mapping)."""
        if self.linked:
            self.linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))

    def close(self) -> None:
        self.unlink()
        try:
            self.memory.close()
        except BufferError:  # a tensor still views it: the mapping goes with that tensor
            logger.debug("shared segment %s still in use; left to the garbage collector", self.name)


def create_segment(nbytes: int) -> Segment:
    """Create and map a new ``0600`` segment of ``nbytes`` (linked: ``unlink`` it once mapped).

    Raises:
        OSError: ``/dev/shm`` is missing, or too small (``ENOSPC``: the pages are
            reserved up front, so a full ``/dev/shm`` fails here, not later with
            a ``SIGBUS`` on first touch).
    """
    name = segment_prefix() + secrets.token_hex(8)
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask did
        os.posix_fallocate(fd, 0, nbytes)
        memory = mmap.mmap(fd, nbytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return Segment(name, nbytes, memory, linked=True)


def map_segment(name: str, nbytes: int) -> Segment:
    """Map a peer's segment ``name`` of ``nbytes`` (checked to be one of ours first).

    Only a regular file of this user, named as this user's segments are, is
    mapped: never a link, nor another user's file (a stranger's memory).
    """
    if (
        type(name) is not str
        or not name.startswith(f"aiodist-{os.getuid()}-")
        or len(name) > _MAX_NAME_CHARS
        or "/" in name
        or "\0" in name
    ):
        raise ValueError(f"invalid shared segment name {name!r:.80}")
    if type(nbytes) is not int or nbytes <= 0:
        raise ValueError(f"invalid shared segment size {nbytes!r:.40}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise ValueError(f"shared segment {name!r} is not a file of this user")
        if st.st_size < nbytes:
            raise ValueError(f"shared segment {name!r} is smaller than the {nbytes} bytes sent")
        memory = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return Segment(name, nbytes, memory)


class Turn:
    """An operation's turn on its group's segments: ``async with turn:`` waits for the last."""

    __slots__ = ("_before", "_done")

    def __init__(self, before: asyncio.Future[None] | None, done: asyncio.Future[None]) -> None:
        self._before = before
        self._done = done

    async def __aenter__(self) -> None:
        if self._before is not None and not self._before.done():
            await asyncio.shield(self._before)

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """End this turn (again is fine): for an operation that ends without entering it."""
        if not self._done.done():
            self._done.set_result(None)


class SharedSegments:
    """This rank's own segments (one per group) and its mappings of its peers' segments."""

    def __init__(self) -> None:
        self._own: dict[int, Segment] = {}
        self._peers: dict[tuple[int, int], Segment] = {}
        self._turns: dict[int, asyncio.Future[None]] = {}
        self.shared_bytes = 0  # asked of ``own`` in all: what this rank placed for its peers

    def take_turn(self, group_id: int) -> Turn:
        """The next turn on ``group_id``'s segments; take it when the operation is called."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        before = self._turns.get(group_id)
        self._turns[group_id] = done
        return Turn(before, done)

    def own(self, group_id: int, nbytes: int) -> Segment:
        """This rank's segment for ``group_id``, of at least ``nbytes`` (new if too small)."""
        self.shared_bytes += nbytes
        seg = self._own.get(group_id)
        if seg is not None and seg.nbytes >= nbytes:
            return seg
        if seg is not None:
            seg.close()
            del self._own[group_id]
        size = max(ROUND_BYTES, -(-nbytes // ROUND_BYTES) * ROUND_BYTES)
        seg = self._own[group_id] = create_segment(size)
        return seg

    def unlink_own(self, group_id: int) -> None:
        """Remove the file of ``group_id``'s own segment once every peer has mapped it."""
        seg = self._own.get(group_id)
        if seg is not None:
            seg.unlink()

    def peer(self, group_id: int, rank: int, name: str, nbytes: int) -> Segment:
        """Rank ``rank``'s segment ``name`` for ``group_id``, mapped on first use and kept."""
        key = (group_id, rank)
        seg = self._peers.get(key)
        if seg is not None and seg.name == name:
            return seg
        if seg is not None:
            seg.close()
            del self._peers[key]
        try:
            seg = map_segment(name, nbytes)
        except ValueError as exc:
            raise ValueError(f"rank {rank} sent a bad shared segment: {exc}") from None
        self._peers[key] = seg
        return seg

    def close(self, *, sweep: bool = False) -> None:
        """Unmap everything and remove own files that peers never mapped.

        With ``sweep`` (a peer failed), also remove dead processes' segments.
        """
        for seg in [*self._peers.values(), *self._own.values()]:
            seg.close()
        self._peers.clear()
        self._own.clear()
        if sweep and available():
            remove_stale()
