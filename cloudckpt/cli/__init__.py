"""The ``cloudckpt`` command line: a thin layer over the library (see docs/cli.md).

``main`` is the console-script entry point; ``cli`` is the click group (for tests and
embedding). Exit codes are defined in ``cloudckpt.cli._common``.
"""

from __future__ import annotations

import os
import sys

# Each module registers its commands on ``cli`` when imported.
from cloudckpt.cli import (  # noqa: F401
    _catalog,
    _demo,
    _listing,
    _maintenance,
    _push,
    _restore,
    _watch,
)
from cloudckpt.cli._common import EXIT_CODE_TABLE, INTERRUPTED, exit_code_for
from cloudckpt.cli._main import cli

__all__ = ["EXIT_CODE_TABLE", "cli", "exit_code_for", "main"]


def main() -> None:
    try:
        cli(prog_name="cloudckpt")
    except SystemExit as exc:
        if exc.code == INTERRUPTED:
            # The command's cleanup has run (temporary files removed, nothing half-done
            # visible). Exit now rather than let the interpreter join transfer threads that
            # may be blocked on a stalled connection for minutes.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(INTERRUPTED)
        raise
