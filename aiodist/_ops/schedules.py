"""SANS-IO: who talks to whom, and about which chunk, in each collective algorithm.

Every function here is pure: it takes a rank and a world size (and a root or
an element count) and returns plain data. ``tensor.py`` turns the plans into
messages; the tests check them without an event loop.

Ranks are group ranks in ``[0, size)``.

- **Ring**: rank ``r`` sends to ``r + 1`` and receives from ``r - 1``. The
  tensor is cut into ``size`` near-equal chunks; reduce-scatter leaves rank
  ``r`` owning the fully reduced chunk ``r + 1``, all-gather then passes the
  finished chunks round the ring.
- **Recursive doubling**: at step ``k`` rank ``r`` exchanges with ``r ^ 2**k``.
  For a size that is not a power of two, the ``size - 2**floor(log2 size)``
  "extra" ranks first fold their data into rank ``r - 2**floor(log2 size)``,
  sit out the exchanges, and get the result back at the end.
- **Binomial tree**: relative rank ``v = (r - root) % size``; the parent clears
  ``v``'s lowest set bit; the children are ``v + 2**k`` for each ``2**k`` below
  that bit (every power of two below ``size`` for the root).
- **Dissemination**: at round ``k`` rank ``r`` sends to ``r + 2**k`` and
  receives from ``r - 2**k``; after ``ceil(log2 size)`` rounds everyone has
  (transitively) heard from everyone.
- **Direct exchange**: every rank sends to every other rank at once, starting
  with ``r + 1``; one round instead of ``log2 size``, at the price of
  ``size - 1`` messages per rank, so it serves small groups and small data.
- **Shared memory** (ranks of one host): every rank reduces chunk ``r`` of
  all ranks' shared segments in place, then copies the other chunks out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

#: Largest group that uses the one-round direct exchange for latency-bound operations.
DIRECT_MAX_RANKS: Final = 8
#: Largest all_reduce (bytes per rank) that uses the direct exchange in such a group.
DIRECT_MAX_BYTES: Final = 16 * 1024
#: all_reduce of at least this many bytes uses the bandwidth-optimal ring.
RING_MIN_BYTES: Final = 64 * 1024
#: all_reduce of at least this many bytes goes through shared memory where it can.
SHM_MIN_BYTES: Final = 1 << 20


def _check(rank: int, size: int) -> None:
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """``(left, right)``: the rank we receive from and the rank we send to."""
    _check(rank, size)
    return (rank - 1) % size, (rank + 1) % size


def chunk_bounds(numel: int, size: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``size`` contiguous ``(start, stop)`` chunks.

    Chunk lengths differ by at most one; the first ``numel % size`` are longer.
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    base, extra = divmod(numel, size)
    bounds = []
    start = 0
    for i in range(size):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def ring_reduce_scatter_steps(rank: int, size: int) -> list[tuple[int, int]]:
    """Per step, ``(chunk sent to the right, chunk received from the left and reduced)``.

    After the ``size - 1`` steps, chunk ``(rank + 1) % size`` is fully reduced here.
    """
    _check(rank, size)
    return [((rank - s) % size, (rank - s - 1) % size) for s in range(size - 1)]


def ring_all_gather_steps(rank: int, size: int) -> list[tuple[int, int]]:
    """Per step, ``(chunk sent to the right, chunk received from the left)``.

    Starts from the state ``ring_reduce_scatter_steps`` leaves: rank ``r`` owns
    chunk ``r + 1``.
    """
    _check(rank, size)
    return [((rank + 1 - s) % size, (rank - s) % size) for s in range(size - 1)]


@dataclass(frozen=True, slots=True)
class RecursiveDoubling:
    """One rank's part in a recursive-doubling exchange.

    Attributes:
        fold_partner: The rank this one folds with (None when it has none):
            for an extra rank the rank it sends its data to and gets the result
            from; for a core rank the extra rank it receives from and answers.
        is_extra: True for ranks that sit out the exchanges.
        partners: The exchange partners, one per step (empty for extra ranks).
    """

    fold_partner: int | None
    is_extra: bool
    partners: tuple[int, ...]


def recursive_doubling(rank: int, size: int) -> RecursiveDoubling:
    """Plan recursive doubling for ``rank``, folding ranks beyond the largest power of two."""
    _check(rank, size)
    core = 1 << (size.bit_length() - 1)  # largest power of two <= size
    if rank >= core:
        return RecursiveDoubling(rank - core, True, ())
    fold = rank + core if rank + core < size else None
    partners = []
    mask = 1
    while mask < core:
        partners.append(rank ^ mask)
        mask <<= 1
    return RecursiveDoubling(fold, False, tuple(partners))


@dataclass(frozen=True, slots=True)
class TreeLinks:
    """One rank's links in a binomial tree.

    Attributes:
        parent: None at the root.
        children: Largest subtree first (the order a broadcast sends in).
    """

    parent: int | None
    children: tuple[int, ...]


def binomial_tree(rank: int, size: int, root: int) -> TreeLinks:
    """The parent and children of ``rank`` in the binomial tree rooted at ``root``."""
    _check(rank, size)
    _check(root, size)
    v = (rank - root) % size
    lowbit = v & -v if v else 1 << size.bit_length()
    parent = None if v == 0 else ((v - lowbit) + root) % size
    children = []
    mask = 1
    while mask < lowbit and v + mask < size:
        children.append((v + mask + root) % size)
        mask <<= 1
    return TreeLinks(parent, tuple(reversed(children)))


def dissemination_partners(rank: int, size: int) -> list[tuple[int, int]]:
    """Per round, ``(rank sent to, rank received from)``; empty for size 1."""
    _check(rank, size)
    rounds = []
    distance = 1
    while distance < size:
        rounds.append(((rank + distance) % size, (rank - distance) % size))
        distance <<= 1
    return rounds


def direct_peers(rank: int, size: int) -> list[int]:
    """The other ranks in the order ``rank`` sends to them: ``r + 1, r + 2, ...``.

    Starting at the next rank spreads the first messages over all receivers.
    """
    _check(rank, size)
    return [*range(rank + 1, size), *range(rank)]  # (rank + k) % size for k = 1, 2, ...


def all_reduce_algorithm(
    nbytes: int, numel: int, size: int, *, shared_memory: bool = False
) -> Literal["direct", "recursive_doubling", "ring", "shared_memory"]:
    """Pick all_reduce's algorithm from the tensor's size and the group's.

    Small tensors in small groups: one round of direct exchange (latency).
    Up to ``RING_MIN_BYTES``: recursive doubling, ``log2 size`` rounds. Larger:
    the ring, which moves ``2 (size - 1) / size`` of the tensor per rank
    (bandwidth), as long as every rank gets a non-empty chunk. From
    ``SHM_MIN_BYTES`` on, a group whose ranks share one host (``shared_memory``)
    reduces in shared memory instead, with no socket copies at all.
    """
    if shared_memory and nbytes >= SHM_MIN_BYTES:
        return "shared_memory"
    if size <= DIRECT_MAX_RANKS and nbytes <= DIRECT_MAX_BYTES:
        return "direct"
    if nbytes < RING_MIN_BYTES or numel < size:
        return "recursive_doubling"
    return "ring"
