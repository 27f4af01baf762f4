"""The layer rules of aiodist's tree, checked on its import graph (read with ``ast``).

    python aiodist/_tools/layers.py           # exit 1, naming each offending import
    python aiodist/_tools/layers.py --graph   # who imports whom, layer by layer

The rules (shared/DESIGN.md, "Layers"):

- Every module belongs to one layer: a private subpackage (``aiodist._ops``), the
  errors module at the bottom, the public face at the top (the package root's
  ``__init__``, ``sync``, ``metrics``, ...), and the developer tools above all.
- A module imports only modules of its own layer or of layers below it: never
  one above, at module level or inside a function. Imports under
  ``if TYPE_CHECKING:`` are annotations only and are exempt.
- No import cycle between modules, counting imports inside functions: no file
  imports a file that imports it back, however many files lie between.
- The package root holds only the public face and the errors module.

Nothing of aiodist is imported to check this (run it as a script, as ``make
lint`` does): the tree is read as text, so an import cycle that stops
``import aiodist`` itself is still reported as the offending import.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = ["LAYERS", "PUBLIC", "Import", "check", "layer_of", "main", "read_imports"]

#: The layers from the bottom up, with what each owns.
LAYERS: Final[tuple[tuple[str, str], ...]] = (
    ("_errors", "the exception tree and its wire codes"),
    ("_wire", "sans-IO framing, messages, the object codec, the token proofs"),
    ("_transport", "bytes between two processes: TCP, Unix sockets, shared memory"),
    ("_server", "the rendezvous server: jobs, store, liveness"),
    ("_control", "a rank's connection to the server: channels, store, init methods"),
    ("_plane", "the data plane: its sans-IO core, channels, matching, bulk transfers, glue"),
    ("_group", "work handles, sessions, joining, process groups, the default world"),
    ("_ops", "collectives, p2p, object operations, new_group"),
    ("_torch", "the bridge to torch.distributed and its store"),
    ("_launch", "starting a job: init_process_group, launchers, aiodist run, the CLI"),
    ("_metrics", "the metric aggregator's internals"),
    ("_sync", "the background loop thread the blocking facade runs on"),
    ("public", "the public face: aiodist, aiodist.sync, aiodist.metrics, ..."),
    ("_tools", "developer tools (gen_sync, this checker); nothing imports them"),
)
#: Modules of the package root that make up the public face.
PUBLIC: Final = ("__init__", "__main__", "sync", "metrics", "testing", "rpc", "transport")
_INDEX: Final = {name: i for i, (name, _) in enumerate(LAYERS)}


@dataclasses.dataclass(frozen=True, slots=True)
class Import:
    """One import of a module of the package by another, where it is written."""

    importer: str  # dotted module name
    imported: str
    path: Path
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def layer_of(module: str) -> str | None:
    """The layer ``module`` (``aiodist._ops.common``) belongs to; None if it has none."""
    parts = module.split(".")
    if len(parts) == 1:
        return "public"
    head = parts[1]
    if len(parts) == 2 and head in PUBLIC:
        return "public"
    return head if head in _INDEX and head != "public" else None


def _modules(package_dir: Path, package: str) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    exempt: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            exempt.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return exempt


def read_imports(package_dir: Path, package: str = "aiodist") -> tuple[list[str], list[Import]]:
    """Every module under ``package_dir`` and every import of one of them by another.

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a
    module, else ``pkg``; relative imports are resolved.
    """
    modules = _modules(package_dir, package)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    imports: list[Import] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        shown = path.relative_to(package_dir.parent)  # aiodist/_ops/common.py
        exempt = _type_checking_nodes(tree)
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in exempt or not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for target in targets:
                if target != package and not target.startswith(package + "."):
                    continue
                resolved = resolve(target)
                if resolved is not None and resolved != module:
                    imports.append(Import(module, resolved, shown, node.lineno))
    return list(modules), imports


def check(modules: Sequence[str], imports: Iterable[Import]) -> list[str]:
    """What breaks the rules, one sentence each; empty when the tree keeps them."""
    imports = list(imports)
    problems: list[str] = []
    for module in modules:
        if layer_of(module) is None:
            kind = "module" if module.count(".") == 1 else "package"
            problems.append(
                f"{module} is in no layer: the package root holds only the public face "
                f"({', '.join(PUBLIC)}) and _errors; put this {kind} in a layer's package, "
                "or add its package to LAYERS in aiodist/_tools/layers.py with what it owns"
            )
    for imp in imports:
        mine, theirs = layer_of(imp.importer), layer_of(imp.imported)
        if mine is None or theirs is None or _INDEX[theirs] <= _INDEX[mine]:
            continue
        problems.append(
            f"{imp.where()}: {imp.importer} imports {imp.imported}, but layer {mine} sits "
            f"below layer {theirs} and may import only its own layer and those below it. "
            "Move what both need down a layer, or pass it in."
        )
    problems.extend(_cycles(modules, imports))
    return problems


def _cycles(modules: Sequence[str], imports: list[Import]) -> list[str]:
    edges: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in imports:
        edges.setdefault(imp.importer, {}).setdefault(imp.imported, imp)
    problems = []
    for component in _strongly_connected(edges):
        if len(component) < 2:
            continue
        path = _cycle_through(min(component), component, edges)
        steps = " -> ".join(f"{imp.importer} ({imp.where()})" for imp in path)
        problems.append(
            f"import cycle: {steps} -> {path[0].importer}. No module may import one that "
            "imports it back (inside functions too); move what they share down a layer"
        )
    return problems


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    # Tarjan's algorithm, iterative: the tree's depth must not meet the recursion limit.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in edges:
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, list(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, list(edges.get(nxt, {}))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def _cycle_through(
    start: str, component: set[str], edges: dict[str, dict[str, Import]]
) -> list[Import]:
    # Breadth-first from start back to itself, inside the component: a shortest cycle.
    came: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for target, imp in sorted(edges[node].items()):
                if target not in component:
                    continue
                if target == start:
                    path = [imp]
                    while path[0].importer != start:
                        path.insert(0, came[path[0].importer])
                    return path
                if target not in came:
                    came[target] = imp
                    nxt_frontier.append(target)
        frontier = nxt_frontier
    raise AssertionError(f"{start} is in a component without a cycle through it")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python aiodist/_tools/layers.py")
    parser.add_argument("--graph", action="store_true", help="print the import graph by layer")
    args = parser.parse_args(argv)
    package_dir = Path(__file__).resolve().parents[1]
    modules, imports = read_imports(package_dir)
    if args.graph:
        for name, owns in LAYERS:
            print(f"{name}: {owns}")
            for module in sorted(m for m in modules if layer_of(m) == name):
                targets = sorted({i.imported for i in imports if i.importer == module})
                print(f"    {module} -> {', '.join(targets) or '-'}")
    problems = check(modules, imports)
    for problem in problems:
        print(f"layers: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
