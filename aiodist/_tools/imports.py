"""Where the names in the async API's annotations come from, so sync.py can import them."""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType


class GenerateError(Exception):
    """The async API has something the generator cannot express; the message says what."""


@dataclasses.dataclass(frozen=True, slots=True)
class Import:
    """How the defining module imports one name: ``from module import name as asname``."""

    module: str
    name: str | None  # None: ``import module``
    asname: str

    def statement(self) -> str:
        if self.name is None:
            alias = "" if self.asname == self.module else f" as {self.asname}"
            return f"import {self.module}{alias}"
        alias = "" if self.asname == self.name else f" as {self.asname}"
        return f"from {self.module} import {self.name}{alias}"


def module_names(module: ModuleType) -> dict[str, Import]:
    """Every name ``module`` imports (TYPE_CHECKING blocks included) or defines at top level."""
    tree = ast.parse(inspect.getsource(module))
    names: dict[str, Import] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level or node.module is None:
                raise GenerateError(f"{module.__name__}: relative imports are not supported")
            for alias in node.names:
                asname = alias.asname or alias.name
                names.setdefault(asname, Import(node.module, alias.name, asname))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                asname = alias.asname or alias.name.split(".")[0]
                module_name = alias.name if alias.asname else asname
                names.setdefault(asname, Import(module_name, None, asname))
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = Import(module.__name__, node.name, node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    names[target.id] = Import(module.__name__, target.id, target.id)
    return names


class Imports:
    """The imports sync.py needs: re-exports at run time, annotation names for type checking."""

    def __init__(self, api: ModuleType) -> None:
        self.api = api
        self.public = set(api.__all__)
        self.runtime: set[str] = set()
        self.twins: dict[str, str] = {}  # name -> module of its hand-written blocking twin
        self.typing: set[str] = {"TYPE_CHECKING"}
        self.type_only: set[str] = set()
        self._sources: dict[str, dict[str, Import]] = {}

    def annotation(self, text: str, fn: Callable[..., Any]) -> str:
        """Record the imports ``text`` (an annotation written in ``fn``'s module) needs."""
        module = inspect.getmodule(fn)
        if module is None:
            raise GenerateError(f"cannot find the module of {fn.__qualname__}")
        if module.__name__ not in self._sources:
            self._sources[module.__name__] = module_names(module)
        known = self._sources[module.__name__]
        for node in ast.walk(ast.parse(text, mode="eval")):
            if not isinstance(node, ast.Name) or hasattr(builtins, node.id):
                continue
            where = known.get(node.id)
            if where is None:
                raise GenerateError(
                    f"{fn.__qualname__}: annotation {text!r} uses {node.id!r}, which "
                    f"{module.__name__} neither imports nor defines"
                )
            if where.module == "typing":
                self.typing.add(node.id)
            elif node.id in self.public and getattr(self.api, node.id) is _resolve(where):
                self.runtime.add(node.id)  # re-exported anyway
            else:
                self.type_only.add(where.statement())
        return text

    def lines(self) -> list[str]:
        out = [
            "from __future__ import annotations",
            f"from typing import {', '.join(sorted(self.typing))}",
            f"import {self.api.__name__} as _api",
            "from aiodist._sync import handoff as _portal",
            "from aiodist._group.world import torch_type as _torch_type",
        ]
        if self.runtime:
            out.append(f"from {self.api.__name__} import {', '.join(sorted(self.runtime))}")
        out.extend(f"from {module} import {name}" for name, module in sorted(self.twins.items()))
        if self.type_only:
            out.append("if TYPE_CHECKING:")
            out.extend(f"    {line}" for line in sorted(self.type_only))
        return out


def _resolve(where: Import) -> object:
    try:
        module = importlib.import_module(where.module)
    except ImportError:
        return None
    return module if where.name is None else getattr(module, where.name, None)
