"""Retention by metric and by time (cloudckpt.retention), in the pure protocol: which
checkpoints each rule keeps, that the kept set is always the union of the rules (property
tests against an oracle written separately), metrics as user data, and the LATEST format
an older cloudckpt refuses."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt import attempt_layout, canonical, digest, formats, protocol, retention
from cloudckpt.errors import ConfigurationError, CorruptRecordError, UnknownFormatError
from cloudckpt.manifests import FileEntry, Manifest
from cloudckpt.protocol import Settings

T0 = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)


def _record(
    step: int, metrics=None, at: dt.datetime | None = None, algorithm: str = digest.SHA256_TREE
) -> protocol.CheckpointRecord:
    """A committed record of ``step``. SHA-256 by default: the LATEST format tests below are
    about what a /2 or /3 writer produced; a BLAKE3 manifest makes LATEST /4 on its own."""
    attempt = f"20300101T000000000Z-{step:08x}"
    m = Manifest(
        ckpt=attempt_layout.ckpt_prefix(step, 1, attempt),
        step=step,
        epoch=1,
        commit_id=attempt,
        writer_id="w",
        created_at="t",
        files=(
            FileEntry(
                "model.bin", 3, digest.tree_digest(b"abc", algorithm=algorithm), algorithm=algorithm
            ),
        ),
        metrics=retention.clean_metrics(metrics),
        algorithm=algorithm,
    )
    return m.record(m.to_bytes(), at or T0 + dt.timedelta(seconds=step))


def _run(saves, settings: Settings) -> protocol.Latest:
    """Commit ``saves``: (step, metrics) or (step, metrics, time) tuples, in order."""
    latest = protocol.initial(protocol.Writer(1, "w", "t"), settings, T0)
    for save in saves:
        latest = protocol.commit(latest, _record(*save), settings, T0)
    return latest


def _steps(records) -> list[int]:
    return [r.step for r in records]


BEST_LOSS = Settings(keep_last=2, keep_best=1, best_metric="loss", best_mode="min")


# --------------------------------------------------------------------------- keep-best


def test_keep_best_keeps_the_best_beside_the_newest():
    latest = _run(
        [
            (1, {"loss": 0.5}),
            (2, {"loss": 0.1}),
            (3, {"loss": 0.4}),
            (4, {"loss": 0.3}),
            (5, {"loss": 0.6}),
        ],
        BEST_LOSS,
    )
    assert _steps(latest.retained()) == [5, 4, 2]
    assert sorted(t.record.step for t in latest.tombstones) == [1, 3]


def test_keep_best_max_mode_and_more_than_one():
    s = Settings(keep_last=1, keep_best=2, best_metric="acc", best_mode="max")
    latest = _run([(1, {"acc": 0.9}), (2, {"acc": 0.5}), (3, {"acc": 0.95}), (4, {"acc": 0.1})], s)
    assert _steps(latest.retained()) == [4, 3, 1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_nan_inf_and_missing_metrics_are_never_best(bad):
    # -inf would be the "lowest loss" and NaN compares false: both must never be best.
    metrics = {} if bad is None else {"loss": bad}
    latest = _run(
        [(1, {"loss": 0.5}), (2, metrics), (3, {"loss": 0.7}), (4, {"loss": 0.8})],
        dataclasses.replace(BEST_LOSS, keep_last=1),
    )
    assert _steps(latest.retained()) == [4, 1]  # step 1 (0.5) is the best, not step 2


def test_non_finite_values_are_recorded_as_strings():
    assert retention.clean_metrics({"a": float("nan"), "b": float("inf"), "c": -math.inf}) == {
        "a": "nan",
        "b": "inf",
        "c": "-inf",
    }
    # The stored form is taken as such (a recovered save's journal holds it).
    assert retention.clean_metrics({"a": "nan", "b": 1}) == {"a": "nan", "b": 1.0}
    assert retention.metric_value({"a": "nan"}, "a") is None


def test_ties_go_to_the_older_checkpoint_whatever_the_order():
    # Like transformers' best_model_checkpoint and Lightning's save_top_k: a tie is no
    # improvement, so the checkpoint that reached the value first stays the best.
    latest = _run(
        [(1, {"loss": 0.2}), (2, {"loss": 0.2}), (3, {"loss": 0.2}), (4, {"loss": 0.9})],
        dataclasses.replace(BEST_LOSS, keep_last=1),
    )
    assert _steps(latest.retained()) == [4, 1]


def test_a_changed_metric_ranks_by_the_new_one_and_pin_brings_the_old_best_back():
    latest = _run([(1, {"loss": 0.1}), (2, {"loss": 0.5, "acc": 0.2})], BEST_LOSS)
    by_acc = dataclasses.replace(BEST_LOSS, best_metric="acc", best_mode="max")
    for save in [(3, {"acc": 0.1}), (4, {"acc": 0.1})]:
        latest = protocol.commit(latest, _record(*save), by_acc, T0)
    # Step 1 has no "acc": it is not among the best any more, and keep_last dropped it;
    # it waits out the grace period as a tombstone, which a pin brings back.
    assert _steps(latest.retained()) == [4, 3, 2]
    dropped = next(t for t in latest.tombstones if t.record.step == 1)
    latest = protocol.pin(latest, dropped.record.commit_id, "old best", T0)
    assert 1 in _steps(latest.retained())


def test_metrics_are_checked():
    for bad in ({"a": True}, {"a": "0.3"}, {"a": [1.0]}, {"": 1.0}, {1: 1.0}, [("a", 1.0)]):
        with pytest.raises(ConfigurationError):
            retention.clean_metrics(bad)
    with pytest.raises(ConfigurationError):
        retention.clean_metrics({f"m{i}": 1.0 for i in range(retention.MAX_METRICS + 1)})

    class Scalar:  # a 0-d tensor or numpy scalar: anything float() takes
        def __float__(self) -> float:
            return 0.25

    assert retention.clean_metrics({"a": Scalar(), "b": 3}) == {"a": 0.25, "b": 3.0}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(keep_best=1),  # no metric
        dict(best_metric="loss"),  # no count
        dict(best_mode="max"),  # a direction for nothing
        dict(keep_best=0, best_metric="loss"),
        dict(keep_best=1, best_metric="loss", best_mode="lower"),
        dict(keep_best=1, best_metric=""),
        dict(keep_periods=((3600, 60),)),  # window shorter than the period
    ],
)
def test_bad_policies_are_refused(kwargs):
    with pytest.raises(ConfigurationError):
        Settings(**kwargs)


def test_periods_are_parsed_from_durations():
    assert retention.periods([("1h", "1d"), (86400, "30d"), "30m:1h"]) == (
        (1800, 3600),
        (3600, 86400),
        (86400, 2592000),
    )
    for bad in ["1h:1d", [("1h",)], [("0s", "1h")], [("1h", "nope")], [("1h", "30m")]]:
        with pytest.raises(ConfigurationError):
            retention.periods(bad)


# --------------------------------------------------------------------------- periods


def _at(hours: float) -> dt.datetime:
    return T0 + dt.timedelta(hours=hours)


def test_one_per_hour_for_the_last_day():
    hourly = Settings(keep_last=1, keep_periods=((3600, 86400),))
    # Every 20 minutes for 30 hours.
    saves = [(i + 1, None, _at(i / 3)) for i in range(90)]
    latest = _run(saves, hourly)
    kept = latest.retained()
    now = _at(89 / 3)
    # The newest of each hour bucket in the last 24 h (day 1 05:40 is exactly 24 h before
    # the current one, day 2 05:40: out), and nothing older.
    assert all(now - _iso(r) < dt.timedelta(hours=24) for r in kept)
    buckets = [_iso(r).replace(minute=0, second=0, microsecond=0) for r in kept]
    assert len(buckets) == len(set(buckets)) == 24
    assert min(buckets) == _at(6) and max(buckets) == _at(29)
    assert all(_iso(r).minute == 40 for r in kept)  # the newest of its hour (:00, :20, :40)


def _iso(r) -> dt.datetime:
    return canonical.parse_iso(r.committed_at)


def test_periods_combine_with_keep_last_and_every_and_pins():
    s = Settings(keep_last=2, keep_every=50, keep_periods=((3600, 3 * 3600),))
    latest = protocol.initial(protocol.Writer(1, "w", "t"), s, T0)
    for i in range(60):
        latest = protocol.commit(latest, _record(i + 1, None, _at(i / 6)), s, T0)  # 10 min
        if i + 1 == 7:
            latest = protocol.pin(latest, latest.current.commit_id, "keep", T0)
    steps = _steps(latest.retained())
    assert steps[:2] == [60, 59]  # keep_last
    assert 50 in steps and 7 in steps  # keep_every, pin
    # One per hour for the last 3 h (after 06:50, the current one being at 09:50): the
    # newest of hours 9 (step 60), 8 (08:50, step 54) and 7 (07:50, step 48).
    assert set(steps) == {60, 59, 54, 48, 50, 7}


def test_time_is_the_current_checkpoints_not_a_clock():
    # Nothing ages out between commits: the window ends at the current checkpoint's time.
    s = Settings(keep_last=1, keep_periods=((3600, 7200),))
    latest = _run([(1, None, _at(0)), (2, None, _at(1)), (3, None, _at(1.5))], s)
    assert _steps(latest.retained()) == [3, 1]
    # An unpin re-applies retention at the same "now": step 1 stays.
    latest = protocol.pin(latest, latest.current.commit_id, "x", T0)
    latest = protocol.unpin(latest, latest.current.commit_id, T0 + dt.timedelta(days=30))
    assert _steps(latest.retained()) == [3, 1]
    latest = protocol.commit(latest, _record(4, None, _at(2.5)), s, T0)
    assert _steps(latest.retained()) == [4, 3]  # step 1 is out of the window now


# --------------------------------------------------------------------------- formats


# What cloudckpt read before retention by metric existed (formats.LATEST_FORMATS_READ).
OLD_READER_FORMATS = ("cloudckpt.latest/1", "cloudckpt.latest/2")


def test_a_latest_that_keeps_the_best_is_refused_by_an_older_cloudckpt(monkeypatch):
    latest = _run([(1, {"loss": 0.1}), (2, {"loss": 0.5})], BEST_LOSS)
    body = latest.to_bytes()
    assert latest.format == "cloudckpt.latest/3" and protocol.parse_latest(body) == latest
    monkeypatch.setattr(protocol, "LATEST_FORMATS_READ", OLD_READER_FORMATS)
    # Refused as a newer version's format, not as damage (issue 28, item 1).
    with pytest.raises(UnknownFormatError, match="latest/3") as exc_info:
        protocol.parse_latest(body)
    assert exc_info.value.found == "cloudckpt.latest/3"
    assert exc_info.value.written_by == formats.WRITTEN_BY


@pytest.mark.parametrize(
    "settings_, metrics",
    [
        (Settings(keep_last=2), {"loss": 0.1}),  # metrics alone: a /2 writer would drop them
        (Settings(keep_last=2, keep_periods=((60, 600),)), None),
        (BEST_LOSS, None),
    ],
)
def test_anything_an_older_writer_would_lose_makes_it_latest_3(settings_, metrics):
    latest = _run([(1, metrics), (2, None)], settings_)
    assert latest.format == "cloudckpt.latest/3"
    assert protocol.parse_latest(latest.to_bytes()) == latest


def test_a_blake3_checkpoint_makes_it_latest_4_whatever_else_it_holds():
    # A /3 reader would take a BLAKE3 record for SHA-256 (docs/design.md §3).
    latest = protocol.initial(protocol.Writer(1, "w", "t"), Settings(keep_last=2), T0)
    latest = protocol.commit(latest, _record(1), Settings(keep_last=2), T0)
    assert latest.format == "cloudckpt.latest/2"
    latest = protocol.commit(
        latest, _record(2, algorithm=digest.BLAKE3_TREE), Settings(keep_last=2), T0
    )
    assert latest.format == "cloudckpt.latest/4"
    assert protocol.parse_latest(latest.to_bytes()) == latest


def test_a_latest_without_them_stays_a_2_body():
    latest = _run([(1, None), (2, {})], Settings(keep_last=1))
    doc = json.loads(latest.to_bytes())
    assert doc["format"] == "cloudckpt.latest/2"
    assert set(doc["settings"]) == {"keep_last", "keep_every", "gc_grace_s"}
    assert all("metrics" not in r for r in [doc["current"], *doc["history"]])
    assert all("metrics" not in t["record"] for t in doc["tombstones"])


def test_a_setting_this_version_does_not_know_is_refused_not_ignored():
    # A newer rule that a writer ignored would drop what it keeps (the /2 hazard above).
    doc = json.loads(_run([(1, None)], Settings(keep_last=1)).to_bytes())
    body = {**doc, "settings": {**doc["settings"], "keep_tagged": ["release"]}}
    with pytest.raises(UnknownFormatError, match="keep_tagged"):
        protocol.parse_latest(canonical.seal(body))


def test_a_malformed_retention_setting_is_corrupt():
    latest = _run([(1, {"loss": 0.1})], BEST_LOSS)
    doc = json.loads(latest.to_bytes())
    for change in (
        {"keep_best": "2"},
        {"best_mode": "lower"},
        {"keep_periods": [[60]]},
        {"keep_periods": [[600, 60]]},
        {"best_metric": None},
    ):
        body = {**doc, "settings": {**doc["settings"], **change}}
        with pytest.raises(CorruptRecordError):
            protocol.parse_latest(canonical.seal(body))


# --------------------------------------------------------------------------- properties


def _oracle_keeps(policy: Settings, candidates, pinned) -> set[str]:
    """What must be kept, written from the rules in docs/design.md §8 (not the code)."""
    keep = {candidates[0].commit_id} | {r.commit_id for r in candidates if r.commit_id in pinned}
    n = len(candidates) if policy.keep_last is None else policy.keep_last
    keep |= {r.commit_id for r in candidates[:n]}
    if policy.keep_every:
        keep |= {r.commit_id for r in candidates if r.step % policy.keep_every == 0}
    if policy.keep_best:
        scored = []
        for age, r in enumerate(reversed(candidates)):  # age 0: the oldest
            v = r.metrics.get(policy.best_metric)
            if isinstance(v, float) and math.isfinite(v):
                scored.append((v if policy.best_mode == "min" else -v, age, r.commit_id))
        keep |= {cid for _, _, cid in sorted(scored)[: policy.keep_best]}
    now = _iso(candidates[0])
    for period, window in policy.keep_periods:
        seen = set()
        for r in candidates:
            t = _iso(r)
            if now - t < dt.timedelta(seconds=window):
                bucket = int(t.timestamp()) // period
                if bucket not in seen:
                    seen.add(bucket)
                    keep.add(r.commit_id)
    return keep


_VALUES = st.sampled_from([0.1, 0.2, 0.2, 0.5, float("nan"), float("inf"), -float("inf"), None])
_POLICIES = st.builds(
    lambda keep_best, best_mode, **kw: Settings(
        keep_best=keep_best,
        best_metric="loss" if keep_best else None,
        best_mode=best_mode if keep_best else "min",
        **kw,
    ),
    keep_last=st.sampled_from([1, 2, 3, None]),
    keep_every=st.sampled_from([None, 3]),
    keep_best=st.sampled_from([None, 1, 2]),
    best_mode=st.sampled_from(["min", "max"]),
    keep_periods=st.sampled_from([(), ((600, 1800),), ((60, 300), (3600, 4 * 3600))]),
)
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["save", "save", "save", "pin", "unpin"]), _VALUES, st.integers(1, 2400)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(policy=_POLICIES, ops=_OPS)
def test_the_kept_set_is_exactly_the_union_of_the_rules(policy, ops):
    latest = protocol.initial(protocol.Writer(1, "w", "t"), policy, T0)
    at, step, ever = T0, 0, []
    for op, value, gap in ops:
        if op == "save" or latest.current is None:
            step += 1
            at += dt.timedelta(seconds=gap)
            record = _record(step, {} if value is None else {"loss": value}, at)
            candidates = [record, *latest.retained()]
            latest = protocol.commit(latest, record, policy, T0)
            ever.append(record.commit_id)
        elif op == "pin":
            target = latest.retained()[gap % len(latest.retained())]
            latest = protocol.pin(latest, target.commit_id, "p", T0)
            continue
        else:
            if not latest.pins:
                continue
            candidates = latest.retained()
            latest = protocol.unpin(latest, latest.pins[gap % len(latest.pins)].commit_id, T0)
        kept = {r.commit_id for r in latest.retained()}
        assert kept == _oracle_keeps(policy, candidates, latest.pinned_ids())
        # Nothing vanishes: every checkpoint ever committed is retained or a tombstone.
        assert set(ever) == kept | {t.record.commit_id for t in latest.tombstones}
        # History stays newest first, and LATEST round-trips.
        assert protocol.parse_latest(latest.to_bytes()) == latest


def _oracle_reasons(policy: Settings, candidates, pinned) -> dict[str, set[str]]:
    """Each rule's keeps (from docs/design.md §8, as ``_oracle_keeps``), by the reason
    ``ls`` prints for it."""
    out: dict[str, set[str]] = {"current": {candidates[0].commit_id}}
    out["pinned"] = {r.commit_id for r in candidates if r.commit_id in pinned}
    n = len(candidates) if policy.keep_last is None else policy.keep_last
    out["all" if policy.keep_last is None else f"last {n}"] = {r.commit_id for r in candidates[:n]}
    if policy.keep_every:
        out[f"every {policy.keep_every}"] = {
            r.commit_id for r in candidates if r.step % policy.keep_every == 0
        }
    if policy.keep_best:
        scored = [
            r for r in candidates
            if isinstance(r.metrics.get(policy.best_metric), float)
            and math.isfinite(r.metrics[policy.best_metric])
        ]  # fmt: skip
        ranked = sorted(
            scored,
            key=lambda r: (
                r.metrics[policy.best_metric] * (1 if policy.best_mode == "min" else -1),
                -candidates.index(r),
            ),
        )
        out[f"best by {policy.best_metric}"] = {r.commit_id for r in ranked[: policy.keep_best]}
    return out


@settings(max_examples=200, deadline=None)
@given(policy=_POLICIES, ops=_OPS)
def test_every_reason_names_a_rule_that_keeps_it(policy, ops):
    """``reasons`` (what `ls` prints as "kept because") is the kept set with, for each
    checkpoint, exactly the rules that keep it; ``kept`` is its keys."""
    latest = protocol.initial(protocol.Writer(1, "w", "t"), policy, T0)
    at = T0
    for step, (op, value, gap) in enumerate(ops, start=1):
        at += dt.timedelta(seconds=gap)
        latest = protocol.commit(latest, _record(step, {"loss": value} if value else {}, at),
                                 policy, T0)  # fmt: skip
        if op == "pin":
            latest = protocol.pin(latest, latest.retained()[-1].commit_id, "p", T0)
    current, history, pinned = latest.current, latest.history, latest.pinned_ids()
    why = policy.retention.reasons(current, history, pinned)
    assert set(why) == policy.retention.kept(current, history, pinned)
    assert set(why) == {r.commit_id for r in latest.retained()}  # what the commits kept
    expected = _oracle_reasons(policy, latest.retained(), pinned)
    for cid, reasons in why.items():
        periodic = [r for r in reasons if r.startswith("one per ")]
        assert [r for r in reasons if not r.startswith("one per ")] == [
            name for name, ids in expected.items() if cid in ids
        ]
        assert len(periodic) <= len(policy.keep_periods)


def test_reasons_read_as_ls_prints_them():
    policy = Settings(keep_last=2, keep_every=10, keep_best=1, best_metric="loss",
                      keep_periods=((3600, 86400),))  # fmt: skip
    latest = _run([(10, {"loss": 0.1}), (11, {"loss": 0.5}), (12, {"loss": 0.4})], policy)
    why = policy.retention.reasons(latest.current, latest.history, set())
    by_step = {r.step: why[r.commit_id] for r in latest.retained()}
    assert by_step == {
        12: ["current", "last 2", "one per 1h for 1d"],
        11: ["last 2"],
        10: ["every 10", "best by loss"],
    }
    assert policy.retention.describe() == [
        "keep_last 2", "keep_every 10", "keep_best 1 by loss (min)", "one per 1h for 1d"
    ]  # fmt: skip
    assert Settings(keep_last=None).retention.describe() == ["keep_last all"]
    for seconds, text in [(90, "1m30s"), (3600, "1h"), (5400, "1h30m"), (86400, "1d"),
                          (2592000, "30d"), (604800, "1w"), (0, "0s")]:  # fmt: skip
        assert retention.format_duration(seconds) == text
        assert retention.parse_duration(text) == seconds


def test_a_best_metric_the_checkpoints_lack_is_reported_with_the_name_they_record():
    policy = Settings(keep_best=1, best_metric="eval_los").retention
    typo = [_record(2, {"eval_loss": 0.2, "epoch": 1.0}), _record(1, {"eval_loss": 0.3})]
    warning = retention.unranked(policy, typo)
    assert warning is not None
    assert "'eval_los'" in warning and "2 of 2 retained checkpoints" in warning
    assert "(epoch, eval_loss)" in warning and "did you mean 'eval_loss'?" in warning
    one = retention.unranked(policy, typo, saved=typo[0])
    assert one is not None and one.startswith("keep-best ranks checkpoints by 'eval_los', but "
                                              "step 2 records metrics without it")  # fmt: skip
    # Nothing amiss: no keep-best; every checkpoint with metrics has it; none has metrics
    # (saves between evaluations). A checkpoint that lacks it beside others that have it
    # is named, but no other name is suggested (the ranking is right).
    right = Settings(keep_best=1, best_metric="eval_loss").retention
    assert retention.unranked(right, typo) is None
    assert retention.unranked(Settings().retention, typo) is None
    assert retention.unranked(policy, [_record(3), _record(4)]) is None
    odd = retention.unranked(right, [_record(3, {"eval_los": 0.1}), *typo])
    assert odd is not None and "1 of 3" in odd and "did you mean" not in odd


# --------------------------------------------------------------------------- the manager


@pytest.fixture(params=["memory", "s3"])
def run_target(request):
    """A fresh run on the memory store and on the moto S3 server."""
    return request.getfixturevalue(f"{request.param}_target")


def _save(mgr, step: int, **metrics: float):
    with mgr.save(step, metrics=metrics) as d:
        (d / "model.bin").write_bytes(b"weights %d" % step)


LOSSES = {1: 0.9, 2: 0.2, 3: 0.5, 4: float("nan"), 5: 0.4, 6: 0.6}


def test_the_manager_keeps_the_best_and_a_new_host_restores_it(
    run_target, manager_factory, tmp_path
):
    mgr = manager_factory(run_target, keep_last=2, keep_best=1, best_metric="loss")
    for step, loss in LOSSES.items():
        _save(mgr, step, loss=loss, acc=1 - loss)
    mgr.wait()
    assert [(c.step, c.metrics["loss"]) for c in mgr.list()] == [(6, 0.6), (5, 0.4), (2, 0.2)]
    assert mgr.list()[0].metrics == {"loss": 0.6, "acc": 0.4}

    # A new host with default options inherits the rule (and what it kept restores).
    new_host = manager_factory(run_target)
    assert new_host.resume(into=tmp_path / "cur").step == 6
    assert (new_host.settings.keep_best, new_host.settings.best_metric) == (1, "loss")
    best = new_host.restore(into=tmp_path / "best", step=2)
    assert (best.path / "model.bin").read_bytes() == b"weights 2"
    _save(new_host, 7, loss=0.3)
    new_host.wait()
    assert [c.step for c in new_host.list()] == [7, 6, 2]


def test_retention_options_are_inherited_as_a_unit(memory_target, manager_factory):
    first = manager_factory(memory_target, keep_best=2, best_metric="acc", best_mode="max")
    _save(first, 1, acc=0.5)
    first.close()
    second = manager_factory(memory_target, keep_last=5, keep_periods=[("1h", "1d")])
    _save(second, 2, acc=0.4)
    second.wait()
    s = second.settings
    assert (s.keep_last, s.keep_best, s.best_metric, s.best_mode) == (5, 2, "acc", "max")
    assert s.keep_periods == ((3600, 86400),)
    second.close()
    third = manager_factory(memory_target, keep_best=None, keep_periods=None)
    _save(third, 3, acc=0.1)
    third.wait()
    assert (third.settings.keep_best, third.settings.best_metric) == (None, None)
    assert third.settings.keep_periods == () and third.settings.keep_last == 5
    for bad in (dict(best_metric="loss"), dict(keep_best=1), dict(best_mode="max")):
        with pytest.raises(ConfigurationError):
            manager_factory(memory_target, **bad)


def test_set_retention_applies_from_the_next_commit(memory_target, manager_factory):
    mgr = manager_factory(memory_target, keep_last=1)
    _save(mgr, 1, loss=0.1)
    _save(mgr, 2, loss=0.5)
    mgr.wait()
    mgr.set_retention(keep_best=1, best_metric="loss")
    _save(mgr, 3, loss=0.7)
    _save(mgr, 4, loss=0.8)
    mgr.wait()
    # Step 1 was dropped before the rule existed; from the change on, the best (step 2,
    # among what was retained) stays.
    assert [c.step for c in mgr.list()] == [4, 2]
    with pytest.raises(ConfigurationError):
        mgr.set_retention(best_metric="acc")


def test_a_recovered_save_keeps_its_metrics(memory_target, tmp_path):
    from cloudckpt import CheckpointManager, failpoints

    staging = tmp_path / "staging"
    mgr = CheckpointManager(memory_target.url, staging_dir=staging, keep_best=1, best_metric="loss")
    _save(mgr, 1, loss=0.5)
    mgr.wait()
    with failpoints.armed("save.after_manifest"):
        _save(mgr, 2, loss=float("-inf"))
        with pytest.raises(failpoints.SimulatedCrash):
            mgr.wait()
    mgr.staging.close()  # the crashed process's lock goes with it
    again = CheckpointManager(memory_target.url, staging_dir=staging)  # step 2 is journaled
    try:
        assert again.resume(into=tmp_path / "r").step == 2
        assert [(c.step, c.metrics) for c in again.list()] == [
            (2, {"loss": "-inf"}),
            (1, {"loss": 0.5}),
        ]
    finally:
        again.close()


def test_committed_at_and_periods_are_on_the_stores_clock(memory_target, tmp_path):
    from cloudckpt import CheckpointManager
    from cloudckpt.stores import open_store
    from cloudckpt.stores.memory import ManualClock

    # The store's clock is years ahead of this host's: retention by time must follow it.
    clock = ManualClock(dt.datetime(2031, 6, 1, 0, 5, tzinfo=dt.timezone.utc))
    store = open_store(memory_target.url, {"clock": clock})
    mgr = CheckpointManager(
        store, staging_dir=tmp_path / "s", keep_last=1, auto_gc=False, keep_periods=[("1h", "3h")]
    )
    try:
        for step in range(1, 13):  # one every 20 minutes of the store's clock
            _save(mgr, step)
            mgr.wait()
            assert canonical.parse_iso(mgr.list()[0].committed_at) == clock()
            clock.advance(20 * 60)
        # Now 04:05; the current one 03:45: the newest of hours 3 (step 12), 2 (step 9,
        # 02:45) and 1 (step 6, 01:45); 00:45 is 3 h before 03:45: out.
        assert [c.step for c in mgr.list()] == [12, 9, 6]
    finally:
        mgr.close()
        store.close()


def test_a_save_without_the_ranked_metric_warns_once_naming_what_it_records(
    memory_target, manager_factory, caplog
):
    """``best_metric="eval_los"`` while the saves record ``eval_loss``: the first save
    that shows it logs a warning (once), naming the metrics it records and the likely
    name; a later manager with default options warns too (the rule is the run's)."""
    import logging

    caplog.set_level(logging.WARNING, logger="cloudckpt")
    mgr = manager_factory(memory_target, keep_last=1, keep_best=1, best_metric="eval_los")
    for step in (1, 2, 3):
        _save(mgr, step, eval_loss=0.5 - step / 10, epoch=float(step))
    mgr.wait()
    warned = [r.getMessage() for r in caplog.records if "keep-best ranks" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "by 'eval_los', but step 1 records metrics without it (epoch, eval_loss)" in warned[0]
    assert "did you mean 'eval_loss'?" in warned[0]
    # What the warning is about: the best (step 1's 0.4... step 3's 0.2) is not kept.
    assert [c.step for c in mgr.list()] == [3]
    mgr.close()
    caplog.clear()
    later = manager_factory(memory_target)  # inherits keep_best by eval_los
    _save(later, 4, eval_loss=0.1)
    later.wait()
    assert [r for r in caplog.records if "keep-best ranks" in r.getMessage()]
    # A save that records no metrics (between evaluations), or the ranked one: no warning.
    caplog.clear()
    right = manager_factory(memory_target, keep_best=1, best_metric="eval_loss")
    _save(right, 5, eval_loss=0.3)
    _save(right, 6)
    right.wait()
    assert not [r for r in caplog.records if "keep-best ranks" in r.getMessage()]
