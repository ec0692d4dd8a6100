"""How records are written: canonical JSON, sealed with their own digest
(``self_sha256``), read back field by field with their types checked, timestamps in UTC.
Pure: no I/O."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from cloudckpt.errors import ConfigurationError, CorruptRecordError


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes: sorted keys, no whitespace, no NaN/inf, UTF-8. Raises
    ConfigurationError for a value JSON cannot hold (user metadata, say)."""
    try:
        return json.dumps(
            obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"value cannot be stored as checkpoint metadata: {exc}",
            hint="Metadata must be JSON: dicts, lists, str, int, finite float, bool, None",
        ) from None


def seal(body: dict[str, Any]) -> bytes:
    """``body`` plus ``self_sha256`` (the digest of the canonical body without it)."""
    body = {k: v for k, v in body.items() if k != "self_sha256"}
    body["self_sha256"] = hashlib.sha256(canonical_json(body)).hexdigest()
    return canonical_json(body)


def unseal(data: bytes, what: str, limit: int) -> dict[str, Any]:
    """The body of a sealed record, ``self_sha256`` removed. Raises CorruptRecordError
    (``what`` says which record) for one over ``limit`` bytes, not a JSON object, or
    failing its self-check."""
    if len(data) > limit:
        raise CorruptRecordError(f"{what} is {len(data)} bytes, over the {limit}-byte limit")
    try:
        body = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptRecordError(f"{what} is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise CorruptRecordError(f"{what} is not a JSON object")
    claimed = body.pop("self_sha256", None)
    actual = hashlib.sha256(canonical_json(body)).hexdigest()
    if claimed != actual:
        raise CorruptRecordError(f"{what} fails its self-check (self_sha256 mismatch)")
    return body


def get_field(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``d[key]``, of type ``kind`` (a bool is no int). Raises CorruptRecordError."""
    value = d.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CorruptRecordError(f"{what}: field {key!r} is missing or has the wrong type")
    return value


def iso(t: dt.datetime) -> str:
    """``t`` as records write times: UTC, milliseconds, ``Z``."""
    return t.astimezone(dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_iso(s: str) -> dt.datetime:
    """A time ``iso`` wrote (raises ValueError for anything else)."""
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
