"""Crash recovery: what becomes of the attempts a crashed process left in staging.

When a writer claims the run, each attempt a previous process left in its staging
directory (``StagingArea.journaled()``) is decided against the committed checkpoint
(module docstring of ``cloudckpt.staging``): a durable one newer than it is committed
first (a recovered save, run through the save queue); one of the committed step is a
candidate local copy (proven by content on use); the rest are removed. ``claim()`` is the
claim of ``resume()``; ``claim_if_needed()`` the save pipeline's ``prepare`` hook (the
first save of a writer that did not resume claims the run).
"""

from __future__ import annotations

import logging
import threading

from cloudckpt.committer import Committer
from cloudckpt.errors import CloudCkptError
from cloudckpt.localcopy import LocalCopies, adopt_leftover
from cloudckpt.protocol import Latest
from cloudckpt.savequeue import QueuedSave, SaveQueue
from cloudckpt.staging import COMMITTED, DURABLE, STAGED, Attempt

log = logging.getLogger("cloudckpt")


class Recovery:
    """The attempts left in staging by a crashed process, decided once, when the writer
    claims the run through ``committer`` (under ``commit_lock``, the save pipeline's);
    recovered saves run through ``queue`` (module docstring)."""

    def __init__(
        self,
        leftovers: list[Attempt],
        local: LocalCopies,
        committer: Committer,
        commit_lock: threading.Lock,
        queue: SaveQueue,
    ) -> None:
        self.leftovers = leftovers
        self.local = local
        self.committer = committer
        self.commit_lock = commit_lock
        self.queue = queue

    def claim(self) -> Latest | None:
        """Claim the run (fencing any older writer) and commit the recovered saves first;
        returns LATEST as claimed. A recovered save that fails is logged (its handle has
        it). Raises: NeedsRepairError, StoreError, CommitConflictError."""
        with self.commit_lock:
            recovered = self._recover(self.committer.claim())
        self.queue.drain()
        for job in recovered:
            try:
                job.handle.result()
            except CloudCkptError as exc:
                log.warning("could not commit recovered step %d: %s", job.handle.step, exc)
        return self.committer.latest

    def claim_if_needed(self) -> None:
        """Before every attempt: claim the run if no one has, and commit the recovered
        saves first (they are older), in this thread. Each reports to its own handle."""
        with self.commit_lock:
            recovered = []
            if self.committer.latest is None:
                recovered = self._recover(self.committer.claim())
        self.queue.run_now(recovered)

    def _recover(self, latest: Latest) -> list[QueuedSave]:
        """The saves to commit, queued first unless on the worker (``resume()``: the
        worker commits them first, ``claim()`` waits for their handles)."""
        jobs = self.decide(latest)
        if jobs and not self.queue.on_worker():
            self.queue.put_first(jobs)
        return jobs

    def decide(self, latest: Latest) -> list[QueuedSave]:
        """Decide every leftover against ``latest`` (just claimed); returns the saves to
        commit, oldest first, as the queue's recovered saves."""
        queue = self.queue
        committed_step = latest.current.step if latest.current else -1
        jobs = []
        for attempt in self.leftovers:
            if attempt.state == DURABLE and attempt.step > committed_step:
                log.warning("recovering step %d staged by a crashed process", attempt.step)
                jobs.append(queue.recovered(attempt))
            elif attempt.state in (STAGED, DURABLE, COMMITTED) and attempt.step == committed_step:
                # Committed, then the process died before keeping it as a local copy (or
                # before the journal said so): a candidate copy, proven by content on use
                # (a staged copy may be incomplete: what does not verify is downloaded).
                adopt_leftover(self.local, attempt)
            else:
                if attempt.state != COMMITTED:
                    log.info("abandoning step %d left in staging (%s)", attempt.step, attempt.state)
                attempt.remove()
        self.leftovers = []
        return jobs

    def abandon_all(self) -> None:
        """Remove every leftover unexamined (a multi-rank manager recovers nothing: the
        ranks' staged parts of one save cannot be matched up after a crash)."""
        for attempt in self.leftovers:
            log.info("abandoning step %d left in staging (%s)", attempt.step, attempt.state)
            attempt.remove()
        self.leftovers = []
