"""The aiodist backend's device parts: torch's calls on CUDA tensors on NCCL, elastic.

``cpu:aiodist,cuda:nccl``: CPU tensors ride aiodist's data plane; those of
another device type go to that device's *part*, a torch process group of
torch's own backend for it (NCCL for CUDA) that the aiodist backend builds over
the membership of the aiodist group it follows, from the job's store (one
``init_method``, one port). When that group changes (``shrink_group``,
``regroup``: the default group is another one), the next call builds the part
again for the new membership, under a store prefix of its own; the old one is
shut down. When the group breaks (a rank failed), the part is aborted, so that
a collective stuck in NCCL ends instead of holding its kernels.

Which parts: ``cuda:nccl`` where CUDA and NCCL are there, none elsewhere;
``AIODIST_TORCH_PARTS`` names them (``cpu:gloo``: gloo stands in for NCCL on
CPU, so that the rebuilding runs without a GPU; ``""``: none).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup as TorchProcessGroup

from aiodist import _settings
from aiodist._errors import timeout_in_torch
from aiodist._torch.store import LoopStore
from aiodist._torch.torch_work import AiodistWork

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Mapping

    from aiodist._errors import DistError
    from aiodist._group.group import ProcessGroup

logger = logging.getLogger(__name__)

_TYPES: Final = {
    "gloo": TorchProcessGroup.BackendType.GLOO,
    "nccl": TorchProcessGroup.BackendType.NCCL,
}


def parts_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Device type -> torch backend, from ``AIODIST_TORCH_PARTS`` or what this process has.

    Raises:
        ValueError: A malformed setting, or a backend other than gloo and NCCL.
    """
    env = os.environ if environ is None else environ
    raw = _settings.TORCH_PARTS.raw(env)  # set but empty: no parts
    if raw is None:
        if torch.cuda.is_available() and dist.is_nccl_available():
            return {"cuda": "nccl"}
        return {}
    parts: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in raw.lower().split(","))):
        device, sep, backend = item.partition(":")
        if not sep or backend not in _TYPES or device not in ("cpu", "cuda"):
            raise ValueError(
                f"AIODIST_TORCH_PARTS={raw!r}: expected DEVICE:BACKEND pairs such as "
                "'cuda:nccl' (or 'cpu:gloo', gloo standing in for NCCL on CPU)"
            )
        parts[device] = backend
    return parts


class DevicePart:
    """torch's calls on one device type's tensors, on ``backend``, over a group's members.

    Built on the calling thread (torch's; never the loop's, which serves its store).
    """

    def __init__(self, device: str, backend: str) -> None:
        self.device = device
        self.backend = backend
        self._lock = threading.Lock()
        self._pg: Any = None
        self._built_for: ProcessGroup | None = None
        self._pending: set[AiodistWork] = set()  # calls in flight on the current part
        self._pending_lock = threading.Lock()  # held only to add and take, never to wait
        self._retired: list[Any] = []  # gloo's parts of older groups (``_retire``)
        self._abandoned: list[Any] = []  # torch's works of calls failed by a break
        _parts.add(self)

    def __repr__(self) -> str:
        return f"<DevicePart {self.device}:{self.backend}>"

    def call(
        self, g: ProcessGroup, loop: asyncio.AbstractEventLoop, name: str, *args: Any, **kwargs: Any
    ) -> AiodistWork:
        """torch's ``name(*args)`` on this part for ``g``'s members, as a Work of aiodist's.

        It fails with ``g``'s error, at once if ``g`` is broken already, or as soon as
        it breaks: a call torch would leave waiting for a rank gone (NCCL's until it is
        aborted, gloo's until its timeout) ends with the failure named, as aiodist's own.
        """
        work = AiodistWork(None, f"{name} ({self.device}:{self.backend})")
        if g.error is not None:
            work._fail(g.error)
            return work
        inner = getattr(self.group_for(g, loop), name)(*args, **kwargs)
        work._inner = inner
        with self._pending_lock:
            self._pending.add(work)
        work._settled.add_done_callback(lambda _: self._forget(work))
        work.follow(inner, lambda exc: self._failed(g, loop, work, exc))
        return work

    def _failed(
        self, g: ProcessGroup, loop: asyncio.AbstractEventLoop, work: AiodistWork, exc: Exception
    ) -> BaseException:
        """The error ``work`` fails with: a timeout in torch breaks ``g`` on every rank.

        On torch's thread. torch's call ended on its timeout (a rank never made it,
        or is stuck): the group breaks as when aiodist's own call times out, so every
        member's next call raises the same ``DistTimeoutError``, the rank that never
        made it included, instead of gloo's "Connection closed by peer". Other errors
        stay torch's own (a rank gone is named by the server's word, ``_broke``).
        """
        where = f"{work._description} on group {g.name!r} failed in torch.distributed"
        error = None if g.error is not None else timeout_in_torch(where, exc)
        if error is None:
            return exc
        error.__cause__ = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is left to tell
            loop.call_soon_threadsafe(g.break_, error)
        return error

    def _forget(self, work: AiodistWork) -> None:
        with self._pending_lock:
            self._pending.discard(work)

    def group_for(self, g: ProcessGroup, loop: asyncio.AbstractEventLoop) -> Any:
        """torch's process group for ``g``'s members: this part's, built again if ``g`` changed."""
        with self._lock:
            if self._built_for is g and self._pg is not None:
                return self._pg
            old, self._pg, self._built_for = self._pg, None, None
            if old is not None:
                self._retire(old)
            store = LoopStore(g, loop, f"part/{g.group_id}/{g.name}/{self.device}/")
            pg = self._build(store, g.rank, g.world_size, g.timeout, g.session.heartbeat_timeout)
            self._pg, self._built_for = pg, g
            loop.call_soon_threadsafe(g.on_break, lambda exc: self._broke(g, pg, exc))
            return pg

    def _build(
        self, store: LoopStore, rank: int, size: int, seconds: float, heartbeat: float
    ) -> Any:
        timeout = timedelta(seconds=seconds)
        pg = TorchProcessGroup(store, rank, size)
        device = torch.device(self.device)
        backend: Any
        if self.backend == "gloo":
            # gloo cannot abort a call its group abandoned: it ends on this timeout (or
            # once a peer hangs up), so a stalled call ends about when aiodist names a
            # silent rank, not after the group's timeout (``wait_for_abandoned``).
            timeout = timedelta(seconds=min(seconds, 2 * heartbeat))
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            backend = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            backend = dist.ProcessGroupGloo(store, rank, size, timeout)
        pg._set_default_backend(_TYPES[self.backend])
        pg._register_backend(device, _TYPES[self.backend], backend)
        return pg

    def _broke(self, g: ProcessGroup, pg: Any, exc: DistError) -> None:
        """``g`` broke: abort its part, so that nothing waits in torch for a rank gone.

        On the loop's thread: it takes no lock (``group_for`` may hold it while torch
        builds a part through the store this loop serves). The next call builds
        again, for the group that replaces ``g``.
        """
        with self._pending_lock:
            pending, self._pending = self._pending, set()
            self._abandoned.extend(w._inner for w in pending if w._inner is not None)
        for work in pending:
            work._fail(exc)
        if self.backend == "nccl":
            # NCCL's kernels wait for the rank gone until its communicator is aborted.
            logger.info("aborting %r of group %r: %s", self, g.name, exc)
            backend = pg._get_backend(torch.device(self.device))
            _in_thread(backend.abort, f"aborting {self!r}")

    def _retire(self, pg: Any) -> None:
        """Let go of the part of an older group.

        gloo's is kept, never shut down nor freed: its calls left waiting for a rank
        gone end on gloo's own timeout, and shutting it down (or its destructor)
        joins gloo's threads holding the GIL, which stops every thread of the
        process, aiodist's loop included, until then. NCCL's was aborted when its
        group broke, or is shut down now.
        """
        if self.backend == "nccl":
            _in_thread(pg.shutdown, f"shutting down {self!r} of an older group")
        else:
            self._retired.append(pg)


def _in_thread(fn: Any, what: str) -> None:
    """Run torch's ``fn`` (it may block) in a daemon thread; log what it raises."""

    def run() -> None:
        try:
            fn()
        except Exception:
            logger.debug("%s failed", what, exc_info=True)

    threading.Thread(target=run, name="aiodist-torch-part", daemon=True).start()


_parts: weakref.WeakSet[DevicePart] = weakref.WeakSet()


@atexit.register
def wait_for_abandoned() -> None:
    """At exit, let gloo end the calls that broken groups abandoned (bounded by its timeout).

    Such a call completes once a peer hangs up or its timeout passes, and its
    completion calls into Python: during the interpreter's finalization that kills
    gloo's thread, which aborts the process (SIGABRT). Before it, it is harmless.
    """
    for part in list(_parts):
        abandoned, part._abandoned = part._abandoned, []
        for inner in abandoned:
            with contextlib.suppress(Exception):
                inner.wait()
