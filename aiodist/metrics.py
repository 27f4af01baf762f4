"""Metric aggregation that costs a training step nothing visible: ``MetricAggregator``.

``update(**values)`` accumulates on this rank only (numbers, 0-d tensors and
tensors; CUDA tensors stay on the GPU, updated by kernels, never ``.item()``).
``sync()`` snapshots every metric and starts **one** fused reduction for all of
them; it returns a running ``aiodist.Work`` and the loop goes on computing.

Two routes, chosen once per aggregator and group, inside its first sync, the
same on every rank:

- **Ranks of one host** (shared memory agreed, ``AIODIST_METRICS_SHM`` not ``0``
  on any rank): a shared board (``_metrics.board``). ``sync()`` queues this
  rank's records from the calling thread and returns; no message, no hop to
  the event loop's thread. They are written into shared memory a bucket of
  sixteen syncs at a time (sooner when someone waits for a result); a handle
  settles when someone looks at it, and a bucket whose handles are all gone
  is never copied out. An interval with one ``update`` of host numbers, the
  case of a sync every step, is kept as it came, and a bucket of them is
  written as their key set's prefix once and every update's numbers
  (``_metrics.record``). A sync every step costs the step about four
  microseconds of Python (six metrics, warm), a third of it reading the values.
- **Otherwise** the data plane, as follows.

How the key set is agreed (measured, then chosen): every sync exchanges one
float64 buffer laid out by the key set agreed at the previous sync, with
recursive doubling: ``log2 P`` exchanges of ``8 * (4 * metrics + 1)`` bytes
(sum, count, update and non-finite slots; min/max and "last" slots beside
them, all reduced in the same pass). A flag slot in that buffer says whether
some rank has a metric outside the agreed set; only then (and at the first
sync) the ranks exchange their ``{name: reduction}`` tables (recursive
doubling again, a union) and reduce once more on the new layout. The agreed
set only grows, so keys that appear on some ranks or some steps cost the
extra round once. Gathering ``(keys, values)`` records with
``all_gather_object`` every sync would need no agreement, but every rank would
receive and decode ``P`` records each time (``P - 1`` messages instead of
``log2 P``), which grows with the job; the flag costs one slot.

Reductions per metric: ``mean`` (weighted by the count passed to ``update``),
``sum``, ``min``, ``max``, and ``last`` (the lowest rank's latest value, rank 0's
when it has one). NaN and infinities propagate as torch would propagate them
and are counted in ``MetricResults.nonfinite``.

From plain code the data-plane route starts on ``aiodist.sync``'s loop thread
(through ``aiodist._sync.portal``, as every ``aiodist.sync`` operation does); with
nothing initialised a sync resolves at once to this process's own values (and
``on_done`` runs at once, in the caller's thread).

The end: each aggregator registers a close hook on the group it syncs on (the
board registers its own), so ``destroy_process_group``, and a process that
ends without it, push out every sync still queued and wait (bounded) until it
completed on every rank and its ``on_done`` ran. ``flush()`` pushes them out
earlier, without waiting for the other ranks.

Example:
    >>> agg = MetricAggregator({"tokens": "sum", "grad_norm": "max"}, every=10)
    >>> for step, batch in enumerate(loader):
    ...     loss = train_step(batch)
    ...     agg.update(len(batch), loss=loss.detach(), tokens=batch.numel())
    ...     agg.step(on_done=lambda r: print(r.summary(prefix=f"step {step} | ")))
"""

from __future__ import annotations

import asyncio
import logging
from threading import get_ident
from typing import TYPE_CHECKING, Any

from aiodist._group.lingering import linger
from aiodist._group.work import Work
from aiodist._group.world import is_initialized, resolve_group
from aiodist._metrics.board import Board
from aiodist._metrics.fused import Route, reduce_locally, start_sync
from aiodist._metrics.record import Single, encode_host
from aiodist._metrics.results import MetricResults, MetricsWriter, deliver, deliver_when_done
from aiodist._metrics.state import (
    INT_LIMIT,
    REDUCTIONS,
    Accumulator,
    Reduction,
    check_reduction,
    check_update,
    host_number,
)
from aiodist._metrics.state import take_snapshot as _take_snapshot
from aiodist._sync import portal
from aiodist._torch import handoff

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from aiodist._group.group import ProcessGroup
    from aiodist._metrics.record import Record
    from aiodist._metrics.state import Snapshot

__all__ = ["REDUCTIONS", "MetricAggregator", "MetricResults", "MetricsWriter", "Reduction"]

logger = logging.getLogger(__name__)

_MAX_KEY_SETS = 64  # single encodings an aggregator keeps
_tensor: type | None = None  # torch.Tensor, once torch is imported here


def _torch_tensor() -> type:
    global _tensor
    import torch

    _tensor = torch.Tensor
    return _tensor


class MetricAggregator:
    """Accumulate metrics locally; reduce them all across ranks in one fused collective.

    Args:
        reductions: ``{name: reduction}`` for metrics that do not use ``default``;
            a reduction is one of ``mean``, ``sum``, ``min``, ``max``, ``last``.
            Every rank must give a metric the same reduction.
        default: The reduction of metrics not named in ``reductions``.
        group: Defaults to the world group (or none: world size 1).
        every: ``step()`` syncs on every ``every``-th call (None: never).
        on_done: Called with the results of each sync ``step()`` starts.

    Raises:
        ValueError: An unknown reduction, or ``every`` below 1.

    Example:
        >>> agg = MetricAggregator({"tokens": "sum"})
        >>> agg.update(32, loss=0.7, tokens=4096)      # 32 samples of mean loss 0.7
        >>> results = await agg.sync()                  # or agg.sync().wait()
        >>> results["loss"], results.summary()
    """

    def __init__(
        self,
        reductions: Mapping[str, str] | None = None,
        *,
        default: str = "mean",
        group: ProcessGroup | None = None,
        every: int | None = None,
        on_done: Callable[[MetricResults], object] | None = None,
    ) -> None:
        self._default = check_reduction("(default)", default)
        self._reductions = {k: check_reduction(k, v) for k, v in (reductions or {}).items()}
        if every is not None and (isinstance(every, bool) or every < 1):
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        self.every = every
        self.on_done = on_done
        self._group = group
        self._accs: dict[str, Accumulator] = {}
        # The interval's update while it is its only one, all host numbers: (names,
        # [weight, *values]). A sync every step writes it as it is (``record.Single``).
        self._single: tuple[tuple[str, ...], list[float]] | None = None
        self._singles: dict[tuple[str, ...], Single] = {}  # encodings by key set
        self._steps = 0
        self._syncs = 0  # every rank numbers its syncs alike: the shared board's index
        # The route the latest sync started on the loop takes; lives on the group's loop.
        self._agreed: asyncio.Future[Route] | None = None
        self._agreed_group: ProcessGroup | None = None
        self._first = 0  # the number of the first sync on ``_agreed_group``
        # Set once syncs go through the shared board and none waits on the loop:
        # then ``sync()`` writes from the caller's thread (see ``_metrics.board``).
        self._board: Board | None = None

    def reduction(self, name: str) -> Reduction:
        """The reduction ``name`` gets."""
        return self._reductions.get(name, self._default)

    @property
    def pending(self) -> list[str]:
        """Metrics updated on this rank since the last sync."""
        return sorted(self._single[0] if self._single is not None else self._accs)

    def update(self, weight: float | Any = 1, /, **values: Any) -> None:
        """Accumulate ``values`` on this rank; no communication, no GPU sync.

        Args:
            weight: The count each value stands for (positional: a batch size,
                a number of tokens); a number or a one-element tensor (a CUDA
                one stays on the GPU). ``mean`` weights by it; every metric
                reports its total in ``MetricResults.counts``.
            **values: Numbers, 0-d tensors, or tensors (each element one
                observation: ``mean`` of a tensor is its mean, ``max`` its
                largest element, ``last`` its mean).

        Raises:
            TypeError: A value or the weight is neither a number nor a tensor.
            ValueError: A negative weight, or a weight tensor with several elements.
        """
        kind = type(weight)
        if (
            self._single is None
            and not self._accs
            and (kind is float or kind is int)
            and 0 <= weight < INT_LIMIT
        ):
            # The interval's first update, of host numbers: kept as it came (the names,
            # not the values: no tensor is kept alive). Inlined: it runs every step.
            tensor = _tensor or _torch_tensor()
            xs: list[float] = [weight]
            for value in values.values():
                vkind = type(value)
                if vkind is tensor:
                    if not value.is_cpu:
                        break
                    try:
                        x = value.item()
                    except RuntimeError:  # not one element
                        break
                    if type(x) is not float and type(x) is not int:
                        break  # a bool or complex tensor
                elif vkind is float:
                    x = value
                elif vkind is int and -INT_LIMIT < value < INT_LIMIT:
                    x = value  # a float holds it (the general path raises for one it cannot)
                else:
                    break  # anything else takes the general path, which checks it
                xs.append(x)
            else:
                self._single = (tuple(values), xs)
                return
        else:
            self._fold_single()
        self._update(weight, values)

    def _update(self, weight: float | Any, values: dict[str, Any]) -> None:
        host_weight = check_update(weight, values)  # all checked first: no partial update
        accs = self._accs
        for name, value in values.items():
            acc = accs.get(name)
            if acc is None:
                acc = accs[name] = Accumulator(self.reduction(name))
            # The usual case, a host number or a one-element CPU tensor, in one call.
            if host_weight is not None and acc.record is None:
                x = host_number(value)
                if x is not None:
                    acc.add_number(x, host_weight)
                    continue
            acc.add(value, weight)

    def reset(self) -> None:
        """Drop what this rank accumulated since the last sync."""
        self._accs = {}
        self._single = None

    def _fold_single(self) -> None:
        """Turn the interval's single update, kept as it came, into accumulators."""
        single = self._single
        if single is None:
            return
        self._single = None
        names, xs = single
        w = float(xs[0])
        for name, x in zip(names, xs[1:], strict=True):
            acc = self._accs[name] = Accumulator(self.reduction(name))
            acc.add_number(float(x), w)

    def sync(
        self, *, on_done: Callable[[MetricResults], object] | None = None
    ) -> Work[MetricResults]:
        """Start reducing every metric across ranks; return at once.

        Every rank of the group must call it, in the same order relative to
        other collectives. The local values start over.

        Args:
            on_done: Called with the results once they are known, on the event
                loop's thread (``aiodist.sync``'s loop thread in plain code), with
                no one awaiting; errors it raises are logged. Not called when
                the sync fails (the Work holds the error).

        Returns:
            Work resolving to ``MetricResults``: metrics no rank updated since
            the previous sync are absent. Already done when not initialised.

        Raises:
            CollectiveMismatchError: Ranks give a metric different reductions
                (from the Work, on every rank).

        Cancellation:
            Cancelling a task that awaits the Work does not cancel the sync; it
            completes on every rank. A timeout marks the group broken.

        Example:
            >>> work = agg.sync(on_done=lambda r: print(r.summary()))
        """
        number = self._syncs
        self._syncs = number + 1
        board = self._board
        if board is not None:
            # Straight onto the board from this thread: only while the group and its
            # session are usable (a destroyed default group went with its session; a
            # new one, or one that replaced a broken one, takes the loop path, which
            # agrees afresh), and only when this sync's sequence number comes next in
            # call order: on the loop's thread, or from plain code with no earlier
            # operation still on its way to the loop (aiodist.sync's, or torch's on the
            # aiodist backend).
            # Every step: a few attribute reads, no helper calls.
            g, session = board.group, board.session
            if (
                # A failed member: the board fails what needs it, while its group is still
                # the one to sync on (shrink_group replaced the default group: agree afresh).
                (g.error is None or (g.keeps_p2p and resolve_group(self._group) is g))
                and not g.closed
                and session.error is None
                and not session.closed
                and (get_ident() == board.loop_thread or handoff.quiet())
            ):
                record: Record | None = self._single  # one update: encoded when written
                if record is not None:
                    self._single = None
                else:
                    record = encode_host(self._accs)  # None: a value lives on a GPU
                    if record is not None:
                        self._accs = {}
                if record is not None:
                    work = board.queue(number - self._first, g.next_seq(), record)
                    if on_done is not None:
                        deliver_when_done(work, on_done, board.loop)
                    return work
        single, self._single = self._single, None
        accs = self._accs
        if accs:
            self._accs = {}
        if single is not None:
            self._single = single
            self._fold_single()
            accs, self._accs = self._accs, {}
        snapshot = _take_snapshot(accs)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # plain code: start it on aiodist.sync's loop thread
            # No round trip to the loop thread: a training step must not wait for it.
            return portal.start_soon(self._start, snapshot, on_done, number)
        return self._start(snapshot, on_done, number)

    def step(
        self, *, on_done: Callable[[MetricResults], object] | None = None
    ) -> Work[MetricResults] | None:
        """Count a step; sync on every ``every``-th one, else return None.

        Ranks count their own calls, so they agree on when to sync without
        talking. ``on_done`` defaults to the aggregator's.
        """
        self._steps += 1
        if self.every is None or self._steps % self.every:
            return None
        return self.sync(on_done=on_done or self.on_done)

    def _single_encoding(self, names: tuple[str, ...]) -> Single:
        """The single encoding of ``names`` (the board's, when it writes a lone update)."""
        single = self._singles.get(names)
        if single is None:
            if len(self._singles) >= _MAX_KEY_SETS:
                self._singles.clear()
            single = self._singles[names] = Single(names, [self.reduction(n) for n in names])
        return single

    def _start(
        self,
        snapshot: Snapshot,
        on_done: Callable[[MetricResults], object] | None,
        number: int,
    ) -> Work[MetricResults]:
        g = resolve_group(self._group)
        work: Work[MetricResults]
        if g is None:
            work = Work.completed(
                MetricResults(reduce_locally(snapshot), snapshot.reductions), "metrics.sync"
            )
        else:
            if g is not self._agreed_group:  # a new default group: agree afresh
                self._agreed, self._agreed_group, self._first = None, g, number
                self._board = None
                g.on_close(self._group_closing)
            previous = self._agreed
            agreed: asyncio.Future[Route] = asyncio.get_running_loop().create_future()
            work = start_sync(g, snapshot, previous, agreed, number - self._first)
            self._agreed = agreed  # only once started: a refused sync leaves the chain as it was
            if agreed.done():  # it went onto the board at once
                self._route_known(agreed)
            else:
                agreed.add_done_callback(self._route_known)
        if on_done is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # plain code, not initialised: no loop, and done already
                deliver(work, on_done)
            else:
                deliver_when_done(work, on_done, loop)
        return work

    def flush(self) -> Work[None]:
        """Push out every sync this rank started; return once they are handed to the peers.

        Syncs between ranks of one host are queued and written to the shared
        board a bucket at a time: ``flush`` writes what is queued now. A sync
        on the data plane goes out when the one before it has agreed on the
        key set, and that agreement is part of its exchange: ``flush`` waits
        for the latest sync started from the event loop to complete. A sync
        from plain code that is still on its way to the loop thread is started
        first. Nothing waits for the other ranks' syncs (that is what awaiting
        a sync's ``Work`` does).

        ``destroy_process_group`` and the end of the process (the end of
        ``asyncio.run``, interpreter exit) flush every aggregator and wait,
        bounded, until its syncs are complete on every rank and their
        ``on_done`` callbacks have run: call ``flush`` to hand syncs over
        earlier, say before a long pause of this rank.

        Returns:
            On the event loop, a running ``Work`` to await. From plain code
            (``aiodist.sync``'s loop thread runs the group), it blocks until
            flushed and returns a done ``Work``. Done at once when nothing is
            pending (or nothing is initialised).

        Raises:
            RuntimeError: Called from plain code while the group lives on an
                event loop of your own (flush there with ``await agg.flush()``).

        Cancellation:
            Cancelling a task that awaits the Work does not stop the flush.

        Example:
            >>> agg.sync(on_done=log)
            >>> await agg.flush()      # from plain code: agg.flush()
        """
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # plain code
            if self._syncs and is_initialized():
                # Through the loop thread, after the syncs still on their way there.
                portal.call(self._flushed, False)
            return Work.completed(None, "metrics.flush")
        loop = self._pending_loop()
        if loop is None:
            return Work.completed(None, "metrics.flush")
        if running is not loop:
            raise RuntimeError(
                "MetricAggregator.flush() was called on an event loop other than its group's; "
                "call it on the loop that joined the job"
            )
        return Work(linger(self._flushed(complete=False)), "metrics.flush")

    def _pending_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop that runs this aggregator's syncs, or None when none can be pending."""
        g = self._agreed_group
        if g is None or g.closed or g.session.closed:
            return None  # never synced on a group, or its close settled every sync
        if self._agreed is not None:
            return self._agreed.get_loop()
        return self._board.loop if self._board is not None else None

    async def _flushed(self, complete: bool) -> None:
        """Wait until the syncs started on the loop took their route; drain the board's."""
        while (agreed := self._agreed) is not None and not agreed.done():
            await asyncio.wait([agreed])  # the latest one: syncs take their routes in order
        board = self._board
        if agreed is not None and not agreed.cancelled() and agreed.exception() is None:
            route = agreed.result()
            if isinstance(route, Board):
                board = route
        if board is not None:
            await board.drain(complete=complete)

    def _group_closing(self) -> asyncio.Task[None] | None:
        """Close hook of the group syncs run on: every sync completes on every rank first."""
        g, agreed = self._agreed_group, self._agreed
        if g is None or agreed is None or agreed.done():
            return None  # the board's own close hook drains what it holds
        task = linger(self._flushed(complete=True), name="aiodist-metrics-flush")
        inflight = g.session.inflight  # the session's close waits for it too
        inflight.add(task)
        task.add_done_callback(inflight.discard)
        return task

    def _route_known(self, agreed: asyncio.Future[Route]) -> None:
        # Syncs go through the board: later ones may write directly (posts may
        # overtake syncs still queued on the loop; each has its own slot).
        if not agreed.cancelled() and agreed.exception() is None:
            route = agreed.result()
            if isinstance(route, Board) and route.group is self._agreed_group:
                route.single_encoding = self._single_encoding
                self._board = route
