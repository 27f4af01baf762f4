"""The aiodist backend's device parts: which devices go to which torch backend."""

from __future__ import annotations

import pytest

from aiodist._torch.parts import parts_from_env


def test_parts_default_to_nccl_for_cuda_only_where_this_process_has_it() -> None:
    import torch

    expected = {"cuda": "nccl"} if torch.cuda.is_available() else {}
    assert parts_from_env({}) == expected


@pytest.mark.parametrize(
    ("raw", "parts"),
    [
        ("cpu:gloo", {"cpu": "gloo"}),
        ("", {}),
        ("CUDA:NCCL, cpu:gloo", {"cuda": "nccl", "cpu": "gloo"}),
    ],
)
def test_parts_setting_names_device_backend_pairs(raw: str, parts: dict[str, str]) -> None:
    assert parts_from_env({"AIODIST_TORCH_PARTS": raw}) == parts


@pytest.mark.parametrize("raw", ["gloo", "cpu:aiodist", "tpu:gloo", "cpu:"])
def test_parts_setting_that_is_not_pairs_of_a_known_backend_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match="AIODIST_TORCH_PARTS"):
        parts_from_env({"AIODIST_TORCH_PARTS": raw})
