"""``ls`` and ``show``: what a run holds, its checkpoints and one checkpoint's files
(a thin layer over ``cloudckpt.reader``; docs/cli.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from cloudckpt.cli._common import (
    RUN_URL,
    StoreArgs,
    emit_json,
    human_bytes,
    info,
    json_option,
    stdout_console,
    store_options,
    warn,
)
from cloudckpt.cli._main import cli
from cloudckpt.cli._retention import format_metrics
from cloudckpt.errors import CheckpointNotFoundError, CorruptionError, step_not_retained

if TYPE_CHECKING:
    from cloudckpt.stores import RunURL, Store


def _load_for_reading(store: Any) -> tuple[Any, bool]:
    """LATEST, or the newest commit record that verifies when it is missing or damaged
    (the library warns about that fallback, once; no second warning here).

    Raises: CorruptionError if LATEST is unreadable and no commit record verifies.
    """
    from cloudckpt.reader import load_latest_for_reading

    latest, from_records = load_latest_for_reading(store)
    if latest is None and from_records:
        raise CorruptionError(
            f"LATEST of {store.url} is unreadable and no commit record verifies",
            hint="Run `cloudckpt repair URL` to see what can be recovered",
        )
    return latest, from_records


def kept_reasons(latest: Any) -> dict[str, list[str]]:
    """Why LATEST keeps each retained checkpoint (``RetentionPolicy.reasons``: the rules
    the commits apply, so ``ls`` and its JSON say what retention itself decides)."""
    return latest.settings.retention.reasons(latest.current, latest.history, latest.pinned_ids())


def _record_dict(latest: Any, record: Any, reasons: dict[str, list[str]]) -> dict[str, Any]:
    return {
        "step": record.step,
        "commit_id": record.commit_id,
        "ckpt": record.ckpt,
        "epoch": record.epoch,
        "committed_at": record.committed_at,
        "num_files": record.num_files,
        "total_bytes": record.total_bytes,
        # Bytes under the checkpoint's own prefix, and bytes it names in older checkpoints'
        # (chunks); None for records written before chunks existed.
        "owned_bytes": record.owned_bytes,
        "shared_bytes": (
            None if record.owned_bytes is None else record.total_bytes - record.owned_bytes
        ),
        "current": latest.current is not None and latest.current.commit_id == record.commit_id,
        "pins": [p.label for p in latest.pins if p.commit_id == record.commit_id],
        "metadata": dict(record.metadata),
        # Numbers recorded with the checkpoint (keep-best ranks by them); NaN and
        # infinities as the strings "nan", "inf", "-inf".
        "metrics": dict(record.metrics),
        # The retention rules that keep it ([]: none does now, e.g. a LATEST rebuilt by
        # repair; the next commit drops it).
        "kept_because": list(reasons.get(record.commit_id, [])),
    }


def _file_dict(f: Any, ckpt: str) -> dict[str, Any]:
    d: dict[str, Any] = {"path": f.path, "size": f.size, "digest": f.digest}
    if f.chunks is not None:
        d["chunks"] = len(f.chunks)
        d["shared_chunks"] = sum(1 for c in f.chunks if c.owner != ckpt)
        d["shared_bytes"] = sum(c.size for c in f.chunks if c.owner != ckpt)
    return d


def _find_record(latest: Any, step: int | None, url: str, commit: str | None = None) -> Any:
    retained = latest.retained()
    if commit is not None:
        for record in retained:
            if record.commit_id == commit and step in (None, record.step):
                return record
        ids = ", ".join(f"{r.step}: {r.commit_id}" for r in retained) or "none"
        raise CheckpointNotFoundError(
            f"{url} retains no checkpoint with commit id {commit!r}"
            + ("" if step is None else f" at step {step}"),
            hint=f"Retained commits (step: commit id): {ids} (`cloudckpt ls URL --json`)",
        )
    if step is None:
        if latest.current is None:
            raise CheckpointNotFoundError(f"{url} has no committed checkpoint")
        return latest.current
    for record in retained:
        if record.step == step:
            return record
    raise step_not_retained(url, step, (r.step for r in retained))


# ---------------------------------------------------------------------------- ls


@cli.command("ls")
@click.argument("url", type=RUN_URL)
@store_options
@json_option
def ls_cmd(url: RunURL, store_args: StoreArgs, as_json: bool) -> None:
    """List the committed checkpoints of the run at URL, newest first."""
    with store_args.open(url, writable=False) as store:
        latest, from_records = _load_for_reading(store)
        below = _runs_below(store) if latest is None and not as_json else []
    doc = _ls_doc(store.url, latest, from_records)
    if as_json:
        emit_json(doc)
        return
    if below:
        shown = ", ".join(below[:5]) + (f" and {len(below) - 5} more" if len(below) > 5 else "")
        info(
            f"{store.url}: not a run, but it holds {len(below)} run(s) below it ({shown}); "
            f"list them with `cloudckpt runs {store.url}`"
        )
        return
    if latest is None:
        info(f"{store.url}: no checkpoints (nothing was ever committed here)")
        siblings = _sibling_runs(url, store_args)
        if siblings:  # a typo in the run's name, most likely: the exit code stays 0
            shown = ", ".join(siblings[:5]) + (
                f" and {len(siblings) - 5} more" if len(siblings) > 5 else ""
            )
            info(f"runs beside it: {shown} (did you mean one of them?)")
        return
    _print_ls(doc)
    for warning in doc["warnings"]:
        warn(warning)


#: How many directories beside a missing run ``ls`` looks into for runs.
_MAX_SIBLINGS = 50


def _sibling_runs(url: RunURL, store_args: StoreArgs) -> list[str]:
    """The URLs of the runs beside ``url`` (in its parent directory), the names closest to
    its own first: one listing and one existence check of LATEST per directory (at most
    ``_MAX_SIBLINGS``). Empty when ``url`` is at a bucket's root, or on any store error
    (a hint is not worth failing ``ls`` over)."""
    import difflib

    from cloudckpt.errors import CloudCkptError, redact_url
    from cloudckpt.protocol import LATEST_KEY
    from cloudckpt.stores import parse_url

    text = url.text.rstrip("/")
    if not url.prefix.strip("/") or "?" in text or "#" in text:
        return []
    parent_text, name = text.rsplit("/", 1)
    try:
        with store_args.open(parse_url(parent_text), writable=False) as parent:
            dirs = [d.rstrip("/") for d in parent.list_dirs("")[:_MAX_SIBLINGS]]
            runs = [d for d in dirs if d != name and parent.exists(f"{d}/{LATEST_KEY}")]
    except CloudCkptError:
        return []
    close = difflib.get_close_matches(name, runs, n=len(runs), cutoff=0.5)
    ordered = close + [r for r in runs if r not in close]
    return [f"{redact_url(parent_text)}/{r}" for r in ordered]


def _runs_below(store: Store) -> list[str]:
    """The paths of the runs up to two directories below ``store``'s root (for ``ls``
    pointed at a prefix of runs)."""
    from cloudckpt.catalog import list_runs

    return [r.path for r in list_runs(store, depth=2) if r.path]


def _ls_doc(url: str, latest: Any, from_records: bool) -> dict[str, Any]:
    """What ``ls --json`` prints: the run's writer, settings, checkpoints and tombstones."""
    if latest is None:
        return {
            "url": url,
            "seq": None,
            "writer": None,
            "settings": None,
            "from_commit_records": False,
            "warnings": [],
            "checkpoints": [],
            "tombstones": [],
        }
    reasons = kept_reasons(latest)
    return {
        "url": url,
        "seq": latest.seq,
        "writer": {
            "epoch": latest.writer.epoch,
            "id": latest.writer.id,
            "claimed_at": latest.writer.claimed_at,
        },
        "settings": _settings_doc(latest.settings),
        "from_commit_records": from_records,
        "warnings": retention_warnings(latest),
        "checkpoints": [_record_dict(latest, r, reasons) for r in latest.retained()],
        "tombstones": [
            {
                "step": t.record.step,
                "commit_id": t.record.commit_id,
                "ckpt": t.record.ckpt,
                "state": t.state,
                "dropped_seq": t.dropped_seq,
            }
            for t in latest.tombstones
        ],
    }


def retention_warnings(latest: Any) -> list[str]:
    """What ``ls`` and ``verify`` warn about the run's retention: checkpoints that record
    metrics but not the one keep-best ranks by (``retention.unranked``)."""
    from cloudckpt.retention import unranked

    warning = unranked(latest.settings.retention, latest.retained())
    return [] if warning is None else [warning]


def _settings_doc(settings: Any) -> dict[str, Any]:
    """A run's settings as ``ls --json`` shows them (every field, set or not)."""
    return {
        "keep_last": settings.keep_last,
        "keep_every": settings.keep_every,
        "gc_grace_s": settings.gc_grace_s,
        "keep_best": settings.keep_best,
        "best_metric": settings.best_metric,
        "best_mode": settings.best_mode if settings.keep_best is not None else None,
        "keep_periods": [
            {"period_s": period, "window_s": window} for period, window in settings.keep_periods
        ],
    }


def _print_ls(doc: dict[str, Any]) -> None:
    """``ls``'s table of checkpoints (of a run that has some): ``cli._table``."""
    from cloudckpt.cli._table import print_ls

    print_ls(stdout_console(), doc)


# ---------------------------------------------------------------------------- show


@cli.command("show")
@click.argument("url", type=RUN_URL)
@click.option("--step", type=int, help="Which checkpoint (default: the current one).")
@click.option(
    "--commit",
    metavar="ID",
    help="The checkpoint with this commit id (as `ls` shows it): where a step was "
    "committed more than once.",
)
@store_options
@json_option
def show_cmd(
    url: RunURL, step: int | None, commit: str | None, store_args: StoreArgs, as_json: bool
) -> None:
    """Show one checkpoint's record and manifest (its files, sizes and digests)."""
    from cloudckpt.reader import fetch_manifest

    with store_args.open(url, writable=False) as store:
        latest, _ = _load_for_reading(store)
        if latest is None:
            raise CheckpointNotFoundError(f"{store.url} has no committed checkpoint")
        record = _find_record(latest, step, store.url, commit)
        manifest = fetch_manifest(store, record)
    doc = _record_dict(latest, record, kept_reasons(latest))
    doc["url"] = store.url
    doc["manifest"] = {
        "writer_id": manifest.writer_id,
        "created_at": manifest.created_at,
        "algorithm": manifest.algorithm,
        "chunk_size": manifest.chunk_size,
        "total_bytes": manifest.total_bytes,
        "chunked": manifest.chunked,
        "owned_bytes": manifest.owned_bytes,
        "shared_bytes": manifest.total_bytes - manifest.owned_bytes,
        "files": [_file_dict(f, record.ckpt) for f in manifest.files],
    }
    if as_json:
        emit_json(doc)
        return
    from cloudckpt.cli._table import new_table

    console = stdout_console()
    console.print(f"step {doc['step']}{'  (current)' if doc['current'] else ''}")
    for key in ("commit_id", "ckpt", "epoch", "committed_at"):
        console.print(f"  {key:<13}{doc[key]}")
    console.print(f"  {'writer':<13}{manifest.writer_id}")
    console.print(
        f"  {'size':<13}{human_bytes(manifest.total_bytes)} in {len(manifest.files)} files"
    )
    m = doc["manifest"]
    console.print(
        f"  {'owns':<13}{human_bytes(m['owned_bytes'])}  shares "
        f"{human_bytes(m['shared_bytes'])} with older checkpoints"
        + ("" if m["chunked"] else "  (whole files, not chunked)")
    )
    if doc["pins"]:
        console.print(f"  {'pins':<13}{', '.join(doc['pins'])}")
    console.print(f"  {'kept because':<13}{', '.join(doc['kept_because']) or '(no rule)'}")
    if doc["metrics"]:
        console.print(f"  {'metrics':<13}{format_metrics(doc['metrics'])}")
    if doc["metadata"]:
        import json

        console.print(f"  {'metadata':<13}{json.dumps(doc['metadata'], sort_keys=True)}")
    table = new_table()
    table.add_column("path")
    table.add_column("size", justify="right")
    table.add_column("chunks (shared)", justify="right")
    table.add_column(f"digest ({manifest.algorithm})")
    for f, d in zip(manifest.files, m["files"], strict=True):
        chunks = "" if f.chunks is None else f"{len(f.chunks)} ({d['shared_chunks']})"
        table.add_row(f.path, human_bytes(f.size), chunks, f.digest)
    console.print(table)
