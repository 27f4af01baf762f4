"""torch.distributed's names that code written for it uses, under ``aiodist.sync``.

Code written for torch.distributed names torch's own types through ``dist``: a
comm hook's ``bucket: dist.GradBucket``, ``dist.DebugLevel.DETAIL``. The drop-in
offers them unchanged, loaded on first use.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

import aiodist
import aiodist.sync
from tests.helpers import ROOT


@pytest.mark.parametrize("name", ["DebugLevel", "GradBucket", "BuiltinCommHookType"])
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
