"""Worker names: ``torch.distributed.rpc``'s ``init_rpc(name)`` and ``WorkerInfo``.

aiodist's remote calls address a worker by its global rank. ``init_rpc`` also
gives each rank a name, as torch's does: every rank contributes its own, the
table is the same on every rank (it comes from one ``all_gather_object``), and
``to`` may then be a rank, a name or a ``WorkerInfo``. The table belongs to the
session it was made in, and names the ranks as they were then (a
``shrink_group`` later renumbers the ranks, not the table).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

    from aiodist._group.session import Session

#: torch.distributed.rpc allows names of up to 128 characters.
MAX_NAME_CHARS: Final = 128


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker of the job, as ``torch.distributed.rpc.WorkerInfo``: its name and rank."""

    name: str
    id: int


@dataclass(frozen=True, slots=True)
class _Names:
    mine: WorkerInfo
    by_name: dict[str, WorkerInfo]
    by_rank: dict[int, WorkerInfo]


_TABLES: Final[weakref.WeakKeyDictionary[Session, _Names]] = weakref.WeakKeyDictionary()


def check_name(name: object) -> str:
    """``name`` if it can name a worker, else ``ValueError`` saying why (before any exchange)."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(
            f"init_rpc's name must be a non-empty string of at most {MAX_NAME_CHARS} "
            f"characters, got {name!r}"
        )
    return name


def register(session: Session, names: Sequence[str], rank: int) -> WorkerInfo:
    """Keep the job's table (``names[r]`` is rank ``r``'s); this rank's ``WorkerInfo``.

    Raises:
        ValueError: Two ranks gave the same name (every rank raises it: they
            all hold the same list).
    """
    by_name: dict[str, WorkerInfo] = {}
    twice: dict[str, list[int]] = {}
    for r, name in enumerate(names):
        if name in by_name:
            twice.setdefault(name, [by_name[name].id]).append(r)
        by_name[name] = WorkerInfo(name, r)
    if twice:
        which = "; ".join(f"{n!r} by ranks {ranks}" for n, ranks in twice.items())
        raise ValueError(f"rpc worker names must be unique, but {which}: give each rank its own")
    mine = WorkerInfo(names[rank], rank)
    _TABLES[session] = _Names(mine, by_name, {info.id: info for info in by_name.values()})
    return mine


def registered(session: Session) -> bool:
    """True once ``init_rpc`` named the workers of ``session``."""
    return session in _TABLES


def names_of(session: Session, what: str) -> _Names:
    """The table ``init_rpc`` made in ``session``.

    Raises:
        RuntimeError: ``init_rpc`` was not called in this job.
    """
    table = _TABLES.get(session)
    if table is None:
        raise RuntimeError(f"{what} needs worker names: call aiodist.rpc.init_rpc(name) first")
    return table


def lookup(table: _Names, name: str) -> WorkerInfo:
    """The worker named ``name``, else ``ValueError`` listing the names there are."""
    info = table.by_name.get(name)
    if info is None:
        known = ", ".join(sorted(table.by_name))
        raise ValueError(f"no rpc worker is named {name!r} (the workers: {known})")
    return info


def worker(session: Session, rank: int) -> WorkerInfo:
    """Rank ``rank``'s ``WorkerInfo``: its name from ``init_rpc``, else ``"rank<N>"``."""
    table = _TABLES.get(session)
    info = None if table is None else table.by_rank.get(rank)
    return WorkerInfo(f"rank{rank}", rank) if info is None else info


def rank_of(session: Session, to: object) -> object:
    """``to`` as a rank: a name or a ``WorkerInfo`` looked up; anything else as given."""
    if isinstance(to, WorkerInfo):
        return to.id
    if isinstance(to, str):
        return lookup(names_of(session, f"a call to {to!r}"), to).id
    return to
