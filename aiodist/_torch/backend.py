"""aiodist as a torch.distributed backend: torch's own calls on aiodist's data plane.

``torch.distributed.init_process_group(backend="aiodist")`` (and a job started
with aiodist's ``init_process_group()`` and no backend) makes torch's group an
``AiodistProcessGroup``: a process group written in Python, as torch accepts
them (its ``ProcessGroup`` trampoline; ``test_c10d_pypg.py``). Each call torch
makes on it (``DistributedDataParallel``'s reducer, ``DistributedSampler``,
``torch.distributed.*``) starts the same operation of aiodist's public API on
aiodist's event loop, in call order, on the aiodist group the torch group
follows, and returns an ``AiodistWork``: a torch ``Work`` whose future
completes from aiodist's loop. So torch's calls are aiodist's calls: a failed
rank fails them naming it, ranks that disagree get ``CollectiveMismatchError``,
they are in the flight recorder and ``aiodist status --job``, they are
encrypted with the job's TLS, and ``shrink_group``/``regroup`` renumber the
torch group underneath (its rank and size follow the aiodist group).

**Threads.** torch's calls are made from the user's threads and block there
(``Work.wait``); aiodist's loop runs the operation. Called on the loop's own
thread (async code calling torch's blocking API) a call would wait for itself:
it raises ``RuntimeError`` at once instead, and names the way out.

**Devices.** CPU tensors ride aiodist's plane. Tensors of another device go to
that device's *part* (``parts``: NCCL for CUDA), a torch process group that
this group builds over its current membership from the job's store, and
builds again when the membership changes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import torch
from torch._C._distributed_c10d import ProcessGroup as TorchProcessGroup

from aiodist._group.group import ProcessGroup
from aiodist._group.world import default_group_loop, get_default_group
from aiodist._ops.movement import (
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_to_all,
    all_to_all_single,
    barrier,
    monitored_barrier,
)
from aiodist._ops.p2p import irecv, isend
from aiodist._ops.reductions import all_reduce, reduce, reduce_scatter, reduce_scatter_tensor
from aiodist._ops.rooted import broadcast, gather, scatter
from aiodist._ops.tensor_groups import all_reduce_coalesced
from aiodist._torch import handoff
from aiodist._torch.ops import options_op
from aiodist._torch.parts import DevicePart, parts_from_env
from aiodist._torch.torch_work import ON_LOOP, AiodistWork, on_loop

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence
    from datetime import timedelta
    from typing import TypeAlias

    from aiodist._group.work import Work

    #: An aiodist operation on a group, started on aiodist's loop.
    Start: TypeAlias = Callable[[ProcessGroup], Work[Any]]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound="Callable[..., Any]")

#: The backend's name in torch.distributed.
BACKEND = "aiodist"


def _routed(method: F) -> F:
    """Send the call to the device part of its tensors' device, if any (``_part``)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        routed = self._part(args)
        if routed is None:
            return method(self, *args, **kwargs)
        part, g, loop = routed
        return part.call(g, loop, name, *args, **kwargs)

    return cast("F", call)


def _device_of(args: Any) -> str | None:
    """The device type of the first tensor in ``args`` (lists searched), or None."""
    if isinstance(args, torch.Tensor):
        return args.device.type
    if isinstance(args, list | tuple):
        for arg in args:
            if (found := _device_of(arg)) is not None:
                return found
    return None


class AiodistProcessGroup(TorchProcessGroup):
    """torch's process group over an aiodist group (the default group, followed).

    Args:
        follow: Returns the aiodist group the torch group is now (the default
            group after ``shrink_group`` or ``regroup`` replaced it).
        rank, size: torch's rank and size at creation (they follow ``follow()``).
        owns_job: torch's ``init_process_group`` joined the job (its ``destroy_process_group``
            leaves it).
        parts: Device type -> torch backend for tensors that do not ride aiodist's plane
            (``parts.py``); ``AIODIST_TORCH_PARTS`` or what this process has if None.
    """

    def __init__(
        self,
        follow: Callable[[], ProcessGroup | None],
        rank: int,
        size: int,
        *,
        owns_job: bool = False,
        parts: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._follow = follow
        self._rank = rank
        self._size = size
        self._owns_job = owns_job
        #: Called by torch's ``destroy_process_group`` (``shutdown``) when the job is ours.
        self.leave_job: Callable[[], None] | None = None
        #: torch's ``destroy_process_group`` is under way (aiodist must not start another).
        self.destroying = False
        # torch's name and description of the group (``_set_group_name``): a group of
        # torch's keeps them on its backends, and this one has none of torch's.
        self._name = self._desc = ""
        self._parts = {
            device: DevicePart(device, name)
            for device, name in (parts_from_env() if parts is None else parts).items()
        }
        # The devices it carries, as torch lists them (``_device_types``: checkpoint
        # loading asks for the group's device); no torch backend object stands behind them.
        for device in sorted({"cpu", *self._parts}):
            self._register_backend(torch.device(device), TorchProcessGroup.BackendType.CUSTOM, None)

    # --- what torch asks of every group -------------------------------------------------------

    def aiodist_group(self) -> ProcessGroup | None:
        """The aiodist group this torch group rides now (``_group.world.as_group`` asks)."""
        g = self._follow()
        if g is not None:
            self._rank, self._size = g.rank, g.world_size
        return g

    def getRank(self) -> int:
        self.aiodist_group()
        return self._rank

    def getSize(self) -> int:
        self.aiodist_group()
        return self._size

    def getBackendName(self) -> str:
        return BACKEND

    # torch's ``group_name``/``group_desc`` read these (DeviceMesh, FSDP2, DTensor name
    # groups by them; torch's ``new_group`` sets them once it has made the group).

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def __repr__(self) -> str:
        return f"<AiodistProcessGroup rank {self.getRank()} of {self.getSize()}>"

    def shutdown(self) -> None:
        """torch's ``destroy_process_group``: a subgroup closes; the default group leaves
        the job if torch's ``init_process_group`` joined it (else aiodist's own
        ``destroy_process_group`` does that)."""
        self.destroying = True
        g = self._follow()
        if self._owns_job and self.leave_job is not None:
            leave, self.leave_job = self.leave_job, None
            leave()
        elif g is not None and g is not get_default_group() and not g.closed:
            loop = default_group_loop()
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(g.close)

    def abort(self) -> None:
        self.shutdown()

    # --- issuing ------------------------------------------------------------------------------

    def _part(self, args: tuple[Any, ...]) -> tuple[DevicePart, ProcessGroup, Any] | None:
        """The device part of the tensors in ``args``, its group and loop; None: aiodist's."""
        device = _device_of(args)
        if device is None or (device == "cpu" and "cpu" not in self._parts):
            return None
        part = self._parts.get(device)
        if part is None:
            raise RuntimeError(
                f"torch.distributed on the aiodist backend carries CPU tensors on aiodist's "
                f"plane and has no backend for {device} tensors in this process (NCCL needs "
                "CUDA and a torch build with it; AIODIST_TORCH_PARTS names the parts)"
            )
        loop = default_group_loop()
        g = self.aiodist_group()
        if loop is None or g is None:
            raise RuntimeError("aiodist's job is not running in this process")
        if on_loop(loop):
            raise RuntimeError(ON_LOOP.format(what=f"torch.distributed on {device} tensors"))
        return part, g, loop

    def _issue(
        self,
        description: str,
        value: Any,
        starts: Sequence[Start],
    ) -> AiodistWork:
        """Start ``starts`` (each an aiodist operation on the group) on aiodist's loop, in order."""
        loop = default_group_loop()
        if loop is None:
            raise RuntimeError(
                f"torch.distributed {description} on the aiodist backend: aiodist's job is not "
                "running in this process (destroy_process_group was called?)"
            )
        if on_loop(loop):
            raise RuntimeError(ON_LOOP.format(what=f"torch.distributed {description}"))
        work = AiodistWork(value, description, len(starts))
        work._loop = loop

        def begin() -> None:
            g = self.aiodist_group()
            if g is None:
                work._fail(RuntimeError(f"{description}: aiodist's job ended"))
                return
            for start in starts:
                try:
                    started = start(g)
                except Exception as exc:
                    work._fail(exc)
                    return
                started.when_done(work._part_done)

        handoff.call_soon(loop, begin)
        return work

    # --- the operations: torch's names (its trampoline's and its Python callers') ------------
    # torch's stubs overload some of them with a per-tensor form (``pg.allreduce(t)``);
    # torch's callers (its Python API, DDP's reducer) use the list forms, implemented here.

    @_routed
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> AiodistWork:  # type: ignore[override]
        op = options_op(opts)
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        (t,) = tensors
        return self._issue("all_reduce", tensors, [lambda g: all_reduce(t, op, g)])

    @_routed
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> AiodistWork:
        op = options_op(opts)
        return self._issue(
            "all_reduce_coalesced", tensors, [lambda g: all_reduce_coalesced(tensors, op, g)]
        )

    @_routed
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> AiodistWork:  # type: ignore[override]
        root = _root(opts)
        return self._issue(
            "broadcast", tensors, [_bind(broadcast, t, None, group_src=root) for t in tensors]
        )

    @_routed
    def allgather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> AiodistWork:
        starts = [_bind(all_gather, o, i) for o, i in _pairs(output_tensors, input_tensors)]
        return self._issue("all_gather", output_tensors, starts)

    @_routed
    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> AiodistWork:
        return self._issue(
            "all_gather_into_tensor", [output], [_bind(all_gather_into_tensor, output, input)]
        )

    @_routed
    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> AiodistWork:
        return self._issue(
            "all_gather_coalesced",
            output_lists,
            [_bind(all_gather_coalesced, output_lists, inputs)],
        )

    @_routed
    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> AiodistWork:
        starts = [_bind(all_gather_into_tensor, o, i) for o, i in _pairs(outputs, inputs)]
        return self._issue("all_gather_into_tensor_coalesced", outputs, starts)

    @_routed
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> AiodistWork:  # type: ignore[override]
        root, op = _root(opts), options_op(opts)
        starts = [_bind(reduce, t, None, op, group_dst=root) for t in tensors]
        return self._issue("reduce", tensors, starts)

    @_routed
    def reduce_scatter(  # type: ignore[override]
        self,
        outputs: list[torch.Tensor],
        input_lists: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> AiodistWork:
        op = options_op(opts)
        starts = [_bind(reduce_scatter, o, i, op) for o, i in _pairs(outputs, input_lists)]
        return self._issue("reduce_scatter", outputs, starts)

    @_routed
    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> AiodistWork:
        op = options_op(opts)
        return self._issue(
            "reduce_scatter_tensor", [output], [_bind(reduce_scatter_tensor, output, input, op)]
        )

    @_routed
    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> AiodistWork:
        op = options_op(opts)
        starts = [_bind(reduce_scatter_tensor, o, i, op) for o, i in _pairs(outputs, inputs)]
        return self._issue("reduce_scatter_tensor_coalesced", outputs, starts)

    @_routed
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> AiodistWork:
        outs = list(output_split_sizes) or None
        ins = list(input_split_sizes) or None
        return self._issue(
            "all_to_all_single", [output], [_bind(all_to_all_single, output, input, outs, ins)]
        )

    @_routed
    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> AiodistWork:
        return self._issue("all_to_all", outputs, [_bind(all_to_all, outputs, inputs)])

    @_routed
    def gather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> AiodistWork:
        root = _root(opts)
        (t,) = input_tensors
        out = output_tensors[0] if output_tensors and self.getRank() == root else None
        return self._issue("gather", output_tensors, [_bind(gather, t, out, None, group_dst=root)])

    @_routed
    def scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> AiodistWork:
        root = _root(opts)
        (t,) = output_tensors
        ins = input_tensors[0] if input_tensors and self.getRank() == root else None
        return self._issue(
            "scatter", output_tensors, [_bind(scatter, t, ins, None, group_src=root)]
        )

    @_routed
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> AiodistWork:
        starts = [_bind(isend, t, None, tag=tag, group_dst=dstRank) for t in tensors]
        return self._issue("send", tensors, starts)

    @_routed
    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> AiodistWork:
        starts = [_bind(irecv, t, None, tag=tag, group_src=srcRank) for t in tensors]
        return self._issue("recv", tensors, starts)

    @_routed
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> AiodistWork:
        starts = [_bind(irecv, t, None, tag=tag) for t in tensors]
        return self._issue("recv", tensors, starts)

    def barrier(self, opts: Any = None) -> AiodistWork:
        return self._issue("barrier", [], [_bind(barrier)])

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        work = self._issue(
            "monitored_barrier",
            [],
            [_bind(monitored_barrier, timeout=timeout, wait_all_ranks=wait_all_ranks)],
        )
        work.wait()

    # torch's older names, which other callers (and its trampoline's fallbacks) use.
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]
    alltoall_base = all_to_all_single  # type: ignore[assignment]


def _bind(fn: Callable[..., Work[Any]], *args: Any, **kwargs: Any) -> Start:
    """``fn(*args, group, **kwargs)``: an aiodist operation, its group last of its positionals."""
    return lambda g: fn(*args, g, **kwargs)


def _pairs(outputs: Sequence[Any], inputs: Sequence[Any]) -> list[tuple[Any, Any]]:
    if len(outputs) != len(inputs):
        raise ValueError(
            f"torch passed {len(outputs)} outputs for {len(inputs)} inputs; expected as many"
        )
    return list(zip(outputs, inputs, strict=True))


def _root(opts: Any) -> int:
    return int(getattr(opts, "rootRank", 0))


def follow_default() -> ProcessGroup | None:
    """The aiodist group torch's default group rides: aiodist's default group, as it is now."""
    return get_default_group()


def create_default(rank: int, size: int, *, owns_job: bool) -> AiodistProcessGroup:
    """torch's default group over aiodist's default group (up in this process).

    ``owns_job``: torch's ``init_process_group`` joined the job, so torch's
    ``destroy_process_group`` leaves it.

    Raises:
        ValueError: torch's rank and size are not this process's in the job.
    """
    g = get_default_group()
    if g is None:
        raise RuntimeError("aiodist's default group is not initialised")
    if (g.rank, g.world_size) != (rank, size):
        raise ValueError(
            f"torch.distributed asked for rank {rank} of {size}, and aiodist's job has this "
            f"process as rank {g.rank} of {g.world_size}; pass the same rank and world size"
        )
    return AiodistProcessGroup(follow_default, rank, size, owns_job=owns_job)


#: Group ids of the aiodist groups under torch's subgroups: a space of their own,
#: derived from torch's group name, since only torch's members make them (aiodist's
#: own ``new_group`` numbers groups on every rank of the parent).
TORCH_GROUP_IDS: Final = 1 << 62
_TORCH_GROUP_SPAN: Final = 1 << 48


#: aiodist groups that torch's next group over the same members rides (``riding``).
_riding: dict[tuple[int, ...], ProcessGroup] = {}


@contextlib.contextmanager
def riding(group: ProcessGroup) -> Iterator[None]:
    """torch's group over ``group``'s members, made inside, rides ``group`` itself.

    ``aiodist.sync.new_group`` makes aiodist's group first (every rank agrees on
    its ranks), then torch's over it: DDP takes torch's, and both name one group.
    """
    key = tuple(group.ranks)
    _riding[key] = group
    try:
        yield
    finally:
        _riding.pop(key, None)


def create_subgroup(
    name: str, ranks: Sequence[int], rank: int, timeout: timedelta | None = None
) -> AiodistProcessGroup:
    """torch's group ``name`` over ``ranks`` (torch's global ranks: the default group's).

    ``timeout``: torch's for the group (``new_group(timeout=...)``); the default
    group's when None.

    Made by its members only (torch calls no backend on the others), so no agreement
    among the whole world: every member derives the same group id from the name,
    unless the group rides one ``aiodist.sync.new_group`` made (``riding``).
    """
    world = get_default_group()
    if world is None:
        raise RuntimeError("aiodist's default group is not initialised")
    session = world.session
    members = [world.ranks[r] for r in ranks]
    group = _riding.pop(tuple(members), None)
    if group is None:
        digest = hashlib.blake2b(f"{world.group_id}/{name}/{members}".encode(), digest_size=8)
        group_id = TORCH_GROUP_IDS + int.from_bytes(digest.digest()) % _TORCH_GROUP_SPAN
        group = ProcessGroup(session, members, name=f"{world.name}/torch:{name}", group_id=group_id)
        group.timeout = world.timeout if timeout is None else timeout.total_seconds()
        session.groups[group_id] = group
    if group.rank != rank:
        raise ValueError(f"torch made rank {rank} of group {name!r}; aiodist has {group.rank}")
    return AiodistProcessGroup(lambda: group, rank, len(members), owns_job=False)
