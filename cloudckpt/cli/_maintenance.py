"""The maintenance commands: ``verify``, ``pin``, ``unpin``, ``gc``, ``repair`` (a thin
layer over ``cloudckpt.verify``, ``admin``, ``gc`` and ``repair``; docs/cli.md)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import click

from cloudckpt.cli._common import (
    DAMAGED,
    DURATION,
    NEEDS_REPAIR,
    RUN_URL,
    StoreArgs,
    emit_json,
    human_bytes,
    json_option,
    progress_bar,
    stdout_console,
    store_options,
    warn,
)
from cloudckpt.cli._main import cli

if TYPE_CHECKING:
    from cloudckpt.gc import GCReport
    from cloudckpt.stores import RunURL


@cli.command("verify")
@click.argument("url", type=RUN_URL)
@click.option("--all", "all_", is_flag=True, help="Every retained checkpoint (default: current).")
@click.option("--read-data", is_flag=True, help="Read back and hash every byte.")
@store_options
@json_option
def verify_cmd(
    url: RunURL, all_: bool, read_data: bool, store_args: StoreArgs, as_json: bool
) -> None:
    """Check LATEST, manifests and objects; with --read-data every byte.

    Exit 0 if everything checked is intact, 4 if anything is damaged, 6 if LATEST is missing
    or damaged (run `cloudckpt repair`).
    """
    from cloudckpt.committer import read_latest
    from cloudckpt.protocol import CorruptRecordError
    from cloudckpt.verify import verify_run

    with store_args.open(url, writable=False) as store:
        total = None
        if read_data:
            with contextlib.suppress(CorruptRecordError):
                head = read_latest(store)
                if head is not None:
                    recs = head.latest.retained() if all_ else head.latest.retained()[:1]
                    total = sum(r.total_bytes for r in recs)
        with progress_bar("verifying", total) as progress:
            report = verify_run(store, all=all_, read_data=read_data, progress=progress)
    doc = report.to_dict()
    code = 0 if report.ok else NEEDS_REPAIR if report.needs_repair else DAMAGED
    doc["exit_code"] = code
    if as_json:
        emit_json(doc)
    else:
        _print_verify(report)
    if code:
        raise click.exceptions.Exit(code)


def _print_verify(report: Any) -> None:
    from cloudckpt.cli._table import new_table

    console = stdout_console()
    if report.latest_ok:
        console.print(f"LATEST  OK (seq {report.seq}, writer epoch {report.writer_epoch})")
    else:
        console.print(f"LATEST  [bold red]DAMAGED[/]: {report.latest_problem}")
        console.print(f"        checked the checkpoints {report.latest_source} describes")
        console.print("        run `cloudckpt repair URL` to rebuild LATEST")
    table = new_table()
    for col in ("step", "role", "status", "size", "details"):
        table.add_column(col, justify="right" if col in ("step", "size") else "left")
    for c in report.checkpoints:
        status = "[green]ok[/]" if c.ok else "[bold red]damaged[/]"
        details = (
            "; ".join(c.reasons)
            if c.reasons
            else (f"{human_bytes(c.bytes_read)} read and hashed" if report.read_data else "listed")
        )
        table.add_row(str(c.step), c.role, status, human_bytes(c.total_bytes), details)
    console.print(table)
    if report.all:
        console.print(
            f"commit records: {report.commit_records_checked} checked, "
            f"{len(report.commit_records_damaged)} damaged"
        )
        for d in report.commit_records_damaged:
            console.print(f"  [red]{d}[/]")
    for p in report.problems:
        console.print(f"[red]problem:[/] {p}")
    from rich.text import Text

    for w in report.warnings:  # user data (metric names): never read as markup
        console.print(Text.assemble(("warning: ", "yellow"), w))
    damaged = sum(not c.ok for c in report.checkpoints)
    depth = "every byte" if report.read_data else "manifests and object sizes"
    if report.ok:
        console.print(f"[green]all {len(report.checkpoints)} checkpoint(s) intact[/] ({depth})")
    elif damaged:
        console.print(
            f"[bold red]{damaged} of {len(report.checkpoints)} checkpoint(s) damaged[/]; "
            "`cloudckpt restore` skips damaged ones automatically"
        )


# ---------------------------------------------------------------------------- pin / unpin


def _pins_doc(store: Any, latest: Any, step: int) -> dict[str, Any]:
    return {
        "url": store.url,
        "step": step,
        "pins": [
            {"step": p.step, "label": p.label, "commit_id": p.commit_id, "pinned_at": p.pinned_at}
            for p in latest.pins
        ],
    }


@cli.command("pin")
@click.argument("url", type=RUN_URL)
@click.argument("step", type=int)
@click.option("--label", default="pinned", show_default=True, help="A name for the pin.")
@store_options
@json_option
def pin_cmd(url: RunURL, step: int, label: str, store_args: StoreArgs, as_json: bool) -> None:
    """Keep checkpoint STEP regardless of retention (safe while a trainer runs)."""
    from cloudckpt.admin import pin

    with store_args.open(url) as store:
        latest = pin(store, step, label)
    doc = _pins_doc(store, latest, step)
    doc["label"] = label
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"pinned step {step} of {store.url} as {label!r}")


@cli.command("unpin")
@click.argument("url", type=RUN_URL)
@click.argument("step", type=int)
@store_options
@json_option
def unpin_cmd(url: RunURL, step: int, store_args: StoreArgs, as_json: bool) -> None:
    """Remove the pins of STEP; retention then decides whether it stays."""
    from cloudckpt.admin import unpin

    with store_args.open(url) as store:
        latest = unpin(store, step)
    doc = _pins_doc(store, latest, step)
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"unpinned step {step} of {store.url}")


# ---------------------------------------------------------------------------- gc


@cli.command("gc")
@click.argument("url", type=RUN_URL)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (what would be deleted); delete and write nothing.",
)
@click.option(
    "--grace",
    type=DURATION,
    help="Minimum age (store clock) before unreferenced data goes, e.g. 30m, 2h, 1d. Never "
    "below the run's own gc_grace (default 2h).",
)
@store_options
@json_option
def gc_cmd(
    url: RunURL, dry_run: bool, grace: float | None, store_args: StoreArgs, as_json: bool
) -> None:
    """Delete checkpoint data nothing references, once older than the grace period.

    GC plans from one read of LATEST and one listing, then carries the plan out, checking
    again after each LATEST write of its own (what became referenced stays). --dry-run
    prints the plan and stops.
    """
    from cloudckpt.gc import execute_gc, plan_gc, preview_gc

    with store_args.open(url) as store:
        plan = plan_gc(store, grace_seconds=grace)
        report = preview_gc(plan) if dry_run else execute_gc(plan)
    if as_json:
        emit_json(_gc_doc(store.url, report))
    else:
        _print_gc(store.url, report, plan.ages())


def _gc_doc(url: str, report: GCReport) -> dict[str, Any]:
    return {
        "url": url,
        "dry_run": report.dry_run,
        "grace_seconds": report.grace_seconds,
        "store_now": report.store_now.isoformat(),
        "deleted_checkpoints": [{"step": s, "ckpt": c} for s, c in report.deleted_checkpoints],
        "deleted_orphans": list(report.deleted_orphans),
        "aborted_uploads": [{"key": k, "upload_id": u} for k, u in report.aborted_uploads],
        "deleted_commit_records": list(report.deleted_commit_records),
        "kept_young": list(report.kept_young),
        "deleted_objects": report.deleted_objects,
        "freed_bytes": report.freed_bytes,
    }


def _span(seconds: float) -> str:
    """``3h05m``, ``12m30s``, ``42s``: a store-clock age, two units at most."""
    s = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if s >= size:
            return f"{s // size}{unit}{(s % size) // sub_size:02d}{sub}"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


_GC_WRITES = {
    "gc-mark": "gc-mark: the dropped checkpoints become 'deleting' before their objects go",
    "gc-forget": "gc-forget: their tombstones leave LATEST once their objects are gone",
    "gc-sweep": "gc-sweep: fences commits in flight before orphans go",
}


def _print_gc(url: str, report: GCReport, ages: dict[str, float]) -> None:
    dry = report.dry_run
    verb = "would delete" if dry else "deleted"
    click.echo(f"gc {url} (grace {report.grace_seconds}s, store clock){' [dry run]' * dry}")
    if report.latest_seq is not None:
        click.echo(
            f"  plan from LATEST seq {report.latest_seq}, store clock {report.store_now.isoformat()}"
        )
    for s, c in report.deleted_checkpoints:
        click.echo(f"  {verb} dropped checkpoint step {s}: {c} (dropped {_span(ages[c])} ago)")
    for p in report.deleted_orphans:
        click.echo(f"  {verb} orphan attempt {p} (started {_span(ages[p])} ago)")
    for k, _ in report.aborted_uploads:
        click.echo(f"  {'would abort' if dry else 'aborted'} incomplete upload {k}")
    if report.deleted_commit_records:
        click.echo(f"  {verb} {len(report.deleted_commit_records)} old commit record(s)")
    if report.kept_young:
        click.echo(f"  kept {len(report.kept_young)} unreferenced attempt(s) younger than grace")
    for op in report.latest_writes:
        click.echo(f"  {'would write' if dry else 'wrote'} LATEST: {_GC_WRITES.get(op, op)}")
    size = human_bytes(report.freed_bytes)
    if dry:
        click.echo(
            f"would delete {report.deleted_objects} object(s), {size}; "
            "nothing was deleted or written (dry run)"
        )
    else:
        click.echo(f"{report.deleted_objects} object(s), {size} freed")


# ---------------------------------------------------------------------------- repair


def _describe_write(write: dict[str, str]) -> str:
    if write["mode"] == "compare-and-swap":
        return (
            f"{write['key']} by compare-and-swap against the damaged version read "
            f"({write['version']}): stops if it changed meanwhile"
        )
    if write["key"] == "LATEST":
        return "LATEST create-only: stops if anything created it meanwhile"
    return f"{write['key']} create-only"


@cli.command("repair")
@click.argument("url", type=RUN_URL)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (what would be rebuilt and written); write nothing.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Rebuild even though LATEST verifies (drops checkpoints whose manifests are gone and "
    "fences the current writer).",
)
@store_options
@json_option
def repair_cmd(
    url: RunURL, dry_run: bool, force: bool, store_args: StoreArgs, as_json: bool
) -> None:
    """Rebuild a missing or damaged LATEST from the commit records.

    The new LATEST comes from the newest commit record whose current checkpoint verifies,
    with a writer epoch above every epoch ever seen (so writers from before stay fenced).
    It is written conditionally; nothing is ever deleted.
    """
    from cloudckpt.repair import repair

    with store_args.open(url) as store:
        report = repair(store, force=force, dry_run=dry_run)
    if as_json:
        emit_json(report.to_dict())
        return
    if report.action == "healthy":
        click.echo(
            f"{store.url}: LATEST verifies (seq {report.seq}, writer epoch {report.epoch}); "
            "nothing to repair"
        )
        return
    if report.action == "empty":
        click.echo(f"{store.url}: nothing here (a new run); nothing to repair")
        return
    if report.latest_state == "ok":
        click.echo(f"{store.url}: LATEST verifies; rebuilding it anyway (--force)")
    else:
        click.echo(f"{store.url}: LATEST {report.latest_state}: {report.latest_problem}")
    click.echo(
        f"  found {report.commit_records} commit record(s) and {report.attempts} attempt(s); "
        f"highest epoch {report.highest_epoch_seen}, highest seq {report.highest_seq_seen}"
    )
    for p in report.passed_over:
        click.echo(f"  passed over {p['record']}: {p['reason']}")
    for d in report.dropped:
        click.echo(f"  dropped step {d['step']} ({d['commit_id']}): {d['reason']}")
    verb = "would rebuild" if dry_run else "rebuilt"
    click.echo(
        f"{verb} LATEST from {report.base}: seq {report.seq}, writer epoch {report.epoch}, "
        f"current step {report.current_step}, retained {report.retained_steps}"
    )
    for w in report.writes if dry_run else ():
        click.echo(f"  would write {_describe_write(w)}")
    if dry_run:
        click.echo("nothing was written (dry run)")
    if report.unreferenced_manifests:
        warn(
            f"{len(report.unreferenced_manifests)} attempt(s) with a complete manifest are not "
            "referenced and will be removed by GC after the grace period: "
            + ", ".join(report.unreferenced_manifests[:5])
        )
