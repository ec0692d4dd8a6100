"""The catalog: find runs, copy and compare checkpoints, take single files out of them.

What users of ``aws s3``, ``restic`` or the Hugging Face hub CLI expect beside save and
restore (``docs/cli.md`` has the commands, docs/design.md §11 the copy's and the resume's
rules):

- ``list_runs(url)``: the runs under a prefix, each with its current step, size and age
  (``cloudckpt runs``);
- ``copy_checkpoint(src, dst)``: a committed checkpoint into another run, on the same
  store or another one, verified and committed through the destination's own LATEST,
  naming the chunks the destination already holds (``cloudckpt cp``);
- ``get_file(url, path, dest)``: one file of a checkpoint, verified, without restoring the
  rest (``cloudckpt get``);
- ``export_checkpoint(url, dest)``: a checkpoint as plain files, in a local directory or
  under a bucket prefix, for tools that know nothing of cloudckpt (``cloudckpt export``);
- ``file_digest(path)``: the ``sha256-tree`` digest a manifest records, for a local file
  (``cloudckpt digest``);
- ``diff_checkpoints(url, a, b)``: which files and chunks changed between two checkpoints
  (``cloudckpt diff``).

Every function takes a run URL (with ``storage_options``) or an open ``Store``. Reads are
verified as restores are (docs/design.md §7): manifests against LATEST's record, chunks
against their SHA-256, files against their recorded digest. Writes to a run go through its
commit protocol (``cloudckpt.copying``).

One module per command (``runs``, ``copy``, ``get``, ``export``, ``diff``; ``file_digest``
is here, one line over ``cloudckpt.digest``), and ``opening``: what they share.
"""

from __future__ import annotations

import os

from cloudckpt import digest
from cloudckpt.catalog.copy import CopyResult, copy_checkpoint
from cloudckpt.catalog.diff import CheckpointDiff, FileChange, diff_checkpoints
from cloudckpt.catalog.export import ExportResult, export_checkpoint
from cloudckpt.catalog.get import FileResult, FilesResult, get_file, get_files
from cloudckpt.catalog.runs import RunInfo, list_runs

__all__ = [
    "CheckpointDiff",
    "CopyResult",
    "ExportResult",
    "FileChange",
    "FileResult",
    "FilesResult",
    "RunInfo",
    "copy_checkpoint",
    "diff_checkpoints",
    "export_checkpoint",
    "file_digest",
    "get_file",
    "get_files",
    "list_runs",
]


def file_digest(path: str | os.PathLike[str], algorithm: str | None = None) -> str:
    """The digest a manifest records for a file with the bytes of ``path`` (``algorithm``:
    the manifest's; default what new checkpoints use, ``blake3-tree``: docs/cli.md,
    ``cloudckpt digest``, shows how to compute it by hand). Raises OSError,
    UnknownFormatError (an algorithm this version does not know)."""
    return digest.tree_digest_of_file(path, algorithm=algorithm)
