"""How a program that ends with an exception uncaught ends its membership.

A rank whose program ends by an uncaught exception or ``sys.exit`` with a
non-zero code has not finished its part of the job: it did not leave, it
failed. Its session then closes at once (the operations in flight
fail instead of being waited for: the process is going away) and tells the
server why, so that its peers hear that it *failed* (``RankFailedError``
naming it and the exception) and the job is recorded as failed, not as
having ended well.

The exception is found where the program's end sees it: ``asyncio.run``
shuts its loop down while the exception propagates (``sys.exc_info()`` in
the shutdown), and the handlers registered with ``at_exit`` (``aiodist.sync``'s
loop thread, an rpc world) get it from whichever comes first:

- in a ``multiprocessing`` child (``torch.multiprocessing.spawn``, a
  ``Process``), the child's own end: its target returned, raised, or called
  ``sys.exit`` (``mp.spawn`` turns an exception into ``sys.exit(1)``), seen by
  a multiprocessing finalizer while that exception propagates, before the
  interpreter's exit (which a forked child skips altogether);
- otherwise interpreter exit, with ``sys.last_value`` (the interpreter's record
  of an uncaught exception). A plain script's own ``sys.exit(n)`` is the one
  end nothing can see: the interpreter keeps its code from exit handlers.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

#: The longest failure reason sent to the server (the wire's bound on ``Leave.reason``).
MAX_REASON_CHARS: Final = 1000


def failure_of(exc: BaseException | None) -> str | None:
    """Why a program that ends with ``exc`` uncaught failed; None if it did not fail.

    ``SystemExit`` with code 0 or None is a normal end; a cancellation is not an
    end of the program (only a task of it ended). Ctrl-C (``KeyboardInterrupt``)
    is no failure either: the rank leaves at once, and its peers hear that it left.
    """
    if exc is None or isinstance(exc, GeneratorExit):
        return None
    if isinstance(exc, SystemExit):
        if exc.code is None or exc.code == 0:
            return None
        return f"its program exited with sys.exit({exc.code!r})"[:MAX_REASON_CHARS]
    if not isinstance(exc, Exception):
        return None  # CancelledError and the like: not the program's end
    text = str(exc).splitlines()[0] if str(exc) else ""
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"its program ended with an uncaught exception ({what})"[:MAX_REASON_CHARS]


def interrupted(exc: BaseException | None) -> bool:
    """True if the program is ending by Ctrl-C: it leaves at once, without waiting."""
    return isinstance(exc, KeyboardInterrupt)


_handlers: list[Callable[[BaseException | None], object]] = []
_armed_in = 0  # the pid whose end runs the handlers


def at_exit(fn: Callable[[BaseException | None], object]) -> None:
    """Call ``fn(exc)`` once at the end of this program (see the module docstring).

    ``exc`` is the exception the program ends with, None if it ends normally.
    Handlers run last registered first; registering one twice runs it once.
    """
    global _armed_in
    if fn not in _handlers:
        _handlers.append(fn)
    if _armed_in == os.getpid():
        return
    _armed_in = os.getpid()
    atexit.register(_at_interpreter_exit)
    mp = sys.modules.get("multiprocessing")
    if mp is not None and mp.parent_process() is not None:  # a multiprocessing child
        import multiprocessing.util

        # Run by the child's bootstrap once its target ended, while what ended it
        # propagates; high priority: before the finalizers of its queues and pools.
        multiprocessing.util.Finalize(None, _at_child_end, exitpriority=100)


def _at_interpreter_exit() -> None:
    _run(getattr(sys, "last_value", None))


def _at_child_end() -> None:
    _run(sys.exc_info()[1])


def _run(exc: BaseException | None) -> None:
    if _armed_in != os.getpid():
        return  # a forked child's copy of its parent's handlers
    while _handlers:
        fn = _handlers.pop()
        try:
            fn(exc)
        except Exception:
            logger.exception("an exit handler of aiodist failed")


def _forget_after_fork() -> None:
    global _armed_in
    _handlers.clear()
    _armed_in = 0


os.register_at_fork(after_in_child=_forget_after_fork)
