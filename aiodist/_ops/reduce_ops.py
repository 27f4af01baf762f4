"""Reduce ops: their names, which dtypes each suits, and the in-place kernels.

Shared by the data plane's reductions, the torch bridge's checks and the
reductions of many tensors at once, so a name or a dtype is judged the same
way everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from aiodist._ops.common import SLICE_NUMEL, LazyModule

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

__all__ = ["ALIASES", "OPS", "check_op_dtype", "combine", "reduce_op"]

OPS: Final = ("sum", "mean", "product", "min", "max", "band", "bor", "bxor")
ALIASES: Final = {"prod": "product", "avg": "mean", "average": "mean"}


def reduce_op(op: object) -> str:
    """The canonical name of ``op``: a string (any case, aliases too) or torch's ``ReduceOp``.

    Raises:
        TypeError: ``op`` is neither.
        ValueError: Not a reduce op aiodist knows.
    """
    name = op if isinstance(op, str) else getattr(op, "name", None)
    if name is None and op is not None and type(op).__name__ in ("ReduceOp", "RedOpType"):
        name = str(op)
    if not isinstance(name, str):
        raise TypeError(f"op must be a string such as 'sum', got {type(op).__name__}")
    key = name.rsplit(".", 1)[-1].lower()
    key = ALIASES.get(key, key)
    if key not in OPS:
        raise ValueError(f"unsupported reduce op {op!r}; use one of {', '.join(OPS)}")
    return key


def check_op_dtype(op: str, dtype: torch.dtype) -> None:
    """Raise ``TypeError`` if reduce op ``op`` (canonical) does not suit ``dtype``."""
    if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"op 'mean' needs a floating-point tensor, got {dtype}")
    if op in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"op {op!r} needs an integer or bool tensor, got {dtype}")


def _kernel(op: str, out: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> None:
    if out.dtype == torch.bool and op in ("sum", "mean", "max"):
        torch.logical_or(first, second, out=out)
    elif out.dtype == torch.bool and op in ("product", "min"):
        torch.logical_and(first, second, out=out)
    elif op in ("sum", "mean"):
        torch.add(first, second, out=out)
    elif op == "product":
        torch.mul(first, second, out=out)
    elif op == "min":
        torch.minimum(first, second, out=out)
    elif op == "max":
        torch.maximum(first, second, out=out)
    elif op == "band":
        torch.bitwise_and(first, second, out=out)
    elif op == "bor":
        torch.bitwise_or(first, second, out=out)
    else:
        torch.bitwise_xor(first, second, out=out)


def combine(op: str, out: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> None:
    """``out = first <op> second`` with torch kernels; ``out`` may alias either input.

    Large tensors go through in slices of ``SLICE_NUMEL`` elements, each below
    torch's parallel grain, so that no rank wakes its intra-op thread pool.
    """
    n = out.numel()
    if n <= SLICE_NUMEL:
        _kernel(op, out, first, second)
        return
    o, a, b = out.view(-1), first.reshape(-1), second.reshape(-1)
    for start in range(0, n, SLICE_NUMEL):
        stop = start + SLICE_NUMEL
        _kernel(op, o[start:stop], a[start:stop], b[start:stop])
