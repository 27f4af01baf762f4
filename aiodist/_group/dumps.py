"""Writing a rank's flight recorder to a file: on failure, on SIGUSR1, on the server's request.

A dump is ``dump(recorder)`` as JSON (the format is documented in
``docs/guide/observability.md``), one file per rank named
``aiodist-dump-<job>-rank<R>.json``, written atomically (a temporary file,
then a rename) so that a reader never sees half of one. A dump is written:

- when a session or one of its groups breaks (a failed rank, a timeout, a
  mismatch), once per session, into ``AIODIST_DUMP_DIR`` if that is set;
- on ``SIGUSR1``, for every session of the process, into ``AIODIST_DUMP_DIR``
  or else the temporary directory (the handler is installed by the first
  session made on the main thread, unless the program has one of its own);
- when ``aiodist status --job J --dump DIR`` asks (``DumpNotice``): into DIR,
  if DIR is an existing directory on the rank's host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiodist._group.recorder import FORMAT

if TYPE_CHECKING:
    from aiodist._group.recorder import Entry, Recorder

__all__ = ["describe", "dump", "dump_path", "on_failure", "register", "write_dump"]

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakKeyDictionary[Recorder, asyncio.AbstractEventLoop] = weakref.WeakKeyDictionary()
_installed: list[bool] = []


def dump(recorder: Recorder, reason: str = "") -> dict[str, Any]:
    """The recorder as plain data: the dump format (``docs/guide/observability.md``)."""
    now = time.perf_counter_ns()
    return {
        "format": FORMAT,
        "job": recorder.job,
        "rank": recorder.rank,
        "pid": recorder.pid,
        "host": socket.gethostname(),
        "reason": reason,
        "time": recorder.wall(now),
        "capacity": recorder.capacity,
        "recorded": recorder.recorded,
        "operations": [describe(recorder, e, now) for e in recorder.entries()],
    }


def describe(recorder: Recorder, e: Entry, now: int) -> dict[str, Any]:
    """One entry as plain data (times in seconds since the epoch)."""
    wall = recorder.wall
    return {
        "id": e.id,
        "name": e.name,
        "group": e.group,
        "seq": e.seq,
        "peer": e.peer,
        "bytes": e.nbytes,
        "dtype": str(e.dtype).removeprefix("torch.") if e.dtype is not None else None,
        "shape": list(e.shape) if e.shape is not None else None,
        "enqueued": wall(e.enqueued),
        "started": wall(e.started),
        "ended": wall(e.ended) if e.ended else None,
        "seconds": ((e.ended or now) - e.enqueued) / 1e9,
        "state": e.state,
        "error": f"{type(e.error).__name__}: {e.error}" if e.error is not None else None,
    }


def dump_path(directory: str | Path, job: str, rank: int | None = None) -> Path:
    """Where rank ``rank`` of ``job`` writes its dump in ``directory`` (None: the whole job's)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:128] or "job"
    tail = "" if rank is None else f"-rank{rank}"
    return Path(directory) / f"aiodist-dump-{safe}{tail}.json"


def write_dump(recorder: Recorder, directory: str | Path, reason: str) -> Path | None:
    """Write ``recorder`` into ``directory``; the file, or None (logged) if it could not."""
    path = dump_path(directory, recorder.job, recorder.rank)
    if not Path(directory).is_dir():
        logger.warning("not writing the flight recorder: %s is no directory", directory)
        return None
    text = json.dumps(dump(recorder, reason), default=str)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".aiodist-dump-", dir=directory)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # a rename: a link planted at ``path`` is replaced, not followed
    except OSError as exc:
        logger.warning("could not write the flight recorder to %s: %s", path, exc)
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)
        return None
    logger.warning("flight recorder of rank %d written to %s (%s)", recorder.rank, path, reason)
    return path


def on_failure(recorder: Recorder | None, reason: str) -> None:
    """A session broke: dump its recorder into ``AIODIST_DUMP_DIR``, if that is set."""
    directory = os.environ.get("AIODIST_DUMP_DIR")
    if recorder is not None and directory:
        try:  # a loop turn later: the operations that the failure ends have ended by then
            asyncio.get_running_loop().call_soon(write_dump, recorder, directory, reason)
        except RuntimeError:  # no loop runs here
            write_dump(recorder, directory, reason)


def register(recorder: Recorder | None) -> None:
    """Dump ``recorder`` on SIGUSR1 (on its loop); install the handler if this is the first."""
    if recorder is None:
        return
    _LIVE[recorder] = asyncio.get_running_loop()
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed.append(True)
    if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:  # the program's own one stays
        signal.signal(signal.SIGUSR1, _on_signal)


def _on_signal(signum: int, frame: Any) -> None:
    directory = os.environ.get("AIODIST_DUMP_DIR") or tempfile.gettempdir()
    for recorder, loop in list(_LIVE.items()):
        with contextlib.suppress(RuntimeError):  # its loop closed
            loop.call_soon_threadsafe(write_dump, recorder, directory, "SIGUSR1")
