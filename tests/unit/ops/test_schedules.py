"""SANS-IO schedules: checked by simulating the plans on plain Python data."""

from __future__ import annotations

import itertools

import pytest

from aiodist._ops.schedules import (
    DIRECT_MAX_BYTES,
    DIRECT_MAX_RANKS,
    RING_MIN_BYTES,
    SHM_MIN_BYTES,
    all_reduce_algorithm,
    binomial_tree,
    chunk_bounds,
    direct_peers,
    dissemination_partners,
    recursive_doubling,
    ring_all_gather_steps,
    ring_neighbours,
    ring_reduce_scatter_steps,
)

SIZES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16]


@pytest.mark.parametrize("size", SIZES)
def test_ring_neighbours_form_one_cycle(size: int) -> None:
    seen, r = [], 0
    for _ in range(size):
        seen.append(r)
        _left, right = ring_neighbours(r, size)
        assert ring_neighbours(right, size)[0] == r
        r = right
    assert sorted(seen) == list(range(size))
    assert r == 0


@pytest.mark.parametrize(("numel", "size"), [(0, 3), (1, 4), (10, 3), (100_003, 5), (8, 8)])
def test_chunk_bounds_cover_range_near_equally(numel: int, size: int) -> None:
    bounds = chunk_bounds(numel, size)
    assert len(bounds) == size
    assert bounds[0][0] == 0
    assert bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    lengths = [b - a for a, b in bounds]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)


@pytest.mark.parametrize("size", SIZES)
def test_ring_reduce_scatter_then_all_gather_sums_every_chunk(size: int) -> None:
    # state[r][c] = set of ranks whose chunk c has been reduced into rank r's chunk c
    state = [[{r} for _ in range(size)] for r in range(size)]
    rs = [ring_reduce_scatter_steps(r, size) for r in range(size)]
    for s in range(size - 1):
        sent = [(rs[r][s][0], set(state[r][rs[r][s][0]])) for r in range(size)]
        for r in range(size):
            left, _ = ring_neighbours(r, size)
            chunk, contents = sent[left]
            assert rs[r][s][1] == chunk  # we reduce the chunk our left neighbour sent
            state[r][chunk] |= contents
    for r in range(size):
        assert state[r][(r + 1) % size] == set(range(size))
    ag = [ring_all_gather_steps(r, size) for r in range(size)]
    for s in range(size - 1):
        sent = [(ag[r][s][0], set(state[r][ag[r][s][0]])) for r in range(size)]
        for r in range(size):
            left, _ = ring_neighbours(r, size)
            chunk, contents = sent[left]
            assert ag[r][s][1] == chunk
            state[r][chunk] = contents
    assert all(c == set(range(size)) for row in state for c in row)


@pytest.mark.parametrize("size", SIZES)
def test_recursive_doubling_with_fold_reaches_everyone(size: int) -> None:
    plans = [recursive_doubling(r, size) for r in range(size)]
    have = [{r} for r in range(size)]
    for r, p in enumerate(plans):
        if p.is_extra:
            assert p.fold_partner is not None
            assert plans[p.fold_partner].fold_partner == r
            have[p.fold_partner] |= have[r]
    core = [r for r in range(size) if not plans[r].is_extra]
    assert len(core) & (len(core) - 1) == 0  # a power of two
    steps = {len(plans[r].partners) for r in core}
    assert len(steps) == 1
    for k in range(steps.pop()):
        before = [set(h) for h in have]
        for r in core:
            partner = plans[r].partners[k]
            assert plans[partner].partners[k] == r
            have[r] = before[r] | before[partner]
    for r, p in enumerate(plans):
        if p.is_extra:
            assert p.fold_partner is not None
            have[r] = have[p.fold_partner]
    assert all(h == set(range(size)) for h in have)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("root_pick", [0, 1, -1])
def test_binomial_tree_spans_all_ranks_from_root(size: int, root_pick: int) -> None:
    root = root_pick % size
    links = [binomial_tree(r, size, root) for r in range(size)]
    assert links[root].parent is None
    for r, link in enumerate(links):
        for c in link.children:
            assert links[c].parent == r
        if r != root:
            assert link.parent is not None
            assert r in links[link.parent].children
    reached, frontier = {root}, [root]
    while frontier:
        nxt = [c for r in frontier for c in links[r].children]
        assert not reached & set(nxt)
        reached |= set(nxt)
        frontier = nxt
    assert reached == set(range(size))


def test_binomial_tree_root_sends_largest_subtree_first() -> None:
    assert binomial_tree(0, 8, 0).children == (4, 2, 1)
    assert binomial_tree(4, 8, 0).children == (6, 5)
    assert binomial_tree(5, 6, 2) == binomial_tree(5, 6, 2)
    assert binomial_tree(3, 6, 2).parent == 2


@pytest.mark.parametrize("size", SIZES)
def test_dissemination_everyone_hears_from_everyone(size: int) -> None:
    rounds = [dissemination_partners(r, size) for r in range(size)]
    heard = [{r} for r in range(size)]
    for k in range(len(rounds[0])):
        before = [set(h) for h in heard]
        for r in range(size):
            to, frm = rounds[r][k]
            assert rounds[frm][k][0] == r
            assert rounds[to][k][1] == r
            heard[r] |= before[frm]
    assert all(h == set(range(size)) for h in heard)
    assert len(rounds[0]) == (size - 1).bit_length()


@pytest.mark.parametrize(
    "call",
    [
        lambda: ring_neighbours(3, 3),
        lambda: chunk_bounds(-1, 2),
        lambda: recursive_doubling(0, 0),
        lambda: binomial_tree(0, 4, 4),
        lambda: dissemination_partners(-1, 2),
    ],
)
def test_bad_rank_or_size_raises_value_error(call: object) -> None:
    with pytest.raises(ValueError, match="must be"):
        call()  # type: ignore[operator]


@pytest.mark.parametrize("size", SIZES)
def test_direct_peers_name_every_other_rank_once_starting_with_the_next(size: int) -> None:
    for rank in range(size):
        peers = direct_peers(rank, size)
        assert sorted(peers) == [r for r in range(size) if r != rank]
        assert not peers or peers[0] == (rank + 1) % size
    # In each position every rank is sent to by exactly one rank: no receiver is flooded.
    for k in range(size - 1):
        assert sorted(direct_peers(r, size)[k] for r in range(size)) == list(range(size))


@pytest.mark.parametrize(
    ("nbytes", "numel", "size", "shared_memory", "expected"),
    [
        (4, 1, 4, False, "direct"),
        (DIRECT_MAX_BYTES, DIRECT_MAX_BYTES // 4, DIRECT_MAX_RANKS, False, "direct"),
        (4, 1, DIRECT_MAX_RANKS + 1, False, "recursive_doubling"),
        (DIRECT_MAX_BYTES + 4, DIRECT_MAX_BYTES // 4 + 1, 4, False, "recursive_doubling"),
        (RING_MIN_BYTES - 4, RING_MIN_BYTES // 4 - 1, 4, True, "recursive_doubling"),
        (RING_MIN_BYTES, RING_MIN_BYTES // 4, 4, False, "ring"),
        (RING_MIN_BYTES, 3, 4, False, "recursive_doubling"),  # a ring chunk would be empty
        (SHM_MIN_BYTES - 4, SHM_MIN_BYTES // 4 - 1, 4, True, "ring"),
        (SHM_MIN_BYTES, SHM_MIN_BYTES // 4, 4, True, "shared_memory"),
        (SHM_MIN_BYTES, SHM_MIN_BYTES // 4, 4, False, "ring"),
    ],
)
def test_all_reduce_algorithm_by_size(
    nbytes: int, numel: int, size: int, shared_memory: bool, expected: str
) -> None:
    assert all_reduce_algorithm(nbytes, numel, size, shared_memory=shared_memory) == expected
