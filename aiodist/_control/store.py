"""The job's key-value store, as a client sees it: TCPStore's operations, awaitable."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Final

from aiodist._wire.messages import (
    StoreAdd,
    StoreCheck,
    StoreCompareSet,
    StoreDeleteKey,
    StoreGet,
    StoreNumKeys,
    StoreSet,
    StoreWait,
    pack_keys,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from aiodist._control.channel import ControlChannel

# How much longer than the server-side timeout the client waits for its answer.
REPLY_GRACE: Final = 5.0


def as_seconds(timeout: float | timedelta | None, default: float) -> float:
    """Convert a torch-style timeout (seconds or ``timedelta``) to float seconds."""
    if timeout is None:
        return default
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {seconds}")
    return seconds


def _as_bytes(value: str | bytes, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{what} must be str or bytes, got {type(value).__name__}")


def _check_key(key: str) -> str:
    if not isinstance(key, str):
        raise TypeError(f"store keys are str, got {type(key).__name__}")
    return key


def _check_keys(keys: Iterable[str]) -> list[str]:
    checked = list(keys)
    try:
        "".join(checked)  # str only, checked in C: waits on 1000s of keys (3x isinstance's speed)
    except TypeError:
        for key in checked:
            _check_key(key)  # raises, naming the first key that is not a str
        raise
    return checked


# The last key list a wait packed, and its packing: the members of one process
# (ranks as tasks) usually wait on the same N keys, and packing 1024 keys costs
# about 20 us; comparing with the last list costs a few.
_last_packed: tuple[list[str], bytes] = ([], pack_keys([]))


def _pack_keys(keys: Iterable[str]) -> bytes:
    global _last_packed
    last, packed = _last_packed
    if type(keys) is list and keys == last:
        return packed
    checked = _check_keys(keys)  # a copy: the caller may change its list later
    packed = pack_keys(checked)
    _last_packed = (checked, packed)
    return packed


class Store:
    """The job's key-value store, shared by all its members (like ``TCPStore``).

    Values are bytes (``str`` is encoded as UTF-8). Operations that wait (``get``,
    ``wait``) give up after ``timeout`` seconds with ``DistTimeoutError``.

    Cancellation:
        Cancelling an awaiting task abandons the wait; a ``set``/``add`` already
        sent still takes effect.

    Example:
        >>> store = aiodist.get_store()
        >>> await store.set("ready", b"1")
        >>> await store.add("count", 1)
        1
    """

    def __init__(self, conn: ControlChannel, timeout: float) -> None:
        self._conn = conn
        self.timeout = timeout

    async def set(self, key: str, value: str | bytes) -> None:
        """Set ``key`` to ``value``, waking every member waiting for it."""
        data = _as_bytes(value, "value")
        await self._conn.request(lambda r: StoreSet(r, _check_key(key), data))

    async def get(self, key: str, timeout: float | timedelta | None = None) -> bytes:
        """Return the value of ``key``, waiting until some member sets it.

        Raises:
            DistTimeoutError: The key was not set within ``timeout``.
        """
        seconds = as_seconds(timeout, self.timeout)
        value: bytes = await self._conn.request(
            lambda r: StoreGet(r, _check_key(key), seconds), timeout=seconds + REPLY_GRACE
        )
        return value

    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (0 when unset); return the new value."""
        if not isinstance(amount, int):
            raise TypeError(f"amount must be int, got {type(amount).__name__}")
        value: int = await self._conn.request(lambda r: StoreAdd(r, _check_key(key), amount))
        return value

    async def wait(self, keys: list[str], timeout: float | timedelta | None = None) -> None:
        """Wait until every key in ``keys`` is set.

        Raises:
            DistTimeoutError: Some key was still unset after ``timeout``.
        """
        seconds = as_seconds(timeout, self.timeout)
        packed = _pack_keys(keys)
        await self._conn.request(
            lambda r: StoreWait(r, packed, seconds), timeout=seconds + REPLY_GRACE
        )

    async def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the value now stored.

        A missing key counts as holding ``b""``. On a mismatch the current value is
        returned (``expected`` when the key is missing), as TCPStore does.
        """
        exp, des = _as_bytes(expected, "expected"), _as_bytes(desired, "desired")
        value: bytes = await self._conn.request(
            lambda r: StoreCompareSet(r, _check_key(key), exp, des)
        )
        return value

    async def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        deleted: bool = await self._conn.request(lambda r: StoreDeleteKey(r, _check_key(key)))
        return deleted

    async def num_keys(self) -> int:
        """Number of keys set in the job's store."""
        count: int = await self._conn.request(StoreNumKeys)
        return count

    async def check(self, keys: list[str]) -> bool:
        """True if every key in ``keys`` is set (never waits)."""
        checked = _check_keys(keys)
        found: bool = await self._conn.request(lambda r: StoreCheck(r, checked))
        return found
