"""A griffe extension for the API reference: three habits of aiodist's docstrings.

- They are Google style and name their example section ``Example:``
  (napoleon reads both spellings). griffe knows only ``Examples:``, and would
  render the singular as a plain note, its ``>>>`` lines turned into nested
  quotes. Renaming the section as the docstring is loaded lets griffe read
  the ``>>>`` lines as code.
- A paragraph may end in reST's ``::`` before an indented example; Markdown
  shows the indented lines as code already, and the ``::`` as it is. One
  colon is left.
- A public class's method that the library's own layers call, but users may
  not (``ProcessGroup.break_``, ``Work.set_result``), ends its docstring with
  ``:meta private:`` (Sphinx autodoc's mark): the reference leaves it out, so
  that it shows what users may call.

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
PRIVATE = ":meta private:"


class DocstringHabits(griffe.Extension):
    """Rename ``Example:`` to ``Examples:``; drop reST's ``::``; leave out private members."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        for name, member in list(cls.members.items()):
            if member.docstring is not None and PRIVATE in member.docstring.value:
                cls.del_member(name)

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
