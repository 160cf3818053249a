"""`python -m lkcnn.bench [kernels|branches|blocks|e2e|rates|loader|app|deploy8|codegen] ...` (`lkcnn-bench`):
one entry point for lkcnn's benchmarks.

Without a subcommand it runs the kernel benchmark (`python -m lkcnn.bench --quick`).
Only the chosen benchmark's module is imported.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# modules of lkcnn.bench, each with main(argv)
COMMANDS = ("kernels", "branches", "blocks", "e2e", "rates", "loader", "app", "deploy8", "codegen")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "kernels"
    importlib.import_module(f"lkcnn.bench.{command}").main(argv)


if __name__ == "__main__":
    main()
