"""Launcher environments -> env:// variables, and Slurm hostlist parsing (sans-IO)."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from aiodist._errors import RendezvousError
from aiodist._launch import launchers, slurm_hostlist
from aiodist._launch.launchers import DEFAULT_MASTER_PORT, infer_launcher, launcher_env
from aiodist._launch.slurm_hostlist import expand_slurm_hostlist, first_slurm_host

if TYPE_CHECKING:
    from types import ModuleType

# Every variable infer_launcher or launcher_env reads; cleared in the environ=None tests.
_ALL_VARS = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NODEID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_RANK",
    "MV2_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_SIZE",
)

TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
    "GROUP_RANK": "1",
    "TORCHELASTIC_RUN_ID": "none",
}

OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "6",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "MASTER_ADDR": "head",
}
MPICH = {
    "PMI_RANK": "6",
    "PMI_SIZE": "8",
    "MPI_LOCALRANKID": "2",
    "MPI_LOCALNRANKS": "4",
    "MASTER_ADDR": "head",
}
MVAPICH = {
    "MV2_COMM_WORLD_RANK": "6",
    "MV2_COMM_WORLD_SIZE": "8",
    "MV2_COMM_WORLD_LOCAL_RANK": "2",
    "MV2_COMM_WORLD_LOCAL_SIZE": "4",
    "MASTER_ADDR": "head",
}
MPI_EXPECTED = {
    "MASTER_ADDR": "head",
    "MASTER_PORT": "29500",
    "RANK": "6",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "2",
    "LOCAL_WORLD_SIZE": "4",
}

SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODELIST": "node[01-04,07]",
    "SLURM_TASKS_PER_NODE": "4(x2)",
}


# --- infer_launcher -------------------------------------------------------------------


def test_infer_launcher_empty_environ_is_none() -> None:
    assert infer_launcher({}) == "none"
    assert infer_launcher({"RANK": "0", "SLURM_JOB_ID": "7", "OMPI_COMM_WORLD_RANK": "0"}) == (
        "none"
    )


@pytest.mark.parametrize(
    ("variable", "expected"),
    [
        ("WORLD_SIZE", "pytorch"),
        ("SLURM_NTASKS", "slurm"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "mpi"),
        ("PMI_RANK", "mpi"),
        ("MV2_COMM_WORLD_RANK", "mpi"),
    ],
)
def test_infer_launcher_single_marker(variable: str, expected: str) -> None:
    assert infer_launcher({variable: "0"}) == expected


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"WORLD_SIZE": "2", "SLURM_NTASKS": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, "pytorch"),
        ({"SLURM_NTASKS": "2", "PMI_RANK": "0"}, "slurm"),  # srun --mpi=pmi2
        ({"SLURM_NTASKS": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, "slurm"),
        ({"PMI_RANK": "0", "MV2_COMM_WORLD_RANK": "0"}, "mpi"),
    ],
)
def test_infer_launcher_precedence_follows_mmengine(environ: dict[str, str], expected: str) -> None:
    assert infer_launcher(environ) == expected


def test_infer_launcher_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ALL_VARS:
        monkeypatch.delenv(name, raising=False)
    assert infer_launcher() == "none"
    monkeypatch.setenv("PMI_RANK", "0")
    assert infer_launcher() == "mpi"
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert infer_launcher() == "slurm"


# --- launcher_env: arguments ----------------------------------------------------------


@pytest.mark.parametrize("launcher", ["none", "torchrun", "", "PYTORCH", "openmpi"])
def test_launcher_env_unknown_launcher_names_valid_ones(launcher: str) -> None:
    with pytest.raises(ValueError, match=r"'pytorch', 'mpi', 'slurm'") as info:
        launcher_env(launcher, dict(TORCHRUN))
    assert repr(launcher) in str(info.value)


@pytest.mark.parametrize("port", [0, -1, 65536])
def test_launcher_env_port_out_of_range_raises(port: int) -> None:
    with pytest.raises(ValueError, match=re.escape("1..65535")):
        launcher_env("slurm", SLURM, port=port)


def test_launcher_env_port_with_pytorch_raises() -> None:
    with pytest.raises(ValueError, match="torchrun chose MASTER_PORT"):
        launcher_env("pytorch", TORCHRUN, port=29600)


def test_launcher_env_negative_num_gpus_raises() -> None:
    with pytest.raises(ValueError, match="num_gpus"):
        launcher_env("slurm", SLURM, num_gpus=-1)


def test_launcher_env_does_not_modify_environ() -> None:
    environ = dict(SLURM)
    launcher_env("slurm", environ, port=29555)
    assert environ == SLURM


def test_launcher_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ALL_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in OPENMPI.items():
        monkeypatch.setenv(name, value)
    assert launcher_env("mpi") == MPI_EXPECTED


# --- launcher_env: pytorch ------------------------------------------------------------


def test_pytorch_env_copies_torchrun_variables_only() -> None:
    assert launcher_env("pytorch", TORCHRUN) == {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
    }


def test_pytorch_env_without_local_variables_leaves_them_out() -> None:
    environ = {k: v for k, v in TORCHRUN.items() if not k.startswith("LOCAL_")}
    env = launcher_env("pytorch", environ)
    assert "LOCAL_RANK" not in env
    assert "LOCAL_WORLD_SIZE" not in env
    assert env["RANK"] == "5"


def test_pytorch_env_local_rank_falls_back_to_rank_modulo_gpus() -> None:
    environ = {k: v for k, v in TORCHRUN.items() if k != "LOCAL_RANK"}
    assert launcher_env("pytorch", environ, num_gpus=4)["LOCAL_RANK"] == "1"  # 5 % 4
    # An explicit LOCAL_RANK beats the guess.
    assert launcher_env("pytorch", {**TORCHRUN, "LOCAL_RANK": "3"}, num_gpus=4)["LOCAL_RANK"] == "3"


@pytest.mark.parametrize("variable", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_pytorch_env_missing_variable_names_it(variable: str) -> None:
    environ = {k: v for k, v in TORCHRUN.items() if k != variable}
    with pytest.raises(RendezvousError) as info:
        launcher_env("pytorch", environ)
    message = str(info.value)
    assert f"needs {variable}" in message
    assert "'pytorch'" in message
    assert "torchrun" in message


def test_pytorch_env_empty_variable_counts_as_missing() -> None:
    with pytest.raises(RendezvousError, match=r"needs MASTER_ADDR \(it is set but empty"):
        launcher_env("pytorch", {**TORCHRUN, "MASTER_ADDR": "  "})


@pytest.mark.parametrize(
    ("variable", "value"),
    [("RANK", "one"), ("WORLD_SIZE", "8.0"), ("MASTER_PORT", "29500a"), ("LOCAL_RANK", "0x1")],
)
def test_pytorch_env_malformed_integer_names_variable_and_value(variable: str, value: str) -> None:
    with pytest.raises(RendezvousError, match="not an integer") as info:
        launcher_env("pytorch", {**TORCHRUN, variable: value})
    assert f"{variable}={value!r}" in str(info.value)


def test_pytorch_env_integers_are_normalised() -> None:
    env = launcher_env("pytorch", {**TORCHRUN, "RANK": " 05 ", "MASTER_ADDR": " host "})
    assert env["RANK"] == "5"
    assert env["MASTER_ADDR"] == "host"


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"RANK": "8"}, "RANK=8, outside 0..7"),
        ({"RANK": "-1"}, "RANK=-1; it must be >= 0"),
        ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0; it must be >= 1"),
        ({"LOCAL_RANK": "4"}, "LOCAL_RANK=4, outside 0..3"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000'; it must be in 1..65535"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT='0'"),
    ],
)
def test_pytorch_env_out_of_range_raises(overrides: dict[str, str], fragment: str) -> None:
    with pytest.raises(RendezvousError, match=re.escape(fragment)):
        launcher_env("pytorch", {**TORCHRUN, **overrides})


# --- launcher_env: mpi ----------------------------------------------------------------


@pytest.mark.parametrize("environ", [OPENMPI, MPICH, MVAPICH], ids=["openmpi", "mpich", "mvapich"])
def test_mpi_env_every_flavour(environ: dict[str, str]) -> None:
    assert launcher_env("mpi", environ) == MPI_EXPECTED


def test_mpi_env_mvapich_under_hydra_uses_mv2_local_rank() -> None:
    # Hydra sets PMI_RANK/PMI_SIZE too, but not MPI_LOCALRANKID for MVAPICH.
    environ = {**MVAPICH, "PMI_RANK": "6", "PMI_SIZE": "8"}
    assert launcher_env("mpi", environ) == MPI_EXPECTED


def test_mpi_env_open_mpi_wins_over_other_flavours() -> None:
    environ = {**OPENMPI, "PMI_RANK": "1", "PMI_SIZE": "2", "MV2_COMM_WORLD_RANK": "1"}
    assert launcher_env("mpi", environ)["RANK"] == "6"


@pytest.mark.parametrize(
    ("extra", "port", "expected"),
    [
        ({}, None, str(DEFAULT_MASTER_PORT)),
        ({"MASTER_PORT": "29611"}, None, "29611"),
        ({"MASTER_PORT": "29611"}, 29622, "29622"),
    ],
)
def test_mpi_env_master_port_precedence(
    extra: dict[str, str], port: int | None, expected: str
) -> None:
    assert launcher_env("mpi", {**OPENMPI, **extra}, port=port)["MASTER_PORT"] == expected


@pytest.mark.parametrize("environ", [OPENMPI, MPICH, MVAPICH], ids=["openmpi", "mpich", "mvapich"])
def test_mpi_env_missing_master_addr_says_what_to_export(environ: dict[str, str]) -> None:
    environ = {k: v for k, v in environ.items() if k != "MASTER_ADDR"}
    with pytest.raises(RendezvousError) as info:
        launcher_env("mpi", environ)
    message = str(info.value)
    assert "launcher 'mpi' needs MASTER_ADDR" in message
    assert "export MASTER_ADDR=<address of rank 0's host>" in message


def test_mpi_env_no_flavour_names_every_rank_variable() -> None:
    with pytest.raises(RendezvousError) as info:
        launcher_env("mpi", {"MASTER_ADDR": "head"})
    message = str(info.value)
    for variable in ("OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK"):
        assert variable in message
    assert "mpirun" in message


@pytest.mark.parametrize(
    ("environ", "missing"),
    [
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
        ({"PMI_RANK": "0"}, "PMI_SIZE"),
        ({"MV2_COMM_WORLD_RANK": "0"}, "MV2_COMM_WORLD_SIZE"),
    ],
)
def test_mpi_env_partial_flavour_names_missing_variable(
    environ: dict[str, str], missing: str
) -> None:
    with pytest.raises(RendezvousError, match=f"launcher 'mpi' needs {missing}"):
        launcher_env("mpi", {**environ, "MASTER_ADDR": "head"})


def test_mpi_env_malformed_size_names_variable_and_value() -> None:
    with pytest.raises(RendezvousError, match=re.escape("PMI_SIZE='eight'")):
        launcher_env("mpi", {**MPICH, "PMI_SIZE": "eight"})


def test_mpi_env_rank_beyond_size_raises() -> None:
    with pytest.raises(RendezvousError, match=re.escape("OMPI_COMM_WORLD_RANK=8, outside 0..7")):
        launcher_env("mpi", {**OPENMPI, "OMPI_COMM_WORLD_RANK": "8"})


def test_mpi_env_without_local_rank_uses_num_gpus_or_leaves_it_out() -> None:
    environ = {"PMI_RANK": "6", "PMI_SIZE": "8", "MASTER_ADDR": "head"}
    assert launcher_env("mpi", environ, num_gpus=4)["LOCAL_RANK"] == "2"
    env = launcher_env("mpi", environ)
    assert "LOCAL_RANK" not in env
    assert "LOCAL_WORLD_SIZE" not in env


# --- launcher_env: slurm --------------------------------------------------------------


def test_slurm_env_typical_srun_task() -> None:
    assert launcher_env("slurm", SLURM) == {
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "29500",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
    }


def test_slurm_env_existing_master_addr_wins_and_nodelist_is_not_parsed() -> None:
    env = launcher_env("slurm", {**SLURM, "MASTER_ADDR": "10.1.2.3", "SLURM_NODELIST": "x[1-"})
    assert env["MASTER_ADDR"] == "10.1.2.3"


def test_slurm_env_falls_back_to_job_nodelist() -> None:
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"}
    environ["SLURM_JOB_NODELIST"] = "gpu5,node[3-4]"
    assert launcher_env("slurm", environ)["MASTER_ADDR"] == "gpu5"


def test_slurm_env_prefers_nodelist_over_job_nodelist() -> None:
    environ = {**SLURM, "SLURM_JOB_NODELIST": "other[1-9]"}
    assert launcher_env("slurm", environ)["MASTER_ADDR"] == "node01"


@pytest.mark.parametrize(
    ("extra", "port", "expected"),
    [
        ({}, None, "29500"),
        ({"MASTER_PORT": "29611"}, None, "29611"),
        ({"MASTER_PORT": "29611"}, 29622, "29622"),
        ({}, 29622, "29622"),
    ],
)
def test_slurm_env_master_port_precedence(
    extra: dict[str, str], port: int | None, expected: str
) -> None:
    assert launcher_env("slurm", {**SLURM, **extra}, port=port)["MASTER_PORT"] == expected


def test_slurm_env_local_rank_from_localid_beats_num_gpus() -> None:
    assert launcher_env("slurm", SLURM, num_gpus=3)["LOCAL_RANK"] == "1"  # not 5 % 3
    assert launcher_env("slurm", {**SLURM, "SLURM_LOCALID": "0"}, num_gpus=2)["LOCAL_RANK"] == "0"


def test_slurm_env_without_localid_uses_procid_modulo_gpus() -> None:
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}
    assert launcher_env("slurm", environ, num_gpus=4)["LOCAL_RANK"] == "1"
    assert launcher_env("slurm", environ, num_gpus=3)["LOCAL_RANK"] == "2"


def test_slurm_env_without_localid_or_gpus_leaves_local_rank_out() -> None:
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_LOCALID"}
    env = launcher_env("slurm", environ)
    assert "LOCAL_RANK" not in env
    assert env["LOCAL_WORLD_SIZE"] == "4"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "4(x2)"}, "2"),
        ({"SLURM_NTASKS_PER_NODE": "junk", "SLURM_TASKS_PER_NODE": "4(x2)"}, "4"),
        ({"SLURM_TASKS_PER_NODE": "4"}, "4"),
        ({"SLURM_TASKS_PER_NODE": "2,2,2"}, "2"),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, "1"),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "2"}, "2"),
        ({"SLURM_TASKS_PER_NODE": "3,2(x2)", "SLURM_NODEID": "0"}, "3"),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1"}, None),  # uneven and no node id
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "9"}, None),
        ({"SLURM_TASKS_PER_NODE": "two"}, None),
        ({"SLURM_TASKS_PER_NODE": "2(x)"}, None),
        ({}, None),
    ],
)
def test_slurm_env_local_world_size(extra: dict[str, str], expected: str | None) -> None:
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"}
    environ["SLURM_LOCALID"] = "0"
    env = launcher_env("slurm", {**environ, **extra})
    assert env.get("LOCAL_WORLD_SIZE") == expected


@pytest.mark.parametrize("variable", ["SLURM_PROCID", "SLURM_NTASKS"])
def test_slurm_env_missing_variable_names_it(variable: str) -> None:
    environ = {k: v for k, v in SLURM.items() if k != variable}
    with pytest.raises(RendezvousError) as info:
        launcher_env("slurm", environ)
    message = str(info.value)
    assert f"launcher 'slurm' needs {variable}" in message
    assert "srun" in message


def test_slurm_env_without_nodelist_or_master_addr_names_all_three() -> None:
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_NODELIST"}
    with pytest.raises(RendezvousError) as info:
        launcher_env("slurm", environ)
    message = str(info.value)
    for variable in ("SLURM_NODELIST", "SLURM_JOB_NODELIST", "MASTER_ADDR"):
        assert variable in message


def test_slurm_env_malformed_nodelist_names_variable_and_keeps_cause() -> None:
    with pytest.raises(RendezvousError) as info:
        launcher_env("slurm", {**SLURM, "SLURM_NODELIST": "node[01-04"})
    message = str(info.value)
    assert "SLURM_NODELIST='node[01-04'" in message
    assert "export MASTER_ADDR" in message
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"SLURM_PROCID": "abc"}, "SLURM_PROCID='abc', which is not an integer"),
        ({"SLURM_NTASKS": ""}, "needs SLURM_NTASKS (it is set but empty"),
        ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8, outside 0..7 (SLURM_NTASKS=8)"),
        ({"SLURM_LOCALID": "4"}, "SLURM_LOCALID=4, outside 0..3 (SLURM_TASKS_PER_NODE=4)"),
        ({"SLURM_LOCALID": "x"}, "SLURM_LOCALID='x'"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ],
)
def test_slurm_env_bad_values_raise(overrides: dict[str, str], fragment: str) -> None:
    with pytest.raises(RendezvousError, match=re.escape(fragment)):
        launcher_env("slurm", {**SLURM, **overrides})


# --- Slurm hostlists ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("host", ["host"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("gpu5,node[3-4]", ["gpu5", "node3", "node4"]),
        ("a[1-2]-ib[3-4]", ["a1-ib3", "a1-ib4", "a2-ib3", "a2-ib4"]),
        ("rack1-n[008-010]", ["rack1-n008", "rack1-n009", "rack1-n010"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("n[5]", ["n5"]),
        ("n[1,3],m[2-3].ib,z", ["n1", "n3", "m2.ib", "m3.ib", "z"]),
        ("host1,host1", ["host1", "host1"]),
        ("  node[1-2]\n", ["node1", "node2"]),
        ("gpu-a100.cluster.local", ["gpu-a100.cluster.local"]),
    ],
)
def test_expand_slurm_hostlist(nodelist: str, hosts: list[str]) -> None:
    assert expand_slurm_hostlist(nodelist) == hosts
    assert first_slurm_host(nodelist) == hosts[0]


def test_first_slurm_host_does_not_expand_the_rest() -> None:
    # Expanding this would take minutes and gigabytes; the first host needs neither.
    assert first_slurm_host("n[0007-9999999999999],m[1-99999999999]") == "n0007"


@pytest.mark.parametrize(
    ("nodelist", "why"),
    [
        ("", "empty Slurm hostlist"),
        ("   ", "empty Slurm hostlist"),
        ("node[1-3", "'[' at position 4 is never closed"),
        ("node1-3]", "']' at position 7 has no matching '['"),
        ("node[[1-2]]", "nested '['"),
        ("node[]", "bad range ''"),
        ("node[a-c]", "bad range 'a-c'"),
        ("node[1-]", "bad range '1-'"),
        ("node[-2]", "bad range '-2'"),
        ("node[1-2,]", "bad range ''"),
        ("node[1:2]", "bad range '1:2'"),
        ("node[3-1]", "runs backwards"),
        ("a,,b", "empty host name before ','"),
        (",a", "empty host name before ','"),
        ("a,", "empty host name after the last ','"),
        ("no de", "whitespace at position 2"),
        ("ok,bad[1-2", "never closed"),  # malformed after the first host too
    ],
)
def test_malformed_slurm_hostlist_raises_value_error(nodelist: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        expand_slurm_hostlist(nodelist)
    with pytest.raises(ValueError, match=re.escape(why)):
        first_slurm_host(nodelist)


# --- the module itself ----------------------------------------------------------------


@pytest.mark.parametrize("module", [launchers, slurm_hostlist])
def test_module_imports_no_torch_asyncio_or_subprocess(module: ModuleType) -> None:
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            imported.add(node.module.split(".")[0])
    assert imported, "the walk found no imports at all"
    assert not imported & {"torch", "asyncio", "subprocess", "socket", "anyio"}


def test_default_master_port_is_torch_default() -> None:
    assert DEFAULT_MASTER_PORT == 29500
