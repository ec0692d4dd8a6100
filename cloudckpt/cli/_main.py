"""The ``cloudckpt`` command group: its options, help text and exit-code epilog.

The commands register themselves on ``cli`` from their own modules (``_listing``,
``_restore``, ``_push``, ``_maintenance``, ``_catalog``, ``_watch``, ``_demo``), which
``cloudckpt.cli`` imports.
"""

from __future__ import annotations

import click

from cloudckpt._version import __version__
from cloudckpt.cli._common import EXIT_CODE_TABLE, CloudCkptGroup, setup_logging

_EPILOG = "Exit codes:\n\n\b\n" + "\n".join(
    f"  {code:>3}  {text}" for code, text in EXIT_CODE_TABLE
)


@click.group(
    cls=CloudCkptGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=_EPILOG,
)
@click.version_option(__version__, prog_name="cloudckpt")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """Crash-safe ML training checkpoints on object storage.

    URL is a run location: s3://bucket/prefix, gs://bucket/prefix, az://container/prefix
    (or abfs[s]://container@account.dfs.core.windows.net/prefix), file:///path or a local
    path. Credentials come from the usual places (AWS_PROFILE or --profile and the AWS_*
    variables; Google application default credentials; AZURE_STORAGE_CONNECTION_STRING or
    AZURE_STORAGE_ACCOUNT_NAME) or from --storage-option.

    --json prints one JSON document (watch: one per event, a line each); docs/cli.md lists
    every command's fields. Shell completion, in ~/.bashrc (zsh: zsh_source in ~/.zshrc):

    \b
      eval "$(_CLOUDCKPT_COMPLETE=bash_source cloudckpt)"
    """
    setup_logging(verbose)
