"""What the tests share: the repository's root, the daemon and process helpers,
the stranger's client, and the worker scripts tests start as real processes."""

from __future__ import annotations

from pathlib import Path

#: The repository's root.
ROOT = Path(__file__).resolve().parents[2]
#: This folder: the worker scripts tests run as processes.
HELPERS = Path(__file__).resolve().parent
