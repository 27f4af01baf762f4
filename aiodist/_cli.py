from __future__ import annotations

def main(argv: object = None) -> int:
    return 0
