"""``RemoteModule`` over ``aiodist.rpc`` (torch's ``torch.distributed.nn``).

A program written for torch changes ``from torch.distributed.nn import
RemoteModule`` (or ``torch.distributed.nn.api.remote_module``) to ``from
aiodist.rpc.nn import RemoteModule``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import nn

from aiodist.rpc import RRef, remote, rpc_async, rpc_sync

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["RemoteModule"]


class RemoteModule(nn.Module):
    """A module made and run on another worker; ``forward`` runs there (torch's).

    The module is ``module_cls(*args, **kwargs)``, made on the worker that
    ``remote_device`` names and moved to its device there. ``forward`` (and
    ``forward_async``) send the inputs there and bring the output back; within
    a distributed autograd context, gradients flow back to the module's
    parameters there. It pickles (pass it to other workers in remote calls:
    they use the same module), and most ``nn.Module`` methods that would act
    on local parameters raise ``ValueError``: use ``remote_parameters()`` (with
    ``DistributedOptimizer``) and ``get_module_rref()``.

    Args:
        remote_device: ``"<worker name>/<device>"``, ``"rank:<rank>/<device>"``, or
            a worker name alone (device ``cpu``).
        module_cls: An ``nn.Module`` class, importable on that worker.
        args: Positional arguments for ``module_cls``.
        kwargs: Keyword arguments for ``module_cls``.

    Raises:
        ValueError: ``remote_device`` is malformed.

    Example:
        >>> emb = RemoteModule("ps", torch.nn.EmbeddingBag, args=(100, 16), kwargs={"mode": "sum"})
        >>> out = emb(indices, offsets)          # EmbeddingBag.forward runs on "ps"
    """

    def __init__(
        self,
        remote_device: str,
        module_cls: type[nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.on, self.device = _parse_remote_device(remote_device)
        self.is_scriptable = False
        self.module_rref: RRef[nn.Module] = remote(
            self.on, _create_module, (module_cls, args or (), kwargs or {}, self.device)
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``forward`` on its worker; its output, here."""
        return rpc_sync(self.on, _remote_forward, (self.module_rref, *args), kwargs)

    def forward_async(self, *args: Any, **kwargs: Any) -> Any:
        """As ``forward``, without waiting: a future of the output (a ``Work`` in async code)."""
        return rpc_async(self.on, _remote_forward, (self.module_rref, *args), kwargs)

    def remote_parameters(self, recurse: bool = True) -> list[RRef[nn.Parameter]]:
        """``RRef``s to the module's parameters, kept by its worker (for DistributedOptimizer)."""
        return rpc_sync(self.on, _param_rrefs, (self.module_rref, recurse))

    def get_module_rref(self) -> RRef[nn.Module]:
        """The ``RRef`` of the module itself."""
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        """Set the remote module's training mode (and this one's)."""
        rpc_sync(self.on, _train, (self.module_rref, mode))
        self.training = mode
        return self

    def eval(self) -> RemoteModule:
        """``train(False)``."""
        return self.train(False)

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on!r}, device={self.device!r})"


def _not_supported(name: str) -> Callable[..., NoReturn]:
    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule")

    method.__name__ = name
    return method


# What would act on local parameters or buffers: refused, as torch's RemoteModule does.
for _name in (
    "register_buffer",
    "register_parameter",
    "add_module",
    "apply",
    "cuda",
    "ipu",
    "xpu",
    "cpu",
    "type",
    "float",
    "double",
    "half",
    "bfloat16",
    "to",
    "register_backward_hook",
    "register_forward_pre_hook",
    "register_forward_hook",
    "state_dict",
    "load_state_dict",
    "parameters",
    "named_parameters",
    "buffers",
    "named_buffers",
    "children",
    "named_children",
    "modules",
    "named_modules",
    "requires_grad_",
    "zero_grad",
    "share_memory",
):
    setattr(RemoteModule, _name, _not_supported(_name))


def _parse_remote_device(remote_device: str) -> tuple[str | int, str]:
    if not isinstance(remote_device, str) or not remote_device:
        raise ValueError(f"remote_device must be '<worker>/<device>', got {remote_device!r}")
    worker, _, device = remote_device.partition("/")
    device = device or "cpu"
    try:
        torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"remote_device {remote_device!r} names no device: {exc}") from exc
    if worker.startswith("rank:"):
        rank = worker.removeprefix("rank:")
        if not rank.isdigit():
            raise ValueError(f"remote_device {remote_device!r}: 'rank:' must be followed by a rank")
        return int(rank), device
    if not worker:
        raise ValueError(f"remote_device {remote_device!r} names no worker")
    return worker, device


def _create_module(
    module_cls: type[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any], device: str
) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(
            f"module_cls(*args, **kwargs) must return an nn.Module, not a {type(module).__name__}"
        )
    return module.to(device)


def _remote_forward(module_rref: RRef[nn.Module], *args: Any, **kwargs: Any) -> Any:
    return module_rref.local_value().forward(*args, **kwargs)


def _param_rrefs(module_rref: RRef[nn.Module], recurse: bool) -> list[RRef[nn.Parameter]]:
    return [RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _train(module_rref: RRef[nn.Module], mode: bool) -> None:
    module_rref.local_value().train(mode)
