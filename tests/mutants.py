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
    from cloudckpt import protocol, reader

    original = reader.load_latest_for_reading

    def scanning(store):
        latest, from_records = original(store)
        if latest is None:
            return latest, from_records
        known = {r.commit_id for r in latest.retained()}
        found = []
        for obj in store.list(protocol.CKPT_PREFIX):
            if not obj.key.endswith(protocol.MANIFEST_NAME):
                continue
            with contextlib.suppress(Exception):
                data, _ = store.get(obj.key)
                manifest = protocol.parse_manifest(data)
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
    from cloudckpt import protocol

    original = protocol.parse_manifest

    def unchecked(data, record=None):
        if record is not None:
            record = dataclasses.replace(
                record,
                manifest_size=len(data),
                manifest_sha256=__import__("hashlib").sha256(data).hexdigest(),
            )
        return original(data, record)

    setattr_(protocol, "parse_manifest", unchecked)


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
    from cloudckpt import transfer

    setattr_(transfer._FileDownload, "finish", lambda self: transfer._fsync_path(self.target))


def _chunked_file_digest_unchecked(setattr_: Callable[[Any, str, Any], None]) -> None:
    """A chunked file is accepted once each chunk matches its name, whatever their order."""
    import os

    from cloudckpt import chunks

    def fsync_only(self):
        fd = os.open(self.target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    setattr_(chunks._Target, "finish", fsync_only)


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

    setattr_(fetch, "_chunk_ok", lambda data, ref: True)


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


_RESUME = "tests/test_resume_state.py"
_DCP = "tests/test_dcp.py"

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
            range(500, 800),  # hits 503, 555, 760 (python tools/mutation_scan.py)
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
            ("tests/test_chunks.py::test_a_save_never_names_a_reused_chunk_that_is_gone",),
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
            why_not_simulated=(
                "the simulation's readers restore into directories; the in-memory and DCP "
                "readers are guarded by the fast tests"
            ),
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
            why_not_simulated=(
                "the simulation's readers restore into directories; the in-memory and DCP "
                "readers are guarded by the fast tests"
            ),
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
    ]
}


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
