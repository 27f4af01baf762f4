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
the shutdown), and ``aiodist.sync``'s exit handler reads ``sys.last_value``
(the interpreter's record of an uncaught exception).
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_REASON_CHARS", "failure_of", "interrupted"]

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
