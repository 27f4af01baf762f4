"""Message kinds and one frozen dataclass per message (error codes: ``aiodist._errors``).

A message's header travels as a msgpack *array* of its fields in declaration
order (compact, and cheap to decode on the hot path); ``headers.py`` turns a
message into that array and back, checking every field's type. A
``StoreWait`` carries its keys pre-packed: ``pack_keys`` and ``unpack_keys``
below are that field's encoding.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, overload

import msgpack

__all__ = [
    "AuthStart",
    "Authenticated",
    "Barrier",
    "Challenge",
    "Channel",
    "CloseChannel",
    "DumpNotice",
    "DumpRequest",
    "ErrorReply",
    "Heartbeat",
    "Hello",
    "HostIds",
    "Join",
    "Leave",
    "MemberFailed",
    "MembersFailed",
    "MembersLeft",
    "MembersRequest",
    "Message",
    "MessageKind",
    "Packed",
    "Reattach",
    "Regroup",
    "Reply",
    "ServerClosing",
    "StatusRequest",
    "StoreAdd",
    "StoreCheck",
    "StoreCompareSet",
    "StoreDeleteKey",
    "StoreGet",
    "StoreNumKeys",
    "StoreSet",
    "StoreWait",
    "Welcome",
    "pack_host_runs",
    "pack_keys",
    "unpack_keys",
]


class MessageKind(enum.IntEnum):
    # client -> server requests (all carry req_id)
    JOIN = 1
    LEAVE = 2
    HEARTBEAT = 3
    STORE_SET = 4
    STORE_GET = 5
    STORE_ADD = 6
    STORE_WAIT = 7
    STORE_COMPARE_SET = 8
    STORE_DELETE_KEY = 9
    STORE_NUM_KEYS = 10
    STORE_CHECK = 11
    BARRIER = 12
    STATUS = 13
    HELLO = 15  # 14 stays unused: tests use it as an unknown kind
    AUTH_START = 16
    CHANNEL = 17  # both ways: which member's channel the messages after it belong to
    CLOSE_CHANNEL = 18
    MEMBERS = 20
    DUMP = 29  # ask every rank of a job to write its flight recorder (``status --dump``)
    REATTACH = 21
    REGROUP = 22
    # server -> client
    REPLY = 32
    WELCOME = 33
    ERROR = 34
    MEMBER_FAILED = 35
    SERVER_CLOSING = 36
    CHALLENGE = 37
    AUTHENTICATED = 38
    MEMBERS_LEFT = 39
    MEMBERS_FAILED = 41  # failures after the first within a notice interval, together
    DUMP_NOTICE = 47  # to each rank of the job a DUMP names
    MEMBERS_JOINED = 40
    # rank <-> rank (data plane)
    PEER_HELLO = 64
    DATA = 65
    PEER_ERROR = 66
    PEER_BYE = 67
    PEER_AUTH = 68  # [nonce, proof]: the data plane's token handshake (see auth.py)
    # [kind, group, a, b, [rank, reason, what]]: a send that failed before its data left;
    # it takes the place of that message, so the receive it matches fails instead.
    PEER_ABORT = 69


# --- control plane: client -> server ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Join:
    KIND: ClassVar[MessageKind] = MessageKind.JOIN
    req_id: int
    group_name: str
    world_size: int
    rank: int  # -1: let the server assign one
    host: str
    pid: int
    addresses: list[str]
    heartbeat_timeout: float
    timeout: float
    # The how-many-th start of the job (a launcher's restart count): a later
    # generation replaces the job's earlier one, an earlier one is refused.
    generation: int = 0
    # A random secret of this member: proof of membership when it re-attaches to a
    # server that came back (``Reattach``); kept in the server's durable state.
    secret: bytes = b""
    # Above 0: the job is elastic (torchrun's ``--nnodes MIN:MAX``): it forms with
    # ``world_size`` members, and admits later joiners while fewer than this many are alive.
    max_world_size: int = 0


@dataclass(frozen=True, slots=True)
class Leave:
    KIND: ClassVar[MessageKind] = MessageKind.LEAVE
    req_id: int
    # Empty: a clean leave. Otherwise the member failed (its program ended with an
    # uncaught exception, a non-zero exit or Ctrl-C) and this says why: the others
    # hear that it failed, and the job is recorded as failed.
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """I am alive; ``where`` says what each member on the connection is doing.

    ``where`` holds one ``[channel, current, last]`` per member that reports:
    ``current`` its oldest unfinished operation and ``last`` the collective it
    finished last, each ``[group, seq, name, seconds]`` (running for, ended ago)
    or None. The server echoes a heartbeat with an empty ``where``.
    """

    KIND: ClassVar[MessageKind] = MessageKind.HEARTBEAT
    where: list[Any] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StoreSet:
    KIND: ClassVar[MessageKind] = MessageKind.STORE_SET
    req_id: int
    key: str
    value: bytes


@dataclass(frozen=True, slots=True)
class StoreGet:
    KIND: ClassVar[MessageKind] = MessageKind.STORE_GET
    req_id: int
    key: str
    timeout: float


@dataclass(frozen=True, slots=True)
class StoreAdd:
    KIND: ClassVar[MessageKind] = MessageKind.STORE_ADD
    req_id: int
    key: str
    amount: int


@dataclass(frozen=True, slots=True)
class StoreWait:
    KIND: ClassVar[MessageKind] = MessageKind.STORE_WAIT
    req_id: int
    # The keys as one msgpack array of str (``pack_keys``). Every member of a job
    # usually waits on the same N keys: the server recognises those waits by these
    # bytes and decodes the N keys once, not once per member.
    keys: bytes
    timeout: float


@dataclass(frozen=True, slots=True)
class StoreCompareSet:
    KIND: ClassVar[MessageKind] = MessageKind.STORE_COMPARE_SET
    req_id: int
    key: str
    expected: bytes
    desired: bytes


@dataclass(frozen=True, slots=True)
class StoreDeleteKey:
    KIND: ClassVar[MessageKind] = MessageKind.STORE_DELETE_KEY
    req_id: int
    key: str


@dataclass(frozen=True, slots=True)
class StoreNumKeys:
    KIND: ClassVar[MessageKind] = MessageKind.STORE_NUM_KEYS
    req_id: int


@dataclass(frozen=True, slots=True)
class StoreCheck:
    KIND: ClassVar[MessageKind] = MessageKind.STORE_CHECK
    req_id: int
    keys: list[str]


@dataclass(frozen=True, slots=True)
class Barrier:
    KIND: ClassVar[MessageKind] = MessageKind.BARRIER
    req_id: int
    seq: int
    timeout: float


@dataclass(frozen=True, slots=True)
class DumpRequest:
    """Ask every active rank of job ``job`` to write its flight recorder.

    The reply is ``{"ranks": [the ranks told], "request": the notice's number}``.
    Each rank writes one file of a fixed name into its own dump directory (the
    request names none) and puts ``request`` in it. A job is told at most once per
    ``DUMP_INTERVAL`` (``_server/state.py``): a request within it is answered
    with the last notice's ranks and number.
    """

    KIND: ClassVar[MessageKind] = MessageKind.DUMP
    req_id: int
    job: str


@dataclass(frozen=True, slots=True)
class Regroup:
    """Agree with other members on a group's next membership (``shrink_group``).

    Every caller names the same ``key`` (the group and how many times it was
    regrouped), the ``group_id`` the new group takes, and the ranks it expects
    in it (``members``, its own among them). The server answers every caller
    with the same sorted list: the members proposed that are still in the job
    (a member that fails or leaves meanwhile is left out), or the same error.
    """

    KIND: ClassVar[MessageKind] = MessageKind.REGROUP
    req_id: int
    key: str
    group_id: int
    members: list[int]
    timeout: float


@dataclass(frozen=True, slots=True)
class StatusRequest:
    """Ask for the server's status: every job (at most ``STATUS_JOBS`` of them), or ``job``."""

    KIND: ClassVar[MessageKind] = MessageKind.STATUS
    req_id: int
    job: str = ""  # "": the jobs in turn, with a few ranks each; else that job, its ranks too


@dataclass(frozen=True, slots=True)
class MembersRequest:
    """Ask for the member table of a formed job (fetched on first need, not at join)."""

    KIND: ClassVar[MessageKind] = MessageKind.MEMBERS
    req_id: int


@dataclass(frozen=True, slots=True)
class AuthStart:
    """Ask the server for a challenge (a client holding a token sends it first)."""

    KIND: ClassVar[MessageKind] = MessageKind.AUTH_START


@dataclass(frozen=True, slots=True)
class Hello:
    """The client's answer to a ``Challenge``: its nonce and its proof of the token."""

    KIND: ClassVar[MessageKind] = MessageKind.HELLO
    nonce: bytes
    proof: bytes


@dataclass(frozen=True, slots=True)
class Channel:
    """The messages after this one on this connection belong to member channel ``channel``.

    Members in one process share one control connection to a server, each on
    its own channel (channel 0 is the connection's own, where it starts). A
    client names the channel before the requests of another member; the server
    names it before a notice (``MemberFailed``, ``ErrorReply`` with no request,
    ``ServerClosing``). Replies need no channel: a request id is unique on its
    connection.
    """

    KIND: ClassVar[MessageKind] = MessageKind.CHANNEL
    channel: int


@dataclass(frozen=True, slots=True)
class CloseChannel:
    """The member on ``channel`` is gone, as if it had a connection of its own that closed."""

    KIND: ClassVar[MessageKind] = MessageKind.CLOSE_CHANNEL
    channel: int


@dataclass(frozen=True, slots=True)
class Reattach:
    """A member of a formed job, back on a server that went away: take me back.

    Sent on a new connection (after its token handshake) for every member of
    the process. ``secret`` is the one its ``Join`` carried: the server that kept
    its state (``--state-dir``) checks it; one that did not rebuilds the job's
    membership from these re-attachments.
    """

    KIND: ClassVar[MessageKind] = MessageKind.REATTACH
    req_id: int
    group_name: str
    generation: int
    world_size: int
    rank: int
    local_rank: int
    host: str
    pid: int
    addresses: list[str]
    heartbeat_timeout: float
    secret: bytes


# --- control plane: server -> client ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Packed:
    """A header field already encoded as msgpack, spliced into the frame unchanged.

    The server encodes a job's member table once and sends the same bytes to
    every member that asks, instead of encoding it N times.
    """

    data: bytes


@dataclass(frozen=True, slots=True)
class Reply:
    KIND: ClassVar[MessageKind] = MessageKind.REPLY
    req_id: int
    value: Any


@dataclass(frozen=True, slots=True)
class Welcome:
    KIND: ClassVar[MessageKind] = MessageKind.WELCOME
    req_id: int
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    # Which host each rank runs on, in rank order, as runs ``[host id, count]``: equal
    # ids mean the same host. Ranks of one host are usually contiguous, so a job of N
    # ranks on H hosts needs H runs, not N ids; and ``[host id, count, repeat]`` stands
    # for ``repeat`` runs of ``count`` ranks on hosts ``host id``, ``host id + 1``, ...:
    # the usual layout (every host the same size) is one run, whatever N and H.
    host_runs: list[list[int]]
    # The server keeps jobs across a restart (a daemon): its members reconnect and
    # re-attach when it goes away, for their grace period (``AIODIST_SERVER_GRACE``).
    restartable: bool = False

    def host_ids(self) -> HostIds:
        """The host id of every rank, in rank order.

        Raises:
            ValueError: The runs are malformed or do not cover ``world_size`` ranks.
        """
        firsts: list[int] = []
        counts: list[int] = []
        starts: list[int] = []
        covered = runs = 0
        for run in self.host_runs:
            if (
                len(run) not in (2, 3)
                or any(type(v) is not int for v in run)
                or run[1] < 1
                or (len(run) == 3 and run[2] < 1)
            ):
                raise ValueError(f"Welcome.host_runs has a malformed run {run!r}")
            repeat = run[2] if len(run) == 3 else 1
            firsts.append(run[0])
            counts.append(run[1])
            starts.append(covered)
            covered += run[1] * repeat
            runs += repeat
            if covered > self.world_size:
                break  # a hostile repeat must not make us count far past it
        if covered != self.world_size:
            raise ValueError(
                f"Welcome.host_runs covers {covered} ranks, world_size is {self.world_size}"
            )
        # Tuples of ints: the garbage collector stops tracking them.
        return HostIds(tuple(firsts), tuple(counts), tuple(starts), covered, runs)


def pack_host_runs(hosts: Iterable[int]) -> list[list[int]]:
    """``Welcome.host_runs`` for the host id of every rank, in rank order.

    Example:
        >>> pack_host_runs([0, 0, 1, 1, 2, 2, 0])
        [[0, 2, 3], [0, 1]]
    """
    runs: list[list[int]] = []  # [host id, count] while being counted
    for host in hosts:
        if runs and runs[-1][0] == host:
            runs[-1][1] += 1
        else:
            runs.append([host, 1])
    packed: list[list[int]] = []  # [host id, count] or [host id, count, repeat]
    for host, count in runs:
        last = packed[-1] if packed else None
        repeat = 0 if last is None else last[2] if len(last) == 3 else 1
        if last is not None and last[1] == count and last[0] + repeat == host:
            last[2:] = [repeat + 1]
        else:
            packed.append([host, count])
    return packed


class HostIds(Sequence[int]):
    """Which host each rank runs on, kept as its runs: a member of a job of N ranks on H
    hosts holds O(H) at most (one run when every host has as many ranks), not a list of
    N ids (N members of one process would hold N^2)."""

    __slots__ = ("_counts", "_firsts", "_len", "_runs", "_starts")

    def __init__(
        self,
        firsts: tuple[int, ...],
        counts: tuple[int, ...],
        starts: tuple[int, ...],
        length: int,
        runs: int,
    ) -> None:
        self._firsts, self._counts, self._starts = firsts, counts, starts
        self._len, self._runs = length, runs

    def __len__(self) -> int:
        return self._len

    @property
    def runs(self) -> int:
        """How many runs of ranks on one host there are (1: every rank on one host)."""
        return self._runs

    @overload
    def __getitem__(self, rank: int) -> int: ...
    @overload
    def __getitem__(self, rank: slice) -> list[int]: ...
    def __getitem__(self, rank: int | slice) -> int | list[int]:
        if isinstance(rank, slice):
            return [self[r] for r in range(*rank.indices(self._len))]
        if rank < 0:
            rank += self._len
        if not 0 <= rank < self._len:
            raise IndexError(f"rank {rank} out of range for {self._len} ranks")
        i = 0 if len(self._starts) == 1 else bisect.bisect_right(self._starts, rank) - 1
        return self._firsts[i] + (rank - self._starts[i]) // self._counts[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HostIds | list | tuple):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, as a list

    def __repr__(self) -> str:
        return f"HostIds({list(self)!r})"


@dataclass(frozen=True, slots=True)
class ErrorReply:
    KIND: ClassVar[MessageKind] = MessageKind.ERROR
    req_id: int  # 0 when the error answers no request
    code: int
    message: str
    details: dict[str, Any]


@dataclass(frozen=True, slots=True)
class MemberFailed:
    KIND: ClassVar[MessageKind] = MessageKind.MEMBER_FAILED
    rank: int
    host: str
    pid: int
    reason: str


@dataclass(frozen=True, slots=True)
class MembersLeft:
    """Members that left a formed job cleanly: ``[rank, host, pid]`` each."""

    KIND: ClassVar[MessageKind] = MessageKind.MEMBERS_LEFT
    members: list[Any]


@dataclass(frozen=True, slots=True)
class MembersFailed:
    """Members of a formed job that failed, ``[rank, host, pid, reason]`` each.

    The first failure of a notice interval is a ``MemberFailed`` of its own; the
    ones after it within the interval go together in one of these, so that a job
    of N members dying at once costs O(N) notices, not O(N^2).
    """

    KIND: ClassVar[MessageKind] = MessageKind.MEMBERS_FAILED
    members: list[Any]

    def each(self) -> list[MemberFailed]:
        """One ``MemberFailed`` per entry.

        Raises:
            ValueError: An entry is not ``[rank, host, pid, reason]`` of those types.
        """
        out = []
        for entry in self.members:
            if (
                type(entry) is not list
                or len(entry) != 4
                or [type(v) for v in entry] != [int, str, int, str]
            ):
                raise ValueError(f"MembersFailed has a malformed entry {entry!r:.80}")
            out.append(MemberFailed(*entry))
        return out


@dataclass(frozen=True, slots=True)
class DumpNotice:
    """Write your flight recorder into your dump directory (a ``DumpRequest`` named your job).

    ``request`` identifies the notice: the dump carries it, so that whoever asked
    knows the file answers its request, not an earlier one.
    """

    KIND: ClassVar[MessageKind] = MessageKind.DUMP_NOTICE
    request: int


@dataclass(frozen=True, slots=True)
class MembersJoined:
    """Members that joined a formed elastic job, and the view they make.

    ``epoch`` counts the job's membership changes (joins, failures, leaves);
    ``world_size`` is the job's rank space now (every rank ever given),
    ``ranks`` the ranks alive, ``joined`` the newcomers as ``[rank, host, pid]``.
    The newcomer gets it too, right after its ``Welcome``.
    """

    KIND: ClassVar[MessageKind] = MessageKind.MEMBERS_JOINED
    epoch: int
    world_size: int
    ranks: list[int]
    joined: list[Any]


@dataclass(frozen=True, slots=True)
class Challenge:
    """The server's nonce; empty when the server requires no token."""

    KIND: ClassVar[MessageKind] = MessageKind.CHALLENGE
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Authenticated:
    """The server accepted the client's proof and proves the token in turn."""

    KIND: ClassVar[MessageKind] = MessageKind.AUTHENTICATED
    proof: bytes


@dataclass(frozen=True, slots=True)
class ServerClosing:
    KIND: ClassVar[MessageKind] = MessageKind.SERVER_CLOSING
    reason: str
    # The server keeps its jobs on disk and is expected back (a daemon with a state
    # directory being restarted): members wait for it, for their grace period.
    coming_back: bool = False


Message = (
    Join
    | Leave
    | Heartbeat
    | StoreSet
    | StoreGet
    | StoreAdd
    | StoreWait
    | StoreCompareSet
    | StoreDeleteKey
    | StoreNumKeys
    | StoreCheck
    | Barrier
    | Regroup
    | StatusRequest
    | DumpRequest
    | DumpNotice
    | MembersRequest
    | Reattach
    | AuthStart
    | Hello
    | Channel
    | CloseChannel
    | Challenge
    | Authenticated
    | Reply
    | Welcome
    | ErrorReply
    | MemberFailed
    | MembersLeft
    | ServerClosing
)

# --- key packing ----------------------------------------------------------------------


def pack_keys(keys: list[str]) -> bytes:
    """``StoreWait.keys`` for ``keys``."""
    return msgpack.packb(keys, use_bin_type=True)


def unpack_keys(data: bytes) -> list[str]:
    """The keys of a ``StoreWait``.

    Raises:
        ValueError: ``data`` is not one msgpack array of str.
    """
    try:
        keys = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"StoreWait.keys is not msgpack: {exc}") from None
    if type(keys) is not list or not _STR.issuperset(map(type, keys)):
        raise ValueError("StoreWait.keys must be a msgpack array of str")
    return keys


_STR = frozenset((str,))
