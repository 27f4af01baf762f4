"""Tensors on the data plane: what may travel, and the copies and divisions on the loop's thread.

``import aiodist`` stays torch-free: torch is imported on first use here
(``LazyModule``), and these helpers are called only once a call holds tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from aiodist._errors import ArgumentError, ArgumentTypeError
from aiodist._ops import staging
from aiodist._wire.codec import byte_view

if TYPE_CHECKING:
    import torch

#: Elements per torch call on large tensors: torch's GRAIN_SIZE, below which it stays serial.
#: Every rank of a host has its own intra-op thread pool, and when several ranks wake
#: theirs at once they spin against each other (a 256 KiB add took 28 ms with 4 ranks on
#: 2 cores), so the data plane keeps its copies and reductions on the loop's thread.
SLICE_NUMEL: Final = 32768


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


if not TYPE_CHECKING:
    torch = LazyModule("torch")


def check_tensor(tensor: object, name: str = "tensor", *, sparse: bool = False) -> torch.Tensor:
    """Return ``tensor`` if the data plane can carry it, else raise ``TypeError``/``ValueError``.

    CPU tensors travel as they are; CUDA tensors are staged through host
    memory (``staging``). A sparse COO tensor is refused unless ``sparse``
    (all_reduce sums them). A tensor that requires grad
    (a parameter, DDP's bucket under ``create_graph``) comes back detached: its
    data, the same memory, which collectives read and write in place outside
    autograd, as gloo's do.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(
            f"Invalid function argument: {name} must be a torch.Tensor, got {type(tensor).__name__}"
        )
    if not tensor.is_cpu and not staging.on_device(tensor):
        raise ArgumentError(
            f"{name} is on {tensor.device}; aiodist's data plane carries CPU and CUDA tensors"
        )
    if tensor.layout == torch.sparse_coo and sparse:
        return tensor
    if tensor.layout != torch.strided:
        raise ArgumentError(
            f"{name} must be a dense (strided) tensor, got {tensor.layout} (of the "
            "collectives, only all_reduce takes sparse COO tensors: it sums them, as gloo's)"
        )
    return tensor.detach() if tensor.requires_grad else tensor


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


def check_outputs(outs: object, name: str, like: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Check ``outs`` holds ``size`` tensors of ``like``'s dtype and shape (torch's errors)."""
    out = check_tensor_list(outs, name, None)
    if len(out) != size:
        raise ArgumentError(f"{name} must hold one tensor per rank ({size}), got {len(out)}")
    for i, x in enumerate(out):
        if x.dtype != like.dtype:
            raise ArgumentError(
                f"Invalid usage of tensors with different dtypes: {name}[{i}] is {x.dtype}, "
                f"the input {like.dtype}"
            )
        if x.shape != like.shape:
            raise ArgumentError(
                f"{name}[{i}] has shape {list(x.shape)}, the input {list(like.shape)}"
            )
    return out


def slices(whole: torch.Tensor, part: torch.Tensor, n: int) -> list[torch.Tensor] | None:
    """``whole`` as ``n`` views shaped like ``part`` (concatenated or stacked), else None."""
    if whole.numel() != n * part.numel():
        return None
    if whole.dim() and whole.shape[0] == n and whole.shape[1:] == part.shape:
        return list(whole.unbind(0))
    if part.dim() and whole.shape[0] == n * part.shape[0] and whole.shape[1:] == part.shape[1:]:
        return list(torch.split(whole, part.shape[0]))
    if part.dim() == 0 and whole.shape == (n,):
        return list(whole.unbind(0))
    return None


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
        t.copy_(torch.true_divide(t, divisor))
