"""The CLI's tables, in one style (``new_table``), and ``ls``'s: one line per checkpoint at
any width (issue 25 item 7).

At 80 columns a row holds what a user scans for: the step, why retention keeps it
(current, pins, last, best, per 1h, every: the header spells each rule out), its age, its size, its
file count and its metrics; only the "kept because" and metrics columns give way (ending
in "…"), never the others. From ``WIDE`` columns on (and when stdout is not a terminal:
200 columns unless ``COLUMNS`` says otherwise) the row adds the commit time, the bytes it
owns and shares, the writer epoch and the commit id. Everything is in ``--json``.
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


def metrics_summary(metrics: Mapping[str, Any], metadata: Mapping[str, Any]) -> str:
    """``eval_loss=0.3124 accuracy=0.91 loss=1.254 epoch=3 note=baseline``: the metrics
    recorded with a checkpoint (its record's ``metrics``: ``push --metric``, ``save(...,
    metrics=)``, the integrations, ``watch``) first, then those of a ``metrics`` mapping in
    its metadata (where runs recorded them before metrics had a field of their own), then
    the rest of its metadata, leaving out the integrations' bookkeeping (``BOOKKEEPING``)
    and a false ``emergency`` flag."""
    parts = [f"{k}={format_value(v)}" for k, v in metrics.items()]
    legacy = metadata.get("metrics")
    if isinstance(legacy, Mapping):
        parts += [f"{k}={format_value(v)}" for k, v in legacy.items() if k not in metrics]
    for key, value in metadata.items():
        if key in BOOKKEEPING or (key == "metrics" and isinstance(legacy, Mapping)):
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


def kept_because(checkpoint: Mapping[str, Any]) -> str:
    """``current, last``, ``pin:best, best``, ``last, every, per 1h``: why retention keeps
    it, each rule of ``kept_because`` (``ls --json``) by its first word (the header spells
    the rules out: ``keep_last 3``, ``keep_best 1 by eval_loss``), a period rule as ``per
    PERIOD``, and ``pinned`` as each pin's label."""
    words: list[str] = []
    for reason in checkpoint["kept_because"]:
        if reason == "pinned":
            words += [f"pin:{label}" for label in checkpoint["pins"]] or ["pinned"]
        elif reason.startswith("one per "):
            words.append("per " + reason.split()[2])
        else:
            words.append(reason.split()[0])
    return ", ".join(words) or "(no rule: dropped at the next commit)"


def settings_line(settings: Mapping[str, Any]) -> str:
    """The run's retention and GC settings, as ``ls``'s header shows them (each rule of
    ``settings`` in ``ls --json``): ``keep_last 3 · keep_best 1 by eval_loss (min) · one
    per 1h for 1d · gc_grace 2h``."""
    from cloudckpt.retention import RetentionPolicy, format_duration

    policy = RetentionPolicy(
        keep_last=settings["keep_last"],
        keep_every=settings["keep_every"],
        keep_best=settings["keep_best"],
        best_metric=settings["best_metric"],
        best_mode=settings["best_mode"] or "min",
        keep_periods=tuple((p["period_s"], p["window_s"]) for p in settings["keep_periods"]),
    )
    return " · ".join([*policy.describe(), f"gc_grace {format_duration(settings['gc_grace_s'])}"])


def new_table() -> Any:
    """A rich table in the one style every table the CLI prints has (``ls``, ``runs``,
    ``show``'s files, ``verify``): a rule under the header, no frame, no padding at the
    edges, every column named."""
    from rich import box
    from rich.table import Table

    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)


def print_ls(console: Any, doc: Mapping[str, Any]) -> None:
    """``ls``'s header and table for ``doc`` (what ``ls --json`` prints, of a run that has
    checkpoints) on the rich ``console``."""
    from rich.text import Text

    now = time.time()
    wide = console.width >= WIDE
    w = doc["writer"]
    console.print(Text(doc["url"], style="bold"))
    console.print(f"writer epoch {w['epoch']} ({w['id']}) · LATEST seq {doc['seq']}")
    console.print(f"retention: {settings_line(doc['settings'])}", overflow="fold")
    checkpoints = doc["checkpoints"]
    summaries = [metrics_summary(c["metrics"], c["metadata"]) for c in checkpoints]
    table = new_table()
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
    table.add_column(
        "kept because", no_wrap=True, max_width=None if wide else 24, overflow="ellipsis"
    )
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
    from cloudckpt.canonical import parse_iso

    try:
        ago = age(now - parse_iso(c["committed_at"]).timestamp()) + " ago"
    except ValueError:
        ago = c["committed_at"]
    row = [str(c["step"]), kept_because(c)]
    row.append(f"{c['committed_at'][:16].replace('T', ' ')} ({ago})" if wide else ago)
    row.append(short_bytes(c["total_bytes"]))
    if wide:
        for key in ("owned_bytes", "shared_bytes"):
            row.append("" if c[key] is None else short_bytes(c[key]))
    row.append(str(c["num_files"]))
    if wide:
        row += [str(c["epoch"]), c["commit_id"]]
    return list(row)
