"""The retention flags of the commands that write a run (``push``, ``watch``), and
``--metric`` values: keep-best by a metric and one per period (``cloudckpt.retention``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from cloudckpt.errors import ConfigurationError


def retention_options(f: Callable) -> Callable:
    """Add ``--keep-best``, ``--best-metric``, ``--best-mode`` and ``--keep-period`` to a
    command; it receives the ``CheckpointManager`` options they set as ``retention`` (a
    dict; empty: keep the run's settings)."""

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
    def wrapper(
        *args: Any,
        keep_best: int | None,
        best_metric: str | None,
        best_mode: str | None,
        keep_periods: tuple[str, ...],
        **kwargs: Any,
    ) -> Any:
        return f(
            *args,
            retention=retention_settings(keep_best, best_metric, best_mode, keep_periods),
            **kwargs,
        )

    return wrapper


def retention_settings(
    keep_best: int | None,
    best_metric: str | None,
    best_mode: str | None,
    keep_periods: tuple[str, ...],
) -> dict[str, Any]:
    """The ``CheckpointManager`` options the flags give (unset flags: none, so the run's
    settings stay). Raises click.BadParameter for a combination that cannot work."""
    options: dict[str, Any] = {}
    if keep_best == 0:
        options["keep_best"] = None
    elif keep_best is not None:
        if not best_metric:
            raise click.BadParameter(
                "--keep-best needs --best-metric (which metric ranks the checkpoints)",
                param_hint="--keep-best",
            )
        options.update(keep_best=keep_best, best_metric=best_metric, best_mode=best_mode or "min")
    elif best_metric or best_mode:
        raise click.BadParameter(
            "--best-metric and --best-mode go with --keep-best K", param_hint="--best-metric"
        )
    if keep_periods:
        if any(p.strip().lower() == "none" for p in keep_periods):
            if len(keep_periods) > 1:
                raise click.BadParameter(
                    "'none' cannot be combined with periods", param_hint="--keep-period"
                )
            options["keep_periods"] = None
        else:
            from cloudckpt.retention import periods

            try:
                options["keep_periods"] = periods(keep_periods)
            except ConfigurationError as exc:
                raise click.BadParameter(str(exc), param_hint="--keep-period") from None
    return options


def with_keep(
    retention: dict[str, Any], keep_last: int | None, keep_every: int | None
) -> dict[str, Any]:
    """``retention`` (``retention_settings``) plus ``--keep-last`` and ``--keep-every``
    where given: the run settings a writing command sets (unset: the run's stay)."""
    settings = dict(retention)
    if keep_last is not None:
        settings["keep_last"] = keep_last
    if keep_every is not None:
        settings["keep_every"] = keep_every
    return settings


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
        out[name] = value
    return out


def format_metrics(metrics: dict[str, Any]) -> str:
    """``eval_loss=0.31  acc=0.9`` (sorted by name; 6 significant digits)."""
    return "  ".join(
        f"{name}={value:.6g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in sorted(metrics.items())
    )
