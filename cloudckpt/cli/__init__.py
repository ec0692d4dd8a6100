"""The ``cloudckpt`` command line: a thin layer over the library (see docs/cli.md).

``main`` is the console-script entry point; ``cli`` is the click group (for tests and
embedding). Exit codes are defined in ``cloudckpt.cli._common``.
"""

from __future__ import annotations

from cloudckpt.cli import _demo, _watch  # noqa: F401 - they register their commands
from cloudckpt.cli._common import EXIT_CODE_TABLE, exit_code_for
from cloudckpt.cli._main import cli

__all__ = ["EXIT_CODE_TABLE", "cli", "exit_code_for", "main"]


def main() -> None:
    cli(prog_name="cloudckpt")
