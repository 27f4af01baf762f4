"""The object collectives' argument forms, read into ``Call``s (see ``requests``).

Every object is encoded once with ``codec.dumps`` (msgpack when plain, else
pickle) in the call's checks, so an object that cannot be encoded fails the
call on its rank before anything is sent (and aborts it on the others); the
same bytes then go to every peer. An object's device tensors are pickled
after the caller's stream finished writing them (``staging.settle_streams``).
"""

from __future__ import annotations

import itertools
import pickle
from typing import TYPE_CHECKING, Any, cast

from aiodist._errors import ArgumentError, ArgumentTypeError, AssertedArgumentError, counted
from aiodist._group.world import is_group
from aiodist._ops import staging
from aiodist._ops.requests import Call, Op, Request, one_root, outsider, root_of, shifted_root
from aiodist._wire import codec

if TYPE_CHECKING:
    from aiodist._group.group import ProcessGroup

_done = Request.done


def _encoded(obj: object) -> bytes:
    staging.settle_streams(obj)
    return codec.dumps(obj)


def all_gather_object(object_list: Any, obj: Any, group: ProcessGroup | None) -> Call:
    out: list[Any] | None = None
    if obj is ... or is_group(obj):  # mmengine's form: (data, group)
        data = object_list
        if is_group(obj):
            group = obj
    else:
        data, out = obj, object_list

    def check(g: ProcessGroup | None) -> Request:
        if g is None or g.rank < 0:
            if out is None:
                return _done([data] if g is None else [])
            return _done(out if g is not None else _fill_objects(out, [data]))
        if out is not None:
            _fill_objects(out, [None] * g.world_size)  # torch's errors, before anything is sent
        return Request(
            op=Op.ALL_GATHER_OBJECT,
            description="all_gather_object",
            payload=_encoded(data),
            resolve=None if out is None else (lambda got: _fill_objects(out, got)),
        )

    return Call("all_gather_object", group, check)


def _fill_objects(out: Any, got: list[Any]) -> list[Any]:
    """``out[i] = got[i]``, raising what torch raises for a list that cannot take them."""
    if not isinstance(out, list):
        raise ArgumentTypeError(f"object_list must be a list, got {type(out).__name__}")
    if len(out) < len(got):
        raise IndexError(
            f"object_list has {counted(len(out), 'item')} but the group has "
            f"{counted(len(got), 'rank')}: list assignment index out of range"
        )
    for i, x in enumerate(got):
        out[i] = x
    return out


def gather_object(
    obj: Any,
    object_gather_list: Any,
    dst: object,
    group: ProcessGroup | None,
    group_dst: object,
) -> Call:
    object_gather_list, dst, group = shifted_root(object_gather_list, dst, group, group_dst, "dst")

    def check(g: ProcessGroup | None) -> Request:
        if outsider(g):
            return _done(None)
        root = root_of(g, dst, group_dst, "dst")  # from here on a group rank
        size = 1 if g is None else g.world_size
        out = cast("list[Any] | None", object_gather_list)
        if (0 if g is None else g.rank) == root:
            if out is not None and len(out) < size:
                raise ArgumentError(
                    f"object_gather_list has {counted(len(out), 'item')}; the group has "
                    f"{counted(size, 'rank')}"
                )
        elif out:
            raise ArgumentError(
                "Argument ``gather_list`` must NOT be specified on non-destination ranks."
            )
        if g is None:
            return _done([obj] if out is None else _fill_objects(out, [obj]))
        fill = out is not None and g.rank == root
        return Request(
            op=Op.GATHER_OBJECT,
            description=f"gather_object(dst={root})",
            payload=_encoded(obj),
            root=root,
            resolve=(lambda got: _fill_objects(out, got or [])) if fill else None,
        )

    return Call("gather_object", group, check)


def broadcast_object_list(
    object_list: Any, src: object, group: ProcessGroup | None, group_src: object
) -> Call:
    src = one_root(src, group_src)

    def check(g: ProcessGroup | None) -> Request:
        if outsider(g):
            return _done(object_list)
        if not isinstance(object_list, list):
            raise AssertedArgumentError(
                f"object_list must be a list, got {type(object_list).__name__}"
            )
        root = root_of(g, src, group_src, "src")  # from here on a group rank
        if g is None:
            return _done(object_list)
        return _broadcast_objects(object_list, root, g.rank == root)

    return Call("broadcast_object_list", group, check)


def _broadcast_objects(objects: list[Any], root: int, is_root: bool) -> Request:
    return Request(
        op=Op.BROADCAST_OBJECT_LIST,
        description=f"broadcast_object_list(src={root})",
        payload=_encoded(objects) if is_root else None,
        data=objects,
        root=root,
    )


def scatter_object_list(
    scatter_object_output_list: Any,
    scatter_object_input_list: Any,
    src: object,
    group: ProcessGroup | None,
    group_src: object,
) -> Call:
    out: list[Any] | None = scatter_object_output_list
    inputs: Any
    inputs, src, group = shifted_root(scatter_object_input_list, src, group, group_src, "src")
    if inputs is None and scatter_object_input_list is not None:
        # aiodist's older form, (objects, src, group): the objects came first.
        out, inputs = None, scatter_object_output_list

    def check(g: ProcessGroup | None) -> Request:
        nonlocal out, inputs
        if outsider(g):
            return _done(None)
        root = root_of(g, src, group_src, "src")  # from here on a group rank
        size = 1 if g is None else g.world_size
        is_src = g is None or g.rank == root
        if is_src and inputs is None and isinstance(out, list | tuple) and len(out) == size > 1:
            # aiodist's older form with src= given by name: the objects first, no output
            # list (torch's form would raise here: its source passes the objects second).
            out, inputs = None, out
        if out is not None and (not isinstance(out, list) or len(out) < 1):
            raise ArgumentError(
                "Expected argument scatter_object_output_list to be a list of size at least 1."
            )
        if is_src:
            if not isinstance(inputs, (list, tuple)):
                raise ArgumentTypeError(
                    "scatter_object_input_list must be a list on the src rank, got "
                    f"{type(inputs).__name__}"
                )
            if len(inputs) != size:
                raise ArgumentError(
                    f"scatter_object_input_list has {counted(len(inputs), 'item')} but the "
                    f"group has {counted(size, 'rank')}; pass one object per rank"
                )
        if g is None:
            assert isinstance(inputs, list | tuple)
            return _done(_first_into(out, inputs[0]))
        if is_src:
            staging.settle_streams(inputs)
        into = out
        return Request(
            op=Op.SCATTER_OBJECT_LIST,
            description=f"scatter_object_list(src={g.global_rank(root)})",
            payload=[codec.dumps(x) for x in inputs] if is_src and inputs else [],
            root=root,
            resolve=lambda got: _first_into(into, got),
        )

    return Call("scatter_object_list", group, check)


def _first_into(out: list[Any] | None, value: Any) -> Any:
    if out is not None:
        out[0] = value
    return value


# --- mmengine's helpers built on them ---------------------------------------------------------


def collect_results(
    results: Any, size: Any, name: str, tmpdir: str | None, group: ProcessGroup | None
) -> Call:
    """``collect_results_cpu`` (with ``tmpdir``: files) or a gather to rank 0 (without)."""

    def check(g: ProcessGroup | None) -> Request:
        _check_results(results, size)
        if g is None or g.rank < 0:
            return _done(results[:size] if g is None else None)
        if tmpdir is not None:
            return Request(
                op=Op.COLLECT_RESULTS_CPU,
                description=name,
                payload=pickle.dumps(results, protocol=2),
                data=(tmpdir, size),
            )
        return Request(
            op=Op.GATHER_OBJECT,
            description=f"{name}(dst=0)",
            payload=_encoded(results),
            root=0,
            resolve=lambda parts: None if parts is None else ordered(parts, size),
        )

    return Call(name, group, check)


def _check_results(results: object, size: object) -> None:
    if not isinstance(results, list):
        raise ArgumentTypeError(f"results must be a list, got {type(results).__name__}")
    if isinstance(size, bool) or not isinstance(size, int):
        raise ArgumentTypeError(f"size must be an int, got {type(size).__name__}")
    if size < 0:
        raise ArgumentError(f"size must be >= 0, got {size}")


def ordered(parts: list[list[Any]], size: int) -> list[Any]:
    """mmengine's order: interleave the parts, drop the ``None`` padding, cut at ``size``."""
    return [
        x for x in itertools.chain.from_iterable(itertools.zip_longest(*parts)) if x is not None
    ][:size]


def sync_random_seed(group: ProcessGroup | None) -> Call:
    import numpy as np

    seed = int(np.random.randint(2**31))  # every rank draws, as mmengine's do

    def check(g: ProcessGroup | None) -> Request:
        if g is None or g.rank < 0 or g.world_size == 1:
            return _done(seed)
        import torch

        # Through torch.tensor, as mmengine's travels (its tests patch torch.tensor
        # and expect the seed to come from it); rank 0's value is broadcast.
        value = int(torch.tensor(seed if g.rank == 0 else 0, dtype=torch.int32).item())
        req = _broadcast_objects([value], 0, g.rank == 0)
        req.resolve = lambda got: int(got[0])
        return req

    return Call("sync_random_seed", group, check)
