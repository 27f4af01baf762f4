"""What every collective shares: group resolution, its place in the order, checks, tensors."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, TypeVar

from aiodist._errors import (
    ArgumentError,
    ArgumentTypeError,
)
from aiodist._group.world import get_default_group
from aiodist._ops import staging
from aiodist._wire.codec import byte_view

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work

__all__ = [
    "SLICE_NUMEL",
    "LazyModule",
    "Slot",
    "bridged",
    "chain",
    "check_alike",
    "check_rank",
    "check_tensor",
    "check_tensor_list",
    "contiguous",
    "copy_into",
    "divide_",
    "outside",
    "resolve_group",
    "root_of",
]

T = TypeVar("T")
R = TypeVar("R")

logger = logging.getLogger(__name__)

#: Elements per torch call on large tensors: torch's GRAIN_SIZE, below which it stays serial.
#: Every rank of a host has its own intra-op thread pool, and when several ranks wake
#: theirs at once they spin against each other (a 256 KiB add took 28 ms with 4 ranks on
#: 2 cores), so the data plane keeps its copies and reductions on the loop's thread.
SLICE_NUMEL = 32768


class LazyModule:
    """Imports a module on first attribute access (keeps ``import aiodist`` torch-free)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        # Only called for names not cached yet: after the first use of ``torch.add``
        # it is a plain instance attribute (an import per call cost ~10 us on hot paths).
        import importlib

        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)
        return value


def resolve_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """``group``, else the default group, else None (not initialised: world size 1)."""
    if group is not None:
        return group
    return get_default_group()


class Slot:
    """A call's place in its group's order, taken first; an error before the op starts aborts it.

    ``with Slot(g, "all_gather_object") as seq:`` takes the next sequence number
    (``ProcessGroup.take_seq``; 0 when ``g`` is None, not initialised), then runs
    the call's checks and encoding. If they raise, the call is aborted on every
    member (``ProcessGroup.abort``) and the error goes on to the caller: a call
    that fails on one rank neither leaves the others waiting nor hands its
    number to this rank's next call. Start the operation with ``seq`` after the
    block. With ``torch`` (the call may issue collectives to torch.distributed,
    which cannot leave out one rank's part), a failure breaks the group instead.
    """

    __slots__ = ("description", "g", "seq", "torch")

    def __init__(self, g: ProcessGroup | None, description: str, *, torch: bool = False) -> None:
        self.g = g
        self.description = description
        self.torch = torch
        # A process outside ``g`` takes no place: torch.distributed skips the call there.
        self.seq = 0 if g is None or g.rank < 0 else g.take_seq()

    def __enter__(self) -> int:
        return self.seq

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and self.g is not None and self.seq:
            self.g.abort(self.seq, self.description, exc, torch=self.torch)


def outside(g: ProcessGroup | None) -> bool:
    """True on a process that is not a member of ``g``.

    There, as in torch.distributed, a collective does nothing: it returns at
    once with its tensors untouched (torch warns; aiodist logs at debug level).
    """
    if g is None or g.rank >= 0:
        return False
    logger.debug("skipping a collective of %r on a process outside it", g)
    return True


def chain(work: Work[T], fn: Callable[[T], R], description: str | None = None) -> Work[R]:
    """A handle that resolves to ``fn(result of work)`` once ``work`` is done (on its loop).

    Takes no place in any order: for calls whose one operation is ``work``
    (a torch-form call that copies a result into the caller's tensors).
    """
    from aiodist._group.work import Work

    name = description or work.description
    if work.is_completed():
        try:
            return Work.completed(fn(work.result()), name)
        except Exception as exc:
            return Work.failed(exc, name)
    loop = work.loop
    assert loop is not None
    out: Work[R] = Work.pending(loop, name)

    def done(w: Work[T]) -> None:
        try:
            value = fn(w.result())
        except BaseException as exc:
            out.set_exception(exc)
        else:
            out.set_result(value)

    work.when_done(done)
    return out


def root_of(g: ProcessGroup | None, root: object, group_root: object, name: str) -> int:
    """The group rank that ``name`` (a global rank) or ``group_name`` (a group rank) names.

    torch.distributed's convention: ``src``/``dst`` are global ranks, and
    ``group_src``/``group_dst`` the same rank counted within the group; one of them.

    Raises:
        ValueError: Neither or both given, or not a member of ``g``.
        TypeError: Not an int.
    """
    size = 1 if g is None else g.world_size
    if root is not None and group_root is not None:
        raise ArgumentError(f"Can not specify both {name} and group_{name}")
    if group_root is not None:
        if not isinstance(group_root, int) or isinstance(group_root, bool):
            raise ArgumentTypeError(
                f"group_{name} must be an int rank, got {type(group_root).__name__}"
            )
        if not 0 <= group_root < size:
            raise ArgumentError(f"group_{name}={group_root} is not a rank of a group of {size}")
        return group_root
    if root is None:
        raise ArgumentError(f"Must specify {name} or group_{name}")
    if g is None:
        if not isinstance(root, int) or isinstance(root, bool):
            raise ArgumentTypeError(f"{name} must be an int rank, got {type(root).__name__}")
        if root != 0:
            raise ArgumentError(f"{name} must be 0 when not initialised (world size 1), got {root}")
        return 0
    return g.group_rank_of(root, name)


def bridged(group: ProcessGroup | None, name: str, *args: Any) -> Work[Any] | None:
    """Start collective ``name`` on torch.distributed, or return None for the data plane.

    It goes to torch when ``group`` is bridged (``ProcessGroup.bridge``) and its
    tensors live on the bridge's device. ``args`` are the collective's
    arguments but ``group``.
    """
    g = resolve_group(group)
    if g is None or g.bridge is None:
        return None
    first = args[0]
    if isinstance(first, list | tuple):  # reduce_scatter, all_to_all: a list of tensors
        first = first[0] if first else None
    if not g.bridge.crosses(first):
        return None
    return g.bridge.start_collective(name, args)


def check_tensor(tensor: object, name: str = "tensor") -> torch.Tensor:
    """Return ``tensor`` if the data plane can carry it, else raise ``TypeError``/``ValueError``.

    CPU tensors travel as they are; CUDA tensors are staged through host
    memory (``staging``). A sparse tensor is refused.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(
            f"Invalid function argument: {name} must be a torch.Tensor, got {type(tensor).__name__}"
        )
    if not tensor.is_cpu and not staging.on_device(tensor):
        raise ArgumentError(
            f"{name} is on {tensor.device}; aiodist's data plane carries CPU and CUDA tensors"
        )
    if tensor.layout != torch.strided:
        raise ArgumentError(f"{name} must be a dense (strided) tensor, got {tensor.layout}")
    return tensor


def check_rank(g: ProcessGroup, rank: object, name: str) -> int:
    """The group rank of global ``rank`` (torch's convention), else ``TypeError``/``ValueError``."""
    return g.group_rank_of(rank, name)


def check_tensor_list(tensors: object, name: str, length: int | None) -> list[torch.Tensor]:
    """Check ``tensors`` is a list of tensors (of ``length``, unless None)."""
    if not isinstance(tensors, (list, tuple)):
        raise ArgumentTypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    out = [check_tensor(t, f"{name}[{i}]") for i, t in enumerate(tensors)]
    if length is not None and len(out) != length:
        raise ArgumentError(f"{name} must hold one tensor per rank ({length}), got {len(out)}")
    return out


def check_alike(tensors: list[torch.Tensor], name: str) -> None:
    """Raise ``ValueError`` unless every tensor has the dtype and shape of the first."""
    first = tensors[0]
    for i, x in enumerate(tensors):
        if x.dtype != first.dtype or x.shape != first.shape:
            raise ArgumentError(f"{name}[{i}] differs from {name}[0] in dtype or shape")


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if contiguous, else a contiguous copy."""
    return t if t.is_contiguous() else t.contiguous()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` on this thread: one memcpy when both are contiguous and alike."""
    if (
        dst.dtype == src.dtype
        and dst.numel() == src.numel()
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        if dst.numel():
            byte_view(dst)[:] = byte_view(src)
        return
    dst.copy_(src)


def divide_(t: torch.Tensor, divisor: int) -> None:
    """``t /= divisor`` in slices below torch's parallel grain (see ``SLICE_NUMEL``).

    Floating tensors are divided in place; integer and bool ones get
    ``true_divide``'s result copied back (truncated), as mmengine's ``op='mean'`` does.
    """
    if t.numel() <= SLICE_NUMEL or not t.is_contiguous():
        _divide(t, divisor)
        return
    flat = t.view(-1)
    for start in range(0, flat.numel(), SLICE_NUMEL):
        _divide(flat[start : start + SLICE_NUMEL], divisor)


def _divide(t: torch.Tensor, divisor: int) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.div_(divisor)
    else:
        import torch

        t.copy_(torch.true_divide(t, divisor))
