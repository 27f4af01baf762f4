"""The README's code runs as written.

The README is the five-minute introduction: the two set-up commands, one
async example and one plain-code example, each run here as ``tests/helpers/blocks.py``
says (its python blocks under ``aiodist run``, its commands as a reader types
them). A block or a command this module does not know fails
``test_every_readme_block_is_checked``, naming it. The rest of the
documentation lives in ``docs/``; ``tests/project/test_docs.py`` runs its blocks, and
leaves the ones it shares with the README to this module.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from tests.helpers.blocks import (
    LANGUAGES,
    ROOT,
    Check,
    Harness,
    check_make,
    commands,
    fenced_blocks,
    python_cases,
    run_python_block,
)
from tests.helpers.daemon import asyncio_only

if TYPE_CHECKING:
    from pathlib import Path

README = ROOT / "README.md"


def readme_block(head: str) -> str:
    """The README's python block that starts with ``head``."""
    found = [b.code for b in fenced_blocks(README) if b.lang == "python" and b.head == head]
    assert found, f"no README python block starts with {head!r} any more: update this module"
    return found[0]


PYTHON: dict[str, Harness] = {
    # "Async code": a complete script for env:// (aiodist run); world size 1 skips the ring.
    "import anyio, torch, aiodist": Harness(runs=(("aiodist run", 1), ("aiodist run", 4))),
    # "Plain code": a complete script too; two all_reduces of t, then one object per rank.
    "import torch": Harness(
        runs=(("aiodist run", 2),),
        epilogue="""
assert t.tolist() == [float(sum(range(2)) * 2)] * 4, t  # summed, then summed again
assert objs == [{"rank": r} for r in range(2)], objs
""",
    ),
}

#: Every README command: how it is checked, or why it is not.
BASH: dict[str, Check | str] = {
    "make demo": check_make,
    "make test": "the whole suite, this module included",
}


def test_every_readme_block_is_checked() -> None:
    blocks = fenced_blocks(README)
    unknown = [b.head for b in blocks if b.lang == "python" and b.head not in PYTHON]
    assert not unknown, f"README python blocks with no harness in {__name__}: {unknown}"
    missing = [command for command in commands(blocks) if command not in BASH]
    assert not missing, f"README commands neither checked nor excused in {__name__}: {missing}"
    stale = [command for command in BASH if command not in commands(blocks)]
    assert not stale, f"commands no longer in the README: {stale}"
    languages = {b.lang for b in blocks}
    assert languages <= LANGUAGES - {"text"}, f"README blocks in other languages: {languages}"


def test_readme_reads_in_five_minutes() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move the rest into docs/"
    first = next(b for b in fenced_blocks(README))
    assert commands([first]) == ["make demo", "make test"], "the set-up commands come first"


def test_readme_links_point_at_files_of_the_checkout() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert links, "the README links into docs/"
    missing = [link for link in links if "://" not in link and not (ROOT / link).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize(("page", "head", "harness", "launcher", "world"), python_cases(PYTHON))
async def test_readme_python_block_runs(
    tmp_path: Path, page: str, head: str, harness: Harness, launcher: str, world: int
) -> None:
    code = readme_block(head)
    await run_python_block(code, harness, launcher, world, tmp_path, f"README block {head!r}")


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize(
    "command", [c for c, check in BASH.items() if not isinstance(check, str)], ids=str
)
async def test_readme_command_runs(tmp_path: Path, command: str) -> None:
    assert command in commands(fenced_blocks(README)), f"`{command}` is no longer in the README"
    check = BASH[command]
    assert not isinstance(check, str)
    await check(command, tmp_path)
