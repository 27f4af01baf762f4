"""Comparing what the original and aiodist returned or raised, case by case (test_dropin.py).

A case's record (see ``dropin_worker.py``) is a result or an error. They agree
when both results are equal (floating values of half precision within its
rounding), or when both raised and aiodist's exception is an instance of the
class the original raised. Where the original refuses something only because
gloo cannot do it (a dtype gloo has no kernel for, ``ReduceOp.AVG`` on integers),
aiodist does it: such a case is *extended*, not compared.
"""

from __future__ import annotations

import math
from typing import Any

#: What gloo says when only gloo is at fault: aiodist carries these cases.
GLOO_LIMITS = (
    "Invalid scalar type",  # int16, uint16/32/64 and float8 tensors
    "can't be cast to the desired output type",  # ReduceOp.AVG on integers (aiodist: truncates)
)

__all__ = ["GLOO_LIMITS", "agree", "dtype_of", "function_of"]


def _is_error(record: Any) -> bool:
    return isinstance(record, dict) and "error" in record


def _close(a: Any, b: Any, loose: bool) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return True
        return a == b or (loose and math.isclose(a, b, rel_tol=1e-2, abs_tol=1e-2))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y, loose) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return False
        inner = loose or a.get("tensor") in ("float16", "bfloat16")
        return all(_close(a[k], b[k], inner) for k in a)
    return bool(a == b)


def agree(original: Any, ours: Any) -> str:
    """``"equal"``, ``"same error"``, ``"extended"`` or ``"both refuse"`` when they agree.

    Anything else says why they do not.
    """
    if _is_error(original):
        if any(limit in original["message"] for limit in GLOO_LIMITS):
            # Only gloo refuses: aiodist carries it, or refuses too where torch has no
            # CPU kernel (sum of uint16, say).
            return "both refuse" if _is_error(ours) else "extended"
        if not _is_error(ours):
            raised = f"{original['error'][0]} ({original['message']})"
            return f"the original raised {raised}, aiodist returned"
        if original["error"][0] not in ours["error"]:
            return (
                f"the original raised {original['error'][0]} ({original['message']}), aiodist "
                f"{ours['error'][0]} ({ours['message']}), which is not one"
            )
        return "same error"
    if _is_error(ours):
        return f"aiodist raised {ours['error'][0]}: {ours['message']}"
    if not _close(original, ours, False):
        return f"results differ: {original!r} != {ours!r}"
    return "equal"


def function_of(case: str) -> str:
    """The function a case calls: ``"all_reduce/SUM/float32"`` -> ``"all_reduce"``."""
    return case.split("/", 1)[0]


def dtype_of(case: str) -> str | None:
    """The dtype a case runs on, if it names one."""
    last = case.rsplit("/", 1)[-1]
    known = ("float", "int", "uint", "bool", "complex", "bfloat")
    return last if last.startswith(known) else None
