"""Agreeing on a bridged collective's signature over aiodist's own data plane first.

torch's gloo and NCCL trust every rank to call the same collective with the
same tensors: an extra ``all_reduce`` on one rank hangs the group until its
timeout, and a shape mismatch can abort the process (gloo's SIGABRT) with
nothing said on the other ranks. torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
checks each call's signature before issuing it. aiodist can do the same over
its own data plane, which fails a mismatch cleanly on every rank
(``CollectiveMismatchError``, the group broken), before anything reaches torch.

With ``AIODIST_CHECK_SIGNATURES=1`` (or torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``),
each bridged collective first meets its peers with its signature (op, dtype,
shape, reduction, root), as aiodist's own barrier meets them, then goes to
torch in call order. The cost is one small exchange among the group's ranks
per call (``docs/guide/gpus.md`` has the measured figure).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from aiodist import _settings
from aiodist._ops.agreement import signature
from aiodist._ops.exchange import Exchange
from aiodist._ops.movement import meet

if TYPE_CHECKING:
    from collections.abc import Mapping

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._ops.agreement import Signature
    from aiodist._ops.requests import Request


def checking(environ: Mapping[str, str] | None = None) -> bool:
    """True if bridged collectives agree on their signature first (the module docstring)."""
    env = os.environ if environ is None else environ
    if _settings.CHECK_SIGNATURES.read(env):
        return True
    return env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


def signature_of(request: Request) -> Signature:
    """What every rank of a bridged call must agree on."""
    first: Any = request.first
    if isinstance(first, list | tuple):
        first = first[0] if first else None
    return signature(request.op.label, first, reduce_op=request.reduce_op, root=request.root)


async def agree(g: ProcessGroup, work: Work[Any], seq: int, mine: Signature) -> None:
    """Meet every member of ``g`` with ``mine`` as operation ``seq``; a mismatch fails ``work``.

    Raises:
        CollectiveMismatchError: A member called another collective, or with other
            tensors (``work`` fails and ``g`` breaks on every member).
    """
    async with Exchange(g, work, seq, mine, rides=True) as ex:
        await meet(ex, None, request_name(mine))


def request_name(mine: Signature) -> str:
    return f"{mine[0]} (signature check)"
