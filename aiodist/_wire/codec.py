"""Objects to bytes and back: msgpack for plain data, pickle for everything else.

The first byte of an encoded object says which: ``M`` (msgpack) or ``P`` (pickle).
msgpack is packed with ``strict_types`` so that a tuple, a ``str`` subclass or
an ``int`` too large for msgpack is not silently turned into something else: those
reach ``_default`` and are either encoded as an extension type (tuples, CPU
tensors, numpy arrays) or make the whole object fall back to pickle. A round trip
therefore returns an object equal to, and of the same type as, the original.

``dumps_split``/``loads_split`` encode the same way but set large CPU tensors
aside (an extension type, or a pickle persistent id, holding their index):
the caller sends their bytes as payloads of their own, straight from the
tensors' memory, and the receiver reads them into fresh tensors, so no copy
of them ends up in the encoding (remote calls use this). Asked to
(``grad=True``: distributed autograd records them), they set aside every CPU
tensor that requires grad too, whatever its size.

This module holds the package's only unpickling. It is called on bytes
from authenticated members of the caller's own job only; the server never
imports this module.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import TYPE_CHECKING, Any, Final

import msgpack

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from aiodist._wire.frame import Buffer

#: ``dumps_split`` sets aside CPU tensors of at least this many bytes.
SPLIT_MIN_BYTES: Final = 64 * 1024

_MSGPACK: Final = ord("M")
_PICKLE: Final = ord("P")

_EXT_TUPLE: Final = 1
_EXT_TENSOR: Final = 2
_EXT_NDARRAY: Final = 3
_EXT_TENSOR_REF: Final = 4  # dumps_split: the index of a tensor set aside


class _NotPlain(Exception):
    """Raised inside msgpack's default hook: this object needs pickle."""


class _Encoder:
    """msgpack's ``default`` hook; with a ``split`` list, large CPU tensors go there."""

    __slots__ = ("grad", "index", "split")

    def __init__(self, split: list[Any] | None, grad: bool = False) -> None:
        self.split = split
        self.grad = grad
        self.index: dict[int, int] = {}  # id(tensor) -> its place in split: each goes once

    def __call__(self, obj: Any) -> msgpack.ExtType:
        if type(obj) is tuple:
            return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj), self))
        if self.split is not None and _splittable(obj, self.grad):
            return msgpack.ExtType(_EXT_TENSOR_REF, _pack(_set_aside(obj, self), _PLAIN))
        return _default(obj)


def _set_aside(t: Any, owner: _Encoder | _SplitPickler) -> int:
    """``t``'s index in ``owner.split``, appended on first sight (then shared, not repeated)."""
    split = owner.split
    assert split is not None
    index = owner.index.get(id(t))
    if index is None:
        index = owner.index[id(t)] = len(split)
        split.append(t)
    return index


def _splittable(obj: Any, grad: bool) -> bool:
    """True for a plain CPU tensor whose bytes travel apart.

    One of at least ``SPLIT_MIN_BYTES`` that does not require grad; with ``grad``,
    also one that requires grad, of any size.
    """
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and type(obj) is torch.Tensor
        and obj.layout == torch.strided
        and obj.device.type == "cpu"
        and (grad if obj.requires_grad else obj.nbytes >= SPLIT_MIN_BYTES)
    )


def _default(obj: Any) -> msgpack.ExtType:
    if type(obj) is tuple:
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj), _PLAIN))
    module = type(obj).__module__
    if module == "torch" and type(obj).__name__ in ("Tensor", "Parameter"):
        return _tensor_ext(obj)
    if module == "numpy" and type(obj).__name__ == "ndarray":
        if obj.dtype.hasobject or obj.dtype.names is not None:
            raise _NotPlain  # dtype.str of a structured dtype drops its field names
        arr = obj if obj.flags.c_contiguous else obj.copy(order="C")
        return msgpack.ExtType(
            _EXT_NDARRAY, _pack([arr.dtype.str, list(arr.shape), arr.data.cast("B")], _PLAIN)
        )
    raise _NotPlain


def flat_view(t: Any) -> Any:
    """Contiguous tensor ``t`` as one dimension of stride 1, sharing its memory.

    Not ``reshape(-1)``: torch calls a tensor contiguous whatever the strides of
    its size-1 dimensions (one element of stride 2 is), and keeps such a stride
    through ``view``/``reshape``, where ``view(torch.uint8)`` then refuses it.
    """
    return t.as_strided((t.numel(),), (1,))


# Dtypes whose numpy array's memoryview casts to bytes directly (a one-character
# buffer format); the others (complex, bfloat16, ...) are viewed as uint8 first.
_NUMPY_VIEWABLE: dict[Any, bool] = {}


def byte_view(t: Any) -> memoryview:
    """A writable view of contiguous CPU tensor ``t``'s bytes (no copy): what travels."""
    assert t.is_contiguous()
    if t.numel() == 0:
        return memoryview(bytearray(0))
    dtype = t.dtype
    direct = _NUMPY_VIEWABLE.get(dtype)
    if direct is None:
        direct = _NUMPY_VIEWABLE[dtype] = _casts_directly(t)
    if direct and not t.requires_grad:
        return t.numpy().data.cast("B")  # type: ignore[no-any-return]  # the fast way
    import torch  # here, not above: an import statement costs every small message

    return flat_view(t).view(torch.uint8).numpy().data.cast("B")  # type: ignore[no-any-return]


def _casts_directly(t: Any) -> bool:
    try:
        t.detach().numpy().data.cast("B")
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def _tensor_ext(t: Any) -> msgpack.ExtType:
    import torch

    if type(t) is not torch.Tensor or t.requires_grad or t.layout != torch.strided:
        raise _NotPlain  # parameters, autograd state, sparse: pickle keeps them exact
    if t.device.type != "cpu":
        raise _NotPlain
    # Conjugate and negative views refuse view(dtype): materialise them first.
    flat = flat_view(t.detach().resolve_conj().resolve_neg().contiguous())
    raw = flat.view(torch.uint8).numpy().data if flat.numel() else b""
    return msgpack.ExtType(_EXT_TENSOR, _pack([str(t.dtype), list(t.shape), raw], _PLAIN))


_PLAIN: Final = _Encoder(None)


def _pack(obj: Any, default: _Encoder) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=True, default=default)


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


def _unpack(data: Buffer, ext_hook: Callable[[int, bytes], Any] = _ext_hook) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext_hook)


def dumps(obj: object) -> bytes:
    """Encode ``obj``: msgpack when it is plain data, pickle otherwise."""
    try:
        return b"M" + _pack(obj, _PLAIN)
    except (_NotPlain, OverflowError, TypeError, ValueError):
        return b"P" + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class _SplitPickler(pickle.Pickler):
    """Pickles large CPU tensors by reference to ``split`` (a persistent id: their index)."""

    def __init__(self, file: io.BytesIO, split: list[Any], grad: bool) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.split: list[Any] | None = split
        self.grad = grad
        self.index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        return _set_aside(obj, self) if _splittable(obj, self.grad) else None


def dumps_split(obj: object, tensors: list[Any], *, grad: bool = False) -> bytes:
    """Encode ``obj`` as ``dumps`` does, but append its large CPU tensors to ``tensors``.

    The encoding refers to each by its index; their bytes are not copied into
    it (``loads_split`` takes them back). ``tensors`` holds the very tensors of
    ``obj``: do not change them until their bytes have been sent. With
    ``grad``, tensors that require grad are set aside too, whatever their size.
    """
    start = len(tensors)
    try:
        return b"M" + _pack(obj, _Encoder(tensors, grad))
    except (_NotPlain, OverflowError, TypeError, ValueError):
        del tensors[start:]  # set aside by the attempt; pickle sets them aside again
    buf = io.BytesIO()
    buf.write(b"P")
    _SplitPickler(buf, tensors, grad).dump(obj)
    return buf.getvalue()


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


def loads_split(data: Buffer, tensors: Sequence[Any]) -> Any:
    """Decode bytes made by ``dumps_split``, whose tensors set aside are now ``tensors``.

    Raises:
        ValueError: The bytes were not made by ``dumps_split``, or refer to a
            tensor that ``tensors`` lacks.
    """
    view = memoryview(data)
    if not view.nbytes:
        raise ValueError("empty object encoding")

    def tensor(index: Any) -> Any:
        if type(index) is not int or not 0 <= index < len(tensors):
            raise ValueError(f"the encoding refers to tensor {index!r} of {len(tensors)}")
        return tensors[index]

    tag = view[0]
    if tag == _MSGPACK:

        def ext_hook(code: int, ext: bytes) -> Any:
            if code == _EXT_TENSOR_REF:
                return tensor(_unpack(ext))
            if code == _EXT_TUPLE:
                return tuple(_unpack(ext, ext_hook))
            return _ext_hook(code, ext)

        return _unpack(view[1:], ext_hook)
    if tag == _PICKLE:
        unpickler = pickle.Unpickler(io.BytesIO(view[1:]))
        unpickler.persistent_load = tensor  # type: ignore[method-assign]
        return unpickler.load()
    raise ValueError(f"unknown object encoding tag {tag!r}")
