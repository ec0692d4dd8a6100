"""The formats of cloudckpt's records, and what a reader does with one it does not know.

Every sealed record (LATEST, a commit record, a manifest, ATTEMPT.json) names its format;
a reader refuses by name a format of its family that it does not read (``check_format``):
a newer cloudckpt wrote it, and reading past it, repairing it or collecting by it would
lose what that version added (docs/design.md §3, format changes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cloudckpt._version import __version__
from cloudckpt.errors import CorruptRecordError, UnknownFormatError

# LATEST /2: records may carry ``owned_bytes`` and manifests may be chunked (/2). An older
# cloudckpt must not read (and above all not garbage-collect) a run whose checkpoints share
# chunks, so every LATEST this version writes is /2 at least; /1 is still read.
LATEST_FORMAT = "cloudckpt.latest/2"
# LATEST /3: settings may keep the best checkpoints by a metric or one per period of time,
# and records may carry ``metrics``. A /2 writer would ignore those rules (and drop the
# metrics when it rewrites LATEST), then apply plain keep_last and drop the best checkpoint:
# a LATEST that uses any of it is written as /3, which /2 versions refuse to read.
LATEST_FORMAT_RETENTION = "cloudckpt.latest/3"
# LATEST /4: a retained or dropped checkpoint's manifest uses a digest other than SHA-256
# (records carry ``digest``; their manifests are /3). A /3 reader would find such a
# manifest "damaged" and fall back past it, or let GC judge its chunks: it must refuse at
# the pointer instead, which it does for a format it does not read. /4 carries /3's rules.
LATEST_FORMAT_DIGEST = "cloudckpt.latest/4"
LATEST_FORMATS_READ = (
    "cloudckpt.latest/1",
    LATEST_FORMAT,
    LATEST_FORMAT_RETENTION,
    LATEST_FORMAT_DIGEST,
)
# Manifest formats. A new field that an older reader may safely ignore (a file's ``mode``:
# an older cloudckpt restores the file with its default permissions) is added without a
# new format; one an older reader must not ignore (chunks: it would restore nothing of a
# chunked file) gets a new format, which older readers refuse by name.
MANIFEST_FORMAT = "cloudckpt.manifest/1"
# A manifest whose files are lists of content-addressed chunks (``cloudckpt.chunks``).
MANIFEST_FORMAT_CHUNKED = "cloudckpt.manifest/2"
# A manifest whose digest is not SHA-256 (``digest.algorithm``, e.g. "blake3-tree"), its
# files whole or chunked (``chunk_owners`` present when any is). /1 and /2 readers check
# only the SHA-256 tree: they must refuse it by name, and the LATEST that names it is /4.
MANIFEST_FORMAT_DIGEST = "cloudckpt.manifest/3"
MANIFEST_FORMATS_READ = (MANIFEST_FORMAT, MANIFEST_FORMAT_CHUNKED, MANIFEST_FORMAT_DIGEST)
ATTEMPT_FORMAT = "cloudckpt.attempt/1"
# Every record this version writes names its writer (``written_by``: cloudckpt's version),
# so that a version that does not know a record's format can say which version wrote it
# (``UnknownFormatError``). An optional field: readers that predate it ignore it.
WRITTEN_BY = __version__

# Bounds on what a reader accepts from the store (hostile or damaged records).
MAX_LATEST_BYTES = 64 * 1024 * 1024
MAX_MANIFEST_BYTES = 256 * 1024 * 1024


def unknown_format(
    what: str, found: Any, known: Sequence[str], body: Mapping[str, Any]
) -> UnknownFormatError:
    """The error for a record (or setting) in a format this version does not know: a newer
    cloudckpt wrote it. ``body``'s ``written_by`` names that version where it says."""
    written_by = body.get("written_by") if isinstance(body.get("written_by"), str) else None
    by = f"cloudckpt {written_by}" if written_by else "a newer cloudckpt"
    return UnknownFormatError(
        f"{what} is in format {found!r}, written by {by}; this cloudckpt ({__version__}) "
        f"reads only {', '.join(known)}. Nothing was read past it or changed: upgrade this "
        "host",
        what=what,
        found=str(found),
        known=tuple(known),
        written_by=written_by,
    )


def check_format(
    body: Mapping[str, Any], family: str, known: Sequence[str], what: str, kind: str
) -> None:
    """Raise UnknownFormatError for a sealed record of ``family`` (``cloudckpt.latest/``)
    in a format not in ``known``; CorruptRecordError for one that is no such record at all.
    A record that passed its self-check was written on purpose: an unknown format of its
    family is a newer version's, never damage (docs/design.md §3, format changes)."""
    fmt = body.get("format")
    if fmt in known:
        return
    if isinstance(fmt, str) and fmt.startswith(family):
        raise unknown_format(what, fmt, known, body)
    raise CorruptRecordError(f"{what} has format {fmt!r}: it is not a {kind}")
