"""mmengine's helpers built on the object collectives: ``collect_results``, ``sync_random_seed``.

``collect_results_cpu`` with a ``tmpdir`` writes files and meets at a barrier,
as mmengine does; without one, and ``collect_results_gpu``, gather the parts
to rank 0 over the data plane (``objects``). ``sync_random_seed`` broadcasts
rank 0's draw.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
from typing import TYPE_CHECKING, Any

from aiodist._errors import AssertedValueError
from aiodist._ops import movement, object_forms, objects
from aiodist._ops.agreement import signature
from aiodist._ops.exchange import Exchange
from aiodist._ops.requests import Op
from aiodist._ops.run import run

if TYPE_CHECKING:
    from aiodist._group.group import ProcessGroup
    from aiodist._group.work import Work
    from aiodist._ops.requests import Request


def collect_results(
    results: list[Any],
    size: int,
    device: str = "cpu",
    tmpdir: str | None = None,
    group: ProcessGroup | None = None,
) -> Work[list[Any] | None]:
    """Collect every rank's results on rank 0, ordered as a distributed sampler split them.

    As ``mmengine.dist.collect_results``: rank ``r`` holds samples ``r, r + n,
    r + 2n, ...``, so the lists are interleaved (``zip_longest``, dropping
    ``None``, as mmengine does) and the sampler's padding is cut off at
    ``size``. ``device="cpu"`` is ``collect_results_cpu`` (files in ``tmpdir``
    when given, else the data plane: no shared filesystem needed);
    ``"gpu"``/``"npu"`` is ``collect_results_gpu``.

    Args:
        results: This rank's results (encoded now).
        size: Length of the whole dataset.
        device: ``"cpu"``, ``"gpu"`` or ``"npu"``.
        tmpdir: A directory every rank can reach (``device="cpu"`` only).
        group: Defaults to the world group.

    Returns:
        Work resolving to the ordered results on rank 0, None elsewhere;
        ``results[:size]`` when not initialised.

    Raises:
        NotImplementedError: ``device`` is none of those (as mmengine raises).
        AssertionError: ``tmpdir`` with ``device="gpu"`` (as mmengine asserts).
        TypeError: ``results`` is not a list or ``size`` not an int.
        FileNotFoundError: On rank 0, ``tmpdir`` is not shared by every rank.
        CollectiveMismatchError: Another rank called a different collective.

    Cancellation:
        Cancelling the awaiting task does not cancel the collection; it
        completes for every rank. A timeout marks ``group`` broken.

    Example:
        >>> ordered = await aiodist.collect_results(preds, len(dataset))
    """
    if device not in ("gpu", "cpu", "npu"):
        raise NotImplementedError(f"device must be 'cpu' , 'gpu' or 'npu', but got {device}")
    if device != "cpu":
        if tmpdir is not None:
            raise AssertedValueError(f"tmpdir should be None when device is {device}")
        return collect_results_gpu(results, size, group)
    return collect_results_cpu(results, size, tmpdir, group)


def collect_results_cpu(
    result_part: list[Any],
    size: int,
    tmpdir: str | None = None,
    group: ProcessGroup | None = None,
) -> Work[list[Any] | None]:
    """Collect every rank's results on rank 0 (mmengine's ``collect_results_cpu``).

    With ``tmpdir``, as mmengine: every rank pickles its part to
    ``tmpdir/part_{rank}.pkl``, the ranks meet at a barrier, rank 0 reads every
    part back, orders them and removes ``tmpdir``. Without it, the parts travel
    over the data plane (mmengine would make a directory under ``.dist_test``).

    Args:
        result_part: This rank's results.
        size: Length of the whole dataset.
        tmpdir: A directory every rank can reach, or None.
        group: Defaults to the world group.

    Returns:
        Work resolving to the ordered results on rank 0, None elsewhere.

    Raises:
        TypeError: ``result_part`` is not a list or ``size`` not an int.
        FileNotFoundError: On rank 0, a part is missing from ``tmpdir``.

    Example:
        >>> ordered = await aiodist.collect_results_cpu(preds, len(dataset), "/shared/tmp")
    """
    return run(
        object_forms.collect_results(result_part, size, "collect_results_cpu", tmpdir, group),
        _start_collect,
    )


def collect_results_gpu(
    result_part: list[Any], size: int, group: ProcessGroup | None = None
) -> Work[list[Any] | None]:
    """Collect every rank's results on rank 0 (mmengine's ``collect_results_gpu``).

    mmengine gathers the parts to every rank with ``all_gather_object``; aiodist
    sends them to rank 0 only, over the data plane. Tensors in the results
    travel pickled (CUDA ones arrive on the device they left).

    Args:
        result_part: This rank's results.
        size: Length of the whole dataset.
        group: Defaults to the world group.

    Returns:
        Work resolving to the ordered results on rank 0, None elsewhere.

    Example:
        >>> ordered = await aiodist.collect_results_gpu(preds, len(dataset))
    """
    return run(
        object_forms.collect_results(result_part, size, "collect_results_gpu", None, group),
        _start_collect,
    )


def _start_collect(g: ProcessGroup, seq: int, req: Request) -> Work[Any]:
    if req.op is Op.GATHER_OBJECT:  # no tmpdir: the parts travel over the data plane
        return objects.start_gather_object(g, seq, req)
    tmpdir, size = req.data
    rank, n = g.rank, g.world_size
    path = os.path.join(tmpdir, f"part_{rank}.pkl")
    met: Work[None] = g.begin(req.description, seq=seq)

    async def written_then_met(seq: int) -> None:
        await asyncio.to_thread(write_private, path, req.payload)
        async with Exchange(g, met, seq, signature("barrier"), rides=True) as ex:
            await movement.meet(ex, None, req.description)

    g.drive(met, written_then_met, seq)

    def read() -> list[Any]:
        parts = []
        for i in range(n):
            part = os.path.join(tmpdir, f"part_{i}.pkl")
            if not os.path.exists(part):
                raise FileNotFoundError(
                    f"{tmpdir} is not a shared directory for rank {i}, please make sure "
                    f"{tmpdir} is a shared directory for all ranks!"
                )
            with open(part, "rb") as f:
                parts.append(pickle.load(f))
        shutil.rmtree(tmpdir)
        return object_forms.ordered(parts, size)

    async def finish(seq: int) -> list[Any] | None:
        await met
        if rank != 0:
            return None
        return await asyncio.to_thread(read)

    # Reading is this rank's own: a missing part fails it here, not the group.
    return g.start(req.description, finish, collective=False, seq=seq)


def write_private(path: str, payload: bytes) -> None:
    """Write ``payload`` to ``path``, readable by this user only (a part of collect_results).

    The results are the user's (mmengine leaves them to the umask): the folder is
    made 0700, the file 0600, and never written through a link planted in its place.
    """
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as f:
        os.fchmod(fd, 0o600)  # a part left by an earlier run keeps its mode otherwise
        f.write(payload)


def sync_random_seed(group: ProcessGroup | None = None) -> Work[int]:
    """Draw a random seed on every rank and give every rank rank 0's (as mmengine).

    Every rank draws ``np.random.randint(2**31)`` (so numpy's global generator
    advances on every rank, as in mmengine), then rank 0's draw is broadcast.

    Args:
        group: Defaults to the world group.

    Returns:
        Work resolving to the same int in ``[0, 2**31)`` on every rank; this
        rank's draw when not initialised.

    Raises:
        CollectiveMismatchError: Another rank called a different collective.
        RankFailedError: A member died first.

    Cancellation:
        Cancelling the awaiting task does not cancel the broadcast. A timeout
        marks ``group`` broken on all members.

    Example:
        >>> seed = await aiodist.sync_random_seed()
    """
    return run(object_forms.sync_random_seed(group), objects.start_broadcast_object_list)
