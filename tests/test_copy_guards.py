"""The rules of `cp` (copy_checkpoint) that nothing else would notice breaking (issue 28,
"the guards must keep up"; the mutants in tests/mutants.py):

- every file read from the source is checked against the digest its manifest records
  before the copy commits: chunks that each match their name but assemble another file
  (swapped, or a whole file stored under another's digest) never reach the destination;
- a chunk the destination holds is named instead of sent only if a checkpoint the
  destination retains names it (a dropped checkpoint's chunks may be collected by GC).
"""

from __future__ import annotations

import random

import pytest
from test_restore import WRONG_ORDER, _files, _rewrite_current_manifest, _save, _tree

from cloudckpt import CheckpointManager, CorruptionError, attempt_layout, protocol
from cloudckpt.catalog import copy_checkpoint
from cloudckpt.restore import restore
from cloudckpt.stores import open_store
from cloudckpt.transfer import TransferEngine
from cloudckpt.verify import verify_run


def _latest(store) -> protocol.Latest:
    return protocol.parse_latest(store.get(protocol.LATEST_KEY)[0])


@pytest.mark.parametrize("backend", ["memory", "s3"])
@pytest.mark.parametrize("case", sorted(WRONG_ORDER))
def test_cp_never_commits_files_that_do_not_match_their_digests(request, backend, case, tmp_path):
    """A source whose every chunk (every object) is intact and whose manifest verifies
    against LATEST, but whose bytes assemble other files: cp skips it for the older step,
    and with --step it commits nothing."""
    target = request.getfixturevalue(f"{backend}_target")
    so = target.storage_options
    src = open_store(target.url, so)
    chunking, edit = WRONG_ORDER[case]
    good = {"a.bin": b"step one"}
    with CheckpointManager(src, staging_dir=tmp_path / "s", chunking=chunking) as mgr:
        _save(mgr, 1, good)
        _save(mgr, 2, _files(case, random.Random(case)))
    _rewrite_current_manifest(src, edit)
    assert verify_run(src).ok  # consistent: only the file digests can tell
    dst_url = target.url.rsplit("/", 1)[0] + "/copy"
    dst = open_store(dst_url, so)

    with pytest.raises(CorruptionError, match="does not match its digest"):
        copy_checkpoint(src, dst, step=2)
    assert _latest(dst).current is None  # claimed, nothing committed
    result = copy_checkpoint(src, dst)
    assert result.step == 1 and [s.step for s in result.skipped] == [2]
    assert "does not match its digest" in result.skipped[0].reason
    assert [r.step for r in _latest(dst).retained()] == [1]
    with TransferEngine() as engine:
        restore(dst, tmp_path / "out", engine)
    assert _tree(tmp_path / "out") == good
    src.close()
    dst.close()


def test_cp_names_only_chunks_of_checkpoints_the_destination_retains(memory_target, tmp_path):
    """The destination retains step 20 and has dropped step 10 (a pending tombstone GC will
    delete). A copy of a checkpoint made of step 10's and step 20's chunks sends step 10's
    again and names step 20's; its first attempt commits (nothing refused and retried)."""
    rng = random.Random(7)
    old, kept, fresh = rng.randbytes(5000), rng.randbytes(6000), rng.randbytes(7000)
    base = memory_target.url.rsplit("/", 1)[0]
    dst = open_store(base + "/dest")
    with CheckpointManager(dst, staging_dir=tmp_path / "d", keep_last=1, auto_gc=False) as mgr:
        _save(mgr, 10, {"old.bin": old})
        _save(mgr, 20, {"kept.bin": kept})
    latest = _latest(dst)
    assert [r.step for r in latest.retained()] == [20]
    assert [t.record.step for t in latest.tombstones] == [10]  # not collected yet
    src = open_store(base + "/src")
    with CheckpointManager(src, staging_dir=tmp_path / "s") as mgr:
        _save(mgr, 30, {"old.bin": old, "kept.bin": kept, "fresh.bin": fresh})

    result = copy_checkpoint(src, dst, force=True)  # (its writer closed a moment ago)
    assert result.bytes_reused == len(kept)  # named: step 20 is retained
    assert result.bytes_uploaded == len(old) + len(fresh)  # step 10's sent again
    attempts = [
        attempt_layout.parse_ckpt_prefix(attempt_layout.CKPT_PREFIX + d)
        for d in dst.list_dirs(attempt_layout.CKPT_PREFIX)
    ]
    assert sorted(a[0] for a in attempts) == [
        10,
        20,
        30,
    ]  # steps 10, 20 and the copy's one attempt: none abandoned
    with TransferEngine() as engine:
        restore(dst, tmp_path / "out", engine)
    assert _tree(tmp_path / "out") == {"old.bin": old, "kept.bin": kept, "fresh.bin": fresh}
