"""Local staging: one directory per save attempt, a journal beside it, and snapshots.

Layout under ``staging_dir``::

    .lock                         flock held by the one manager using this directory
    dcp/<token>/                  a DCP writer's local files (cloudckpt.integrations.dcp)
    attempts/<attempt_id>/
        journal.json              the attempt's plan and state (atomic replace + fsync)
        files/...                 the checkpoint's files

Journal states: ``open`` (the caller is writing), ``staged`` (files complete, handed to
the uploader; for ``save_state``, which uploads from its host buffers, the files are written
by the uploader beside the upload), ``durable`` (staged files fsynced), ``committed``,
``failed``. A manager
started after a crash recovers ``durable`` attempts newer than the committed checkpoint
(their files are complete and on disk, so uploading them loses nothing) and abandons the
rest (an ``open`` attempt may be half-written by the caller; ``staged`` files may not have
reached the disk before a power loss).

Start-up deletes only what cloudckpt wrote: under ``attempts/`` (and the local tier's
``committed/``, ``cloudckpt.localcopy``) a directory counts as cloudckpt's when its name has
cloudckpt's form (an attempt id) and it holds nothing but cloudckpt's own entries
(``ATTEMPT_ENTRIES``: a half-written attempt, whose journal never landed, is one); under
``dcp/`` (a DCP writer's staging) when its name is a writer's 16-hex token. Anything else
there is someone else's: the manager refuses the directory (``ConfigurationError``) and
deletes nothing (``StagingArea.check_dedicated``).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cloudckpt.errors import ConfigurationError, StagingError
from cloudckpt.formats import WRITTEN_BY, unknown_format

log = logging.getLogger("cloudckpt.staging")

OPEN, STAGED, DURABLE, COMMITTED, FAILED = "open", "staged", "durable", "committed", "failed"

#: What cloudckpt writes into an attempt's directory: the journal (and its temporary file),
#: the staged files, and what the local tier adds before it moves the attempt to
#: ``committed/`` (``cloudckpt.localcopy``).
ATTEMPT_ENTRIES = frozenset(
    {"journal.json", "journal.json.tmp", "files", "copy.json", "MANIFEST.json"}
)
#: The journal's format. A journal without one was written before journals named theirs
#: (the same content); one in a format this version does not know is a newer version's
#: staged save: start-up refuses it (``UnknownFormatError``) rather than abandon it.
JOURNAL_FORMAT = "cloudckpt.journal/1"
JOURNAL_FORMATS_READ = (JOURNAL_FORMAT,)
#: An attempt directory's name: ``attempt_layout.new_attempt_id``'s form.
ATTEMPT_ID = re.compile(r"\d{8}T\d{9}Z-[0-9a-f]{8}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staging_error(exc: OSError, action: str) -> StagingError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StagingError(f"the staging disk is full while trying to {action}")
    return StagingError(f"could not {action}: {exc.strerror or exc}")


def holds_files(src: str | os.PathLike[str]) -> bool:
    """Whether the directory ``src`` (or one below it) holds at least one file, i.e.
    whether a snapshot of it would save anything."""
    return any(filenames for _, _, filenames in os.walk(src))


#: Where a DCP writer (``cloudckpt.integrations.dcp``) stages a save: ``dcp/<token>/``,
#: the token 16 random hex digits, the content DCP's own files.
DCP_DIR = "dcp"
DCP_TOKEN = re.compile(r"[0-9a-f]{16}")

#: A place cloudckpt keeps its own directories in: (subdirectory of the staging root, the
#: form of their names, the entries they may hold; None: any).
Place = tuple[str, re.Pattern[str], frozenset[str] | None]
ATTEMPTS: Place = ("attempts", ATTEMPT_ID, ATTEMPT_ENTRIES)
DCP: Place = (DCP_DIR, DCP_TOKEN, None)


def own_directory(path: Path, name: re.Pattern[str], entries: frozenset[str] | None) -> bool:
    """Whether ``path`` is a directory cloudckpt wrote: not a link, named in cloudckpt's
    form ``name``, holding nothing but ``entries`` (module docstring)."""
    if path.is_symlink() or not path.is_dir() or not name.fullmatch(path.name):
        return False
    if entries is None:
        return True
    try:
        return all(entry in entries for entry in os.listdir(path))
    except OSError:
        return False


def foreign_entries(root: Path, place: Place) -> list[Path]:
    """The entries of ``place`` under ``root`` that cloudckpt did not write
    (``own_directory``), sorted; the place itself if it is not a directory; none if it does
    not exist. Raises StagingError (it cannot be listed)."""
    sub, name, entries = place
    directory = root / sub
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        return [directory]
    try:
        found = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise _staging_error(exc, f"list {directory}") from None
    return [path for path in found if not own_directory(path, name, entries)]


def remove_own(root: Path, place: Place) -> None:
    """Delete the directories of ``place`` under ``root`` that cloudckpt wrote; nothing
    else."""
    sub, name, entries = place
    try:
        found = list((root / sub).iterdir())
    except OSError:
        return
    for path in found:
        if own_directory(path, name, entries):
            shutil.rmtree(path, ignore_errors=True)


@dataclasses.dataclass
class Attempt:
    """One save attempt's local state."""

    dir: Path
    id: str
    step: int
    metadata: dict[str, Any]
    state: str = OPEN
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def files_dir(self) -> Path:
        return self.dir / "files"

    def set_state(self, state: str, *, sync: bool = True, **extra: Any) -> None:
        """Record ``state`` atomically (temp file, replace); durably (fsync) unless
        ``sync=False``, which suits states recovery ignores anyway (open, staged): the
        caller of save() should not wait for a disk flush. ``state`` says it only once the
        journal does: a ``close()`` that timed out tells which saves a restart commits by it
        (``SaveQueue.durable``)."""
        self.extra.update(extra)
        body = json.dumps(
            {
                "format": JOURNAL_FORMAT,
                "written_by": WRITTEN_BY,
                "id": self.id,
                "step": self.step,
                "metadata": self.metadata,
                "metrics": self.metrics,
                "state": state,
                "extra": self.extra,
            },
            sort_keys=True,
        ).encode()
        tmp = self.dir / "journal.json.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(body)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.dir / "journal.json")
            if sync:
                _fsync_dir(self.dir)
        except OSError as exc:
            raise _staging_error(exc, f"write the journal of attempt {self.id}") from None
        self.state = state

    def list_files(self) -> list[tuple[str, Path]]:
        """(relative '/'-path, local path) of every file, sorted. Symlinks to files are
        followed (their content is the checkpoint's); anything else is refused."""
        found = []
        for dirpath, dirnames, filenames in os.walk(self.files_dir, followlinks=False):
            linked_dirs = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            if linked_dirs:
                raise StagingError(
                    f"{Path(dirpath, linked_dirs[0])} is a link to a directory",
                    hint="Checkpoints hold regular files (and links to files) only",
                )
            for name in filenames:
                path = Path(dirpath, name)
                rel = path.relative_to(self.files_dir).as_posix()
                try:
                    mode = os.stat(path).st_mode
                except OSError as exc:
                    raise StagingError(f"cannot stat staged file {path}: {exc.strerror}") from None
                if not stat.S_ISREG(mode):
                    raise StagingError(
                        f"{rel} in the checkpoint is not a regular file",
                        hint="Checkpoints hold regular files (and links to them) only",
                    )
                found.append((rel, path))
        return sorted(found)

    def write_files(self, files: Any, cancelled: Any = None) -> bool:
        """Write in-memory files (relative path, ``transfer.MemoryFile``) into the attempt;
        False if ``cancelled`` (a ``threading.Event``) stopped it: the upload committed
        first and the local copy is no longer needed."""
        try:
            for rel, mem in files:
                path = self.files_dir.joinpath(*rel.split("/"))
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    if not mem.write_to(fd, cancelled):
                        return False
                finally:
                    os.close(fd)
        except OSError as exc:
            raise _staging_error(exc, f"write the staged files of attempt {self.id}") from None
        return True

    def fsync_files(self) -> None:
        """Make the staged files durable (so a crash-recovered attempt is never torn)."""
        try:
            for dirpath, _dirnames, filenames in os.walk(self.files_dir):
                for name in filenames:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                _fsync_dir(Path(dirpath))
        except OSError as exc:  # ENOSPC/EIO surface here on some filesystems
            raise _staging_error(exc, f"flush the staged files of attempt {self.id}") from None

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class StagingArea:
    """The staging directory of one manager. Holds an exclusive lock while open, so two
    live managers never share (and never recover each other's) attempts."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        self.attempts_dir = self.root / "attempts"
        try:
            self.attempts_dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd: int | None = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise _staging_error(exc, f"create the staging directory {self.root}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ConfigurationError(
                f"staging directory {self.root} is in use by another cloudckpt manager",
                hint="Give each training process (each rank) its own staging_dir",
            ) from None

    def check_dedicated(self, *more: Place) -> None:
        """Refuse a staging directory holding entries cloudckpt did not write where it
        keeps its own: ``attempts/``, ``dcp/`` and each place of ``more`` (the local
        tier's ``committed/``). Nothing is deleted; the lock is released.

        Raises: ConfigurationError (foreign entries), StagingError (cannot list).
        """
        try:
            found = [
                p for place in (ATTEMPTS, DCP, *more) for p in foreign_entries(self.root, place)
            ]
        except StagingError:
            self.close()
            raise
        if not found:
            return
        self.close()
        shown = ", ".join(str(p.relative_to(self.root)) for p in found[:3])
        more_text = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise ConfigurationError(
            f"staging directory {self.root} holds files cloudckpt did not write where it "
            f"keeps its own ({shown}{more_text}); nothing was deleted",
            hint="Choose a dedicated staging directory (a new or empty one that only "
            "cloudckpt uses), or move those files out of it",
        )

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def new_attempt(
        self,
        attempt_id: str,
        step: int,
        metadata: dict[str, Any],
        metrics: dict[str, Any] | None = None,
    ) -> Attempt:
        attempt = Attempt(
            self.attempts_dir / attempt_id,
            attempt_id,
            step,
            dict(metadata),
            metrics=dict(metrics or {}),
        )
        try:
            attempt.files_dir.mkdir(parents=True)
        except OSError as exc:
            raise _staging_error(exc, "create a staging directory") from None
        attempt.set_state(OPEN, sync=False)
        return attempt

    def snapshot(self, src: str | os.PathLike[str], attempt: Attempt) -> None:
        """Hard-link every file of ``src`` into the attempt (copy across filesystems).

        The links pin the bytes: the trainer deleting or rotating ``src`` afterwards cannot
        change what is uploaded. (Rewriting a file *in place* would; the uploader detects
        that by size/mtime/inode and fails the save rather than upload a torn file.)
        """
        src_path = Path(src)
        if not src_path.is_dir():
            raise ConfigurationError(f"{src} is not a directory")
        copied = 0
        try:
            for dirpath, _dirnames, filenames in os.walk(src_path):
                rel_dir = Path(dirpath).relative_to(src_path)
                (attempt.files_dir / rel_dir).mkdir(parents=True, exist_ok=True)
                for name in filenames:
                    source = Path(dirpath, name)
                    target = attempt.files_dir / rel_dir / name
                    try:
                        os.link(source, target)
                    except OSError as exc:
                        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                            raise
                        shutil.copy2(source, target)
                        copied += 1
        except StagingError:
            raise
        except OSError as exc:
            raise _staging_error(exc, f"snapshot {src}") from None
        if copied:
            log.info("copied %d files of %s (staging_dir is on another filesystem)", copied, src)

    def journaled(self) -> Iterator[Attempt]:
        """Attempts left by an earlier process, oldest first; one that is cloudckpt's but
        has no readable journal (half-written) is removed. Entries cloudckpt did not write
        are left alone (``check_dedicated`` refuses them first).

        Raises UnknownFormatError: a journal in a format a newer cloudckpt wrote (its
        attempt is left as it is)."""
        for path in sorted(self.attempts_dir.iterdir()):
            if not own_directory(path, ATTEMPT_ID, ATTEMPT_ENTRIES):
                continue
            try:
                body = json.loads((path / "journal.json").read_bytes())
                fmt = body.get("format", JOURNAL_FORMAT)
                if fmt not in JOURNAL_FORMATS_READ:
                    raise unknown_format(
                        f"the staging journal {path / 'journal.json'}",
                        fmt,
                        JOURNAL_FORMATS_READ,
                        body,
                    )
                yield Attempt(
                    path,
                    body["id"],
                    int(body["step"]),
                    body.get("metadata", {}),
                    body["state"],
                    body.get("extra", {}),
                    body.get("metrics", {}),
                )
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                log.warning("abandoning unreadable staging attempt %s", path.name)
                shutil.rmtree(path, ignore_errors=True)
