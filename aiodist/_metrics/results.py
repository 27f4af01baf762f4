"""What a metric sync resolves to, and a JSON-lines / CSV writer for rank 0."""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

from aiodist._group.world import get_rank

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Iterator
    from types import TracebackType

    from aiodist._group.work import Work

logger = logging.getLogger(__name__)


class MetricResults(Mapping[str, float]):
    """The global value of every metric some rank updated since the previous sync.

    A read-only mapping of metric name to float, sorted by name. ``counts``
    holds each metric's total weight over all ranks (``weight * numel`` summed
    over its updates), ``nonfinite`` how many NaN or infinite elements went
    into it (the value then is NaN or infinite too: nothing is dropped).

    Example:
        >>> results = await agg.sync()
        >>> results["loss"], results.counts["loss"]
        >>> print(results.summary())
    """

    __slots__ = ("_values", "counts", "nonfinite", "reductions")

    def __init__(
        self,
        reduced: Mapping[str, tuple[float, float, int]],
        reductions: Mapping[str, str] | None = None,
    ) -> None:
        names = sorted(reduced)
        self._values: dict[str, float] = {k: reduced[k][0] for k in names}
        self.counts: dict[str, float] = {k: reduced[k][1] for k in names}
        self.nonfinite: dict[str, int] = {k: reduced[k][2] for k in names if reduced[k][2]}
        given = reductions or {}
        self.reductions: dict[str, str] = {k: given[k] for k in names if k in given}

    def __getitem__(self, name: str) -> float:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"MetricResults({self._values!r})"

    def to_dict(self) -> dict[str, float]:
        """The values as a plain ``{name: float}`` dict (for loggers such as TensorBoard)."""
        return dict(self._values)

    def summary(self, digits: int = 4, prefix: str = "") -> str:
        """One line for humans: ``loss=0.2315 acc=0.9102 [non-finite: loss x3]``.

        Args:
            digits: Significant digits per value.
            prefix: Put in front (``"step 100 | "``, say).
        """
        parts = [f"{k}={v:.{digits}g}" for k, v in self._values.items()]
        line = prefix + " ".join(parts)
        if self.nonfinite:
            bad = ", ".join(f"{k} x{n}" for k, n in self.nonfinite.items())
            line += f" [non-finite: {bad}]"
        return line


Format = Literal["jsonl", "csv"]


class MetricsWriter:
    """Append each sync's results to a JSON-lines or CSV file, on rank 0 only.

    On other ranks ``write`` does nothing and no file is opened. JSON lines
    hold ``{**extra, **values}`` per line (NaN and infinities as Python's json
    writes them: ``NaN``, ``Infinity``), plus ``"nonfinite"`` when a value
    took in NaN or infinite elements. A CSV file takes its columns from the
    first row; a later row with a metric outside them raises ``ValueError``
    before anything is written (use JSON lines, or name every column with
    ``fields``).

    Args:
        path: The file (appended to; created with its parents).
        format: ``"jsonl"`` or ``"csv"``; by default from the suffix (``.csv``
            is CSV, anything else JSON lines).
        rank: Write when this is 0; defaults to ``aiodist.get_rank()``.
        fields: CSV columns, in order (default: the first row's, extras first).

    Example:
        >>> with MetricsWriter("logs/metrics.jsonl") as out:
        ...     agg.sync(on_done=lambda r: out.write(r, step=step))
    """

    def __init__(
        self,
        path: str | Path,
        format: Format | None = None,
        *,
        rank: int | None = None,
        fields: list[str] | None = None,
    ) -> None:
        self.path = Path(path)
        fmt = format or ("csv" if self.path.suffix.lower() == ".csv" else "jsonl")
        if fmt not in ("jsonl", "csv"):
            raise ValueError(f"format must be 'jsonl' or 'csv', got {format!r}")
        self.format: Format = fmt
        if rank is None:
            rank = get_rank()
        self.enabled = rank == 0
        self._fields = list(fields) if fields is not None else None
        self._file: IO[str] | None = None
        self._csv: csv.DictWriter[str] | None = None

    def write(self, results: Mapping[str, float], **extra: Any) -> None:
        """Append one row: ``extra`` (``step=...``) then the metric values."""
        if not self.enabled:
            return
        row: dict[str, Any] = {**extra, **results}
        if self.format == "jsonl":
            nonfinite = getattr(results, "nonfinite", None)
            if nonfinite:
                row["nonfinite"] = dict(nonfinite)
            self._open().write(json.dumps(row) + "\n")
        else:
            self._write_csv(row)
        assert self._file is not None
        self._file.flush()

    def _write_csv(self, row: dict[str, Any]) -> None:
        if self._fields is None:
            self._fields = list(row)
        unknown = [k for k in row if k not in self._fields]
        if unknown:
            raise ValueError(
                f"{self.path}: metrics {unknown} are not columns of this CSV file "
                f"({self._fields}); pass fields= with every column, or write JSON lines"
            )
        if self._csv is None:
            f = self._open()
            self._csv = csv.DictWriter(f, fieldnames=self._fields, restval="")
            if f.tell() == 0:
                self._csv.writeheader()
        self._csv.writerow({k: _csv_value(v) for k, v in row.items()})

    def _open(self) -> IO[str]:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8", newline="")
        return self._file

    def close(self) -> None:
        """Close the file (a no-op when nothing was written)."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._csv = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _csv_value(v: object) -> object:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # nan, inf, -inf: what float() reads back
    return v


def deliver_when_done(
    work: Work[MetricResults],
    on_done: Callable[[MetricResults], object],
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Call ``on_done`` with the sync's results on ``loop`` (see ``deliver``)."""
    # A loop turn after the sync finished, even when it is done already: callbacks
    # run on the loop's thread, in call order.
    work.when_done(lambda w: loop.call_soon(deliver, w, on_done))


def deliver(work: Work[MetricResults], on_done: Callable[[MetricResults], object]) -> None:
    """Call ``on_done`` with a finished sync's results; log its error, or the callback's."""
    if work.exception() is not None:
        logger.warning("metrics sync failed: %s", work.exception())
        return
    try:
        on_done(work.result())
    except Exception:
        logger.exception("the on_done callback of a metrics sync raised")
