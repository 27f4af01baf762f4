"""The examples run as users run them: ``aiodist run -n N examples/<name>.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from tests.helpers import ROOT
from tests.helpers.procs import free_port
from tests.helpers.warm import popen
from tests.helpers.warm import run as warm_run

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("ranks", "items"), [(4, 200), (3, 50)])
def test_async_pipeline_gathers_every_item(ranks: int, items: int) -> None:
    script = ROOT / "examples" / "async_pipeline.py"
    args = ["-n", str(ranks), str(script), "--items", str(items)]
    result = warm_run(
        [sys.executable, "-m", "aiodist", "run", *args],
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    total = -(-items // ranks) * ranks  # rounded up to equal shares
    assert f"[rank 0] pipeline: {total} items on {ranks} ranks" in result.stdout
    # Every rank shared its progress every 10 records; the last report counts them all.
    last = (total // ranks) // 10 * 10
    assert f"progress: {last * ranks} records done across ranks ({[last] * ranks})" in (
        result.stdout
    )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parameter_server_trains_through_remote_calls(mode: str) -> None:
    script = ROOT / "examples" / "parameter_server.py"
    args = ["-n", "4", str(script), "--steps", "40", *(["--async-sgd"] if mode == "async" else [])]
    result = warm_run(
        [sys.executable, "-m", "aiodist", "run", *args],
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(x for x in result.stdout.splitlines() if "parameter server" in x)
    assert line.startswith(f"[rank 0] parameter server ({mode}): 40 steps, 3 workers, loss ")
    first, last = (float(x) for x in line.split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first / 100  # the workers' gradients reached the master's model
    assert float(line.rsplit(" ", 1)[1]) < 0.05  # close to the weights the data came from
    assert "Warning" not in result.stderr


def test_torch_script_ported_by_its_import_prints_what_torch_prints(tmp_path: Path) -> None:
    ported = ROOT / "examples" / "torch_port.py"
    source = ported.read_text()
    assert source.count("import aiodist.sync as dist") == 2  # the docstring's and the import
    original = tmp_path / "torch_original.py"
    original.write_text(
        source.replace("\nimport aiodist.sync as dist\n", "\nimport torch.distributed as dist\n")
    )
    assert original.read_text() != source  # the import line, and nothing else, differs
    ours = warm_run(
        [sys.executable, "-m", "aiodist", "run", "-n", "2", "--no-prefix", str(ported)],
        timeout=120,
    )
    assert ours.returncode == 0, ours.stdout + ours.stderr
    # The original, under torch.distributed, as torchrun would start it (one pipe per rank).
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
    }
    procs = [
        popen(
            [sys.executable, str(original)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    theirs: list[str] = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            theirs.extend(out.splitlines())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    mine = ours.stdout.splitlines()
    assert len(mine) == 27  # every step printed on both ranks (gather on rank 0 only)
    assert sorted(mine) == sorted(theirs)
    assert mine.count("rank 1 train: weights in sync across ranks: True") == 1


def test_crc_transport_carries_the_jobs_collectives() -> None:
    # The example registers its own transport and the job picks it: every rank's
    # collectives and messages travel over crc:// channels, each frame checksummed.
    script = ROOT / "examples" / "crc_transport.py"
    env = {k: v for k, v in os.environ.items() if k != "AIODIST_TRANSPORT"}
    result = warm_run(
        [sys.executable, "-m", "aiodist", "run", "-n", "4", str(script)],
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [x for x in result.stdout.splitlines() if "crc transport:" in x]
    assert len(lines) == 4, result.stdout
    for line in lines:
        channels = int(line.split(" over ")[1].split(" crc channels")[0])
        checked = int(line.split(", ")[-1].split(" frames")[0])
        assert channels >= 2  # each rank talks to its ring neighbours at least
        assert checked > 0
