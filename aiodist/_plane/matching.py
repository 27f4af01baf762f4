"""Sans-IO message matching: posted receives against arriving messages.

Every data-plane message carries a *key* (group, tag or collective sequence
number, step) and comes from a source rank. A receive names a key and either
a source or any source (``None``). The rules, as MPI's:

- A message matches the *earliest posted* receive with its key whose source is
  its source or any source.
- A receive matches the *earliest arrived* unexpected message with its key
  (from its source, when it names one).
- Messages from one source with one key match in the order they arrived
  (non-overtaking); the transport keeps them in send order.

The matcher stores opaque receive and message objects; it never touches
buffers, sockets or futures.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

R = TypeVar("R")  # a posted receive
M = TypeVar("M")  # an unexpected message

Key = tuple[int, ...]


class Matcher(Generic[R, M]):
    """Match receives to messages by (source, key)."""

    def __init__(self) -> None:
        self._order = itertools.count()
        self._posted: dict[tuple[int, Key], deque[tuple[int, R]]] = {}
        self._posted_any: dict[Key, deque[tuple[int, R]]] = {}
        self._unexpected: dict[Key, deque[tuple[int, M]]] = {}

    def __len__(self) -> int:
        """Posted receives plus buffered messages (zero when idle)."""
        return (
            sum(map(len, self._posted.values()))
            + sum(map(len, self._posted_any.values()))
            + sum(map(len, self._unexpected.values()))
        )

    @property
    def num_unexpected(self) -> int:
        return sum(map(len, self._unexpected.values()))

    def post(self, src: int | None, key: Key, recv: R) -> tuple[int, M] | None:
        """Post a receive. Returns ``(source, message)`` if one already arrived, else None."""
        queue = self._unexpected.get(key)
        if queue:
            for i, (msg_src, msg) in enumerate(queue):
                if src is None or msg_src == src:
                    del queue[i]
                    if not queue:
                        del self._unexpected[key]
                    return msg_src, msg
        entry = (next(self._order), recv)
        if src is None:
            self._posted_any.setdefault(key, deque()).append(entry)
        else:
            self._posted.setdefault((src, key), deque()).append(entry)
        return None

    def arrive(self, src: int, key: Key) -> R | None:
        """A message's header arrived: take the receive it matches, or None."""
        specific = self._posted.get((src, key))
        anysrc = self._posted_any.get(key)
        if specific and (not anysrc or specific[0][0] < anysrc[0][0]):
            _, recv = specific.popleft()
            if not specific:
                del self._posted[(src, key)]
            return recv
        if anysrc:
            _, recv = anysrc.popleft()
            if not anysrc:
                del self._posted_any[key]
            return recv
        return None

    def withdraw(self, src: int | None, key: Key, recv: R) -> bool:
        """Take back ``recv``, posted with ``src`` and ``key``, if nothing matched it yet."""
        table: dict[object, deque[tuple[int, R]]] = (
            self._posted_any if src is None else self._posted  # type: ignore[assignment]
        )
        where: object = key if src is None else (src, key)
        queue = table.get(where)
        if queue is None:
            return False
        for i, (_, posted) in enumerate(queue):
            if posted is recv:
                del queue[i]
                if not queue:
                    del table[where]
                return True
        return False

    def buffer(self, src: int, key: Key, msg: M) -> None:
        """Keep a message nobody has asked for yet."""
        self._unexpected.setdefault(key, deque()).append((src, msg))

    def drop_unexpected_where(self, drop: Callable[[Key], bool]) -> int:
        """Forget the buffered messages whose key satisfies ``drop``; return how many."""
        keys = [k for k in self._unexpected if drop(k)]
        return sum(len(self._unexpected.pop(k)) for k in keys)

    def take_posted_from(self, src: int) -> list[R]:
        """Remove and return the receives posted for ``src`` by name (not any-source ones)."""
        out: list[tuple[int, R]] = []
        for src_key in [k for k in self._posted if k[0] == src]:
            out.extend(self._posted.pop(src_key))
        return [recv for _, recv in sorted(out, key=lambda e: e[0])]

    def take_posted_where(self, keep: Callable[[Key], bool]) -> list[R]:
        """Remove and return the posted receives whose key satisfies ``keep``."""
        out: list[tuple[int, R]] = []
        for src_key in [k for k in self._posted if keep(k[1])]:
            out.extend(self._posted.pop(src_key))
        for key in [k for k in self._posted_any if keep(k)]:
            out.extend(self._posted_any.pop(key))
        return [recv for _, recv in sorted(out, key=lambda e: e[0])]
