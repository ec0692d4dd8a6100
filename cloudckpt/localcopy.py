"""The local tier: staged copies of committed checkpoints kept in ``staging_dir``.

A save stages its files locally before (or while) it uploads them. After the commit the
staged copy is not thrown away: it moves, by one ``rename``, to::

    staging_dir/committed/<step:012d>-<commit_id>/
        copy.json          which checkpoint this claims to be (commit id, step, manifest digest)
        MANIFEST.json      the manifest exactly as committed
        files/...          the checkpoint's files

A restart on the same host (an OOM, a NCCL hang, a crashed process: the common failures)
then restores from it with no data downloaded: ``restore`` (into a directory) and
``load_state`` (into memory) read LATEST as always, and for the checkpoint they choose use
a local copy only if it proves to be that checkpoint:

1. LATEST (read fresh, its own digest checked) names the checkpoint and its manifest's
   SHA-256 and size;
2. the kept ``MANIFEST.json`` has exactly that digest (else the manifest is read from the
   store, as without a copy);
3. every byte of the copy is checked against that manifest, as bytes from the store are:
   each chunk against its SHA-256, each file against its digest, recomputed from the
   local bytes (``cloudckpt.fetch``). What does not verify is read from the store.

So ``copy.json`` is only a hint for finding a copy: nothing about it is trusted. That is
what makes the bookkeeping crash-safe: a crash between the commit and the move leaves the
attempt in ``attempts/`` with its journal saying ``durable`` or ``committed``; the next
manager adopts such an attempt as a copy of the checkpoint of its step (``adopt_leftover``)
and the content check decides whether it is one.

Retention (``CheckpointManager(keep_local=, local_budget_bytes=)``): the newest
``keep_local`` copies (default 1 with a ``staging_dir``, 0 with a temporary one) whose total
size fits ``local_budget_bytes`` (default: no limit); a copy larger than the budget on its
own is not kept. Older copies are deleted after each commit and when a manager starts. A
kept copy costs its size on the staging disk, so during the next save the disk holds the
copy and the new save's staged files.

Only what cloudckpt wrote is ever deleted here: a directory of ``committed/`` named
``<step:012d>-<attempt id>`` holding only cloudckpt's entries (``staging.own_directory``).
Anything else in ``committed/`` is someone else's: a manager refuses such a staging
directory when it starts (``check_dedicated``) and the tier leaves it alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

from cloudckpt import manifests
from cloudckpt.errors import CloudCkptError
from cloudckpt.manifests import Manifest
from cloudckpt.protocol import CheckpointRecord
from cloudckpt.staging import (
    ATTEMPT_ENTRIES,
    ATTEMPT_ID,
    Attempt,
    Place,
    StagingArea,
    own_directory,
)

log = logging.getLogger("cloudckpt.staging")

COMMITTED_DIR = "committed"
RECORD = "copy.json"
MANIFEST = "MANIFEST.json"
FORMAT = "cloudckpt.localcopy/1"
#: A kept copy's directory name: ``<step:012d>-<commit or attempt id>``.
COPY_NAME = re.compile(r"\d{12}-" + ATTEMPT_ID.pattern)
COPIES: Place = (COMMITTED_DIR, COPY_NAME, ATTEMPT_ENTRIES)


def check_dedicated(staging: StagingArea) -> None:
    """Refuse (``ConfigurationError``; nothing deleted, the lock released) a staging
    directory holding entries cloudckpt did not write in ``attempts/`` or ``committed/``."""
    staging.check_dedicated(COPIES)


@dataclasses.dataclass(frozen=True)
class LocalCopy:
    """A staged copy of a committed checkpoint (unproven: see the module docstring).
    ``commit_id`` is None for a copy adopted after a crash (only its step is known)."""

    dir: Path
    step: int
    commit_id: str | None

    @property
    def files_dir(self) -> Path:
        return self.dir / "files"

    def file(self, rel: str) -> Path:
        """Where file ``rel`` (a validated manifest path) of the copy would be."""
        return self.files_dir.joinpath(*rel.split("/"))

    def manifest(self, record: CheckpointRecord) -> Manifest | None:
        """The kept manifest if it is exactly the one ``record`` names, else None."""
        try:
            data = (self.dir / MANIFEST).read_bytes()
        except OSError:
            return None
        if len(data) != record.manifest_size:
            return None
        if hashlib.sha256(data).hexdigest() != record.manifest_sha256:
            return None
        try:
            return manifests.parse_manifest(data, record)
        except CloudCkptError:
            return None

    def nbytes(self) -> int:
        total = 0
        for dirpath, _dirs, names in os.walk(self.files_dir):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_size
        return total


class LocalCopies:
    """The local tier of one staging directory (one manager holds its lock)."""

    def __init__(self, staging_root: Path, keep: int, budget: int | None) -> None:
        self.root = staging_root / COMMITTED_DIR
        self.keep = max(0, keep)
        self.budget = budget

    def copies(self) -> list[LocalCopy]:
        """The kept copies, newest step first (then most recently kept)."""
        found: list[tuple[int, float, LocalCopy]] = []
        if not self.root.is_dir():
            return []
        for path in self.root.iterdir():
            if not own_directory(path, COPY_NAME, ATTEMPT_ENTRIES):
                continue  # not cloudckpt's: never touched
            copy = _read_copy(path)
            if copy is None:
                log.info("removing %s: not a readable local copy", path)
                shutil.rmtree(path, ignore_errors=True)
                continue
            with contextlib.suppress(OSError):
                found.append((copy.step, (path / RECORD).stat().st_mtime, copy))
        found.sort(key=lambda t: (t[0], t[1]), reverse=True)
        return [c for _, _, c in found]

    def find(self, record: CheckpointRecord) -> LocalCopy | None:
        """A copy that may be ``record``'s checkpoint: one kept under its commit id, else
        one adopted after a crash with its step. Unproven (module docstring)."""
        if self.keep == 0:
            return None
        copies = self.copies()
        for copy in copies:
            if copy.commit_id == record.commit_id:
                return copy
        for copy in copies:
            if copy.commit_id is None and copy.step == record.step:
                return copy
        return None

    def adopt(self, attempt: Attempt, commit_id: str | None, manifest: bytes | None) -> None:
        """Keep the staged files of ``attempt`` (committed as ``commit_id``; None when
        only its step is known) as a local copy, then apply retention. Never raises: the
        local tier is an optimisation, and a failure here only costs a download later."""
        if self.keep == 0:
            attempt.remove()
            return
        try:
            record = {"format": FORMAT, "step": attempt.step, "commit_id": commit_id}
            if manifest is not None:
                (attempt.dir / MANIFEST).write_bytes(manifest)
            (attempt.dir / RECORD).write_text(json.dumps(record, sort_keys=True))
            self.root.mkdir(exist_ok=True)
            target = self.root / f"{attempt.step:012d}-{commit_id or attempt.id}"
            if own_directory(target, COPY_NAME, ATTEMPT_ENTRIES):
                shutil.rmtree(target, ignore_errors=True)
            os.rename(attempt.dir, target)  # (onto anything else: fails, copy not kept)
        except OSError as exc:
            log.warning("step %d: local copy not kept: %s", attempt.step, exc)
            attempt.remove()
            return
        self.prune()

    def prune(self) -> None:
        """Apply retention: the newest ``keep`` copies that fit the budget stay."""
        used = 0
        kept = 0
        for copy in self.copies():
            size = copy.nbytes() if self.budget is not None else 0
            if kept < self.keep and (self.budget is None or used + size <= self.budget):
                kept += 1
                used += size
                continue
            log.info("removing the local copy of step %d (retention)", copy.step)
            shutil.rmtree(copy.dir, ignore_errors=True)


#: ``ioctl(FICLONE)``: make a file share another's blocks, copy-on-write (btrfs, XFS with
#: reflink, bcachefs, ZFS 2.2+, overlayfs on those); Linux only.
FICLONE = 0x40049409


def place_file(source: Path, target: Path, *, link: bool = False) -> str | None:
    """Put the bytes of a kept copy's file ``source`` at the new path ``target`` for a
    restore: a reflink (the file shares the copy's blocks until either is written, where
    the filesystem offers it), else a copy (in the kernel, ``copy_file_range``). The
    restored file is independent of the kept copy and of every other restore: editing one
    in place changes nothing else. ``link``: a hard link instead (no bytes written, but the
    restored file IS the kept copy: editing it in place edits the copy and every other
    restore linked from it; a copy when the link fails, as across filesystems).

    Only a regular file is taken: ``source`` is opened without following a symbolic link,
    and a link, a FIFO, a device, a directory or a missing file gives None (the caller
    downloads that file). Returns how it was placed: ``"reflink"``, ``"copy"`` or
    ``"link"``.

    Raises OSError writing ``target`` (a full disk, no permission).
    """
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # gone, a symbolic link (ELOOP), unreadable
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None  # only regular files: never a FIFO or device planted in staging
        if link and _hard_link(source, target, st):
            return "link"
        return _clone_or_copy(fd, st.st_size, target)
    finally:
        os.close(fd)


def _hard_link(source: Path, target: Path, st: os.stat_result) -> bool:
    """Hard-link ``source`` (whose open file is ``st``) at ``target``; False (nothing left
    at ``target``) when linking fails or what got linked is not that regular file (it was
    replaced between the open and the link)."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        return False
    got = os.lstat(target)
    if stat.S_ISREG(got.st_mode) and (got.st_dev, got.st_ino) == (st.st_dev, st.st_ino):
        return True
    target.unlink()
    return False


def _clone_or_copy(src: int, size: int, target: Path) -> str | None:
    """Write the open file ``src`` (``size`` bytes) to the new file ``target``: a reflink
    where the filesystem has one, else an in-kernel copy, else a plain one. None (nothing
    left at ``target``) if ``src`` ended early (shrunk under the copy: download it).
    Raises OSError writing ``target`` (then removed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    dst = os.open(target, flags, 0o666)
    try:
        how = "reflink" if _reflink(src, dst) else ("copy" if _copy(src, dst, size) else None)
    except BaseException:
        os.close(dst)
        target.unlink(missing_ok=True)
        raise
    os.close(dst)
    if how is None:
        target.unlink(missing_ok=True)
    return how


def _reflink(src: int, dst: int) -> bool:
    try:
        import fcntl

        fcntl.ioctl(dst, FICLONE, src)
    except (ImportError, OSError):  # not Linux, another filesystem, no reflink here
        return False
    return True


def _copy(src: int, dst: int, size: int) -> bool:
    """Copy ``size`` bytes from ``src`` to ``dst`` (both at offset 0); False if ``src``
    ended first."""
    offset = 0
    in_kernel = hasattr(os, "copy_file_range")
    while offset < size:
        if in_kernel:
            try:
                n = os.copy_file_range(src, dst, size - offset, offset, offset)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                in_kernel = False  # not between these files: copy through user space
                continue
        else:
            data = os.pread(src, min(size - offset, 8 << 20), offset)
            n = os.pwrite(dst, data, offset) if data else 0
        if n <= 0:
            return False
        offset += n
    return True


def _read_copy(path: Path) -> LocalCopy | None:
    try:
        body = json.loads((path / RECORD).read_text())
        if body.get("format") != FORMAT:
            return None
        step = body["step"]
        commit_id = body.get("commit_id")
        if not isinstance(step, int) or not (commit_id is None or isinstance(commit_id, str)):
            return None
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    return LocalCopy(path, step, commit_id)


def adopt_leftover(copies: LocalCopies, attempt: Attempt) -> None:
    """An attempt a crashed process left ``durable`` or ``committed`` whose step is the
    committed one: keep it as a copy of that step (its content decides, when a restore
    uses it, whether it is the committed checkpoint)."""
    commit_id = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        body = json.loads((attempt.dir / RECORD).read_text())
        if body.get("format") == FORMAT and isinstance(body.get("commit_id"), str):
            commit_id = body["commit_id"]
    manifest = None
    with contextlib.suppress(OSError):
        manifest = (attempt.dir / MANIFEST).read_bytes()
    copies.adopt(attempt, commit_id, manifest)
