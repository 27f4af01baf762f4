"""``init_rpc``'s backend and options, as torch names them: what aiodist reads, what it refuses.

A program written for ``torch.distributed.rpc`` passes ``backend=BackendType.TENSORPIPE``
and a ``TensorPipeRpcBackendOptions``; aiodist's data plane carries the calls
whatever they say, and reads from the options what still means something here:
where the rpc world meets (``init_method``), the default timeout of a call
(``rpc_timeout``) and how many threads run plain functions
(``num_worker_threads``). Torch's own options object is read the same way.
What aiodist cannot honour (CUDA device maps, TensorPipe's transports and
channels) is refused by name rather than ignored.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Final

#: torch's defaults for ``TensorPipeRpcBackendOptions``.
DEFAULT_RPC_TIMEOUT: Final = 60.0
DEFAULT_INIT_METHOD: Final = "env://"
DEFAULT_NUM_WORKER_THREADS: Final = 16


class BackendType(enum.Enum):
    """The rpc backends, as torch names them; aiodist's data plane stands in for each."""

    TENSORPIPE = "TENSORPIPE"


class RpcBackendOptions:
    """What every backend's options carry (torch's ``RpcBackendOptions``).

    Args:
        rpc_timeout: The default timeout of a call, in seconds (0: none).
        init_method: Where the rpc world meets (``tcp://HOST:PORT``, ``env://``, ``file://``).
    """

    def __init__(
        self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT, init_method: str = DEFAULT_INIT_METHOD
    ) -> None:
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method
        settings_of(self)  # refuse bad values now, not at init_rpc

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rpc_timeout={self.rpc_timeout!r}, "
            f"init_method={self.init_method!r})"
        )


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's TensorPipe options, accepted so that programs written for it run unchanged.

    Args:
        num_worker_threads: Threads that run plain functions on this rank (aiodist's
            ``AIODIST_RPC_THREADS``).
        rpc_timeout: The default timeout of a call, in seconds (0: none).
        init_method: Where the rpc world meets.
        device_maps: Refused unless empty: aiodist moves CUDA tensors through host
            memory, not with TensorPipe's device maps.
        devices: Refused unless empty, as ``device_maps``.
        _transports: Refused: aiodist's data plane picks its transports
            (``AIODIST_TRANSPORT``).
        _channels: Refused, as ``_transports``.

    Raises:
        ValueError: A field aiodist cannot honour, named.
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: dict[Any, Any] | None = None,
        devices: list[Any] | None = None,
        _transports: list[str] | None = None,
        _channels: list[str] | None = None,
    ) -> None:
        self.num_worker_threads = num_worker_threads
        self.device_maps = dict(device_maps or {})
        self.devices = list(devices or [])
        self._transports = _transports
        self._channels = _channels
        super().__init__(rpc_timeout, init_method)

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Refused: aiodist has no device maps (CUDA tensors travel through host memory).

        Raises:
            ValueError: Always.
        """
        raise ValueError(_refusal("device_maps"))


@dataclass(frozen=True, slots=True)
class RpcSettings:
    """What ``init_rpc`` takes from its options (None where they say nothing)."""

    init_method: str | None
    timeout: float | None  # seconds; None: the job's timeout
    threads: int | None


_REFUSED: Final = {
    "device_maps": "aiodist moves CUDA tensors through host memory, without device maps",
    "devices": "aiodist moves CUDA tensors through host memory, without device maps",
    "_transports": "aiodist's data plane picks its transports (AIODIST_TRANSPORT)",
    "_channels": "aiodist's data plane picks its transports (AIODIST_TRANSPORT)",
}


def _refusal(field: str) -> str:
    return (
        f"rpc_backend_options.{field} is not supported by aiodist.rpc: {_REFUSED[field]}; "
        "leave it unset"
    )


def settings_of(options: object) -> RpcSettings:
    """Read ``init_rpc``'s ``rpc_backend_options`` (aiodist's, torch's, or None).

    Raises:
        ValueError: A field aiodist cannot honour is set, or a value is out of range.
        TypeError: A field has the wrong type.
    """
    if options is None:
        return RpcSettings(None, None, None)
    for field in _REFUSED:
        if getattr(options, field, None):
            raise ValueError(_refusal(field))
    init_method = getattr(options, "init_method", None)
    if init_method is not None and not isinstance(init_method, str):
        raise TypeError(f"rpc_backend_options.init_method must be a str, got {init_method!r}")
    timeout = getattr(options, "rpc_timeout", None)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"rpc_backend_options.rpc_timeout must be seconds, got {timeout!r}")
        if timeout < 0:
            raise ValueError(f"rpc_backend_options.rpc_timeout must be >= 0, got {timeout!r}")
        timeout = float(timeout)
    threads = getattr(options, "num_worker_threads", None)
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int):
            raise TypeError(
                f"rpc_backend_options.num_worker_threads must be an int, got {threads!r}"
            )
        if threads < 1:
            raise ValueError(
                f"rpc_backend_options.num_worker_threads must be >= 1, got {threads!r}"
            )
    return RpcSettings(init_method, timeout, threads)


def check_backend(backend: object) -> None:
    """Accept ``init_rpc``'s ``backend``: None or TENSORPIPE (aiodist's or torch's enum).

    Raises:
        ValueError: Another backend.
    """
    if backend is None or getattr(backend, "name", None) == BackendType.TENSORPIPE.name:
        return
    raise ValueError(
        f"init_rpc's backend must be None or BackendType.TENSORPIPE, got {backend!r}: "
        "aiodist's data plane carries the calls"
    )
