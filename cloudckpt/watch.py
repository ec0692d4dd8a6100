"""``watch``: a sidecar that uploads and commits the checkpoints a trainer writes to disk.

The trainer keeps writing checkpoints to its local output directory as it always did; the
watcher polls that directory, decides when each checkpoint is *complete*, snapshots it by
hard links (so the trainer may rotate it away at once) and hands it to a
``CheckpointManager``, which uploads and commits it. No change to the training code.

A checkpoint is taken as soon as the framework's own last write shows it complete; the
layouts and their rules are in ``cloudckpt.watch_layouts``.

Every rule also requires that no file vanished since the previous look (a directory being
deleted by rotation is never taken half-deleted). Files in the watched tree that belong to
no checkpoint are reported once (event ``ignored``), and a checkpoint that stays incomplete
for ``quiet_period``, or is incomplete when the watcher stops, once (event ``incomplete``).

Ordering and restart safety: the watcher only moves forward. On start it reads LATEST; a
candidate whose step is not above the committed step (or one already handed over) is never
uploaded, and every commit records ``{"watch": {"source", "kind"}}`` in the checkpoint's
metadata. A restarted watcher therefore re-uploads nothing that is committed, and an old
checkpoint can never become "current" again.

Stopping: ``stop()`` (the CLI calls it on SIGTERM/SIGINT) starts a final upload bounded by
``final_upload_timeout`` seconds: ``finish()`` keeps looking, takes every checkpoint that
is complete (or becomes complete while one is still visibly being written) and waits for
the uploads, until nothing is left or the time is up. What did not make it is listed in
``not_uploaded`` with where its files still are.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cloudckpt.committer import read_latest, refuse_foreign_data, run_has_data
from cloudckpt.errors import CloudCkptError, ConfigurationError, FencedError, NeedsRepairError
from cloudckpt.manager import CheckpointManager, ManagerBase
from cloudckpt.protocol import CorruptRecordError, Latest
from cloudckpt.retention import logged_eval_metrics
from cloudckpt.savequeue import SaveHandle
from cloudckpt.stores import Store, open_store
from cloudckpt.watch_layouts import (
    DS_LATEST,
    Candidate,
    Signature,
    Verdict,
    find_candidates,
    judge_candidate,
)

log = logging.getLogger("cloudckpt.watch")

MAX_TRIES = 3
FINAL_POLL = 0.1  # seconds between looks while stopping: the budget is short

EventSink = Callable[[dict[str, Any]], None]


@dataclasses.dataclass
class _Seen:
    sig: Signature
    since: float  # monotonic time the signature was first seen
    reported: bool = False  # "incomplete" said once


def _signature(c: Candidate) -> Signature | None:
    """(relative path, size, mtime_ns) of every file, or None if it vanished meanwhile."""
    try:
        if c.is_file:
            st = c.path.stat()
            return ((c.path.name, st.st_size, st.st_mtime_ns),)
        entries = []
        for dirpath, dirnames, filenames in os.walk(c.path, onerror=_raise):
            dirnames.sort()
            for name in filenames:
                full = Path(dirpath, name)
                st = full.stat()
                entries.append((full.relative_to(c.path).as_posix(), st.st_size, st.st_mtime_ns))
        return tuple(sorted(entries))
    except OSError:
        return None


def _raise(exc: OSError) -> None:
    raise exc


def _check_options(
    directory: Path,
    settle: float,
    quiet_period: float,
    final_upload_timeout: float,
    max_pending: int,
) -> None:
    """Raises ConfigurationError for a ``Watcher`` argument out of range."""
    if directory.exists() and not directory.is_dir():
        raise ConfigurationError(
            f"{directory} is not a directory",
            hint="Pass the trainer's output directory (it may also not exist yet)",
        )
    for name, value in (
        ("settle", settle),
        ("quiet_period", quiet_period),
        ("final_upload_timeout", final_upload_timeout),
    ):
        if value < 0:
            raise ConfigurationError(f"{name} must be >= 0 seconds")
    if max_pending < 1:
        raise ConfigurationError("max_pending must be >= 1")


def _watched_sources(latest: Latest) -> set[str]:
    """The sources (paths in the watched directory) of the run's checkpoints a watcher
    uploaded, retained or tombstoned: never uploaded again."""
    sources = set()
    for rec in [*latest.retained(), *(t.record for t in latest.tombstones)]:
        watch = rec.metadata.get("watch") if isinstance(rec.metadata, Mapping) else None
        if isinstance(watch, Mapping) and isinstance(watch.get("source"), str):
            sources.add(watch["source"])
    return sources


class Watcher:
    """Watch ``directory`` and commit each complete checkpoint to ``url``.

    Args:
        directory: the trainer's output directory. It may not exist yet: the watcher
            waits for it (event ``waiting``).
        url: the run URL; or a ``Store`` to save through (the watcher reads the run from
            it and its manager saves through it; the caller closes it after the watcher);
            or a ``CheckpointManager`` to use (the watcher then does not close it).
        settle: seconds a checkpoint's files must stay unchanged after it looks complete,
            for layouts whose last write is not final (several HF ranks, accelerate, a
            non-zip ``.ckpt``); the others are taken at once.
        quiet_period: seconds unchanged for ``accept_quiet_dirs``; also when an
            incomplete checkpoint is reported as abandoned.
        markers: file names that mark any directory complete.
        accept_quiet_dirs: also take directories that are merely quiet (see
            ``cloudckpt.watch_layouts``).
        final_upload_timeout: seconds ``stop()`` leaves for the final upload.
        max_pending: saves handed over and not yet committed at once (the watcher waits
            for a slot instead of blocking in ``save()``).
        on_event: called with a dict for every event (see ``docs/cli.md``).
        manager_options: passed to ``CheckpointManager`` (staging_dir, transfer, ...).
            Retention defaults to the run's current settings, so the watcher's claim does
            not change them.

    Raises (constructor): ConfigurationError (``directory`` is a file, a negative
    duration), NeedsRepairError (the run has data but no readable LATEST), NotARunError
    (the run location holds other data and no LATEST), StoreError.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        url: str | Store | ManagerBase,
        *,
        settle: float = 2.0,
        quiet_period: float = 30.0,
        markers: tuple[str, ...] = (".complete",),
        accept_quiet_dirs: bool = False,
        final_upload_timeout: float = 20.0,
        max_pending: int = 2,
        storage_options: Mapping[str, Any] | None = None,
        on_event: EventSink | None = None,
        **manager_options: Any,
    ) -> None:
        self.directory = Path(directory).expanduser().absolute()
        _check_options(self.directory, settle, quiet_period, final_upload_timeout, max_pending)
        self.settle = settle
        self.quiet_period = quiet_period
        self.markers = tuple(markers)
        self.accept_quiet_dirs = accept_quiet_dirs
        self.final_upload_timeout = final_upload_timeout
        self.max_pending = max_pending
        self._emit = on_event or (lambda event: None)
        self._stop = threading.Event()
        self._deadline: float | None = None  # monotonic; set by stop()
        self._budget: float | None = None  # seconds stop() gave
        self._seen: dict[str, _Seen] = {}
        self._done: set[str] = set()  # sources handed over, committed, skipped or given up
        self._tries: dict[str, int] = {}
        self._pending: list[tuple[SaveHandle, Candidate, Path]] = []  # + staged files
        self._reported: set[str] = set()  # directories whose loose files were reported
        self._loose: dict[str, list[str]] = {}  # filled by scan()
        self._waiting_announced = False
        # What the last poll left: complete but not handed over, complete but settling,
        # and incomplete but still being written.
        self._ready: list[tuple[Candidate, Verdict]] = []
        self._settling: list[tuple[Candidate, Verdict]] = []
        self._writing: list[tuple[Candidate, Verdict]] = []
        self._unfinished: list[tuple[Candidate, Verdict, _Seen]] = []  # incomplete ones
        self.committed: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []
        self.not_uploaded: list[dict[str, Any]] = []
        self.fenced: FencedError | None = None
        self._flushing = False  # close() has begun: no poll follows, so no retry either

        latest = self._open_run(url, storage_options, max_pending, manager_options)
        self.committed_step: int | None = None
        self.committed_sources: set[str] = set()
        if latest is not None:
            self.committed_step = latest.current.step if latest.current is not None else None
            self.committed_sources = _watched_sources(latest)
        self._floor = self.committed_step  # highest step committed or handed over

    def _open_run(
        self,
        url: str | Store | ManagerBase,
        storage_options: Mapping[str, Any] | None,
        max_pending: int,
        manager_options: dict[str, Any],
    ) -> Latest | None:
        """Set ``manager`` (built here unless given) and return the run's LATEST, read
        first (raises as the constructor says)."""
        if isinstance(url, ManagerBase):
            self.manager, self._owns_manager = url, False
            return self._read_run(self.manager.store)
        if isinstance(url, Store):
            latest = self._read_run(url)
            manager_options.setdefault("max_pending", max_pending)
            # A sidecar restores nothing itself: no local copies (docs/design.md §12).
            manager_options.setdefault("keep_local", 0)
            self.manager = CheckpointManager(url, **manager_options)
            self._owns_manager = True
            return latest
        store = open_store(url, storage_options)
        try:
            latest = self._read_run(store)
        finally:
            store.close()
        # Retention and grace left unset keep the run's own (the manager inherits them).
        manager_options.setdefault("max_pending", max_pending)
        manager_options.setdefault("keep_local", 0)  # a sidecar restores nothing itself
        self.manager = CheckpointManager(url, storage_options=storage_options, **manager_options)
        self._owns_manager = True
        return latest

    @staticmethod
    def _read_run(store: Any) -> Latest | None:
        try:
            head = read_latest(store)
        except CorruptRecordError as exc:
            raise NeedsRepairError(f"LATEST of {store.url} is unreadable: {exc}") from None
        if head is None:
            if run_has_data(store):
                raise NeedsRepairError(f"{store.url} holds checkpoints but no LATEST")
            refuse_foreign_data(store)  # refused now, not at the first upload
            return None
        return head.latest

    @property
    def in_flight(self) -> int:
        """Saves handed over whose upload has not finished."""
        return sum(not handle.done() for handle, _, _ in self._pending)

    # ---------------------------------------------------------------- discovery

    def scan(self) -> list[Candidate]:
        """Every checkpoint-like entry in the directory (complete or not). Also records,
        per directory, the files that belong to no checkpoint (``_loose``)."""
        found, self._loose = find_candidates(self.directory, self.markers, self.accept_quiet_dirs)
        return found

    def judge(self, c: Candidate, sig: Signature) -> Verdict:
        """The completeness rule of ``c``'s layout (``watch_layouts``); the caller applies
        ``settle``."""
        return judge_candidate(
            c, sig, settle=self.settle, quiet_period=self.quiet_period, markers=self.markers
        )

    # ---------------------------------------------------------------- the loop

    def poll(self) -> int:
        """One pass: reap finished uploads, then hand over every newly complete checkpoint
        (oldest first, while fewer than ``max_pending`` are in flight and, after
        ``stop()``, before its deadline). Returns how many were handed over."""
        self._reap()
        self._ready, self._settling, self._writing, self._unfinished = [], [], [], []
        if self.fenced is not None or not self._directory_exists():
            return 0
        now = time.monotonic()
        ready: list[tuple[int, Candidate, Signature, Verdict]] = []  # (its step first)
        present = set()
        for c in self.scan():
            present.add(c.source)
            if c.source in self._done:
                continue
            if c.step is None:
                self._skip(c, "no step number in its name (or marker)")
                continue
            if c.source in self.committed_sources:
                self._skip(c, "already committed (recorded in LATEST)", quiet=True)
                continue
            if (looked := self._look(c, now)) is not None:
                ready.append((c.step, *looked))
        for source in list(self._seen):
            if source not in present:
                del self._seen[source]
        self._report_loose()
        ready.sort(key=lambda r: (r[0], r[1].source))
        self._ready = [(c, v) for _, c, _, v in ready]
        handed = 0
        for step, c, sig, verdict in ready:
            if self._floor is not None and step <= self._floor:
                self._ready.remove((c, verdict))
                self._skip(
                    c, f"step {step} is not newer than step {self._floor}, already committed"
                )
                continue
            if self._deadline_passed() or self.in_flight >= self.max_pending:
                break  # taken at a later look (saving never blocks the loop)
            self._ready.remove((c, verdict))
            if self._hand_over(c, step, sig, verdict):
                handed += 1
            elif c.source not in self._done:  # it changed meanwhile: look again
                self._settling.append((c, verdict))
        return handed

    def _look(self, c: Candidate, now: float) -> tuple[Candidate, Signature, Verdict] | None:
        """Judge ``c``; return it if it is complete and may be taken now."""
        sig = _signature(c)
        if sig is None:
            self._seen.pop(c.source, None)
            return None
        prev = self._seen.get(c.source)
        lost = False
        if prev is None or prev.sig != sig:
            # A file gone since the last look: a rotation deleting it, or a writer
            # replacing files. Never take it from this listing.
            lost = prev is not None and not {r for r, _, _ in prev.sig} <= {r for r, _, _ in sig}
            prev = self._seen[c.source] = _Seen(sig, now, prev.reported if prev else False)
        verdict = self.judge(c, sig)
        quiet_for = now - prev.since
        if not verdict.complete:
            if quiet_for < max(self.settle, FINAL_POLL * 2):
                self._writing.append((c, verdict))
            elif quiet_for >= self.quiet_period and not prev.reported:
                prev.reported = True
                self._incomplete(
                    c, verdict, f"unchanged for {quiet_for:.0f}s: its writer may have stopped "
                    "half-way; not uploaded unless it completes"
                )  # fmt: skip
            self._unfinished.append((c, verdict, prev))
            return None
        if lost or quiet_for < verdict.settle:
            self._settling.append((c, verdict))
            return None
        return c, sig, verdict

    def _directory_exists(self) -> bool:
        if self.directory.is_dir():
            if self._waiting_announced:
                self._waiting_announced = False
                log.info("%s exists now; watching it", self.directory)
                self._emit({"event": "appeared", "directory": str(self.directory)})
            return True
        if not self._waiting_announced:
            self._waiting_announced = True
            log.info("%s does not exist yet; waiting for it", self.directory)
            self._emit({"event": "waiting", "directory": str(self.directory)})
        return False

    def _report_loose(self) -> None:
        """Say once per directory that its files belong to no checkpoint (not uploaded)."""
        for rel, names in self._loose.items():
            if rel in self._reported:
                continue
            self._reported.add(rel)
            reason = (
                "they belong to no checkpoint layout watch recognises (HF checkpoint-N/, "
                "Lightning *.ckpt, accelerate checkpoint_N/, DeepSpeed global_stepN/, a directory holding a "
                f"{' or '.join(self.markers) or 'marker'} file)"
            )
            log.info("not uploading the files in %s (%s): %s", rel, ", ".join(names[:5]), reason)
            self._emit(
                {
                    "event": "ignored",
                    "source": rel,
                    "files": names[:5],
                    "count": len(names),
                    "reason": reason,
                }
            )

    def _incomplete(self, c: Candidate, verdict: Verdict, why: str) -> None:
        reason = f"{verdict.rule}; {why}"
        log.warning("%s is incomplete: %s", c.source, reason)
        self._emit({"event": "incomplete", "source": c.source, "step": c.step, "reason": reason})

    def _skip(self, c: Candidate, reason: str, *, quiet: bool = False) -> None:
        self._done.add(c.source)
        if not quiet:
            log.info("not uploading %s: %s", c.source, reason)
        self._emit({"event": "skipped", "source": c.source, "step": c.step, "reason": reason})

    def _hand_over(self, c: Candidate, step: int, sig: Signature, verdict: Verdict) -> bool:
        """Snapshot ``c`` into a save of ``step`` (``c.step``, known) and queue it. False if
        it changed or vanished."""
        metadata = {"watch": {"source": c.source, "kind": c.kind}}
        try:
            handle = self.manager.save(step, metadata, metrics=_metrics(c))
            with handle as staging:
                if c.kind == "deepspeed":  # DeepSpeed's layout: the tag directory + latest
                    _link_snapshot(c, sig, staging / c.path.name)
                    (staging / DS_LATEST).write_text(c.path.name)
                else:
                    _link_snapshot(c, sig, staging)
        except _Changed as exc:
            self._seen.pop(c.source, None)
            if not c.path.exists():
                self._skip(c, f"deleted by its writer (rotation?) while being copied ({exc})")
            else:
                log.info("%s changed while being snapshotted (%s); will look again", c.source, exc)
            return False
        except FencedError as exc:
            self.fenced = exc
            self._emit({"event": "fenced", "source": c.source, "message": str(exc)})
            return False
        except (OSError, CloudCkptError) as exc:  # staging disk full, unreadable file...
            self._failed(c, exc)
            return False
        handle.mark_reported()  # _reap reports (and retries) it; the manager need not
        self._done.add(c.source)
        self._floor = step
        self._pending.append((handle, c, staging))
        size = sum(s for _, s, _ in sig)
        log.info(
            "uploading %s as step %d (%d files, %d bytes; complete: %s)",
            c.source, c.step, len(sig), size, verdict.rule,
        )  # fmt: skip
        self._emit(
            {
                "event": "queued",
                "source": c.source,
                "kind": c.kind,
                "step": c.step,
                "files": len(sig),
                "bytes": size,
                "rule": verdict.rule,
            }
        )
        return True

    def _reap(self) -> None:
        still = []
        for handle, c, staged in self._pending:
            if not handle.done():
                still.append((handle, c, staged))
                continue
            exc = handle.exception()
            if exc is None:
                info = handle.result()
                if self.committed_step is None or info.step > self.committed_step:
                    self.committed_step = info.step
                self.committed_sources.add(c.source)
                event = {
                    "event": "committed",
                    "source": c.source,
                    "step": info.step,
                    "commit_id": info.commit_id,
                    "files": info.num_files,
                    "bytes": info.total_bytes,
                    "bytes_uploaded": info.bytes_uploaded,
                    "bytes_reused": info.bytes_reused,
                    "bytes_resumed": info.bytes_resumed,
                    "commit_seconds": round(info.commit_seconds, 3),
                }
                self.committed.append(event)
                log.info(
                    "committed %s as step %d in %.1fs", c.source, info.step, info.commit_seconds
                )
                self._emit(event)
            elif isinstance(exc, FencedError):
                self.fenced = exc
                self._emit({"event": "fenced", "source": c.source, "message": str(exc)})
            else:
                self._failed(c, exc)
        self._pending = still

    def _failed(self, c: Candidate, exc: BaseException) -> None:
        tries = self._tries[c.source] = self._tries.get(c.source, 0) + 1
        retry = tries < MAX_TRIES and not self._stop.is_set() and not self._flushing
        event = {
            "event": "failed",
            "source": c.source,
            "step": c.step,
            "error": getattr(exc, "message", None) or str(exc),
            "will_retry": retry,
        }
        self.failed.append(event)
        log.error(
            "upload of %s failed (%s)%s",
            c.source,
            exc,
            "; will retry" if retry else "; giving up on it",
        )
        self._emit(event)
        if retry:
            self._done.discard(c.source)
            self._seen.pop(c.source, None)
        else:
            self._done.add(c.source)
        steps = [handle.step for handle, p, _ in self._pending if p is not c]
        if self.committed_step is not None:
            steps.append(self.committed_step)
        self._floor = max(steps) if steps else None

    def run(self, poll_interval: float = 1.0, *, once: bool = False) -> None:
        """Poll until ``stop()``, then ``finish()`` within its budget; with ``once``, take
        what is complete now (waiting out ``settle`` where a rule needs it), then flush."""
        try:
            if once:
                self._stop.set()  # no deadline: wait for every upload
            else:
                while not self._stop.is_set() and self.fenced is None:
                    self.poll()
                    self._stop.wait(poll_interval)
            self.finish(wait_for_writers=not once)
        finally:
            self.close(timeout=0 if self._deadline_passed() else None)

    def stop(self, budget: float | None = None) -> None:
        """Stop the regular looking; ``run()`` then calls ``finish()``, which has ``budget``
        seconds from now (default ``final_upload_timeout``) to upload what is complete.
        Safe to call from a signal handler."""
        if not self._stop.is_set():
            self._budget = self.final_upload_timeout if budget is None else budget
            self._deadline = time.monotonic() + self._budget
        self._stop.set()

    def _deadline_passed(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def finish(self, *, wait_for_writers: bool = True) -> None:
        """The final upload: look again and again (``FINAL_POLL``) and hand over every
        checkpoint that is complete, waiting for its upload, until nothing complete is
        left, or the deadline ``stop()`` set passes. With ``wait_for_writers``, a
        checkpoint still visibly being written (changed within ``settle``) is waited for
        too. Fills ``not_uploaded``."""
        self._emit(
            {
                "event": "flushing",
                "pending": self.in_flight,
                "budget_seconds": None
                if self._deadline is None
                else round(max(0.0, self._deadline - time.monotonic()), 3),
            }
        )
        while True:
            self.poll()
            if self.fenced is not None:
                break
            busy = self._pending or self._ready or self._settling
            if not busy and not (wait_for_writers and self._writing):
                break
            if self._deadline_passed():
                break
            remaining = None if self._deadline is None else self._deadline - time.monotonic()
            time.sleep(FINAL_POLL if remaining is None else max(0.0, min(FINAL_POLL, remaining)))
        self._reap()
        self.not_uploaded = [] if self.fenced else self.outstanding(writers=wait_for_writers)
        for item in self.not_uploaded:
            log.warning("not uploaded: %s (step %s): %s; its files are in %s",
                        item["source"], item["step"], item["reason"], item["path"])  # fmt: skip
            self._emit(item)
        left = {item["source"] for item in self.not_uploaded}
        for c, verdict, seen in self._unfinished:
            if c.source not in left and not seen.reported:
                seen.reported = True
                self._incomplete(c, verdict, "still incomplete when the watcher stopped")

    def outstanding(self, *, writers: bool = True) -> list[dict[str, Any]]:
        """What is not committed (yet): uploads in flight, complete checkpoints not handed
        over or still settling and, with ``writers``, checkpoints still being written; each
        as a ``not_uploaded`` event naming where its files are. Safe from a signal handler."""
        budget = (
            "the final upload budget" if self._budget is None else f"the {self._budget:g}s budget"
        )
        out = []
        for handle, c, staged in self._pending:
            if handle.done():
                continue  # reported by the next reap
            where = c.path if c.path.exists() else staged / c.path.name if c.is_file else staged
            out.append(_leftover(c, where, f"its upload did not finish within {budget}"))
        for c, v in self._ready:
            out.append(
                _leftover(c, c.path, f"complete ({v.rule}) but not uploaded within {budget}")
            )
        for c, v in self._settling:
            out.append(
                _leftover(
                    c, c.path, f"complete but still changing ({v.rule}) when {budget} ran out"
                )
            )
        for c, v in self._writing if writers else ():
            out.append(
                _leftover(c, c.path, f"still being written ({v.rule}) when {budget} ran out")
            )
        return out

    @property
    def given_up(self) -> list[dict[str, Any]]:
        """The last ``failed`` event of each checkpoint whose upload failed and that was
        not committed afterwards (retries exhausted, or the watcher stopped before the
        next try): after ``close()``, what did not reach the store."""
        last = {event["source"]: event for event in self.failed}
        return [e for source, e in last.items() if source not in self.committed_sources]

    def close(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` for the saves handed over (reporting each), then release
        the manager. If some are still uploading, the manager is left running: its
        threads cannot be interrupted, so the caller should end the process (the CLI
        does, with ``os._exit``, so that nothing can commit after it reported).
        Failed uploads are reported as events (``failed``; ``given_up``), not raised.

        Raises: a failure of a save that others made through a manager passed in
        (``manager.wait()``'s).
        """
        self._flushing = True  # no poll follows: a failure from here on is final
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle, _, _ in self._pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(cf.TimeoutError):
                handle.exception(remaining)
        self._reap()
        if self._pending:
            return
        # The watcher's own saves were reported by _reap (they are marked reported when
        # handed over), so the manager raises none of them.
        if self._owns_manager:
            self.manager.close()
        else:
            self.manager.wait()


def _leftover(c: Candidate, where: Path, reason: str) -> dict[str, Any]:
    return {
        "event": "not_uploaded",
        "source": c.source,
        "step": c.step,
        "path": str(where),
        "reason": reason,
    }


class _Changed(Exception):
    """The checkpoint changed between the stability check and the snapshot."""


def _metrics(c: Candidate) -> dict[str, Any]:
    """What to record as the checkpoint's metrics: for a Hugging Face ``checkpoint-N``, the
    evaluation metrics the Trainer logged at step N (``trainer_state.json``'s
    ``log_history``; the snapshot that follows fails if the file changes meanwhile)."""
    if c.kind != "hf" or c.step is None:
        return {}
    try:
        state = json.loads((c.path / "trainer_state.json").read_bytes())
    except (OSError, ValueError):
        return {}
    return logged_eval_metrics(
        state.get("log_history") if isinstance(state, dict) else None, c.step
    )


def _link_snapshot(c: Candidate, sig: Signature, staging: Path) -> None:
    """Hard-link (else copy) exactly the files of ``sig`` into ``staging`` and check that
    what was linked is what was judged complete; raise _Changed if not."""
    for rel, size, mtime_ns in sig:
        src = c.path if c.is_file else c.path / rel
        dst = staging / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dst, follow_symlinks=True)
        except FileNotFoundError:
            raise _Changed(f"{rel} disappeared") from None
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            try:
                shutil.copy2(src, dst)
            except FileNotFoundError:
                raise _Changed(f"{rel} disappeared") from None
        st = dst.stat()
        if (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
            raise _Changed(f"{rel} was modified")
    if not c.is_file:
        now = _signature(c)
        if now is None or {r for r, _, _ in now} != {r for r, _, _ in sig}:
            raise _Changed("its file list changed")
