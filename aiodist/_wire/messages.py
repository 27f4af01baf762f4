"""Every message of aiodist's wire, declared once: its kind, its fields and their bounds.

One class per message (``headers.py`` derives the rest from it: the decoder's
table, the header array, the type and range checks, the durable set). A
message's header travels as a msgpack *array* of its fields in declaration
order (compact, and cheap to decode on the hot path). Kinds 1-31 go from a
client to the rendezvous server, 32-63 back, 64 and above between ranks (the
data plane). Adding a message is adding its class here; the server's handler
(``_server``) and its sender are the only other places it appears.

A ``StoreWait`` carries its keys pre-packed: ``pack_keys`` and ``unpack_keys``
below are that field's encoding. Error codes are ``aiodist._errors``'s.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, overload

import msgpack

from aiodist._wire.bounds import (
    I64,
    MAX_GROUP_NAME_CHARS,
    MAX_NONCE_BYTES,
    MAX_REASON_CHARS,
    MAX_WORLD_SIZE,
    Addresses,
    Generation,
    HeartbeatTimeout,
    HostName,
    Int,
    JobName,
    Len,
    Name,
    Nonce,
    Pid,
    Rank,
    ReqId,
    Secret,
    Timeout,
    U64Int,
    Where,
    WorldSize,
)
from aiodist._wire.headers import Message, message

# --- control plane: client -> server ------------------------------------------------


@message(1, durable=True)
class Join(Message):
    req_id: ReqId
    group_name: JobName
    world_size: WorldSize
    rank: Annotated[int, Int(-1, MAX_WORLD_SIZE - 1)]  # -1: let the server assign one
    host: HostName
    pid: Pid
    addresses: Addresses
    heartbeat_timeout: HeartbeatTimeout
    timeout: Timeout
    # The how-many-th start of the job (a launcher's restart count): a later
    # generation replaces the job's earlier one, an earlier one is refused.
    generation: Generation = 0
    # A random secret of this member: proof of membership when it re-attaches to a
    # server that came back (``Reattach``); kept in the server's durable state.
    secret: Secret = b""
    # Above 0: the job is elastic (torchrun's ``--nnodes MIN:MAX``): it forms with
    # ``world_size`` members, and admits later joiners while fewer than this many are alive.
    max_world_size: Annotated[int, Int(0, MAX_WORLD_SIZE)] = 0


@message(2, durable=True)
class Leave(Message):
    req_id: ReqId
    # Empty: a clean leave. Otherwise the member failed (its program ended with an
    # uncaught exception, a non-zero exit or Ctrl-C) and this says why: the others
    # hear that it failed, and the job is recorded as failed.
    reason: Annotated[str, Len(0, MAX_REASON_CHARS, "characters")] = ""


@message(3)
class Heartbeat(Message):
    """I am alive; ``where`` says what each member on the connection is doing.

    ``where`` holds one ``[channel, current, last, sent]`` per member that
    reports: ``current`` its oldest unfinished operation and ``last`` the
    collective it finished last, each ``[group, seq, name, seconds]`` (running
    for, ended ago) or None; ``sent`` the ``[messages, bytes]`` its data plane
    sent its peers since it joined (the dashboard's rates). The server echoes a
    heartbeat with an empty ``where``.
    """

    where: Annotated[list[Any], Where()] = field(default_factory=list)


@message(4, durable=True)
class StoreSet(Message):
    req_id: ReqId
    key: str
    value: bytes


@message(5)
class StoreGet(Message):
    req_id: ReqId
    key: str
    timeout: Timeout


@message(6, durable=True)
class StoreAdd(Message):
    req_id: ReqId
    key: str
    amount: Annotated[int, Int(-I64, I64 - 1)]  # TCPStore's int64


@message(7)
class StoreWait(Message):
    req_id: ReqId
    # The keys as one msgpack array of str (``pack_keys``). Every member of a job
    # usually waits on the same N keys: the server recognises those waits by these
    # bytes and decodes the N keys once, not once per member.
    keys: bytes
    timeout: Timeout


@message(8, durable=True)
class StoreCompareSet(Message):
    req_id: ReqId
    key: str
    expected: bytes
    desired: bytes


@message(9, durable=True)
class StoreDeleteKey(Message):
    req_id: ReqId
    key: str


@message(10)
class StoreNumKeys(Message):
    req_id: ReqId


@message(11)
class StoreCheck(Message):
    req_id: ReqId
    keys: list[str]


@message(12, durable=True)
class Barrier(Message):
    req_id: ReqId
    seq: U64Int
    timeout: Timeout


@message(29)
class DumpRequest(Message):
    """Ask every active rank of job ``job`` to write its flight recorder.

    The reply is ``{"ranks": [the ranks told], "request": the notice's number}``.
    Each rank writes one file of a fixed name into its own dump directory (the
    request names none) and puts ``request`` in it. A job is told at most once per
    ``DUMP_INTERVAL`` (``_server/state.py``): a request within it is answered
    with the last notice's ranks and number.
    """

    req_id: ReqId
    job: JobName


@message(22, durable=True)
class Regroup(Message):
    """Agree with other members on a group's next membership (``shrink_group``).

    Every caller names the same ``key`` (the group and how many times it was
    regrouped), the ``group_id`` the new group takes, and the ranks it expects
    in it (``members``, its own among them). The server answers every caller
    with the same sorted list: the members proposed that are still in the job
    (a member that fails or leaves meanwhile is left out), or the same error.
    """

    req_id: ReqId
    key: JobName
    group_id: U64Int
    members: Annotated[list[int], Len(1, MAX_WORLD_SIZE, "items")]
    timeout: Timeout


@message(13)
class StatusRequest(Message):
    """Ask for the server's status: every job (at most ``STATUS_JOBS`` of them), or ``job``."""

    req_id: ReqId
    # "": the jobs in turn, with a few ranks each; else that job, its ranks too.
    job: Annotated[str, Name(0, MAX_GROUP_NAME_CHARS)] = ""


@message(20)
class MembersRequest(Message):
    """Ask for the member table of a formed job (fetched on first need, not at join)."""

    req_id: ReqId


@message(16)
class AuthStart(Message):
    """Ask the server for a challenge (a client holding a token sends it first)."""


@message(15)
class Hello(Message):
    """The client's answer to a ``Challenge``: its nonce and its proof of the token."""

    nonce: Nonce
    proof: Nonce


@message(17)
class Channel(Message):
    """The messages after this one on this connection belong to member channel ``channel``.

    Members in one process share one control connection to a server, each on
    its own channel (channel 0 is the connection's own, where it starts). A
    client names the channel before the requests of another member; the server
    names it before a notice (``MemberFailed``, ``ErrorReply`` with no request,
    ``ServerClosing``). Replies need no channel: a request id is unique on its
    connection.
    """

    channel: U64Int


@message(18)
class CloseChannel(Message):
    """The member on ``channel`` is gone, as if it had a connection of its own that closed."""

    channel: U64Int


@message(21)
class Reattach(Message):
    """A member of a formed job, back on a server that went away: take me back.

    Sent on a new connection (after its token handshake) for every member of
    the process. ``secret`` is the one its ``Join`` carried: the server that kept
    its state (``--state-dir``) checks it; one that did not rebuilds the job's
    membership from these re-attachments.
    """

    req_id: ReqId
    group_name: JobName
    generation: Generation
    world_size: WorldSize
    rank: Rank
    local_rank: Rank
    host: HostName
    pid: Pid
    addresses: Addresses
    heartbeat_timeout: HeartbeatTimeout
    secret: Secret


# --- control plane: server -> client ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Packed:
    """A header field already encoded as msgpack, spliced into the frame unchanged.

    The server encodes a job's member table once and sends the same bytes to
    every member that asks, instead of encoding it N times.
    """

    data: bytes


@message(32)
class Reply(Message):
    req_id: int
    value: Any


@message(33)
class Welcome(Message):
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


@message(34)
class ErrorReply(Message):
    req_id: int  # 0 when the error answers no request
    code: int
    message: str
    details: dict[str, Any]


@message(35)
class MemberFailed(Message):
    rank: int
    host: str
    pid: int
    reason: str


@message(39)
class MembersLeft(Message):
    """Members that left a formed job cleanly: ``[rank, host, pid]`` each."""

    members: list[Any]


@message(41)
class MembersFailed(Message):
    """Members of a formed job that failed, ``[rank, host, pid, reason]`` each.

    The first failure of a notice interval is a ``MemberFailed`` of its own; the
    ones after it within the interval go together in one of these, so that a job
    of N members dying at once costs O(N) notices, not O(N^2).
    """

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


@message(47)
class DumpNotice(Message):
    """Write your flight recorder into your dump directory (a ``DumpRequest`` named your job).

    ``request`` identifies the notice: the dump carries it, so that whoever asked
    knows the file answers its request, not an earlier one.
    """

    request: int


@message(40)
class MembersJoined(Message):
    """Members that joined a formed elastic job, and the view they make.

    ``epoch`` counts the job's membership changes (joins, failures, leaves);
    ``world_size`` is the job's rank space now (every rank ever given),
    ``ranks`` the ranks alive, ``joined`` the newcomers as ``[rank, host, pid]``.
    The newcomer gets it too, right after its ``Welcome``.
    """

    epoch: int
    world_size: int
    ranks: list[int]
    joined: list[Any]


@message(37)
class Challenge(Message):
    """The server's nonce; empty when the server requires no token."""

    nonce: bytes


@message(38)
class Authenticated(Message):
    """The server accepted the client's proof and proves the token in turn."""

    proof: bytes


@message(36)
class ServerClosing(Message):
    reason: str
    # The server keeps its jobs on disk and is expected back (a daemon with a state
    # directory being restarted): members wait for it, for their grace period.
    coming_back: bool = False


# --- data plane: rank <-> rank ------------------------------------------------------------


@message(64)
class PeerHello(Message):
    """The connecting side's claim: rank ``rank`` of job ``job`` (pid ``pid``) wants member
    ``member`` of a shared listener; ``nonce`` is its challenge (None without a token).

    See ``_plane/channel.py`` for the token handshake it opens.
    """

    job: JobName
    rank: Rank
    pid: Pid
    member: U64Int
    nonce: Annotated[bytes | None, Len(0, MAX_NONCE_BYTES, "bytes")] = None


@message(65)
class Data(Message):
    """One message between ranks: its match key (``keys.py``), then the sender's meta;
    its payload follows the header.

    The hot path never builds this class: a ``DATA`` header stays the list
    ``[kind, group, a, b, meta]``: the match key, then the meta at ``DATA_META``.
    """

    kind: int
    group: int
    a: int
    b: int
    meta: Any


#: Where ``DATA``'s header holds the sender's meta, after the match key's four fields.
DATA_META: Final = 4


@message(66)
class PeerError(Message):
    """A group broke, or a call was aborted, on the sender: ``code``, ``message`` and
    ``details`` as ``ErrorReply``'s (``_errors.from_wire`` rebuilds the error)."""

    group_id: int
    code: int
    message: str
    details: dict[str, Any]


@message(67)
class PeerBye(Message):
    """The sender closes the channel: what it sent before is all there is."""


@message(68)
class PeerAuth(Message):
    """The data plane's token handshake (``_plane/channel.py``): a nonce and a proof."""

    nonce: Nonce
    proof: Nonce


@message(69)
class PeerAbort(Message):
    """A send that failed before its data left: it takes the place of the ``DATA`` of key
    ``(kind, group, a, b)``, so the receive it matches fails instead, naming ``rank``,
    why (``reason``) and the call (``what``)."""

    kind: int
    group: int
    a: int
    b: int
    rank: int
    reason: str
    what: str


@message(70)
class PeerAnnounce(Message):
    """A large payload's announcement (``_plane/bulk.py``): the ``DATA`` of key
    ``(kind, group, a, b)`` and ``meta`` will follow once the receiver clears it, as
    payload ``ident`` of ``nbytes`` bytes."""

    kind: int
    group: int
    a: int
    b: int
    meta: Any
    ident: int
    nbytes: U64Int


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


# The declared messages, then the rest.
