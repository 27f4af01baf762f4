"""The daemon's state directory: an append-only log of its jobs, and snapshots of it.

A server started with a state directory (``aiodist serve --state-dir DIR``)
writes each change that a restart must not lose as one record: a job formed
(its members, their ranks and re-attach secrets), a newcomer admitted to an
elastic job, a key set or deleted, a barrier passed, a regroup decided, a
member failed or left, a job ended. Each file starts with a header, then holds
records:

    header: | magic (8) | number (u64) | length (u64) | crc32 of the 24 bytes before (u32) |
    record: | body length (u32) | crc32 of the body (u32) | body: one msgpack array |

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

**Replay** reads the snapshot, then the log up to its acknowledged length.
Bytes after that length are a write that a crash cut short (no reply had told
of them): they are dropped, with a warning. Anything else is damage, and the
server refuses to start, naming the file, the byte and what is wrong, without
writing anything: a record before the acknowledged end that is cut short,
fails its checksum or is malformed; a file shorter than its header says; a
header that fails its checksum; the snapshot a log follows missing, or
another one in its place; the log missing. A record is checked as a client's
message is (``_wire/bounds.py``): a state directory is input, not trusted
memory.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgpack

from aiodist._errors import ErrorCode
from aiodist._wire.bounds import (
    MAX_ADDRESS_CHARS,
    MAX_ADDRESSES,
    MAX_GROUP_NAME_CHARS,
    MAX_HOST_CHARS,
    MAX_SECRET_BYTES,
    MAX_WORLD_SIZE,
    MIN_HEARTBEAT_TIMEOUT,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["JobRecord", "MemberRecord", "StateDir", "StateDirError"]

logger = logging.getLogger("aiodist._server.serve")

MAGIC: Final = b"AIODST02"
_EARLIER_MAGIC: Final = b"AIODST01"
_FILE_HEAD: Final = struct.Struct("<8sQQI")  # magic, number, length, crc32 of the rest
_HEAD: Final = struct.Struct("<II")  # body length, crc32 of the body
MAX_RECORD_BYTES: Final = 1 << 30
MAX_KEY_CHARS: Final = 1 << 20
MAX_SETTLED_REGROUPS: Final = 256  # decided regroups a job keeps (``elastic.MAX_SETTLED``)
# The log is folded into a snapshot after this many records or bytes.
COMPACT_RECORDS: Final = 200_000
COMPACT_BYTES: Final = 256 << 20
_OPEN_FLAGS: Final = os.O_NOFOLLOW | os.O_CLOEXEC
_fdatasync = getattr(os, "fdatasync", os.fsync)


class StateDirError(Exception):
    """The state directory cannot be used (damaged, locked by another server, not private)."""


@dataclass(slots=True)
class MemberRecord:
    rank: int
    local_rank: int
    host: str
    pid: int
    addresses: list[str]
    heartbeat_timeout: float
    secret: bytes

    def row(self) -> list[Any]:
        return [
            self.rank,
            self.local_rank,
            self.host,
            self.pid,
            self.addresses,
            self.heartbeat_timeout,
            self.secret,
        ]


@dataclass(slots=True)
class JobRecord:
    """What the log knows of one formed job.

    ``world_size`` is its rank space: the members it formed with
    (``min_world_size``) and the newcomers admitted since (an elastic job,
    ``max_world_size`` above 0).
    """

    name: str
    generation: int
    world_size: int
    members: list[MemberRecord]
    min_world_size: int = 0  # 0: world_size (a job that never grew)
    max_world_size: int = 0
    kv: dict[str, bytes] = field(default_factory=dict)
    barriers_done: int = 0
    failures: list[tuple[int, str, int, str]] = field(default_factory=list)
    left: dict[int, tuple[str, int]] = field(default_factory=dict)
    # Regroup key -> the answer every caller got: ``[ranks]`` or ``[code, message, details]``.
    regroups: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.min_world_size:
            self.min_world_size = self.world_size

    def records(self) -> list[list[Any]]:
        """This job as the records that rebuild it (a snapshot's part)."""
        out: list[list[Any]] = [
            [
                "job",
                self.name,
                self.generation,
                self.world_size,
                self.min_world_size,
                self.max_world_size,
                [m.row() for m in self.members],
            ]
        ]
        out.extend(["kv", self.name, k, v] for k, v in self.kv.items())
        if self.barriers_done:
            out.append(["barrier", self.name, self.barriers_done])
        out.extend(["failed", self.name, *f] for f in self.failures)
        out.extend(["left", self.name, r, h, p] for r, (h, p) in self.left.items())
        out.extend(["regroup", self.name, k, a] for k, a in self.regroups.items())
        return out


class _Bad(ValueError):
    pass


def _int(v: Any, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _Bad(f"an integer in [{lo}, {hi}] expected, got {v!r:.40}")
    return v


def _str(v: Any, most: int) -> str:
    if type(v) is not str or len(v) > most:
        raise _Bad(f"a string of at most {most} characters expected")
    return v


def _bytes(v: Any, most: int) -> bytes:
    if type(v) is not bytes or len(v) > most:
        raise _Bad(f"bytes of at most {most} expected")
    return v


def _member(v: Any, world_size: int) -> MemberRecord:
    if type(v) is not list or len(v) != 7:
        raise _Bad("a member is an array of 7")
    rank, local_rank, host, pid, addresses, hb, secret = v
    if type(addresses) is not list or len(addresses) > MAX_ADDRESSES:
        raise _Bad("addresses must be a short array")
    if type(hb) not in (int, float) or not MIN_HEARTBEAT_TIMEOUT <= hb <= 365 * 86400.0:
        raise _Bad("heartbeat timeout out of range")
    return MemberRecord(
        _int(rank, 0, world_size - 1),
        _int(local_rank, 0, world_size - 1),
        _str(host, MAX_HOST_CHARS),
        _int(pid, 0, 2**64 - 1),
        [_str(a, MAX_ADDRESS_CHARS) for a in addresses],
        float(hb),
        _bytes(secret, MAX_SECRET_BYTES),
    )


def _regroup_answer(v: Any, world_size: int) -> list[Any]:
    if type(v) is list and len(v) == 1 and type(v[0]) is list:
        return [[_int(r, 0, world_size - 1) for r in v[0]]]
    if type(v) is list and len(v) == 3 and type(v[2]) is dict:
        code = _int(v[0], 0, 2**31)
        if code not in ErrorCode._value2member_map_:
            raise _Bad(f"an error code expected, got {code}")
        return [ErrorCode(code), _str(v[1], 1 << 16), v[2]]
    raise _Bad("a regroup's answer is [ranks] or [code, message, details]")


def apply_record(jobs: dict[str, JobRecord], rec: Any) -> None:
    """Apply one decoded record to ``jobs``.

    Raises:
        ValueError: The record is malformed (a wrong type, a value out of range,
            a job it names unknown).
    """
    if type(rec) is not list or not rec or type(rec[0]) is not str:
        raise _Bad("a record is an array starting with its kind")
    kind, args = rec[0], rec[1:]
    if kind == "job":
        if len(args) != 6 or type(args[5]) is not list:
            raise _Bad(
                "a job record is [name, generation, world_size, min_world_size, "
                "max_world_size, members]"
            )
        name = _str(args[0], MAX_GROUP_NAME_CHARS)
        world_size = _int(args[2], 1, MAX_WORLD_SIZE)
        least = _int(args[3], 1, world_size)
        most = _int(args[4], 0, MAX_WORLD_SIZE)
        if most and most < least:
            raise _Bad(f"job {name!r} may grow to {most} members, fewer than it formed with")
        if len(args[5]) != world_size:
            raise _Bad(f"job {name!r} has {len(args[5])} members, world size {world_size}")
        members = [_member(m, world_size) for m in args[5]]
        if sorted(m.rank for m in members) != list(range(world_size)):
            raise _Bad(f"job {name!r}: the ranks are not 0..{world_size - 1}")
        generation = _int(args[1], 0, 2**63 - 1)
        jobs[name] = JobRecord(name, generation, world_size, members, least, most)
        return
    if not args:
        raise _Bad(f"a {kind} record names its job")
    job = jobs.get(_str(args[0], MAX_GROUP_NAME_CHARS))
    if job is None:
        raise _Bad(f"a {kind} record for a job with no job record: {args[0]!r:.60}")
    if kind == "kv" and len(args) == 3:
        key = _str(args[1], MAX_KEY_CHARS)
        if args[2] is None:
            job.kv.pop(key, None)
        else:
            job.kv[key] = _bytes(args[2], MAX_RECORD_BYTES)
    elif kind == "joined" and len(args) == 2:
        if not job.max_world_size:
            raise _Bad(f"a newcomer joined job {job.name!r}, which is not elastic")
        member = _member(args[1], job.world_size + 1)
        if member.rank != job.world_size:
            raise _Bad(f"a newcomer of job {job.name!r} must have rank {job.world_size}")
        job.members.append(member)
        job.world_size += 1
    elif kind == "barrier" and len(args) == 2:
        job.barriers_done = max(job.barriers_done, _int(args[1], 0, 2**64 - 1))
    elif kind == "failed" and len(args) == 5:
        job.failures.append(
            (
                _int(args[1], 0, job.world_size - 1),
                _str(args[2], MAX_HOST_CHARS),
                _int(args[3], 0, 2**64 - 1),
                _str(args[4], 1 << 16),
            )
        )
    elif kind == "left" and len(args) == 4:
        job.left[_int(args[1], 0, job.world_size - 1)] = (
            _str(args[2], MAX_HOST_CHARS),
            _int(args[3], 0, 2**64 - 1),
        )
    elif kind == "regroup" and len(args) == 3:
        key = _str(args[1], MAX_GROUP_NAME_CHARS)
        job.regroups.pop(key, None)
        job.regroups[key] = _regroup_answer(args[2], job.world_size)
        while len(job.regroups) > MAX_SETTLED_REGROUPS:
            del job.regroups[next(iter(job.regroups))]
    elif kind == "end" and len(args) == 2:
        if job.generation == _int(args[1], 0, 2**63 - 1):
            del jobs[job.name]
    else:
        raise _Bad(f"unknown record {kind!r:.40} with {len(args)} fields")


def frame(rec: list[Any]) -> bytes:
    body = msgpack.packb(rec, use_bin_type=True)
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
        if magic == _EARLIER_MAGIC:
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

    def load(self) -> dict[str, JobRecord]:
        """Replay the snapshot and the log; then start a new log from a fresh snapshot.

        Raises:
            StateDirError: The directory is damaged (nothing was written, and the
                directory is let go), or cannot be written.
        """
        try:
            jobs = self._replay()
            self.compact(jobs.values())
        except StateDirError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            raise StateDirError(f"cannot write the state directory {self.path}: {exc}") from exc
        return jobs

    def _replay(self) -> dict[str, JobRecord]:
        snapshot, log = self._read("snapshot"), self._read("log")
        if snapshot is None and log is None:
            return {}  # a new directory
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
        jobs: dict[str, JobRecord] = {}
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
            for i, (pos, rec) in enumerate(records):
                try:
                    apply_record(jobs, rec)
                except ValueError as exc:
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
        return jobs

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

    def append(self, rec: list[Any]) -> None:
        """Queue one record; ``commit`` writes it."""
        self._pending.append(frame(rec))

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

    def compact(self, jobs: Iterable[JobRecord]) -> None:
        """Write ``jobs`` as the next snapshot and an empty log after it, atomically."""
        self.commit()
        number = self.number + 1
        snapshot = self._create("snapshot.tmp")
        try:
            with open(snapshot, "wb", closefd=False) as f:
                f.write(file_header(number, 0))
                for job in jobs:
                    f.writelines(frame(rec) for rec in job.records())
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
