"""What one rank writes into its shared-board slot for one sync, and reading it back.

Two encodings, told apart by the first byte:

- **full** (msgpack, a list): one ``[name, reduction, total, count, nonfinite,
  extreme, last, updates, seen]`` per metric, the fields of ``Accumulator``;
- **single** (``SINGLE``, then a cached schema and raw doubles): the interval
  had one ``update`` of host numbers, the case of a sync every step. The slot
  holds the names and reductions (packed once per key set, ``Single``), the
  weight and each value; the reader rebuilds the full records from them with
  the same float operations ``Accumulator.add_number`` does, so both encodings
  reduce to bitwise the same values.

A training loop pays for every object built on the writing side, so the single
encoding builds one ``bytes`` per sync and nothing per metric.
"""

from __future__ import annotations

import math
import struct
import threading
from itertools import chain
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import msgpack

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from aiodist._metrics.state import Accumulator, Reduction, Snapshot

#: First byte of a single-update record (a msgpack list starts with 0x90-0x9F or 0xDC-0xDD).
SINGLE: Final = 0x01
_SCHEMA_LEN: Final = struct.Struct("<BI")  # SINGLE, then the schema's length

_packers = threading.local()  # one reusable msgpack buffer per thread


def _pack(obj: object) -> bytes:
    packer: msgpack.Packer | None = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer()
    return packer.pack(obj)


def encode(snapshot: Snapshot) -> bytes:
    """The full encoding of one snapshot."""
    reductions = snapshot.reductions
    records = snapshot.records()
    return _pack([[name, reductions[name], *rec] for name, rec in records.items()])


def encode_host(accumulators: Mapping[str, Accumulator]) -> bytes | None:
    """``encode(take_snapshot(accumulators))`` without the snapshot; None if one is on a device."""
    records = []
    for name, a in accumulators.items():
        if a.record is not None:
            return None
        updates, seen = float(a.updates), float(a.seen)
        records.append(
            [name, a.reduction, a.total, a.count, a.nonfinite, a.extreme, a.last, updates, seen]
        )
    return _pack(records)


class Single:
    """The single encoding for one key set (names in ``update``'s order)."""

    __slots__ = ("_runs", "_values", "nbytes", "prefix")

    def __init__(self, names: Sequence[str], reductions: Sequence[Reduction]) -> None:
        schema = _pack([list(names), list(reductions)])
        self.prefix = _SCHEMA_LEN.pack(SINGLE, len(schema)) + schema
        self._values = struct.Struct(f"<{len(names) + 1}d")  # the weight, then the values
        self.nbytes = len(self.prefix) + self._values.size
        self._runs: dict[int, struct.Struct] = {}  # ``k`` updates' values side by side, by k

    @property
    def values_bytes(self) -> int:
        """The size of one update's numbers: the record without its prefix."""
        return self._values.size

    def encode(self, numbers: Sequence[float]) -> bytes:
        """The record of one update: ``numbers`` is its weight, then one number per name."""
        return self.prefix + self._values.pack(*numbers)

    def pack_values(self, memory: memoryview, at: int, updates: Sequence[Sequence[float]]) -> None:
        """Write the numbers of ``updates`` (each as ``encode`` takes them) side by side.

        The prefix goes once before them (``prefix_length`` finds its end): one
        call for a whole batch of per-step syncs.
        """
        k = len(updates)
        run = self._runs.get(k)
        if run is None:
            run = self._runs[k] = struct.Struct(f"<{k * (self._values.size // 8)}d")
        run.pack_into(memory, at, *chain.from_iterable(updates))


def prefix_length(data: bytes, at: int) -> int:
    """The length of the single encoding's prefix that starts at ``data[at]``."""
    n: int = _SCHEMA_LEN.unpack_from(data, at)[1]
    return _SCHEMA_LEN.size + n


#: What a sync hands the board: an encoded record, or one update to encode when written
#: (names, then the weight and one number per name: ``MetricAggregator``'s own, with
#: ``Single`` looked up then).
Record: TypeAlias = "bytes | tuple[tuple[str, ...], list[float]]"


def decode(row: bytes) -> list[list[Any]]:
    """The full records of ``row``, whichever encoding it has."""
    if not row or row[0] != SINGLE:
        records: list[list[Any]] = msgpack.unpackb(row)
        return records
    _, n = _SCHEMA_LEN.unpack_from(row)
    start = _SCHEMA_LEN.size
    names, reductions = msgpack.unpackb(row[start : start + n])
    weight, *values = struct.unpack_from(f"<{len(names) + 1}d", row, start + n)
    count = 0.0 + weight
    out: list[list[Any]] = []
    for name, red, x in zip(names, reductions, values, strict=True):
        # Accumulator.add_number on a fresh accumulator, step by step.
        total = 0.0 + weight * x if red == "mean" else 0.0 + x if red == "sum" else 0.0
        extreme = x if red in ("min", "max") else math.nan
        last = x if red == "last" else math.nan
        nonfinite = 0.0 if math.isfinite(x) else 1.0
        out.append([name, red, total, count, nonfinite, extreme, last, 1.0, 1.0])
    return out
