"""`aiodist run --start-method`: a rank forked from the warm interpreter is the rank exec gives.

Each probe runs under both methods, and what the ranks see of themselves must be
the same (pids and other per-process facts aside): the default, ``forkserver``,
must not change what a script observes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Any

import pytest

from tests.helpers import ROOT, warm

if TYPE_CHECKING:
    from pathlib import Path

METHODS = ("forkserver", "spawn")

PROBE = """\
import atexit, json, os, random, signal, sys, threading
import numpy

first = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))


def late():
    threading.Event().wait(0.3)
    print("thread ran", flush=True)


threading.Thread(target=late).start()
print(json.dumps({
    "rank": int(os.environ["RANK"]),
    "pid": os.getpid(),
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "mine": os.environ.get("PROBE_VAR"),
    "ppid_is_launcher": os.getppid() == int(os.environ.get("LAUNCHER_PID", os.getppid())),
    "ppid": os.getppid(),
    # What the process image was exec'd with: a forked rank has its server's.
    "image_env_has_probe_var": b"PROBE_VAR=" in open("/proc/self/environ", "rb").read(),
    "spare_env": "_AIODIST_FORK_SERVER" in os.environ,
    "own_group": os.getpgrp() == os.getpid(),
    "stdin": sys.stdin.read(),
    "py_random": random.random(),
    "np_random": float(numpy.random.random()),
    "main_module": sys.modules["__main__"].__file__,
    # The server preloads aiodist, yet a rank imports it as a fresh interpreter does.
    "aiodist_before_import": any(n.split(".")[0] == "aiodist" for n in sys.modules),
}), flush=True)
import aiodist.sync
assert aiodist.sync.get_rank() == 0 and aiodist._group.world is sys.modules["aiodist._group.world"]
if first != "ok" and os.environ["RANK"] == "0":
    threading.Event().wait(60)  # still running when rank 1 ends: the launcher stops it
if first == "exit" and os.environ["RANK"] == "1":
    sys.exit(4)
if first == "raise" and os.environ["RANK"] == "1":
    raise ValueError("the probe's own error")
if first == "kill" and os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _launch(
    tmp_path: Path, method: str, *args: str, nproc: int = 2
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    wrapper = tmp_path / "launch.py"
    # The launcher's own pid, for the ranks to compare with their parent's.
    wrapper.write_text(
        textwrap.dedent(
            """\
            import os, sys
            os.environ["LAUNCHER_PID"] = str(os.getpid())
            from aiodist._launch.cli import main
            sys.exit(main(sys.argv[1:]))
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env |= {"PYTHONPATH": str(ROOT), "PROBE_VAR": "from the launcher's environment"}
    return subprocess.run(
        [
            sys.executable,
            str(wrapper),
            "run",
            "-n",
            str(nproc),
            "--no-prefix",
            "--start-method",
            method,
            str(script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )


def _reports(stdout: str) -> dict[int, dict[str, Any]]:
    reports = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {r["rank"]: r for r in reports}


def _same_for_both(tmp_path: Path, *args: str) -> dict[str, subprocess.CompletedProcess[str]]:
    """The same probe under each start method, each in a directory of its own."""
    done = {}
    for method in METHODS:
        (tmp_path / method).mkdir()
        done[method] = _launch(tmp_path / method, method, *args)
    return done


def _summary(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The launcher's lines about its ranks, pids left out."""
    pids = {r["pid"] for r in _reports(result.stdout).values()}
    lines = [line for line in result.stderr.splitlines() if line.startswith("aiodist run:")]
    for pid in pids:
        lines = [line.replace(f"pid {pid}", "pid N") for line in lines]
    return lines


def test_a_forked_rank_sees_what_an_execd_rank_sees(tmp_path: Path) -> None:
    done = _same_for_both(tmp_path, "ok", "second")
    seen = {}
    for method, result in done.items():
        assert result.returncode == 0, (method, result.stderr)
        reports = _reports(result.stdout)
        assert sorted(reports) == [0, 1], (method, result.stdout)
        for r in reports.values():
            probe = str(tmp_path / method / "probe.py")
            assert r["name"] == "__main__"
            assert r["file"] == probe == r["main_module"]
            assert r["argv"] == [probe, "ok", "second"]
            assert r["path0"] == str(tmp_path / method) == r["cwd"]
            assert r["mine"] == "from the launcher's environment"
            assert r["ppid_is_launcher"], (method, r)
            assert r["own_group"], (method, r)
            assert r["stdin"] == ""
            assert not r["aiodist_before_import"], (method, r)
        # Each rank has its own random state, as processes of their own have.
        assert reports[0]["py_random"] != reports[1]["py_random"], method
        assert reports[0]["np_random"] != reports[1]["np_random"], method
        # Threads are joined and atexit runs before the rank exits, in that order.
        assert result.stdout.count("thread ran") == 2, (method, result.stdout)
        assert result.stdout.count("atexit ran") == 2, (method, result.stdout)
        assert result.stdout.index("thread ran") < result.stdout.rindex("atexit ran")
        seen[method] = {k for r in reports.values() for k, v in r.items() if v is True}
    assert seen["forkserver"] == seen["spawn"]


@pytest.mark.parametrize("how", ["exit", "raise", "kill"])
def test_a_forked_ranks_end_is_reported_as_an_execd_ranks(tmp_path: Path, how: str) -> None:
    done = _same_for_both(tmp_path, how)
    codes = {m: r.returncode for m, r in done.items()}
    assert codes["forkserver"] == codes["spawn"] == {"exit": 4, "raise": 1, "kill": 137}[how]
    summaries = {m: _summary(r) for m, r in done.items()}
    assert summaries["forkserver"] == summaries["spawn"], summaries
    if how == "raise":
        for method, r in done.items():
            tb = r.stderr[r.stderr.index("Traceback") :]
            # The traceback starts at the script's own frame, as the interpreter prints it.
            # Its frames are the indented lines: the other rank's lines may come between.
            frames = [line for line in tb.splitlines()[1:] if line.startswith("  ")]
            assert frames[0].strip().startswith(f'File "{tmp_path / method / "probe.py"}"'), tb
            assert "ValueError: the probe's own error" in tb
    if how == "kill":
        assert "killed by SIGKILL" in done["forkserver"].stderr


@pytest.mark.parametrize("method", METHODS)
def test_a_launcher_forked_warm_forks_its_ranks_from_a_server_forked_beside_it(
    tmp_path: Path, method: str
) -> None:
    """``python -m aiodist run`` forked from a server (as the suite starts its launchers)
    gets a preloaded server forked with it instead of exec'ing one; its ranks see what
    ranks of an exec'd launcher see, and nothing of the hand-over."""
    (tmp_path / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env |= {"PYTHONPATH": str(ROOT), "PROBE_VAR": "from the launcher's environment"}
    argv = [sys.executable, "-m", "aiodist", "run", "-n", "2", "--no-prefix"]
    proc = warm.popen(
        [*argv, "--start-method", method, "probe.py", "ok"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
    )
    assert isinstance(proc, warm.WarmPopen), "the launcher was not forked warm"
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    reports = _reports(out)
    assert sorted(reports) == [0, 1], out
    for r in reports.values():
        assert r["ppid"] == proc.pid
        assert r["mine"] == "from the launcher's environment"
        assert r["argv"] == ["probe.py", "ok"]
        assert not r["aiodist_before_import"], r
        assert not r["spare_env"], r
        # Forked from the server forked with the launcher, whose image is the suite's
        # server's (no PROBE_VAR); an exec'd server's image has the launcher's environment.
        assert r["image_env_has_probe_var"] == (method == "spawn"), r
    assert out.count("atexit ran") == 2, out


def test_ranks_start_by_exec_when_the_warm_interpreter_cannot_fork(tmp_path: Path) -> None:
    """A Python thread started while preloading makes forking unsafe: exec, saying why."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n"
    )
    script = tmp_path / "probe.py"
    script.write_text('import os\nprint("rank", os.environ["RANK"], flush=True)\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIODIST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    result = subprocess.run(
        [sys.executable, "-m", "aiodist", "run", "-n", "2", "--no-prefix", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:2]) == ["rank 0", "rank 1"]
    assert "Python threads after preloading" in result.stderr
    assert "using exec" in result.stderr
