"""Sans-IO tests of the object codec: msgpack for plain data, pickle for the rest."""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiodist._wire.codec import dumps, loads


class Point:
    """A user class: only pickle can carry it."""

    def __init__(self, x: int, y: list[str]) -> None:
        self.x = x
        self.y = y

    def __eq__(self, other: object) -> bool:
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)

    __hash__ = None  # type: ignore[assignment]


def _round_trip(obj: object, path: bytes) -> Any:
    data = dumps(obj)
    assert type(data) is bytes
    assert data[:1] == path, f"{obj!r} took {data[:1]!r}, expected {path!r}"
    return loads(data)


def _assert_same(got: Any, want: Any) -> None:
    # repr tells apart what == does not: True/1, 1/1.0, -0.0/0.0, tuple/list, bytes/bytearray.
    assert type(got) is type(want)
    assert repr(got) == repr(want)


# --- plain data: msgpack -------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(None, id="none"),
        pytest.param(True, id="true"),
        pytest.param(False, id="false"),
        pytest.param(0, id="zero"),
        pytest.param(-1, id="minus-one"),
        pytest.param(2**64 - 1, id="uint64-max"),
        pytest.param(-(2**63), id="int64-min"),
        pytest.param(1.5, id="float"),
        pytest.param(-0.0, id="negative-zero"),
        pytest.param(math.inf, id="inf"),
        pytest.param(-math.inf, id="minus-inf"),
        pytest.param(1e-310, id="subnormal"),
        pytest.param("", id="empty-str"),
        pytest.param("héllo \u2603 \U0001f600", id="unicode-str"),
        pytest.param(b"", id="empty-bytes"),
        pytest.param(bytes(range(256)), id="bytes"),
        pytest.param([], id="empty-list"),
        pytest.param([1, [2, [3, [4, []]]], "x"], id="nested-list"),
        pytest.param((), id="empty-tuple"),
        pytest.param((1, "a", None), id="tuple"),
        pytest.param((1, (2, (3,)), [4, (5,)]), id="nested-tuple"),
        pytest.param([(1, 2), [3, 4]], id="tuple-in-list"),
        pytest.param({}, id="empty-dict"),
        pytest.param({"a": 1, "b": [True, None], "c": {"d": b"e"}}, id="dict"),
        pytest.param({1: "int key", 2.5: "float key", None: 0, False: 1}, id="non-str-keys"),
        pytest.param({(1, 2): "a", ("x", (3,)): [()]}, id="tuple-keys"),
        pytest.param({"loss": 0.5, "step": 100, "tags": ("a", "b")}, id="metrics"),
    ],
)
def test_plain_data_round_trips_through_msgpack(obj: object) -> None:
    _assert_same(_round_trip(obj, b"M"), obj)


def test_tuple_dict_keys_come_back_as_tuples() -> None:
    out = _round_trip({(0, 1): (2, 3), (4,): {(5, 6): 7}}, b"M")
    assert list(out) == [(0, 1), (4,)]
    assert all(type(key) is tuple for key in out)
    assert type(out[(0, 1)]) is tuple
    assert type(next(iter(out[(4,)]))) is tuple
    assert out[(4,)][(5, 6)] == 7


def test_nan_round_trips_through_msgpack() -> None:
    out = _round_trip(math.nan, b"M")
    assert type(out) is float
    assert math.isnan(out)
    nested = _round_trip({"x": [math.nan, 1.0]}, b"M")
    assert math.isnan(nested["x"][0])
    assert nested["x"][1] == 1.0


# --- everything else: pickle ------------------------------------------------------------


@pytest.mark.parametrize(
    "obj",
    [
        pytest.param(2**64, id="uint64-max-plus-one"),
        pytest.param(2**200 + 7, id="huge-int"),
        pytest.param(-(2**63) - 1, id="int64-min-minus-one"),
        pytest.param({1, 2, 3}, id="set"),
        pytest.param(frozenset({"a", "b"}), id="frozenset"),
        pytest.param(set(), id="empty-set"),
        pytest.param(Point(3, ["a", "b"]), id="custom-class"),
        pytest.param([1, {"p": Point(1, [])}], id="custom-class-nested"),
        pytest.param({"n": 2**70}, id="huge-int-nested"),
        pytest.param(complex(1, 2), id="complex"),
        pytest.param(range(3), id="range"),
    ],
)
def test_other_objects_round_trip_through_pickle(obj: object) -> None:
    out = _round_trip(obj, b"P")
    assert type(out) is type(obj)
    assert out == obj


def test_custom_class_round_trips_with_its_attributes() -> None:
    out = _round_trip(Point(7, ["x"]), b"P")
    assert type(out) is Point
    assert out.x == 7
    assert out.y == ["x"]


class _Name(str):
    __slots__ = ()


class _Count(int):
    pass


def test_str_and_int_subclasses_keep_their_type() -> None:
    # msgpack would turn these into a plain str and int; strict types send them to pickle.
    out = _round_trip([_Name("rank"), {_Name("k"): _Count(3)}], b"P")
    assert type(out[0]) is _Name
    assert out[0] == "rank"
    ((key, value),) = out[1].items()
    assert type(key) is _Name
    assert type(value) is _Count
    assert value == 3


def test_pickle_payload_is_plain_pickle() -> None:
    data = dumps({1, 2})
    assert data[:1] == b"P"
    assert pickle.loads(data[1:]) == {1, 2}


# --- torch tensors ---------------------------------------------------------------------

TENSOR_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    values = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) - 7
    if dtype == torch.bool:
        return values.remainder(3) == 0
    if dtype.is_complex:
        return torch.complex(values, -values * 0.5).to(dtype)
    if dtype == torch.uint8:
        return values.abs().to(dtype)
    return (values * (0.25 if dtype.is_floating_point else 1)).to(dtype)


def _assert_same_tensor(got: Any, want: torch.Tensor) -> None:
    assert type(got) is torch.Tensor
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.device == want.device
    assert got.requires_grad == want.requires_grad
    assert torch.equal(got.detach(), want.detach())


@pytest.mark.parametrize("dtype", TENSOR_DTYPES, ids=str)
def test_tensor_round_trips_through_msgpack(dtype: torch.dtype) -> None:
    t = _sample(dtype)
    _assert_same_tensor(_round_trip(t, b"M"), t)


@pytest.mark.parametrize("dtype", TENSOR_DTYPES, ids=str)
def test_zero_dim_tensor_round_trips(dtype: torch.dtype) -> None:
    t = _sample(dtype, (1,)).reshape(())
    out = _round_trip(t, b"M")
    _assert_same_tensor(out, t)
    assert out.dim() == 0


@pytest.mark.parametrize("shape", [(0,), (0, 3), (4, 0, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64], ids=str)
def test_empty_tensor_round_trips(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    t = torch.empty(shape, dtype=dtype)
    out = _round_trip(t, b"M")
    _assert_same_tensor(out, t)
    assert out.numel() == 0


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.arange(12.0).reshape(3, 4).t(), id="transposed"),
        pytest.param(lambda: torch.arange(20).reshape(4, 5)[:, 1::2], id="strided-slice"),
        pytest.param(lambda: torch.arange(10, dtype=torch.int16)[3:8], id="offset-slice"),
        pytest.param(lambda: torch.arange(3.0).expand(4, 3), id="expanded"),
        pytest.param(lambda: torch.ones(2, 3, 4).permute(2, 0, 1), id="permuted"),
        pytest.param(
            lambda: torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)[..., ::3], id="bf16"
        ),
        pytest.param(lambda: torch.tensor([1 + 2j, 3 - 4j]).conj(), id="conj-view"),
        pytest.param(lambda: torch.tensor([1.0, -2.0])._neg_view(), id="neg-view"),
    ],
)
def test_view_tensor_round_trips_as_its_values(make: Any) -> None:
    t = make()
    out = _round_trip(t, b"M")
    _assert_same_tensor(out, t)
    assert out.is_contiguous()
    assert not out.is_conj()
    assert not out.is_neg()


def test_decoded_tensor_owns_writable_memory() -> None:
    t = torch.arange(6, dtype=torch.int32)
    data = dumps(t)
    out = loads(data)
    out += 1  # a read-only or shared buffer would warn (warnings are errors) or corrupt
    assert torch.equal(out, torch.arange(1, 7, dtype=torch.int32))
    assert torch.equal(loads(data), t)
    assert torch.equal(t, torch.arange(6, dtype=torch.int32))


def test_tensor_body_is_raw_bytes_not_msgpack_numbers() -> None:
    t = torch.zeros(100_000, dtype=torch.float32)
    assert len(dumps(t)) < t.numel() * 4 + 100


def test_tensors_inside_containers_round_trip() -> None:
    obj: dict[str, Any] = {
        "w": _sample(torch.float32),
        "pair": (torch.tensor(1), torch.tensor([True])),
    }
    out = _round_trip(obj, b"M")
    assert list(out) == ["w", "pair"]
    _assert_same_tensor(out["w"], obj["w"])
    assert type(out["pair"]) is tuple
    _assert_same_tensor(out["pair"][0], torch.tensor(1))
    _assert_same_tensor(out["pair"][1], torch.tensor([True]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_tensor_requiring_grad_round_trips_through_pickle(dtype: torch.dtype) -> None:
    t = torch.linspace(-1, 1, 6, dtype=dtype).requires_grad_()
    out = _round_trip(t, b"P")
    _assert_same_tensor(out, t)
    assert out.requires_grad
    assert out.is_leaf


def test_parameter_round_trips_through_pickle() -> None:
    p = torch.nn.Parameter(torch.ones(2, 2))
    out = _round_trip(p, b"P")
    assert type(out) is torch.nn.Parameter
    assert out.requires_grad
    assert torch.equal(out.detach(), p.detach())


def test_tensor_requiring_grad_makes_whole_object_pickle() -> None:
    obj = {"plain": torch.ones(2), "grad": torch.zeros(2, requires_grad=True)}
    out = _round_trip(obj, b"P")
    _assert_same_tensor(out["plain"], obj["plain"])
    _assert_same_tensor(out["grad"], obj["grad"])


# --- numpy arrays ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        "float64",
        "float16",
        "int8",
        "uint16",
        "int64",
        "bool",
        "complex128",
        ">i4",
        "<U3",
    ],
)
@pytest.mark.parametrize("shape", [(), (7,), (2, 3), (2, 1, 4)], ids=str)
def test_ndarray_round_trips_through_msgpack(dtype: str, shape: tuple[int, ...]) -> None:
    a = (np.arange(math.prod(shape)) % 5).astype(dtype).reshape(shape)
    assert type(a) is np.ndarray
    out = _round_trip(a, b"M")
    assert type(out) is np.ndarray
    assert out.dtype == a.dtype
    assert out.shape == a.shape
    np.testing.assert_array_equal(out, a)
    assert out.flags.writeable


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.arange(12.0).reshape(3, 4).T, id="transposed"),
        pytest.param(lambda: np.asfortranarray(np.arange(6).reshape(2, 3)), id="fortran"),
        pytest.param(lambda: np.arange(20, dtype=np.int16)[::3], id="strided"),
    ],
)
def test_non_contiguous_ndarray_round_trips(make: Any) -> None:
    a = make()
    out = _round_trip(a, b"M")
    assert out.dtype == a.dtype
    assert out.shape == a.shape
    np.testing.assert_array_equal(out, a)


@pytest.mark.parametrize(
    "a",
    [
        pytest.param(np.array([1, "a", None], dtype=object), id="object"),
        pytest.param(np.array(["2024-01-01"], dtype="datetime64[ns]"), id="datetime64"),
        pytest.param(np.array([(1, 2.5)], dtype=[("a", "<i4"), ("b", "<f8")]), id="structured"),
        pytest.param(np.zeros((0, 3)), id="empty"),
    ],
)
def test_unusual_ndarray_round_trips_exactly(a: np.ndarray[Any, Any]) -> None:
    out = loads(dumps(a))
    assert type(out) is np.ndarray
    assert out.dtype == a.dtype
    assert out.shape == a.shape
    np.testing.assert_array_equal(out, a)


def test_numpy_scalar_keeps_its_type() -> None:
    out = _round_trip(np.float32(1.5), b"P")
    assert type(out) is np.float32
    assert out == np.float32(1.5)


# --- loads of bad input ------------------------------------------------------------------


def test_loads_empty_raises() -> None:
    with pytest.raises(ValueError, match="empty object encoding"):
        loads(b"")


@pytest.mark.parametrize("data", [b"X", b"m\x90", b"p", b"\x00\x80", b"{}"])
def test_loads_unknown_tag_raises(data: bytes) -> None:
    with pytest.raises(ValueError, match="unknown object encoding tag") as info:
        loads(data)
    assert str(data[0]) in str(info.value)


def test_loads_accepts_memoryview_and_bytearray() -> None:
    obj = {"a": (1, 2), "t": [b"x"]}
    data = dumps(obj)
    _assert_same(loads(memoryview(data)), obj)
    _assert_same(loads(bytearray(data)), obj)
    _assert_same(loads(memoryview(b"junk" + data)[4:]), obj)


def test_dumps_of_non_picklable_object_raises() -> None:
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        dumps(lambda: None)


# --- hypothesis ------------------------------------------------------------------------

_plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=8), children, max_size=5)
        | st.lists(children, max_size=3).map(tuple)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(_plain)
def test_plain_data_round_trips(obj: Any) -> None:
    data = dumps(obj)
    assert data[:1] in (b"M", b"P")
    _assert_same(loads(data), obj)


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.integers(-(2**63), 2**64 - 1) | st.text(), st.lists, max_leaves=10))
def test_plain_data_in_msgpack_range_never_pickles(obj: Any) -> None:
    data = dumps(obj)
    assert data[:1] == b"M"
    _assert_same(loads(data), obj)
