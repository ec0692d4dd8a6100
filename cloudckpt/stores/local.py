"""``file:///path``: a POSIX directory as a store, safe across threads and processes.

fsspec's ``mode="create"`` is check-then-write and races (docs/design.md §4), so this adapter does
its own atomic writes:

- every write goes to a temporary file under ``<root>/.cloudckpt/tmp`` first and is fsynced;
- create-only: ``os.link`` the temporary file to the final name (fails atomically if the
  name exists), then fsync the directory;
- compare-and-swap and overwrite: take an ``flock`` on one of 64 lock-stripe files, compare
  the current version, ``os.replace``, fsync the directory;
- readers take no lock: files are never modified in place, so an open file descriptor always
  reads one complete version.

Versions are ``<inode>.<mtime_ns>``. Under the lock each write sets its file's mtime
strictly above the previous version's, so a version never repeats even when the kernel
reuses an inode and the clock is coarse (an A-B-A write sequence stays detectable).

Unlike an object store, a directory cannot hold both ``a`` and ``a/b``; cloudckpt's layout
never needs that.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import datetime as dt
import errno
import fcntl
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence

import google_crc32c

from cloudckpt.errors import (
    ChecksumMismatchError,
    ObjectNotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
)
from cloudckpt.stores.base import (
    CREATE,
    INTERNAL_PREFIX,
    OVERWRITE,
    Capabilities,
    Create,
    MultipartUpload,
    ObjectInfo,
    PartInfo,
    PendingUpload,
    PutMode,
    Store,
    Update,
    crc32c_b64,
    validate_key,
)

_LOCK_STRIPES = 64
_COPY_CHUNK = 8 * 1024 * 1024


def _version(st: os.stat_result) -> str:
    return f"{st.st_ino:x}.{st.st_mtime_ns:x}"


def _mtime(st: os.stat_result) -> dt.datetime:
    return dt.datetime.fromtimestamp(st.st_mtime_ns / 1e9, tz=dt.timezone.utc)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(Store):
    """A store in a local (POSIX) directory. See the module docstring for the mechanics.

    ``fsync=False`` skips the fsyncs (faster, not crash-safe; for tests of other layers).
    """

    def __init__(self, root: str, *, fsync: bool = True) -> None:
        self.root = os.path.abspath(root)
        self.url = f"file://{self.root}/"
        self.capabilities = Capabilities()
        # File times are nanoseconds, but the kernel stamps them from a coarse clock
        # (a jiffy, up to 10 ms); an NFS server may round further.
        self.clock_resolution = 0.1
        self._fsync = fsync
        self._internal = os.path.join(self.root, INTERNAL_PREFIX.rstrip("/"))

    # --- paths and errors ------------------------------------------------------------

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *validate_key(key).split("/"))

    def _scratch(self, *parts: str) -> str:
        path = os.path.join(self._internal, *parts)
        os.makedirs(path, exist_ok=True)
        return path

    def _error(self, exc: OSError, key: str | None, action: str) -> StoreError:
        where = f"{self.url}{key or ''}"
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFoundError(f"{where} does not exist", key=key)
        if isinstance(exc, PermissionError):
            return PermissionDeniedError(
                f"permission denied while trying to {action} {where}",
                key=key,
                hint="Check the directory's owner and mode, or choose a writable location",
            )
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return StoreError(
                f"no space left on the device holding {self.root} while trying to {action} {where}",
                key=key,
                hint="Free space there or point the run at a larger volume; nothing was committed",
            )
        return StoreError(f"could not {action} {where}: {exc.strerror or exc}", key=key)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        stripe = int.from_bytes(hashlib.sha1(key.encode()).digest()[:4], "big") % _LOCK_STRIPES
        path = os.path.join(self._scratch("locks"), f"{stripe:02d}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    # --- reads ---------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        try:
            st = os.stat(self._path(key))
        except OSError as exc:
            raise self._error(exc, key, "read") from None
        return ObjectInfo(key, st.st_size, _version(st), _mtime(st))

    def get(self, key: str) -> tuple[bytes, ObjectInfo]:
        try:
            with open(self._path(key), "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except IsADirectoryError:
            raise ObjectNotFoundError(f"{self.url}{key} does not exist", key=key) from None
        except OSError as exc:
            raise self._error(exc, key, "read") from None
        return data, ObjectInfo(key, len(data), _version(st), _mtime(st))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except OSError as exc:
            raise self._error(exc, key, "read") from None
        try:
            chunks, offset, end = [], start, start + length
            while offset < end:
                chunk = os.pread(fd, end - offset, offset)
                if not chunk:
                    break
                chunks.append(chunk)
                offset += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        # Walk only the deepest directory that can hold matching keys.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = os.path.join(self.root, *base.split("/")) if base else self.root
        found = []
        for dirpath, dirnames, filenames in os.walk(top):
            rel_dir = os.path.relpath(dirpath, self.root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            if rel_dir == "":
                dirnames[:] = [d for d in dirnames if d != INTERNAL_PREFIX.rstrip("/")]
            for name in filenames:
                key = rel_dir + name
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # deleted while listing
                found.append(ObjectInfo(key, st.st_size, _version(st), _mtime(st)))
        found.sort(key=lambda o: o.key)
        yield from found

    # --- writes --------------------------------------------------------------------

    def _new_temp(self) -> str:
        return os.path.join(self._scratch("tmp"), uuid.uuid4().hex)

    def _write_temp(self, data: bytes | memoryview) -> str:
        tmp = self._new_temp()
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        return tmp

    def _make_parent(self, path: str) -> str:
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        return parent

    def _bump_mtime(self, tmp: str, previous_ns: int) -> None:
        """Give ``tmp`` an mtime strictly above ``previous_ns`` (see module docstring)."""
        target = max(time.time_ns(), previous_ns + 1)
        for step in (0, 1_000, 1_000_000, 1_000_000_000, 2_000_000_000):
            os.utime(tmp, ns=(target + step, target + step))
            if os.stat(tmp).st_mtime_ns > previous_ns:
                return
        raise StoreError(f"cannot give {tmp} a newer modification time than the current one")

    def _install(self, key: str, tmp: str, mode: PutMode) -> ObjectInfo:
        """Move the finished temporary file ``tmp`` to ``key`` according to ``mode``."""
        path = self._path(key)
        with self._locked(key):
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
            if isinstance(mode, Create) and current is not None:
                raise PreconditionFailedError(f"{self.url}{key} already exists", key=key)
            if isinstance(mode, Update):
                if current is None:
                    raise PreconditionFailedError(
                        f"{self.url}{key} does not exist (compare-and-swap needs it)", key=key
                    )
                if _version(current) != mode.version:
                    raise PreconditionFailedError(
                        f"{self.url}{key} changed (version {_version(current)}, "
                        f"expected {mode.version})",
                        key=key,
                    )
            self._bump_mtime(tmp, current.st_mtime_ns if current else 0)
            for _ in range(5):  # a concurrent delete may remove the empty parent directory
                parent = self._make_parent(path)
                try:
                    if isinstance(mode, Create):
                        # link fails atomically if the name exists, even against writers
                        # that do not take our lock.
                        os.link(tmp, path)
                        os.unlink(tmp)
                    else:
                        os.replace(tmp, path)
                    break
                except FileNotFoundError:
                    continue
                except FileExistsError:
                    raise PreconditionFailedError(
                        f"{self.url}{key} already exists", key=key
                    ) from None
            else:
                raise StoreError(f"could not create the directory for {self.url}{key}", key=key)
            if self._fsync:
                _fsync_dir(parent)
            st = os.stat(path)
        return ObjectInfo(key, st.st_size, _version(st), _mtime(st))

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = OVERWRITE) -> ObjectInfo:
        validate_key(key)
        tmp = None
        try:
            tmp = self._write_temp(data)
            return self._install(key, tmp, mode)
        except OSError as exc:
            raise self._error(exc, key, "write") from None
        finally:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            with self._locked(key):
                os.unlink(path)
        except FileNotFoundError:
            return
        except IsADirectoryError:
            return
        except OSError as exc:
            raise self._error(exc, key, "delete") from None
        # Prune empty directories up to the root so deleted checkpoints leave nothing.
        parent = os.path.dirname(path)
        while parent != self.root and parent.startswith(self.root):
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)

    # --- multipart -------------------------------------------------------------------

    def _upload_dir(self, upload_id: str) -> str:
        return os.path.join(self._internal, "uploads", upload_id)

    def create_multipart(self, key: str) -> MultipartUpload:
        validate_key(key)
        upload_id = uuid.uuid4().hex
        try:
            path = self._upload_dir(upload_id)
            os.makedirs(path)
            with open(os.path.join(path, "target"), "w") as f:
                f.write(key)
        except OSError as exc:
            raise self._error(exc, key, "start an upload of") from None
        return MultipartUpload(key, upload_id)

    def _check_upload(self, upload: MultipartUpload) -> str:
        path = self._upload_dir(upload.upload_id)
        try:
            with open(os.path.join(path, "target")) as f:
                target = f.read()
        except FileNotFoundError:
            target = None
        if target != upload.key:
            raise ObjectNotFoundError(
                f"multipart upload {upload.upload_id} of {self.url}{upload.key} does not exist",
                key=upload.key,
            )
        return path

    def upload_part(
        self,
        upload: MultipartUpload,
        part_number: int,
        data: bytes | memoryview,
        *,
        crc32c: str | None = None,
    ) -> PartInfo:
        path = self._check_upload(upload)
        actual = crc32c_b64(data)
        if crc32c is not None and crc32c != actual:
            raise ChecksumMismatchError(
                f"part {part_number} of {self.url}{upload.key}: CRC32C mismatch "
                f"(sent {crc32c}, received bytes have {actual})",
                key=upload.key,
            )
        try:
            tmp = self._write_temp(data)
            os.replace(tmp, os.path.join(path, f"{part_number:05d}"))
        except OSError as exc:
            raise self._error(exc, upload.key, "upload a part of") from None
        return PartInfo(part_number, f"{part_number}-{actual}", actual, len(data))

    def complete_multipart(
        self, upload: MultipartUpload, parts: Sequence[PartInfo], *, mode: PutMode = CREATE
    ) -> ObjectInfo:
        if isinstance(mode, Update):
            raise StoreError("compare-and-swap completion of multipart uploads is not offered")
        path = self._check_upload(upload)
        numbers = [p.part_number for p in parts]
        if not parts or numbers != sorted(set(numbers)):
            raise StoreError("parts must be non-empty, unique and in ascending order")
        tmp = self._new_temp()
        try:
            with open(tmp, "wb") as out:
                for i, part in enumerate(parts):
                    part_path = os.path.join(path, f"{part.part_number:05d}")
                    crc = google_crc32c.Checksum()
                    size = 0
                    with open(part_path, "rb") as src:
                        while chunk := src.read(_COPY_CHUNK):
                            crc.update(chunk)
                            size += len(chunk)
                            out.write(chunk)
                    etag = f"{part.part_number}-{base64.b64encode(crc.digest()).decode()}"
                    if etag != part.etag:
                        raise StoreError(
                            f"part {part.part_number} of {self.url}{upload.key} was replaced "
                            "or damaged since it was uploaded",
                            key=upload.key,
                        )
                    if i < len(parts) - 1 and size < self.capabilities.min_part_size:
                        raise StoreError(
                            f"part {part.part_number} is smaller than the minimum part size",
                            key=upload.key,
                        )
                out.flush()
                if self._fsync:
                    os.fsync(out.fileno())
            info = self._install(upload.key, tmp, mode)
        except FileNotFoundError:
            raise StoreError(
                f"a part of upload {upload.upload_id} is missing", key=upload.key
            ) from None
        except OSError as exc:
            raise self._error(exc, upload.key, "complete an upload of") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        shutil.rmtree(path, ignore_errors=True)
        return info

    def abort_multipart(self, upload: MultipartUpload) -> None:
        shutil.rmtree(self._upload_dir(upload.upload_id), ignore_errors=True)

    def list_multipart(self, prefix: str = "") -> builtins.list[PendingUpload]:
        uploads_dir = os.path.join(self._internal, "uploads")
        try:
            upload_ids = os.listdir(uploads_dir)
        except FileNotFoundError:
            return []
        pending = []
        for upload_id in upload_ids:
            marker = os.path.join(uploads_dir, upload_id, "target")
            try:
                with open(marker) as f:
                    key = f.read()
                st = os.stat(marker)
            except FileNotFoundError:
                continue  # completed or aborted meanwhile
            if key.startswith(prefix):
                pending.append(PendingUpload(key, upload_id, _mtime(st)))
        return sorted(pending, key=lambda p: (p.key, p.upload_id))

    # --- clock -----------------------------------------------------------------------

    def now(self) -> dt.datetime:
        # The clock that stamps files is the filesystem's (an NFS server's, say), so read it
        # from a freshly touched file rather than trusting this host's clock.
        try:
            probe = os.path.join(self._scratch("clock"), uuid.uuid4().hex)
            with open(probe, "wb"):
                pass
            st = os.stat(probe)
            os.unlink(probe)
            return _mtime(st)
        except OSError:
            return dt.datetime.now(dt.timezone.utc)
