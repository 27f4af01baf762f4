"""PNG plots for the benchmark report: bus bandwidth against message size, aiodist vs gloo.

One figure per world size, one panel per tensor collective, both axes
logarithmic; each point is the median over repeats and its error bar spans
the bandwidths of the slowest and the fastest repeat. matplotlib (the
``bench`` extra) is imported here only, with the Agg backend: no display.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from benchmarks._collective_ranks import SYSTEMS, TENSOR_OPS, bus_factor
from benchmarks._common import as_summary

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["busbw_points", "have_matplotlib", "plot_busbw"]

COLORS: Final = {"aiodist": "tab:blue", "gloo": "tab:orange"}
_SIZE_TICKS: Final = (4, 256, 16 * 1024, 1024**2, 64 * 1024**2)
_SIZE_LABELS: Final = ("4 B", "256 B", "16 KiB", "1 MiB", "64 MiB")


def have_matplotlib() -> bool:
    """Whether the plots can be drawn (``pip install -e '.[bench]'``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def busbw_points(
    results: list[dict[str, Any]], n: int, op: str, system: str
) -> list[tuple[int, float, float, float]]:
    """``(bytes, median, low, high)`` bus bandwidths in GB/s for one curve, by size."""
    factor = bus_factor(op, n)
    assert factor is not None, op
    points = []
    for row in results:
        res = row.get(system, {})
        summary = as_summary(res.get("summary_s"))
        if row["world_size"] != n or row["op"] != op or summary is None:
            continue
        gbps = row["nbytes"] * factor / 1e9
        points.append(
            (row["nbytes"], gbps / summary.median, gbps / summary.max, gbps / summary.min)
        )
    return sorted(points)


def plot_busbw(data: dict[str, Any], out: Path) -> list[Path]:
    """Draw ``busbw_ws{N}.png`` for every world size of a collectives run; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    results = data["results"]
    for n in data["config"]["world_sizes"]:
        fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
        for ax, op in zip(axes.flat, TENSOR_OPS, strict=True):
            for system in SYSTEMS:
                points = busbw_points(results, n, op, system)
                if not points:
                    continue
                sizes = [p[0] for p in points]
                mid = [p[1] for p in points]
                err = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
                ax.errorbar(
                    sizes,
                    mid,
                    yerr=err,
                    marker="o",
                    markersize=4,
                    capsize=3,
                    color=COLORS[system],
                    label="torch.distributed gloo" if system == "gloo" else "aiodist",
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(_SIZE_TICKS, _SIZE_LABELS)
            ax.set_title(op)
            ax.set_ylabel("bus bandwidth (GB/s)")
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(loc="upper left", fontsize="small")
        for ax in axes[1]:
            ax.set_xlabel("message size")
        fig.suptitle(
            f"Bus bandwidth vs message size, world size {n}, one host "
            "(median, bars: min-max over repeats)"
        )
        fig.tight_layout()
        path = out / f"busbw_ws{n}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths
