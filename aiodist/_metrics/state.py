"""Local accumulation of metrics and the layout of the fused buffer (no I/O, no loop).

Every metric keeps one *record* per sync interval, six numbers:

- ``total``: the sum of its values (``mean``: weighted by count; ``sum``: unweighted);
- ``count``: the total weight of its observations (``weight * numel`` per update);
- ``updates``: how many ``update`` calls mentioned it (kept on the host);
- ``nonfinite``: how many observed elements were NaN or infinite;
- ``extreme``: the smallest (``min``) or largest (``max``) element seen;
- ``last``: the latest value (a tensor's mean).

Numbers and CPU tensors accumulate as Python floats. A metric that receives a
CUDA tensor keeps its record in a float64 tensor on that device and updates it
with kernels only, so ``update`` never waits for the GPU; ``take_snapshot``
starts one non-blocking copy of all such records to pinned host memory.

A ``Layout`` places the records of an agreed, sorted key set into one float64
buffer of three segments reduced with different ops in one pass (plain floats:
a few hundred bytes, where each torch call would cost more than the whole sum):

    [ sum segment | max segment | select segment ]

- sum: per metric ``total`` (mean and sum only), ``count``, ``updates``, ``nonfinite``;
- max: slot 0 is the "my keys are not all in the layout" flag, then ``extreme``
  per min/max metric (min is stored negated, so one ``maximum`` serves both);
- select: per "last" metric a ``(priority, value)`` pair; the pair with the higher
  priority (``-rank``, ``-inf`` when absent) wins, so the lowest rank's value is kept.
"""

from __future__ import annotations

import math
import numbers
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, cast

from aiodist._errors import CollectiveMismatchError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    import torch

Reduction = Literal["mean", "sum", "min", "max", "last"]
REDUCTIONS: Final[tuple[Reduction, ...]] = ("mean", "sum", "min", "max", "last")
_TOTAL, _COUNT, _NONFINITE, _EXTREME, _LAST = range(5)  # device record slots
NEG_INF: Final = -math.inf
#: A float holds every integer below this (to within rounding).
INT_LIMIT: Final = 2**1023


def check_update(weight: object, values: Mapping[str, Any]) -> float | None:
    """Check an update's weight and values; return the weight as a float (None on a device).

    Raises:
        TypeError: A value or the weight is neither a number nor a tensor.
        ValueError: A negative weight, a weight tensor with several elements, or an
            integer too large for a float.
    """
    import torch

    tensor = torch.Tensor
    host_weight: float | None = None
    if isinstance(weight, tensor):
        if weight.numel() != 1:
            raise ValueError(f"weight must be one number, got a tensor of {weight.numel()}")
        if weight.is_cpu:
            host_weight = float(weight.item())
    elif isinstance(weight, numbers.Real) and not isinstance(weight, bool):
        if weight < 0:
            raise ValueError(f"weight must be >= 0, got {weight}")
        try:
            host_weight = float(weight)
        except OverflowError:
            raise ValueError("weight is an integer too large for a float") from None
    else:
        raise TypeError(f"weight must be a number or a tensor, got {type(weight).__name__}")
    for name, value in values.items():
        kind = type(value)
        if kind is not tensor and kind is not float and kind is not int:
            if not isinstance(value, tensor | numbers.Real) or isinstance(value, bool):
                raise TypeError(
                    f"metric {name!r} must be a number or a tensor, got {kind.__name__}"
                )
        if kind is int and not -INT_LIMIT < value < INT_LIMIT:
            try:
                float(value)
            except OverflowError:
                raise ValueError(f"metric {name!r} is an integer too large for a float") from None
    return host_weight


def check_reduction(name: str, reduction: object) -> Reduction:
    """``reduction`` if it is one of ``REDUCTIONS``, else a ``ValueError`` naming the metric."""
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"metric {name!r}: unknown reduction {reduction!r}; use one of {', '.join(REDUCTIONS)}"
        )
    return reduction


def _fmin(a: float, b: float) -> float:
    return a if a != a or a <= b else b  # a NaN on either side wins, as with torch.minimum


def _fmax(a: float, b: float) -> float:
    return a if a != a or a >= b else b


def host_number(value: object) -> float | None:
    """``value`` as one float: a number, or a one-element real CPU tensor; else None.

    One element (a loss, a norm) costs one conversion instead of a few torch calls.
    """
    kind = type(value)
    if kind is float or kind is int:
        return float(cast("float", value))
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_cpu and value.numel() == 1 and not value.is_complex():
            return float(value.item())
        return None
    return float(cast("float", value))


@dataclass(slots=True)
class Accumulator:
    """One metric's record for the current interval (floats, or a tensor on ``device``)."""

    reduction: Reduction
    total: float = 0.0
    count: float = 0.0
    nonfinite: float = 0.0
    extreme: float = math.nan  # set by the first observation
    last: float = math.nan
    updates: int = 0
    seen: bool = False  # an element was observed: ``extreme`` holds one
    device: torch.device | None = None
    record: torch.Tensor | None = None  # [total, count, nonfinite, extreme, last] on device

    def add(self, value: object, weight: object) -> None:
        """Fold ``value`` (number or tensor) observed with ``weight`` into the record."""
        import torch

        on_device = (isinstance(value, torch.Tensor) and not value.is_cpu) or (
            isinstance(weight, torch.Tensor) and not weight.is_cpu
        )
        if self.record is not None or on_device:
            self.updates += 1
            self._add_device(value, weight)
            return
        w = float(cast("Any", weight))
        x = host_number(value)
        if x is None:  # a tensor of several elements, or a complex one
            self.updates += 1
            self._add_host_tensor(cast("torch.Tensor", value), w)
            return
        self.add_number(x, w)

    def add_number(self, x: float, w: float) -> None:
        """Fold one host value ``x`` observed with weight ``w`` into a host record."""
        self.updates += 1
        self.count += w
        if not math.isfinite(x):
            self.nonfinite += 1
        if self.reduction == "mean":
            self.total += w * x
        elif self.reduction == "sum":
            self.total += x
        elif self.reduction == "min":
            self.extreme = _fmin(self.extreme, x) if self.seen else x
        elif self.reduction == "max":
            self.extreme = _fmax(self.extreme, x) if self.seen else x
        else:
            self.last = x
        self.seen = True

    def _add_host_tensor(self, value: torch.Tensor, w: float) -> None:
        import torch

        x = value.detach().to(torch.float64)
        n = x.numel()
        self.count += w * n
        if n == 0:
            return
        self.nonfinite += int((~torch.isfinite(x)).sum())
        if self.reduction == "mean":
            self.total += w * float(x.sum())
        elif self.reduction == "sum":
            self.total += float(x.sum())
        elif self.reduction == "min":
            m = float(x.min())
            self.extreme = _fmin(self.extreme, m) if self.seen else m
        elif self.reduction == "max":
            m = float(x.max())
            self.extreme = _fmax(self.extreme, m) if self.seen else m
        else:
            self.last = float(x.mean())
        self.seen = True

    def _add_device(self, value: object, weight: object) -> None:
        import torch

        if self.record is None:
            device = next(
                v.device
                for v in (value, weight)
                if isinstance(v, torch.Tensor) and v.device.type != "cpu"
            )
            start = [self.total, self.count, self.nonfinite, self.extreme, self.last]
            self.device = device
            self.record = torch.tensor(start, dtype=torch.float64).to(device, non_blocking=True)
        rec = self.record
        assert rec is not None
        assert self.device is not None
        x = torch.as_tensor(value).detach().to(self.device, torch.float64, non_blocking=True)
        w: torch.Tensor | float
        w = (
            weight.detach().to(self.device, torch.float64, non_blocking=True)
            if isinstance(weight, torch.Tensor)
            else float(cast("Any", weight))
        )
        n = x.numel()
        rec[_COUNT] += w * n
        if n == 0:
            return
        rec[_NONFINITE] += (~torch.isfinite(x)).sum()
        if self.reduction == "mean":
            rec[_TOTAL] += x.sum() * w
        elif self.reduction == "sum":
            rec[_TOTAL] += x.sum()
        elif self.reduction in ("min", "max"):
            m = x.min() if self.reduction == "min" else x.max()
            if not self.seen:
                rec[_EXTREME] = m
            elif self.reduction == "min":
                rec[_EXTREME] = torch.minimum(rec[_EXTREME], m)
            else:
                rec[_EXTREME] = torch.maximum(rec[_EXTREME], m)
        else:
            rec[_LAST] = x.mean()
        self.seen = True


@dataclass(slots=True)
class Snapshot:
    """The records of one interval, taken at ``sync()`` time.

    Host records are final; device records are being copied to ``pinned`` and
    are usable once ``event`` completed (``wait_event`` in ``fused``).
    """

    reductions: dict[str, Reduction]
    host: dict[str, list[float]]  # name -> [total, count, nonfinite, extreme, last, updates, seen]
    device_names: list[str] = field(default_factory=list)
    device_updates: list[tuple[int, bool]] = field(default_factory=list)
    pinned: torch.Tensor | None = None  # (len(device_names), 5) float64, filling
    event: Any = None  # torch.cuda.Event recorded after the copy

    def records(self) -> dict[str, list[float]]:
        """Every metric's seven numbers; call once the device copy completed."""
        out = dict(self.host)
        if self.pinned is not None:
            rows = self.pinned.tolist()
            for name, row, (updates, seen) in zip(
                self.device_names, rows, self.device_updates, strict=True
            ):
                out[name] = [*row, float(updates), float(seen)]
        return out


def take_snapshot(accumulators: Mapping[str, Accumulator]) -> Snapshot:
    """Capture ``accumulators`` now; GPU records start copying to pinned memory (no wait)."""
    snap = Snapshot({k: a.reduction for k, a in accumulators.items()}, {})
    device_accs = []
    for name, acc in accumulators.items():
        if acc.record is None:
            snap.host[name] = [
                *(acc.total, acc.count, acc.nonfinite, acc.extreme, acc.last),
                *(float(acc.updates), float(acc.seen)),
            ]
        else:
            device_accs.append((name, acc))
    if device_accs:
        import torch

        by_device: dict[torch.device, list[tuple[str, Accumulator]]] = {}
        for name, acc in device_accs:
            assert acc.device is not None
            by_device.setdefault(acc.device, []).append((name, acc))
        stacks = [
            torch.stack([cast("torch.Tensor", a.record) for _, a in group])
            for group in by_device.values()
        ]
        pinned = torch.empty((len(device_accs), 5), dtype=torch.float64, pin_memory=True)
        row = 0
        for stack, group in zip(stacks, by_device.values(), strict=True):
            pinned[row : row + len(group)].copy_(stack, non_blocking=True)
            row += len(group)
            snap.device_names.extend(name for name, _ in group)
            snap.device_updates.extend((a.updates, a.seen) for _, a in group)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        snap.pinned, snap.event = pinned, event
    return snap


@dataclass(frozen=True, slots=True)
class Layout:
    """Where each metric of an agreed key set lives in the fused buffer."""

    schema: tuple[tuple[str, Reduction], ...]  # sorted by name
    sum_slots: dict[str, int]  # first sum slot: [total]?, count, updates, nonfinite
    max_slots: dict[str, int]
    select_slots: dict[str, int]  # index of the pair among the select pairs
    n_sum: int
    n_max: int  # including the flag slot
    n_select: int
    reductions: dict[str, Reduction]  # the schema as a mapping

    @classmethod
    def of(cls, schema: Sequence[tuple[str, Reduction]]) -> Layout:
        """The layout of ``schema`` (sorted here, so every rank computes the same one)."""
        ordered = tuple(sorted(schema))
        sum_slots: dict[str, int] = {}
        max_slots: dict[str, int] = {}
        select_slots: dict[str, int] = {}
        n_sum, n_max, n_select = 0, 1, 0
        for name, red in ordered:
            sum_slots[name] = n_sum
            n_sum += 4 if red in ("mean", "sum") else 3
            if red in ("min", "max"):
                max_slots[name] = n_max
                n_max += 1
            elif red == "last":
                select_slots[name] = n_select
                n_select += 1
        return cls(
            ordered, sum_slots, max_slots, select_slots, n_sum, n_max, n_select, dict(ordered)
        )

    @property
    def numel(self) -> int:
        """Length of the fused buffer."""
        return self.n_sum + self.n_max + 2 * self.n_select

    def pack(self, records: Mapping[str, Sequence[float]], rank: int) -> array[float]:
        """This rank's fused buffer; the flag slot is 1 when a metric is not in the layout."""
        buf = [0.0] * self.n_sum + [NEG_INF] * self.n_max + [NEG_INF, 0.0] * self.n_select
        reductions = self.reductions
        outside = any(name not in reductions for name in records)
        buf[self.n_sum] = 1.0 if outside else 0.0
        sel = self.n_sum + self.n_max
        for name, rec in records.items():
            red = reductions.get(name)
            if red is None:
                continue
            total, count, nonfinite, extreme, last, updates, seen = rec
            i = self.sum_slots[name]
            if red in ("mean", "sum"):
                buf[i] = total
                i += 1
            buf[i : i + 3] = [count, updates, nonfinite]
            if not seen:  # no element observed (empty tensors): leave the neutral values
                continue
            if red in ("min", "max"):
                buf[self.n_sum + self.max_slots[name]] = -extreme if red == "min" else extreme
            elif red == "last":
                j = sel + 2 * self.select_slots[name]
                buf[j : j + 2] = [float(-rank), last]
        return array("d", buf)

    def flagged(self, vals: Sequence[float]) -> bool:
        """True when some rank had a metric outside this layout (after the reduction)."""
        return vals[self.n_sum] > 0

    def reduce_rows(self, rows: memoryview[float], size: int) -> list[float]:
        """Combine ``size`` packed buffers, stored one after another in ``rows`` (doubles).

        Rows are taken in order, in plain floats: every rank that combines the same
        rows gets bitwise the same values. For a few hundred bytes this beats torch
        calls, whose fixed cost is a few microseconds each.
        """
        n = self.numel
        out = list(rows[0:n])
        for r in range(1, size):
            self.merge(out, rows[r * n : (r + 1) * n].tolist())
        return out

    def merge(self, out: list[float], other: Sequence[float]) -> None:
        """``out = out (+) other`` segment by segment: add, maximum, keep the higher priority."""
        n, s, m = self.numel, self.n_sum, self.n_sum + self.n_max
        for i in range(s):
            out[i] += other[i]
        for i in range(s, m):
            out[i] = _fmax(out[i], other[i])
        for j in range(m, n, 2):
            if other[j] > out[j]:  # the higher priority (lower rank) keeps its value
                out[j] = other[j]
                out[j + 1] = other[j + 1]

    def unpack(self, vals: Sequence[float]) -> dict[str, tuple[float, float, int]]:
        """``name -> (value, count, nonfinite)`` for every metric some rank updated."""
        out: dict[str, tuple[float, float, int]] = {}
        sel = self.n_sum + self.n_max
        for name, red in self.schema:
            i = self.sum_slots[name]
            total = vals[i] if red in ("mean", "sum") else 0.0
            if red in ("mean", "sum"):
                i += 1
            count, updates, nonfinite = vals[i : i + 3]
            if updates == 0:
                continue
            if red == "mean":
                value = total / count if count else math.nan
            elif red == "sum":
                value = total
            elif red in ("min", "max"):
                m = vals[self.n_sum + self.max_slots[name]]
                # Still the neutral -inf with no non-finite input: no rank saw an element.
                value = math.nan if m == NEG_INF and not nonfinite else -m if red == "min" else m
            else:
                j = sel + 2 * self.select_slots[name]
                value = math.nan if vals[j] == NEG_INF else vals[j + 1]
            out[name] = (value, count, int(nonfinite))
        return out


_layouts: dict[tuple[tuple[str, Reduction], ...], Layout] = {}  # the few key sets a job uses


def layout_of(schema: tuple[tuple[str, Reduction], ...]) -> Layout:
    """``Layout.of(schema)`` for a sorted ``schema``, computed once per key set."""
    layout = _layouts.get(schema)
    if layout is None:
        if len(_layouts) > 64:
            _layouts.clear()
        layout = _layouts[schema] = Layout.of(schema)
    return layout


def union_of(
    tables: Sequence[Mapping[str, Reduction]], group: str
) -> tuple[tuple[str, Reduction], ...]:
    """The union of every rank's ``{name: reduction}`` table (in rank order), sorted.

    Raises:
        CollectiveMismatchError: Two ranks reduce one metric differently.
    """
    union: dict[str, tuple[Reduction, int]] = {}
    for r, table in enumerate(tables):
        for name, red in table.items():
            have = union.setdefault(name, (red, r))
            if have[0] != red:
                raise CollectiveMismatchError(
                    f"ranks reduce metric {name!r} differently (rank {have[1]}: "
                    f"{have[0]!r}, rank {r}: {red!r}) in group {group!r}; give every "
                    "rank the same reductions",
                    field="reduction",
                    values_by_rank={have[1]: have[0], r: red},
                )
    return tuple(sorted((name, red) for name, (red, _) in union.items()))
