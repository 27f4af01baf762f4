"""Reduce ops: their names, which dtypes each suits, and the in-place kernels.

Shared by the data plane's reductions, the torch bridge's checks and the
reductions of many tensors at once, so a name or a dtype is judged the same
way everywhere.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import ArgumentError, ArgumentTypeError
from aiodist._ops.tensors import SLICE_NUMEL, LazyModule

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
else:
    torch = LazyModule("torch")

#: Each reduce op, and the torch function that computes it (on bool tensors, ``kernel`` says).
_TORCH_NAMES: Final = {
    "sum": "add",
    "mean": "add",
    "product": "mul",
    "min": "minimum",
    "max": "maximum",
    "band": "bitwise_and",
    "bor": "bitwise_or",
    "bxor": "bitwise_xor",
}
OPS: Final = tuple(_TORCH_NAMES)
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
            kernel(op, dtype)(a, a, out=a)
            if op == "mean" and not (dtype.is_floating_point or dtype.is_complex):
                torch.true_divide(a, 2)
            known = True
        except (NotImplementedError, RuntimeError, TypeError):
            known = False
        _computable_cache[key] = known
    return known


_checked: dict[tuple[object, object], str] = {}


def reduction(op: object, dtype: torch.dtype, call: str) -> str:
    """``reduce_op(op)``, checked against ``dtype`` (``check_op_dtype``) for ``call``.

    Runs on every reduction's call, so what passed is remembered (for ops given
    as strings, ``ReduceOp`` included): the next call with them is one lookup.
    """
    named = isinstance(op, str)
    if named:
        known = _checked.get((op, dtype))
        if known is not None:
            return known
    name = reduce_op(op)
    check_op_dtype(name, dtype, call)
    if named:
        _checked[(op, dtype)] = name
    return name


_kernels: dict[tuple[str, object], Callable[..., Any]] = {}


def kernel(op: str, dtype: torch.dtype) -> Callable[..., Any]:
    """torch's function for ``op`` (canonical) on ``dtype``: ``fn(first, second, out=out)``.

    On bool tensors ``sum``/``mean``/``max`` are logical or, ``product``/``min``
    logical and. Looked up once per op and dtype: the small reductions call it
    directly, once per part.
    """
    known = _kernels.get((op, dtype))
    if known is not None:
        return known
    if dtype == torch.bool and op in ("sum", "mean", "max"):
        name = "logical_or"
    elif dtype == torch.bool and op in ("product", "min"):
        name = "logical_and"
    else:
        name = _TORCH_NAMES[op]
    fn: Callable[..., Any] = getattr(torch, name)
    _kernels[(op, dtype)] = fn
    return fn


def combine(op: str, out: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> None:
    """``out = first <op> second`` with torch kernels; ``out`` may alias either input.

    Large tensors go through in slices of ``SLICE_NUMEL`` elements, each below
    torch's parallel grain, so that no rank wakes its intra-op thread pool.
    """
    fn = kernel(op, out.dtype)
    n = out.numel()
    if n <= SLICE_NUMEL:
        fn(first, second, out=out)
        return
    o, a, b = out.view(-1), first.reshape(-1), second.reshape(-1)
    for start in range(0, n, SLICE_NUMEL):
        stop = start + SLICE_NUMEL
        fn(a[start:stop], b[start:stop], out=o[start:stop])
