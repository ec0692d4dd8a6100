"""A checkpoint's manifest (``MANIFEST.json``): its files, whole or as content-addressed
chunks, their digests and modes; how it is written, parsed and checked against its LATEST
record, and which paths it may name. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Any

from cloudckpt import digest as _digest
from cloudckpt.attempt_layout import CHUNKS_DIR, chunk_name, is_sha256, parse_ckpt_prefix
from cloudckpt.canonical import get_field as _get  # the parsers read dozens of fields
from cloudckpt.canonical import iso, seal, unseal
from cloudckpt.digest import CHUNK_SIZE, SHA256_TREE
from cloudckpt.errors import CorruptRecordError, UnsafePathError
from cloudckpt.formats import (
    MANIFEST_FORMAT,
    MANIFEST_FORMAT_CHUNKED,
    MANIFEST_FORMAT_DIGEST,
    MANIFEST_FORMATS_READ,
    MAX_MANIFEST_BYTES,
    WRITTEN_BY,
    check_format,
)
from cloudckpt.protocol import CheckpointRecord

MAX_FILE_SIZE = 1 << 50  # 1 PiB: S3's object limit is 5 TiB


@dataclasses.dataclass(frozen=True)
class ChunkRef:
    """One content-addressed chunk of a file: stored at ``<owner>chunks/<name>``, where
    ``owner`` is the prefix of the attempt that uploaded it first (``cloudckpt.chunks``)
    and ``name`` its leaf digest ``sha256`` (hex; despite the field's name, a digest of
    ``algorithm``, the manifest's) with the algorithm's prefix (``chunk_name``)."""

    owner: str
    sha256: str
    size: int
    algorithm: str = dataclasses.field(default_factory=lambda: _digest.ALGORITHM)

    @property
    def name(self) -> str:
        return chunk_name(self.algorithm, self.sha256)

    @property
    def key(self) -> str:
        return f"{self.owner}{CHUNKS_DIR}{self.name}"


#: The permission bits a manifest may record for a file (``FileEntry.mode``). Restores
#: apply at most these, less the process umask: never setuid, setgid or sticky.
MODE_BITS = 0o777


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """A file of a checkpoint. ``chunks`` is None for a file stored whole under the
    attempt's ``files/``; otherwise the file is the concatenation of these chunks.
    ``mode``: the file's permission bits when it was saved (``MODE_BITS`` at most), None
    when unknown (saved from memory, or by a cloudckpt that did not record modes)."""

    path: str
    size: int
    digest: str
    chunks: tuple[ChunkRef, ...] | None = None
    mode: int | None = None
    # What ``digest`` (and the chunks' names) are digests of: the manifest's algorithm
    # (not stored per file); a new entry takes the one new checkpoints use.
    algorithm: str = dataclasses.field(default_factory=lambda: _digest.ALGORITHM)

    def to_json(self, owners: dict[str, int]) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "size": self.size, "digest": self.digest}
        if self.chunks is not None:
            d["chunks"] = [
                [owners.setdefault(c.owner, len(owners)), c.sha256, c.size] for c in self.chunks
            ]
        if self.mode is not None:
            # An optional field: readers that predate it ignore it (and restore 0644), so
            # recording it needs no new manifest format (see MANIFEST_FORMAT).
            d["mode"] = self.mode
        return d


@dataclasses.dataclass(frozen=True)
class Manifest:
    ckpt: str
    step: int
    epoch: int
    commit_id: str
    writer_id: str
    created_at: str
    files: tuple[FileEntry, ...]
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # The file digests' algorithm (``cloudckpt.digest``); a new manifest takes the one new
    # checkpoints use. Its chunks are named by digests of the same algorithm.
    algorithm: str = dataclasses.field(default_factory=lambda: _digest.ALGORITHM)
    chunk_size: int = CHUNK_SIZE
    # ``retention.clean_metrics``; absent from the body when empty (then byte-identical
    # to a manifest written before metrics existed, which an older cloudckpt reads).
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def chunked(self) -> bool:
        return any(f.chunks is not None for f in self.files)

    @property
    def owned_bytes(self) -> int:
        """Bytes stored under this checkpoint's own prefix: plain files, plus each distinct
        chunk it uploaded first."""
        own = {c.name: c.size for f in self.files for c in f.chunks or () if c.owner == self.ckpt}
        return sum(f.size for f in self.files if f.chunks is None) + sum(own.values())

    @property
    def format(self) -> str:
        """The oldest manifest format that carries this manifest."""
        if self.algorithm != SHA256_TREE:
            return MANIFEST_FORMAT_DIGEST
        return MANIFEST_FORMAT_CHUNKED if self.chunked else MANIFEST_FORMAT

    def to_bytes(self) -> bytes:
        """Raises ValueError for a file or chunk digested with another algorithm."""
        if any(
            f.algorithm != self.algorithm or any(c.algorithm != f.algorithm for c in f.chunks or ())
            for f in self.files
        ):
            raise ValueError(f"a file of {self.ckpt} is not digested with {self.algorithm}")
        owners: dict[str, int] = {}
        files = [f.to_json(owners) for f in self.files]
        extra: dict[str, Any] = {}
        if self.chunked:
            extra["chunk_owners"] = sorted(owners, key=owners.__getitem__)
        if self.metrics:
            extra["metrics"] = dict(self.metrics)
        return seal(
            {
                **extra,
                "format": self.format,
                "written_by": WRITTEN_BY,
                "ckpt": self.ckpt,
                "step": self.step,
                "epoch": self.epoch,
                "commit_id": self.commit_id,
                "writer_id": self.writer_id,
                "created_at": self.created_at,
                "metadata": dict(self.metadata),
                "digest": {"algorithm": self.algorithm, "chunk_size": self.chunk_size},
                "files": files,
                "total_bytes": self.total_bytes,
            }
        )

    def record(self, data: bytes, committed_at: dt.datetime) -> CheckpointRecord:
        """The LATEST record of this manifest, whose serialised bytes are ``data``."""
        return CheckpointRecord(
            ckpt=self.ckpt,
            step=self.step,
            epoch=self.epoch,
            commit_id=self.commit_id,
            manifest_sha256=hashlib.sha256(data).hexdigest(),
            manifest_size=len(data),
            committed_at=iso(committed_at),
            total_bytes=self.total_bytes,
            num_files=len(self.files),
            metadata=dict(self.metadata),
            owned_bytes=self.owned_bytes,
            metrics=dict(self.metrics),
            digest=None if self.algorithm == SHA256_TREE else self.algorithm,
        )


def safe_relpath(path: str) -> str:
    """Return ``path`` if it is a safe relative file path; raise UnsafePathError if not.

    Refused: absolute paths, drive letters, backslashes, ``..``/``.``/empty segments,
    control characters. What passes can only name a file below the destination.
    """
    if not isinstance(path, str) or not path or len(path) > 4096:
        raise UnsafePathError(f"manifest path {path!r} is empty or too long")
    if (
        path.startswith("/")
        or "\\" in path
        or re.match(r"^[A-Za-z]:", path)
        or any(ord(c) < 32 or ord(c) == 127 for c in path)
    ):
        raise UnsafePathError(f"manifest path {path!r} is absolute or has illegal characters")
    segments = path.split("/")
    if any(s in ("", ".", "..") for s in segments) or posixpath.normpath(path) != path:
        raise UnsafePathError(f"manifest path {path!r} has '..', '.' or empty segments")
    return path


def validate_file_entries(entries: Sequence[FileEntry]) -> None:
    """Paths safe and unique, no file that is also a directory of another, sane sizes."""
    seen: set[str] = set()
    dirs: set[str] = set()
    for e in entries:
        safe_relpath(e.path)
        if e.path in seen:
            raise UnsafePathError(f"manifest lists {e.path!r} twice")
        seen.add(e.path)
        parts = e.path.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        if not 0 <= e.size <= MAX_FILE_SIZE:
            raise CorruptRecordError(f"manifest: size {e.size} of {e.path!r} out of range")
        if not is_sha256(e.digest):
            raise CorruptRecordError(f"manifest: digest of {e.path!r} is not a hex digest")
        if e.mode is not None and (
            not isinstance(e.mode, int) or isinstance(e.mode, bool) or not 0 <= e.mode <= 0o7777
        ):
            raise CorruptRecordError(f"manifest: mode of {e.path!r} is not a file mode")
        if e.chunks is not None:
            _check_chunks(e)
    clash = seen & dirs
    if clash:
        raise UnsafePathError(f"manifest path {sorted(clash)[0]!r} is both a file and a directory")


def _chunk_ref(c: Any, owners: Sequence[str], algorithm: str, what: str) -> ChunkRef:
    if (
        not isinstance(c, list)
        or len(c) != 3
        or not isinstance(c[0], int)
        or isinstance(c[0], bool)
        or not 0 <= c[0] < len(owners)
        or not isinstance(c[1], str)
        or not isinstance(c[2], int)
        or isinstance(c[2], bool)
    ):
        raise CorruptRecordError(f"{what}: malformed chunk reference {c!r:.80}")
    return ChunkRef(owners[c[0]], c[1], c[2], algorithm)


def _check_chunks(e: FileEntry) -> None:
    """Chunks: hex SHA-256 names, positive sizes within one digest leaf, adding up to the
    file's size."""
    offset = 0
    for c in e.chunks or ():
        if not is_sha256(c.sha256):
            raise CorruptRecordError(f"manifest: a chunk of {e.path!r} is not a hex digest")
        if c.size <= 0 or offset // CHUNK_SIZE != (offset + c.size - 1) // CHUNK_SIZE:
            raise CorruptRecordError(f"manifest: a chunk of {e.path!r} crosses a digest leaf")
        offset += c.size
    if offset != e.size:
        raise CorruptRecordError(f"manifest: the chunks of {e.path!r} do not add up to its size")


def parse_manifest(data: bytes, record: CheckpointRecord | None = None) -> Manifest:
    """Parse and verify a manifest (against its LATEST record when given).

    Raises CorruptRecordError (damaged, or not the manifest ``record`` names),
    UnknownFormatError (sealed, in a format a newer cloudckpt wrote, or a digest algorithm
    this version does not know: not damage) or UnsafePathError (a path that would escape
    the destination).
    """
    what = f"manifest of {record.ckpt}" if record else "manifest"
    if record is not None:
        if len(data) != record.manifest_size:
            raise CorruptRecordError(
                f"{what} is {len(data)} bytes, LATEST recorded {record.manifest_size}"
            )
        if hashlib.sha256(data).hexdigest() != record.manifest_sha256:
            raise CorruptRecordError(f"{what} does not match the digest LATEST recorded")
    body = unseal(data, what, MAX_MANIFEST_BYTES)
    check_format(body, "cloudckpt.manifest/", MANIFEST_FORMATS_READ, what, "manifest")
    fmt = body["format"]
    digest = _get(body, "digest", dict, what)
    algorithm = _digest_algorithm(digest, fmt, what)
    owners: list[str] = []
    if fmt == MANIFEST_FORMAT_CHUNKED or (fmt == MANIFEST_FORMAT_DIGEST and "chunk_owners" in body):
        owners = _get(body, "chunk_owners", list, what)
        if not all(isinstance(o, str) and parse_ckpt_prefix(o) for o in owners):
            raise CorruptRecordError(f"{what}: a chunk owner is not a checkpoint prefix")
    chunked = fmt != MANIFEST_FORMAT
    files = [
        _file_entry(f, chunked, owners, algorithm, what) for f in _get(body, "files", list, what)
    ]
    manifest = Manifest(
        ckpt=_get(body, "ckpt", str, what),
        step=_get(body, "step", int, what),
        epoch=_get(body, "epoch", int, what),
        commit_id=_get(body, "commit_id", str, what),
        writer_id=_get(body, "writer_id", str, what),
        created_at=_get(body, "created_at", str, what),
        files=tuple(files),
        metadata=_get(body, "metadata", dict, what),
        algorithm=algorithm,
        chunk_size=_get(digest, "chunk_size", int, what),
        metrics=_get(body, "metrics", dict, what) if "metrics" in body else {},
    )
    if not 0 < manifest.chunk_size <= 1 << 30:
        raise CorruptRecordError(f"{what}: digest chunk size {manifest.chunk_size} out of range")
    validate_file_entries(manifest.files)
    if record is not None and (manifest.ckpt, manifest.commit_id) != (
        record.ckpt,
        record.commit_id,
    ):
        raise CorruptRecordError(f"{what} belongs to another checkpoint")
    return manifest


def _digest_algorithm(digest: Mapping[str, Any], fmt: str, what: str) -> str:
    """The manifest's digest algorithm. Raises UnknownFormatError (a name this version does
    not know: not damage, a newer writer) or CorruptRecordError (no name, or one that
    ``fmt`` cannot carry: /1 and /2 manifests are always SHA-256)."""
    algorithm = _digest.check(_get(digest, "algorithm", str, what), what)
    if fmt != MANIFEST_FORMAT_DIGEST and algorithm != SHA256_TREE:
        raise CorruptRecordError(f"{what}: a {fmt} manifest with digest {algorithm!r}")
    return algorithm


def _file_entry(f: Any, chunked: bool, owners: list[str], algorithm: str, what: str) -> FileEntry:
    """One of a manifest's file entries (``chunked``: the format that may name chunks of
    ``owners``, digests of ``algorithm``). Raises CorruptRecordError (``what`` says whose
    manifest)."""
    if not isinstance(f, dict):
        raise CorruptRecordError(f"{what}: file entry is not an object")
    chunks = None
    if chunked and "chunks" in f:
        chunks = tuple(
            _chunk_ref(c, owners, algorithm, what) for c in _get(f, "chunks", list, what)
        )
    return FileEntry(
        _get(f, "path", str, what),
        _get(f, "size", int, what),
        _get(f, "digest", str, what),
        chunks,
        None if f.get("mode") is None else _get(f, "mode", int, what),
        algorithm,
    )
