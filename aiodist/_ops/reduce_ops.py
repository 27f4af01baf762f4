"""Reduce ops: their names, which dtypes each suits, and the in-place kernels.

Shared by the data plane's reductions, the torch bridge's checks and the
reductions of many tensors at once, so a name or a dtype is judged the same
way everywhere.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Final

from aiodist._errors import ArgumentError, ArgumentTypeError
from aiodist._ops.tensors import SLICE_NUMEL, LazyModule

if TYPE_CHECKING:
    import torch
else:
    torch = LazyModule("torch")

__all__ = [
    "ALIASES",
    "OPS",
    "ReduceOp",
    "check_op_dtype",
    "combine",
    "reduce_op",
    "supports_complex",
]

OPS: Final = ("sum", "mean", "product", "min", "max", "band", "bor", "bxor")
ALIASES: Final = {"prod": "product", "avg": "mean", "average": "mean"}
# torch.distributed refuses these on complex tensors (``supports_complex``).
_NOT_COMPLEX: Final = ("product", "min", "max", "band", "bor", "bxor")


class ReduceOp(enum.StrEnum):
    """The reduce ops, under torch.distributed's names (``ReduceOp.SUM``, ``ReduceOp.AVG``).

    Members are strings, so mmengine-style code that passes or compares
    ``"sum"``/``"mean"`` works with them too (``ReduceOp.AVG == "mean"``).
    Every operation also accepts torch's own ``torch.distributed.ReduceOp``.
    """

    SUM = "sum"
    AVG = "mean"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


def supports_complex(reduceOp: object) -> bool:
    """True if ``reduceOp`` may reduce complex tensors, as torch.distributed decides."""
    return reduce_op(reduceOp) not in _NOT_COMPLEX


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
        raise ArgumentError(f"unsupported reduce op {op!r}; use one of {', '.join(OPS)}")
    return key


def check_op_dtype(op: str, dtype: torch.dtype, call: str = "all_reduce") -> None:
    """Raise as torch.distributed does if reduce op ``op`` (canonical) does not suit ``dtype``.

    ``mean`` suits every dtype: on integers it is mmengine's (sum, true divide,
    copy back, so truncated), on bool a logical or.

    Raises:
        ArgumentTypeError: A bitwise op on a floating-point or complex tensor.
        ArgumentError: An op torch refuses on complex tensors (``supports_complex``).
    """
    if dtype.is_complex and op in _NOT_COMPLEX:
        # torch's words first ("all_reduce does not support ... on complex tensors"),
        # so that code written against torch's message still matches.
        raise ArgumentError(
            f"{call} does not support {op} on complex tensors: op {op!r} has no order "
            f"on complex numbers (got {dtype})"
        )
    if op in ("band", "bor", "bxor") and dtype.is_floating_point:
        raise ArgumentTypeError(f"op {op!r} needs an integer or bool tensor, got {dtype}")
    if not _computable(op, dtype):
        raise ArgumentTypeError(
            f"op {op!r} cannot reduce {dtype} tensors: torch has no CPU kernel for it"
        )


_computable_cache: dict[tuple[str, object], bool] = {}


def _computable(op: str, dtype: torch.dtype) -> bool:
    """Whether torch's CPU kernels compute ``op`` on ``dtype`` (unsigned 16-64 bit ints
    and float8 lack most): tried once on one element, then remembered."""
    key = (op, dtype)
    known = _computable_cache.get(key)
    if known is None:
        a = torch.ones(1, dtype=dtype)
        try:
            _kernel(op, a, a, a)
            if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
                torch.true_divide(a, 2)
            known = True
        except (NotImplementedError, RuntimeError, TypeError):
            known = False
        _computable_cache[key] = known
    return known


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
