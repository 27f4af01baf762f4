"""The overlapped training loop of ``train_overlap.py`` on GPUs, with NCCL.

Run with ``aiodist run -n N examples/train_nccl.py`` on a machine with N GPUs
(one per rank; rank ``r`` uses GPU ``LOCAL_RANK``). Gradients are CUDA tensors,
so their all_reduce goes to NCCL through the torch bridge: issued in order from
one thread per group, awaited without parking a thread, and synchronised with
the training stream. Without CUDA (or with fewer GPUs than ranks) it says so
and exits cleanly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_overlap


def main() -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        print("train_nccl: skipped, this machine has no CUDA (or torch has no NCCL)")
        return 0
    if torch.cuda.device_count() < world:
        print(
            f"train_nccl: skipped, {world} ranks need {world} GPUs, found "
            f"{torch.cuda.device_count()}"
        )
        return 0
    return train_overlap.main(["--backend", "nccl", "--device", "cuda", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
