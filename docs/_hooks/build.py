"""Build hooks of the docs site: the parts of pages that are read from the code.

MkDocs runs this module (``hooks:`` in ``mkdocs.yml``) while it builds. Each
function below fills one marker, an HTML comment alone on its line, so a page
says what it shows in plain Markdown and the code says what it is:

- ``<!-- aiodist:layers -->`` (architecture): one section per layer, in the
  order of ``aiodist._tools.layers.LAYERS``, each the docstring of that
  layer's package (``aiodist/_wire/__init__.py``, ...). Nothing is copied: a
  layer added, renamed or reworded shows as it is in the tree.
- ``<!-- aiodist:error-tree -->`` (failures): every exception class of
  ``aiodist._errors`` as a tree of its bases; a class the page has no
  ``## ClassName`` section for fails the build (strict mode turns the
  warning into an error), as does a section for a class that is gone.
- ``<!-- aiodist:sync-members -->`` (the reference of ``aiodist.sync``): the
  names ``aiodist.sync`` defines itself, the blocking functions; the classes,
  queries and errors it re-exports are the very objects of ``aiodist`` and
  are documented there once.

The tree is read, never imported, except ``aiodist`` and ``aiodist.sync``
for the last marker (neither imports torch).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "aiodist"
log = logging.getLogger("mkdocs.hooks.aiodist")

# --- the architecture: the layers' own docstrings ---------------------------------------------


def layer_order() -> list[tuple[str, str]]:
    """``LAYERS`` of ``aiodist/_tools/layers.py``, read from its source."""
    tree = ast.parse((PACKAGE / "_tools" / "layers.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "LAYERS" for t in targets):
                assert node.value is not None
                value = ast.literal_eval(node.value)
                return [(str(name), str(owns)) for name, owns, *_ in value]
    raise RuntimeError("aiodist/_tools/layers.py defines no LAYERS")


def module_docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _layer_source(name: str) -> Path | None:
    if name == "public":
        return None
    package = PACKAGE / name / "__init__.py"
    return package if package.exists() else PACKAGE / f"{name}.py"


def _public_face() -> str:
    lines = [
        "The package root holds only the public face; each module's own docstring opens "
        "its page of the [API reference](reference/aiodist.md).",
        "",
    ]
    for name in ("__init__", "sync", "rpc", "metrics", "testing"):
        path = PACKAGE / f"{name}.py"
        if not path.exists():
            continue
        module = "aiodist" if name == "__init__" else f"aiodist.{name}"
        summary = module_docstring(path).split("\n\n", 1)[0].replace("\n", " ")
        page = "aiodist" if name == "__init__" else name
        lines.append(f"- [`{module}`](reference/{page}.md): {summary}")
    return "\n".join(lines)


def _demote_rst(text: str) -> str:
    # The docstrings are reST-flavoured: ``code`` reads the same in Markdown, and a
    # paragraph ending in "::" introduces an indented literal block, which Markdown
    # shows as code when a blank line precedes it, as it does in reST.
    return re.sub(r"::\n", ":\n", text)


def render_layers() -> str:
    """One section per layer, bottom up, each its package docstring."""
    out = []
    for index, (name, owns) in enumerate(layer_order()):
        out.append(f"### {index}. `{name}`\n")
        out.append(f"*{owns}*\n")
        source = _layer_source(name)
        if source is None:
            out.append(_public_face())
        elif not source.exists():
            log.warning("architecture: layer %s has no package or module in aiodist/", name)
            continue
        else:
            doc = module_docstring(source)
            if not doc:
                log.warning("architecture: %s has no docstring", source.relative_to(ROOT))
            where = source.relative_to(ROOT).as_posix()
            out.append(f"{_demote_rst(doc)}\n\n<small>From `{where}`.</small>")
        out.append("")
    return "\n".join(out)


# --- the failures page: every exception class has its section -------------------------------


def error_classes() -> dict[str, list[str]]:
    """Every exception class ``aiodist/_errors.py`` defines, with its bases, in order."""
    tree = ast.parse((PACKAGE / "_errors.py").read_text())
    classes: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(base) for base in node.bases]
            classes[node.name] = bases
    # Keep the exceptions: classes whose bases lead to a builtin exception.
    builtin = {
        name
        for name, value in vars(builtins).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    errors: dict[str, list[str]] = {}
    changed = True
    while changed:
        changed = False
        for name, bases in classes.items():
            if name not in errors and any(b in builtin or b in errors for b in bases):
                errors[name] = bases
                changed = True
    return {name: errors[name] for name in classes if name in errors}


def documented_errors(markdown: str) -> set[str]:
    """The class names of the page's ``## Name`` sections."""
    return set(re.findall(r"^## `?(\w+)`?\s*$", markdown, re.MULTILINE))


def render_error_tree() -> str:
    errors = error_classes()
    children: dict[str, list[str]] = {}
    roots = []
    for name, bases in errors.items():
        inside = [b for b in bases if b in errors]
        if inside:
            children.setdefault(inside[0], []).append(name)
        else:
            roots.append(name)

    def item(name: str, depth: int) -> list[str]:
        bases = errors[name]
        extra = bases if depth == 0 else bases[1:]
        note = f" ({'also ' if depth else ''}a `{'`, `'.join(extra)}`)" if extra else ""
        line = f"{'    ' * depth}- [`{name}`](#{name.lower()}){note}"
        return [line] + [x for child in children.get(name, []) for x in item(child, depth + 1)]

    return "\n".join(x for root in roots for x in item(root, 0))


def check_error_sections(markdown: str, src: str) -> None:
    errors = set(error_classes())
    sections = documented_errors(markdown)
    for name in sorted(errors - sections):
        log.warning("%s: no '## %s' section; every error type has one", src, name)
    for name in sorted(sections - errors):
        log.warning("%s: '## %s' names no class of aiodist/_errors.py", src, name)


# --- the blocking facade's own functions -------------------------------------------------------


def sync_own_members() -> list[str]:
    """The names of ``aiodist.sync`` that are not the very objects of ``aiodist``."""
    aiodist = importlib.import_module("aiodist")
    sync = importlib.import_module("aiodist.sync")
    return [
        name
        for name in sync.__all__
        if not name.startswith("_") and getattr(sync, name) is not getattr(aiodist, name, None)
    ]


# --- the hook ----------------------------------------------------------------------------------


def render_sync_members() -> str:
    """A ``members:`` option of mkdocstrings, inside the page's ``::: aiodist.sync``."""
    return "members: [" + ", ".join(sync_own_members()) + "]"


MARKERS: dict[str, Callable[[], str]] = {
    "<!-- aiodist:layers -->": render_layers,
    "<!-- aiodist:error-tree -->": render_error_tree,
    "<!-- aiodist:sync-members -->": render_sync_members,
}


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Fill the markers of ``page``; check the failures page's sections."""
    src = page.file.src_uri
    if "<!-- aiodist:error-tree -->" in markdown:
        check_error_sections(markdown, src)
    for marker, render in MARKERS.items():
        if marker in markdown:
            indent = re.search(rf"^([ \t]*){re.escape(marker)}", markdown, re.MULTILINE)
            pad = indent.group(1) if indent else ""
            text = "\n".join(pad + line if line else line for line in render().splitlines())
            markdown = markdown.replace(pad + marker, text)
    return markdown
