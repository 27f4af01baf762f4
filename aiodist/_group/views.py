"""Membership views of an elastic job: who is in it, epoch by epoch.

The server owns the sequence (``_server/membership.py``): each membership change of
a formed job (a join, a failure, a leave) is one epoch. A member (its session)
follows it from the server's notices, in the order the server sent them: a join carries
the whole view and its epoch; a failure or a leave moves the view on by one.
Groups are formed over a view (``regroup``), never over "whoever is alive".
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable

# Views a member keeps, so that a watcher that fell behind still sees each one.
MAX_VIEWS: Final = 64


@dataclass(frozen=True, slots=True)
class MembershipView:
    """One membership of the job: its epoch and the ranks alive in it.

    Attributes:
        epoch: How many membership changes the job has had since it formed.
        ranks: The job's ranks alive, sorted (ranks of the job, as
            ``regroup`` takes them; newcomers have the next ranks never used).
        joined: The ranks that joined in this change.
        left: The ranks that failed or left in this change.
    """

    epoch: int
    ranks: tuple[int, ...]
    joined: tuple[int, ...] = ()
    left: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        """How many ranks are alive in this view."""
        return len(self.ranks)


class Views:
    """The views this member has seen, the latest last; awaitable."""

    def __init__(self, epoch: int, ranks: Iterable[int]) -> None:
        self.history: collections.deque[MembershipView] = collections.deque(maxlen=MAX_VIEWS)
        self.history.append(MembershipView(epoch, tuple(sorted(ranks))))
        self._changed = asyncio.Event()
        #: A newcomer's first view, until it regrouped: the view its members meet it at
        #: when they step one epoch at a time, even when later changes came before it asked.
        self.join_view: MembershipView | None = None

    @property
    def current(self) -> MembershipView:
        return self.history[-1]

    def joined(self, epoch: int, ranks: Iterable[int], joined: Iterable[int]) -> None:
        """The server's view after a join (it carries the whole view)."""
        if epoch <= self.current.epoch and self.current.epoch >= 0:
            return  # never move back
        view = MembershipView(epoch, tuple(sorted(ranks)), tuple(sorted(joined)))
        if self.current.epoch < 0:
            self.join_view = view
        self._add(view)

    def gone(self, rank: int) -> None:
        """``rank`` failed or left: the next epoch."""
        now = self.current
        if now.epoch < 0:
            return  # a newcomer before its first view: that view counts this change
        self._add(
            MembershipView(now.epoch + 1, tuple(r for r in now.ranks if r != rank), (), (rank,))
        )

    def _add(self, view: MembershipView) -> None:
        self.history.append(view)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def after(self, epoch: int) -> MembershipView:
        """The first view kept with an epoch above ``epoch``, once there is one."""
        while True:
            for view in self.history:
                if view.epoch > epoch:
                    return view
            await self._changed.wait()

    async def watch(self) -> AsyncIterator[MembershipView]:
        """Every view from the current one on, each once, in epoch order."""
        view = self.current
        if view.epoch < 0:
            view = await self.after(-1)
        while True:
            yield view
            view = await self.after(view.epoch)
