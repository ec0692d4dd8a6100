"""``ls``'s table: one line per checkpoint at any width (issue 25 item 7).

At 80 columns a row holds what a user scans for: the step, its status (current, pinned),
its age, its size, its file count and its metrics; only the metrics column gives way
(ending in "…"), never the others. From ``WIDE`` columns on (and when stdout is not a
terminal: 200 columns unless ``COLUMNS`` says otherwise) the row adds the commit time, the
bytes it owns and shares, the writer epoch and the commit id. Everything is in ``--json``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

#: From this width on, the table adds the commit time, owns/shares, epoch and commit id.
WIDE = 160

#: Metadata the integrations record for their own use (restoring into the right place),
#: not for a person scanning the table: ``show`` and ``--json`` have it.
BOOKKEEPING = frozenset(
    {
        "framework",  # "transformers", "lightning"
        "checkpoint_dir",  # HF: checkpoint-N
        "output_dir",  # HF: the Trainer's output_dir
        "global_step",  # the step again
        "filename",  # Lightning: the .ckpt name
        "path",  # Lightning: where it was saved
        "watch",  # `cloudckpt watch`: the source directory and its kind
    }
)

#: Longest value of user metadata shown as it is (longer ones end in "…").
_VALUE_CHARS = 24


def format_value(value: Any) -> str:
    """A metadata value in a few characters: 4 significant digits for a float, ``{…}`` /
    ``[…]`` for a nested object or list."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return "{…}"
    if isinstance(value, list):
        return "[…]"
    text = str(value)
    return text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 1] + "…"


def metrics_summary(metadata: Mapping[str, Any]) -> str:
    """``eval_loss=0.3124 accuracy=0.91 loss=1.254 epoch=3 note=baseline``: the metrics a
    checkpoint records (``metadata["metrics"]``, a mapping of name to number) first, then
    the rest of its metadata, leaving out the integrations' bookkeeping (``BOOKKEEPING``)
    and a false ``emergency`` flag."""
    parts: list[str] = []
    metrics = metadata.get("metrics")
    if isinstance(metrics, Mapping):
        parts += [f"{k}={format_value(v)}" for k, v in metrics.items()]
    for key, value in metadata.items():
        if key in BOOKKEEPING or (key == "metrics" and isinstance(metrics, Mapping)):
            continue
        if key == "emergency":
            if value is True:
                parts.append("emergency")
            continue
        parts.append(f"{key}={format_value(value)}")
    return " ".join(parts)


def short_bytes(n: float) -> str:
    """``293 KiB``, ``1.21 GiB``, ``1023 MiB``: three significant digits, 8 characters at
    most."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            break
        n /= 1024
    if unit == "B" or abs(n) >= 100:
        return f"{n:.0f} {unit}"
    return f"{n:.{1 if abs(n) >= 10 else 2}f} {unit}"


def age(seconds: float) -> str:
    """``42s``, ``5m``, ``3h``, ``12d`` (rounded down: never younger than it is)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(int(seconds), 0)}s"


def status(checkpoint: Mapping[str, Any]) -> str:
    """``current``, ``pin:best``, ``current pin:best pin:release``."""
    words = ["current"] if checkpoint["current"] else []
    return " ".join(words + [f"pin:{label}" for label in checkpoint["pins"]])


def print_ls(console: Any, doc: Mapping[str, Any]) -> None:
    """``ls``'s header and table for ``doc`` (what ``ls --json`` prints, of a run that has
    checkpoints) on the rich ``console``."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    now = time.time()
    wide = console.width >= WIDE
    w, settings = doc["writer"], doc["settings"] or {}
    console.print(Text(doc["url"], style="bold"))
    retention = ", ".join(
        f"{key} {settings[key]}" for key in ("keep_last", "keep_every") if settings.get(key)
    )
    console.print(
        f"writer epoch {w['epoch']} ({w['id']}) · LATEST seq {doc['seq']}"
        + (f" · {retention}" if retention else ""),
        overflow="fold",
    )
    checkpoints = doc["checkpoints"]
    summaries = [metrics_summary(c["metadata"]) for c in checkpoints]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    _ls_columns(table, wide, any(summaries))
    for c, summary in zip(checkpoints, summaries, strict=True):
        cells: list[Any] = _ls_row(c, now, wide)
        if any(summaries):
            cells.append(Text(summary, no_wrap=True, overflow="ellipsis"))
        table.add_row(*cells)
    console.print(table)
    if doc["tombstones"]:
        console.print(
            f"{len(doc['tombstones'])} checkpoint(s) dropped by retention, waiting for "
            "`cloudckpt gc`"
        )


def _ls_columns(table: Any, wide: bool, metrics: bool) -> None:
    """``ls``'s columns (the wide ones on a wide terminal; metrics if any checkpoint has
    some) added to the rich ``table``."""
    # Every column but the metrics keeps its width (no_wrap); the metrics column is the
    # one that gives way, each cell cut with "…" rather than wrapped onto a second line.
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True, max_width=24, overflow="ellipsis")
    table.add_column("committed" if wide else "age", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    if wide:
        table.add_column("owns", justify="right", no_wrap=True)
        table.add_column("shares", justify="right", no_wrap=True)
    table.add_column("files", justify="right", no_wrap=True)
    if wide:
        table.add_column("epoch", justify="right", no_wrap=True)
        table.add_column("commit", no_wrap=True)
    if metrics:
        table.add_column("metrics / metadata", overflow="ellipsis", ratio=1)


def _ls_row(c: Mapping[str, Any], now: float, wide: bool) -> list[Any]:
    """The cells of checkpoint ``c``'s row, up to its metrics (``_ls_columns``)."""
    from cloudckpt.protocol import parse_iso

    try:
        ago = age(now - parse_iso(c["committed_at"]).timestamp()) + " ago"
    except ValueError:
        ago = c["committed_at"]
    row = [str(c["step"]), status(c)]
    row.append(f"{c['committed_at'][:16].replace('T', ' ')} ({ago})" if wide else ago)
    row.append(short_bytes(c["total_bytes"]))
    if wide:
        for key in ("owned_bytes", "shared_bytes"):
            row.append("" if c[key] is None else short_bytes(c[key]))
    row.append(str(c["num_files"]))
    if wide:
        row += [str(c["epoch"]), c["commit_id"]]
    return list(row)
