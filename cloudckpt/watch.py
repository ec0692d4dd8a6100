"""``watch``: a sidecar that uploads and commits the checkpoints a trainer writes to disk.

The trainer keeps writing checkpoints to its local output directory as it always did; the
watcher polls that directory, decides when each checkpoint is *finished*, snapshots it by
hard links (so the trainer may rotate it away at once) and hands it to a
``CheckpointManager``, which uploads and commits it. No change to the training code.

What counts as a checkpoint, and when it is finished (every rule also requires the files'
names, sizes and mtimes to have stayed the same for ``settle`` seconds):

``checkpoint-N/`` (Hugging Face ``Trainer``)
    ``trainer_state.json`` exists and parses. ``Trainer._save_checkpoint`` writes the model,
    then optimizer, scheduler, scaler and RNG state, and ``trainer_state.json`` last, so a
    directory without it (a trainer killed half-way) is never complete. The settle period
    covers ranks that still write shards after rank 0 wrote the state.
``*.ckpt`` files (PyTorch Lightning ``ModelCheckpoint``; the step comes from ``step=S``)
    A regular file (not a ``last.ckpt`` link), and when it is a zip archive (what
    ``torch.save`` writes) its central directory, written last, must be readable: a file
    cut short by a crash has none. Names without ``step=`` (``last.ckpt``) are skipped.
``*.ckpt/`` directories (Lightning sharded/distributed checkpoints)
    Contain ``meta.pt`` (Lightning) or ``.metadata`` (torch.distributed.checkpoint), which
    the coordinator writes after every shard.
any other directory with a marker file (default ``.complete``)
    The writer's own "done" signal. The step is the marker's content (an integer, or JSON
    with ``"step"``) or else the number the directory name ends with.
any directory whose name ends with a number, quiet for ``settle`` (opt-in only)
    ``accept_quiet_dirs=True``. Beware: a writer killed half-way leaves a directory that is
    quiet forever, and this rule would commit it. Prefer markers.

Ordering and restart safety: the watcher only moves forward. On start it reads LATEST; a
candidate whose step is not above the committed step (or one already handed over) is never
uploaded, and every commit records ``{"watch": {"source", "kind"}}`` in the checkpoint's
metadata. A restarted watcher therefore re-uploads nothing that is committed, and an old
checkpoint can never become "current" again.

``stop()`` (the CLI calls it on SIGTERM/SIGINT) stops scanning; ``close()`` then waits for
every checkpoint already handed over to commit (a flush) before returning.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import threading
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cloudckpt.committer import read_latest, run_has_data
from cloudckpt.errors import CloudCkptError, ConfigurationError, FencedError, NeedsRepairError
from cloudckpt.manager import CheckpointManager, SaveHandle
from cloudckpt.protocol import CorruptRecordError, Latest
from cloudckpt.stores import open_store

log = logging.getLogger("cloudckpt.watch")

HF_DIR = re.compile(r"^checkpoint-(\d+)$")
LIGHTNING_STEP = re.compile(r"(?:^|[-_])step=(\d+)")
TRAILING_NUMBER = re.compile(r"(\d+)$")
HF_STATE = "trainer_state.json"
SHARDED_DONE = ("meta.pt", ".metadata")
TEMP_SUFFIXES = (".tmp", ".temp", ".part", ".partial", ".incomplete", ".lock")
MAX_DEPTH = 4  # how deep *.ckpt files are looked for (lightning_logs/version_0/checkpoints)
MAX_TRIES = 3

Signature = tuple[tuple[str, int, int], ...]
EventSink = Callable[[dict[str, Any]], None]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Something in the watched directory that is, or will become, a checkpoint."""

    path: Path
    source: str  # path relative to the watched directory, '/'-separated
    kind: str  # "hf", "lightning", "lightning-dir", "marker", "quiet"
    step: int | None

    @property
    def is_file(self) -> bool:
        return self.kind == "lightning"


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


def _zip_complete(path: Path) -> bool:
    """A zip archive (torch.save's format) is complete only once its central directory,
    written last, is there. Files that are not zip archives pass (nothing to check)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"PK\x03\x04":
            return True
        with zipfile.ZipFile(path) as z:
            z.namelist()
        return True
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return False


def _marker_step(path: Path) -> int | None:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return None
    if text.isdigit():
        return int(text)
    try:
        body = json.loads(text) if text else None
    except ValueError:
        return None
    step = body.get("step") if isinstance(body, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


class Watcher:
    """Watch ``directory`` and commit each finished checkpoint to ``url``.

    Args:
        directory: the trainer's output directory.
        url: the run URL (or a ``CheckpointManager`` to use; the watcher then does not
            close it).
        settle: seconds a checkpoint's files must stay unchanged before it is taken.
        markers: file names that mark any directory complete.
        accept_quiet_dirs: also take directories that are merely quiet (see module doc).
        on_event: called with a dict for every event (queued, committed, skipped, failed).
        manager_options: passed to ``CheckpointManager`` (staging_dir, transfer, ...).
            Retention defaults to the run's current settings, so the watcher's claim does
            not change them.

    Raises (constructor): ConfigurationError (not a directory), NeedsRepairError (the run
    has data but no readable LATEST), StoreError.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        url: str | CheckpointManager,
        *,
        settle: float = 30.0,
        markers: tuple[str, ...] = (".complete",),
        accept_quiet_dirs: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        on_event: EventSink | None = None,
        **manager_options: Any,
    ) -> None:
        self.directory = Path(directory).expanduser().absolute()
        if not self.directory.is_dir():
            raise ConfigurationError(
                f"{self.directory} is not a directory",
                hint="Pass the trainer's output directory (create it first if training has "
                "not started yet)",
            )
        if settle < 0:
            raise ConfigurationError("settle must be >= 0 seconds")
        self.settle = settle
        self.markers = tuple(markers)
        self.accept_quiet_dirs = accept_quiet_dirs
        self._emit = on_event or (lambda event: None)
        self._stop = threading.Event()
        self._seen: dict[str, tuple[Signature, float]] = {}
        self._done: set[str] = set()  # sources handed over, committed, skipped or given up
        self._tries: dict[str, int] = {}
        self._pending: list[tuple[SaveHandle, Candidate]] = []
        self.committed: list[dict[str, Any]] = []
        self.failed: list[dict[str, Any]] = []
        self.fenced: FencedError | None = None
        self._flushing = False  # close() has begun: no poll follows, so no retry either

        if isinstance(url, CheckpointManager):
            self.manager, self._owns_manager = url, False
            latest = self._read_run(self.manager.store)
        else:
            store = open_store(url, storage_options)
            try:
                latest = self._read_run(store)
            finally:
                store.close()
            # Retention and grace left unset keep the run's own (the manager inherits them).
            manager_options.setdefault("max_pending", 2)
            self.manager = CheckpointManager(
                url, storage_options=storage_options, **manager_options
            )
            self._owns_manager = True
        self.committed_step: int | None = None
        self.committed_sources: set[str] = set()
        if latest is not None:
            if latest.current is not None:
                self.committed_step = latest.current.step
            for rec in [*latest.retained(), *(t.record for t in latest.tombstones)]:
                watch = rec.metadata.get("watch") if isinstance(rec.metadata, Mapping) else None
                if isinstance(watch, Mapping) and isinstance(watch.get("source"), str):
                    self.committed_sources.add(watch["source"])
        self._floor = self.committed_step  # highest step committed or handed over

    @staticmethod
    def _read_run(store: Any) -> Latest | None:
        try:
            head = read_latest(store)
        except CorruptRecordError as exc:
            raise NeedsRepairError(f"LATEST of {store.url} is unreadable: {exc}") from None
        if head is None:
            if run_has_data(store):
                raise NeedsRepairError(f"{store.url} holds checkpoints but no LATEST")
            return None
        return head.latest

    # ---------------------------------------------------------------- discovery

    def scan(self) -> list[Candidate]:
        """Every checkpoint-like entry in the directory (finished or not)."""
        found: list[Candidate] = []
        self._scan_dir(self.directory, 0, found)
        return found

    def _scan_dir(self, root: Path, depth: int, found: list[Candidate]) -> None:
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            name = entry.name
            if name.startswith(".") or name.startswith("tmp-") or name.endswith(TEMP_SUFFIXES):
                continue
            path = Path(entry.path)
            source = path.relative_to(self.directory).as_posix()
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
                is_file = entry.is_file(follow_symlinks=False)
            except OSError:
                continue
            if is_file and name.endswith(".ckpt"):
                m = LIGHTNING_STEP.search(name[: -len(".ckpt")])
                found.append(Candidate(path, source, "lightning", int(m.group(1)) if m else None))
            if not is_dir:
                continue
            if depth == 0 and (m := HF_DIR.match(name)):
                found.append(Candidate(path, source, "hf", int(m.group(1))))
            elif name.endswith(".ckpt"):
                m = LIGHTNING_STEP.search(name[: -len(".ckpt")])
                found.append(
                    Candidate(path, source, "lightning-dir", int(m.group(1)) if m else None)
                )
            elif marker := next((mk for mk in self.markers if (path / mk).is_file()), None):
                step = _marker_step(path / marker)
                if step is None and (m := TRAILING_NUMBER.search(name)):
                    step = int(m.group(1))
                found.append(Candidate(path, source, "marker", step))
            elif self.accept_quiet_dirs and depth == 0 and (m := TRAILING_NUMBER.search(name)):
                found.append(Candidate(path, source, "quiet", int(m.group(1))))
            elif depth < MAX_DEPTH:
                self._scan_dir(path, depth + 1, found)

    def _finished(self, c: Candidate, sig: Signature) -> bool:
        """The kind-specific completeness rule (the settle period is checked by the caller)."""
        names = {rel for rel, _, _ in sig}
        if c.kind == "hf":
            if HF_STATE not in names:
                return False
            try:
                json.loads((c.path / HF_STATE).read_bytes())
            except (OSError, ValueError):
                return False
            return True
        if c.kind == "lightning":
            return sig[0][1] > 0 and _zip_complete(c.path)
        if c.kind == "lightning-dir":
            return any(n in names for n in SHARDED_DONE)
        if c.kind == "marker":
            return any(n in names for n in self.markers)
        return c.kind == "quiet" and bool(sig)

    # ---------------------------------------------------------------- the loop

    def poll(self) -> int:
        """One pass: reap finished uploads, then hand over every newly finished checkpoint.
        Returns how many were handed over."""
        self._reap()
        if self.fenced is not None:
            return 0
        now = time.monotonic()
        ready: list[tuple[Candidate, Signature]] = []
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
            sig = _signature(c)
            if sig is None:
                self._seen.pop(c.source, None)
                continue
            prev = self._seen.get(c.source)
            if prev is None or prev[0] != sig:
                self._seen[c.source] = (sig, now)
                if self.settle > 0:
                    continue
            elif now - prev[1] < self.settle:
                continue
            if self._finished(c, sig):
                ready.append((c, sig))
        for source in list(self._seen):
            if source not in present:
                del self._seen[source]
        handed = 0
        for c, sig in sorted(ready, key=lambda r: (r[0].step, r[0].source)):
            if self._stop.is_set():
                break
            if self._floor is not None and c.step <= self._floor:
                self._skip(
                    c, f"step {c.step} is not newer than step {self._floor}, already committed"
                )
                continue
            if self._hand_over(c, sig):
                handed += 1
        return handed

    def _skip(self, c: Candidate, reason: str, *, quiet: bool = False) -> None:
        self._done.add(c.source)
        if not quiet:
            log.info("not uploading %s: %s", c.source, reason)
        self._emit({"event": "skipped", "source": c.source, "step": c.step, "reason": reason})

    def _hand_over(self, c: Candidate, sig: Signature) -> bool:
        """Snapshot ``c`` into a save and queue it. False if it changed or vanished."""
        metadata = {"watch": {"source": c.source, "kind": c.kind}}
        try:
            handle = self.manager.save(c.step, metadata)
            with handle as staging:
                _link_snapshot(c, sig, staging)
        except _Changed as exc:
            log.info("%s changed while being snapshotted (%s); will look again", c.source, exc)
            self._seen.pop(c.source, None)
            return False
        except FencedError as exc:
            self.fenced = exc
            self._emit({"event": "fenced", "source": c.source, "message": str(exc)})
            return False
        except (OSError, CloudCkptError) as exc:  # staging disk full, unreadable file...
            self._failed(c, exc)
            return False
        handle._reported = True  # _reap reports (and retries) it; the manager need not
        self._done.add(c.source)
        self._floor = c.step
        self._pending.append((handle, c))
        size = sum(s for _, s, _ in sig)
        log.info("uploading %s as step %d (%d files, %d bytes)", c.source, c.step, len(sig), size)
        self._emit(
            {
                "event": "queued",
                "source": c.source,
                "kind": c.kind,
                "step": c.step,
                "files": len(sig),
                "bytes": size,
            }
        )
        return True

    def _reap(self, wait: bool = False) -> None:
        still = []
        for handle, c in self._pending:
            if not wait and not handle.done():
                still.append((handle, c))
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
        log.error("upload of %s failed (%s)%s", c.source, exc, "; will retry" if retry else "")
        self._emit(event)
        if retry:
            self._done.discard(c.source)
            self._seen.pop(c.source, None)
        else:
            self._done.add(c.source)
        steps = [p.step for _, p in self._pending if p is not c]
        if self.committed_step is not None:
            steps.append(self.committed_step)
        self._floor = max(steps) if steps else None

    def run(self, poll_interval: float = 5.0, *, once: bool = False) -> None:
        """Poll until ``stop()`` (or, with ``once``, for one settle period), then flush."""
        try:
            if once:
                self.poll()
                if self.settle > 0 and not self._stop.wait(self.settle):
                    self.poll()
            else:
                while not self._stop.is_set() and self.fenced is None:
                    self.poll()
                    self._stop.wait(poll_interval)
        finally:
            self.close()

    def stop(self) -> None:
        """Stop scanning; ``run()`` then flushes what was handed over and returns."""
        self._stop.set()

    @property
    def given_up(self) -> list[dict[str, Any]]:
        """The last ``failed`` event of each checkpoint whose upload failed and that was
        not committed afterwards (retries exhausted, or the watcher stopped before the
        next try): after ``close()``, what did not reach the store."""
        last = {event["source"]: event for event in self.failed}
        return [e for source, e in last.items() if source not in self.committed_sources]

    def close(self, timeout: float | None = None) -> None:
        """Wait for every handed-over checkpoint to commit (or fail), then release.
        Failed uploads are reported as events (``failed``, ``given_up``), not raised.

        Raises: TimeoutError; a failure of a save that others made through a manager
        passed in (``manager.wait()``'s).
        """
        self._emit({"event": "flushing", "pending": len(self._pending)})
        self._flushing = True
        # The watcher's own saves are reported by _reap below (they are marked reported
        # when handed over), so the manager raises none of them.
        if self._owns_manager:
            self.manager.close(timeout)
        else:
            self.manager.wait(timeout)
        self._reap(wait=True)


class _Changed(Exception):
    """The checkpoint changed between the stability check and the snapshot."""


def _link_snapshot(c: Candidate, sig: Signature, staging: Path) -> None:
    """Hard-link (else copy) exactly the files of ``sig`` into ``staging`` and check that
    what was linked is what was judged finished; raise _Changed if not."""
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
