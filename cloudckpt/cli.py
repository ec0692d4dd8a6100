"""The ``cloudckpt`` command line: a thin layer over the library."""

from __future__ import annotations

import click

from cloudckpt._version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cloudckpt")
def cli() -> None:
    """Crash-safe ML training checkpoints on object storage."""


def main() -> None:
    cli()
