"""Where an attempt's objects live: its prefix ``ckpt/<step:012d>-e<epoch>-<attempt>/``,
the names under it (``ATTEMPT.json``, ``files/``, ``chunks/``, ``MANIFEST.json``), chunk
names by digest algorithm, new attempt ids, and the ``ATTEMPT.json`` body
(``cloudckpt.protocol`` draws the whole layout of a run). Pure: no I/O.
"""

from __future__ import annotations

import datetime as dt
import re
import secrets

from cloudckpt.canonical import canonical_json, iso
from cloudckpt.digest import BLAKE3_TREE, SHA256_TREE
from cloudckpt.errors import ConfigurationError
from cloudckpt.formats import ATTEMPT_FORMAT, WRITTEN_BY

CKPT_PREFIX = "ckpt/"
MANIFEST_NAME = "MANIFEST.json"
ATTEMPT_NAME = "ATTEMPT.json"
FILES_DIR = "files/"
CHUNKS_DIR = "chunks/"

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CKPT_RE = re.compile(r"^ckpt/(\d{12})-e(\d+)-([0-9A-Za-z]+-[0-9a-f]+)/$")


def new_attempt_id(now: dt.datetime) -> str:
    """A unique, time-ordered attempt id such as ``20261202T120000123Z-9f3a0c1e``."""
    stamp = now.astimezone(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}{now.microsecond // 1000:03d}Z-{secrets.token_hex(4)}"


def ckpt_prefix(step: int, epoch: int, attempt_id: str) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or step >= 10**12:
        raise ConfigurationError(
            f"step must be an int in [0, 10**12), got {step!r}",
            hint="Pass the training step (global step) as a non-negative int",
        )
    return f"{CKPT_PREFIX}{step:012d}-e{epoch}-{attempt_id}/"


def parse_ckpt_prefix(prefix: str) -> tuple[int, int, str] | None:
    """(step, epoch, attempt id) of an attempt prefix, or None if it is not one."""
    m = _CKPT_RE.match(prefix)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def is_sha256(text: str) -> bool:
    """Whether ``text`` is a 64-digit lowercase hex digest (what a chunk is named by)."""
    return bool(_HEX64.match(text))


# A chunk's object name carries its algorithm: the same bytes have different names under
# SHA-256 and BLAKE3, and a name never stands for a digest of the other algorithm.
_CHUNK_NAME_PREFIX = {SHA256_TREE: "", BLAKE3_TREE: "b3-"}


def chunk_name(algorithm: str, hexdigest: str) -> str:
    """The object name (under ``chunks/``) of a chunk whose leaf digest is ``hexdigest``."""
    return _CHUNK_NAME_PREFIX[algorithm] + hexdigest


def parse_chunk_name(name: str) -> tuple[str, str] | None:
    """(algorithm, hex digest) of a chunk's object name, or None if it is not one."""
    for algorithm, prefix in _CHUNK_NAME_PREFIX.items():
        if prefix and name.startswith(prefix) and is_sha256(name[len(prefix) :]):
            return algorithm, name[len(prefix) :]
    return (SHA256_TREE, name) if is_sha256(name) else None


def attempt_body(
    *, ckpt: str, step: int, epoch: int, writer_id: str, started_at: dt.datetime
) -> bytes:
    """The small ATTEMPT.json written first into every attempt prefix."""
    return canonical_json(
        {
            "format": ATTEMPT_FORMAT,
            "written_by": WRITTEN_BY,
            "ckpt": ckpt,
            "step": step,
            "epoch": epoch,
            "writer_id": writer_id,
            "started_at": iso(started_at),
        }
    )
