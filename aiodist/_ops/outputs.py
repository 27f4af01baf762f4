"""Output tensors of large collectives, reused once the caller dropped them.

``all_gather`` and ``reduce_scatter`` return new tensors, as mmengine's do.
Fresh memory costs more than the gather itself on a busy host: the kernel
faults in and zeroes every page (for a 64 MiB gather on 4 ranks, a quarter of
a million pages on the host per call). So each group keeps the tensors of its
last large call of each operation, and the next call of the same dtype and
shape writes into them again if, by then, nothing outside this module refers
to their memory any more (no tensor, view, numpy array or storage of the
caller's): the storage's reference count says so exactly. Otherwise it
allocates new ones. The tensors handed out share the kept storages but are
plain tensors, not views.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import torch

    from aiodist._group.group import ProcessGroup

#: Gathers whose output is smaller than this allocate every time (faults matter little).
MIN_KEPT_BYTES: Final = 1 << 20


class _Kept:
    """One group's last set of output tensors, and the reference count of an unused one."""

    __slots__ = ("idle_count", "key", "tensors")

    def __init__(self, key: tuple[object, ...], tensors: list[torch.Tensor]) -> None:
        self.key = key
        self.tensors = tensors
        self.idle_count = _use_count(tensors[0])


def _use_count(t: torch.Tensor) -> int:
    import torch

    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


def _share(t: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, t.shape, t.stride())


def new_outputs(
    g: ProcessGroup, like: torch.Tensor, count: int, operation: str
) -> list[torch.Tensor]:
    """``count`` contiguous tensors shaped like ``like`` whose memory nobody else uses."""
    import torch

    nbytes = like.numel() * like.element_size() * count
    if nbytes < MIN_KEPT_BYTES:
        return [torch.empty_like(like, memory_format=torch.contiguous_format) for _ in range(count)]
    key = (like.dtype, tuple(like.shape), count)
    by_operation = g.kept_outputs  # operation -> its _Kept
    kept: _Kept | None = by_operation.get(operation)
    if (
        kept is None
        or kept.key != key
        or any(_use_count(t) != kept.idle_count for t in kept.tensors)
    ):
        tensors = [
            torch.empty_like(like, memory_format=torch.contiguous_format) for _ in range(count)
        ]
        kept = by_operation[operation] = _Kept(key, tensors)
    return [_share(t) for t in kept.tensors]
