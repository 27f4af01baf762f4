"""The tensor reductions' and rooted collectives' argument forms, read into ``Call``s.

One function per public collective, with the public function's parameters:
it sorts out which form it was given (torch's or mmengine's) and returns the
``Call`` whose ``check`` (run in the call's slot) checks the arguments and
returns the canonical ``Request`` (``requests``). The forms of the gathers
and all-to-alls are ``movement_forms``'.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from aiodist._errors import ArgumentError, ArgumentTypeError
from aiodist._group.world import is_group
from aiodist._ops import reduce_ops
from aiodist._ops.requests import Call, Op, Request, Whole, outsider, root_of, size_of
from aiodist._ops.tensors import (
    LazyModule,
    check_alike,
    check_tensor,
    check_tensor_list,
    slices,
)

if TYPE_CHECKING:
    import torch

    from aiodist._group.group import ProcessGroup
else:
    torch = LazyModule("torch")

_done = Request.done


# --- reductions ------------------------------------------------------------------------------


def all_reduce(tensor: object, op: object, group: ProcessGroup | None) -> Call:
    def check(g: ProcessGroup | None) -> Request:
        t = check_tensor(tensor, "tensor", sparse=True)
        reduce_op = reduce_ops.reduction(op, t.dtype, "all_reduce")
        if t.is_sparse and (reduce_op != "sum" or not t.is_cpu):
            raise ArgumentError(
                f"all_reduce of a sparse tensor sums CPU tensors only (as gloo's), got "
                f"op={reduce_op} on {t.device}"
            )
        if g is None or g.rank < 0:
            return _done(t)
        return Request(
            op=Op.ALL_REDUCE,
            description=f"all_reduce(op={reduce_op})",
            tensor=t,
            in_place=True,
            reduce_op=reduce_op,
        )

    return Call("all_reduce", group, check, tensor)


def reduce(
    tensor: object, dst: object, op: object, group: ProcessGroup | None, group_dst: object
) -> Call:
    def check(g: ProcessGroup | None) -> Request:
        t = check_tensor(tensor, "tensor")
        reduce_op = reduce_ops.reduction(op, t.dtype, "reduce")
        if outsider(g):
            return _done(t)
        root = root_of(g, dst, group_dst, "dst")
        if g is None:
            return _done(t)
        return Request(
            op=Op.REDUCE,
            description=f"reduce(dst={g.global_rank(root)}, op={reduce_op})",
            tensor=t,
            in_place=True,
            reduce_op=reduce_op,
            root=root,
        )

    return Call("reduce", group, check, tensor)


def reduce_scatter(
    output: object, input_list: object, op: object, group: ProcessGroup | None
) -> Call:
    if isinstance(output, list | tuple):  # aiodist's form: (inputs, op, group)
        inputs: object = output
        out_tensor: object = None
        the_op: object = input_list if input_list is not None else op
        if is_group(op):
            group = op  # the group, passed third
    else:
        inputs, out_tensor, the_op = input_list, output, op

    def check(g: ProcessGroup | None) -> Request:
        out = None if out_tensor is None else check_tensor(out_tensor, "output")
        tensors = check_tensor_list(inputs, "input_list", None)
        if not tensors:
            raise ArgumentError("input_list must hold one tensor per rank, got an empty list")
        reduce_op = reduce_ops.reduce_op(the_op)
        check_alike(tensors, "input_list")
        first = tensors[0]
        if out is not None and (out.dtype != first.dtype or out.shape != first.shape):
            raise ArgumentError(
                f"output is {out.dtype} {list(out.shape)} but input_list holds "
                f"{first.dtype} {list(first.shape)}"
            )
        reduce_ops.check_op_dtype(reduce_op, first.dtype)
        if outsider(g):
            return _done(out if out is not None else first)
        if g is None:
            if out is None:
                return _done(first)
            out.copy_(first)
            return _done(out)
        if len(tensors) != g.world_size:
            raise ArgumentError(
                f"input_list must hold one tensor per rank ({g.world_size}), got {len(tensors)}"
            )
        return _reduce_scatter(tensors, out, reduce_op)

    return Call("reduce_scatter", group, check, inputs)


def _reduce_scatter(
    tensors: list[torch.Tensor], out: torch.Tensor | None, reduce_op: str
) -> Request:
    return Request(
        op=Op.REDUCE_SCATTER,
        description=f"reduce_scatter(op={reduce_op})",
        inputs=tensors,
        outputs=None if out is None else [out],
        reduce_op=reduce_op,
    )


def reduce_scatter_tensor(
    output: object, input: object, op: object, group: ProcessGroup | None
) -> Call:
    def check(g: ProcessGroup | None) -> Request:
        out = check_tensor(output, "output")
        t = check_tensor(input, "input")
        reduce_op = reduce_ops.reduction(op, t.dtype, "reduce_scatter")
        size = size_of(g)
        parts = slices(t, out, size)
        if parts is None or t.dtype != out.dtype:
            raise ArgumentError(
                f"input ({t.dtype} {list(t.shape)}) must hold {size} slices of output "
                f"({out.dtype} {list(out.shape)})"
            )
        if outsider(g):
            return _done(out)
        if g is None:
            out.copy_(parts[0])
            return _done(out)
        req = _reduce_scatter(parts, out, reduce_op)
        req.whole_inputs = Whole(t, lambda whole: slices(whole, out, size) or [])
        return req

    return Call("reduce_scatter_tensor", group, check, input)


# --- rooted ----------------------------------------------------------------------------------


def broadcast(tensor: object, src: object, group: ProcessGroup | None, group_src: object) -> Call:
    if group_src is not None and src == 0:
        src = None  # torch: one of the two

    def check(g: ProcessGroup | None) -> Request:
        t = check_tensor(tensor, "tensor")
        if outsider(g):
            return _done(t)
        root = root_of(g, src, group_src, "src")
        if g is None:
            return _done(t)
        return Request(
            op=Op.BROADCAST,
            description=f"broadcast(src={g.global_rank(root)})",
            tensor=t,
            in_place=True,
            root=root,
        )

    return Call("broadcast", group, check, tensor)


def gather(
    tensor: object,
    gather_list: object,
    dst: object,
    group: ProcessGroup | None,
    group_dst: object,
) -> Call:
    if isinstance(gather_list, int) and not isinstance(gather_list, bool):
        # mmengine's form, gather(data, dst, group): shift the arguments by one.
        if is_group(dst):
            group = dst
        gather_list, dst = None, gather_list
    if is_group(dst):
        raise ArgumentTypeError("dst must be an int rank, got a ProcessGroup")
    if group_dst is not None and dst == 0:
        dst = None

    def check(g: ProcessGroup | None) -> Request:
        t = check_tensor(tensor, "tensor")
        if outsider(g):
            return _done([])
        root = root_of(g, dst, group_dst, "dst")
        outs = None
        if gather_list is not None and (0 if g is None else g.rank) == root:
            outs = check_tensor_list(gather_list, "gather_list", size_of(g))
            for i, x in enumerate(outs):
                if x.dtype != t.dtype:
                    raise ArgumentError(f"gather_list[{i}] is {x.dtype}, but tensor is {t.dtype}")
                if x.shape != t.shape:
                    raise ArgumentError(
                        f"gather_list[{i}] has shape {list(x.shape)}, tensor {list(t.shape)}"
                    )
        elif gather_list:
            raise ArgumentError(
                "Argument ``gather_list`` must NOT be specified on non-destination ranks."
            )
        if g is None:
            if outs is None:
                return _done([t])
            outs[0].copy_(t)
            return _done(outs)
        return Request(
            op=Op.GATHER,
            description=f"gather(dst={g.global_rank(root)})",
            tensor=t,
            outputs=outs,
            root=root,
        )

    return Call("gather", group, check, tensor)


def scatter(
    tensor: object,
    scatter_list: object,
    src: object,
    group: ProcessGroup | None,
    group_src: object,
) -> Call:
    def check(g: ProcessGroup | None) -> Request:
        t = check_tensor(tensor, "tensor")
        if outsider(g):
            return _done(t)
        # As torch: with neither src nor group_src, the source is global rank 0.
        source = 0 if src is None and group_src is None else src
        root = root_of(g, source, group_src, "src")
        parts: list[torch.Tensor] = []
        if (0 if g is None else g.rank) == root:
            if not scatter_list:
                raise ArgumentError("Argument ``scatter_list`` must be specified on source rank.")
            parts = check_tensor_list(scatter_list, "scatter_list", size_of(g))
            for i, part in enumerate(parts):
                if part.dtype != t.dtype or part.shape != t.shape:
                    raise ArgumentError(
                        f"scatter_list[{i}] is {part.dtype} {list(part.shape)}, but tensor is "
                        f"{t.dtype} {list(t.shape)}"
                    )
        elif scatter_list:
            raise ArgumentError(
                "Argument ``scatter_list`` must NOT be specified on non-source ranks."
            )
        if g is None:
            t.copy_(parts[0])
            return _done(t)
        return Request(
            op=Op.SCATTER,
            description=f"scatter(src={g.global_rank(root)})",
            tensor=t,
            in_place=True,
            inputs=parts,
            root=root,
        )

    return Call("scatter", group, check, tensor)


def barrier(
    name: str,
    group: ProcessGroup | None,
    timeout: float | timedelta | None,
    *,
    monitored: bool = False,
) -> Call:
    """A barrier; ``monitored`` (torch's ``monitored_barrier``) waits the group's timeout.

    A monitored barrier takes a timeout of 0, as torch's does: it gives up at
    once unless every member has arrived already.
    """
    least = ">= 0" if monitored else "> 0"

    def check(g: ProcessGroup | None) -> Request:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if seconds is None and monitored and g is not None:
            seconds = g.timeout
        if seconds is not None and (
            isinstance(seconds, bool) or not (seconds >= 0 if monitored else seconds > 0)
        ):
            raise ArgumentError(f"timeout must be a number of seconds {least}, got {seconds!r}")
        if g is None or g.rank < 0:
            return _done(None)
        return Request(op=Op.BARRIER, description=name, timeout=seconds)

    return Call(name, group, check)
