"""The retention flags of the commands that write a run (``push``, ``watch``), and
``--metric`` values: keep-best by a metric and one per period (``cloudckpt.retention``)."""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Callable
from typing import Any

import click

from cloudckpt.errors import ConfigurationError
from cloudckpt.retention import INHERIT, RetentionOptions


def retention_options(f: Callable) -> Callable:
    """Add ``--keep-last``, ``--keep-every``, ``--keep-best``, ``--best-metric``,
    ``--best-mode`` and ``--keep-period`` to a command; it receives what they set as
    ``retention`` (a ``RetentionOptions``; no flag: the run's settings stay)."""

    @click.option(
        "--keep-last",
        type=int,
        metavar="N",
        help="Keep the newest N checkpoints. Default: the run's setting.",
    )
    @click.option(
        "--keep-every",
        type=int,
        metavar="K",
        help="Also keep every K-th step. Default: the run's setting.",
    )
    @click.option(
        "--keep-best",
        type=click.IntRange(min=0),
        metavar="K",
        help="Also keep the best K checkpoints by --best-metric (0: stop keeping by metric). "
        "Default: the run's setting.",
    )
    @click.option(
        "--best-metric",
        metavar="NAME",
        help="The metric --keep-best ranks by (recorded with each checkpoint: push --metric).",
    )
    @click.option(
        "--best-mode",
        type=click.Choice(["min", "max"]),
        help="min: lower is better (default, e.g. a loss); max: higher is better.",
    )
    @click.option(
        "--keep-period",
        "keep_periods",
        multiple=True,
        metavar="PERIOD:WINDOW",
        help="Also keep the newest checkpoint of each PERIOD for the last WINDOW, on the "
        "store's clock (repeatable): 1h:1d keeps one per hour for the last day. 'none' "
        "stops keeping by time. Default: the run's setting.",
    )
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        flags = {name: kwargs.pop(name) for name in _FLAGS}
        return f(*args, retention=retention_settings(**flags), **kwargs)

    return wrapper


#: The flags' names by the option each sets.
_FLAGS = {
    "keep_last": "--keep-last",
    "keep_every": "--keep-every",
    "keep_best": "--keep-best",
    "best_metric": "--best-metric",
    "best_mode": "--best-mode",
    "keep_periods": "--keep-period",
}


def retention_settings(
    keep_last: int | None,
    keep_every: int | None,
    keep_best: int | None,
    best_metric: str | None,
    best_mode: str | None,
    keep_periods: tuple[str, ...],
) -> RetentionOptions:
    """The retention the flags set (``RetentionOptions.parse``: an unset flag leaves the
    run's setting). Raises click.BadParameter for a value or combination that cannot work,
    naming the retention flags given."""
    given = {
        "keep_last": keep_last,
        "keep_every": keep_every,
        "keep_best": keep_best,
        "best_metric": best_metric,
        "best_mode": best_mode,
        "keep_periods": keep_periods or None,
    }
    options = {name: INHERIT if value is None else value for name, value in given.items()}
    if keep_best == 0:
        options["keep_best"] = None  # stop keeping by metric
    if _says_none(keep_periods):
        options["keep_periods"] = None  # stop keeping by time
    try:
        return RetentionOptions.parse(**options)
    except ConfigurationError as exc:  # in the CLI's words
        hint = exc.cli_hint or exc.hint
        message = _in_cli_words(exc.message.removeprefix("keep_periods: "))
        raise click.BadParameter(
            f"{message}. {hint}" if hint else message,
            param_hint=[_FLAGS[name] for name, value in given.items() if value is not None],
        ) from None


def _in_cli_words(message: str) -> str:
    """A retention message in the flags' names ("keep_best=2 needs a metric" reads
    "--keep-best 2 needs a metric"): the CLI answers in CLI syntax (issue 32 item 9)."""
    for name, flag in _FLAGS.items():
        message = re.sub(rf"\b{name}=", f"{flag} ", message)
        message = re.sub(rf"\b{name}\b", flag, message)
    return message


def _says_none(keep_periods: tuple[str, ...]) -> bool:
    """Whether ``--keep-period none`` was given. Raises click.BadParameter (with others)."""
    if not any(p.strip().lower() == "none" for p in keep_periods):
        return False
    if len(keep_periods) > 1:
        raise click.BadParameter(
            "'none' cannot be combined with periods", param_hint="--keep-period"
        )
    return True


def parse_metrics(items: tuple[str, ...]) -> dict[str, float]:
    """``NAME=VALUE`` pairs (``--metric eval_loss=0.31``; ``nan`` and ``inf`` are numbers
    too, recorded as such and never ranked best). Raises click.BadParameter."""
    out: dict[str, float] = {}
    for item in items:
        name, eq, raw = item.partition("=")
        name = name.strip()
        if not eq or not name:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--metric")
        try:
            value = float(raw)
        except ValueError:
            raise click.BadParameter(
                f"the value of {name!r} is not a number ({raw!r}); put other values in --metadata",
                param_hint="--metric",
            ) from None
        if math.isinf(value) and raw.strip().lstrip("+-").lower() not in ("inf", "infinity"):
            raise click.BadParameter(  # a finite number float() could not hold (1e400)
                f"the value of {name!r} is too large for a float (beyond "
                f"±{sys.float_info.max:.3g}); write inf if it is unbounded",
                param_hint="--metric",
            )
        out[name] = value
    return out


def format_metrics(metrics: dict[str, Any]) -> str:
    """``eval_loss=0.31  acc=0.9`` (sorted by name; 6 significant digits)."""
    return "  ".join(
        f"{name}={value:.6g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in sorted(metrics.items())
    )
