"""The tree shows the architecture: one package per layer, imports pointing down, no cycles.

The checker (``aiodist._tools.layers``) reads the import graph with ``ast``; these
tests run it on the real tree, and on small trees written here to prove that
each rule can fail and that its message names the offending import.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap
from typing import TYPE_CHECKING

import pytest

from tests.helpers import ROOT

if TYPE_CHECKING:
    from pathlib import Path
    from types import ModuleType

PACKAGE = ROOT / "aiodist"


def _load_checker() -> (
    ModuleType
):  # by path: checking the tree must not need `import aiodist` to work
    spec = importlib.util.spec_from_file_location("aiodist_layers", PACKAGE / "_tools/layers.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


_checker = _load_checker()
LAYERS, PUBLIC, beneath = _checker.LAYERS, _checker.PUBLIC, _checker.beneath
check, layer_of, main, read_imports = (
    _checker.check,
    _checker.layer_of,
    _checker.main,
    _checker.read_imports,
)


def _tree(root: Path, files: dict[str, str]) -> Path:
    """Write a package named ``aiodist`` under ``root`` from {relative path: source}."""
    pkg = root / "aiodist"
    for rel, source in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    for directory in [pkg, *(p for p in pkg.rglob("*") if p.is_dir())]:
        (directory / "__init__.py").touch()
    return pkg


def _problems(pkg: Path) -> list[str]:
    modules, imports = read_imports(pkg)
    problems: list[str] = check(modules, imports)
    return problems


def test_the_package_keeps_every_layer_rule() -> None:
    modules, imports = read_imports(PACKAGE)
    assert check(modules, imports) == []
    assert main([]) == 0


def test_every_module_sits_in_a_layer_and_the_root_holds_only_the_public_face() -> None:
    modules, _ = read_imports(PACKAGE)
    assert all(layer_of(m) is not None for m in modules)
    root_files = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert set(root_files) <= {*PUBLIC, "_errors", "_settings"}  # leaves every layer reads
    assert len(root_files) <= 8, root_files


def test_each_layer_package_says_what_it_owns_and_may_import() -> None:
    for name, _, _ in LAYERS:
        init = PACKAGE / name / "__init__.py"
        if name in ("public", "_errors", "_settings"):  # one module each, no package
            continue
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree)
        assert doc is not None, f"{init} needs a layer docstring"
        assert "May import" in doc, f"{init}'s docstring should say what the layer may import"
        # A layer's __init__ imports nothing: importing one module of it loads no other.
        assert not any(isinstance(n, ast.Import | ast.ImportFrom) for n in tree.body), init


def test_only_public_modules_list_their_names_in_all() -> None:
    # A private module's interface is its names without a leading underscore; only
    # the public modules' ``__all__`` (the API, read by gen_sync and the docs) is kept.
    listed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        private = any(
            part.startswith("_") and part != "__init__.py"
            for part in path.relative_to(PACKAGE).parts
        )
        tree = ast.parse(path.read_text())
        names = {
            t.id
            for n in tree.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        if private and "__all__" in names:
            listed.append(str(path.relative_to(ROOT)))
    assert listed == []


def test_internal_layers_never_import_the_public_face() -> None:
    _, imports = read_imports(PACKAGE)
    upward = [
        i for i in imports if layer_of(i.imported) == "public" and layer_of(i.importer) != "public"
    ]
    assert upward == []


def test_back_import_at_module_level_is_named(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "_ops/common.py": "from aiodist._torch.bridge import bridged\n",
            "_torch/bridge.py": "bridged = None\n",
        },
    )
    [problem] = _problems(pkg)
    assert "_ops/common.py:1" in problem
    assert "aiodist._ops.common imports aiodist._torch.bridge" in problem
    assert "layer _ops sits below layer _torch" in problem


def test_back_import_inside_a_function_is_named(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "_group/world.py": """\
                def init():
                    from aiodist._launch import init as launch_init
                    return launch_init
            """,
            "_launch/init.py": "",
        },
    )
    [problem] = _problems(pkg)
    assert "_group/world.py:2" in problem
    assert "aiodist._group.world imports aiodist._launch.init" in problem


def test_internal_module_importing_the_package_root_is_named(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {"_plane/peers.py": "from aiodist import get_rank\n"})
    [problem] = _problems(pkg)
    assert "aiodist._plane.peers imports aiodist," in problem


def test_type_checking_imports_are_exempt(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "_group/group.py": """\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from aiodist._torch.bridge import GroupBridge
            """,
            "_torch/bridge.py": "from aiodist._group.group import ProcessGroup\n",
        },
    )
    assert _problems(pkg) == []


def test_cycle_within_a_layer_names_every_step(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "_ops/a.py": "from aiodist._ops import b\n",
            "_ops/b.py": "import os\n\ndef f():\n    from aiodist._ops.c import g\n",
            "_ops/c.py": "from . import a\n",  # relative imports resolve too
        },
    )
    [problem] = _problems(pkg)
    assert problem.startswith("import cycle: aiodist._ops.a (")
    assert "aiodist._ops.b (" in problem
    assert "b.py:4" in problem
    assert "aiodist._ops.c (" in problem
    assert "c.py:1" in problem


def test_module_in_no_layer_is_named(tmp_path: Path) -> None:
    pkg = _tree(tmp_path, {"_peers.py": "", "_stuff/x.py": ""})
    problems = _problems(pkg)
    assert any(p.startswith("aiodist._peers is in no layer") for p in problems)
    assert any(p.startswith("aiodist._stuff.x is in no layer") for p in problems)


@pytest.mark.parametrize(
    ("importer", "imported"),
    [("_wire", "_transport"), ("_server", "_control"), ("_plane", "_group"), ("_torch", "_launch")],
)
def test_each_adjacent_pair_of_layers_is_ordered(
    tmp_path: Path, importer: str, imported: str
) -> None:
    pkg = _tree(
        tmp_path,
        {f"{importer}/low.py": f"from aiodist.{imported} import high\n", f"{imported}/high.py": ""},
    )
    assert len(_problems(pkg)) == 1
    down = _tree(
        tmp_path / "down",
        {f"{imported}/high.py": f"from aiodist.{importer} import low\n", f"{importer}/low.py": ""},
    )
    assert _problems(down) == []


@pytest.mark.parametrize(
    ("importer", "imported"),
    [("_rpc", "_ops"), ("_ops", "_rpc"), ("_torch", "_metrics"), ("_metrics", "_torch")],
)
def test_sibling_layers_may_not_import_each_other(
    tmp_path: Path, importer: str, imported: str
) -> None:
    pkg = _tree(
        tmp_path,
        {f"{importer}/a.py": f"from aiodist.{imported} import b\n", f"{imported}/b.py": ""},
    )
    [problem] = _problems(pkg)
    assert f"aiodist.{importer}.a imports aiodist.{imported}.b" in problem
    assert f"layers {importer} and {imported} are siblings" in problem


def test_the_branches_share_what_lies_beneath_them() -> None:
    assert {"_group", "_plane", "_wire", "_errors"} <= beneath("_ops") & beneath("_rpc")
    assert "_ops" in beneath("_torch")
    assert "_ops" in beneath("_metrics")
    assert {"_torch", "_rpc", "_ops"} <= beneath("_launch")
    assert "_launch" not in beneath("_metrics")
    assert all(name in beneath("_tools") for name, _, _ in LAYERS if name != "_tools")


def test_type_only_cycle_inside_a_package_is_named(tmp_path: Path) -> None:
    pkg = _tree(
        tmp_path,
        {
            "_ops/a.py": "from aiodist._ops import b\n",
            "_ops/b.py": """\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from aiodist._ops.a import A
            """,
        },
    )
    [problem] = _problems(pkg)
    assert problem.startswith("import cycle: aiodist._ops.a (")
    assert "b.py:3, type only" in problem


def test_type_only_cycle_between_session_and_group_is_named(tmp_path: Path) -> None:
    # No package's type-only cycles are tolerated any more: not even the session's.
    pkg = _tree(
        tmp_path,
        {
            "_group/session.py": "from aiodist._group import group\n",
            "_group/group.py": """\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from aiodist._group.session import Session
            """,
        },
    )
    [problem] = _problems(pkg)
    assert problem.startswith("import cycle: aiodist._group.group (")
    assert "group.py:3, type only" in problem
    assert "aiodist._group.session (" in problem


@pytest.mark.parametrize("package", ["_control", "_launch"])
def test_type_only_cycle_of_a_package_no_longer_tolerated_is_named(
    tmp_path: Path, package: str
) -> None:
    pkg = _tree(
        tmp_path,
        {
            f"{package}/run.py": f"from aiodist.{package} import placement\n",
            f"{package}/placement.py": f"""\
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from aiodist.{package}.run import LaunchSpec
            """,
        },
    )
    [problem] = _problems(pkg)
    assert problem.startswith(f"import cycle: aiodist.{package}.placement (")
    assert "placement.py:3, type only" in problem
