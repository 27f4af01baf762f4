"""The tensor collectives' argument forms, read into ``Call``s.

One function per public collective, with the public function's parameters:
it sorts out which form it was given (torch's or mmengine's) and returns the
``Call`` whose ``check`` (run in the call's slot) checks the arguments and
returns the canonical ``Request`` (``requests``).

torch's variants of the gathers and all-to-alls are the same operation with
other outputs: ``all_gather_into_tensor`` fills the slices of one tensor,
``all_to_all_single`` sends and receives the slices of two,
``all_gather_coalesced`` gathers several tensors packed into one buffer. A
device tensor cut into slices is staged whole (``Request.whole_inputs``,
``whole_outputs``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from aiodist._errors import ArgumentError, ArgumentTypeError
from aiodist._group.world import is_group
from aiodist._ops import reduce_ops, staging
from aiodist._ops.requests import (
    Call,
    Op,
    Request,
    Whole,
    one_root,
    outsider,
    root_of,
    shifted_root,
    size_of,
)
from aiodist._ops.tensors import (
    LazyModule,
    check_alike,
    check_outputs,
    check_tensor,
    check_tensor_list,
    slices,
)
from aiodist._wire import codec

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


# --- gathers and all-to-alls -----------------------------------------------------------------


def all_gather(tensor_list: object, tensor: object, group: ProcessGroup | None) -> Call:
    outs: object = None
    if isinstance(tensor_list, list | tuple):
        outs, data = tensor_list, tensor
    else:  # mmengine's form, all_gather(data, group)
        data = tensor_list
        if is_group(tensor):
            group = tensor

    def check(g: ProcessGroup | None) -> Request:
        t = check_tensor(data, "tensor")
        out_list = None
        if outs is not None:
            out_list = check_outputs(outs, "tensor_list", t, size_of(g))
        if outsider(g):
            return _done(out_list or [])
        if g is None:
            if out_list is None:
                return _done([t])
            out_list[0].copy_(t)
            return _done(out_list)
        return Request(op=Op.ALL_GATHER, description="all_gather", tensor=t, outputs=out_list)

    return Call("all_gather", group, check, data)


def all_gather_into_tensor(
    output_tensor: object, input_tensor: object, group: ProcessGroup | None
) -> Call:
    def check(g: ProcessGroup | None) -> Request:
        out = check_tensor(output_tensor, "output_tensor")
        t = check_tensor(input_tensor, "input_tensor")
        size = size_of(g)
        parts = slices(out, t, size)
        if parts is None or out.dtype != t.dtype:
            raise ArgumentError(
                f"output_tensor ({out.dtype} {list(out.shape)}) must hold {size} tensors like "
                f"input_tensor ({t.dtype} {list(t.shape)})"
            )
        if outsider(g):
            return _done(out)
        if g is None:
            out.copy_(t.reshape(out.shape))
            return _done(out)
        return Request(
            op=Op.ALL_GATHER,
            description="all_gather_into_tensor",
            tensor=t,
            outputs=parts,
            whole_outputs=Whole(out, lambda whole: slices(whole, t, size) or []),
            resolve=lambda _: out,
        )

    return Call("all_gather_into_tensor", group, check, input_tensor)


def all_gather_coalesced(
    output_tensor_lists: object, input_tensor_list: object, group: ProcessGroup | None
) -> Call:
    def check(g: ProcessGroup | None) -> Request:
        inputs = check_tensor_list(input_tensor_list, "input_tensor_list", None)
        if not isinstance(output_tensor_lists, list | tuple):
            raise ArgumentTypeError("output_tensor_lists must be a list of lists of tensors")
        size = size_of(g)
        if len(output_tensor_lists) != size:
            raise ArgumentError(f"output_tensor_lists must hold {size} lists, one per rank")
        outs = []
        for r, row in enumerate(output_tensor_lists):
            got = check_tensor_list(row, f"output_tensor_lists[{r}]", len(inputs))
            for i, (o, x) in enumerate(zip(got, inputs, strict=True)):
                if o.dtype != x.dtype or o.numel() != x.numel():
                    raise ArgumentError(
                        f"output_tensor_lists[{r}][{i}] does not match input_tensor_list[{i}]"
                    )
            outs.append(got)
        if any(staging.on_device(x) for x in inputs):
            raise ArgumentError("all_gather_coalesced takes host (CPU) tensors only")
        if outsider(g):
            return _done(list(output_tensor_lists))
        packed = _pack(inputs)
        if g is None:
            _unpack(packed, outs[0])
            return _done(list(output_tensor_lists))

        def unpack(got: list[torch.Tensor]) -> list[list[torch.Tensor]]:
            return [_unpack(x, row) for x, row in zip(got, outs, strict=True)]

        return Request(
            op=Op.ALL_GATHER,
            description="all_gather_coalesced",
            tensor=packed,
            resolve=unpack,
        )

    return Call("all_gather_coalesced", group, check)


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors``, one after the other, as one uint8 tensor."""
    flat = [codec.flat_view(t.contiguous()) for t in tensors]
    return (
        torch.cat([x.view(torch.uint8) for x in flat])
        if flat
        else torch.empty(0, dtype=torch.uint8)
    )


def _unpack(packed: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    offset = 0
    for o in outs:
        n = o.numel() * o.element_size()
        o.copy_(packed[offset : offset + n].clone().view(o.dtype).view(o.shape))
        offset += n
    return outs


def all_to_all(
    output_tensor_list: object, input_tensor_list: object, group: ProcessGroup | None
) -> Call:
    outs: object = None
    inputs: object
    if isinstance(input_tensor_list, list | tuple):
        outs, inputs = output_tensor_list, input_tensor_list
    else:  # aiodist's form, all_to_all(inputs, group)
        inputs = output_tensor_list
        if is_group(input_tensor_list):
            group = input_tensor_list

    def check(g: ProcessGroup | None) -> Request:
        tensors = check_tensor_list(inputs, "input_tensor_list", None)
        dtypes = {x.dtype for x in tensors}
        if len(dtypes) > 1:
            raise ArgumentError(f"inputs must share one dtype, got {sorted(map(str, dtypes))}")
        out_list = None
        size = size_of(g)
        if outs is not None:
            out_list = check_tensor_list(outs, "output_tensor_list", size)
            for i, o in enumerate(out_list):
                if tensors and o.dtype != tensors[0].dtype:
                    raise ArgumentError(
                        f"output_tensor_list[{i}] is {o.dtype}, the inputs {tensors[0].dtype}"
                    )
        if outsider(g):
            return _done(out_list or [])
        if g is None and out_list is None:
            return _done(tensors)  # aiodist's form, not initialised: the inputs
        if len(tensors) != size:
            raise ArgumentError(
                f"input_tensor_list must hold one tensor per rank ({size}), got {len(tensors)}"
            )
        if g is None:
            assert out_list is not None
            if out_list[0].numel() != tensors[0].numel():
                raise ArgumentError("output_tensor_list[0] does not fit input_tensor_list[0]")
            out_list[0].copy_(tensors[0].reshape(out_list[0].shape))
            return _done(out_list)
        return Request(
            op=Op.ALL_TO_ALL,
            description="all_to_all",
            inputs=tensors,
            outputs=out_list,
            fill="reshape",
        )

    return Call("all_to_all", group, check, inputs)


def all_to_all_single(
    output: object,
    input: object,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: ProcessGroup | None,
) -> Call:
    def check(g: ProcessGroup | None) -> Request:
        out = check_tensor(output, "output")
        t = check_tensor(input, "input")
        if out.dtype != t.dtype:
            raise ArgumentError(f"output is {out.dtype} but input is {t.dtype}")
        if outsider(g):
            return _done(out)
        size = 1 if g is None else g.world_size
        sends = _split(t, input_split_sizes, size, "input")
        recvs = _split(out, output_split_sizes, size, "output")
        if g is None:
            if recvs[0].shape != sends[0].shape:
                raise ArgumentError("output and input must have the same size at world size 1")
            recvs[0].copy_(sends[0])
            return _done(out)
        return Request(
            op=Op.ALL_TO_ALL,
            description="all_to_all_single",
            inputs=sends,
            outputs=recvs,
            whole_inputs=Whole(t, lambda whole: _split(whole, input_split_sizes, size, "input")),
            whole_outputs=Whole(
                out, lambda whole: _split(whole, output_split_sizes, size, "output")
            ),
            fill="exact",
            resolve=lambda _: out,
        )

    return Call("all_to_all_single", group, check, input)


def _split(t: torch.Tensor, sizes: list[int] | None, n: int, name: str) -> list[torch.Tensor]:
    rows = t.shape[0] if t.dim() else 1
    if sizes is None:
        if rows % n:
            raise ArgumentError(f"{name} has {rows} rows, not divisible by the group size {n}")
        sizes = [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows or any(s < 0 for s in sizes):
        raise ArgumentError(
            f"{name}_split_sizes {sizes} must hold {n} sizes that add up to {name}'s {rows} rows"
        )
    whole = t if t.dim() else t.reshape(1)
    return list(torch.split(whole, sizes))


# --- rooted ----------------------------------------------------------------------------------


def broadcast(tensor: object, src: object, group: ProcessGroup | None, group_src: object) -> Call:
    src = one_root(src, group_src)

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
    gather_list, dst, group = shifted_root(gather_list, dst, group, group_dst, "dst")

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
