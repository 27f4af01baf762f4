"""Running the code blocks of Markdown pages as their reader would: README.md and docs/.

Every fenced ``python`` block runs the way a user would run it: a complete
script under ``aiodist run -n N`` (or ``python`` for world size 1); a fragment
(it uses names the page leaves to the reader, such as ``loader`` or ``rank``)
inside a ``Harness`` the test module supplies, keyed by the block's first
line, so the page stays as written. Every command line of the ``bash`` blocks
is run by a ``Check`` here, or named with the reason it is not (two hosts,
GPUs, a benchmark). ``text`` blocks show output (a log, an error message) and
run nothing. ``tests/project/test_readme.py`` holds the README's table,
``tests/project/test_docs.py`` the pages'.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import pytest

from tests.helpers import ROOT
from tests.helpers.daemon import TOKEN, run_cli, serve
from tests.helpers.procs import Finished, run

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Mapping
    from pathlib import Path

__all__ = [
    "LANGUAGES",
    "ROOT",
    "TRAIN_PY",
    "Block",
    "Check",
    "Harness",
    "Harnesses",
    "check_make",
    "check_run",
    "check_run_on_daemon",
    "check_serve",
    "check_serve_token_from_env",
    "check_status",
    "check_torchrun",
    "commands",
    "fenced_blocks",
    "python_cases",
    "run_python_block",
    "unfenced_blocks",
]

#: The languages a page's blocks may have: code that runs, and output that is shown.
LANGUAGES = frozenset({"python", "bash", "text"})
_FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_INDENTED_FENCE = re.compile(r"^[ \t]+```.*$", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: str  # the page's path from the repository's root
    lang: str
    code: str

    @property
    def head(self) -> str:
        """The block's first line: its key in a harness table."""
        return self.code.strip().splitlines()[0]


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced blocks of the page at ``path``, in order."""
    page = path.resolve().relative_to(ROOT).as_posix()
    return [Block(page, lang, code) for lang, code in _FENCE.findall(path.read_text())]


def unfenced_blocks(path: Path) -> list[str]:
    """Fences that do not start a line: blocks this module would not see, so not run."""
    return [m.group(0).strip() for m in _INDENTED_FENCE.finditer(path.read_text())]


def commands(blocks: Iterable[Block]) -> list[str]:
    """Every command line of the ``bash`` blocks, without its comment."""
    out = []
    for block in blocks:
        if block.lang != "bash":
            continue
        for line in block.code.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                out.append(command)
    return out


# --- the python blocks --------------------------------------------------------------------


@dataclass(frozen=True)
class Harness:
    """How one python block runs.

    ``runs``: ``(launcher, world size)`` pairs, the launcher ``"python"`` or
    ``"aiodist run"``. ``prelude`` defines what the block leaves to the reader
    and ``epilogue`` checks what it computed; with ``wrap_async`` the block's
    top-level ``await``s become the body of ``async def main()``. ``check``
    looks at the run's output and files afterwards. ``name`` tells two
    harnesses of one block apart in test ids.
    """

    runs: tuple[tuple[str, int], ...]
    prelude: str = ""
    epilogue: str = ""
    wrap_async: bool = False
    check: Callable[[Finished, Path, int], None] | None = field(default=None, compare=False)
    name: str = ""

    def script(self, code: str) -> str:
        if not self.wrap_async:
            return "\n".join([self.prelude, code, self.epilogue])
        body = textwrap.indent("\n".join([self.prelude, code, self.epilogue]), "    ")
        return f"import anyio\n\n\nasync def main():\n{body}\n\nanyio.run(main)\n"


Harnesses: TypeAlias = "Harness | tuple[Harness, ...]"


def python_cases(table: Mapping[str, Harnesses], page: str = "") -> list[object]:
    """One pytest case per run of every harness of ``table`` (first line -> harness)."""
    cases: list[object] = []
    for head, harnesses in table.items():
        for harness in harnesses if isinstance(harnesses, tuple) else (harnesses,):
            for launcher, world in harness.runs:
                where = f"{page}:" if page else ""
                name = f"-{harness.name}" if harness.name else ""
                case_id = f"{where}{head[:30]}{name}-{launcher}-{world}"
                cases.append(pytest.param(page, head, harness, launcher, world, id=case_id))
    return cases


async def run_python_block(
    code: str, harness: Harness, launcher: str, world: int, tmp_path: Path, where: str
) -> None:
    """Run ``code`` in ``harness`` as ``launcher`` with ``world`` ranks; it must pass quietly."""
    script = tmp_path / "block.py"
    script.write_text(harness.script(code))
    argv = [sys.executable, str(script)]
    if launcher == "aiodist run":
        argv = [sys.executable, "-m", "aiodist", "run", "-n", str(world), str(script)]
    result = await run(argv, limit=90, env={"PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    where = f"{where} ({launcher}, world size {world})"
    assert result.returncode == 0, f"{where} failed:\n{result.stdout}\n{result.stderr}"
    assert result.stderr == "", f"{where} wrote to stderr:\n{result.stderr}"
    if harness.check is not None:
        harness.check(result, tmp_path, world)


# --- the bash blocks ----------------------------------------------------------------------

#: How a command is checked: ``await check(command, tmp_path)``.
Check: TypeAlias = "Callable[[str, Path], Awaitable[None]]"

#: The reader's own ``train.py``, for the commands that start one.
TRAIN_PY = """
import argparse
import aiodist.sync as dist

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.01)
args = parser.parse_args()
dist.init_process_group()
print(f"rank {dist.get_rank()} of {dist.get_world_size()}, lr {args.lr}")
"""


async def _launch(command: str, cwd: Path) -> Finished:
    argv = [sys.executable, "-m", "aiodist", *shlex.split(command)[1:]]
    result = await run(argv, limit=120, env={"PYTHONPATH": str(ROOT)}, cwd=cwd)
    assert result.returncode == 0, f"`{command}` failed:\n{result.stdout}\n{result.stderr}"
    assert result.stderr == "", f"`{command}` wrote to stderr:\n{result.stderr}"
    return result


async def check_run(command: str, cwd: Path) -> None:
    """``aiodist run``: a script of the repository, or the reader's ``train.py``."""
    if "train.py" not in command:  # a script of the repository
        result = await _launch(command, ROOT)
        if "examples/master_worker.py" in command:  # z came back; b was made on worker 2
            assert "[rank 0] z fetched: (20, 20)" in result.stdout, result.stdout
            assert "(on worker 2)" in result.stdout, result.stdout
        if "examples/master_worker_pipeline.py" in command:  # it checks its results itself
            assert "24 batches issued to workers [1, 2]" in result.stdout, result.stdout
        if "examples/train_overlap.py" in command:  # overlapped and blocking steps agree
            assert "[rank 0]  overlap:" in result.stdout, result.stdout
            assert result.stdout.count("weights in sync") == 2, result.stdout
            assert "overlap efficiency" in result.stdout, result.stdout
        return
    (cwd / "train.py").write_text(TRAIN_PY)  # the reader's own script
    result = await _launch(command, cwd)
    args = shlex.split(command)
    world = args[args.index("-n") + 1]
    lr = "0.1" if "--lr 0.1" in command else "0.01"
    prefix = "" if "--no-prefix" in command else "[rank 0] "
    line = f"{prefix}rank 0 of {world}, lr {lr}"
    assert line in result.stdout.splitlines(), result.stdout


async def check_run_on_daemon(command: str, cwd: Path) -> None:
    """``aiodist run --rdzv-endpoint``: the page's endpoint is a deployment's, ours a free port."""
    async with serve("--port", "0") as daemon:
        endpoint = shlex.split(command)[shlex.split(command).index("--rdzv-endpoint") + 1]
        await check_run(command.replace(endpoint, f"127.0.0.1:{daemon.port}"), cwd)


async def check_torchrun(command: str, cwd: Path) -> None:
    (cwd / "train.py").write_text(TRAIN_PY)
    argv = [sys.executable, "-m", "torch.distributed.run", *shlex.split(command)[1:]]
    result = await run(argv, limit=120, env={"PYTHONPATH": str(ROOT)}, cwd=cwd)
    assert result.returncode == 0, f"`{command}` failed:\n{result.stdout}\n{result.stderr}"
    # torchrun passes its workers' stdout through unchanged: an unbuffered print writes its
    # text and its newline apart, so two ranks' lines may interleave. The words are there.
    assert "rank 0 of 4, lr 0.01" in result.stdout, result.stdout


async def check_make(command: str, cwd: Path) -> None:
    result = await run(shlex.split(command), limit=180, cwd=ROOT)
    assert result.returncode == 0, f"`{command}` failed:\n{result.stdout}\n{result.stderr}"


def _serve_args(command: str, cwd: Path) -> list[str]:
    # The page's ports and token path are a deployment's: ours are free ones and a file here.
    token = cwd / "token"
    token.write_text(TOKEN)
    args = shlex.split(command)[2:]
    state = cwd / "state"
    for flag, value in (
        ("--port", "0"),
        ("--metrics-port", "0"),
        ("--token-file", str(token)),
        ("--state-dir", str(state)),
    ):
        if flag in args:
            args[args.index(flag) + 1] = value
    return args


async def check_serve(command: str, cwd: Path) -> None:
    async with serve(*_serve_args(command, cwd)) as daemon:
        assert daemon.port > 0, daemon.ready
        # Leaving the block stops it with SIGTERM and checks that it exits 0.


async def check_serve_token_from_env(command: str, cwd: Path) -> None:
    # The token comes from the environment: status with it is served, without it refused.
    args = _serve_args(command.split(" ", 1)[1], cwd)
    async with serve(*args, env={"AIODIST_TOKEN": TOKEN}) as daemon:
        port = str(daemon.port)
        served = await run_cli("status", "--port", port, env={"AIODIST_TOKEN": TOKEN})
        assert served.returncode == 0, served.stderr
        refused = await run_cli("status", "--port", port)
        assert refused.returncode == 1
        assert "AuthenticationError" in refused.stderr or "token" in refused.stderr


async def check_status(command: str, cwd: Path) -> None:
    async with serve("--port", "0") as daemon:
        args = shlex.split(command)[1:]
        args[args.index("--port") + 1] = str(daemon.port)
        result = await run_cli(*args)
        assert result.returncode == 0, f"`{command}` failed:\n{result.stdout}\n{result.stderr}"
        if "--json" in args:
            assert json.loads(result.stdout)["version"], result.stdout
