"""The daemon's state directory: an append-only log of its jobs, and snapshots of it.

A server started with a state directory (``aiodist serve --state-dir DIR``)
writes each change that a restart must not lose as one record
(``records.py``: a job formed, a member added with its rank and re-attach
secret, a key set or deleted, a barrier passed, a regroup decided, a member
failed or left, a job ended). The job table's parts emit them; ``serve.py``
hands each batch of them to ``write``. Each file starts with a header, then
holds records:

    header: | magic (8) | number (u64) | length (u64) | crc32 of the 24 bytes before (u32) |
    record: | body length (u32) | crc32 of the body (u32) | body: msgpack [kind, *fields] |

little-endian. ``snapshot`` is the live jobs written out as records; its
``number`` counts the snapshots written, its ``length`` is its own. ``log``
holds the records since the snapshot whose number it names; its ``length`` is
where the records acknowledged so far end. A snapshot is written to
``snapshot.tmp``, an empty log after it to ``log.tmp``, both fsync'd, then
renamed over ``snapshot`` and ``log`` (atomic), after which the log grows.

**Acknowledged.** The records of a batch of messages are written (and, with
``fsync=True``, the default, fsync'd), then the log's header is moved past
them (and fsync'd again) before any reply of that batch leaves the server:
a client never hears of a change the log could lose, and the header always
says how far the log holds changes that were told. One pair of fsyncs covers
every record of a batch (a group commit). With ``fsync=False`` the log
survives the daemon's crash (the kernel holds the pages, in the order they
were written) but not the host's.

**Replay** reads the snapshot, then the log up to its acknowledged length,
and hands each record to the job table (``load``).
Bytes after that length are a write that a crash cut short (no reply had told
of them): they are dropped, with a warning. Anything else is damage, and the
server refuses to start, naming the file, the byte and what is wrong, without
writing anything: a record before the acknowledged end that is cut short,
fails its checksum or is malformed; a file shorter than its header says; a
header that fails its checksum; the snapshot a log follows missing, or
another one in its place; the log missing; what the records make does not
hold together (a record for a job never formed, a rank it does not have). A
record's fields are checked as a client's message is (its declaration's types
and bounds): a state directory is input, not trusted memory.

**The directory** holds nothing but the server's files: it is made private
(0700, its files 0600) and must belong to the server's user; no symbolic link
is followed, and a name that is not a regular file (a FIFO, a directory) is
refused by name. The server holds a lock on the directory itself (``flock``)
for as long as it runs: a second server on it is refused.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

import msgpack

from aiodist._errors import ProtocolError
from aiodist._server.records import decode_record, encode_record

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

logger = logging.getLogger("aiodist._server.serve")

MAGIC: Final = b"AIODST03"
_EARLIER_MAGICS: Final = (b"AIODST01", b"AIODST02")
_FILE_HEAD: Final = struct.Struct("<8sQQI")  # magic, number, length, crc32 of the rest
_HEAD: Final = struct.Struct("<II")  # body length, crc32 of the body
MAX_RECORD_BYTES: Final = (1 << 30) + (2 << 20)  # the largest value, its key and the rest
# The log is folded into a snapshot after this many records or bytes.
COMPACT_RECORDS: Final = 200_000
COMPACT_BYTES: Final = 256 << 20
_OPEN_FLAGS: Final = os.O_NOFOLLOW | os.O_CLOEXEC
_fdatasync = getattr(os, "fdatasync", os.fsync)


class StateDirError(Exception):
    """The state directory cannot be used (damaged, locked by another server, not private)."""


def frame(row: list[Any]) -> bytes:
    """One record of a state file: its head, then ``row`` (``records.encode_record``)."""
    body = msgpack.packb(row, use_bin_type=True)
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def file_header(number: int, length: int) -> bytes:
    """The header of a state file: ``number`` and ``length`` (see the module)."""
    head = MAGIC + struct.pack("<QQ", number, length)
    return head + struct.pack("<I", zlib.crc32(head))


class _Damage(Exception):
    """What is wrong with one file of the state directory."""


@dataclass(slots=True)
class _File:
    path: Path
    number: int
    length: int  # a snapshot's own length; how far a log's acknowledged records go
    data: bytes

    @classmethod
    def parse(cls, path: Path, data: bytes) -> _File:
        if len(data) < _FILE_HEAD.size:
            size = _FILE_HEAD.size
            raise _Damage(f"it holds {len(data)} bytes, less than its {size}-byte header")
        magic, number, length, crc = _FILE_HEAD.unpack_from(data)
        if magic in _EARLIER_MAGICS:
            raise _Damage(
                "it was written by an earlier version of aiodist, whose state this one cannot "
                "read (not damaged)"
            )
        if magic != MAGIC:
            raise _Damage("it does not start with aiodist's magic: it is no state file of aiodist")
        if zlib.crc32(data[: _FILE_HEAD.size - 4]) != crc:
            raise _Damage("its header fails its checksum")
        if length < _FILE_HEAD.size:
            raise _Damage(f"its header names a length of {length} bytes, less than the header")
        return cls(path, number, length, data)

    def records(self) -> list[tuple[int, Any]]:
        """The records up to ``length``, each with the byte it starts at.

        Raises:
            _Damage: The file is shorter than ``length``, or a record before it
                is cut short, fails its checksum or is no msgpack.
        """
        data, end = self.data, self.length
        if len(data) < end:
            raise _Damage(
                f"it is cut short: it ends at byte {len(data)}, but it held {end} bytes"
                + (" of acknowledged records" if self.path.name == "log" else "")
            )
        out: list[tuple[int, Any]] = []
        pos = _FILE_HEAD.size
        while pos < end:
            problem = ""
            if end - pos < _HEAD.size:
                problem = "is cut short (a part of its header)"
            else:
                length, crc = _HEAD.unpack_from(data, pos)
                start = pos + _HEAD.size
                if length > MAX_RECORD_BYTES:
                    problem = f"claims {length} bytes (at most {MAX_RECORD_BYTES})"
                elif start + length > end:
                    problem = f"runs past byte {end}, where the records end"
                elif zlib.crc32(data[start : start + length]) != crc:
                    problem = "fails its checksum"
                else:
                    try:
                        out.append((pos, msgpack.unpackb(data[start : start + length])))
                    except Exception as exc:  # msgpack raises several unrelated types
                        problem = f"is no msgpack ({exc})"
            if problem:
                raise _Damage(
                    f"record {len(out)} at byte {pos} {problem}; the {len(out)} records before "
                    f"it are whole, the {end - pos} bytes from it on cannot be read"
                )
            pos = start + length
        return out


class StateDir:
    """The log and snapshots of one server, in one private directory it holds locked."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            # The directory itself is no link either: name the directory it points to.
            self._dir = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and self.path.is_symlink():
                raise StateDirError(
                    f"the state directory {self.path} is a symbolic link: none is followed; "
                    f"give the directory it points to ({os.path.realpath(self.path)})"
                ) from None
            raise StateDirError(f"cannot use the state directory {self.path}: {exc}") from exc
        try:
            self._private(self._dir, self.path, directory=True)
            try:
                fcntl.flock(self._dir, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise StateDirError(
                        f"cannot lock the state directory {self.path}: {exc}; use a local "
                        "file system"
                    ) from exc
                raise StateDirError(
                    f"the state directory {self.path} is in use by another aiodist server; "
                    "give each server its own --state-dir"
                ) from None
        except BaseException:
            os.close(self._dir)
            raise
        self._log = -1  # the log's descriptor, once loaded
        self._end = 0  # where the log's acknowledged records end
        self.number = 0  # the snapshot's number
        self.replayed = 0  # records read at start-up
        self._pending: list[bytes] = []
        self.records_in_log = 0
        self.bytes_in_log = 0
        self.writes = 0  # batches written (each one pair of fsyncs when fsync is on)

    # --- reading --------------------------------------------------------------------------

    def load(self, apply: Callable[[Any], None], restored: Callable[[], Iterable[Any]]) -> None:
        """Replay the snapshot and the log; then start a new log from a fresh snapshot.

        Args:
            apply: Called with each record, in order (``records.py``); raises
                ``ValueError`` where a record does not fit those before it.
            restored: Called once every record is applied; returns the records of
                the fresh snapshot, or raises ``ValueError`` where what the records
                made does not hold together.

        Raises:
            StateDirError: The directory is damaged (nothing was written, and the
                directory is let go), or cannot be written.
        """
        try:
            self._replay(apply)
            try:
                snapshot = list(restored())
            except ValueError as exc:
                raise self._damaged(self.path, str(exc)) from None
            self.compact(snapshot)
        except StateDirError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise StateDirError(f"cannot write the state directory {self.path}: {exc}") from exc

    def _replay(self, apply: Callable[[Any], None]) -> None:
        snapshot, log = self._read("snapshot"), self._read("log")
        if snapshot is None and log is None:
            return  # a new directory
        if snapshot is None:
            assert log is not None
            raise self._damaged(
                self.path / "snapshot",
                f"it is missing: the log follows snapshot {log.number}, which held every job "
                "the log does not",
            )
        self.number = snapshot.number
        files = [snapshot]
        if log is None:
            after = self._read("log.tmp")  # a crash between the two renames of a fold
            if after is None or after.number != snapshot.number:
                raise self._damaged(
                    self.path / "log",
                    f"it is missing: the changes acknowledged since snapshot {snapshot.number} "
                    "were in it",
                )
        elif log.number == snapshot.number:
            files.append(log)
        elif log.number + 1 != snapshot.number:  # one behind: folded already, a fold cut short
            raise self._damaged(
                log.path,
                f"it follows snapshot {log.number}, but {snapshot.path} is snapshot "
                f"{snapshot.number}: one of them was replaced by another copy",
            )
        for file in files:
            if file is snapshot and len(file.data) != file.length:
                problem = (
                    f"it is {len(file.data)} bytes long, but {file.length} bytes were written to it"
                )
                raise self._damaged(file.path, problem)
            try:
                records = file.records()
            except _Damage as exc:
                raise self._damaged(file.path, str(exc)) from None
            for i, (pos, row) in enumerate(records):
                try:
                    apply(decode_record(row))
                except (ValueError, ProtocolError) as exc:
                    raise self._damaged(
                        file.path, f"record {i} at byte {pos} is malformed ({exc})"
                    ) from None
            self.replayed += len(records)
            if file is log and len(file.data) > file.length:
                logger.warning(
                    "%s: dropped the %d bytes after byte %d, where its acknowledged records "
                    "end: a crash cut that write short, before any reply told of it",
                    file.path,
                    len(file.data) - file.length,
                    file.length,
                )

    def _read(self, name: str) -> _File | None:
        """The state file ``name``, parsed; None if there is none.

        Raises:
            StateDirError: It is damaged, a link, no regular file, or not the server's.
        """
        path = self.path / name
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _OPEN_FLAGS, dir_fd=self._dir)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._refused(path, exc) from None
        try:
            self._private(fd, path)
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
        finally:
            os.close(fd)
        try:
            return _File.parse(path, data)
        except _Damage as exc:
            raise self._damaged(path, str(exc)) from None

    def _private(self, fd: int, path: Path, *, directory: bool = False) -> None:
        """Refuse ``fd`` (``path``) unless it is the server's and of its kind; make it private
        (0700 for the directory, 0600 for a file)."""
        st = os.fstat(fd)
        mode = 0o700 if directory else 0o600
        if not directory and not stat.S_ISREG(st.st_mode):
            raise StateDirError(
                f"{path} is not a regular file ({_kind(st.st_mode)}): the state directory holds "
                "only the server's files; remove it"
            )
        if st.st_uid != os.geteuid():
            raise StateDirError(
                f"{path} belongs to user id {st.st_uid}, not to this server's ({os.geteuid()}): "
                "another user could read or change the jobs' state; give the server a "
                "directory of its own"
            )
        if stat.S_IMODE(st.st_mode) & ~mode:
            try:
                os.fchmod(fd, mode)
            except OSError as exc:
                raise StateDirError(
                    f"{path} is mode {stat.S_IMODE(st.st_mode):o} and cannot be made {mode:o}: "
                    f"{exc}"
                ) from exc
            logger.warning(
                "%s was mode %o: made it %o (it holds the members' secrets and their stores)",
                path,
                stat.S_IMODE(st.st_mode),
                mode,
            )

    def _refused(self, path: Path, exc: OSError) -> StateDirError:
        if exc.errno == errno.ELOOP:
            return StateDirError(
                f"{path} is a symbolic link: none is followed in a state directory; remove it"
            )
        if exc.errno == errno.ENXIO:  # a socket, or a FIFO without a reader
            return StateDirError(
                f"{path} is not a regular file: the state directory holds only the server's "
                "files; remove it"
            )
        return StateDirError(f"cannot use {path}: {exc}")

    def _damaged(self, path: Path, problem: str) -> StateDirError:
        return StateDirError(
            f"the state directory {self.path} is damaged: {path}: {problem}. The server did not "
            "start, and wrote nothing there: the jobs it holds (their members, stores and "
            "barriers) are neither taken back nor lost while it is damaged. Put back a good "
            f"copy, or move the directory aside (mv {self.path} {self.path}.damaged) to start "
            "without them"
        )

    # --- writing --------------------------------------------------------------------------

    def write(self, records: Iterable[Any]) -> None:
        """Write ``records`` (``records.py``) and ``commit`` them: durable when this returns."""
        self._pending.extend(frame(encode_record(rec)) for rec in records)
        self.commit()

    def commit(self) -> None:
        """Write the queued records, then move the log's header past them (see the module)."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        self.records_in_log += len(self._pending)
        self._pending.clear()
        _write_at(self._log, data, self._end)
        end = self._end + len(data)
        if self.fsync:
            _fdatasync(self._log)
        _write_at(self._log, file_header(self.number, end), 0)
        if self.fsync:
            _fdatasync(self._log)
        self._end = end
        self.bytes_in_log += len(data)
        self.writes += 1

    def wants_compaction(self) -> bool:
        return self.records_in_log >= COMPACT_RECORDS or self.bytes_in_log >= COMPACT_BYTES

    def compact(self, records: Iterable[Any]) -> None:
        """Write ``records`` (every live job's) as the next snapshot and an empty log after
        it, atomically."""
        self.commit()
        number = self.number + 1
        snapshot = self._create("snapshot.tmp")
        try:
            with open(snapshot, "wb", closefd=False) as f:
                f.write(file_header(number, 0))
                f.writelines(frame(encode_record(rec)) for rec in records)
                length = f.tell()
            _write_at(snapshot, file_header(number, length), 0)
            os.fsync(snapshot)
        finally:
            os.close(snapshot)
        log = self._create("log.tmp")
        try:
            _write_at(log, file_header(number, _FILE_HEAD.size), 0)
            os.fsync(log)
            self._rename("snapshot.tmp", "snapshot")
            self._rename("log.tmp", "log")
            os.fsync(self._dir)
        except BaseException:
            os.close(log)
            raise
        if self._log >= 0:
            os.close(self._log)
        self._log, self._end, self.number = log, _FILE_HEAD.size, number
        self.records_in_log = self.bytes_in_log = 0

    def _create(self, name: str) -> int:
        """A new, empty, private file ``name``: one left over is removed, never followed."""
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self._dir)  # a link is removed, not what it points to
            return os.open(
                name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600, dir_fd=self._dir
            )
        except OSError as exc:
            raise self._refused(self.path / name, exc) from None

    def _rename(self, old: str, new: str) -> None:
        try:
            os.replace(old, new, src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except OSError as exc:
            raise StateDirError(f"cannot replace {self.path / new}: {exc}") from exc

    def close(self) -> None:
        if self._dir < 0:
            return
        with contextlib.suppress(OSError):
            if self._log >= 0:
                self.commit()
        if self._log >= 0:
            os.close(self._log)
            self._log = -1
        os.close(self._dir)  # lets go of the lock
        self._dir = -1


def _write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a file"


class _Table(Protocol):
    """What a ``Journal`` reads of the job table (``state.JobTable``)."""

    def replay(self, rec: Any, now: float) -> None: ...
    def restored(self, now: float) -> list[Any]: ...
    def records(self) -> list[Any]: ...


class Journal:
    """A state directory wired to a job table: its jobs taken back, its records kept.

    Made once the table is: it replays the directory into the table (``load``).
    Then call it with each batch of the table's records (``take_records``)
    before any reply of that batch leaves: they are durable when it returns, and
    the log is folded into a snapshot of the table's jobs when it has grown.
    """

    def __init__(self, state_dir: StateDir, table: _Table, now: float) -> None:
        self.state_dir = state_dir
        self._table = table
        state_dir.load(lambda rec: table.replay(rec, now), lambda: table.restored(now))

    def __call__(self, records: list[Any]) -> None:
        state_dir = self.state_dir
        state_dir.write(records)
        if state_dir.wants_compaction():
            state_dir.compact(self._table.records())
