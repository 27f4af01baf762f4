"""Objects to bytes and back: msgpack for plain data, pickle for everything else.

The first byte of an encoded object says which: ``M`` (msgpack) or ``P`` (pickle).
msgpack is packed with ``strict_types`` so that a tuple, a ``str`` subclass or
an ``int`` too large for msgpack is not silently turned into something else: those
reach ``_default`` and are either encoded as an extension type (tuples, CPU
tensors, numpy arrays) or make the whole object fall back to pickle. A round trip
therefore returns an object equal to, and of the same type as, the original.

This module holds the package's only ``pickle.loads``. It is called on bytes
from authenticated members of the caller's own job only; the server never
imports this module.
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any, Final

import msgpack

if TYPE_CHECKING:
    from aiodist._wire.frame import Buffer

__all__ = ["dumps", "loads"]

_MSGPACK: Final = ord("M")
_PICKLE: Final = ord("P")

_EXT_TUPLE: Final = 1
_EXT_TENSOR: Final = 2
_EXT_NDARRAY: Final = 3


class _NotPlain(Exception):
    """Raised inside msgpack's default hook: this object needs pickle."""


def _default(obj: Any) -> msgpack.ExtType:
    if type(obj) is tuple:
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
    module = type(obj).__module__
    if module == "torch" and type(obj).__name__ in ("Tensor", "Parameter"):
        return _tensor_ext(obj)
    if module == "numpy" and type(obj).__name__ == "ndarray":
        if obj.dtype.hasobject or obj.dtype.names is not None:
            raise _NotPlain  # dtype.str of a structured dtype drops its field names
        arr = obj if obj.flags.c_contiguous else obj.copy(order="C")
        return msgpack.ExtType(
            _EXT_NDARRAY, _pack([arr.dtype.str, list(arr.shape), arr.data.cast("B")])
        )
    raise _NotPlain


def _tensor_ext(t: Any) -> msgpack.ExtType:
    import torch

    if type(t) is not torch.Tensor or t.requires_grad or t.layout != torch.strided:
        raise _NotPlain  # parameters, autograd state, sparse: pickle keeps them exact
    if t.device.type != "cpu":
        raise _NotPlain
    # Conjugate and negative views refuse view(dtype): materialise them first.
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().data if flat.numel() else b""
    return msgpack.ExtType(_EXT_TENSOR, _pack([str(t.dtype), list(t.shape), raw]))


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TUPLE:
        return tuple(_unpack(data))
    if code == _EXT_TENSOR:
        import torch

        dtype_name, shape, raw = _unpack(data)
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a torch dtype: {dtype_name}")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if code == _EXT_NDARRAY:
        import numpy as np

        dtype_str, shape, raw = _unpack(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype_str)).reshape(shape).copy()
    return msgpack.ExtType(code, data)


def _unpack(data: Buffer) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext_hook)


def dumps(obj: object) -> bytes:
    """Encode ``obj``: msgpack when it is plain data, pickle otherwise."""
    try:
        return b"M" + _pack(obj)
    except (_NotPlain, OverflowError, TypeError, ValueError):
        return b"P" + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: Buffer) -> Any:
    """Decode bytes made by ``dumps``.

    Raises:
        ValueError: The bytes were not made by ``dumps``.
    """
    view = memoryview(data)
    if not view.nbytes:
        raise ValueError("empty object encoding")
    tag = view[0]
    if tag == _MSGPACK:
        return _unpack(view[1:])
    if tag == _PICKLE:
        return pickle.loads(view[1:])
    raise ValueError(f"unknown object encoding tag {tag!r}")
