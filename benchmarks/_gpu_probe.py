"""What ``gpu_check``'s preflight asks the python that runs the check: one JSON line.

torch's version and CUDA build, whether it sees a GPU (and torch's warning
when it does not), NCCL and gloo, the device's name, capability and memory, a
small kernel's result, ``import aiodist`` from the checkout, and the versions
of the packages the tests use. Run as ``python -m benchmarks._gpu_probe``.
"""

from __future__ import annotations

import json
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import Any

PACKAGES = (
    "anyio",
    "msgpack",
    "uvloop",
    "prometheus-client",
    "pytest",
    "pytest-timeout",
    "hypothesis",
    "numpy",
    "psutil",
)


def probe() -> dict[str, Any]:
    """What this python has; never raises (an error is a field of the answer)."""
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "cuda_available": False,
        "nccl": False,
    }
    try:
        import torch
        import torch.distributed as dist

        out.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            out["cuda_available"] = bool(torch.cuda.is_available())
        if said:  # torch says why it sees no GPU (driver too old, no device, ...)
            out["cuda_warnings"] = [str(w.message)[:300] for w in said]
        out["nccl"] = bool(dist.is_available() and dist.is_nccl_available())
        out["gloo"] = bool(dist.is_available() and dist.is_gloo_available())
        if out["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            out.update(
                device_count=torch.cuda.device_count(),
                name=props.name,
                capability=f"{props.major}{props.minor}",
                memory_gib=round(props.total_memory / 2**30, 1),
            )
            x = torch.arange(4.0, device="cuda")
            out["kernel_ok"] = float((x * 2).sum().item()) == 12.0
            if out["nccl"]:
                v = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
                out["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    try:
        import aiodist

        out["aiodist"] = aiodist.__file__
    except Exception as exc:
        out["aiodist_error"] = f"{type(exc).__name__}: {exc}"[:500]
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    out["packages"] = versions
    return out


if __name__ == "__main__":
    print(json.dumps(probe()))
