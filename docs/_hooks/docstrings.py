"""A griffe extension for the API reference: two habits of aiodist's docstrings.

- They are Google style and name their example section ``Example:``
  (napoleon reads both spellings). griffe knows only ``Examples:``, and would
  render the singular as a plain note, its ``>>>`` lines turned into nested
  quotes. Renaming the section as the docstring is loaded lets griffe read
  the ``>>>`` lines as code.
- A paragraph may end in reST's ``::`` before an indented example; Markdown
  shows the indented lines as code already, and the ``::`` as it is. One
  colon is left.

``mkdocs.yml`` loads this module through mkdocstrings' ``extensions`` option;
nothing else does.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import griffe

if TYPE_CHECKING:
    import ast

_SINGULAR = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_LITERAL = re.compile(r"(?<=\S)::$(?=\n\s*\n)", re.MULTILINE)


class DocstringHabits(griffe.Extension):
    """Rename each ``Example:`` section of a docstring to ``Examples:``; drop reST's ``::``."""

    def on_instance(
        self,
        *,
        node: ast.AST | griffe.ObjectNode,
        obj: griffe.Object,
        agent: griffe.Visitor | griffe.Inspector,
        **kwargs: Any,
    ) -> None:
        if obj.docstring is not None:
            value = _SINGULAR.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _LITERAL.sub(":", value)
