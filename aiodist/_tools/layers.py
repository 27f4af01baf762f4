"""The layer rules of aiodist's tree, checked on its import graph (read with ``ast``).

    python aiodist/_tools/layers.py           # exit 1, naming each offending import
    python aiodist/_tools/layers.py --graph   # who imports whom, layer by layer

The rules (shared/DESIGN.md, "Layers"):

- Every module belongs to one layer: a private subpackage (``aiodist._ops``), the
  errors module at the bottom, the public face at the top (the package root's
  ``__init__``, ``sync``, ``metrics``, ...), and the developer tools above all.
- A module imports only modules of its own layer or of the layers *beneath*
  it: never one above it or beside it, at module level or inside a function.
  Imports under ``if TYPE_CHECKING:`` are annotations only and are exempt from
  this rule.
- No import cycle between modules, counting imports inside functions: no file
  imports a file that imports it back, however many files lie between. Inside
  one package, imports under ``TYPE_CHECKING`` count too: a reader has to hold
  such a cycle in mind all the same.
- The package root holds only the public face and the errors module.

**The layers are a graph, not a ladder.** Up to ``_group`` each layer builds on
all those below it. Above it the tree branches where the code does: ``_ops``
(collectives, point-to-point) and ``_rpc`` (remote calls) both build on
``_group`` and know nothing of each other; ``_torch`` (the bridge to
torch.distributed) and ``_metrics`` (the aggregator) both build on ``_ops``,
and neither on the other. ``_launch`` joins the branches it starts
(``init_process_group`` brings up the torch bridge and the rpc agent), and the
public face sits on everything. A ladder would let any of the siblings reach
into another (``_rpc`` into the collectives, the aggregator into the bridge)
without the checker noticing; the graph says which of them may.

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

#: The layers from the bottom up: each with what it owns and the layers right
#: beneath it (it may import those and, through them, everything they may).
LAYERS: Final[tuple[tuple[str, str, tuple[str, ...]], ...]] = (
    ("_errors", "the exception tree and its wire codes", ()),
    ("_settings", "every AIODIST_* variable: declared, read and checked once", ("_errors",)),
    ("_wire", "sans-IO framing, messages, the object codec, the token proofs", ("_settings",)),
    ("_transport", "bytes between two processes: TCP, Unix sockets, shared memory", ("_wire",)),
    ("_server", "the rendezvous server: jobs, store, liveness", ("_transport",)),
    ("_control", "a rank's connection to the server: channels, store, init methods", ("_server",)),
    ("_plane", "the data plane: sans-IO core, channels, matching, bulk transfers", ("_control",)),
    ("_group", "work handles, sessions, joining, process groups, the default world", ("_plane",)),
    ("_ops", "collectives, p2p, object operations, new_group", ("_group",)),
    ("_rpc", "remote calls and remote references", ("_group",)),
    ("_torch", "the bridge to torch.distributed and its store", ("_ops",)),
    ("_metrics", "the metric aggregator's internals", ("_ops",)),
    (
        "_launch",
        "starting a job: init_process_group, launchers, aiodist run, the CLI",
        ("_torch", "_rpc"),
    ),
    ("_remote", "master-worker mode: rank 0 drives tensors held by the others", ("_launch",)),
    ("_sync", "the background loop thread the blocking facade runs on", ("_remote", "_metrics")),
    ("public", "the public face: aiodist, aiodist.sync, aiodist.metrics, ...", ("_sync",)),
    ("_tools", "developer tools (gen_sync, this checker); nothing imports them", ("public",)),
)
#: Modules of the package root that make up the public face.
PUBLIC: Final = (
    "__init__", "__main__", "sync", "metrics", "testing", "rpc", "transport", "remote"
)  # fmt: skip
_NAMES: Final = tuple(name for name, _, _ in LAYERS)


def _reach() -> dict[str, frozenset[str]]:
    reach: dict[str, frozenset[str]] = {}
    for name, _, below in LAYERS:  # bottom up: every layer below is done already
        assert all(b in reach for b in below), f"layer {name} names a layer not below it"
        reach[name] = frozenset(below).union(*(reach[b] for b in below))
    return reach


_REACH: Final = _reach()


def beneath(layer: str) -> frozenset[str]:
    """The layers ``layer`` may import (besides its own)."""
    return _REACH[layer]


@dataclasses.dataclass(frozen=True, slots=True)
class Import:
    """One import of a module of the package by another, where it is written."""

    importer: str  # dotted module name
    imported: str
    path: Path
    line: int
    type_only: bool = False  # under ``if TYPE_CHECKING:``

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def layer_of(module: str) -> str | None:
    """The layer ``module`` (``aiodist._ops.common``) belongs to; None if it has none."""
    parts = module.split(".")
    if len(parts) == 1:
        return "public"
    head = parts[1]
    if head in PUBLIC:  # a public module, or a module of a public package (aiodist.rpc.nn)
        return "public"
    return head if head in _REACH and head != "public" else None


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
    module, else ``pkg``; relative imports are resolved. Imports under
    ``TYPE_CHECKING`` are returned too, marked ``type_only``.
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
            if not isinstance(node, ast.Import | ast.ImportFrom):
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
                    imports.append(Import(module, resolved, shown, node.lineno, id(node) in exempt))
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
        if imp.type_only or mine is None or theirs is None or mine == theirs:
            continue
        if theirs in _REACH[mine]:
            continue
        where = (
            f"layer {mine} sits below layer {theirs}"
            if mine in _REACH[theirs]
            else f"layers {mine} and {theirs} are siblings (neither builds on the other)"
        )
        allowed = ", ".join(n for n in _NAMES if n in _REACH[mine]) or "none"
        problems.append(
            f"{imp.where()}: {imp.importer} imports {imp.imported}, but {where}; layer "
            f"{mine} may import only its own layer and those beneath it ({allowed}). "
            "Move what both need down a layer, or pass it in."
        )
    problems.extend(_cycles(modules, imports))
    return problems


def _counts_for_cycles(imp: Import) -> bool:
    """Runtime imports always; type-only ones inside one package (see the module docstring)."""
    return not imp.type_only or layer_of(imp.importer) == layer_of(imp.imported)


def _cycles(modules: Sequence[str], imports: list[Import]) -> list[str]:
    edges: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in imports:
        if _counts_for_cycles(imp):
            edges.setdefault(imp.importer, {}).setdefault(imp.imported, imp)
    problems = []
    for component in _strongly_connected(edges):
        if len(component) < 2:
            continue
        path = _cycle_through(min(component), component, edges)
        steps = " -> ".join(
            f"{imp.importer} ({imp.where()}{', type only' if imp.type_only else ''})"
            for imp in path
        )
        problems.append(
            f"import cycle: {steps} -> {path[0].importer}. No module may import one that "
            "imports it back (inside functions and, within a package, under TYPE_CHECKING "
            "too); move what they share down, or pass it in"
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
        for name, owns, below in LAYERS:
            print(f"{name}: {owns} (on {', '.join(below) or 'nothing'})")
            for module in sorted(m for m in modules if layer_of(m) == name):
                targets = sorted(
                    {i.imported for i in imports if i.importer == module and not i.type_only}
                )
                print(f"    {module} -> {', '.join(targets) or '-'}")
    problems = check(modules, imports)
    for problem in problems:
        print(f"layers: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
