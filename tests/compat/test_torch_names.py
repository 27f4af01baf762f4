"""torch.distributed's names that code written for it uses, under ``aiodist.sync``.

Code written for torch.distributed names torch's own types through ``dist``: a
comm hook's ``bucket: dist.GradBucket``, ``dist.DebugLevel.DETAIL``. The drop-in
offers them unchanged, loaded on first use.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import TYPE_CHECKING

import anyio
import pytest
import torch
import torch.distributed as dist

import aiodist
import aiodist.sync
from aiodist._group.world import TORCH_TYPES
from aiodist.testing import run_ranks
from tests.helpers import ROOT
from tests.helpers.procs import free_port

if TYPE_CHECKING:
    from aiodist import ProcessGroup, RendezvousServer


@pytest.mark.parametrize("name", sorted(TORCH_TYPES))
def test_torch_types_are_torchs_own_under_both_modules(name: str) -> None:
    assert getattr(aiodist.sync, name) is getattr(dist, name)
    assert getattr(aiodist, name) is getattr(dist, name)


def test_unknown_name_raises_attribute_error_naming_the_module() -> None:
    with pytest.raises(AttributeError, match=r"module 'aiodist\.sync' has no attribute 'Nope'"):
        _ = aiodist.sync.Nope
    assert not hasattr(aiodist, "ProcessGroupNCCL")  # only the types listed are offered


def test_importing_the_drop_in_still_does_not_import_torch() -> None:
    code = (
        "import sys, aiodist.sync as dist\n"
        "before = 'torch' in sys.modules\n"
        "level = dist.DebugLevel.OFF\n"
        "print(before, 'torch' in sys.modules, level)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    )
    assert out.stdout.split() == ["False", "True", "DebugLevel.OFF"], out.stderr


def test_set_debug_level_sets_torchs_level() -> None:
    before = dist.get_debug_level()  # type: ignore[attr-defined]
    try:
        aiodist.sync.set_debug_level(aiodist.sync.DebugLevel.INFO)
        assert dist.get_debug_level() == dist.DebugLevel.INFO  # type: ignore[attr-defined]
        assert aiodist.sync.get_debug_level() == aiodist.sync.DebugLevel.INFO
        aiodist.set_debug_level(dist.DebugLevel.DETAIL)  # type: ignore[attr-defined]
        assert aiodist.get_debug_level() == dist.DebugLevel.DETAIL  # type: ignore[attr-defined]
    finally:
        dist.set_debug_level(before)  # type: ignore[attr-defined]


async def test_irecv_from_any_source_names_its_sender_under_torchs_private_name(
    server: RendezvousServer,
) -> None:
    async def body(g: ProcessGroup) -> list[int] | None:
        if g.rank == 0:
            works = [aiodist.irecv(torch.zeros(2), group=g) for _ in range(2)]  # src=None
            for w in works:
                await w
            return sorted(w._source_rank() for w in works)
        await aiodist.isend(torch.full((2,), float(g.rank)), dst=0, group=g)
        return None

    with anyio.fail_after(15):
        outs = await run_ranks(server.address, 3, body)
    # Before: AttributeError: 'Work' object has no attribute '_source_rank'.
    assert outs[0] == [1, 2]


GET_BACKEND = """
import json, sys
import aiodist.sync as dist
from torch.distributed.distributed_c10d import _get_default_group

dist.init_process_group(backend="gloo", init_method=sys.argv[1], world_size=1, rank=0)
try:
    print(json.dumps([dist.get_backend(), dist.get_backend(_get_default_group())]))
finally:
    dist.destroy_process_group()
"""


def test_get_backend_of_torchs_own_group_answers_as_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", GET_BACKEND, f"tcp://127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
        check=False,
    )
    # Before: AttributeError: '...ProcessGroup' object has no attribute 'backend'.
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["gloo", "gloo"]
