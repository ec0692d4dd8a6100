"""A save whose commit landed is reported committed, whatever fails after it (issue 28
item 3, invariant I6): the staging disk filling at the journal's ``committed`` write."""

from __future__ import annotations

import errno
import logging

import pytest

from cloudckpt import staging


@pytest.fixture
def full_disk_at_committed(monkeypatch):
    """The journal's ``committed`` write fails with ENOSPC (the real write path: its
    ``open`` of the temporary file raises); every other journal write works."""
    real_set_state = staging.Attempt.set_state
    real_open = open
    failing = {"on": False, "hit": 0}

    def fake_open(path, *args, **kwargs):
        if failing["on"] and str(path).endswith("journal.json.tmp"):
            failing["hit"] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)

    def set_state(self, state, **kwargs):
        failing["on"] = state == staging.COMMITTED
        try:
            return real_set_state(self, state, **kwargs)
        finally:
            failing["on"] = False

    monkeypatch.setattr(staging, "open", fake_open, raising=False)
    monkeypatch.setattr(staging.Attempt, "set_state", set_state)
    return failing


@pytest.mark.parametrize("how", ["save", "save_dir"])
def test_a_full_disk_at_the_committed_journal_write_reports_the_save_committed(
    memory_target, manager_factory, tmp_path, full_disk_at_committed, caplog, how
):
    mgr = manager_factory(memory_target)
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.bin").write_bytes(b"weights" * 1000)
    if how == "save":
        handle = mgr.save(step=3)
        with handle as d:
            (d / "model.bin").write_bytes(b"weights" * 1000)
    else:
        handle = mgr.save_dir(step=3, src=src)
    with caplog.at_level(logging.WARNING, logger="cloudckpt"):
        mgr.wait(timeout=60)  # a background save: wait() must not raise
        info = handle.result(timeout=60)
    assert full_disk_at_committed["hit"] == 1
    assert info.step == 3
    assert info.warnings and "step 3 is committed" in info.warnings[0]
    assert "staging disk is full" in info.warnings[0]
    assert "othing was committed" not in info.warnings[0]
    assert any("step 3 is committed" in r.getMessage() for r in caplog.records)
    assert mgr.latest().step == 3  # current on the store
    restored = mgr.restore(into=tmp_path / "back")
    assert (restored.path / "model.bin").read_bytes() == b"weights" * 1000
    mgr.close(timeout=60)  # close() re-raises unreported failures: there is none


def test_save_state_with_a_full_disk_at_the_committed_journal_write_is_committed(
    memory_target, manager_factory, full_disk_at_committed
):
    """save_state keeps its local copy on a thread of its own after the commit: the same
    failure there costs the copy only (this path was already right; kept as a guard)."""
    import torch

    from cloudckpt.integrations.torch import save_state

    mgr = manager_factory(memory_target, keep_local=1)
    info = save_state(mgr, 5, {"w": torch.arange(10)}).result(timeout=60)
    mgr.wait(timeout=60)
    assert info.step == 5 and mgr.latest().step == 5
    mgr.close(timeout=60)
