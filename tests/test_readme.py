"""The README's code runs as written.

Every fenced ``python`` block of README.md runs the way a user would run it:
a complete script under ``aiodist run -n N`` (or ``python`` for world size
1); a fragment (it uses names the README leaves to the reader, such as
``loader`` or ``rank``) inside a harness this module supplies, keyed by the
block's first line, so the README stays as written. Every command line of the
``bash`` blocks is run too, or named here with the reason it is not (two
hosts, GPUs, a benchmark). A block or a command this module does not know
fails ``test_every_readme_block_is_checked``, naming it.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import pytest
import torch

from tests._daemon import TOKEN, asyncio_only, run_cli, serve
from tests._procs import Finished, run

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_blocks(lang: str) -> list[str]:
    """The README's fenced blocks of ``lang``, in order."""
    return [code for kind, code in _FENCE.findall(README.read_text()) if kind == lang]


def first_line(code: str) -> str:
    return code.strip().splitlines()[0]


def readme_block(head: str) -> str:
    """The README's python block that starts with ``head``."""
    found = [code for code in readme_blocks("python") if first_line(code) == head]
    assert found, f"no README python block starts with {head!r} any more: update this module"
    return found[0]


def commands() -> list[str]:
    """Every command line of the README's bash blocks, without its comment."""
    out = []
    for code in readme_blocks("bash"):
        for line in code.splitlines():
            command = line.split("#", 1)[0].strip()
            if command:
                out.append(command)
    return out


# --- the python blocks --------------------------------------------------------------------


@dataclass(frozen=True)
class Harness:
    """How one README python block runs.

    ``runs``: ``(launcher, world size)`` pairs, the launcher ``"python"`` or
    ``"aiodist run"``. ``prelude`` defines what the block leaves to the reader
    and ``epilogue`` checks what it computed; with ``wrap_async`` the block's
    top-level ``await``s become the body of ``async def main()``. ``check``
    looks at the run's output and files afterwards.
    """

    runs: tuple[tuple[str, int], ...]
    prelude: str = ""
    epilogue: str = ""
    wrap_async: bool = False
    check: Callable[[Finished, Path, int], None] | None = field(default=None, compare=False)

    def script(self, code: str) -> str:
        if not self.wrap_async:
            return "\n".join([self.prelude, code, self.epilogue])
        body = textwrap.indent("\n".join([self.prelude, code, self.epilogue]), "    ")
        return f"import anyio\n\n\nasync def main():\n{body}\n\nanyio.run(main)\n"


def _metrics_written(result: Finished, cwd: Path, world: int) -> None:
    # 25 steps, a sync every 10th: two syncs, the second just before the script ends
    # (without destroy_process_group): both reach every rank and rank 0 writes both.
    rows = [json.loads(line) for line in (cwd / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [9, 19], rows
    assert [row["tokens"] for row in rows] == [world * 10 * 32.0] * 2, rows
    assert [row["loss"] for row in rows] == [9.0, 29.0], rows  # 2 * mean(i) over each interval
    summaries = [line for line in result.stdout.splitlines() if "loss=" in line]
    assert len(summaries) == 2 * world, result.stdout  # on_done ran on every rank


def _remote_calls_ran(result: Finished, cwd: Path, world: int) -> None:
    # Each call ran on the rank the master named (the workers print what they run).
    lines = result.stdout.splitlines()
    for r in (1, 2, 3):
        assert f"[rank {r}] train_shard({r})" in lines, result.stdout
    assert "[rank 2] Counter.add(5) -> 5" in lines, result.stdout


PYTHON: dict[str, Harness] = {
    # "Using it": a complete script for env:// (aiodist run).
    "import anyio, torch, aiodist": Harness(runs=(("aiodist run", 1), ("aiodist run", 4))),
    # Object collectives and subgroups: names ranks 0 and 2, so four ranks.
    'objs = await aiodist.all_gather_object({"rank": rank, "loss": 0.5})': Harness(
        runs=(("aiodist run", 4),),
        wrap_async=True,
        prelude="""
import torch, aiodist
await aiodist.init_process_group()
rank = aiodist.get_rank()
t = torch.ones(4) * rank
""",
        epilogue="""
assert objs == [{"rank": r, "loss": 0.5} for r in range(4)], objs
assert list(evens.ranks) == [0, 2] and evens.rank == (rank // 2 if rank in (0, 2) else -1)
if rank in (0, 2):
    assert t.tolist() == [2.0] * 4, t  # 0 + 2 on both, then rank 2's
""",
    ),
    # The blocking facade: world_size=4 as written; rank, grads, preds, dataset are ours.
    "import torch": Harness(
        runs=(("aiodist run", 4),),
        prelude="""
import os
import torch
rank = int(os.environ["RANK"])
grads = torch.ones(8) * (rank + 1)
dataset = range(12)
preds = list(dataset)[rank::4]  # this rank's share, as a distributed sampler splits it
""",
        epilogue="""
assert t.tolist() == [6.0] * 4, t
assert objs == [{"loss": 0.5}] * 4, objs
assert grads.tolist() == [10.0] * 8, grads
assert results == (list(dataset) if rank == 0 else None), results
""",
    ),
    # Master-worker: the README's main(), with the train_shard and Counter it names.
    "import aiodist, aiodist.rpc as rpc": Harness(
        runs=(("aiodist run", 4),),
        prelude="""
import anyio


def train_shard(r):
    print(f"train_shard({r})", flush=True)
    return 0.1 * r


class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k):
        self.n += k
        print(f"Counter.add({k}) -> {self.n}", flush=True)
        return self.n
""",
        epilogue="""
anyio.run(main)
""",
        check=_remote_calls_ran,
    ),
    # Metrics: the on_done snippet, alone (world size 1, nothing initialised) and on 4 ranks.
    "from aiodist.metrics import MetricAggregator, MetricsWriter": Harness(
        runs=(("python", 1), ("aiodist run", 4)),
        prelude="""
import os
import torch
import aiodist.sync as dist
if "WORLD_SIZE" in os.environ:
    dist.init_process_group()
loader = [torch.full((8, 4), float(i)) for i in range(25)]  # 25 batches of 8 samples


def train_step(batch):
    return batch.mean() * 2
""",
        check=_metrics_written,
    ),
}


def _python_cases() -> list[object]:
    return [
        pytest.param(head, launcher, world, id=f"{head[:30]}-{launcher}-{world}")
        for head, harness in PYTHON.items()
        for launcher, world in harness.runs
    ]


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize(("head", "launcher", "world"), _python_cases())
async def test_readme_python_block_runs(
    tmp_path: Path, head: str, launcher: str, world: int
) -> None:
    harness = PYTHON[head]
    script = tmp_path / "block.py"
    script.write_text(harness.script(readme_block(head)))
    argv = [sys.executable, str(script)]
    if launcher == "aiodist run":
        argv = [sys.executable, "-m", "aiodist", "run", "-n", str(world), str(script)]
    result = await run(argv, limit=90, env={"PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    where = f"README block {head!r} ({launcher}, world size {world})"
    assert result.returncode == 0, f"{where} failed:\n{result.stdout}\n{result.stderr}"
    assert result.stderr == "", f"{where} wrote to stderr:\n{result.stderr}"
    if harness.check is not None:
        harness.check(result, tmp_path, world)


# --- the bash blocks ----------------------------------------------------------------------

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


async def _check_run(command: str, cwd: Path) -> None:
    if "train.py" not in command:  # a script of the repository
        await _launch(command, ROOT)
        return
    (cwd / "train.py").write_text(TRAIN_PY)  # the reader's own script
    result = await _launch(command, cwd)
    if "train.py" in command:
        lr = "0.1" if "--lr 0.1" in command else "0.01"
        prefix = "" if "--no-prefix" in command else "[rank 0] "
        assert f"{prefix}rank 0 of 4, lr {lr}" in result.stdout.splitlines(), result.stdout


async def _check_run_on_daemon(command: str, cwd: Path) -> None:
    # The README's endpoint is a deployment's: ours is a daemon on a free port.
    async with serve("--port", "0") as daemon:
        endpoint = shlex.split(command)[shlex.split(command).index("--rdzv-endpoint") + 1]
        await _check_run(command.replace(endpoint, f"127.0.0.1:{daemon.port}"), cwd)


async def _check_torchrun(command: str, cwd: Path) -> None:
    (cwd / "train.py").write_text(TRAIN_PY)
    argv = [sys.executable, "-m", "torch.distributed.run", *shlex.split(command)[1:]]
    result = await run(argv, limit=120, env={"PYTHONPATH": str(ROOT)}, cwd=cwd)
    assert result.returncode == 0, f"`{command}` failed:\n{result.stdout}\n{result.stderr}"
    # torchrun passes its workers' stdout through unchanged: an unbuffered print writes its
    # text and its newline apart, so two ranks' lines may interleave. The words are there.
    assert "rank 0 of 4, lr 0.01" in result.stdout, result.stdout


async def _check_make(command: str, cwd: Path) -> None:
    result = await run(shlex.split(command), limit=180, cwd=ROOT)
    assert result.returncode == 0, f"`{command}` failed:\n{result.stdout}\n{result.stderr}"


def _serve_args(command: str, cwd: Path) -> list[str]:
    # The README's ports and token path are a deployment's: ours are free ones and a file here.
    token = cwd / "token"
    token.write_text(TOKEN)
    args = shlex.split(command)[2:]
    for flag, value in (("--port", "0"), ("--metrics-port", "0"), ("--token-file", str(token))):
        if flag in args:
            args[args.index(flag) + 1] = value
    return args


async def _check_serve(command: str, cwd: Path) -> None:
    async with serve(*_serve_args(command, cwd)) as daemon:
        assert daemon.port > 0, daemon.ready
        # Leaving the block stops it with SIGTERM and checks that it exits 0.


async def _check_serve_token_from_env(command: str, cwd: Path) -> None:
    # The token comes from the environment: status with it is served, without it refused.
    args = _serve_args(command.split(" ", 1)[1], cwd)
    async with serve(*args, env={"AIODIST_TOKEN": TOKEN}) as daemon:
        port = str(daemon.port)
        served = await run_cli("status", "--port", port, env={"AIODIST_TOKEN": TOKEN})
        assert served.returncode == 0, served.stderr
        refused = await run_cli("status", "--port", port)
        assert refused.returncode == 1
        assert "AuthenticationError" in refused.stderr or "token" in refused.stderr


async def _check_status(command: str, cwd: Path) -> None:
    async with serve("--port", "0") as daemon:
        args = shlex.split(command)[1:]
        args[args.index("--port") + 1] = str(daemon.port)
        result = await run_cli(*args)
        assert result.returncode == 0, f"`{command}` failed:\n{result.stdout}\n{result.stderr}"
        if "--json" in args:
            assert json.loads(result.stdout)["version"], result.stdout


Check: TypeAlias = "Callable[[str, Path], Awaitable[None]]"
NCCL_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

#: Every README command: how it is checked, or why it is not.
BASH: dict[str, Check | str] = {
    "make demo": _check_make,
    "make test": "the whole suite, this module included",
    "aiodist serve --port 29500": _check_serve,
    "aiodist serve --host 0.0.0.0 --token-file /etc/aiodist/token --metrics-port 9500 "
    "--log-format json": _check_serve,
    "AIODIST_TOKEN=... aiodist serve --port 29500": _check_serve_token_from_env,
    "aiodist status --port 29500": _check_status,
    "aiodist status --port 29500 --json": _check_status,
    "aiodist run -n 4 train.py --lr 0.1": _check_run,
    "aiodist run -n 4 --no-prefix train.py": _check_run,
    "aiodist run -n 4 --max-restarts 3 train.py": _check_run,
    "aiodist run -n 4 --rdzv-endpoint 127.0.0.1:29500 train.py": _check_run_on_daemon,
    "aiodist run -n 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 "
    "train.py": "two hosts (tests/test_launch_paths.py runs two nodes on two network namespaces)",
    "aiodist run -n 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 "
    "train.py": "two hosts (tests/test_launch_paths.py runs two nodes on two network namespaces)",
    "torchrun --standalone --nproc-per-node 4 train.py": _check_torchrun,
    "torchrun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 "
    "--nproc-per-node 4 train.py": "two hosts (tests/test_launch_paths.py runs torchrun on two "
    "network namespaces)",
    "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 "
    "--rdzv-id job7 train.py": "two hosts (tests/test_launch_paths.py runs c10d on one host)",
    "aiodist run -n 4 examples/train_overlap.py": _check_run,
    "aiodist run -n 4 examples/crc_transport.py": _check_run,
    "aiodist run -n 2 examples/train_overlap.py --device cuda --backend none": (
        _check_run if torch.cuda.is_available() else "needs a CUDA GPU"
    ),
    "aiodist run -n 2 examples/train_nccl.py": (
        _check_run if NCCL_GPUS >= 2 else "needs two CUDA GPUs"
    ),
    "python -m benchmarks.bench_bridge": "a benchmark (make bench runs it)",
}


def test_every_readme_block_is_checked() -> None:
    unknown = [first_line(code) for code in readme_blocks("python")]
    unknown = [head for head in unknown if head not in PYTHON]
    assert not unknown, f"README python blocks with no harness in {__name__}: {unknown}"
    missing = [command for command in commands() if command not in BASH]
    assert not missing, f"README commands neither checked nor excused in {__name__}: {missing}"
    stale = [command for command in BASH if command not in commands()]
    assert not stale, f"commands no longer in the README: {stale}"
    languages = {kind for kind, _ in _FENCE.findall(README.read_text())}
    assert languages <= {"python", "bash"}, f"README blocks in other languages: {languages}"


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize(
    "command", [c for c, check in BASH.items() if not isinstance(check, str)], ids=str
)
async def test_readme_command_runs(tmp_path: Path, command: str) -> None:
    assert command in commands(), f"`{command}` is no longer in the README"
    check = BASH[command]
    assert not isinstance(check, str)
    await check(command, tmp_path)
