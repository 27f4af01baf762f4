"""Shared-memory segments for ranks on one host: ``/dev/shm`` files, mapped once, reused.

Collectives between ranks of one host can read each other's data in place
instead of copying it through a socket twice (in and out of the kernel). Each
rank owns at most one segment, grown when an operation needs more; peers map
it by the name the owner sends them over the data plane, and keep the mapping
for later operations. The owner unlinks the file as soon as every peer has
mapped it, so a crash leaves nothing behind in ``/dev/shm``; the memory is
freed once the last mapping closes.

Messages still go over the data channels: this module only holds memory.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import torch

__all__ = ["Segment", "SharedSegments", "available"]

logger = logging.getLogger(__name__)

SHM_DIR: Final = "/dev/shm"
#: Segments grow in steps of this many bytes, so slightly larger tensors reuse them.
ROUND_BYTES: Final = 1 << 20


def available() -> bool:
    """Linux with a writable ``/dev/shm``, unless ``AIODIST_SHM=0``."""
    return (
        sys.platform.startswith("linux")
        and os.environ.get("AIODIST_SHM", "1") != "0"
        and os.path.isdir(SHM_DIR)
        and os.access(SHM_DIR, os.W_OK)
    )


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

    def close(self) -> None:
        if self.linked:
            self.linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))
        try:
            self.memory.close()
        except BufferError:  # a tensor still views it: the mapping goes with that tensor
            logger.debug("shared segment %s still in use; left to the garbage collector", self.name)


class SharedSegments:
    """This rank's own segment and its mappings of its peers' segments."""

    def __init__(self) -> None:
        self._own: Segment | None = None
        self._peers: dict[int, Segment] = {}

    def own(self, nbytes: int) -> Segment:
        """This rank's segment, of at least ``nbytes`` (a new one if the old is too small)."""
        if self._own is not None and self._own.nbytes >= nbytes:
            return self._own
        if self._own is not None:
            self._own.close()
            self._own = None
        size = max(ROUND_BYTES, -(-nbytes // ROUND_BYTES) * ROUND_BYTES)
        name = f"aiodist-{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._own = Segment(name, size, memory, linked=True)
        return self._own

    def unlink_own(self) -> None:
        """Remove the own segment's file once every peer has mapped it."""
        own = self._own
        if own is not None and own.linked:
            own.linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, own.name))

    def peer(self, rank: int, name: str, nbytes: int) -> Segment:
        """Rank ``rank``'s segment ``name``, mapped on first use and kept."""
        seg = self._peers.get(rank)
        if seg is not None and seg.name == name:
            return seg
        if seg is not None:
            seg.close()
            del self._peers[rank]
        if "/" in name or not name.startswith("aiodist-"):
            raise ValueError(f"rank {rank} sent an invalid shared segment name {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            memory = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        seg = Segment(name, nbytes, memory)
        self._peers[rank] = seg
        return seg

    def close(self) -> None:
        """Unmap everything and remove the own file if peers never mapped it."""
        for seg in self._peers.values():
            seg.close()
        self._peers.clear()
        if self._own is not None:
            self._own.close()
            self._own = None
