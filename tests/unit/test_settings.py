"""Every ``AIODIST_*`` variable is declared, read and checked in ``aiodist._settings``."""

from __future__ import annotations

import logging
import re

import pytest

import aiodist
from aiodist import _settings
from aiodist._launch.cli import main
from aiodist._server.serve import DEFAULT_PORT, DEFAULT_SHUTDOWN_TIMEOUT
from aiodist._tools import gen_settings
from tests.helpers import ROOT


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for name in [n for n in os.environ if n.startswith("AIODIST_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(_settings, "_warned_in", 0)
    return monkeypatch


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "AIODIST_HEARTBEAT_TIMEOUT",
            "abc",
            "AIODIST_HEARTBEAT_TIMEOUT='abc' is not a number of seconds; set a number > 0 "
            "(unset: 10.0)",
        ),
        (
            "AIODIST_MAX_WORLD_SIZE",
            "x",
            "AIODIST_MAX_WORLD_SIZE='x' is not a whole number; set a whole number >= 0 (unset: 0)",
        ),
        ("AIODIST_HEARTBEAT_INTERVAL", "-1", "AIODIST_HEARTBEAT_INTERVAL='-1' is not a number"),
        ("AIODIST_HEARTBEAT_TIMEOUT", "nan", "AIODIST_HEARTBEAT_TIMEOUT='nan' is not a number"),
    ],
)
async def test_init_with_a_bad_variable_names_it_the_value_and_what_is_allowed(
    clean_env: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    clean_env.setenv(name, value)
    # Before: "ValueError: could not convert string to float: 'abc'" (or "invalid literal").
    with pytest.raises(ValueError, match=re.escape(message)):
        await aiodist.init_process_group(
            init_method="tcp://127.0.0.1:1", rank=0, world_size=2, timeout=5
        )


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("AIODIST_SHM", "maybe", "a switch; set 1 (on) or 0 (off)"),
        ("AIODIST_PORT", "70000", "a port in [0, 65535]"),
        ("AIODIST_SERVER", "no-port", "HOST:PORT with a port in 1..65535"),
        ("AIODIST_LOG_LEVEL", "loud", "one of debug, info, warning, error"),
        ("AIODIST_RPC_THREADS", "0", "a number of threads >= 1"),
        ("AIODIST_SPIN_US", "1.5", "a whole number of microseconds"),
    ],
)
def test_each_kind_of_setting_checks_its_value(name: str, value: str, allowed: str) -> None:
    setting = _settings.by_name(name)
    with pytest.raises(ValueError, match=re.escape(f"{name}={value!r} is not {allowed}")):
        setting.read({name: value})
    assert setting.read({}) == setting.default
    assert setting.read({name: "  "}) == setting.default  # empty: unset


def test_switches_and_numbers_read_what_users_write() -> None:
    assert _settings.SHM.read({"AIODIST_SHM": "0"}) is False
    assert _settings.SHM.read({"AIODIST_SHM": "Off"}) is False
    assert _settings.EMBED.read({"AIODIST_EMBED": "true"}) is True
    assert _settings.HEARTBEAT_TIMEOUT.read({"AIODIST_HEARTBEAT_TIMEOUT": " 2.5 "}) == 2.5
    assert _settings.TORCH_PARTS.raw({"AIODIST_TORCH_PARTS": ""}) == ""  # set, empty: none
    assert _settings.HOST.read({"AIODIST_HOST": " 10.0.0.1 "}) == "10.0.0.1"
    assert _settings.TOKEN.read({"AIODIST_TOKEN": " s3cret "}) == " s3cret "  # byte for byte


def test_unknown_variable_is_warned_with_the_closest_name_once(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    clean_env.setenv("AIODIST_TOKNE", "secret")
    clean_env.setenv("AIODIST_ZZZZZZZZ", "1")
    caplog.set_level(logging.WARNING, "aiodist")
    # Before: ignored in silence (a job meant to need a token ran without one).
    assert _settings.warn_unknown() == ["AIODIST_TOKNE", "AIODIST_ZZZZZZZZ"]
    _settings.warn_unknown()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "AIODIST_TOKNE is not an aiodist setting (did you mean AIODIST_TOKEN?)"
    ), lines
    assert lines[1].startswith("AIODIST_ZZZZZZZZ is not an aiodist setting; it is ignored")


def test_the_command_names_a_bad_variable_and_warns_of_an_unknown_one(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_env.setenv("AIODIST_PORT", "x")
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert "AIODIST_PORT='x' is not a port; set a whole number in [0, 65535]" in err, err
    clean_env.delenv("AIODIST_PORT")
    clean_env.setenv("AIODIST_HEARTBEAT_TIMOUT", "30")
    main(["status", "--port", "1", "--timeout", "0.5"])  # nothing listens: it fails, warned
    err = capsys.readouterr().err
    assert "AIODIST_HEARTBEAT_TIMOUT is not an aiodist setting (did you mean " in err, err


def test_the_reference_page_tables_are_the_declared_settings() -> None:
    page = gen_settings.PAGE.read_text()
    assert gen_settings.render(page) == page, (
        "docs/reference/environment.md is stale: run python -m aiodist._tools.gen_settings"
    )


def test_every_variable_the_library_names_is_declared() -> None:
    declared = {s.name for s in _settings.SETTINGS}
    named: dict[str, str] = {}
    for path in (ROOT / "aiodist").rglob("*.py"):
        if path.name == "_settings.py":
            continue  # the declaration (its docstring shows a typo)
        for name in re.findall(r"\bAIODIST_[A-Z][A-Z_]*[A-Z]\b", path.read_text()):
            named.setdefault(name, str(path.relative_to(ROOT)))
    unknown = {n: p for n, p in named.items() if n not in declared and n != "AIODIST_TLS"}
    assert unknown == {}, unknown


def test_declared_defaults_agree_with_the_servers() -> None:
    assert _settings.PORT.default == DEFAULT_PORT
    assert _settings.SHUTDOWN_TIMEOUT.default == DEFAULT_SHUTDOWN_TIMEOUT
