"""The one ordered thread that issues a group's torch.distributed calls.

A daemon thread of our own, not a ``ThreadPoolExecutor``'s: the interpreter
joins those before its exit handlers run and refuses them work from then on,
so torch's group could not be destroyed at exit (torch warns about a group
never destroyed), and a call stuck in torch would hang the exit. NCCL hangs
when one group's collectives are issued from several threads: one thread per
group, in call order (see ``bridge``).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")


class IssuingThread(Executor):
    """One daemon thread that runs the calls submitted to it, in order.

    Usable until ``shutdown``, at interpreter exit included (see the module
    docstring for why it is not a ``ThreadPoolExecutor``).
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._calls.put((future, lambda: fn(*args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._calls.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, call, item  # nothing of a finished call stays alive here
