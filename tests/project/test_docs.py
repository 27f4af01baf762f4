"""The documentation site: its code runs, its links resolve, it needs no network.

- Every fenced block of ``docs/`` is run as ``tests/helpers/blocks.py`` says, with
  the harnesses and command checks below, or named with the reason it is not;
  a block that is also in the README (the same text) is left to
  ``tests/project/test_readme.py``, so it runs once.
- The built site (``make docs``; ``make test`` passes its folder in
  ``DOCS_SITE``, else the site is built here) has no internal link or
  anchor that goes nowhere, and no page loads anything from another host.
- The pages that list what the code has (every error type, every server
  metric, every ``AIODIST_*`` variable) list all of it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

import pytest

from tests.helpers.blocks import (
    LANGUAGES,
    ROOT,
    Block,
    Check,
    Harness,
    Harnesses,
    check_run,
    check_run_on_daemon,
    check_serve,
    check_serve_token_from_env,
    check_status,
    check_torchrun,
    commands,
    fenced_blocks,
    python_cases,
    run_python_block,
    unfenced_blocks,
)
from tests.helpers.daemon import TOKEN, asyncio_only
from tests.helpers.procs import Finished, run
from tests.project.test_readme import BASH as README_BASH
from tests.project.test_readme import PYTHON as README_PYTHON
from tests.project.test_readme import README

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)


def page_blocks() -> list[Block]:
    return [block for page in PAGES for block in fenced_blocks(page)]


def _readme_runs(block: Block) -> bool:
    """True if ``tests/project/test_readme.py`` runs this very block (the same text)."""
    return any(
        b.code == block.code and b.head in README_PYTHON
        for b in fenced_blocks(README)
        if b.lang == "python"
    )


# --- the python blocks, page by page ------------------------------------------------------


def _ran_without_setup(result: Finished, cwd: Path, world: int) -> None:
    lines = result.stdout.splitlines()
    assert lines == ["(0, 1) True", "[{'loss': 0.5}]"], result.stdout


def _every_rank_joined(result: Finished, cwd: Path, world: int) -> None:
    lines = result.stdout.splitlines()
    for r in range(world):
        assert f"[rank {r}] rank {r} of {world}" in lines, result.stdout


def _metrics_written(result: Finished, cwd: Path, world: int) -> None:
    # 25 steps, a sync every 10th: two syncs, the second just before the script ends
    # (without destroy_process_group): both reach every rank and rank 0 writes both.
    import json

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


def _master_worker_ran(result: Finished, cwd: Path, world: int) -> None:
    # The shape was known on the master; the sum came back from worker 1.
    lines = result.stdout.splitlines()
    assert "[rank 0] 1 -1 (20, 20)" in lines, result.stdout
    assert "[rank 0] 2010.0" in lines, result.stdout


def _server_trained(result: Finished, cwd: Path, world: int) -> None:
    # The loss falls step by step: the gradients reached worker1 and SGD stepped there.
    lines = result.stdout.splitlines()
    losses = [float(line.rsplit(" ", 1)[1]) for line in lines if "loss" in line]
    assert len(losses) == 3, result.stdout
    assert losses[0] > losses[1] > losses[2], result.stdout


_JOINED = """
import torch, aiodist
await aiodist.init_process_group()
rank = aiodist.get_rank()
"""

# Under `aiodist run`, each rank's environment rewritten as the launcher's would be.
_AS_SLURM = """
import os
env = os.environ  # what srun gives each task (MASTER_ADDR: where aiodist run listens)
env["SLURM_PROCID"], env["SLURM_NTASKS"] = env.pop("RANK"), env.pop("WORLD_SIZE")
env["SLURM_LOCALID"], env["SLURM_NODELIST"] = env.pop("LOCAL_RANK"), "localhost"
del env["LOCAL_WORLD_SIZE"]
import aiodist
assert aiodist.infer_launcher() == "slurm"
"""
_AS_OPEN_MPI = """
import os
env = os.environ  # what Open MPI's mpirun gives each rank, MASTER_ADDR exported
env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"] = env.pop("RANK"), env.pop("WORLD_SIZE")
env["OMPI_COMM_WORLD_LOCAL_RANK"] = env.pop("LOCAL_RANK")
env["OMPI_COMM_WORLD_LOCAL_SIZE"] = env.pop("LOCAL_WORLD_SIZE")
import aiodist
assert aiodist.infer_launcher() == "mpi"
"""


def _stepped_alike(result: Finished, cwd: Path, world: int) -> None:
    lines = sorted(result.stdout.splitlines())
    w = -0.5 * 50  # 50 steps of 0.5 times the mean gradient, 1.0
    assert lines == [f"[rank {r}] rank {r} of {world}: {[w] * 3}" for r in range(world)], lines


def _survivors_shrank(result: Finished, cwd: Path, world: int) -> None:
    lines = result.stdout.splitlines()
    for old, new in ((0, 0), (1, 1), (2, 2)):
        line = f"[rank {old}] rank {old} is now {new} of 3: [3.0, 3.0]"
        assert line in lines, result.stdout


# The survivors' aiodist logs the broken group (an error) on stderr, which a run must not write.
_QUIET = "import logging\nlogging.disable(logging.CRITICAL)"

#: page -> first line of a python block -> how it runs.
PYTHON: dict[str, dict[str, Harnesses]] = {
    "docs/guide/elastic.md": {
        "try:": Harness(
            runs=(("aiodist run", 2),),
            wrap_async=True,
            prelude=_JOINED + "grad = torch.ones(2)",
            epilogue="assert grad.tolist() == [2.0, 2.0], grad",
        ),
        "import anyio, torch, aiodist": Harness(
            runs=(("aiodist run", 4),), prelude=_QUIET, check=_survivors_shrank
        ),
        # The members' loop (the growing is tests/integration/test_elastic_grow.py's).
        "import anyio": Harness(runs=(("aiodist run", 3),), check=_stepped_alike),
        # Three ranks that formed the job: none joined late, the view is the job's first.
        "await aiodist.init_process_group(world_size=3, max_world_size=4)": Harness(
            runs=(("aiodist run", 3),),
            wrap_async=True,
            prelude="import aiodist",
            epilogue="view = await aiodist.membership()\n"
            "await aiodist.barrier()  # nobody leaves (a new view) before all looked\n"
            "assert (view.epoch, view.ranks) == (0, (0, 1, 2)), view\n"
            "await aiodist.destroy_process_group()",
        ),
    },
    "docs/guide/torch-backend.md": {
        "import torch": Harness(runs=(("aiodist run", 2),)),
        "try:": Harness(
            runs=(("aiodist run", 2),),
            prelude="import torch, torch.distributed as dist, aiodist.sync\n"
            "aiodist.sync.init_process_group()\n"
            "ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
            "loss = ddp(torch.ones(1, 2)).sum()",
            epilogue="aiodist.sync.destroy_process_group()",
        ),
    },
    "docs/index.md": {
        'objs = await aiodist.all_gather_object({"loss": 0.5})  # one object per rank': Harness(
            runs=(("aiodist run", 2),),
            wrap_async=True,
            prelude=_JOINED + "grads = torch.ones(3) * (rank + 1)",
            epilogue="assert objs == [{'loss': 0.5}] * 2 and grads.tolist() == [3.0] * 3",
        ),
    },
    "docs/guide/async-api.md": {
        "async with aiodist.open_process_group() as world:  # env://, as init_process_group": (
            Harness(
                runs=(("aiodist run", 2),),
                wrap_async=True,
                prelude="import torch, aiodist",
                epilogue="assert t.tolist() == [2.0, 2.0], t",
            )
        ),
        "import anyio, torch, aiodist": Harness(runs=(("python", 1),), check=_ran_without_setup),
        # Names ranks 0 and 2, so four ranks.
        'objs = await aiodist.all_gather_object({"rank": rank, "loss": 0.5})': Harness(
            runs=(("aiodist run", 4),),
            wrap_async=True,
            prelude=_JOINED + "t = torch.ones(4) * rank",
            epilogue="""
assert objs == [{"rank": r, "loss": 0.5} for r in range(4)], objs
assert list(evens.ranks) == [0, 2] and evens.rank == (rank // 2 if rank in (0, 2) else -1)
if rank in (0, 2):
    assert t.tolist() == [2.0] * 4, t  # 0 + 2 on both, then rank 2's
""",
        ),
    },
    "docs/guide/handles.md": {
        "w = aiodist.all_reduce(t)  # already running": Harness(
            runs=(("aiodist run", 2),),
            wrap_async=True,
            prelude=_JOINED + "t = torch.ones(1024) * rank",
            epilogue="assert t.tolist() == [1.0] * 1024 and objs == [{'loss': 0.5}] * 2",
        ),
        "w = aiodist.irecv_object(src=peer, tag=9)": Harness(
            runs=(("aiodist run", 2),),
            wrap_async=True,
            prelude=_JOINED + "import asyncio\npeer = 1 - rank",
            epilogue="""
assert w.is_completed() and not w.cancel()
await aiodist.barrier()  # both withdrew theirs before either sends
await aiodist.isend_object(rank, dst=peer, tag=9)
assert await aiodist.irecv_object(src=peer, tag=9) == peer  # not lost to the withdrawn one
""",
        ),
        "w = aiodist.all_reduce(t)": Harness(
            runs=(("aiodist run", 2),),
            wrap_async=True,
            prelude=_JOINED + "t = torch.ones(3) * (rank + 1)",
            epilogue="assert w.is_completed() and t.tolist() == [3.0] * 3, t",
        ),
    },
    "docs/guide/sync.md": {
        # world_size=4 as written.
        "import os": Harness(
            runs=(("aiodist run", 4),),
            epilogue="""
assert t.tolist() == [6.0] * 4, t
assert objs == [{"loss": 0.5}] * 4, objs
assert grads.tolist() == [10.0] * 8, grads
assert results == (list(dataset) if rank == 0 else None), results
""",
        ),
    },
    "docs/guide/launching.md": {
        "import aiodist.sync as dist": (
            Harness(
                runs=(("aiodist run", 2),),
                prelude=_AS_SLURM,
                check=_every_rank_joined,
                name="slurm",
            ),
            Harness(
                runs=(("aiodist run", 2),),
                prelude=_AS_OPEN_MPI,
                check=_every_rank_joined,
                name="mpi",
            ),
        ),
    },
    "docs/guide/rpc.md": {
        # The page's program: main() on every rank.
        "import anyio": Harness(runs=(("aiodist run", 4),), check=_remote_calls_ran),
        # The torch-style parameter server: trained over an rpc world of its own.
        "import os": Harness(runs=(("aiodist run", 2),), check=_server_trained),
    },
    "docs/guide/master-worker.md": {
        "import anyio": Harness(runs=(("aiodist run", 3),), check=_master_worker_ran),
    },
    "docs/guide/metrics.md": {
        # The on_done snippet, alone (world size 1, nothing initialised) and on 4 ranks.
        "import torch": Harness(
            runs=(("python", 1), ("aiodist run", 4)),
            prelude="""
import os
import aiodist.sync as dist
if "WORLD_SIZE" in os.environ:
    dist.init_process_group()
""",
            check=_metrics_written,
        ),
    },
}


# --- the commands -------------------------------------------------------------------------


async def _check_token_file(command: str, cwd: Path) -> None:
    # `python` is the reader's interpreter: ours.
    line = command.replace("python", shlex.quote(sys.executable), 1)
    result = await run(["bash", "-c", line], limit=30, cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"[0-9a-f]{64}\n", (cwd / "token").read_text())


async def _check_chmod(command: str, cwd: Path) -> None:
    (cwd / "token").write_text(TOKEN)
    result = await run(shlex.split(command), limit=30, cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert (cwd / "token").stat().st_mode & 0o777 == 0o600


# The security page's certificates, made with openssl as it says (each step runs them all).
OPENSSL_STEPS = (
    "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key "
    '-out ca.pem -days 365 -subj "/CN=aiodist job CA"',
    "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout rank.key "
    '-out rank.csr -subj "/CN=aiodist rank"',
    "openssl x509 -req -in rank.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out rank.pem "
    "-days 365",
    "chmod 600 ca.key rank.key",
)
_TLS_TESTED = (
    "tests/integration/test_tls.py runs serve, status and run with --tls-* and AIODIST_TLS_* "
    "on certificates trustme makes"
)


async def _check_openssl(command: str, cwd: Path) -> None:
    for step in OPENSSL_STEPS:
        result = await run(shlex.split(step), limit=60, cwd=cwd)
        assert result.returncode == 0, result.stderr
    from aiodist._transport.tls import config_from

    config = config_from(str(cwd / "rank.pem"), str(cwd / "rank.key"), str(cwd / "ca.pem"))
    assert config is not None
    assert (cwd / "rank.key").stat().st_mode & 0o777 == 0o600


async def _check_run_with_token(command: str, cwd: Path) -> None:
    (cwd / "token").write_text(TOKEN)
    (cwd / "token").chmod(0o600)  # as the page says: it warns otherwise
    await check_run(command, cwd)


_TWO_HOSTS = "two hosts (tests/test_launch_paths.py runs two nodes on two network namespaces)"
_NEEDS_CUDA = "needs a CUDA GPU (make gpu-check runs it on one)"

#: Every command of the pages that the README does not have: how it is checked, or why not.
BASH: dict[str, Check | str] = {
    # Getting started
    "aiodist run -n 4 script.py": (
        "the README's async example, which tests/project/test_readme.py runs so"
    ),
    # Launching
    "aiodist run -n 4 train.py --lr 0.1": check_run,
    "aiodist run -n 4 --no-prefix train.py": check_run,
    "aiodist run -n 4 --max-restarts 3 train.py": check_run,
    "aiodist run -n 4 --rdzv-endpoint 127.0.0.1:29500 train.py": check_run_on_daemon,
    "aiodist run -n 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 "
    "train.py": _TWO_HOSTS,
    "aiodist run -n 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 "
    "train.py": _TWO_HOSTS,
    "torchrun --standalone --nproc-per-node 4 train.py": check_torchrun,
    "torchrun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 "
    "--nproc-per-node 4 train.py": "two hosts (tests/test_launch_paths.py runs torchrun on two "
    "network namespaces)",
    "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 "
    "--rdzv-id job7 train.py": "two hosts (tests/test_launch_paths.py runs c10d on one host)",
    "srun --nodes 2 --ntasks-per-node 4 python train.py": "needs a Slurm cluster; the page's "
    "python block runs init_dist on Slurm's variables",
    "mpirun -np 8 -x MASTER_ADDR=10.0.0.1 python train.py": "needs MPI on two hosts; the page's "
    "python block runs init_dist on Open MPI's variables",
    # The daemon
    "aiodist serve --port 29500": check_serve,
    "aiodist serve --port 29500 --state-dir /var/lib/aiodist": check_serve,
    "aiodist serve --host 0.0.0.0 --token-file /etc/aiodist/token --metrics-port 9500 "
    "--log-format json": check_serve,
    "AIODIST_TOKEN=... aiodist serve --port 29500": check_serve_token_from_env,
    "aiodist status --port 29500": check_status,
    "aiodist status --port 29500 --json": check_status,
    "aiodist status --port 29500 --job train": (
        "tests/integration/test_status_job.py runs `status --job` on a live job"
    ),
    # Seeing inside a running job
    "aiodist status --job train": "tests/test_status_job.py runs it on a live job of three ranks",
    "aiodist status --job train --json": "tests/test_status_job.py runs it on a live job",
    "aiodist status --job train --dump": "tests/test_status_job.py runs it on a live job",
    "kill -USR1 4121": "tests/test_status_job.py sends SIGUSR1 to a rank and reads its dump",
    "AIODIST_TRACE=traces aiodist run -n 4 examples/demo.py": "tests/test_trace.py runs the "
    "demo so and checks the merged trace",
    "aiodist trace merge traces -o job.json": "tests/test_trace.py runs it on the demo's traces",
    # Security
    'python -c "import secrets; print(secrets.token_hex(32))" > token': _check_token_file,
    "chmod 600 token": _check_chmod,
    "aiodist run -n 4 --token-file token train.py": _check_run_with_token,
    **dict.fromkeys(OPENSSL_STEPS, _check_openssl),
    "aiodist serve --host 0.0.0.0 --token-file token --tls-cert server.pem --tls-key server.key "
    "--tls-ca ca.pem": _TLS_TESTED,
    "export AIODIST_TLS_CERT=rank.pem AIODIST_TLS_KEY=rank.key AIODIST_TLS_CA=ca.pem": _TLS_TESTED,
    "aiodist run -n 4 --rdzv-endpoint server-host:29500 train.py": _TLS_TESTED,
    "aiodist status --tls-cert op.pem --tls-key op.key --tls-ca ca.pem": _TLS_TESTED,
    # GPUs
    "aiodist run -n 4 examples/train_overlap.py": check_run,
    "aiodist run -n 4 examples/crc_transport.py": check_run,
    # Master-worker mode
    "aiodist run -n 3 examples/master_worker.py": check_run,
    "aiodist run -n 3 examples/master_worker_pipeline.py": check_run,
    "aiodist run -n 2 examples/train_nccl.py": "needs two CUDA GPUs",
    "aiodist run -n 2 examples/train_overlap.py --device cuda --backend none": _NEEDS_CUDA,
    "python -m benchmarks.bench_bridge": "a benchmark (make bench runs it)",
    "make gpu-check": "needs a CUDA GPU (tests/test_gpu_check.py checks that it fails at once "
    "without one)",
    "python -m benchmarks.gpu_check --device cpu --quick": "minutes long; tests/test_gpu_check.py "
    "runs its parts",
    # Tests and benchmarks
    "make lint": "make test runs it",
    "make docs": "make test runs it; test_docs_site_* build the site without it",
    "make bench": "a benchmark run, minutes long",
}


def test_every_docs_block_is_checked() -> None:
    problems = []
    readme_commands = commands(fenced_blocks(README))
    for page in PAGES:
        page_id = page.relative_to(ROOT).as_posix()
        blocks = fenced_blocks(page)
        table = PYTHON.get(page_id, {})
        for block in blocks:
            if block.lang not in LANGUAGES:
                problems.append(f"{page_id}: a ```{block.lang} block; use one of {LANGUAGES}")
            elif block.lang == "python" and block.head not in table and not _readme_runs(block):
                problems.append(f"{page_id}: python block {block.head!r} has no harness here")
        heads = {b.head for b in blocks if b.lang == "python"}
        stale = [head for head in table if head not in heads]
        problems += [f"{page_id}: no python block starts {head!r} any more" for head in stale]
        for command in commands(blocks):
            if command not in BASH and command not in readme_commands:
                problems.append(f"{page_id}: `{command}` is neither checked nor excused here")
        indented = unfenced_blocks(page)
        problems += [f"{page_id}: a fence that does not start its line: {f}" for f in indented]
    every = commands(page_blocks())
    problems += [f"`{c}` is in no page any more" for c in BASH if c not in every]
    problems += [f"{p}: no such page" for p in PYTHON if not (ROOT / p).is_file()]
    assert not problems, "\n".join(problems)
    assert set(README_BASH) <= set(readme_commands)


def _docs_python_cases() -> list[object]:
    return [case for page, table in PYTHON.items() for case in python_cases(table, page)]


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize(("page", "head", "harness", "launcher", "world"), _docs_python_cases())
async def test_docs_python_block_runs(
    tmp_path: Path, page: str, head: str, harness: Harness, launcher: str, world: int
) -> None:
    found = [b.code for b in fenced_blocks(ROOT / page) if b.lang == "python" and b.head == head]
    assert found, f"{page} has no python block starting {head!r} any more"
    await run_python_block(found[0], harness, launcher, world, tmp_path, f"{page} {head!r}")


@pytest.mark.slow
@asyncio_only
@pytest.mark.parametrize(
    "command", [c for c, check in BASH.items() if not isinstance(check, str)], ids=str
)
async def test_docs_command_runs(tmp_path: Path, command: str) -> None:
    check = BASH[command]
    assert not isinstance(check, str)
    await check(command, tmp_path)


# --- pages that list what the code has ---------------------------------------------------


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "_hooks" / "build.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_failures_page_has_a_section_for_every_error_type() -> None:
    import aiodist._errors

    hooks = _hooks()
    errors = hooks.error_classes()
    real = {
        name
        for name, value in vars(aiodist._errors).items()
        if isinstance(value, type)
        and issubclass(value, BaseException)
        and value.__module__ == "aiodist._errors"
    }
    assert set(errors) == real, "the build's reading of aiodist/_errors.py is off"
    sections = hooks.documented_errors((DOCS / "failures.md").read_text())
    assert not real - sections, f"docs/failures.md has no section for {sorted(real - sections)}"
    assert not sections - real, f"docs/failures.md has sections for no error: {sections - real}"


def test_daemon_page_names_every_server_metric() -> None:
    names = set()
    for path in (ROOT / "aiodist" / "_server").rglob("*metrics*.py"):
        names |= set(re.findall(r"[\"'](aiodist_[a-z_]+)[\"']", path.read_text()))
    assert names, "found no metric names in aiodist/_server/"
    page = (DOCS / "operations" / "daemon.md").read_text()
    missing = sorted(n for n in names if f"`{n}" not in page)
    assert not missing, f"docs/operations/daemon.md does not name {missing}"


# --- the built site -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site: ``make docs``'s, or built here in strict mode."""
    if built := os.environ.get("DOCS_SITE"):
        path = Path(built)
        assert (path / "index.html").is_file(), f"DOCS_SITE={built} holds no site"
        return path
    path = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    return path


class _Page(HTMLParser):
    """The ids a page has, and every URL it refers to, with the tag and attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.refs: list[tuple[str, str, str, str]] = []  # tag, attribute, url, rel

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        for name in ("id", "name"):
            if name in values and (tag != "meta" or name == "id"):
                self.ids.add(values[name])
        for name in ("href", "src"):
            if name in values:
                self.refs.append((tag, name, values[name], values.get("rel", "")))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


def _internal_links(site: Path, pages: list[Path]) -> Iterator[tuple[Path, str, Path, str]]:
    for page in pages:
        for _tag, _attr, url, _rel in _parse(page).refs:
            parts = urlsplit(url)
            if parts.scheme or parts.netloc or url.startswith(("mailto:", "javascript:")):
                continue
            # A path from the site's root (the 404 page's, served at any depth) or the page's.
            path = unquote(parts.path)
            base = site if path.startswith("/") else page.parent
            target = (base / path.lstrip("/")).resolve() if path else page
            if target.is_dir():
                target = target / "index.html"
            yield page, url, target, unquote(parts.fragment)


@pytest.mark.slow
def test_docs_site_index_and_api_pages_have_no_broken_internal_link(site: Path) -> None:
    pages = [site / "index.html", *sorted((site / "reference").glob("*.html"))]
    pages += sorted(p for p in site.rglob("*.html") if p not in pages)
    assert len(pages) >= 10, pages
    ids: dict[Path, set[str]] = {}
    broken = []
    checked = 0
    for page, url, target, fragment in _internal_links(site, pages):
        checked += 1
        where = f"{page.relative_to(site)} -> {url}"
        if not target.is_file() or not target.resolve().is_relative_to(site.resolve()):
            broken.append(f"{where}: no file {target}")
            continue
        if fragment and target.suffix == ".html":
            if target not in ids:
                ids[target] = _parse(target).ids
            if fragment not in ids[target]:
                broken.append(f"{where}: no id {fragment!r} in {target.relative_to(site)}")
    assert checked > 500, f"only {checked} internal links: is the site built?"
    assert not broken, "\n".join(broken)


_EXTERNAL = re.compile(r"^(https?:)?//", re.IGNORECASE)


@pytest.mark.slow
def test_docs_site_fetches_nothing_from_another_host(site: Path) -> None:
    fetched = []
    for page in sorted(site.rglob("*.html")):
        for tag, attr, url, rel in _parse(page).refs:
            is_asset = attr == "src" or (tag == "link" and rel not in ("canonical",))
            if is_asset and _EXTERNAL.match(url):
                fetched.append(f"{page.relative_to(site)}: <{tag} {attr}={url!r} rel={rel!r}>")
        imports = re.findall(r"@import\s+url\(\s*['\"]?(?:https?:)?//[^)]*\)", page.read_text())
        fetched += [f"{page.relative_to(site)}: {found}" for found in imports]
    for sheet in sorted(site.rglob("*.css")):
        for url in re.findall(r"url\(\s*['\"]?((?:https?:)?//[^)'\"]+)", sheet.read_text()):
            fetched.append(f"{sheet.relative_to(site)}: url({url})")
    assert not fetched, "the site would fetch from the network:\n" + "\n".join(fetched)


def test_api_reference_shows_only_what_users_may_call() -> None:
    import griffe

    extensions = griffe.load_extensions("docs/_hooks/docstrings.py:DocstringHabits")
    package = griffe.load("aiodist", search_paths=[str(ROOT)], extensions=extensions)

    def shown(name: str) -> set[str]:
        cls = package[name].final_target
        # What the reference renders: members with a docstring (show_if_no_docstring is off).
        return {n for n, m in cls.members.items() if m.docstring is not None}

    group, work = shown("ProcessGroup"), shown("Work")
    # Before: internals listed as public (ProcessGroup.break_, spawn, take_seq; Work.set_result,
    # settle_as) beside what users call.
    for internal in ("break_", "spawn", "take_seq", "begin", "drive", "abort", "check_usable"):
        assert internal not in group, internal
    for internal in ("set_result", "settle_as", "set_exception", "when_done", "pending"):
        assert internal not in work, internal
    assert "size" in group, group
    assert {"wait", "is_completed", "result", "exception", "add_done_callback"} <= work, work


def test_launching_page_names_every_flag_of_aiodist_run() -> None:
    import argparse

    from aiodist._launch.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    run_parser = sub.choices["run"]
    flags = {
        next(o for o in action.option_strings if o.startswith("--"))
        for action in run_parser._actions
        if any(o.startswith("--") for o in action.option_strings) and action.dest != "help"
    }
    page = (DOCS / "guide" / "launching.md").read_text()
    table = page.split("### torchrun's flags", 1)[1].split("\n## ", 1)[0]
    # Before: no --replace-failed or --max-replacements, and --nnodes "not the elastic MIN:MAX".
    missing = sorted(f for f in flags if f"`{f}" not in table)
    assert not missing, f"docs/guide/launching.md's torchrun table does not name {missing}"
    assert "not the elastic" not in table


def test_index_page_table_links_every_page_of_the_guide_and_operations() -> None:
    nav = re.findall(r":\s*([\w/-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    index = (DOCS / "index.md").read_text()
    listed = set(re.findall(r"\]\(([\w/-]+\.md)\)", index.split("| page |", 1)[1]))
    # The API reference's other modules are one entry (the reference's own nav).
    wanted = {p for p in nav if p != "index.md" and not p.startswith("reference/")}
    # Before: the elastic, torch backend, transports and observability pages were missing.
    assert wanted - listed == set(), sorted(wanted - listed)


@pytest.mark.parametrize("page", ["index.md", "getting-started.md"])
def test_first_pages_code_fits_without_scrolling(page: str) -> None:
    # The theme's code blocks show about 80 characters before they scroll sideways.
    wide = [
        f"{block.head!r}: {line!r}"
        for block in fenced_blocks(DOCS / page)
        for line in block.code.splitlines()
        if len(line) > 80
    ]
    # Before: "make test    # installs, lints (ruff, mypy --strict), builds the docs, ..." (90).
    assert not wide, wide
