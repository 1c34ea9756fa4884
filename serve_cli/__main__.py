"""``python -m serve_cli`` is ``xhal-serve``."""

from __future__ import annotations

from serve_cli.cli import main

if __name__ == "__main__":
    main(prog_name="xhal-serve")
