"""Writing a rank's flight recorder to a file: on failure, on SIGUSR1, on the server's request.

A dump is ``dump(recorder)`` as JSON (the format is documented in
``docs/guide/observability.md``), one file per rank named
``aiodist-dump-<job>-rank<R>.json``, written atomically (a new file of its
own, then a rename over the name: a reader never sees half of one, and a link
planted at the name is replaced, never followed). A dump is written:

- when a session or one of its groups breaks (a failed rank, a timeout, a
  mismatch), once per session, into ``AIODIST_DUMP_DIR`` if that is set;
- on ``SIGUSR1``, for every session of the process, into its dump directory
  (the handler is installed by the first session made on the main thread,
  unless the program has one of its own);
- when ``aiodist status --job J --dump`` asks (``DumpNotice``): into its dump
  directory, never one that a request names.

The dump directory (``dump_dir``) is ``AIODIST_DUMP_DIR``, else a directory of
this user's own (mode 0700) in the temporary directory. Dumps on request or on
``SIGUSR1`` are bounded: at most one per ``MIN_DUMP_INTERVAL`` per recorder
(one asked for sooner is written once the interval has passed, the latest
request's), and one at a time. The loop only copies the recorder's entries
(``snapshot``); making the JSON and writing the file run in a thread, so that
heartbeats and operations go on while a dump is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import socket
import stat
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from aiodist import _settings
from aiodist._group.recorder import FORMAT, nbytes_of, state_of

if TYPE_CHECKING:
    from aiodist._group.recorder import Entry, Recorder

logger = logging.getLogger(__name__)

#: The least time between two dumps of one rank's recorder on request or on SIGUSR1.
MIN_DUMP_INTERVAL: Final = 1.0


class _Row(NamedTuple):
    """An entry's fields, copied on the loop (the entry itself is reused by the ring)."""

    id: int
    name: str
    group: str
    seq: int
    peer: int
    dtype: Any
    shape: Any
    enqueued: int
    started: int
    ended: int
    error: BaseException | None


class Snapshot(NamedTuple):
    """A recorder at one instant: cheap to take on the loop, rendered anywhere."""

    header: dict[str, Any]
    rows: list[_Row]
    now: int  # perf_counter_ns when taken
    perf0: int
    wall0: int

    def wall(self, perf_ns: int) -> float:
        return (self.wall0 + (perf_ns - self.perf0)) / 1e9


def snapshot(recorder: Recorder, reason: str = "", request: int | None = None) -> Snapshot:
    """Copy what a dump of ``recorder`` needs (a few microseconds per entry)."""
    now = time.perf_counter_ns()
    header = {
        "format": FORMAT,
        "job": recorder.job,
        "rank": recorder.rank,
        "pid": recorder.pid,
        "host": socket.gethostname(),
        "reason": reason,
        "request": request,
        "time": recorder.wall(now),
        "capacity": recorder.capacity,
        "recorded": recorder.recorded,
    }
    rows = [_row(e) for e in recorder.entries()]
    return Snapshot(header, rows, now, recorder.perf0, recorder.wall0)


def _row(e: Entry) -> _Row:
    return _Row(
        e.id, e.name, e.group, e.seq, e.peer, e.dtype, e.shape, e.enqueued, e.started, e.ended,
        e.error,
    )  # fmt: skip


def render(snap: Snapshot) -> dict[str, Any]:
    """A snapshot as plain data: the dump format (``docs/guide/observability.md``)."""
    return {**snap.header, "operations": [describe(snap, r) for r in snap.rows]}


def dump(recorder: Recorder, reason: str = "") -> dict[str, Any]:
    """The recorder as plain data: the dump format (``docs/guide/observability.md``)."""
    return render(snapshot(recorder, reason))


def describe(snap: Snapshot, r: _Row) -> dict[str, Any]:
    """One entry as plain data (times in seconds since the epoch)."""
    wall = snap.wall
    return {
        "id": r.id,
        "name": r.name,
        "group": r.group,
        "seq": r.seq,
        "peer": r.peer,
        "bytes": nbytes_of(r.shape, r.dtype),
        "dtype": str(r.dtype).removeprefix("torch.") if r.dtype is not None else None,
        "shape": list(r.shape) if r.shape is not None else None,
        "enqueued": wall(r.enqueued),
        "started": wall(r.started),
        "ended": wall(r.ended) if r.ended else None,
        "seconds": ((r.ended or snap.now) - r.enqueued) / 1e9,
        "state": state_of(r.ended, r.error),
        "error": f"{type(r.error).__name__}: {r.error}" if r.error is not None else None,
    }


def dump_path(
    directory: str | Path, job: str, rank: int | None = None, *, kind: str = "dump"
) -> Path:
    """Where rank ``rank`` of ``job`` writes its dump in ``directory`` (None: the whole job's);
    ``kind="trace"``: its trace (``tracefile.py``)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", job)[:128] or "job"
    tail = "" if rank is None else f"-rank{rank}"
    return Path(directory) / f"aiodist-{kind}-{safe}{tail}.json"


def dump_dir() -> Path | None:
    """This process's dump directory: ``AIODIST_DUMP_DIR``, else a private one (logged if None).

    ``AIODIST_DUMP_DIR`` is made (mode 0700) if it is not there yet.

    The private one is ``<temporary directory>/aiodist-dumps-<uid>``, made with mode
    0700; one that is not a directory of this user's that only this user may use
    (another user made it first, or it is a link) is refused.
    """
    configured = _settings.DUMP_DIR.read()
    if configured:
        try:
            return make_dump_dir(Path(configured))
        except OSError as exc:
            logger.warning("AIODIST_DUMP_DIR=%s: %s; no flight recorder written", configured, exc)
            return None
    path = Path(tempfile.gettempdir()) / f"aiodist-dumps-{os.getuid()}"
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError as exc:
        logger.warning("cannot make the dump directory %s: %s; set AIODIST_DUMP_DIR", path, exc)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        logger.warning(
            "not writing dumps into %s: it is not a directory of this user's that only this "
            "user may use (mode 0700); remove it, or set AIODIST_DUMP_DIR",
            path,
        )
        return None
    return path


def make_dump_dir(path: Path) -> Path:
    """``path``, made (mode 0700, its parents too) if it is not there yet.

    Raises:
        OSError: It cannot be made, or something other than a directory is there.
    """
    os.makedirs(path, 0o700, exist_ok=True)  # FileExistsError: not a directory
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` as the file ``path``: a new file of its own (0600), renamed over it.

    A link or anything else at ``path`` is replaced, never followed or opened.

    Raises:
        OSError: It could not be written (nothing is left behind).
    """
    fd, tmp = tempfile.mkstemp(prefix=".aiodist-", dir=path.parent)  # O_EXCL, mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write(snap: Snapshot, directory: Path | None) -> Path | None:
    """Write ``snap`` into ``directory`` (None: the dump directory); the file, or None (logged)."""
    directory = dump_dir() if directory is None else directory
    if directory is None:
        return None
    rank = snap.header["rank"]
    path = dump_path(directory, snap.header["job"], rank)
    if not directory.is_dir():
        logger.warning("not writing the flight recorder: %s is no directory", directory)
        return None
    try:
        write_atomic(path, json.dumps(render(snap), default=str))
    except OSError as exc:
        logger.warning("could not write the flight recorder to %s: %s", path, exc)
        return None
    logger.warning(
        "flight recorder of rank %d written to %s (%s)", rank, path, snap.header["reason"]
    )
    return path


def write_dump(recorder: Recorder, directory: str | Path, reason: str) -> Path | None:
    """Write ``recorder`` into ``directory`` now; the file, or None (logged) if it could not."""
    return _write(snapshot(recorder, reason), Path(directory))


class _Dumper:
    """One recorder's dumps on request: one at a time, one per ``MIN_DUMP_INTERVAL``."""

    __slots__ = ("last", "loop", "pending", "recorder", "timer", "writing")

    def __init__(self, recorder: Recorder, loop: asyncio.AbstractEventLoop) -> None:
        self.recorder = weakref.ref(recorder)
        self.loop = loop
        self.last = -math.inf  # loop time of the last dump's start
        self.pending: tuple[str, int | None] | None = None  # (reason, request) to write next
        self.timer: asyncio.TimerHandle | None = None
        self.writing: asyncio.Future[Path | None] | None = None

    def ask(self, reason: str, request: int | None) -> None:
        self.pending = (reason, request)  # the latest request wins: it is the one awaited
        if self.writing is not None or self.timer is not None:
            return  # it goes once the dump being written is done, or the interval passed
        wait = self.last + MIN_DUMP_INTERVAL - self.loop.time()
        if wait > 0:
            self.timer = self.loop.call_later(wait, self._start)
        else:
            self._start()

    def _start(self) -> None:
        self.timer = None
        recorder = self.recorder()
        if self.pending is None or recorder is None:
            return
        reason, request = self.pending
        self.pending = None
        self.last = self.loop.time()
        snap = snapshot(recorder, reason, request)
        self.writing = self.loop.run_in_executor(None, _write, snap, None)
        self.writing.add_done_callback(self._done)

    def _done(self, future: asyncio.Future[Path | None]) -> None:
        self.writing = None
        if not future.cancelled() and (exc := future.exception()) is not None:
            logger.warning("could not write the flight recorder: %r", exc)
        if self.pending is not None:
            self.ask(*self.pending)


_LIVE: weakref.WeakKeyDictionary[Recorder, _Dumper] = weakref.WeakKeyDictionary()
_installed: list[bool] = []


def request_dump(recorder: Recorder | None, reason: str, request: int | None = None) -> None:
    """Dump ``recorder`` into the dump directory, in a thread, within the bounds (on its loop).

    ``request`` is the number of the ``DumpNotice`` that asked (put in the file).
    """
    if recorder is None:
        return
    dumper = _LIVE.get(recorder)
    if dumper is None:
        dumper = _LIVE[recorder] = _Dumper(recorder, asyncio.get_running_loop())
    dumper.ask(reason, request)


def on_failure(recorder: Recorder | None, reason: str) -> None:
    """A session broke: dump its recorder into ``AIODIST_DUMP_DIR``, if that is set.

    Once per session, so not bounded: a loop turn later (the operations that the
    failure ends have ended by then), written in a thread.
    """
    directory = _settings.DUMP_DIR.read()
    if recorder is None or not directory:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop runs here
        write_dump(recorder, directory, reason)
        return

    def start() -> None:
        snap = snapshot(recorder, reason)
        done = loop.run_in_executor(None, _write, snap, Path(directory))
        done.add_done_callback(_log_error)

    loop.call_soon(start)


def _log_error(future: asyncio.Future[Path | None]) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        logger.warning("could not write the flight recorder: %r", exc)


def register(recorder: Recorder | None) -> None:
    """Dump ``recorder`` on SIGUSR1 (on its loop); install the handler if this is the first."""
    if recorder is None:
        return
    _LIVE[recorder] = _Dumper(recorder, asyncio.get_running_loop())
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed.append(True)
    if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:  # the program's own one stays
        signal.signal(signal.SIGUSR1, _on_signal)


def _on_signal(signum: int, frame: Any) -> None:
    for dumper in list(_LIVE.values()):
        with contextlib.suppress(RuntimeError):  # its loop closed
            dumper.loop.call_soon_threadsafe(dumper.ask, "SIGUSR1", None)
