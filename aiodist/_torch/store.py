"""A ``torch.distributed.Store`` over the job's own key-value store.

torch.distributed needs a store to bring up gloo and NCCL; this one forwards
to aiodist's (the rendezvous server's), so a job needs one ``init_method`` and
one port. torch calls it from its own threads (the thread running
``init_process_group``, gloo's and NCCL's workers); each call runs the async
operation on the event loop that joined the job and waits for it in the
calling thread. Never call it from the loop's own thread: it would wait for
itself.

This module imports torch at the top: ``bridge`` imports it only when
a torch backend is brought up.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypeVar

from torch._C._distributed_c10d import Store as TorchStore

from aiodist._control.store import REPLY_GRACE
from aiodist._group.work import running_loop

if TYPE_CHECKING:
    from collections.abc import Coroutine
    from datetime import timedelta

    from aiodist._control.store import Store
    from aiodist._group.group import ProcessGroup

T = TypeVar("T")


class LoopStore(TorchStore):
    """torch's Store interface, served by ``group``'s job store on ``loop``.

    Args:
        group: The group whose store it is; its timeout is the time a waiting
            operation may take (torch's ``timeout``).
        loop: The event loop that joined the job (and keeps running).
        prefix: Prepended to every key after ``torch/``, so torch's keys never meet
            the user's.
    """

    def __init__(
        self, group: ProcessGroup, loop: asyncio.AbstractEventLoop, prefix: str = ""
    ) -> None:
        super().__init__()
        self._store: Store = group.store
        self._loop = loop
        self._prefix = "torch/" + prefix
        self._timeout = group.timeout

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if running_loop() is self._loop:
            coro.close()
            raise RuntimeError(
                "the torch bridge's store was called on the event loop's thread; it must be "
                "called from a worker thread (run torch.distributed calls in a thread)"
            )
        seconds = self._timeout if timeout is None else timeout
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(seconds + REPLY_GRACE)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: str | bytes) -> None:
        self._run(self._store.set(self._key(key), value))

    def get(self, key: str) -> bytes:
        return self._run(self._store.get(self._key(key), self._timeout))

    def add(self, key: str, amount: int) -> int:
        return self._run(self._store.add(self._key(key), int(amount)))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._run(self._store.compare_set(self._key(key), expected, desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        if seconds <= 0:  # torch's "no timeout"
            seconds = self._timeout
        self._run(self._store.wait([self._key(k) for k in keys], seconds), seconds)

    def check(self, keys: list[str]) -> bool:
        return self._run(self._store.check([self._key(k) for k in keys]))

    def delete_key(self, key: str) -> bool:
        return self._run(self._store.delete_key(self._key(key)))

    def num_keys(self) -> int:
        return self._run(self._store.num_keys())

    def clone(self) -> LoopStore:
        # Every call is its own request on the loop, so one object serves any number of
        # threads. A new Python object would be dropped while torch still holds its C++
        # half, and torch's calls on it would fail.
        return self

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()
