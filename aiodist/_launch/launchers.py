"""Turn a launcher's environment (torchrun, MPI, Slurm) into torchrun's ``env://`` variables.

Pure functions, the counterpart of ``mmengine.dist.init_dist``'s ``_init_dist_pytorch``,
``_init_dist_mpi``, ``_init_dist_slurm`` and ``infer_launcher``: they read a mapping (the
process environment by default) and return a new dict; they never write ``os.environ``,
never import torch and never start a process. Where mmengine runs ``scontrol show
hostname`` to find rank 0's host, ``_slurm_hostlist.first_slurm_host`` parses Slurm's
hostlist syntax itself, so a job step needs no Slurm client tools.

Example:
    >>> env = launcher_env(infer_launcher(), num_gpus=torch.cuda.device_count())
    >>> os.environ.update(env)
    >>> torch.distributed.init_process_group("nccl", init_method="env://")
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from aiodist._errors import RendezvousError
from aiodist._launch.slurm_hostlist import first_slurm_host

if TYPE_CHECKING:
    from collections.abc import Mapping

DEFAULT_MASTER_PORT: Final = 29500
"""torch.distributed's default store port; mmengine falls back to it too."""

LAUNCHERS: Final = ("pytorch", "mpi", "slurm")
"""The launchers :func:`launcher_env` understands; ``'none'`` means a single process."""

_HOW: Final = {
    "pytorch": "start the job with torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR "
    "and MASTER_PORT for every process",
    "mpi": "start the job with mpirun or mpiexec (Open MPI, MPICH, Intel MPI or MVAPICH)",
    "slurm": "start every task with srun, inside an sbatch or salloc allocation",
}
_HOW_MASTER_ADDR: Final = (
    "export MASTER_ADDR=<address of rank 0's host> to every rank "
    "(mpirun -x MASTER_ADDR with Open MPI, -genv MASTER_ADDR <host> with MPICH)"
)


@dataclass(frozen=True, slots=True)
class _MpiFlavour:
    rank: str
    size: str
    local_rank: str
    local_size: str


# MVAPICH ahead of MPICH: MVAPICH under Hydra sets PMI_RANK as well, but only its own
# MV2_* names are sure to carry the local rank.
_MPI_FLAVOURS: Final = (
    _MpiFlavour(
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    _MpiFlavour(
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    _MpiFlavour("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
# What infer_launcher looks for: mmengine's Open MPI check, then MPICH/Hydra, then MVAPICH.
_MPI_MARKERS: Final = ("OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")


def infer_launcher(environ: Mapping[str, str] | None = None) -> str:
    """Guess which launcher started this process, in mmengine's order.

    Args:
        environ: The environment to read; defaults to ``os.environ``.

    Returns:
        ``'pytorch'`` if ``WORLD_SIZE`` is set (torchrun), else ``'slurm'`` if
        ``SLURM_NTASKS`` is, else ``'mpi'`` if Open MPI (``OMPI_COMM_WORLD_LOCAL_RANK``),
        MPICH/Hydra (``PMI_RANK``) or MVAPICH (``MV2_COMM_WORLD_RANK``) variables are,
        else ``'none'``.

    Example:
        >>> infer_launcher({"SLURM_NTASKS": "8", "PMI_RANK": "3"})
        'slurm'
    """
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:
        return "pytorch"
    if "SLURM_NTASKS" in env:
        return "slurm"
    if any(name in env for name in _MPI_MARKERS):
        return "mpi"
    return "none"


def launcher_env(
    launcher: str,
    environ: Mapping[str, str] | None = None,
    *,
    port: int | None = None,
    num_gpus: int = 0,
) -> dict[str, str]:
    """Compute the variables ``init_process_group(init_method="env://")`` reads.

    ``'pytorch'`` copies what torchrun set. ``'mpi'`` reads rank and size from Open MPI
    (``OMPI_COMM_WORLD_*``), MVAPICH (``MV2_COMM_WORLD_*``) or MPICH/Intel MPI
    (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``), and needs
    ``MASTER_ADDR`` exported by the user. ``'slurm'`` reads ``SLURM_PROCID``,
    ``SLURM_NTASKS`` and ``SLURM_LOCALID``, and takes ``MASTER_ADDR`` from the
    environment or else the first host of ``SLURM_NODELIST`` (``SLURM_JOB_NODELIST``).

    ``MASTER_PORT`` is, for ``'mpi'`` and ``'slurm'``: ``port``, else ``MASTER_PORT``
    from the environment, else :data:`DEFAULT_MASTER_PORT` (mmengine's order).
    ``LOCAL_RANK`` is the launcher's own local rank, else ``RANK % num_gpus`` when
    ``num_gpus > 0`` (mmengine's fallback), else left out rather than guessed.
    ``LOCAL_WORLD_SIZE`` is included when the launcher says it (for Slurm:
    ``SLURM_NTASKS_PER_NODE``, else this node's entry of ``SLURM_TASKS_PER_NODE``).

    Args:
        launcher: ``'pytorch'``, ``'mpi'`` or ``'slurm'``, e.g. from :func:`infer_launcher`.
        environ: The environment to read; defaults to ``os.environ``. Never modified.
        port: Store port for ``'mpi'`` and ``'slurm'``; torchrun already chose one for
            ``'pytorch'``, so passing it there is an error.
        num_gpus: GPUs per node, used only when the launcher gives no local rank.

    Returns:
        A new dict with ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``,
        plus ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` when known; integers in decimal.

    Raises:
        ValueError: ``launcher`` is not one of :data:`LAUNCHERS` (``'none'`` included),
            ``port`` is outside 1..65535 or given with ``'pytorch'``, or ``num_gpus < 0``.
        RendezvousError: A required variable is missing or empty, is not an integer, or
            is out of range (``RANK >= WORLD_SIZE``); the message names the variable,
            the launcher, and what to do.

    Example:
        >>> env = launcher_env("slurm", {"SLURM_PROCID": "5", "SLURM_NTASKS": "8",
        ...                              "SLURM_LOCALID": "1", "SLURM_NODELIST": "gpu[03-04]"})
        >>> env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"], env["LOCAL_RANK"]
        ('gpu03', '29500', '5', '1')
    """
    if launcher not in LAUNCHERS:
        valid = ", ".join(repr(name) for name in LAUNCHERS)
        hint = (
            " ('none' is a single process: there is nothing to join)" if launcher == "none" else ""
        )
        raise ValueError(f"launcher must be one of {valid}, got {launcher!r}{hint}")
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if port is not None:
        if launcher == "pytorch":
            raise ValueError(
                "port= does not apply to launcher 'pytorch': torchrun chose MASTER_PORT "
                "and its agent listens there; pass port only with 'mpi' or 'slurm'"
            )
        if not 1 <= port <= 65535:
            raise ValueError(f"port must be in 1..65535, got {port}")
    env = os.environ if environ is None else environ
    if launcher == "pytorch":
        return _pytorch_env(env, num_gpus)
    if launcher == "mpi":
        return _mpi_env(env, port, num_gpus)
    return _slurm_env(env, port, num_gpus)


def _pytorch_env(environ: Mapping[str, str], num_gpus: int) -> dict[str, str]:
    rank = _require_int(environ, "pytorch", "RANK")
    world_size = _require_int(environ, "pytorch", "WORLD_SIZE")
    _check_rank("pytorch", "RANK", rank, "WORLD_SIZE", world_size)
    addr = _require(environ, "pytorch", "MASTER_ADDR")
    master_port = _port_var("pytorch", _require(environ, "pytorch", "MASTER_PORT"))
    local_rank = _optional_int(environ, "pytorch", "LOCAL_RANK")
    local_size = _optional_int(environ, "pytorch", "LOCAL_WORLD_SIZE")
    _check_rank("pytorch", "LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_size)
    return _env_vars(addr, master_port, rank, world_size, local_rank, local_size, num_gpus)


def _mpi_env(environ: Mapping[str, str], port: int | None, num_gpus: int) -> dict[str, str]:
    flavour = next(
        (f for f in _MPI_FLAVOURS if any(v in environ for v in (f.rank, f.size, f.local_rank))),
        None,
    )
    if flavour is None:
        names = ", ".join(f.rank for f in _MPI_FLAVOURS)
        raise RendezvousError(f"launcher 'mpi' found none of {names}: {_HOW['mpi']}")
    rank = _require_int(environ, "mpi", flavour.rank)
    world_size = _require_int(environ, "mpi", flavour.size)
    _check_rank("mpi", flavour.rank, rank, flavour.size, world_size)
    local_rank = _optional_int(environ, "mpi", flavour.local_rank)
    local_size = _optional_int(environ, "mpi", flavour.local_size)
    _check_rank("mpi", flavour.local_rank, local_rank, flavour.local_size, local_size)
    addr = _require(environ, "mpi", "MASTER_ADDR", _HOW_MASTER_ADDR)
    master_port = _master_port(environ, "mpi", port)
    return _env_vars(addr, master_port, rank, world_size, local_rank, local_size, num_gpus)


def _slurm_env(environ: Mapping[str, str], port: int | None, num_gpus: int) -> dict[str, str]:
    rank = _require_int(environ, "slurm", "SLURM_PROCID")
    world_size = _require_int(environ, "slurm", "SLURM_NTASKS")
    _check_rank("slurm", "SLURM_PROCID", rank, "SLURM_NTASKS", world_size)
    local_rank = _optional_int(environ, "slurm", "SLURM_LOCALID")
    local_size_var, local_size = _slurm_local_world_size(environ)
    _check_rank("slurm", "SLURM_LOCALID", local_rank, local_size_var, local_size)
    addr = _slurm_master_addr(environ)
    master_port = _master_port(environ, "slurm", port)
    return _env_vars(addr, master_port, rank, world_size, local_rank, local_size, num_gpus)


def _slurm_master_addr(environ: Mapping[str, str]) -> str:
    # An existing MASTER_ADDR wins, as in mmengine; the nodelist is not even parsed then.
    addr = environ.get("MASTER_ADDR", "").strip()
    if addr:
        return addr
    for name in ("SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        nodelist = environ.get(name, "").strip()
        if nodelist:
            try:
                return first_slurm_host(nodelist)
            except ValueError as exc:
                raise RendezvousError(
                    f"launcher 'slurm' cannot read {name}={nodelist!r}: {exc}; "
                    "export MASTER_ADDR=<address of rank 0's host> to skip it"
                ) from exc
    raise RendezvousError(
        "launcher 'slurm' needs SLURM_NODELIST (or SLURM_JOB_NODELIST, or MASTER_ADDR) "
        f"to find rank 0's host: {_HOW['slurm']}, or export MASTER_ADDR=<address of rank 0's host>"
    )


_TASKS_PER_NODE_ITEM: Final = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


def _slurm_local_world_size(environ: Mapping[str, str]) -> tuple[str, int | None]:
    """Tasks on this node, or None when Slurm does not say in a form we can read."""
    value = environ.get("SLURM_NTASKS_PER_NODE", "").strip()
    if value.isdecimal() and int(value) > 0:
        return "SLURM_NTASKS_PER_NODE", int(value)
    # SLURM_TASKS_PER_NODE is compressed per node, in node order: "2(x3),1" is 2,2,2,1.
    name = "SLURM_TASKS_PER_NODE"
    runs: list[tuple[int, int]] = []
    for item in environ.get(name, "").strip().split(","):
        match = _TASKS_PER_NODE_ITEM.fullmatch(item)
        if match is None:
            return name, None
        runs.append((int(match[1]), int(match[2] or 1)))
    if len({count for count, _ in runs}) == 1:
        return name, runs[0][0]
    node_id = environ.get("SLURM_NODEID", "").strip()
    if node_id.isdecimal():
        remaining = int(node_id)
        for count, repeat in runs:
            if remaining < repeat:
                return name, count
            remaining -= repeat
    return name, None


def _env_vars(
    addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    local_rank: int | None,
    local_world_size: int | None,
    num_gpus: int,
) -> dict[str, str]:
    if local_rank is None and num_gpus > 0:
        local_rank = rank % num_gpus
    env = {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(master_port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
    }
    if local_rank is not None:
        env["LOCAL_RANK"] = str(local_rank)
    if local_world_size is not None:
        env["LOCAL_WORLD_SIZE"] = str(local_world_size)
    return env


def _require(environ: Mapping[str, str], launcher: str, name: str, how: str = "") -> str:
    value = environ.get(name)
    if value is None or not value.strip():
        state = "" if value is None else f" (it is set but empty: {value!r})"
        raise RendezvousError(f"launcher {launcher!r} needs {name}{state}: {how or _HOW[launcher]}")
    return value.strip()


_INT: Final = re.compile(r"[+-]?[0-9]+")


def _to_int(launcher: str, name: str, value: str) -> int:
    if _INT.fullmatch(value.strip()) is None:
        raise RendezvousError(
            f"launcher {launcher!r} got {name}={value!r}, which is not an integer; "
            f"check what sets {name} in the job script"
        )
    return int(value)


def _require_int(environ: Mapping[str, str], launcher: str, name: str) -> int:
    return _to_int(launcher, name, _require(environ, launcher, name))


def _optional_int(environ: Mapping[str, str], launcher: str, name: str) -> int | None:
    value = environ.get(name, "")
    return _to_int(launcher, name, value) if value.strip() else None


def _check_rank(
    launcher: str, rank_name: str, rank: int | None, size_name: str, size: int | None
) -> None:
    """Raise unless 0 <= rank < size, for whichever of the two is known."""
    if size is not None and size < 1:
        raise RendezvousError(f"launcher {launcher!r} got {size_name}={size}; it must be >= 1")
    if rank is not None and rank < 0:
        raise RendezvousError(f"launcher {launcher!r} got {rank_name}={rank}; it must be >= 0")
    if rank is not None and size is not None and rank >= size:
        raise RendezvousError(
            f"launcher {launcher!r} got {rank_name}={rank}, outside 0..{size - 1} "
            f"({size_name}={size}); every process of the job must see the same {size_name}"
        )


def _master_port(environ: Mapping[str, str], launcher: str, port: int | None) -> int:
    if port is not None:
        return port
    value = environ.get("MASTER_PORT", "")
    return _port_var(launcher, value) if value.strip() else DEFAULT_MASTER_PORT


def _port_var(launcher: str, value: str) -> int:
    port = _to_int(launcher, "MASTER_PORT", value)
    if not 1 <= port <= 65535:
        raise RendezvousError(
            f"launcher {launcher!r} got MASTER_PORT={value!r}; it must be in 1..65535"
        )
    return port
