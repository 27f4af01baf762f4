"""The daemon's state directory: an append-only log of its jobs, and snapshots of it.

A server started with a state directory (``aiodist serve --state-dir DIR``)
writes each change that a restart must not lose as one record: a job formed
(its members, their ranks and re-attach secrets), a newcomer admitted to an
elastic job, a key set or deleted, a barrier passed, a regroup decided, a
member failed or left, a job ended. Records are framed as

    +----------------+----------------+---------------------------+
    | length  (u32)  | crc32   (u32)  | body: one msgpack array   |
    +----------------+----------------+---------------------------+

little-endian, after an 8-byte magic at the start of each file. ``log`` holds
the records since ``snapshot``; a snapshot is the live jobs written out as the
same records, to ``snapshot.tmp``, fsync'd, then renamed over ``snapshot``
(atomic), after which the log starts again empty.

**fsync policy.** Records are written (and, with ``fsync=True``, the
default, fsync'd once) before the replies of the batch that made them leave
the server: a client never hears of a change the log could lose. One fsync
covers every record of a batch (a group commit). With ``fsync=False`` the
log survives the daemon's crash (the kernel holds the pages) but not the
host's.

**Replay** reads the snapshot, then the log, and stops at the first record
that is truncated, fails its checksum or does not decode to a well-formed
record: what follows a torn write (a crash mid-append) is dropped, with a
warning naming the offset. Every value read is checked as a client's would be
(``_wire/bounds.py``): a state directory is input, not trusted memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
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

MAGIC: Final = b"AIODST01"
_HEAD: Final = struct.Struct("<II")  # body length, crc32 of the body
MAX_RECORD_BYTES: Final = 1 << 30
MAX_KEY_CHARS: Final = 1 << 20
MAX_SETTLED_REGROUPS: Final = 256  # decided regroups a job keeps (``elastic.MAX_SETTLED``)
# The log is folded into a snapshot after this many records or bytes.
COMPACT_RECORDS: Final = 200_000
COMPACT_BYTES: Final = 256 << 20


class StateDirError(Exception):
    """The state directory cannot be used (locked by another server, not writable)."""


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


def read_records(data: bytes, what: str) -> tuple[list[Any], int]:
    """The whole records at the start of ``data`` (after the magic), and where they end.

    A truncated record, a bad checksum or undecodable msgpack ends the read
    there, with a warning: the tail of a log torn by a crash.
    """
    if not data:
        return [], 0
    if not data.startswith(MAGIC):
        logger.warning("%s does not start with aiodist's magic: ignoring it", what)
        return [], 0
    out: list[Any] = []
    pos = len(MAGIC)
    while pos < len(data):
        problem = ""
        if len(data) - pos < _HEAD.size:
            problem = "a truncated record header"
        else:
            length, crc = _HEAD.unpack_from(data, pos)
            start = pos + _HEAD.size
            body = data[start : start + length]
            if length > MAX_RECORD_BYTES:
                problem = f"a record of {length} bytes (at most {MAX_RECORD_BYTES})"
            elif len(body) < length:
                problem = f"a truncated record ({len(body)} of {length} bytes)"
            elif zlib.crc32(body) != crc:
                problem = "a record failing its checksum"
            else:
                try:
                    out.append(msgpack.unpackb(body, raw=False, strict_map_key=True))
                except Exception as exc:  # msgpack raises several unrelated types
                    problem = f"a record that is not msgpack ({exc})"
        if problem:
            logger.warning(
                "%s: %s at byte %d of %d; replay stops at the last whole record before it "
                "(a crash during a write leaves such a tail)",
                what,
                problem,
                pos,
                len(data),
            )
            return out, pos
        pos = start + length
    return out, pos


class StateDir:
    """The log and snapshots of one server, in one directory it holds locked."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock = open(self.path / "lock", "a+b")  # held while serving
        except OSError as exc:
            raise StateDirError(f"cannot use the state directory {self.path}: {exc}") from exc
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise StateDirError(
                f"the state directory {self.path} is in use by another aiodist server; "
                "give each server its own --state-dir"
            ) from None
        self._log: Any = None
        self._pending: list[bytes] = []
        self.records_in_log = 0
        self.bytes_in_log = 0
        self.writes = 0  # batches written (each one fsync when fsync is on)

    def load(self) -> dict[str, JobRecord]:
        """Replay the snapshot and the log; then start a new log from a fresh snapshot."""
        jobs: dict[str, JobRecord] = {}
        for name in ("snapshot", "log"):
            file = self.path / name
            try:
                data = file.read_bytes()
            except FileNotFoundError:
                continue
            records, _ = read_records(data, str(file))
            for i, rec in enumerate(records):
                try:
                    apply_record(jobs, rec)
                except ValueError as exc:
                    logger.warning(
                        "%s: record %d is malformed (%s); replay stops before it", file, i, exc
                    )
                    break
        self.compact(jobs.values())
        return jobs

    def append(self, rec: list[Any]) -> None:
        """Queue one record; ``commit`` writes it."""
        self._pending.append(frame(rec))

    def commit(self) -> None:
        """Write the queued records, and fsync them once (with ``fsync`` on)."""
        if not self._pending:
            return
        data = b"".join(self._pending)
        self.records_in_log += len(self._pending)
        self._pending.clear()
        self._log.write(data)
        self._log.flush()
        if self.fsync:
            os.fsync(self._log.fileno())
        self.bytes_in_log += len(data)
        self.writes += 1

    def wants_compaction(self) -> bool:
        return self.records_in_log >= COMPACT_RECORDS or self.bytes_in_log >= COMPACT_BYTES

    def compact(self, jobs: Iterable[JobRecord]) -> None:
        """Write ``jobs`` as the new snapshot, atomically, and start an empty log."""
        self.commit()
        tmp = self.path / "snapshot.tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            for job in jobs:
                f.writelines(frame(rec) for rec in job.records())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / "snapshot")
        if self._log is not None:
            self._log.close()
        self._log = open(self.path / "log", "wb")  # held while serving
        self._log.write(MAGIC)
        self._log.flush()
        self._fsync_dir()
        self.records_in_log = self.bytes_in_log = 0

    def _fsync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.commit()
        if self._log is not None:
            self._log.close()
            self._log = None
        self._lock.close()
