"""Which committed checkpoints LATEST keeps (docs/design.md §8). Pure: no I/O, no clocks.

A checkpoint stays retained if ANY rule keeps it (the union of keeps); the others become
tombstones inside the commit (or unpin) that drops them, and GC deletes them after the grace
period. The rules, over the candidates ``current`` + ``history`` (newest first, in commit
order):

- the current checkpoint, and every pinned one;
- ``keep_last``: the newest N (current included); None keeps everything;
- ``keep_every``: every checkpoint whose step is a multiple of K;
- ``keep_best``: the best K by the metric ``best_metric`` (``best_mode`` "min" or "max"),
  among the checkpoints whose recorded value of that metric is a finite number. A
  checkpoint without the metric, or with NaN or an infinity, is never among the best. Ties
  go to the OLDER checkpoint (what transformers' ``best_model_checkpoint`` and Lightning's
  ``save_top_k`` do: both replace the best only on a strict improvement);
- ``keep_periods``: for each ``(period_s, window_s)``, the newest checkpoint of every
  ``period_s``-long bucket of time in the last ``window_s`` ("one per hour for the last
  day": ``(3600, 86400)``). Times are the records' ``committed_at``, which the committer
  reads from the STORE's clock just before its compare-and-swap; "now" is the current
  checkpoint's ``committed_at`` (so nothing ages out between commits, and no host clock
  is consulted). Buckets are aligned to the Unix epoch (UTC): hours start on the hour,
  days at midnight UTC. A checkpoint is in the window if ``now - window_s <
  committed_at``; one dated after "now" (a clock that stepped back) counts as in it.

Metrics are user data: ``clean_metrics`` checks and normalises them for a record (NaN and
infinities become the strings ``"nan"``, ``"inf"``, ``"-inf"``: canonical JSON has no
NaN, and they must never rank as best).

``RetentionPolicy.reasons`` says why each kept checkpoint is kept (``kept`` is its keys:
one implementation for the commit, ``ls`` and ``ls --json``), and ``unranked`` warns when
checkpoints record metrics but not the one keep-best ranks by (a mistyped name: they can
never be kept as best, and GC deletes them once the other rules let them go).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol

from cloudckpt.errors import ConfigurationError

BestMode = Literal["min", "max"]
BEST_MODES: tuple[str, ...] = ("min", "max")

MAX_METRICS = 256  # per checkpoint: every retained record carries them in LATEST
MAX_METRIC_NAME = 200
MAX_PERIODS = 8


class Candidate(Protocol):
    """What retention reads of a checkpoint record (``protocol.CheckpointRecord``)."""

    @property
    def commit_id(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def committed_at(self) -> str: ...
    @property
    def metrics(self) -> Mapping[str, Any]: ...


# --- durations ----------------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d``, ``1w``, ``1h30m`` -> seconds.

    Raises: ValueError if ``text`` is not a duration.
    """
    s = text.strip().lower().replace(" ", "")
    if not s:
        raise ValueError("empty duration")
    total, pos = 0.0, 0
    for m in _DURATION.finditer(s):
        if m.start() != pos or (not m.group(2) and (m.start() or m.end() != len(s))):
            break  # a bare number is seconds only on its own ("1h30" is ambiguous)
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s):
        raise ValueError(f"{text!r} is not a duration (examples: 90s, 30m, 2h, 1d, 1h30m)")
    return total


def format_duration(seconds: float) -> str:
    """``3600`` -> ``1h``, ``5400`` -> ``1h30m``, ``2592000`` -> ``30d``: in at most two
    units (weeks only for whole weeks), as ``parse_duration`` reads them."""
    s = max(round(seconds), 0)
    if s and s % 604800 == 0:
        return f"{s // 604800}w"
    units = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
    for i, (name, size) in enumerate(units):
        if s >= size or name == "s":
            head, rest = divmod(s, size)
            sub = units[i + 1] if i + 1 < len(units) else None
            if sub is not None and rest // sub[1]:
                return f"{head}{name}{rest // sub[1]}{sub[0]}"
            return f"{head}{name}"
    raise AssertionError("unreachable")  # ("s" ends the loop)


def _seconds(value: Any, what: str) -> int:
    """Whole seconds (>= 1) of a number or a duration string. Raises ConfigurationError."""
    try:
        if isinstance(value, str):
            seconds = parse_duration(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        else:
            raise ValueError(f"{value!r} is neither seconds nor a duration string")
    except ValueError as exc:
        raise ConfigurationError(f"{what}: {exc}") from None
    if not math.isfinite(seconds) or round(seconds) < 1:
        raise ConfigurationError(f"{what} must be at least one second, got {value!r}")
    return round(seconds)


_PERIOD_CLI_HINT = "Write PERIOD:WINDOW: --keep-period 1h:1d keeps one per hour for the last day"


def periods(spec: Iterable[Any] | None) -> tuple[tuple[int, int], ...]:
    """``[("1h", "1d"), (86400, "30d")]`` -> ``((3600, 86400), (86400, 2592000))``: each a
    (period, window) in whole seconds, window >= period, sorted. None or () -> ().

    Raises: ConfigurationError.
    """
    if spec is None:
        return ()
    if isinstance(spec, (str, bytes)):
        raise ConfigurationError(
            f"keep_periods must be a list of (period, window) pairs, not {spec!r}",
            hint='For one per hour for the last day: keep_periods=[("1h", "1d")]',
        )
    out = set()
    for item in spec:
        if isinstance(item, str) and ":" in item:
            item = item.split(":", 1)  # the CLI's PERIOD:WINDOW
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigurationError(
                f"keep_periods: {item!r} is not a (period, window) pair",
                hint='For one per hour for the last day: keep_periods=[("1h", "1d")]',
            ).with_cli_hint(_PERIOD_CLI_HINT)
        period = _seconds(item[0], "keep_periods period")
        window = _seconds(item[1], "keep_periods window")
        if window < period:
            raise ConfigurationError(
                f"keep_periods: the window ({window} s) is shorter than the period ({period} s)",
                hint='Give (period, window), e.g. ("1h", "1d"): one per hour for the last day',
            ).with_cli_hint(_PERIOD_CLI_HINT)
        out.add((period, window))
    if len(out) > MAX_PERIODS:
        raise ConfigurationError(f"keep_periods: at most {MAX_PERIODS} (period, window) pairs")
    return tuple(sorted(out))


# --- metrics ------------------------------------------------------------------------------

_NON_FINITE = ("nan", "inf", "-inf")  # how NaN and infinities are recorded


def _metric_number(name: str, value: Any) -> float | str:
    """A metric value as stored: a finite float, or "nan"/"inf"/"-inf"."""
    if isinstance(value, str) and value in _NON_FINITE:
        return value  # already stored form (a recovered save, a copied record)
    if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
        raise ConfigurationError(
            f"metric {name!r} is not a number ({type(value).__name__})",
            hint="Metrics are numbers (a tensor: float(t)); record other values as metadata",
        )
    try:
        number = float(value)
    except OverflowError:  # an int beyond a float's range (10**400)
        raise ConfigurationError(
            f"metric {name!r} is too large for a float (beyond ±{sys.float_info.max:.3g})",
            hint='Record it scaled (or its logarithm), or as float("inf") if it is unbounded',
        ) from None
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"metric {name!r} is not a single number ({exc})",
            hint="Metrics are numbers (a tensor: float(t)); record other values as metadata",
        ) from None
    if math.isnan(number):
        return "nan"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    return number


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float | str]:
    """The metrics to record with a checkpoint: names are non-empty strings, values are
    numbers (anything ``float()`` takes, but not bools or strings); NaN and infinities are
    kept as the strings "nan", "inf", "-inf" (and those strings are taken as such), which
    never rank as best.

    Raises: ConfigurationError (not a mapping, a bad name or value, too many).
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigurationError(f"metrics must be a mapping of name to number, not {metrics!r}")
    if len(metrics) > MAX_METRICS:
        raise ConfigurationError(
            f"{len(metrics)} metrics, more than {MAX_METRICS} per checkpoint",
            hint="Record the metrics retention or you rank by; put the rest in metadata",
        )
    out: dict[str, float | str] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name or len(name) > MAX_METRIC_NAME:
            raise ConfigurationError(
                f"metric name {name!r} must be a non-empty string of at most "
                f"{MAX_METRIC_NAME} characters"
            )
        out[name] = _metric_number(name, value)
    return out


def logged_eval_metrics(log_history: Any, step: int) -> dict[str, float | str]:
    """The evaluation metrics (``eval_*`` numbers) a transformers ``Trainer`` logged at
    ``step``: its ``TrainerState.log_history``, as ``trainer_state.json`` holds it. What a
    checkpoint-N saved right after an evaluation at step N is recorded with. Malformed
    entries (not numbers, numbers beyond a float's range) are skipped: the file is the
    trainer's, not ours, and a bad metric must not keep the checkpoint from uploading."""
    found: dict[str, Any] = {}
    for entry in log_history if isinstance(log_history, list) else ():
        if not isinstance(entry, dict) or entry.get("step") != step:
            continue
        for name, value in entry.items():
            if (
                isinstance(name, str)
                and name.startswith("eval_")
                and len(name) <= MAX_METRIC_NAME
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and _fits_a_float(value)
                and len(found) < MAX_METRICS
            ):
                found[name] = value
    return clean_metrics(found)


def _fits_a_float(value: int | float) -> bool:
    try:
        float(value)
    except OverflowError:
        return False
    return True


def metric_value(metrics: Mapping[str, Any], name: str) -> float | None:
    """The finite value of metric ``name`` in a record's metrics, or None (missing, not a
    number, NaN, infinite or beyond a float's range: such a checkpoint is never among the
    best)."""
    value = metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not _fits_a_float(value):
        return None
    return float(value) if math.isfinite(value) else None


# --- the policy ---------------------------------------------------------------------------


def _positive(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigurationError(f"{name} must be a positive int or None, got {value!r}")


_BEST_HINT = (
    'Name it: best_metric="eval_loss" (recorded with each save: metrics={...}); '
    'best_mode="min" (the default: lower is better) or "max"'
)
_BEST_CLI_HINT = (
    "Name it: --best-metric eval_loss (recorded with each push: --metric eval_loss=VALUE); "
    "--best-mode min (the default: lower is better) or max"
)


def _check_best(keep_best: int | None, metric: Any, mode: Any) -> None:
    """keep_best, best_metric and best_mode as one unit (all set, or keep-best off).

    Raises: ConfigurationError.
    """
    _positive("keep_best", keep_best)
    if mode not in BEST_MODES:
        raise ConfigurationError(f"best_mode must be 'min' or 'max', not {mode!r}")
    if metric is not None and (
        not isinstance(metric, str) or not metric or len(metric) > MAX_METRIC_NAME
    ):
        raise ConfigurationError(f"best_metric must be a metric name, not {metric!r}")
    if keep_best is not None and metric is None:
        raise ConfigurationError(
            f"keep_best={keep_best} needs a metric: which one ranks the checkpoints",
            hint=_BEST_HINT,
        ).with_cli_hint(_BEST_CLI_HINT)
    if keep_best is None and (metric is not None or mode != "min"):
        raise _without_keep_best()


def _without_keep_best() -> ConfigurationError:
    """A metric or direction given without how many of the best to keep."""
    return ConfigurationError(
        "best_metric and best_mode need keep_best: how many of the best checkpoints to keep",
        hint='E.g. keep_best=1, best_metric="eval_loss", best_mode="min"; keep_best=None '
        "turns keep-best off",
    ).with_cli_hint(
        "E.g. --keep-best 1 --best-metric eval_loss --best-mode min; --keep-best 0 turns "
        "keep-best off"
    )


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """Which committed checkpoints LATEST keeps (module docstring). Pins and the current
    checkpoint are kept regardless. The one declaration of the retention rules: the run
    settings (``protocol.Settings``) extend it with the GC grace period, and every writer
    builds its options with ``RetentionOptions.parse``.

    Raises (constructor): ConfigurationError for an invalid rule or combination: each is
    checked here, and only here (``RetentionOptions.parse`` adds the rule of options: a
    metric or direction without keep_best).
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    keep_periods: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        _positive("keep_last", self.keep_last)
        _positive("keep_every", self.keep_every)
        _check_best(self.keep_best, self.best_metric, self.best_mode)
        if periods(self.keep_periods) != tuple(self.keep_periods):
            raise ConfigurationError(
                f"keep_periods {self.keep_periods!r} is not a sorted tuple of (period, window) "
                "whole seconds"
            )

    @property
    def extended(self) -> bool:
        """Whether it uses a rule an older cloudckpt does not know (keep-best, periods):
        LATEST is then written as ``cloudckpt.latest/3`` (docs/design.md §3)."""
        return self.keep_best is not None or bool(self.keep_periods)

    def kept(
        self, current: Candidate | None, history: Sequence[Candidate], pinned: set[str]
    ) -> set[str]:
        """The commit ids to keep among ``current`` + ``history`` (newest first): those
        ``reasons`` names."""
        return set(self.reasons(current, history, pinned))

    def reasons(
        self, current: Candidate | None, history: Sequence[Candidate], pinned: set[str]
    ) -> dict[str, list[str]]:
        """Why each checkpoint to keep among ``current`` + ``history`` (newest first) is
        kept: commit id -> the rules that keep it, in this order and wording: ``current``,
        ``pinned``, ``last N`` (``all`` when keep_last is None), ``every K``, ``best by
        METRIC``, ``one per PERIOD for WINDOW`` (``format_duration``). A checkpoint no rule
        keeps is absent (retention drops it)."""
        candidates = ([current] if current is not None else []) + list(history)
        why: dict[str, list[str]] = {}

        def add(records: Iterable[Candidate], reason: str) -> None:
            for r in records:
                why.setdefault(r.commit_id, []).append(reason)

        if current is not None:
            add([current], "current")
        add((r for r in candidates if r.commit_id in pinned), "pinned")
        last = "all" if self.keep_last is None else f"last {self.keep_last}"
        add(newest(candidates, self.keep_last), last)
        if self.keep_every is not None:
            every = self.keep_every
            add((r for r in candidates if r.step % every == 0), f"every {every}")
        if self.keep_best is not None and self.best_metric is not None:
            ranked = best(candidates, self.best_metric, self.best_mode)
            add(ranked[: self.keep_best], f"best by {self.best_metric}")
        for period, window in self.keep_periods:
            add(
                one_per_period(candidates, period, window),
                f"one per {format_duration(period)} for {format_duration(window)}",
            )
        return why

    def describe(self) -> list[str]:
        """The rules, as ``ls`` prints them: ``keep_last 3``, ``keep_every 500``,
        ``keep_best 1 by eval_loss (min)``, ``one per 1h for 1d``."""
        out = ["keep_last all" if self.keep_last is None else f"keep_last {self.keep_last}"]
        if self.keep_every is not None:
            out.append(f"keep_every {self.keep_every}")
        if self.keep_best is not None:
            out.append(f"keep_best {self.keep_best} by {self.best_metric} ({self.best_mode})")
        out += [
            f"one per {format_duration(p)} for {format_duration(w)}" for p, w in self.keep_periods
        ]
        return out


# --- the options a writer sets ------------------------------------------------------------


class _Inherit:
    """Default of a run setting: keep what the run's LATEST says (or the default for a new
    run), so a writer that does not say otherwise never silently changes retention."""

    def __repr__(self) -> str:
        return "INHERIT"


INHERIT: Any = _Inherit()

#: The names of the retention rules (``CheckpointManager``'s retention options).
POLICY_FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(RetentionPolicy))


@dataclasses.dataclass(frozen=True)
class RetentionOptions:
    """The retention a writer sets: ``policy`` holds the rules it was given; those named
    in ``inherit`` keep the run's current values instead (a new run's: the defaults). The
    manager, ``set_retention``, the CLI and the HF and Lightning integrations all build it
    with ``parse``."""

    policy: RetentionPolicy = RetentionPolicy()
    inherit: frozenset[str] = POLICY_FIELDS

    @classmethod
    def parse(
        cls,
        *,
        keep_last: Any = INHERIT,
        keep_every: Any = INHERIT,
        keep_best: Any = INHERIT,
        best_metric: Any = INHERIT,
        best_mode: Any = INHERIT,
        keep_periods: Any = INHERIT,
    ) -> RetentionOptions:
        """The options as ``CheckpointManager`` takes them (INHERIT: not given).
        keep_best, best_metric and best_mode are one unit: keep_best=None turns it off
        (whatever the others say), keep_best=K sets all three (best_mode "min" unless
        given), and a metric or mode without keep_best is refused.
        keep_periods: ``periods`` (None: off).

        Raises: ConfigurationError (an invalid rule or combination).
        """
        given = {
            "keep_last": keep_last,
            "keep_every": keep_every,
            "keep_best": keep_best,
            "best_metric": best_metric,
            "best_mode": best_mode,
            "keep_periods": keep_periods if keep_periods is INHERIT else periods(keep_periods),
        }
        if keep_best is INHERIT and (best_metric is not INHERIT or best_mode is not INHERIT):
            raise _without_keep_best()  # else they would change the run's keep-best rule
        if keep_best is None:
            given.update(best_metric=None, best_mode="min")
        elif keep_best is not INHERIT:
            given.update(best_metric=None if best_metric is INHERIT else best_metric)
            given.update(best_mode="min" if best_mode is INHERIT else best_mode)
        explicit = {name: value for name, value in given.items() if value is not INHERIT}
        policy = dataclasses.replace(RetentionPolicy(), **explicit)  # checks every rule
        return cls(policy, POLICY_FIELDS - set(explicit))

    def given(self) -> dict[str, Any]:
        """The rules set, by name (as ``CheckpointManager`` and ``set_retention`` take them)."""
        fields = dataclasses.fields(RetentionPolicy)
        return {f.name: getattr(self.policy, f.name) for f in fields if f.name not in self.inherit}


def unranked(
    policy: RetentionPolicy, records: Sequence[Candidate], saved: Candidate | None = None
) -> str | None:
    """A warning when keep-best ranks by a metric that checkpoints lack although they
    record metrics (a mistyped ``best_metric``: such a checkpoint can never be kept as one
    of the best, so once the other rules let it go, GC deletes it), naming what they do
    record; or None when nothing is amiss (no keep-best, or every checkpoint with metrics
    has the ranked one; one without any metrics is not counted: a save between
    evaluations). About ``saved`` alone when given (a save just committed), else about
    every one of ``records`` (a run's retained checkpoints); a closer name is suggested
    only when none of ``records`` has the ranked metric (else the ranking is right and
    the checkpoint is the odd one out). The wording names no syntax (Python or CLI).
    """
    metric = policy.best_metric
    if policy.keep_best is None or metric is None:
        return None
    judged = [saved] if saved is not None else list(records)
    lacking = [r for r in judged if r.metrics and metric not in r.metrics]
    if not lacking:
        return None
    names = sorted({name for r in lacking for name in r.metrics})
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    if saved is not None:
        who = f"step {saved.step} records metrics without it ({shown}): it"
    else:
        who = (
            f"{len(lacking)} of {len(records)} retained checkpoints record metrics without it "
            f"({shown}): they"
        )
    close = difflib.get_close_matches(metric, names, n=1)
    ranked_somewhere = any(metric in r.metrics for r in records)
    guess = f"; did you mean {close[0]!r}?" if close and not ranked_somewhere else ""
    return (
        f"keep-best ranks checkpoints by {metric!r}, but {who} can never be kept as one of "
        f"the best, and once the other rules let go of a checkpoint, GC deletes it{guess}"
    )


def newest(candidates: Sequence[Candidate], n: int | None) -> Sequence[Candidate]:
    """The newest ``n`` of ``candidates`` (newest first); all of them for None."""
    return candidates if n is None else candidates[:n]


def best(candidates: Sequence[Candidate], metric: str, mode: str) -> list[Candidate]:
    """Every candidate with a finite value of ``metric``, best first; ties: older first.
    ``candidates`` are newest first, so a larger index is older."""
    scored = []
    for index, rec in enumerate(candidates):
        value = metric_value(rec.metrics, metric)
        if value is not None:
            scored.append((value if mode == "min" else -value, -index, rec))
    scored.sort(key=lambda item: (item[0], item[1]))
    return [rec for _, _, rec in scored]


def _time(rec: Candidate) -> dt.datetime | None:
    try:
        t = dt.datetime.fromisoformat(rec.committed_at.replace("Z", "+00:00"))
    except (AttributeError, ValueError):
        return None
    return t if t.tzinfo is not None else None


def one_per_period(candidates: Sequence[Candidate], period: int, window: int) -> list[Candidate]:
    """The newest candidate of each ``period``-second bucket (aligned to the Unix epoch)
    whose time is within ``window`` seconds before the first candidate's (module
    docstring). Candidates are newest first; one whose time does not parse is in no bucket."""
    if not candidates:
        return []
    now = _time(candidates[0])
    if now is None:
        return []
    start = now.timestamp() - window
    seen: set[int] = set()
    out = []
    for rec in candidates:
        t = _time(rec)
        if t is None or t.timestamp() <= start:
            continue
        bucket = math.floor(t.timestamp() / period)
        if bucket not in seen:
            seen.add(bucket)
            out.append(rec)
    return out
