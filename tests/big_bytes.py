"""Short explanations for failed ``==`` between large byte strings.

pytest explains a failed ``assert a == b`` with a diff of the two reprs. When it runs in CI
(``CI`` set) it does not truncate that explanation, and a diff of two multi-MiB reprs takes
minutes: a failing test looks like a hang and times out without saying what differed (a
mutant's guard did exactly that in CI). Past ``LARGE`` bytes, say what differs instead: the
lengths, digests and the first differing offset, per key for dicts of files.
"""

from __future__ import annotations

import hashlib
from typing import Any

LARGE = 64 * 1024
_BYTES = (bytes, bytearray, memoryview)


def _is_large(value: Any) -> bool:
    return isinstance(value, _BYTES) and len(value) > LARGE


def holds_large_bytes(value: Any) -> bool:
    """True for large bytes, or a dict, list or tuple holding some."""
    if isinstance(value, dict):
        return any(_is_large(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_is_large(v) for v in value)
    return _is_large(value)


def _describe(value: Any) -> str:
    if not isinstance(value, _BYTES):
        text = repr(value)
        return text if len(text) <= 80 else text[:77] + "..."
    blob = bytes(value)
    return f"{len(blob)} bytes, sha256 {hashlib.sha256(blob).hexdigest()[:16]}"


def _first_difference(left: Any, right: Any) -> str:
    if not (isinstance(left, _BYTES) and isinstance(right, _BYTES)):
        return ""
    a, b = bytes(left), bytes(right)
    offset = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return f", first difference at byte {offset}"


def explain(left: Any, right: Any) -> list[str]:
    """pytest_assertrepr_compare's lines for ``left == right`` holding large bytes."""
    lines = ["values hold large bytes; their differences, not their reprs:"]
    if isinstance(left, dict) and isinstance(right, dict):
        for key in sorted(set(left) | set(right), key=repr):
            if key not in right:
                lines.append(f"  {key!r}: only on the left ({_describe(left[key])})")
            elif key not in left:
                lines.append(f"  {key!r}: only on the right ({_describe(right[key])})")
            elif left[key] != right[key]:
                lines.append(
                    f"  {key!r}: {_describe(left[key])} != {_describe(right[key])}"
                    + _first_difference(left[key], right[key])
                )
        return lines
    if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
        if len(left) != len(right):
            lines.append(f"  lengths differ: {len(left)} != {len(right)}")
        for i, (a, b) in enumerate(zip(left, right, strict=False)):
            if a != b:
                lines.append(f"  [{i}]: {_describe(a)} != {_describe(b)}{_first_difference(a, b)}")
        return lines
    lines.append(f"  {_describe(left)} != {_describe(right)}{_first_difference(left, right)}")
    return lines
