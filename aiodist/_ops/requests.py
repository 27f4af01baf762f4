"""Every public call, in one canonical form: what this rank sends, receives and reduces, with whom.

torch.distributed and mmengine spell the same operation several ways:
``all_gather(tensor_list, tensor)`` fills a list, mmengine's ``all_gather(data,
group)`` returns one, ``all_gather_into_tensor(out, input)`` fills the slices
of a tensor; ``src`` is a global rank and ``group_src`` a rank of the group.
This module reads each of them into a ``Call``: the group it names, the tensor
that decides where it runs (the torch bridge, host memory, a device staged
through host memory), and its ``check``: the argument checks, run in the
call's slot (``run.run``), which return the ``Request``. From there on one
algorithm per operation serves every spelling: ``all_gather_into_tensor`` is
an ``all_gather`` whose outputs are the slices of ``out``.

The checks raise what torch raises for the same arguments (``TypeError``,
``ValueError``), before anything is sent. A process outside the group, and a
process with nothing initialised (world size 1), get their answer from the
check itself (``Request.done``): torch.distributed's, and mmengine's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from aiodist._errors import ArgumentError, ArgumentTypeError, CollectiveMismatchError
from aiodist._group.world import is_group

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import TypeAlias

    import torch

    from aiodist._group.group import ProcessGroup

    #: Cuts a whole tensor into one view per rank (``Whole.cut``).
    Cut: TypeAlias = Callable[[torch.Tensor], list[torch.Tensor]]

#: ``Request.answer`` of a request that still has to run.
NOT_DONE: Any = object()


class Op(enum.Enum):
    """The algorithm a request runs, and whether torch.distributed has it too.

    ``torch``: a call of it whose tensors a torch bridge carries goes to
    torch.distributed; ``_torch/ops.py`` holds one start for each such
    operation, checked when it is imported. The others run on aiodist's data
    plane whatever their tensors (staged through host memory from a device).
    """

    label: str
    torch: bool

    def __init__(self, label: str, torch: bool) -> None:
        self.label = label
        self.torch = torch

    ALL_REDUCE = "all_reduce", True
    REDUCE = "reduce", True
    REDUCE_SCATTER = "reduce_scatter", True
    BROADCAST = "broadcast", True
    GATHER = "gather", True
    SCATTER = "scatter", True
    ALL_GATHER = "all_gather", True
    ALL_TO_ALL = "all_to_all", True
    BARRIER = "barrier", False
    # Several tensors reduced in place at once (``all_reduce_dict``, ``all_reduce_params``).
    ALL_REDUCE_PARTS = "all_reduce_parts", False
    ALL_GATHER_OBJECT = "all_gather_object", False
    GATHER_OBJECT = "gather_object", False
    BROADCAST_OBJECT_LIST = "broadcast_object_list", False
    SCATTER_OBJECT_LIST = "scatter_object_list", False
    COLLECT_RESULTS_CPU = "collect_results_cpu", False
    DONE = "done", False  # answered without sending anything (``Request.done``)


class Whole(NamedTuple):
    """A tensor that a request's ``inputs`` or ``outputs`` are views of, and how they are cut."""

    tensor: torch.Tensor
    cut: Cut


@dataclass(slots=True, kw_only=True)
class Request:
    """One call in canonical form.

    Attributes:
        op: The algorithm (``Op``).
        description: The call as handles and errors name it.
        tensor: The one tensor of the call: reduced, broadcast or scattered
            into in place (``in_place``), or gathered.
        inputs: One tensor per rank, when the call sends each rank its own
            (scatter on the root, reduce_scatter, all_to_all).
        outputs: The caller's tensors for the results (torch's forms); None
            for new ones.
        whole_inputs, whole_outputs: The tensors that ``inputs`` and
            ``outputs`` are views of, with the functions that cut them so
            (torch's ``*_tensor`` and ``*_single`` forms): a device call copies
            the whole tensor to host memory (and back) once, and cuts the host
            copy the same way.
        fill: How results go into ``outputs``: copied, reshaped to each output
            (the same number of elements), or only of the same shape.
        reduce_op: The reduction, for reductions.
        root: The root's group rank, for rooted operations.
        resolve: Makes the call's value of the (filled) result; None: the result.
        payload: An object operation's encoded objects (one per rank for a scatter).
        data: An object operation's own objects (the list a broadcast fills).
        timeout: A barrier's own timeout, in seconds.
        shm: Whether it may take a turn on shared memory (not when staged
            from a device: it starts too late to take its turn in call order).
        answer: The call's value when nothing needs to be sent (``done``).
    """

    op: Op
    description: str = ""
    tensor: torch.Tensor | None = None
    in_place: bool = False
    inputs: Sequence[torch.Tensor] = ()
    outputs: list[torch.Tensor] | None = None
    whole_inputs: Whole | None = None
    whole_outputs: Whole | None = None
    fill: Literal["copy", "reshape", "exact"] = "copy"
    reduce_op: str | None = None
    root: int | None = None
    resolve: Callable[[Any], Any] | None = None
    payload: Any = None
    data: Any = None
    timeout: float | None = None
    shm: bool = True
    answer: Any = NOT_DONE

    @classmethod
    def done(cls, answer: Any) -> Request:
        """A call answered without sending anything (outside the group, not initialised)."""
        return cls(op=Op.DONE, answer=answer)

    @property
    def first(self) -> torch.Tensor | None:
        """The tensor whose device says where the call runs."""
        if self.tensor is not None:
            return self.tensor
        if self.whole_inputs is not None:
            return self.whole_inputs.tensor
        return self.inputs[0] if self.inputs else None

    def deliver(self, got: Any) -> Any:
        """The call's value of an algorithm's result: ``outputs`` filled, then ``resolve``."""
        value = self.filled(got)
        return value if self.resolve is None else self.resolve(value)

    def filled(self, got: Any) -> Any:
        """Copy ``got`` (a tensor, or one per rank) into ``outputs``; return what holds it."""
        outs = self.outputs
        if outs is None or got is outs:
            return got
        parts = got if isinstance(got, list) else [got]
        for r, (o, x) in enumerate(zip(outs, parts, strict=False)):
            if o is x:
                continue
            if self.fill == "copy":
                o.copy_(x)
            elif self.fill == "reshape":
                if o.numel() != x.numel():
                    raise CollectiveMismatchError(
                        f"rank {r} sent {x.numel()} elements for an output of {o.numel()}",
                        field="shape",
                        values_by_rank={r: list(x.shape)},
                    )
                o.copy_(x.reshape(o.shape))
            else:
                if o.shape != x.shape:
                    raise CollectiveMismatchError(
                        f"rank {r} sent a part of shape {list(x.shape)} for a slice of "
                        f"{list(o.shape)}; check the split sizes on both ranks",
                        field="shape",
                        values_by_rank={r: list(x.shape)},
                    )
                o.copy_(x)
        if not isinstance(got, list):
            return outs[0]
        return outs if parts else parts


@dataclass(slots=True)
class Call:
    """A public call, read: its name, its group, and its checks (run in its slot).

    ``first`` is the tensor (or list of tensors) that decides whether a torch
    bridge runs it; None for calls torch's bridge never takes. ``torch`` says
    that the call may issue parts to a bridged group's torch.distributed
    whatever ``first`` is (a call that reduces several tensors).
    """

    name: str
    group: ProcessGroup | None
    check: Callable[[ProcessGroup | None], Request]
    first: object = None
    torch: bool = False


def size_of(g: ProcessGroup | None) -> int:
    """How many ranks a call on ``g`` counts with: 1 when not initialised or outside."""
    return 1 if g is None or g.rank < 0 else g.world_size


def outsider(g: ProcessGroup | None) -> bool:
    """True on a process that is not a member of ``g``.

    There, as in torch.distributed, a collective does nothing: it returns at
    once with its tensors untouched.
    """
    return g is not None and g.rank < 0


def root_of(g: ProcessGroup | None, root: object, group_root: object, name: str) -> int:
    """The group rank that ``name`` (a global rank) or ``group_name`` (a group rank) names.

    torch.distributed's convention: ``src``/``dst`` are global ranks, and
    ``group_src``/``group_dst`` the same rank counted within the group; one of them.

    Raises:
        ValueError: Neither or both given, or not a member of ``g``.
        TypeError: Not an int.
    """
    size = 1 if g is None else g.world_size
    if root is not None and group_root is not None:
        raise ArgumentError(f"Can not specify both {name} and group_{name}")
    if group_root is not None:
        if not isinstance(group_root, int) or isinstance(group_root, bool):
            raise ArgumentTypeError(
                f"group_{name} must be an int rank, got {type(group_root).__name__}"
            )
        if not 0 <= group_root < size:
            raise ArgumentError(f"group_{name}={group_root} is not a rank of a group of {size}")
        return group_root
    if root is None:
        raise ArgumentError(f"Must specify {name} or group_{name}")
    if g is None:
        if not isinstance(root, int) or isinstance(root, bool):
            raise ArgumentTypeError(f"{name} must be an int rank, got {type(root).__name__}")
        if root != 0:
            raise ArgumentError(f"{name} must be 0 when not initialised (world size 1), got {root}")
        return 0
    return g.group_rank_of(root, name)


def one_root(root: object, group_root: object) -> object:
    """``root``, or None where ``group_root`` is given and ``root`` is its default 0.

    torch takes one of the two (``root_of``); a ``src``/``dst`` that defaults to 0
    must not count as given beside ``group_src``/``group_dst``.
    """
    return None if group_root is not None and root == 0 else root


def shifted_root(
    second: object, root: object, group: ProcessGroup | None, group_root: object, name: str
) -> tuple[object, object, ProcessGroup | None]:
    """torch's ``(second, root, group)``, from mmengine's shifted form if it is that.

    mmengine's ``gather(data, dst, group)`` (and aiodist's older
    ``scatter_object_list(objects, src, group)``) passes the root where torch
    passes its second argument: an int ``second`` is the root, and ``root`` the
    group if it is one; the second argument is then None. The root returned is
    ``one_root``'s.

    Raises:
        TypeError: ``root`` is a group, and ``second`` not a rank.
    """
    if isinstance(second, int) and not isinstance(second, bool):
        if is_group(root):
            group = root
        second, root = None, second
    if is_group(root):
        raise ArgumentTypeError(f"{name} must be an int rank, got a ProcessGroup")
    return second, one_root(root, group_root), group
