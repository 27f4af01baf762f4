"""Slurm's hostlist syntax (``SLURM_NODELIST``), parsed without Slurm's tools.

``first_slurm_host`` finds rank 0's host (what mmengine asks ``scontrol show
hostname`` for) without expanding the rest of a list that may name thousands
of hosts; ``expand_slurm_hostlist`` lists them all.
"""

from __future__ import annotations

import itertools
import re
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterator


# A hostlist is comma-separated host expressions; commas inside brackets separate
# ranges instead. An expression is literal text and bracket groups, each group a
# comma-separated list of N or N-M (decimal, N <= M); a number keeps the width of N,
# so "n[008-010]" is n008, n009, n010. Several groups multiply, leftmost slowest, as
# scontrol prints them: "a[1-2]-ib[3-4]" is a1-ib3, a1-ib4, a2-ib3, a2-ib4.

_RANGE: Final = re.compile(r"([0-9]+)(?:-([0-9]+))?")

_Group = tuple[tuple[int, int, int], ...]  # (low, high, width) for each range in a group
_Expression = tuple[str | _Group, ...]


def expand_slurm_hostlist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist, as ``scontrol show hostnames`` does.

    Args:
        nodelist: E.g. ``SLURM_NODELIST``: ``"node[01-04,07]"``, ``"gpu5,node[3-4]"``,
            ``"a[1-2]-ib[3-4]"``, ``"rack1-n[008-010]"`` or a plain ``"host"``.

    Returns:
        Every host, in Slurm's order, duplicates kept, zero padding kept.

    Raises:
        ValueError: ``nodelist`` is empty or malformed (unbalanced or nested brackets,
            an empty name, group or range, a non-decimal or backwards range).

    Example:
        >>> expand_slurm_hostlist("gpu5,node[3-4]")
        ['gpu5', 'node3', 'node4']
    """
    return [
        "".join(parts)
        for expression in _parse_hostlist(nodelist)
        for parts in itertools.product(
            *([part] if isinstance(part, str) else _numbers(part) for part in expression)
        )
    ]


def first_slurm_host(nodelist: str) -> str:
    """Return the first host of a Slurm hostlist without expanding the rest.

    Slurm places rank 0 on the first node of the step, so this is where the store
    listens; mmengine gets it from ``scontrol show hostname ... | head -n1``.

    Args:
        nodelist: E.g. ``SLURM_NODELIST``; see :func:`expand_slurm_hostlist`.

    Returns:
        The first host name, zero padding kept: ``"rack1-n[008-010]"`` gives ``"rack1-n008"``.

    Raises:
        ValueError: ``nodelist`` is empty or malformed; the whole list is checked.

    Example:
        >>> first_slurm_host("node[01-04,07]")
        'node01'
    """
    first = _parse_hostlist(nodelist)[0]
    return "".join(
        part if isinstance(part, str) else f"{part[0][0]:0{part[0][2]}d}" for part in first
    )


def _numbers(group: _Group) -> Iterator[str]:
    for low, high, width in group:
        for n in range(low, high + 1):
            yield f"{n:0{width}d}"


def _parse_hostlist(nodelist: str) -> list[_Expression]:
    text = nodelist.strip()
    if not text:
        raise ValueError("empty Slurm hostlist")
    expressions: list[_Expression] = []
    parts: list[str | _Group] = []
    literal = ""
    i = 0
    while i < len(text):
        char = text[i]
        if char == "[":
            end = text.find("]", i + 1)
            if end == -1:
                raise _malformed(text, f"'[' at position {i} is never closed")
            nested = text.find("[", i + 1, end)
            if nested != -1:
                raise _malformed(text, f"nested '[' at position {nested}")
            if literal:
                parts.append(literal)
                literal = ""
            parts.append(_parse_group(text, text[i + 1 : end]))
            i = end + 1
            continue
        if char == "]":
            raise _malformed(text, f"']' at position {i} has no matching '['")
        if char == ",":
            if not parts and not literal:
                raise _malformed(text, f"empty host name before ',' at position {i}")
            expressions.append((*parts, literal) if literal else tuple(parts))
            parts, literal = [], ""
        elif char.isspace():
            raise _malformed(text, f"whitespace at position {i}")
        else:
            literal += char
        i += 1
    if not parts and not literal:
        raise _malformed(text, "empty host name after the last ','")
    expressions.append((*parts, literal) if literal else tuple(parts))
    return expressions


def _parse_group(text: str, inner: str) -> _Group:
    ranges: list[tuple[int, int, int]] = []
    for piece in inner.split(","):
        match = _RANGE.fullmatch(piece)
        if match is None:
            raise _malformed(
                text, f"bad range {piece!r} in [{inner}]: expected N or N-M, in decimal"
            )
        low = int(match[1])
        high = low if match[2] is None else int(match[2])
        if high < low:
            raise _malformed(text, f"range {piece!r} in [{inner}] runs backwards")
        ranges.append((low, high, len(match[1])))
    return tuple(ranges)


def _malformed(text: str, why: str) -> ValueError:
    return ValueError(f"malformed Slurm hostlist {text!r}: {why}")
