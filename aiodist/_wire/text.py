"""Text from a peer made safe to show: control characters escaped, as ``repr`` writes them.

A host name or a failure reason travels from one client through the server to
operators' terminals (``aiodist status``), logs and other ranks' error
messages. A terminal acts on escape sequences (``\\x1b[2J`` clears it), so
every such string is shown through ``printable``: what ``str.isprintable``
refuses becomes ``\\x1b``, ``\\n``, ``\\u2028``, the rest stays as it was.
"""

from __future__ import annotations

from typing import Any


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped as ``repr`` does."""
    if text.isprintable():
        return text  # the usual case: no copy
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def printable_data(value: Any) -> Any:
    """``value`` (plain data: dicts, lists, strings) with every string made ``printable``."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_data(k): printable_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [printable_data(v) for v in value]
    return value
