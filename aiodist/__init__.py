"""aiodist: asyncio-first communication for distributed PyTorch."""

from __future__ import annotations

from aiodist._errors import (
    AuthenticationError,
    ClosedError,
    CollectiveMismatchError,
    DistError,
    DistTimeoutError,
    GroupBrokenError,
    ProtocolError,
    RankFailedError,
    RendezvousError,
    RendezvousTimeout,
)

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "ClosedError",
    "CollectiveMismatchError",
    "DistError",
    "DistTimeoutError",
    "GroupBrokenError",
    "ProtocolError",
    "RankFailedError",
    "RendezvousError",
    "RendezvousTimeout",
    "__version__",
]
