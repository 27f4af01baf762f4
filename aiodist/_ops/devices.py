"""mmengine's device helpers: where data lives, where a group communicates, moving data there.

They behave as ``mmengine.dist``'s: same results, same errors for the same input.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from aiodist._group.world import get_backend

if TYPE_CHECKING:
    import torch

    from aiodist._group.group import ProcessGroup


def _is_tensor(data: object) -> bool:
    import torch

    return isinstance(data, torch.Tensor)


def get_data_device(data: Any) -> torch.device:
    """The device of ``data``: a tensor, or a sequence or dict of them on one device.

    Raises:
        ValueError: Tensors on different devices, or an empty sequence or dict.
        TypeError: Something else.

    Example:
        >>> aiodist.get_data_device({"a": torch.zeros(1)})
        device(type='cpu')
    """
    if _is_tensor(data):
        return data.device  # type: ignore[no-any-return]
    if isinstance(data, Mapping):
        return _one_device(data.values())
    if isinstance(data, Iterable) and not isinstance(data, str):
        return _one_device(data)
    raise TypeError(f"data should be a Tensor, sequence of tensor or dict, but got {data}")


def _one_device(items: Iterable[Any]) -> torch.device:
    pre = None
    for item in items:
        cur = get_data_device(item)
        if pre is None:
            pre = cur
        elif cur != pre:
            raise ValueError(f"device type in data should be consistent, but got {cur} and {pre}")
    if pre is None:
        raise ValueError("data should not be empty.")
    return pre


def get_comm_device(group: ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s backend communicates from: the current GPU under NCCL, else the CPU.

    aiodist's own data plane takes CUDA tensors under any backend (staged
    through host memory); this answers as mmengine does, for code that moves
    data itself.
    """
    import torch

    if get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cast_data_device(data: Any, device: torch.device, out: Any = None) -> Any:
    """``data`` (a tensor, or a sequence or dict of them) on ``device``; into ``out`` if given.

    Raises:
        TypeError: ``out`` of another type than ``data``, a set, or data of no
            supported kind.
        ValueError: Empty data, or ``out`` of another length.
    """
    import numpy as np

    if out is not None:
        if type(data) is not type(out):
            raise TypeError(
                f"out should be the same type with data, but got data is {type(data)} and "
                f"out is {type(out)}"
            )
        if isinstance(out, set):
            raise TypeError("out should not be a set")
    if _is_tensor(data):
        moved = data if get_data_device(data) == device else data.to(device)
        if out is not None:
            out.copy_(moved)
        return moved
    if isinstance(data, Mapping):
        if out is not None and len(data) != len(out):
            raise ValueError(
                f"length of data and out should be same, but got {len(data)} and {len(out)}"
            )
        moved_items = {
            k: cast_data_device(v, device, None if out is None else out[k]) for k, v in data.items()
        }
        if not moved_items:
            raise ValueError("data should not be empty")
        return type(data)(moved_items)  # type: ignore[call-arg]
    if isinstance(data, Iterable) and not isinstance(data, str | np.ndarray):
        if out is not None:
            moved_list = [
                cast_data_device(v1, device, v2) for v1, v2 in zip(data, out, strict=False)
            ]
        else:
            moved_list = [cast_data_device(v, device) for v in data]
        if not moved_list:
            raise ValueError("data should not be empty")
        return type(data)(moved_list)  # type: ignore[call-arg]
    raise TypeError(f"data should be a Tensor, list of tensor or dict, but got {data}")
