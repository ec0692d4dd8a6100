"""How long the HF and Lightning integrations wait for an emergency checkpoint's commit
after a preemption notice (cloudckpt.integrations._pending, shared by both)."""

from __future__ import annotations

import logging

import pytest

from cloudckpt.attempts import CommitInfo
from cloudckpt.errors import FencedError
from cloudckpt.integrations._pending import (
    DEFAULT_EMERGENCY_TIMEOUT,
    emergency_timeout,
    wait_for_emergency,
)
from cloudckpt.preemption import PreemptionNotice

NOW = 1_000_000.0


@pytest.mark.parametrize(
    ("notice", "override", "expected"),
    [
        # Another rank's notice (none here): the whole override, else the default.
        (None, None, DEFAULT_EMERGENCY_TIMEOUT),
        (None, 30.0, 30.0),
        # The override counts from the notice, not from now; never negative.
        (PreemptionNotice("aws", "spot", NOW - 10, deadline=NOW + 100), 30.0, 20.0),
        (PreemptionNotice("aws", "spot", NOW - 50, deadline=NOW + 100), 30.0, 0.0),
        # Else the notice's deadline.
        (PreemptionNotice("gce", "preempted", NOW - 5, deadline=NOW + 25), None, 25.0),
        (PreemptionNotice("gce", "preempted", NOW - 40, deadline=NOW - 10), None, 0.0),
        # Else the default, from the notice.
        (PreemptionNotice("signal", "SIGTERM", NOW - 20), None, DEFAULT_EMERGENCY_TIMEOUT - 20),
    ],
)
def test_the_emergency_wait_ends_at_the_notices_deadline(notice, override, expected):
    assert emergency_timeout(notice, override, now=NOW) == pytest.approx(expected)


def test_an_emergency_checkpoint_that_does_not_commit_is_logged_not_raised(caplog):
    logger = logging.getLogger("cloudckpt.test-pending")
    waits: list[float] = []

    def times_out(timeout: float) -> CommitInfo:
        waits.append(timeout)
        raise TimeoutError

    def fenced(timeout: float) -> CommitInfo:
        waits.append(timeout)
        raise FencedError("fenced")

    def broken(timeout: float) -> CommitInfo:
        raise RuntimeError("not a save failure")

    with caplog.at_level(logging.ERROR, logger=logger.name):
        assert wait_for_emergency(times_out, 7, 12.0, logger) is None
        assert wait_for_emergency(fenced, 7, 3.0, logger) is None
    assert waits == [12.0, 3.0]
    errors = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert "did not commit within 12s" in errors[0] and "step 7" in errors[0]
    assert "failed: fenced" in errors[1]
    with pytest.raises(RuntimeError, match="not a save failure"):
        wait_for_emergency(broken, 7, 1.0, logger)
