"""Before ``init_process_group``: the non-distributed answers, and a word where a launcher
started this process as one of several ranks."""

from __future__ import annotations

import logging

import pytest
import torch

import aiodist
from aiodist import sync
from aiodist._group import world


@pytest.fixture
def not_warned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(world, "_warned_alone", False, raising=False)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.usefixtures("not_warned")
def test_queries_before_init_under_a_launcher_warn_once_naming_the_missing_call(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    caplog.set_level(logging.WARNING, "aiodist")
    # The non-distributed answers stay, as mmengine's.
    assert (aiodist.get_rank(), aiodist.get_world_size()) == (0, 1)
    t = torch.ones(2)
    sync.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]
    # Before: nothing at all; each rank of `aiodist run -n 2` computed alone.
    (warning,) = _warnings(caplog)
    assert warning.startswith("get_rank() answered as a world of one rank"), warning
    assert "init_process_group was not called (or not awaited)" in warning
    assert "WORLD_SIZE=2" in warning


@pytest.mark.usefixtures("not_warned")
@pytest.mark.parametrize("size", [None, "1", "x"])
def test_queries_before_init_alone_say_nothing(
    size: str | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", size)
    caplog.set_level(logging.WARNING, "aiodist")
    assert (aiodist.get_rank(), aiodist.get_world_size()) == (0, 1)
    assert _warnings(caplog) == []
