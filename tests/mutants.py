"""Deliberately broken variants of cloudckpt's safety rules, one per guard (issue 21, item 7).

Each mutant breaks one rule the way a plausible bug would. ``tests/test_mutations.py``
applies each one and checks that its guards notice: the fast tests named in ``guards``
fail, and, where the rule is reachable there, the simulation's invariant checker reports
a violation within ``seeds``. A guard that passes under its mutant guards nothing.

Apply one by hand: ``CLOUDCKPT_MUTANT=<name> pytest tests/...`` (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    rule: str  # the rule it breaks
    patch: Callable[[Callable[[Any, str, Any], None]], None]  # patch(setattr)
    guards: tuple[str, ...]  # fast tests that must fail under it
    seeds: range | None = None  # simulation seeds that must show a violation
    violation: str = ""  # text of that violation
    why_not_simulated: str = ""


# --------------------------------------------------------------------------- the patches


def _restore_scans_the_bucket(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A restore that, like tools that trust "the newest complete directory", also offers
    every attempt whose manifest is complete, committed or not, newest first."""
    from cloudckpt import attempt_layout, manifests, reader

    original = reader.load_latest_for_reading

    def scanning(store):
        latest, from_records = original(store)
        if latest is None:
            return latest, from_records
        known = {r.commit_id for r in latest.retained()}
        found = []
        for obj in store.list(attempt_layout.CKPT_PREFIX):
            if not obj.key.endswith(attempt_layout.MANIFEST_NAME):
                continue
            with contextlib.suppress(Exception):
                data, _ = store.get(obj.key)
                manifest = manifests.parse_manifest(data)
                if manifest.commit_id not in known:
                    found.append(manifest.record(data, store.now()))
        records = sorted([*latest.retained(), *found], key=lambda r: r.step, reverse=True)
        if not records:
            return latest, from_records
        return dataclasses.replace(latest, current=records[0], history=tuple(records[1:])), (
            from_records
        )

    setattr_(reader, "load_latest_for_reading", scanning)


def _gc_forgets_pending_tombstones(setattr_: Callable[[Any, str, Any], None]) -> None:
    """GC protects chunks named by retained checkpoints only, not by pending tombstones
    (which a pin may still bring back)."""
    from cloudckpt import chunks

    original = chunks.protected_chunk_keys

    def retained_only(store, latest, deleting=()):
        pending = {t.record.commit_id for t in latest.tombstones}
        return original(store, latest, {*deleting, *pending})

    setattr_(chunks, "protected_chunk_keys", retained_only)


def _manifest_not_checked_against_latest(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A manifest is accepted if it is well formed and sealed, whatever LATEST recorded."""
    from cloudckpt import manifests

    original = manifests.parse_manifest

    def unchecked(data, record=None):
        if record is not None:
            record = dataclasses.replace(
                record,
                manifest_size=len(data),
                manifest_sha256=__import__("hashlib").sha256(data).hexdigest(),
            )
        return original(data, record)

    setattr_(manifests, "parse_manifest", unchecked)


def _no_chunk_source_rule(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A save may name chunks of a checkpoint that left retention while it uploaded."""
    from cloudckpt import chunks

    setattr_(chunks.UploadStats, "requires", lambda self, base: None)


def _gc_does_not_sweep(setattr_: Callable[[Any, str, Any], None]) -> None:
    """GC deletes orphan attempts without first writing LATEST (no gc-sweep)."""
    from cloudckpt import protocol

    setattr_(protocol, "sweep", lambda base, now: None)


def _age_on_the_hosts_clock(setattr_: Callable[[Any, str, Any], None]) -> None:
    """An attempt's age measured on the host's monotonic clock (stops while suspended)."""
    from cloudckpt import attempts, committer
    from cloudckpt.errors import StaleAttemptError

    @dataclasses.dataclass(frozen=True)
    class HostClockAge(committer.AttemptAge):
        started: float = dataclasses.field(default_factory=lambda: time.monotonic())

        def check(self, store, step):
            if time.monotonic() - self.started > self.max_age_s:
                raise StaleAttemptError(f"step {step} is stale")
            return store.now()

    setattr_(attempts, "AttemptAge", HostClockAge)


def _reused_chunks_not_listed(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The pre-commit listing checks only the chunks this attempt uploaded."""
    from cloudckpt import chunks

    original = chunks.check_uploaded

    def own_only(store, prefix, entries):
        own = [
            dataclasses.replace(e, chunks=tuple(c for c in e.chunks if c.owner == prefix))
            for e in entries
            if e.chunks is not None
        ]
        original(store, prefix, own)

    setattr_(chunks, "check_uploaded", own_only)


def _whole_file_digest_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A whole file is accepted once every range arrived, without comparing its digest."""
    from cloudckpt import fetch

    original = fetch._File.root_ok

    def unchecked(self):
        return True if self.entry.chunks is None else original(self)

    setattr_(fetch._File, "root_ok", unchecked)


def _chunked_file_digest_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A chunked file is accepted once each chunk matches its name, whatever their order."""
    from cloudckpt import fetch

    original = fetch._File.root_ok

    def unchecked(self):
        return True if self.entry.chunks is not None else original(self)

    setattr_(fetch._File, "root_ok", unchecked)


def _resumed_chunks_age_unbounded(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A save that resumes an interrupted attempt's chunks is bounded by its own age
    only, not by the interrupted attempt's (which GC dates from its older birth)."""
    from cloudckpt import committer

    setattr_(committer.AttemptAge, "resuming", lambda self, born: self)


def _modes_unmasked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A restore applies whatever mode its manifest records."""
    from cloudckpt import restore

    setattr_(restore, "safe_mode", lambda mode, umask: mode)


def _retention_ignores_keep_best(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Retention that forgets the keep-best rule: only keep_last, keep_every, periods and
    pins keep a checkpoint."""
    from cloudckpt import retention

    setattr_(retention, "best", lambda candidates, metric, mode: [])


def _retention_ignores_periods(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Retention that forgets the one-per-period rule."""
    from cloudckpt import retention

    setattr_(retention, "one_per_period", lambda candidates, period, window: [])


def _committed_at_on_the_hosts_clock(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A commit dated by the host's clock instead of the store's (time-based retention
    then buckets by a clock that may be skewed, or stopped while the VM slept)."""
    import datetime as dt

    from cloudckpt import committer

    check = committer.AttemptAge.check

    def host_dated(self, store, step):
        check(self, store, step)
        return dt.datetime.now(dt.timezone.utc)

    setattr_(committer.AttemptAge, "check", host_dated)


_RETENTION = "tests/test_retention.py::"


def _copy_waits_for_no_other_stream(setattr_: Callable[[Any, str, Any], None]) -> None:
    """save_state copies from a CUDA device without waiting for the device's other
    streams (as it once waited for the current stream only)."""
    from cloudckpt.integrations import _device_copy

    setattr_(_device_copy, "wait_for_writers", lambda ops, devices: None)


def _upload_reads_ahead_of_the_copy(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The upload of save_state's host memory reads bytes the copy has not reached yet."""
    from cloudckpt.integrations import _device_copy

    setattr_(_device_copy.Watermark, "wait", lambda self, upto: None)


_COPY_TESTS = "tests/test_device_copy.py"
_WRONG_ORDER = "tests/test_restore.py::test_valid_chunks_in_the_wrong_order_never_restore"


def _memory_chunk_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A chunk read into memory is accepted without checking it against its name (its
    leaf digest is then taken from the manifest: nothing else notices)."""
    from cloudckpt import fetch

    setattr_(fetch, "_chunk_ok", lambda data, ref, *_: True)


def _memory_file_digest_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A whole file read into memory is accepted once every range landed."""
    from cloudckpt import fetch

    setattr_(fetch._File, "root_ok", lambda self: True)


def _local_copy_trusted(setattr_: Callable[[Any, str, Any], None]) -> None:
    """What a local copy fails to verify is not read again from the store (the copy is
    trusted once it was found)."""
    from cloudckpt import fetch

    original = fetch._run_local

    def trusting(reader, planned, local):
        original(reader, planned, local)
        for i in local:  # every unit counted as landed
            reader.files[i].missing = 0
        return []

    setattr_(fetch, "_run_local", trusting)


def _local_piece_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A chunk of a local copy, read and hashed piece by piece while its pieces are hot in
    cache, is accepted without comparing that hash with its name (its leaf digest is then
    taken from the manifest: nothing else notices)."""
    from cloudckpt import fetch

    setattr_(fetch, "_named", lambda leaves, data, ref: True)


def _local_workers_run_on(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The workers reading a kept copy go on taking units after one failed (the restore
    raised, and bytes keep landing behind it)."""
    import os
    import threading

    from cloudckpt import fetch

    def running_on(reader, units):
        ok = [False] * len(units)
        todo = iter(range(len(units)))
        lock = threading.Lock()

        def drain():
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                try:
                    ok[i] = fetch._local_unit(reader, units[i])
                except Exception:
                    continue

        workers = min(len(units), max(fetch.LOCAL_WORKERS_MIN, os.cpu_count() or 1))
        futures = [reader.engine.submit(drain) for _ in range(workers)]
        reader.engine.wait_all(futures)
        return ok

    setattr_(fetch, "_local_units", running_on)


def _cp_file_digest_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """`cp` commits once every chunk matched its name, without checking that they make up
    each file's recorded digest."""
    from cloudckpt import copying

    setattr_(copying, "_file_ok", lambda entry, leaves: True)


def _cp_reuses_dropped_chunks(setattr_: Callable[[Any, str, Any], None]) -> None:
    """`cp` names the destination's chunks of every checkpoint LATEST still records,
    dropped ones (pending tombstones, which GC will delete) included."""
    from cloudckpt import chunks, copying
    from cloudckpt.reader import fetch_manifest

    def every_recorded(writer):
        latest = writer.committer.latest
        records = [*latest.retained(), *(t.record for t in latest.tombstones)] if latest else []
        known = []
        for record in records:
            with contextlib.suppress(Exception):
                manifest = fetch_manifest(writer.store, record)
                known += [chunks._Known(c, manifest.commit_id)
                          for f in manifest.files for c in f.chunks or ()]  # fmt: skip
        return known

    setattr_(copying, "_retained_chunks", every_recorded)


def _export_into_runs(setattr_: Callable[[Any, str, Any], None]) -> None:
    """`export` checks only that its destination prefix is not itself a run (as it once
    did): a prefix inside a run, or one holding a run, is written with --force."""
    from cloudckpt import protocol
    from cloudckpt.catalog import export
    from cloudckpt.errors import DestinationNotEmptyError

    def prefix_only(out, overwrite):
        if out.exists(protocol.LATEST_KEY):
            raise DestinationNotEmptyError(f"{out.url} is a cloudckpt run")
        if next(iter(out.list("")), None) is not None and not overwrite:
            raise DestinationNotEmptyError(f"{out.url} is not empty")

    setattr_(export, "_check_export_destination", prefix_only)
    setattr_(export, "_refuse_runs_above", lambda dest, out, options: None)
    setattr_(export, "refuse_run_directories", lambda *args: None)


def _staging_deletes_unmarked_directories(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Start-up takes every directory under attempts/, committed/ and dcp/ for
    cloudckpt's, marker or not (and deletes those it cannot read)."""
    from cloudckpt import localcopy, staging

    def any_directory(path, name, entries):
        return path.is_dir()

    setattr_(staging, "own_directory", any_directory)
    setattr_(localcopy, "own_directory", any_directory)


def _retention_ignores_keep_every(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Retention that forgets the keep_every rule (milestones)."""
    from cloudckpt import retention

    kept = retention.RetentionPolicy.kept

    def without(self, current, history, pinned):
        return kept(dataclasses.replace(self, keep_every=None), current, history, pinned)

    setattr_(retention.RetentionPolicy, "kept", without)


def _retention_ignores_pins(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Retention that forgets pins (a pinned checkpoint is kept only if a rule keeps it)."""
    from cloudckpt import retention

    kept = retention.RetentionPolicy.kept
    setattr_(
        retention.RetentionPolicy,
        "kept",
        lambda self, current, history, pinned: kept(self, current, history, set()),
    )


def _retention_keep_last_off_by_one(setattr_: Callable[[Any, str, Any], None]) -> None:
    """keep_last=N keeps the newest N-1 (with the current one, N-1 at least 1)."""
    from cloudckpt import retention

    setattr_(
        retention, "newest", lambda candidates, n: candidates if n is None else candidates[: n - 1]
    )


def _raw_download(store: Any, ckpt: str, entry: Any, into: Any) -> None:
    """A file's bytes as the store holds them, unchecked (chunks concatenated)."""
    from cloudckpt import attempt_layout

    if entry.chunks is not None:
        data = b"".join(store.get(c.key)[0] for c in entry.chunks)
    else:
        data = store.get(ckpt + attempt_layout.FILES_DIR + entry.path)[0]
    target = into.joinpath(*entry.path.split("/"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _partial_restore_unverified(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A restore fetches the files it selected as the store holds them ("just these
    files"), with no digest check."""
    from cloudckpt import restore

    def raw(store, engine, record, manifest, rest, tmp, progress, clock):
        for entry in rest:
            _raw_download(store, record.ckpt, entry, tmp)

    setattr_(restore, "_download_rest", raw)


def _get_files_unverified(setattr_: Callable[[Any, str, Any], None]) -> None:
    """``get`` of several files writes them as the store holds them, unchecked."""
    from cloudckpt.catalog import get

    def raw(store, engine, record, entries, root, targets):
        out = []
        for entry, target in zip(entries, targets, strict=True):
            _raw_download(store, record.ckpt, entry, root)
            out.append(get.FileResult(entry.path, target, entry.size, entry.digest,
                                      entry.mode, record.step, record.commit_id))  # fmt: skip
        return out

    setattr_(get, "_download_into", raw)


def _copy_noop_by_step_only(setattr_: Callable[[Any, str, Any], None]) -> None:
    """``cp`` calls a checkpoint already copied when the destination retains its step,
    whatever that checkpoint holds."""
    from cloudckpt import copying

    def by_step(dst, latest, manifest, step):
        for record in latest.retained() if latest is not None else ():
            if record.step == step:
                return record
        return None

    setattr_(copying, "already_held", by_step)


def _copy_resets_destination_retention(setattr_: Callable[[Any, str, Any], None]) -> None:
    """``cp`` commits with the default keep-best and periods (it inherits only keep_last,
    keep_every and the grace period from the destination), dropping its best."""
    from cloudckpt import protocol
    from cloudckpt.catalog import copy as catalog_copy

    original = catalog_copy._copy_writer

    def partial_inherit(target, engine, writer_id, progress, settings):
        writer = original(target, engine, writer_id, progress, settings)
        if settings is None:
            writer.committer._inherit = frozenset({"keep_last", "keep_every", "gc_grace_s"})
            writer.committer.settings = protocol.Settings()
        return writer

    setattr_(catalog_copy, "_copy_writer", partial_inherit)


def _restore_into_runs(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A restore that writes wherever it is told, a local run's directory included."""
    from cloudckpt import restore

    setattr_(restore, "refuse_run_directories", lambda *args, **kwargs: None)


def _unranked_metric_unreported(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Nothing says that checkpoints lack the metric keep-best ranks by."""
    from cloudckpt import attempts, retention, verify

    for module in (retention, attempts, verify):
        setattr_(module, "unranked", lambda policy, records, saved=None: None)


_RESUME = "tests/test_resume_state.py"
_CP_GUARDS = "tests/test_copy_guards.py"
_STAGING = "tests/test_staging_dedicated.py"
_DCP = "tests/test_dcp.py"
_CATALOG = "tests/test_catalog.py::"
_COPY = "tests/test_copy.py::"
_NOT_SIMULATED_CATALOG = (
    "the simulation's actors save, restore whole checkpoints and collect garbage; they run "
    "no partial reads or copies between runs"
)

MUTANTS = {
    m.name: m
    for m in [
        Mutant(
            "restore-scans-the-bucket",
            "a fallback never restores an uncommitted attempt, even one with a complete manifest",
            _restore_scans_the_bucket,
            ("tests/test_guards.py::test_fallback_never_restores_an_uncommitted_attempt",),
            range(0, 40),
            "never committed",
        ),
        Mutant(
            "gc-forgets-pending-tombstones",
            "GC keeps a chunk named only by a pending tombstone",
            _gc_forgets_pending_tombstones,
            ("tests/test_guards.py::test_gc_keeps_a_chunk_named_only_by_a_pending_tombstone",),
            # hits 1950 (python tools/mutation_scan.py; 100:1300 caught it at 120, 1208
            # before GC read every manifest before its first write)
            range(1940, 1960),
            "deleted chunk",
        ),
        Mutant(
            "manifest-not-checked-against-latest",
            "a manifest must match the digest and size LATEST recorded",
            _manifest_not_checked_against_latest,
            ("tests/test_guards.py::test_a_resealed_manifest_is_refused",),
            range(0, 20),
            "re-sealed manifest",
        ),
        Mutant(
            "no-chunk-source-rule",
            "a commit may name another checkpoint's chunks only while it is retained",
            _no_chunk_source_rule,
            # (test_a_save_whose_chunk_source_was_dropped_uploads_in_full guards the retry
            # after a refusal, not the rule: it replaces the rule with its own refusal.)
            ("tests/test_chunks.py::test_commit_refused_when_a_source_left_retention",),
            why_not_simulated=(
                "unreachable there today: a writer's chunk index holds the chunks of its own "
                "current checkpoint, which only its own next commit replaces (pins and "
                "unpins never drop the current one); the rule guards future index sources"
            ),
        ),
        Mutant(
            "gc-does-not-sweep",
            "GC writes LATEST (gc-sweep) before deleting orphan attempts",
            _gc_does_not_sweep,
            (
                "tests/test_simulation.py::test_a_commit_delayed_in_flight_cannot_land_after_gc_deleted_its_attempt",
            ),
            range(0, 300),
            "I7",
        ),
        Mutant(
            "age-on-the-hosts-clock",
            "an attempt's age is judged on the store's clock",
            _age_on_the_hosts_clock,
            ("tests/test_store_clock.py::test_a_suspended_host_cannot_commit_after_waking",),
            range(0, 400),
            "I7",
        ),
        Mutant(
            "reused-chunks-not-listed",
            "a commit never names a chunk that is not in the store",
            _reused_chunks_not_listed,
            (
                "tests/test_chunks.py::test_a_save_never_names_a_reused_chunk_that_is_gone",
                "tests/test_distributed.py::test_a_multi_rank_save_reuploads_a_reused_chunk_"
                "that_is_gone",
            ),
            why_not_simulated=(
                "in the simulation a chunk can go missing only through another broken rule; "
                "the fast test deletes one by hand"
            ),
        ),
        Mutant(
            "resumed-chunks-age-unbounded",
            "a commit names an interrupted attempt's chunks only while GC cannot own them",
            _resumed_chunks_age_unbounded,
            ("tests/test_resume.py::test_resumed_chunks_never_outlive_the_grace_period",),
            why_not_simulated=(
                "reachable but rare there (no seed of 0:1200): GC must sweep while the "
                "interrupted attempt is older than grace and the resuming save is still "
                "younger than its bound; the checker holds the rule (I7, a commit naming "
                "chunks of an attempt GC swept as old) and the fast guard stages the race"
            ),
        ),
        Mutant(
            "modes-unmasked",
            "a restore never gives a file setuid, setgid, sticky or bits the umask removes",
            _modes_unmasked,
            ("tests/test_modes.py::test_a_manifest_cannot_set_special_bits_or_defeat_the_umask",),
            why_not_simulated=(
                "the simulation's writers record the modes of their own staged files; the "
                "fast test forges a manifest with setuid, setgid, sticky and world-write bits"
            ),
        ),
        Mutant(
            "whole-file-digest-unchecked",
            "a whole file is restored only if it matches its recorded digest",
            _whole_file_digest_unchecked,
            (
                f"{_WRONG_ORDER}[whole files' digests swapped-memory]",
                f"{_WRONG_ORDER}[whole files' digests swapped-s3]",
                "tests/test_guards.py::test_a_damaged_whole_file_falls_back",
            ),
            range(0, 100),
            "bytes that are not its checkpoint's",
        ),
        Mutant(
            "chunked-file-digest-unchecked",
            "a chunked file is restored only if its chunks make up its recorded digest",
            _chunked_file_digest_unchecked,
            tuple(
                f"{_WRONG_ORDER}[{case}-{backend}]"
                for case in (
                    "chunks of two files swapped",
                    "two chunks inside one leaf swapped",
                    "two whole leaves swapped",
                )
                for backend in ("memory", "s3")
            ),
            range(0, 100),
            "consistent forgery",
        ),
        Mutant(
            "retention-ignores-keep-best",
            "a checkpoint among the best keep_best by its metric is never dropped",
            _retention_ignores_keep_best,
            (
                f"{_RETENTION}test_keep_best_keeps_the_best_beside_the_newest",
                f"{_RETENTION}test_the_kept_set_is_exactly_the_union_of_the_rules",
                f"{_RETENTION}test_the_manager_keeps_the_best_and_a_new_host_restores_it[s3]",
            ),
            range(0, 40),
            "while among the best",
        ),
        Mutant(
            "retention-ignores-periods",
            "the newest checkpoint of each period in the window is never dropped",
            _retention_ignores_periods,
            (
                f"{_RETENTION}test_one_per_hour_for_the_last_day",
                f"{_RETENTION}test_the_kept_set_is_exactly_the_union_of_the_rules",
                f"{_RETENTION}test_committed_at_and_periods_are_on_the_stores_clock",
            ),
            range(0, 40),
            "the only checkpoint of its",
        ),
        Mutant(
            "committed-at-on-the-hosts-clock",
            "a commit is dated (committed_at) by the store's clock",
            _committed_at_on_the_hosts_clock,
            (f"{_RETENTION}test_committed_at_and_periods_are_on_the_stores_clock",),
            range(0, 5),
            "not the store's time",
        ),
        Mutant(
            "copy-waits-for-no-other-stream",
            "a copy from a CUDA device waits for every stream of the device first",
            _copy_waits_for_no_other_stream,
            (
                f"{_COPY_TESTS}::test_every_stream_is_waited_for_then_pieces_land_in_order_behind_the_watermark",
                f"{_COPY_TESTS}::test_the_upload_reads_the_first_pieces_while_later_ones_are_still_copying",
            ),
            why_not_simulated="the simulation saves files, not tensors on a device",
        ),
        Mutant(
            "upload-reads-ahead-of-the-copy",
            "save_state's upload reads host memory only where the copy has landed",
            _upload_reads_ahead_of_the_copy,
            (
                f"{_COPY_TESTS}::test_every_stream_is_waited_for_then_pieces_land_in_order_behind_the_watermark",
                f"{_COPY_TESTS}::test_the_upload_reads_the_first_pieces_while_later_ones_are_still_copying",
                f"{_COPY_TESTS}::test_a_failed_copy_stops_the_readers_and_leaves_no_copy_running",
            ),
            why_not_simulated="the simulation saves files, not tensors on a device",
        ),
        Mutant(
            "memory-chunk-unchecked",
            "a chunk read into memory is used only if it matches its SHA-256",
            _memory_chunk_unchecked,
            # (chunking="fixed": every leaf one chunk, so nothing but the chunk's own check
            # can notice; where a leaf is cut, its recomputed digest notices too.)
            (
                f"{_RESUME}::test_a_flipped_byte_falls_back_and_no_damaged_tensor_reaches_the_"
                "caller[fixed]",
                f"{_DCP}::test_the_reader_verifies_what_it_reads[tensor]",
            ),
            # The one read engine (issue 29): a restore into a directory reads the same way.
            range(0, 20),
            "bytes that are not its checkpoint's",
        ),
        Mutant(
            "memory-file-digest-unchecked",
            "a whole file read into memory is used only if it matches its recorded digest",
            _memory_file_digest_unchecked,
            (
                f"{_RESUME}::test_a_flipped_byte_falls_back_and_no_damaged_tensor_reaches_the_"
                "caller[off]",
                f"{_DCP}::test_the_reader_verifies_what_it_reads[off]",
            ),
            range(0, 20),
            "bytes that are not its checkpoint's",
        ),
        Mutant(
            "local-copy-trusted",
            "a local copy is used only where it verifies; the rest is read from the store",
            _local_copy_trusted,
            tuple(
                f"{_RESUME}::test_a_damaged_local_copy_is_never_used[{damage}]"
                for damage in ("flip", "truncate", "other-step")
            ),
            why_not_simulated=(
                "the simulation's hosts keep no staging directory between crashes; the fast "
                "tests damage a kept copy by hand"
            ),
        ),
        Mutant(
            "local-piece-unchecked",
            "a kept local copy's chunk, hashed piece by piece as it is read, is used only if "
            "that hash is its name",
            _local_piece_unchecked,
            # (Its chunks are its leaves, so nothing but the chunk's own check can notice;
            # the one read engine checks a copy restored into memory the same way.)
            tuple(
                "tests/test_local_restore.py::test_kept_copy_hashing_threads_and_a_flipped_"
                f"byte_is_still_caught[{cores}]"
                for cores in (2, 64)
            ),
            why_not_simulated=(
                "the simulation's hosts keep no staging directory between crashes; the fast "
                "tests damage a kept copy by hand"
            ),
        ),
        Mutant(
            "local-workers-run-on",
            "the workers reading a kept copy take no further unit once one failed",
            _local_workers_run_on,
            (
                "tests/test_local_restore.py::test_a_failed_unit_of_a_kept_copy_stops_the_"
                "other_workers",
            ),
            why_not_simulated="the simulation's hosts keep no staging directory between crashes",
        ),
        Mutant(
            "cp-file-digest-unchecked",
            "cp commits a file only once its bytes make up its recorded digest",
            _cp_file_digest_unchecked,
            tuple(
                f"{_CP_GUARDS}::test_cp_never_commits_files_that_do_not_match_their_digests"
                f"[{case}-{backend}]"
                for case in (
                    "chunks of two files swapped",
                    "two chunks inside one leaf swapped",
                    "two whole leaves swapped",
                    "whole files' digests swapped",
                )
                for backend in ("memory", "s3")
            ),
            why_not_simulated="the simulation has no copying actor; the fast tests forge "
            "consistent manifests by hand",
        ),
        Mutant(
            "cp-reuses-dropped-chunks",
            "cp names a destination chunk only if a checkpoint the destination retains names it",
            _cp_reuses_dropped_chunks,
            (f"{_CP_GUARDS}::test_cp_names_only_chunks_of_checkpoints_the_destination_retains",),
            why_not_simulated="the simulation has no copying actor (and the commit rule "
            "refuses the copy's first attempt there: the guard sees the wasted attempt)",
        ),
        Mutant(
            "export-into-runs",
            "export never writes inside a run, nor over one",
            _export_into_runs,
            tuple(
                f"tests/test_export_into_runs.py::{t}"
                for t in (
                    "test_export_into_or_over_a_local_run_is_refused",
                    "test_export_into_or_over_a_run_on_s3_is_refused",
                    "test_the_python_api_refuses_a_prefix_inside_a_run[1]",
                    "test_the_python_api_refuses_a_prefix_inside_a_run[3]",
                )
            ),
            why_not_simulated="the simulation does not export",
        ),
        Mutant(
            "staging-deletes-unmarked-directories",
            "a manager deletes only directories of its staging directory that cloudckpt wrote",
            _staging_deletes_unmarked_directories,
            (
                f"{_STAGING}::test_a_staging_directory_with_the_users_directories_is_refused_"
                "and_nothing_deleted",
                f"{_STAGING}::test_push_refuses_such_a_staging_directory_with_a_hint",
            ),
            why_not_simulated="the simulation's hosts keep no staging directory between "
            "crashes; the fast tests put the user's directories there",
        ),
        Mutant(
            "retention-ignores-keep-every",
            "a checkpoint whose step is a multiple of keep_every is never dropped",
            _retention_ignores_keep_every,
            (
                f"{_RETENTION}test_periods_combine_with_keep_last_and_every_and_pins",
                f"{_RETENTION}test_the_kept_set_is_exactly_the_union_of_the_rules",
            ),
            range(0, 40),  # hits 6, 8, 10 (python tools/mutation_scan.py)
            "milestone step",
        ),
        Mutant(
            "retention-ignores-pins",
            "a pinned checkpoint is never dropped",
            _retention_ignores_pins,
            (
                f"{_RETENTION}test_periods_combine_with_keep_last_and_every_and_pins",
                f"{_RETENTION}test_the_kept_set_is_exactly_the_union_of_the_rules",
            ),
            range(0, 40),  # hits 7, 15, 19
            "pinned",
        ),
        Mutant(
            "retention-keep-last-off-by-one",
            "the newest keep_last checkpoints are never dropped",
            _retention_keep_last_off_by_one,
            (f"{_RETENTION}test_the_kept_set_is_exactly_the_union_of_the_rules",),
            range(0, 40),  # hits 7, 21, 34
            "dropped with only",
        ),
        Mutant(
            "partial-restore-unverified",
            "a partial restore (include/exclude) verifies every file it selects",
            _partial_restore_unverified,
            tuple(
                f"tests/test_restore.py::test_a_partial_restore_reads_only_what_it_selects_"
                f"and_verifies_it[{chunking}]"
                for chunking in ("tensor", "off")
            ),
            why_not_simulated=_NOT_SIMULATED_CATALOG,
        ),
        Mutant(
            "get-files-unverified",
            "get of several files (or a glob) verifies every file before it appears",
            _get_files_unverified,
            (f"{_CATALOG}test_get_files_falls_back_when_a_selected_file_is_damaged",),
            why_not_simulated=_NOT_SIMULATED_CATALOG,
        ),
        Mutant(
            "copy-noop-by-step-only",
            "cp skips a copy only when the destination holds the same content as that step",
            _copy_noop_by_step_only,
            (f"{_COPY}test_copying_the_same_checkpoint_twice_commits_it_once",),
            why_not_simulated=_NOT_SIMULATED_CATALOG,
        ),
        Mutant(
            "copy-resets-destination-retention",
            "cp keeps every retention rule of the destination (its best checkpoint too)",
            _copy_resets_destination_retention,
            (f"{_COPY}test_cp_keeps_metrics_and_retention_and_carries_the_sources_on_request",),
            why_not_simulated=_NOT_SIMULATED_CATALOG,
        ),
        Mutant(
            "unranked-metric-unreported",
            "a keep-best metric the checkpoints lack is reported (save, ls, verify)",
            _unranked_metric_unreported,
            (
                f"{_RETENTION}test_a_save_without_the_ranked_metric_warns_once_naming_what_it_"
                "records",
                "tests/test_cli_retention.py::test_a_mistyped_best_metric_is_reported_by_push_"
                "watch_ls_and_verify",
            ),
            why_not_simulated="the simulation checks what is kept, not what is reported",
        ),
        Mutant(
            "restore-into-runs",
            "a restore never writes into, over or around a file:// run's directory",
            _restore_into_runs,
            ("tests/test_restore.py::test_restore_never_writes_into_or_over_a_local_run",),
            why_not_simulated="the simulation restores into memory, not into directories",
        ),
    ]
}


# --------------------------------------------------------------------------- issue 28, items 6-8
# The local tier, load_state's header and the DCP partial read (a block of their own).


def _header_judged_from_one_read(setattr_: Callable[[Any, str, Any], None]) -> None:
    """``load_state`` judges a checkpoint by its first header read: a damaged local copy or
    one garbled response (a header that is not sane, or not the verified file's) counts as
    a damaged checkpoint."""
    from cloudckpt import reader
    from cloudckpt.errors import CorruptionError, UnsafePathError
    from cloudckpt.integrations import _torch_restore as tr

    def one_read(self, prefix, entry, copy, manifest, stats):
        read = lambda n: self._read_head(prefix, entry, copy, n, stats)  # noqa: E731
        return tr._header_bytes(read, entry.size, self.dtypes)

    def no_second_read(self, record):
        try:
            return self._load(record, verified_head=False)
        except tr._HeaderMoved:
            return reader.Damaged("the header of tensors.safetensors changed")
        except (CorruptionError, UnsafePathError) as exc:
            return reader.Damaged.of(exc)

    setattr_(tr._Loader, "_head", one_read)
    setattr_(tr._Loader, "try_one", no_second_read)


def _local_copy_unverified(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A restore into a directory keeps every file it took from the kept copy, unverified."""
    from cloudckpt import fetch

    setattr_(fetch, "verify_local", lambda engine, jobs, **kw: [j.local is not None for j in jobs])


def _local_manifest_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The manifest kept with a local copy is used if it parses, whatever LATEST recorded."""
    from cloudckpt import localcopy, manifests
    from cloudckpt.errors import CloudCkptError

    def any_manifest(self, record):
        try:
            return manifests.parse_manifest((self.dir / localcopy.MANIFEST).read_bytes())
        except (OSError, CloudCkptError):
            return None

    setattr_(localcopy.LocalCopy, "manifest", any_manifest)


def _local_tier_links(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A restore hard-links the kept copy's files, asked to or not."""
    from cloudckpt import restore

    original = restore.place_file
    setattr_(
        restore,
        "place_file",
        lambda source, target, *, link=False: original(source, target, link=True),
    )


def _local_tier_takes_any_file(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A restore takes whatever the kept copy holds under a file's name, following links."""
    import shutil

    from cloudckpt import restore

    def any_file(source, target, *, link=False):
        try:
            shutil.copyfile(source, target)  # follows a symbolic link, opens anything
        except FileNotFoundError:
            return None
        return "copy"

    setattr_(restore, "place_file", any_file)


def _dcp_applies_before_verify(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The DCP reader applies each window as it verifies, before the later ones are read."""
    from cloudckpt.integrations import dcp

    setattr_(dcp.CloudStorageReader, "_verify_batches", lambda self, batches, by_path, stats: None)


def _dcp_chunk_list_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A partial read trusts the manifest's chunk list to make up the file (each chunk is
    still checked against its name)."""
    from cloudckpt import fetch

    original = fetch.manifest_root

    def trusting(entry):
        return None if original(entry) is None else entry.digest

    setattr_(fetch, "manifest_root", trusting)


_HEADER = "tests/test_header_reads.py::"
_LOCAL = "tests/test_local_restore.py::"
_NOT_SIMULATED_LOCAL = (
    "the simulation's hosts keep no staging directory between crashes and restore into "
    "directories only; the fast tests damage a kept copy by hand"
)

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "header-judged-from-one-read",
                "load_state judges a checkpoint by a verified header only (a bad local copy "
                "or one garbled response is read again from the store first)",
                _header_judged_from_one_read,
                (
                    *(
                        f"{_HEADER}test_a_damaged_header_in_the_local_copy_is_read_from_the_"
                        f"store[{how}]"
                        for how in ("length", "json", "other-header")
                    ),
                    *(
                        f"{_HEADER}test_a_garbled_header_response_is_read_again_before_"
                        f"judging[{how}-{chunking}]"
                        for how in ("length", "json")
                        for chunking in ("tensor", "off")
                    ),
                ),
                why_not_simulated=_NOT_SIMULATED_LOCAL,
            ),
            Mutant(
                "local-copy-unverified",
                "a restore keeps a file of the kept copy only once its bytes verify",
                _local_copy_unverified,
                (
                    f"{_LOCAL}test_a_kept_file_that_does_not_verify_is_downloaded",
                    f"{_LOCAL}test_link_local_hard_links_on_request_and_an_edited_copy_is_"
                    "downloaded",
                ),
                why_not_simulated=_NOT_SIMULATED_LOCAL,
            ),
            Mutant(
                "local-manifest-unchecked",
                "the kept copy's manifest is used only if it is the one LATEST names",
                _local_manifest_unchecked,
                (f"{_LOCAL}test_a_kept_manifest_of_another_checkpoint_is_not_used",),
                why_not_simulated=_NOT_SIMULATED_LOCAL,
            ),
            Mutant(
                "local-tier-links",
                "restored files are independent of the kept copy (hard links only on request)",
                _local_tier_links,
                (f"{_LOCAL}test_two_restores_from_the_local_tier_are_independent",),
                why_not_simulated=_NOT_SIMULATED_LOCAL,
            ),
            Mutant(
                "local-tier-takes-any-file",
                "a restore takes only regular files of the kept copy, never following a link",
                _local_tier_takes_any_file,
                tuple(
                    f"{_LOCAL}test_only_regular_files_of_the_kept_copy_are_taken[{kind}]"
                    for kind in ("symlink", "fifo")
                ),
                why_not_simulated=_NOT_SIMULATED_LOCAL,
            ),
            Mutant(
                "dcp-applies-before-verify",
                "the DCP reader applies nothing before every window of the plan verified",
                _dcp_applies_before_verify,
                tuple(
                    f"{_DCP}::test_a_damaged_later_window_leaves_every_planned_tensor_"
                    f"untouched[{chunking}]"
                    for chunking in ("tensor", "fixed")
                ),
                why_not_simulated="the simulation's readers restore into directories",
            ),
            Mutant(
                "dcp-chunk-list-unchecked",
                "a DCP partial read checks the file's digest from the chunk list first",
                _dcp_chunk_list_unchecked,
                (f"{_DCP}::test_a_chunk_list_that_is_not_the_file_fails_the_load_untouched",),
                why_not_simulated="the simulation's readers restore whole files",
            ),
        ]
    }
)


# --------------------------------------------------------------------------- DeepSpeed (issue 32)


def _deepspeed_step_before_latest(setattr_: Callable[[Any, str, Any], None]) -> None:
    """watch takes a global_stepN/ before DeepSpeed's ``latest`` names it."""
    from cloudckpt import watch_layouts

    setattr_(watch_layouts, "_latest_names", lambda c: True)


def _deepspeed_missing_shard_taken(setattr_: Callable[[Any, str, Any], None]) -> None:
    """watch does not look for every rank's ZeRO shard (nor settles for them)."""
    import re

    from cloudckpt import watch_layouts

    setattr_(watch_layouts, "DS_SHARD", re.compile(r"(?!)"))


_DS_WATCH = "tests/test_watch.py::test_deepspeed_steps_are_taken_once_latest_names_them"
MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "deepspeed-step-before-latest",
                "watch uploads a DeepSpeed step only once `latest` names it (or a later one)",
                _deepspeed_step_before_latest,
                (_DS_WATCH,),
                why_not_simulated="the simulation has no sidecar",
            ),
            Mutant(
                "deepspeed-missing-shard-taken",
                "watch waits for every rank's ZeRO shard (0..R) and for them to settle",
                _deepspeed_missing_shard_taken,
                (_DS_WATCH,),
                why_not_simulated="the simulation has no sidecar",
            ),
        ]
    }
)


@contextlib.contextmanager
def applied(name: str) -> Iterator[Mutant]:
    """Apply mutant ``name`` for the duration of the block."""
    mutant = MUTANTS[name]
    undo: list[tuple[Any, str, Any]] = []

    def setattr_(obj: Any, attr: str, value: Any) -> None:
        undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    mutant.patch(setattr_)
    try:
        yield mutant
    finally:
        for obj, attr, value in reversed(undo):
            setattr(obj, attr, value)


# --------------------------------------------------------------------------- newer formats
# Issue 28, item 1: a format this version does not know is a newer version's, never damage
# (docs/design.md §3, "Format changes: the policy").

_NEWER = "tests/test_newer_format.py::"
_NEWER_GC_ATTEMPT = f"{_NEWER}test_gc_never_collects_what_a_newer_attempt_holds_or_names"
_NOT_SIMULATED_NEWER_MANIFEST = (
    "the simulation's newer version writes a newer LATEST (the pointer rule); a newer "
    "manifest under a LATEST this version reads is set up by tests/test_newer_format.py"
)


def _unknown_latest_as_damage(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A LATEST (or commit record) in a format this version does not know raises the
    error of a damaged one, as before issue 28."""
    from cloudckpt import protocol
    from cloudckpt.errors import CorruptRecordError, UnknownFormatError

    original = protocol.check_format  # where parse_latest looks it up

    def as_damage(body, family, known, what, kind):
        try:
            original(body, family, known, what, kind)
        except UnknownFormatError as exc:
            if family != "cloudckpt.latest/":
                raise
            raise CorruptRecordError(exc.message) from None

    setattr_(protocol, "check_format", as_damage)


def _unknown_record_skipped(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The reader's fallback over the commit records skips a newer record as if it were
    damaged, and reads the next older one."""
    import types

    from cloudckpt import protocol, reader
    from cloudckpt.errors import CorruptRecordError, UnknownFormatError

    def parse_latest(data, what="LATEST"):
        try:
            return protocol.parse_latest(data, what)
        except UnknownFormatError as exc:
            raise CorruptRecordError(exc.message) from None

    proxy = types.SimpleNamespace(**{**vars(protocol), "parse_latest": parse_latest})
    setattr_(reader, "protocol", proxy)


def _repair_over_unknown(setattr_: Callable[[Any, str, Any], None]) -> None:
    """repair takes a newer LATEST for a damaged one and passes over newer commit records,
    rebuilding from the newest record it can read (an older one)."""
    from cloudckpt import repair
    from cloudckpt.errors import CorruptRecordError, UnknownFormatError

    setattr_(repair, "CorruptRecordError", (CorruptRecordError, UnknownFormatError))


def _gc_over_unknown(setattr_: Callable[[Any, str, Any], None]) -> None:
    """GC takes a newer manifest for an unreadable one (keeps every chunk this time) and
    goes on deleting tombstones and orphans."""
    from cloudckpt import chunks
    from cloudckpt.errors import UnknownFormatError

    original = chunks.protected_chunk_keys

    def swallowing(store, latest, deleting=()):
        try:
            return original(store, latest, deleting)
        except UnknownFormatError:
            return None

    setattr_(chunks, "protected_chunk_keys", swallowing)


def _gc_writes_before_judging(setattr_: Callable[[Any, str, Any], None]) -> None:
    """GC reads the run's manifests only after its first LATEST edit (as before): a newer
    manifest stops it, but after it marked tombstones or deleted old records."""
    from cloudckpt import gc

    setattr_(gc, "_judge", lambda store, latest: None)


def _gc_collects_newer_by_name(setattr_: Callable[[Any, str, Any], None]) -> None:
    """GC deletes old commit records, orphan attempts and the chunks they hold by their
    names, without reading what format wrote them (as before the safety audit)."""
    from cloudckpt import gc

    setattr_(gc, "_judge_garbage", lambda plan: None)


def _autogc_error_ends_the_worker(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Automatic GC logs only cloudckpt's own errors (as before the safety audit): any
    other exception ends the thread it runs on, unlogged by GC (the save worker, before
    issue 31: later saves waited forever)."""
    from cloudckpt import autogc
    from cloudckpt.errors import CloudCkptError

    def collect(self: Any) -> None:
        try:
            autogc.collect_garbage(self.store)
        except CloudCkptError as exc:
            autogc.log.warning("background garbage collection failed: %s", exc)

    setattr_(autogc.AutoGC, "_collect", collect)


def _after_each_error_ends_the_worker(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The save worker calls its after-save hook (automatic GC) unguarded (as before issue
    32): an exception there ends the worker, and later saves never run."""
    from cloudckpt import savequeue

    def unguarded(self: Any, job: Any) -> bool:
        self._after_each()
        return True

    setattr_(savequeue.SaveQueue, "_after_save", unguarded)


def _stopped_worker_accepts_saves(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A worker stopped by a BaseException fails the saves queued, but takes new ones (as
    before issue 31): they are never run, and their result(), wait() and close() wait."""
    from cloudckpt import savequeue

    def fail_queued(self: Any, exc: BaseException) -> None:
        savequeue.log.critical("the save worker stopped: %r; queued saves fail with it", exc)
        with self._cv:
            self._inflight = None
            for queued in self._queue:
                queued.handle._future.set_exception(exc)
            self._queue.clear()
            self._cv.notify_all()

    setattr_(savequeue.SaveQueue, "_fail_queued", fail_queued)


def _gc_on_the_save_worker(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Automatic GC runs on the save worker, after the save (one host, before issue 31):
    a hung collection holds up every later save."""
    from cloudckpt import autogc

    def inline(self: Any) -> None:
        if not self.enabled or time.monotonic() - self._last < self.interval:
            return
        self._last = time.monotonic()
        self._collect()

    setattr_(autogc.AutoGC, "if_due", inline)


def _gc_stacked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A collection due while the last one still runs starts beside it: hung ones pile up."""
    import threading

    from cloudckpt import autogc

    def stacked(self: Any) -> None:
        if not self.enabled or time.monotonic() - self._last < self.interval:
            return
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    setattr_(autogc.AutoGC, "if_due", stacked)


def _gc_close_waits_forever(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The manager's close() waits for a running collection however long it takes."""
    from cloudckpt import autogc

    def close(self: Any, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join()

    setattr_(autogc.AutoGC, "close", close)


def _gc_close_ignores_the_timeout(setattr_: Callable[[Any, str, Any], None]) -> None:
    """close(timeout=...) waits for a running automatic GC up to CLOSE_WAIT_S whatever is
    left of the caller's timeout (as before this rule: up to 60 s past it)."""
    from cloudckpt import autogc

    original = autogc.AutoGC.close

    def close(self: Any, timeout: float | None = None) -> None:
        original(self, None)

    setattr_(autogc.AutoGC, "close", close)


def _gc_close_waits_the_whole_timeout(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A close(timeout=...) longer than CLOSE_WAIT_S is all given to a running automatic GC
    (a close with a long timeout for its saves hangs that long on a hung GC)."""
    from cloudckpt import autogc

    def close(self: Any, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(autogc.CLOSE_WAIT_S if timeout is None else max(0.0, timeout))

    setattr_(autogc.AutoGC, "close", close)


def _gc_crash_spares_the_saves(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A simulated crash in automatic GC ends only GC's thread; the saves go on, as no dead
    process would."""
    from cloudckpt import autogc
    from cloudckpt.errors import CloudCkptError

    def collect(self: Any) -> None:
        try:
            autogc.collect_garbage(self.store)
        except CloudCkptError as exc:
            autogc.log.warning("background garbage collection failed: %s", exc)
        except Exception as exc:
            autogc.log.error("background garbage collection failed: %r", exc)

    setattr_(autogc.AutoGC, "_collect", collect)


def _repair_past_newer_manifests(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Repair never reads the manifests its rebuilt LATEST leaves unreferenced (as before
    the safety audit): a newer version's commits, whose records are lost, are rolled back."""
    from cloudckpt import repair

    setattr_(repair, "_refuse_newer_manifests", lambda store, prefixes: None)


def _writer_over_unknown(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A save that cannot read the current manifest (a newer version's) uploads in full
    and commits over it, as before issue 28."""
    from cloudckpt import attempts

    class NeverRaised(Exception):
        pass

    setattr_(attempts, "UnknownFormatError", NeverRaised)


def _newer_journal_abandoned(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A staging journal in a newer format is taken for an unreadable one: the manager
    deletes that attempt at start-up."""
    from cloudckpt import staging

    setattr_(staging, "unknown_format", lambda *args: ValueError("unknown journal"))


# --- issue 32 items 8 and 10: fencing warnings, gc_grace at construction --------------------


def _fenced_writer_always_named(setattr_: Callable[[Any, str, Any], None]) -> None:
    """push and cp warn about every writer they fence, an exited earlier push's too."""
    from cloudckpt import admin

    setattr_(admin.WriterStatus, "may_be_live", property(lambda self: True))


def _gc_grace_unchecked_at_construction(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A manager accepts a gc_grace too short to commit under; the first save refuses it."""
    from cloudckpt import manager

    setattr_(manager, "check_grace", lambda grace, store: None)


_FIRST_HOUR = "tests/test_first_hour.py::"

# --------------------------------------------------------------------------- issue 28 #5
# Short reads: a cut answer is a transient error on every backend, a short answer is read
# again before a file is judged truncated, and wrappers forward the zero-copy read.


def _gcs_short_read_is_short(setattr_: Callable[[Any, str, Any], None]) -> None:
    """GCS's direct read returns what arrived when the connection closes cleanly mid-body
    (http.client reports a FIN as the end of the body): a cut answer passes for short."""
    from cloudckpt.stores import gcs

    def read_into(resp, buf, skip):
        while skip > 0:
            skipped = len(resp.read(min(skip, 1 << 20)))
            if not skipped:
                return 0
            skip -= skipped
        got = 0
        while got < len(buf):
            n = resp.readinto(buf[got:])
            if not n:
                break
            got += n
        return got

    setattr_(gcs, "_read_into", read_into)


def _azure_cut_not_transient(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Azure: a download the SDK gave up on mid-body is a plain StoreError, not retried."""
    from cloudckpt.stores import _azure_errors

    setattr_(_azure_errors, "_cut_short", lambda exc: False)


def _fsspec_cut_not_transient(setattr_: Callable[[Any, str, Any], None]) -> None:
    """fsspec (http://): an answer shorter than its Content-Length is a plain StoreError."""
    from cloudckpt.stores import fsspec_store

    setattr_(fsspec_store, "_cut_short", lambda exc: False)


def _short_read_judged_at_once(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A ranged read that answers short is taken for a short object at once."""
    from cloudckpt.transfer import TransferEngine

    def read_exact(self, store, key, start, view):
        return int(self._retry(lambda: store.get_range_into(key, start, view), f"download {key}"))

    setattr_(TransferEngine, "read_exact", read_exact)


def _runs_listing_passes_newer_runs(setattr_: Callable[[Any, str, Any], None]) -> None:
    """`runs` lists a run a newer version wrote and exits 0, as if the listing were whole."""
    from cloudckpt.cli import _catalog

    setattr_(_catalog, "_newer_runs_error", lambda runs: None)


def _fused_crc_misses_a_byte(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The CRC32C computed in the digest's pass leaves out the last byte: of a chunk
    (``leaf_and_crc32c``; each chunk of a leaf read block by block,
    ``leaf_and_pieces_as_read``) and of a part (``leaves_and_crc32c_as_read``)."""
    from cloudckpt import _crc32c, digest

    def short(view, start, n):
        return _crc32c.value(view[start : start + max(0, n - 1)])

    original = digest.leaf_and_crc32c

    def fused(chunk, algorithm=None, crc=0):
        view = memoryview(chunk).cast("B")
        leaf, _ = original(view, algorithm, crc)
        return leaf, original(view[: max(0, len(view) - 1)], algorithm, crc)[1]

    as_read = digest.leaves_and_crc32c_as_read

    def part(buf, read, chunk_size=digest.CHUNK_SIZE, algorithm=None):
        leaves, _ = as_read(buf, read, chunk_size, algorithm)
        view = memoryview(buf).cast("B")
        return leaves, short(view, 0, len(view))

    pieces_as_read = digest.leaf_and_pieces_as_read

    def pieces(buf, read, sizes, algorithm=None, *, crc32c=False):
        leaf, names, crcs = pieces_as_read(buf, read, sizes, algorithm, crc32c=crc32c)
        if crcs is not None:
            view, at, crcs = memoryview(buf).cast("B"), 0, []
            for n in sizes:
                crcs.append(short(view, at, n))
                at += n
        return leaf, names, crcs

    setattr_(digest, "leaf_and_crc32c", fused)
    setattr_(digest, "leaves_and_crc32c_as_read", part)
    setattr_(digest, "leaf_and_pieces_as_read", pieces)


def _block_hashed_before_read(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The one loop that reads a buffer block by block hands each block to the hashes
    before reading it into the reused buffer: a chunked save names each chunk (and CRCs
    it) by what the buffer held before (zeros, or another leaf's bytes), not by the bytes
    sent."""
    from cloudckpt import digest

    def blocks_as_read(buf, read, cuts=()):
        view = memoryview(buf).cast("B")
        pending = iter(cuts)
        cut = next(pending, None)
        for at in range(0, len(view), digest.FUSED_BLOCK):
            block = view[at : at + digest.FUSED_BLOCK]
            lo, end = at, at + len(block)
            while cut is not None and cut < end:
                if cut > lo:
                    yield lo, view[lo:cut]
                    lo = cut
                cut = next(pending, None)
            yield lo, view[lo:end]
            if read is not None:
                read(block, at)

    setattr_(digest, "blocks_as_read", blocks_as_read)


def _dedup_names_before_read(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A multi-rank save's naming pass (``chunk_names``, cross-rank dedup) hashes each
    leaf's reused buffer before the blocks are read into it: the names it sends in the
    plan are of what the buffer held before (zeros, another leaf), not of the chunks the
    upload then puts, so owners are chosen for chunks nobody holds and shared chunks are
    put by every holder (or a rank names a chunk that is not its own)."""
    from cloudckpt import digest

    original = digest.pieces_as_read

    def named_first(buf, read, sizes, algorithm=None):
        names = original(buf, None, sizes, algorithm)  # the buffer as it is
        if read is not None:
            view = memoryview(buf).cast("B")
            for at in range(0, len(view), digest.FUSED_BLOCK):
                read(view[at : at + digest.FUSED_BLOCK], at)
        return names

    setattr_(digest, "pieces_as_read", named_first)


def _cut_inside_a_block_ignored(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A chunk cut (a tensor's start or end) inside a 1 MiB block is ignored: the block
    goes whole to the chunk it starts in, so that chunk is named (and CRC'd) by bytes of
    its neighbour too, and its neighbour by fewer than its own."""
    from cloudckpt import digest

    original = digest.blocks_as_read

    def blocks_as_read(buf, read, cuts=()):
        return original(buf, read, [c for c in cuts if c % digest.FUSED_BLOCK == 0])

    setattr_(digest, "blocks_as_read", blocks_as_read)


def _part_hashed_before_read(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The one pass over a part read block by block hashes and CRCs each block before the
    block is read into the reused buffer: the leaves and the CRC are of what the buffer held
    before (zeros, or another part's bytes), not of the bytes sent."""
    from cloudckpt import _crc32c, digest

    def as_read(buf, read, chunk_size=digest.CHUNK_SIZE, algorithm=None):
        view = memoryview(buf).cast("B")
        leaves, crc = [], 0
        for start in range(0, len(view), chunk_size):
            chunk = view[start : start + chunk_size]
            h = digest.hasher(algorithm)
            for i in range(0, len(chunk), digest.FUSED_BLOCK):
                block = chunk[i : i + digest.FUSED_BLOCK]
                h.update(block)
                crc = _crc32c.extend(crc, block)
                read(block, start + i)
            leaves.append(h.digest())
        return leaves, crc

    setattr_(digest, "leaves_and_crc32c_as_read", as_read)


def _populate_rounds_outward(setattr_: Callable[[Any, str, Any], None]) -> None:
    """``populate`` maps the pages a range only partly covers too: the edge pages may be
    another object's memory (a neighbouring tensor's, the allocator's)."""
    import mmap

    from cloudckpt.integrations import _torch_restore as tr

    original = tr.populate

    def outward(address: int, nbytes: int) -> None:
        page = mmap.PAGESIZE
        lo = address // page * page
        original(lo, -(-(address + nbytes) // page) * page - lo)

    setattr_(tr, "populate", outward)


def _restore_tensors_pooled(setattr_: Callable[[Any, str, Any], None]) -> None:
    """New host tensors are carved from a kept buffer per size, reused by the next load (a
    pool, as the engine's read buffers are): a second load overwrites the tensors the first
    one returned."""
    from cloudckpt.integrations import _torch_restore as tr

    kept: dict[tuple[Any, ...], Any] = {}
    original = tr.new_host_tensor

    def pooled(shape, dtype):
        key = (tuple(shape), dtype)
        if key not in kept:
            kept[key] = original(shape, dtype)
        return kept[key]

    setattr_(tr, "new_host_tensor", pooled)


def _short_judged_by_the_answers(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Answers short on every retry are taken for a short object without asking the store
    the object's size (as before simulation seed 1430): a proxy that cuts every answer
    makes an intact checkpoint look truncated."""
    from cloudckpt import transfer
    from cloudckpt.errors import TransientStoreError

    def read_exact(retry, store, key, start, view):
        short: list[int | None] = [None]

        def once() -> int:
            short[0] = None
            got = store.get_range_into(key, start, view)
            if got < len(view):
                short[0] = got
                raise TransientStoreError(f"{key}: {got} of {len(view)} bytes")
            return got

        try:
            return int(retry(once, f"download {key}"))
        except TransientStoreError:
            if short[0] is None:
                raise
            return short[0]

    setattr_(transfer, "read_exact", read_exact)


def _wrapper_drops_get_range_into(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A forwarding wrapper inherits ``Store``'s copying ``get_range_into`` instead of
    forwarding it: the inner store's zero-copy read goes unused behind every wrapper."""
    from cloudckpt.stores.base import Store
    from cloudckpt.testing.wrappers import ForwardingStore

    setattr_(ForwardingStore, "get_range_into", Store.get_range_into)


def _faults_skip_get_range_into(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The fault injector forwards ``get_range_into`` untouched: its rules never reach
    the zero-copy read path (as before issue 28)."""
    from cloudckpt.testing.faults import FaultInjectingStore
    from cloudckpt.testing.wrappers import ForwardingStore

    setattr_(FaultInjectingStore, "get_range_into", ForwardingStore.get_range_into)


_CUT = "tests/test_store_conformance.py::test_a_cut_response_is_transient_on_every_backend"
_SHORT = "tests/test_short_reads.py::"
_HOT = "tests/test_chunks_hot.py::"
_NOT_SIMULATED_STORES = "the simulation runs on the memory store; real backends are not in it"

# --------------------------------------------------------------------------- digests (issue 31)


def _digest_algorithm_ignored(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Every hash is the one new checkpoints use, whatever the manifest's algorithm: a
    SHA-256 checkpoint is checked with BLAKE3 (a reader that forgot to pass it on)."""
    from cloudckpt import digest

    original = digest.hasher

    def writing_algorithm(algorithm=None, size_hint=0):
        return original(None, size_hint)

    setattr_(digest, "hasher", writing_algorithm)


def _unknown_digest_is_damage(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A digest this version does not know is reported as damage (CorruptRecordError), as
    before BLAKE3: a restore falls back past a newer writer's checkpoint."""
    from cloudckpt import digest
    from cloudckpt.errors import CorruptRecordError, UnknownFormatError

    original = digest.check

    def as_damage(algorithm, what=""):
        try:
            return original(algorithm, what)
        except UnknownFormatError as exc:
            raise CorruptRecordError(exc.message) from None

    setattr_(digest, "check", as_damage)


def _latest_format_ignores_digest(setattr_: Callable[[Any, str, Any], None]) -> None:
    """LATEST keeps an older format when it names BLAKE3 checkpoints: an older reader
    opens their manifests and takes them for damage."""
    from cloudckpt import formats, protocol

    def older(self):
        records = [*self.retained(), *(t.record for t in self.tombstones)]
        if self.settings.retention.extended or any(r.metrics for r in records):
            return formats.LATEST_FORMAT_RETENTION
        return formats.LATEST_FORMAT

    setattr_(protocol.Latest, "format", property(older))


_DIGESTS = "tests/test_digest_algorithms.py::"
_NOT_SIMULATED_DIGESTS = (
    "the simulation's writers all save with the one digest new checkpoints use; SHA-256 "
    "runs, unknown digests and older readers are set up by the fast tests"
)

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "unknown-latest-as-damage",
                "a LATEST in a format this version does not know is refused, not damage",
                _unknown_latest_as_damage,
                (
                    f"{_NEWER}test_restore_and_load_state_refuse_a_newer_latest_never_an_older_"
                    "step",
                    f"{_NEWER}test_the_cli_exits_10_naming_the_version_and_changes_nothing",
                    f"{_NEWER}test_repair_refuses_a_newer_latest_and_changes_nothing",
                    f"{_NEWER}test_gc_deletes_nothing_of_a_run_with_a_newer_latest",
                    f"{_NEWER}test_a_save_refuses_a_newer_latest_and_writes_nothing",
                ),
                range(0, 10),
                "I11",
            ),
            Mutant(
                "unknown-record-skipped",
                "a reader never falls back past a commit record in a newer format",
                _unknown_record_skipped,
                (f"{_NEWER}test_a_newer_commit_record_is_not_skipped_for_an_older_one",),
                range(0, 10),
                "I11: a restore returned step",
            ),
            Mutant(
                "repair-over-unknown",
                "repair refuses while LATEST or any commit record is in a newer format",
                _repair_over_unknown,
                (
                    f"{_NEWER}test_repair_refuses_a_newer_latest_and_changes_nothing",
                    f"{_NEWER}test_repair_refuses_while_any_commit_record_is_newer",
                ),
                range(0, 10),
                "I11: final wrote LATEST over the one a newer version wrote",
            ),
            Mutant(
                "gc-over-unknown",
                "GC deletes nothing by a manifest in a newer format",
                _gc_over_unknown,
                (f"{_NEWER}test_gc_deletes_nothing_by_a_newer_manifest",),
                why_not_simulated=_NOT_SIMULATED_NEWER_MANIFEST,
            ),
            Mutant(
                "gc-writes-before-judging",
                "GC reads every manifest it must understand before its first write",
                _gc_writes_before_judging,
                (
                    f"{_NEWER}test_gc_deletes_nothing_by_a_newer_manifest",
                    f"{_NEWER}test_gc_refuses_a_newer_manifest_before_its_first_write"
                    "[False-tombstones]",
                    f"{_NEWER}test_gc_refuses_a_newer_manifest_before_its_first_write"
                    "[False-records]",
                ),
                why_not_simulated=_NOT_SIMULATED_NEWER_MANIFEST,
            ),
            Mutant(
                "gc-collects-newer-by-name",
                "GC reads every record it would delete by name; a newer one stops it",
                _gc_collects_newer_by_name,
                (
                    f"{_NEWER}test_gc_never_deletes_a_newer_commit_record[False]",
                    f"{_NEWER_GC_ATTEMPT}[manifest]",
                    f"{_NEWER_GC_ATTEMPT}[marker]",
                    f"{_NEWER_GC_ATTEMPT}[young-names-old-chunks]",
                ),
                why_not_simulated=_NOT_SIMULATED_NEWER_MANIFEST,
            ),
            Mutant(
                "autogc-error-ends-the-worker",
                "an automatic GC's failure, whatever its type, never stops later saves",
                _autogc_error_ends_the_worker,
                (
                    "tests/test_autogc.py::"
                    "test_an_unexpected_gc_error_never_stops_the_saves_after_it",
                ),
                why_not_simulated="the simulation's stores raise only cloudckpt's own errors",
            ),
            Mutant(
                "after-each-error-ends-the-worker",
                "a failing after-save hook never stops later saves nor fails a committed one",
                _after_each_error_ends_the_worker,
                (
                    "tests/test_autogc.py::"
                    "test_a_failing_after_each_never_stops_later_saves_nor_fails_a_committed_one",
                ),
                why_not_simulated="the simulation's managers run no automatic GC",
            ),
            Mutant(
                "stopped-worker-accepts-saves",
                "once a BaseException stopped the save worker, every later save is refused "
                "at once, saying why; nothing waits for it",
                _stopped_worker_accepts_saves,
                tuple(
                    f"tests/test_savequeue_stopped.py::{name}"
                    for name in (
                        "test_after_a_crash_on_the_worker_every_later_save_is_refused_at_once",
                        "test_saves_waiting_for_a_slot_or_still_in_their_block_fail_when_the_"
                        "worker_stops",
                        "test_a_keyboard_interrupt_on_the_worker_refuses_later_saves_and_close_"
                        "returns",
                    )
                ),
                why_not_simulated="a simulated writer that crashed never saves again with "
                "that manager (its next life is a new one)",
            ),
            Mutant(
                "gc-on-the-save-worker",
                "a slow or hung automatic GC never holds up a later save",
                _gc_on_the_save_worker,
                ("tests/test_autogc.py::test_a_hung_gc_never_holds_up_a_later_save",),
                why_not_simulated="the simulation's managers run no automatic GC",
            ),
            Mutant(
                "gc-stacked",
                "an automatic GC due while the last still runs is skipped and logged, never "
                "started beside it",
                _gc_stacked,
                (
                    "tests/test_autogc.py::"
                    "test_a_gc_still_running_when_the_next_is_due_is_skipped_and_logged",
                ),
                why_not_simulated="the simulation's managers run no automatic GC",
            ),
            Mutant(
                "gc-close-waits-forever",
                "close() waits for a running automatic GC only a bounded time",
                _gc_close_waits_forever,
                ("tests/test_autogc.py::test_close_does_not_wait_forever_for_a_hung_gc",),
                why_not_simulated="the simulation's managers run no automatic GC",
            ),
            Mutant(
                "gc-close-ignores-the-timeout",
                "close(timeout=...) gives a running automatic GC only what is left of it",
                _gc_close_ignores_the_timeout,
                (
                    "tests/test_autogc.py::"
                    "test_close_with_a_timeout_gives_a_hung_gc_only_what_is_left_of_it",
                ),
                why_not_simulated="the simulation's managers run no automatic GC",
            ),
            Mutant(
                "gc-close-waits-the-whole-timeout",
                "close() waits for a running automatic GC at most CLOSE_WAIT_S, even under a "
                "longer timeout",
                _gc_close_waits_the_whole_timeout,
                (
                    "tests/test_autogc.py::"
                    "test_a_long_close_timeout_still_waits_for_a_hung_gc_at_most_close_wait_s",
                ),
                why_not_simulated="the simulation's managers run no automatic GC",
            ),
            Mutant(
                "gc-crash-spares-the-saves",
                "a simulated crash in automatic GC, off the save worker, still stops the "
                "saves as a dead process",
                _gc_crash_spares_the_saves,
                (
                    "tests/test_autogc.py::"
                    "test_a_simulated_crash_in_automatic_gc_stops_the_saves_as_a_dead_process",
                ),
                why_not_simulated="the simulation's managers run no automatic GC",
            ),
            Mutant(
                "repair-past-newer-manifests",
                "repair refuses while an attempt it would leave unreferenced has a newer manifest",
                _repair_past_newer_manifests,
                (f"{_NEWER}test_repair_refuses_when_an_unreferenced_manifest_is_newer",),
                why_not_simulated=_NOT_SIMULATED_NEWER_MANIFEST,
            ),
            Mutant(
                "writer-over-unknown",
                "a save never commits over a checkpoint in a newer format",
                _writer_over_unknown,
                (f"{_NEWER}test_a_save_refuses_a_newer_manifest_under_its_latest",),
                why_not_simulated=_NOT_SIMULATED_NEWER_MANIFEST,
            ),
            Mutant(
                "newer-journal-abandoned",
                "a staging journal in a newer format stops the manager and is kept",
                _newer_journal_abandoned,
                (f"{_NEWER}test_a_newer_staging_journal_is_refused_and_kept",),
                why_not_simulated="the simulation's writers share no staging directory with "
                "another version",
            ),
            Mutant(
                "fenced-writer-always-named",
                "push/cp warn only about a fenced writer that may still run",
                _fenced_writer_always_named,
                (f"{_FIRST_HOUR}test_an_exited_writer_is_fenced_without_a_warning_in_process",),
                why_not_simulated="the simulation checks what is committed, not what is said",
            ),
            Mutant(
                "gc-grace-unchecked-at-construction",
                "a gc_grace too short to commit under is refused when the manager is built",
                _gc_grace_unchecked_at_construction,
                (f"{_FIRST_HOUR}test_gc_grace_too_short_is_refused_when_the_manager_is_built",),
                why_not_simulated="the simulation builds its managers with valid settings",
            ),
            Mutant(
                "gcs-short-read-taken-as-truncation",
                "GCS: a ranged read cut short by a clean close (FIN) is a transient error",
                _gcs_short_read_is_short,
                (f"{_CUT}[gcs-FIN]",),
                why_not_simulated=_NOT_SIMULATED_STORES,
            ),
            Mutant(
                "azure-cut-not-transient",
                "Azure: a download cut short (FIN or RST) is a transient error",
                _azure_cut_not_transient,
                (f"{_CUT}[azurite-FIN]", f"{_CUT}[azurite-RST]"),
                why_not_simulated=_NOT_SIMULATED_STORES,
            ),
            Mutant(
                "fsspec-cut-not-transient",
                "fsspec (http://): an answer shorter than its Content-Length is transient",
                _fsspec_cut_not_transient,
                (f"{_CUT}[http-FIN]",),
                why_not_simulated=_NOT_SIMULATED_STORES,
            ),
            Mutant(
                "fused-crc-misses-a-byte",
                "the transfer CRC32C computed in the digest's pass covers every byte sent",
                _fused_crc_misses_a_byte,
                (
                    "tests/test_transfer_crc.py::test_one_pass_gives_the_leaf_and_crc_of_two_passes",
                    "tests/test_transfer_crc.py::test_a_first_save_sends_the_crc_from_the_digest_pass",
                    f"{_HOT}test_one_pass_gives_the_leaf_chunks_and_crcs_of_separate_passes",
                    f"{_HOT}test_each_chunk_is_named_and_crcd_from_exactly_the_bytes_sent[file]",
                    "tests/test_upload_buffers.py::test_a_part_read_block_by_block_gets_the_"
                    "leaves_and_crc_of_its_bytes[chunks]",
                ),
                why_not_simulated="not reachable: the simulation's memory store takes no CRC with a put",
            ),
            Mutant(
                "block-hashed-before-read",
                "a leaf read block by block into a reused buffer is hashed, cut into chunks "
                "and CRC'd after each block is read: chunk names and CRCs are of the bytes sent",
                _block_hashed_before_read,
                (
                    f"{_HOT}test_each_chunk_is_named_and_crcd_from_exactly_the_bytes_sent[file]",
                    f"{_HOT}test_an_incremental_save_names_new_chunks_from_their_bytes_and_"
                    "sends_no_crc",
                    f"{_HOT}test_one_pass_gives_the_leaf_chunks_and_crcs_of_separate_passes",
                    f"{_HOT}test_chunk_names_are_the_names_the_upload_puts[tensor]",
                ),
                # hits 0, 1, 2 (python tools/mutation_scan.py)
                seeds=range(0, 10),
                violation="does not match its name",
            ),
            Mutant(
                "cut-inside-a-block-ignored",
                "each chunk of a leaf read block by block is hashed and CRC'd from its own "
                "bytes only, wherever its cut falls inside a block",
                _cut_inside_a_block_ignored,
                (
                    f"{_HOT}test_each_chunk_is_named_and_crcd_from_exactly_the_bytes_sent[file]",
                    f"{_HOT}test_each_chunk_is_named_and_crcd_from_exactly_the_bytes_sent[memory]",
                    f"{_HOT}test_one_pass_gives_the_leaf_chunks_and_crcs_of_separate_passes",
                    f"{_HOT}test_chunk_names_are_the_names_the_upload_puts[tensor]",
                ),
                # hits 0, 44, 50: saves of model.safetensors (the simulation's tensor cuts)
                seeds=range(0, 60),
                violation="does not match its name",
            ),
            Mutant(
                "populate-rounds-outward",
                "a new tensor's range has only the whole pages inside it mapped ahead; the "
                "partial pages at its edges are left as they are",
                _populate_rounds_outward,
                (
                    "tests/test_restore_buffers.py::test_populate_maps_exactly_the_whole_pages_"
                    "inside_the_range",
                ),
                why_not_simulated="the simulation restores directories, not tensors",
            ),
            Mutant(
                "dedup-names-before-read",
                "a multi-rank save's chunk names (cross-rank dedup) are the digests of the "
                "bytes its upload puts under them, each block hashed after it is read",
                _dedup_names_before_read,
                (
                    f"{_HOT}test_chunk_names_are_the_names_the_upload_puts[tensor]",
                    f"{_HOT}test_chunk_names_are_the_names_the_upload_puts[fixed]",
                    f"{_HOT}test_one_pass_gives_the_leaf_chunks_and_crcs_of_separate_passes",
                    "tests/test_distributed_dedup.py::test_a_dp2_save_uploads_each_shared_"
                    "chunk_once_and_restores_exactly",
                ),
                why_not_simulated="the simulation has no multi-rank saves",
            ),
            Mutant(
                "restore-tensors-pooled",
                "every tensor a load returns owns its memory: nothing handed to a caller is "
                "pooled or reused by a later load",
                _restore_tensors_pooled,
                (
                    "tests/test_restore_buffers.py::test_new_tensors_of_a_load_are_ordinary_"
                    "and_each_owns_its_memory",
                ),
                why_not_simulated="the simulation restores directories, not tensors",
            ),
            Mutant(
                "part-hashed-before-read",
                "a part read block by block is digested and CRC'd after each block is read: "
                "the leaves and the CRC are of the bytes sent",
                _part_hashed_before_read,
                (
                    "tests/test_upload_buffers.py::test_a_part_read_block_by_block_gets_the_"
                    "leaves_and_crc_of_its_bytes[chunks]",
                    "tests/test_upload_buffers.py::test_files_uploaded_through_reused_buffers_"
                    "get_the_digests_of_their_bytes",
                ),
                # hits 4, 6 (seed 2: I10, the final save's upload refused)
                seeds=range(0, 10),
                violation="does not match its size and digest",
            ),
            Mutant(
                "short-judged-by-the-answers",
                "answers short on every retry are judged by the object's stored size: an "
                "object that holds the bytes had its answers cut (a store failure, not damage)",
                _short_judged_by_the_answers,
                (f"{_SHORT}test_answers_cut_short_every_time_are_a_store_failure_not_damage",),
                # hits 1, 19, 44, 62, 64: keys whose answers are all cut for a while (the
                # sticky short reads); before them only 1430 in 0:2000 (four in a row)
                seeds=range(0, 65),
                violation="I8",
            ),
            Mutant(
                "short-read-judged-at-once",
                "a ranged read that answers short is read again before the file is judged "
                "truncated",
                _short_read_judged_at_once,
                (
                    f"{_SHORT}test_a_short_read_is_read_again_before_a_file_is_judged_"
                    "truncated[memory-off]",
                    f"{_SHORT}test_a_short_read_is_read_again_before_a_file_is_judged_"
                    "truncated[seaweedfs-off]",
                ),
                # hits 6, 7, 26
                seeds=range(0, 10),
                violation="I8",
            ),
            Mutant(
                "wrapper-drops-get-range-into",
                "wrappers forward get_range_into (the inner store's zero-copy read)",
                _wrapper_drops_get_range_into,
                (f"{_SHORT}test_wrappers_forward_the_zero_copy_read[ForwardingStore]",),
                why_not_simulated="reads through a copy are the same bytes: no invariant breaks",
            ),
            Mutant(
                "faults-skip-get-range-into",
                "the fault injector's rules on get_range reach get_range_into",
                _faults_skip_get_range_into,
                (
                    f"{_SHORT}test_the_fault_injector_reaches_the_zero_copy_read_path[memory]",
                    f"{_SHORT}test_the_fault_injector_reaches_the_zero_copy_read_path[seaweedfs]",
                ),
                why_not_simulated="a fault injector that injects nothing breaks no invariant",
            ),
        ]
    }
)


# --------------------------------------------------------------------------- issue 28 items 2-4


def _resumed_chunk_trusted_by_name(setattr_: Callable[[Any, str, Any], None]) -> None:
    """An interrupted attempt's chunk is named once a listing shows its name and size,
    its content never checked."""
    from cloudckpt import chunks

    setattr_(chunks, "resumed_chunk_ok", lambda engine, store, known, data: True)


def _failure_after_cas_fails_the_save(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Whatever fails after the commit landed (the journal's ``committed`` write on a
    full disk) fails the save: a committed save reported as failed."""
    from cloudckpt import localsave

    def raising(step, what, fn, warnings):
        fn()
        return True

    setattr_(localsave, "after_commit", raising)


def _attempt_dated_by_its_birth_read(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The commit's bound counts from the store's clock read before ``ATTEMPT.json``,
    never from its objects' ``last_modified`` (what GC dates the attempt by)."""
    from cloudckpt import committer

    setattr_(committer.AttemptAge, "dated", lambda self, times: self)


_AFTER_COMMIT = "tests/test_after_commit.py::"
_RESUMED = "tests/test_resumed_content.py::"

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "resumed-chunk-trusted-by-name",
                "a resumed chunk is named only once its content checks",
                _resumed_chunk_trusted_by_name,
                (
                    f"{_RESUMED}test_a_resumed_push_never_names_a_chunk_whose_bytes_differ",
                    f"{_RESUMED}test_a_resumed_copy_never_names_a_chunk_whose_bytes_differ",
                ),
                why_not_simulated="the simulation's stores never hold other bytes under a "
                "chunk's name (no actor writes them)",
            ),
            Mutant(
                "failure-after-cas-reported-failed",
                "a save whose compare-and-swap landed is reported committed, with a warning "
                "for what failed after",
                _failure_after_cas_fails_the_save,
                (
                    f"{_AFTER_COMMIT}test_a_full_disk_at_the_committed_journal_write_reports_"
                    "the_save_committed",
                ),
                why_not_simulated="the simulation's staging disk never fills",
            ),
            Mutant(
                "attempt-dated-by-birth-read",
                "the commit's bound counts from the oldest last_modified of the attempt's "
                "objects, as GC dates it",
                _attempt_dated_by_its_birth_read,
                (
                    "tests/test_store_clock.py::test_a_store_clock_stepping_back_before_"
                    "attempt_json_cannot_let_gc_own_a_commit",
                ),
                why_not_simulated="reachable (the store's clock steps back for a write), but "
                "GC must sweep in the window; 300 seeds showed no violation with the rule "
                "removed",
            ),
            Mutant(
                "digest-algorithm-ignored",
                "each file and chunk is checked with its manifest's digest algorithm",
                _digest_algorithm_ignored,
                (f"{_DIGESTS}test_a_sha256_run_mixes_with_blake3_restore_verify_gc_cp_fallback",),
                why_not_simulated=_NOT_SIMULATED_DIGESTS,
            ),
            Mutant(
                "runs-listing-passes-newer-runs",
                "`runs` over a run a newer version wrote lists the others and exits 10",
                _runs_listing_passes_newer_runs,
                (f"{_NEWER}test_runs_lists_every_run_flags_the_newer_one_and_exits_10",),
                why_not_simulated="not reachable: the simulation has no CLI",
            ),
            Mutant(
                "unknown-digest-is-damage",
                "a digest this version does not know is a newer format, not damage",
                _unknown_digest_is_damage,
                (f"{_DIGESTS}test_an_unknown_digest_is_a_newer_format_not_damage",),
                why_not_simulated=_NOT_SIMULATED_DIGESTS,
            ),
            Mutant(
                "latest-format-ignores-digest",
                "a LATEST naming a BLAKE3 checkpoint is /4, which older readers refuse",
                _latest_format_ignores_digest,
                (
                    f"{_DIGESTS}test_an_older_reader_refuses_a_blake3_run_at_the_pointer",
                    f"{_DIGESTS}test_new_checkpoints_use_blake3_and_say_so[fixed]",
                ),
                why_not_simulated=_NOT_SIMULATED_DIGESTS,
            ),
        ]
    }
)


# --------------------------------------------------------------------------- issue 32 item 10


def _library_logs_in_their_own_style(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The CLI prints the library's logs as ``cloudckpt: WARNING: ...`` again, beside its
    own ``warning: ...`` lines (one event, two styles)."""
    import sys

    from cloudckpt.cli import _common

    def emit(self, record):
        sys.stderr.write(f"cloudckpt: {record.levelname}: {record.getMessage()}\n")

    setattr_(_common._CliLogHandler, "emit", emit)


_ONE_LINE = "tests/test_cli_one_line.py::"

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "library-logs-in-their-own-style",
                "the CLI prints each event once, in its own style: the library's warnings "
                "and errors as warning:/error: lines",
                _library_logs_in_their_own_style,
                (
                    f"{_ONE_LINE}test_get_after_a_fallback_warns_once_in_the_clis_style[False]",
                    f"{_ONE_LINE}test_watch_reports_a_failed_upload_once_in_the_clis_style",
                ),
                why_not_simulated="not reachable: the simulation checks what is committed, "
                "not what is said",
            ),
        ]
    }
)


# --------------------------------------------------------------------------- issue 30 item 1


def _multi_rank_reuse_sources_unreported(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A rank of a multi-rank save reports no checkpoint its reused chunks come from, so
    the coordinator's commit requires none of them retained."""
    from cloudckpt.distributed import _save

    setattr_(_save, "_reuse_sources", lambda stats: frozenset())


MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "multi-rank-reuse-sources-unreported",
                "a multi-rank commit requires the checkpoints every rank's reused chunks "
                "come from to be retained",
                _multi_rank_reuse_sources_unreported,
                (
                    "tests/test_distributed.py::test_a_multi_rank_commit_requires_the_sources_"
                    "of_reused_chunks",
                ),
                why_not_simulated="the simulation has no multi-rank saves",
            ),
        ]
    }
)


def _multi_rank_reupload_keeps_missing_chunks(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The retry of a multi-rank save whose reused chunks were missing uses the same index:
    the ranks name the missing chunks again instead of uploading them."""
    from cloudckpt.distributed import _chunks

    original = _chunks.RankChunks.index

    def ignoring(self, base, again):
        return original(self, base, None if again is None or again.missing is not None else again)

    setattr_(_chunks.RankChunks, "index", ignoring)


MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "multi-rank-reupload-keeps-missing-chunks",
                "a multi-rank save whose reused chunks are missing is saved again once, every "
                "rank uploading those chunks",
                _multi_rank_reupload_keeps_missing_chunks,
                (
                    "tests/test_distributed.py::test_a_multi_rank_save_reuploads_a_reused_chunk_"
                    "that_is_gone",
                ),
                why_not_simulated="the simulation has no multi-rank saves",
            ),
        ]
    }
)


# --------------------------------------------------------------------------- issue 30 items 1-2


def _dedup_owner_not_deterministic(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The owner of a chunk several ranks hold is any of the ranks that must upload it,
    not the lowest: two coordinators (or two saves) given the same plans disagree."""
    import random

    from cloudckpt.distributed import _chunks

    def any_owner(held, reusable, base):
        chosen = {}
        for name, rank in _chunks_owners(held, reusable, base).items():
            holders = [r for r, names in enumerate(held) if name in names and r >= rank]
            chosen[name] = random.choice(holders)
        return chosen

    _chunks_owners = _chunks.owners
    setattr_(_chunks, "owners", any_owner)


def _dedup_owner_reuses_owed_chunk(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The owner of a shared chunk names it from its own index instead of putting it under
    the attempt, where the other holders name it: they name a chunk nobody put."""
    from cloudckpt import chunks

    original = chunks._Uploader.__init__

    def forgetting(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.owed = frozenset()

    setattr_(chunks._Uploader, "__init__", forgetting)


def _replica_disagreement_committed(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The coordinator commits without comparing the replicas' digests."""
    from cloudckpt.distributed import _replicas

    setattr_(_replicas, "check_agreement", lambda groups, entries, step: None)


# The local tier at N ranks (issue 30 item 3): cloudckpt.distributed._kept.
def _rank_copy_unverified(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A node's leader keeps every file it placed from its ranks' kept copies, unverified."""
    from cloudckpt.distributed import _kept

    setattr_(
        _kept, "verified", lambda engine, jobs, chunk_size: [j.local is not None for j in jobs]
    )


def _rank_copy_stale(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A rank's newest kept copy is taken for the checkpoint being restored, whatever
    checkpoint it holds, its kept manifest trusted."""
    from cloudckpt import localcopy, manifests
    from cloudckpt.distributed import _kept

    def newest(self, record):
        found = {}
        for rank, tier in self.tiers.items():
            copies = tier.copies()
            if copies:
                found[rank] = copies[0]
        return found

    def kept_manifest(copies, record):
        for copy in copies.values():
            with contextlib.suppress(Exception):
                return manifests.parse_manifest((copy.dir / localcopy.MANIFEST).read_bytes())
        return None

    setattr_(_kept.NodeCopies, "find", newest)
    setattr_(_kept.NodeCopies, "manifest", staticmethod(kept_manifest))


def _rank_copy_linked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A node's restore hard-links its ranks' kept files, asked to or not."""
    from cloudckpt.distributed import _kept

    original = _kept.place_file
    setattr_(
        _kept,
        "place_file",
        lambda source, target, *, link=False: original(source, target, link=True),
    )


_RANK_LOCAL = "tests/test_distributed_local.py::"
_NOT_SIMULATED_RANKS = "the simulation has no multi-rank saves and keeps no staging directory"

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "dedup-owner-not-deterministic",
                "the owner of a chunk several ranks hold is chosen deterministically: the "
                "lowest rank that must upload it",
                _dedup_owner_not_deterministic,
                (
                    "tests/test_distributed_dedup.py::test_dedup_owner_is_the_lowest_rank_that_"
                    "must_upload",
                ),
                why_not_simulated="the simulation has no multi-rank saves",
            ),
            Mutant(
                "dedup-owner-reuses-owed-chunk",
                "the owner of a shared chunk puts it under the attempt even if its own index "
                "holds it (the other ranks name it there)",
                _dedup_owner_reuses_owed_chunk,
                (
                    "tests/test_distributed_dedup.py::test_incremental_dp2_saves_and_a_restart_"
                    "keep_one_copy_and_commit",
                ),
                why_not_simulated="the simulation has no multi-rank saves",
            ),
            Mutant(
                "replica-disagreement-committed",
                "replicas that saved different bytes are not committed",
                _replica_disagreement_committed,
                (
                    "tests/test_distributed_dedup.py::test_a_divergent_replica_is_not_committed_"
                    "and_names_ranks_and_file",
                ),
                why_not_simulated="the simulation has no multi-rank saves",
            ),
            Mutant(
                "rank-copy-unverified",
                "a multi-rank restore takes a rank's kept file only once its bytes verify "
                "against the committed manifest",
                _rank_copy_unverified,
                tuple(
                    f"{_RANK_LOCAL}test_a_damaged_kept_copy_is_read_from_the_store[{damage}]"
                    for damage in ("flip", "truncate")
                ),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
            Mutant(
                "rank-copy-stale",
                "a multi-rank restore uses only kept copies of the checkpoint LATEST names, "
                "with the manifest whose digest LATEST records",
                _rank_copy_stale,
                (f"{_RANK_LOCAL}test_a_kept_copy_of_another_step_is_never_used",),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
            Mutant(
                "rank-copy-linked",
                "files a multi-rank restore takes from kept copies are independent of them "
                "(hard links only with link_local)",
                _rank_copy_linked,
                (f"{_RANK_LOCAL}test_restored_files_are_independent_of_the_kept_copy",),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
        ]
    }
)


# No collective waits forever (issue 30 item 6): cloudckpt.distributed._comm.
def _collective_without_timeout(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The manager's gloo group is created with an hour's timeout, whatever ``timeout``
    says (as with torch's default of 30 minutes)."""
    from cloudckpt.distributed import _manager

    original = _manager._join
    setattr_(_manager, "_join", lambda dist, group, timeout: original(dist, group, 3600.0))


def _collective_error_names_no_rank(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A failed collective says only that some rank died or hung."""
    from cloudckpt.distributed import _comm

    setattr_(_comm.Whereabouts, "of", classmethod(lambda cls, *args: None))


_TIMEOUTS = (
    "tests/test_distributed_timeouts.py::test_a_rank_that_never_reaches_the_post_restore_"
    "barrier_is_named_within_the_timeout"
)

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "collective-without-timeout",
                "every collective of the multi-rank manager gives up after its timeout",
                _collective_without_timeout,
                (f"{_TIMEOUTS}[stall]",),  # a dead rank's closed connection needs no timeout
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
            Mutant(
                "collective-error-names-no-rank",
                "a failed collective names the ranks that never reached it",
                _collective_error_names_no_rank,
                (f"{_TIMEOUTS}[stall]", f"{_TIMEOUTS}[die]"),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
        ]
    }
)


# --------------------------------------------------------------------------- fan-out
# Issue 30, item 5: a chunk several nodes need is read once and sent to the others, who
# verify it (docs/design.md §7, "Read once, fan out").


def _fanout_receiver_trusts_bytes(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A receiver keeps whatever bytes a peer sent it, unverified."""
    from cloudckpt.distributed import _fanout

    setattr_(_fanout, "accept", lambda ref, data: True)


def _fanout_reads_on_every_node(setattr_: Callable[[Any, str, Any], None]) -> None:
    """No chunk is shared: every node reads every chunk it needs from the store."""
    from cloudckpt.distributed import _fanout

    setattr_(_fanout, "plan", lambda needs, **kw: [])


_FANOUT = "tests/test_fanout.py"
_FANOUT_RANKS = (
    "tests/test_distributed_local.py::test_data_parallel_replicas_on_2_nodes_read_each_chunk_once"
)

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "fanout-receiver-trusts-bytes",
                "a chunk received from another node is used only if it is exactly the chunk "
                "its name names; what fails is read from the store",
                _fanout_receiver_trusts_bytes,
                (
                    f"{_FANOUT}::test_a_received_chunk_is_kept_only_if_it_is_exactly_the_chunk_"
                    "its_name_names",
                    _FANOUT_RANKS,
                ),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
            Mutant(
                "fanout-reads-on-every-node",
                "a chunk several nodes need is read from the store once, by one of them",
                _fanout_reads_on_every_node,
                (
                    f"{_FANOUT}::test_each_chunk_several_nodes_need_gets_one_sender_spread_by_"
                    "bytes",
                    _FANOUT_RANKS,
                ),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
        ]
    }
)


# --------------------------------------------------------------------------- one read engine
# Issue 29, item 2: every verified read is ``fetch.read_files``; ``verify --read-data`` is
# its hash-only sink, with the damage of each file reported and the others read on.


def _verify_drops_damage(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Where the engine collects damage per file (``verify --read-data``), a failed unit
    is dropped instead of recorded: the file counts as read and intact."""
    from cloudckpt import fetch
    from cloudckpt.errors import CorruptionError

    original = fetch._Reader.run_checked

    def dropping(self, unit, check_root):
        if self.damage is None:
            return original(self, unit, check_root)
        with contextlib.suppress(CorruptionError):
            if unit.pieces:
                self.run_unit(unit, False, check_root)
            else:
                self.file_done(unit.job)
        return None

    setattr_(fetch._Reader, "run_checked", dropping)


# --------------------------------------------------------------------------- peer copies
# Issue 30, item 4: each node's kept files are also held by k other nodes; a replacement
# host restores from them, every chunk verified (docs/design.md §7, "Peer copies").


def _peer_chunk_held_unverified(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A node holds whatever bytes a peer sent it as its copy, unverified."""
    from cloudckpt.distributed import _peers

    setattr_(_peers, "holdable", lambda ref, data: True)


def _peer_send_failure_fails_committed_save(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A peer transfer that fails after the commit fails the (committed) save."""
    from cloudckpt.distributed._manager import RankSave

    def raising(self: Any, info: Any, warnings: list[str]) -> None:
        if self.share is not None:
            warnings.extend(self.share(info))

    setattr_(RankSave, "_peer_copies", raising)


def _peer_copy_dropped_before_newer_complete(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A new peer copy replaces the older ones even when some of its chunks never came."""
    from cloudckpt.distributed._peers import PeerStore

    original = PeerStore.record

    def always(self: Any, step: int, commit_id: str, names: Any, complete: bool) -> None:
        original(self, step, commit_id, names, True)

    setattr_(PeerStore, "record", always)


def _peer_budget_ignored(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A node takes a peer copy whatever its budget and free disk."""
    from cloudckpt.distributed import _peers

    setattr_(_peers, "fits", lambda need, room: True)


def _peer_holdings_ignored(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A restore never asks a peer: what a node lacks is read from the store."""
    from cloudckpt.distributed._peers import Holdings

    setattr_(Holdings, "mask", lambda self, chunks: bytes((len(chunks) + 7) // 8))


def _peer_copy_of_other_step_used(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A leader takes the chunk its peer store holds under a name, unverified (another
    step's bytes, a damaged file)."""
    from cloudckpt.distributed import _fanout

    def trusting(chunks: Any, rest: Any, local: Any, held: bytes, got: Any) -> None:
        wanted = {ref.key for e in rest for ref in (e.chunks or ())}
        for i, ref in enumerate(chunks):
            if ref.key in wanted and i >> 3 < len(held) and held[i >> 3] >> (i & 7) & 1:
                data = local.read(ref)
                if data is not None:
                    got.add(ref, data)

    setattr_(_fanout, "_own", trusting)


MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "verify-drops-damage",
                "verify --read-data reports every file whose bytes do not verify",
                _verify_drops_damage,
                (
                    "tests/test_verify.py::test_bit_flip_in_data_is_found_only_by_reading_it",
                    "tests/test_digest_algorithms.py::test_a_damaged_byte_is_detected_under_blake3",
                ),
                why_not_simulated="the simulation does not run verify; restores raise on damage",
            ),
        ]
    }
)


_PEERS = "tests/test_peers.py"
_PEERS_RANKS = "tests/test_distributed_peers.py"

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "peer-chunk-held-unverified",
                "a node holds a chunk of a peer copy only if it is exactly the committed "
                "manifest's chunk (size and digest)",
                _peer_chunk_held_unverified,
                (
                    f"{_PEERS}::test_a_chunk_that_does_not_verify_is_not_held",
                    f"{_PEERS_RANKS}::test_peer_copies_are_held_verified_and_a_failed_transfer_"
                    "leaves_the_commit",
                ),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
            Mutant(
                "peer-send-failure-fails-committed-save",
                "a peer transfer that fails after the commit is a warning on the committed "
                "save, never its failure",
                _peer_send_failure_fails_committed_save,
                (
                    f"{_PEERS}::test_a_failed_peer_transfer_is_a_warning_on_the_committed_save",
                    f"{_PEERS_RANKS}::test_peer_copies_are_held_verified_and_a_failed_transfer_"
                    "leaves_the_commit",
                ),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
            Mutant(
                "peer-copy-dropped-before-newer-complete",
                "an older peer copy is dropped only once a newer one is complete",
                _peer_copy_dropped_before_newer_complete,
                (
                    f"{_PEERS}::test_an_older_copy_goes_only_once_a_newer_one_is_complete",
                    f"{_PEERS_RANKS}::test_peer_copies_are_held_verified_and_a_failed_transfer_"
                    "leaves_the_commit",
                ),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
            Mutant(
                "peer-budget-ignored",
                "a peer copy that does not fit peer_budget_bytes (or the free disk) is not "
                "held, and the save says so",
                _peer_budget_ignored,
                (f"{_PEERS}::test_a_copy_that_does_not_fit_the_budget_is_not_held",),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
            Mutant(
                "peer-holdings-ignored",
                "a chunk a node lacks and a peer holds comes from the peer, not the store",
                _peer_holdings_ignored,
                (
                    f"{_PEERS}::test_holdings_are_the_placed_files_and_the_peer_store",
                    f"{_PEERS_RANKS}::test_a_replacement_host_restores_from_its_peer",
                ),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
            Mutant(
                "peer-copy-of-other-step-used",
                "a chunk a node holds as a peer copy is used only if its bytes are exactly "
                "the committed manifest's",
                _peer_copy_of_other_step_used,
                (f"{_PEERS}::test_a_leader_uses_its_own_peer_chunk_only_if_it_verifies",),
                why_not_simulated=_NOT_SIMULATED_RANKS,
            ),
        ]
    }
)


def _load_into_shape_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """``load_state(into=...)`` checks only the names of the caller's tensors against the
    checkpoint, not their shapes and dtypes."""
    from cloudckpt.integrations import _torch_restore as tr

    original = tr.Into.check

    def names_only(self, doc, where):
        described = doc.get("tensors")
        if isinstance(described, dict):
            mine = self.tensors
            doc = {
                **doc,
                "tensors": {
                    n: (
                        {
                            "shape": list(mine[n].shape),
                            "dtype": str(mine[n].dtype).removeprefix("torch."),
                        }
                        if n in mine
                        else info
                    )
                    for n, info in described.items()
                },
            }
        original(self, doc, where)

    setattr_(tr.Into, "check", names_only)


def _load_into_ignored(setattr_: Callable[[Any, str, Any], None]) -> None:
    """``load_state(into=...)`` loads into new tensors, as without ``into``."""
    from cloudckpt.integrations import torch as integration

    setattr_(integration, "_into", lambda state, strict: None)


def _load_into_object_tensor_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """``load_state(into=..., strict=True)`` leaves a caller's tensor that the checkpoint
    holds as a pickled object (it cannot be filled in place) silently stale."""
    from cloudckpt.integrations import torch as integration

    original = integration._into

    def without_unfillable(state, strict):
        into = original(state, strict)
        into.unfillable = ()
        return into

    setattr_(integration, "_into", without_unfillable)


def _load_into_claims_nothing_written(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A refusal of ``into`` after a damaged newer checkpoint's bytes landed in it still
    says nothing was written."""
    from cloudckpt.integrations import _torch_restore as tr

    setattr_(tr.Into, "_written", lambda self: "nothing was written into into's tensors")


_INTO = "tests/test_load_into.py"
_NOT_SIMULATED_TORCH = "the simulation saves and restores directories, not state dicts"


def _checksum_choice_overridden(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The S3 client's ``response_checksum_validation="when_required"`` default replaces
    whatever the user chose (config_kwargs, a Config, the environment, the profile)."""
    import botocore.config

    from cloudckpt.stores import _s3_client

    def forced(session, config):
        return config.merge(botocore.config.Config(response_checksum_validation="when_required"))

    setattr_(_s3_client, "_without_checksum_mode", forced)


# --------------------------------------------------------------------------- the stall (issue 31)
# Item 5: save_state's stall beside CPU hogs. The next save waits for the previous save's
# upload, never for its staged copy still being written after the commit (a low-priority
# thread a busy host starves): that copy is cut short, and a copy cut short is never kept.


def _next_save_waits_for_local_copy(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The next save_state waits until the previous save's local copy is on disk before
    it reuses the host buffers (what it did before issue 31 item 5)."""
    from cloudckpt import savequeue

    setattr_(savequeue.BackgroundWrite, "reclaim_memory", lambda self: None)


def _cut_local_copy_kept(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A staged copy whose writes all returned is made durable (and kept as the local
    tier) even though the next save cut it short and may have reused its buffers."""
    from cloudckpt import localsave
    from cloudckpt.errors import CloudCkptError
    from cloudckpt.staging import DURABLE

    def stage(job, files, cancelled):
        attempt = job.attempt
        with contextlib.suppress(CloudCkptError):
            if attempt.write_files(files, cancelled):
                attempt.fsync_files()
                attempt.set_state(DURABLE)

    setattr_(localsave, "_stage", stage)


def _refused_save_cuts_local_copy(setattr_: Callable[[Any, str, Any], None]) -> None:
    """save_state cuts the previous save's local copy short before the manager checks
    the new save's step, metadata and metrics (as before issue 32): a refused save costs
    that step its local copy."""
    from cloudckpt.integrations import torch as ct

    def always(self: Any, step: Any, metadata: Any, metrics: Any) -> bool:
        if self._last is not None:
            self._last.reclaim_memory()
        return False

    setattr_(ct.StateSaver, "_reclaim_unless_refused", always)


_STALL = "tests/test_save_stall.py"
_NOT_SIMULATED_STALL = (
    "the simulation's writers call save() in its synchronous mode: save_state's host "
    "buffers, its background writer and its staged copy are not in it"
)

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "load-into-shape-unchecked",
                "a checkpoint tensor whose counterpart in load_state's into has another shape "
                "or dtype is refused, naming it, before any byte is written into into",
                _load_into_shape_unchecked,
                (
                    f"{_INTO}::test_a_shape_mismatch_raises_before_any_byte_is_written",
                    f"{_INTO}::test_a_dtype_mismatch_raises_before_any_byte_is_written",
                ),
                why_not_simulated=_NOT_SIMULATED_TORCH,
            ),
            Mutant(
                "load-into-ignored",
                "load_state(into=...) fills the caller's tensors in place and returns them",
                _load_into_ignored,
                (
                    f"{_INTO}::test_load_state_fills_the_callers_tensors_in_place",
                    f"{_INTO}::test_resume_state_fills_in_place_from_the_local_copy",
                ),
                why_not_simulated=_NOT_SIMULATED_TORCH,
            ),
            Mutant(
                "load-into-object-tensor-unchecked",
                "with strict=True, a tensor of into that the checkpoint holds as a pickled "
                "object (it cannot be filled in place) is refused, not left stale",
                _load_into_object_tensor_unchecked,
                (f"{_INTO}::test_a_tensor_saved_as_an_object_is_refused_under_strict",),
                why_not_simulated=_NOT_SIMULATED_TORCH,
            ),
            Mutant(
                "load-into-claims-nothing-written",
                "a refusal of into after a damaged newer checkpoint's bytes landed says its "
                "tensors are undefined, never that nothing was written",
                _load_into_claims_nothing_written,
                (f"{_INTO}::test_a_fallback_that_does_not_fit_says_the_tensors_are_undefined",),
                why_not_simulated=_NOT_SIMULATED_TORCH,
            ),
            Mutant(
                "s3-checksum-choice-overridden",
                "the S3 client's cheaper checksum default (when_required) gives way to the "
                "user's response_checksum_validation, however it was set",
                _checksum_choice_overridden,
                (
                    "tests/test_s3_store.py::test_ranged_reads_ask_for_no_checksum_unless_the_"
                    "user_does",
                ),
                why_not_simulated=_NOT_SIMULATED_STORES,
            ),
            Mutant(
                "next-save-waits-for-local-copy",
                "save_state waits for the previous save's upload, never for its staged copy "
                "still being written after the commit (that copy is cut short)",
                _next_save_waits_for_local_copy,
                (f"{_STALL}::test_the_next_save_does_not_wait_for_the_previous_saves_local_copy",),
                why_not_simulated=_NOT_SIMULATED_STALL,
            ),
            Mutant(
                "cut-local-copy-kept",
                "a staged copy cut short for the next save is never kept as the local tier, "
                "even if its writes completed (they may have read reused buffers)",
                _cut_local_copy_kept,
                (
                    f"{_STALL}::test_a_local_copy_cut_short_is_never_kept_even_if_its_writes_"
                    "completed",
                ),
                why_not_simulated=_NOT_SIMULATED_STALL,
            ),
            Mutant(
                "refused-save-cuts-local-copy",
                "a save_state the manager refuses for its step, metadata or metrics never "
                "cuts the previous save's local copy short",
                _refused_save_cuts_local_copy,
                tuple(
                    f"{_STALL}::test_a_refused_save_never_cuts_the_previous_saves_local_copy[{arg}]"
                    for arg in ("step", "metadata", "metrics")
                ),
                why_not_simulated=_NOT_SIMULATED_STALL,
            ),
        ]
    }
)


# --------------------------------------------------------------------------- close(timeout) (bounded)


def _close_joins_the_worker_forever(setattr_: Callable[[Any, str, Any], None]) -> None:
    """close() stops the save worker once its wait for the saves expires, and joins it
    with no timeout (as before: close(timeout) waited as long as a hung upload did)."""
    import threading

    from cloudckpt import savequeue

    original = savequeue.SaveQueue.settle

    def settle(self: Any, timeout: float | None = None) -> list[Any]:
        original(self, timeout)
        return []

    def stop(self: Any, timeout: float | None = None) -> bool:
        with self._cv:
            self.closing = True
            self._cv.notify_all()
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join()
        return True

    setattr_(savequeue.SaveQueue, "settle", settle)
    setattr_(savequeue.SaveQueue, "stop", stop)


def _close_tears_down_under_a_running_save(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A close() that timed out still releases staging and marks the manager closed, under
    the save still being written."""
    from cloudckpt import manager

    original = manager.ManagerBase.close

    def close(self: Any, timeout: float | None = None) -> None:
        try:
            original(self, timeout)
        except TimeoutError:
            if not self._closed:
                self.queue.stop(0)
                self.staging.close()
                if self._tmp_staging is not None:
                    self._tmp_staging.cleanup()
                self._closed = True
            raise

    setattr_(manager.ManagerBase, "close", close)


def _close_timeout_takes_the_failure(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A close() that times out has already taken an earlier save's unreported failure
    (marked told, raised by no one: the next close() returns as if all went well)."""
    from cloudckpt import savequeue

    original = savequeue.SaveQueue.settle

    def settle(self: Any, timeout: float | None = None) -> list[Any]:
        pending = original(self, timeout)
        if pending:
            for handle in list(self._handles):
                handle._take_failure()
        return pending

    setattr_(savequeue.SaveQueue, "settle", settle)


def _close_timeout_calls_every_save_durable(setattr_: Callable[[Any, str, Any], None]) -> None:
    """close()'s TimeoutError says a restart commits every save still being written, even
    one not yet durable in staging (which a restart abandons)."""
    from cloudckpt import savequeue

    setattr_(savequeue.SaveQueue, "durable", staticmethod(lambda handle: True))


def _close_waits_for_local_copies_forever(setattr_: Callable[[Any, str, Any], None]) -> None:
    """close(timeout) waits for the local copies still being finished with no bound (as
    before: a copy written at a low priority on a busy host, or a hung staging disk)."""
    import concurrent.futures as cf

    from cloudckpt import localsave

    def close(self: Any, timeout: float | None = None) -> bool:
        with self._lock:
            keeping = list(self._keeping)
        cf.wait(keeping)
        return True

    setattr_(localsave.LocalSave, "close", close)


def _queue_opens_after_closing(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A save's block opens though close() has told the worker to stop (the queue does not
    check ``closing``): the worker may have ended, and the save, accepted, never runs."""
    from cloudckpt import savequeue

    original = savequeue.SaveQueue.open

    def open_(self: Any, handle: Any) -> Any:
        closing, self.closing = self.closing, False
        try:
            return original(self, handle)
        finally:
            self.closing = closing or self.closing

    setattr_(savequeue.SaveQueue, "open", open_)


def _worker_ends_under_an_open_block(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Told to stop, the save worker ends once its queue is empty, though another thread
    still has a save's block open: that save is handed over to no one."""
    from cloudckpt import savequeue

    setattr_(savequeue.SaveQueue, "_writing", lambda self: False)


def _finish_pending_drops_an_untold_failure(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The integrations' ``finish_pending``, its ``close()`` timed out, drops the manager
    without taking the failures no handle covered: no one is ever told of them."""
    from cloudckpt.integrations import _pending

    setattr_(_pending, "_untold", lambda mgr: [])


def _attempt_state_before_its_journal(setattr_: Callable[[Any, str, Any], None]) -> None:
    """An attempt says its new state before its journal is written (as before), so a
    close() that timed out names as durable a save whose journal a restart reads otherwise."""
    from cloudckpt import staging

    original = staging.Attempt.set_state

    def set_state(self: Any, state: str, *, sync: bool = True, **extra: Any) -> None:
        self.state = state
        original(self, state, sync=sync, **extra)

    setattr_(staging.Attempt, "set_state", set_state)


def _close_ignores_a_failed_phase_s_rank_work(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A multi-rank manager's close() does not wait for this rank's work that a phase
    failed on a CollectiveError left running (as before): it releases staging and the
    engine under an upload still going on."""
    from cloudckpt.distributed import _manager

    setattr_(_manager.RankSave, "close", lambda self, timeout=None: True)


_CLOSE = "tests/test_close_timeout.py"
_NOT_SIMULATED_CLOSE = "the simulation's managers close without a timeout"

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "close-joins-the-worker-forever",
                "close(timeout) returns within about timeout, even with a save hung mid-upload",
                _close_joins_the_worker_forever,
                (f"{_CLOSE}::test_close_with_a_hung_upload_returns_in_time_and_releases_nothing",),
                why_not_simulated=_NOT_SIMULATED_CLOSE,
            ),
            Mutant(
                "close-tears-down-under-a-running-save",
                "a close() that timed out with saves still being written releases nothing "
                "(staging, store, worker) and leaves the manager open",
                _close_tears_down_under_a_running_save,
                (
                    f"{_CLOSE}::test_close_with_a_hung_upload_returns_in_time_and_releases_nothing",
                    f"{_CLOSE}::test_a_save_still_in_its_block_at_the_deadline_is_not_released_"
                    "under_it",
                ),
                why_not_simulated=_NOT_SIMULATED_CLOSE,
            ),
            Mutant(
                "close-waits-for-local-copies-forever",
                "close(timeout) waits for local copies still being finished only until the "
                "deadline, then releases nothing",
                _close_waits_for_local_copies_forever,
                (
                    f"{_CLOSE}::test_a_local_copy_still_being_written_at_the_deadline_is_not_"
                    "released_under",
                ),
                why_not_simulated=_NOT_SIMULATED_CLOSE,
            ),
            Mutant(
                "close-timeout-takes-the-failure",
                "a close() that timed out takes no unreported failure: the next close() raises it",
                _close_timeout_takes_the_failure,
                (
                    f"{_CLOSE}::test_a_close_that_timed_out_keeps_an_earlier_failure_for_the_"
                    "next_close",
                ),
                why_not_simulated=_NOT_SIMULATED_CLOSE,
            ),
            Mutant(
                "close-timeout-calls-every-save-durable",
                "close()'s TimeoutError names as lost on exit the saves not yet durable in "
                "staging (a restart commits only durable ones)",
                _close_timeout_calls_every_save_durable,
                (
                    f"{_CLOSE}::test_a_save_still_in_its_block_at_the_deadline_is_not_released_"
                    "under_it",
                ),
                why_not_simulated=_NOT_SIMULATED_CLOSE,
            ),
            Mutant(
                "queue-opens-after-closing",
                "once close() has told the save worker to stop, a new save's block is refused",
                _queue_opens_after_closing,
                (f"{_CLOSE}::test_a_save_begun_as_close_stops_the_worker_is_run_or_refused[stop]",),
                why_not_simulated=_NOT_SIMULATED_CLOSE,
            ),
            Mutant(
                "worker-ends-under-an-open-block",
                "told to stop, the save worker still runs the saves other threads have open "
                "(close() waits for them before it releases anything)",
                _worker_ends_under_an_open_block,
                (
                    f"{_CLOSE}::test_a_save_begun_as_close_stops_the_worker_is_run_or_refused"
                    "[settle]",
                    f"{_CLOSE}::test_close_without_a_timeout_waits_for_a_save_begun_during_its_"
                    "wait",
                ),
                why_not_simulated=_NOT_SIMULATED_CLOSE,
            ),
            Mutant(
                "finish-pending-drops-an-untold-failure",
                "finish_pending, when close() times out, raises the failures no handle covered "
                "(the manager it drops would never raise them)",
                _finish_pending_drops_an_untold_failure,
                (
                    f"{_CLOSE}::test_finish_pending_raises_a_failure_no_handle_covered_when_"
                    "close_times_out",
                ),
                why_not_simulated=_NOT_SIMULATED_CLOSE,
            ),
            Mutant(
                "attempt-state-before-its-journal",
                "an attempt says durable only once its journal does (close()'s TimeoutError "
                "names the saves a restart commits by it)",
                _attempt_state_before_its_journal,
                (f"{_CLOSE}::test_an_attempt_is_durable_only_once_its_journal_says_so",),
                why_not_simulated=_NOT_SIMULATED_CLOSE,
            ),
            Mutant(
                "close-ignores-a-failed-phase-s-rank-work",
                "a multi-rank close() releases nothing while this rank's work of a failed "
                "collective phase still runs, and is bounded by its timeout",
                _close_ignores_a_failed_phase_s_rank_work,
                (
                    "tests/test_distributed_close.py::test_close_is_bounded_and_releases_"
                    "nothing_under_a_failed_phase_s_work",
                ),
                why_not_simulated=_NOT_SIMULATED_CLOSE,
            ),
        ]
    }
)


# --------------------------------------------------------------- the lean ranged GET of S3


def _lean_get_accepts_a_200(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A 200 (the whole object, the Range ignored) taken as the range's bytes."""
    from cloudckpt.stores import _s3_fast_get as fg

    original = fg.FastGet._read

    def read(response: Any, start: int, end: int, buf: memoryview) -> tuple[str | None, int]:
        if response.status_code == 200:
            want = min(len(buf), int(response.headers["content-length"]))
            got = 0
            while got < want:
                got += response.raw._fp.readinto(buf[got:want]) or want
            return None, got
        return original(response, start, end, buf)

    setattr_(fg.FastGet, "_read", staticmethod(read))


def _lean_get_ignores_the_range_start(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Only the length of the answered range is checked, not where it starts."""
    from cloudckpt.stores import _s3_fast_get as fg

    def matches(first: int, last: int, total: int, start: int, end: int) -> bool:
        return last - first == end - start or total == last + 1

    setattr_(fg, "_range_matches", matches)


def _lean_get_reuses_a_refused_connection(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A refused answer's connection goes back to the pool, its body unread."""
    from cloudckpt.stores import _s3_fast_get as fg

    setattr_(fg, "_discard", lambda raw: raw.release_conn())


def _lean_get_learns_from_any_get(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The request's shape is promoted as botocore sends it, before its answer is known."""
    from urllib.parse import unquote, urlsplit

    from cloudckpt.stores import _s3_fast_get as fg

    def seen(self: Any, request: Any, **_: Any) -> None:
        self._pending.request = request
        path = unquote(urlsplit(request.url).path)
        full_key = path[len(self._bucket) + 2 :]
        self.promote(full_key, fg._text(request.headers["Range"]))

    setattr_(fg.FastGet, "_seen", seen)


def _lean_get_learns_from_an_answer_never_sent(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Any successful GetObject teaches the lean path, one a before-send handler answered
    (nothing sent) too."""
    from cloudckpt.stores import s3

    setattr_(s3, "_came_over_the_network", lambda resp: True)


def _lean_get_counts_every_fallback(setattr_: Callable[[Any, str, Any], None]) -> None:
    """Errors every client meets (throttling, a missing key) count toward turning the lean
    path off, as answers it cannot take do."""
    from cloudckpt.stores import _s3_fast_get as fg

    original = fg.FastGet._fell_back

    def fell_back(self: Any, why: str, counts: bool = True, rest: bool = False) -> None:
        original(self, why, True, rest)

    setattr_(fg.FastGet, "_fell_back", fell_back)


def _lean_get_keeps_trying_a_failing_store(setattr_: Callable[[Any, str, Any], None]) -> None:
    """The store's own trouble (a 503, a reset) does not rest the lean path: a store that
    fails every read gets a lean try besides botocore's on each."""
    from cloudckpt.stores import _s3_fast_get as fg

    original = fg.FastGet._fell_back

    def fell_back(self: Any, why: str, counts: bool = True, rest: bool = False) -> None:
        original(self, why, counts, False)

    setattr_(fg.FastGet, "_fell_back", fell_back)


_FAST = "tests/test_s3_fast_get.py"
_NOT_SIMULATED_LEAN = (
    "the simulation's stores are in memory: the S3 store's HTTP requests are not in it"
)

MUTANTS.update(
    {
        m.name: m
        for m in [
            Mutant(
                "lean-get-accepts-a-200",
                "the lean ranged GET accepts only a 206 (anything else: botocore's answer)",
                _lean_get_accepts_a_200,
                (f"{_FAST}::test_a_spoiled_answer_falls_back_to_botocores_bytes[200]",),
                why_not_simulated=_NOT_SIMULATED_LEAN,
            ),
            Mutant(
                "lean-get-ignores-the-range-start",
                "the lean ranged GET accepts only a Content-Range that starts where asked",
                _lean_get_ignores_the_range_start,
                (f"{_FAST}::test_a_spoiled_answer_falls_back_to_botocores_bytes[shifted]",),
                why_not_simulated=_NOT_SIMULATED_LEAN,
            ),
            Mutant(
                "lean-get-reuses-a-refused-connection",
                "a connection whose answer the lean GET refused is never used again",
                _lean_get_reuses_a_refused_connection,
                (f"{_FAST}::test_a_refused_answers_connection_is_never_used_again",),
                why_not_simulated=_NOT_SIMULATED_LEAN,
            ),
            Mutant(
                "lean-get-learns-from-any-get",
                "the lean GET learns the request's shape only from a botocore GET that succeeded",
                _lean_get_learns_from_any_get,
                (f"{_FAST}::test_nothing_is_learned_from_a_get_that_failed",),
                why_not_simulated=_NOT_SIMULATED_LEAN,
            ),
            Mutant(
                "lean-get-learns-from-an-answer-never-sent",
                "the lean GET learns only from a GetObject whose answer came over the network",
                _lean_get_learns_from_an_answer_never_sent,
                (f"{_FAST}::test_an_answer_that_never_went_over_the_network_teaches_nothing",),
                why_not_simulated=_NOT_SIMULATED_LEAN,
            ),
            Mutant(
                "lean-get-counts-every-fallback",
                "only answers the lean GET cannot take turn it off, not errors every client meets",
                _lean_get_counts_every_fallback,
                (
                    f"{_FAST}::test_answers_every_client_gets_do_not_turn_the_path_off",
                    f"{_FAST}::test_a_burst_of_throttling_does_not_turn_the_path_off",
                    f"{_FAST}::test_bodies_cut_short_do_not_turn_the_path_off",
                ),
                why_not_simulated=_NOT_SIMULATED_LEAN,
            ),
            Mutant(
                "lean-get-keeps-trying-a-failing-store",
                "the store's own trouble rests the lean GET until botocore reads again",
                _lean_get_keeps_trying_a_failing_store,
                (f"{_FAST}::test_a_store_that_fails_every_read_costs_one_lean_request_in_all",),
                why_not_simulated=_NOT_SIMULATED_LEAN,
            ),
        ]
    }
)
