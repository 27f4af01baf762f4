"""Write the tables of ``docs/reference/environment.md`` from ``aiodist._settings``.

Usage::

    python -m aiodist._tools.gen_settings            # rewrite the tables in the page
    python -m aiodist._tools.gen_settings --check    # exit 1 if they are stale

The page's prose stays as written; each table sits between two markers
(``<!-- settings: ranks -->`` ... ``<!-- /settings: ranks -->``, and ``serve``)
and is ``_settings.tables()``'s text, so a setting is documented where it is
declared, and the page can never list a variable that is not read, or miss one.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from aiodist._settings import tables

if TYPE_CHECKING:
    from collections.abc import Sequence

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "environment.md"


def render(page: str) -> str:
    """``page`` with its tables replaced by the declared ones.

    Raises:
        ValueError: A table's markers are missing.
    """
    for part, table in zip(("ranks", "serve"), tables(), strict=True):
        start, end = f"<!-- settings: {part} -->", f"<!-- /settings: {part} -->"
        pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
        found = pattern.search(page)
        if found is None:
            raise ValueError(f"the page has no {start} ... {end} markers")
        page = f"{page[: found.start()]}{start}\n{table}\n{end}{page[found.end() :]}"
    return page


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with ``--check``, verify) the page's tables; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m aiodist._tools.gen_settings")
    parser.add_argument("--check", action="store_true", help="exit 1 if the tables are stale")
    args = parser.parse_args(argv)
    current = PAGE.read_text()
    try:
        text = render(current)
    except ValueError as exc:
        print(f"gen_settings: {PAGE}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if text != current:
            print(
                f"gen_settings: {PAGE}'s tables are stale (aiodist/_settings.py changed); "
                "rewrite them with `python -m aiodist._tools.gen_settings`",
                file=sys.stderr,
            )
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
