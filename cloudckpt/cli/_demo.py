"""``cloudckpt demo``."""

from __future__ import annotations

import click

from cloudckpt.cli._common import emit_json, info, json_option
from cloudckpt.cli._main import cli


@cli.command("demo")
@click.option("--steps", default=8, show_default=True, help="Training steps in all.")
@click.option(
    "--kill-after",
    default=3,
    show_default=True,
    help="Committed checkpoints before host 1 is killed mid-upload.",
)
@click.option("--size-mib", default=64, show_default=True, help="Checkpoint size in MiB.")
@click.option(
    "--step-seconds",
    default=1.5,
    show_default=True,
    help="Length of one simulated training step.",
)
@json_option
def demo_cmd(
    steps: int, kill_after: int, size_mib: int, step_seconds: float, as_json: bool
) -> None:
    """Crash a training run mid-upload and resume it, on an embedded S3 (moto) endpoint.

    Starts a moto S3 server on 127.0.0.1, trains a toy model in a child process that
    checkpoints every step in the background, kills it with SIGKILL while an upload is in
    flight, resumes on a "new host" (a new process with an empty staging directory) from
    LATEST, trains to the end, and proves the torn upload was never visible. No network, no
    cloud account; needs moto (from the root of a clone: pip install '.[demo]').
    """
    from cloudckpt.demo import DemoConfig, format_report, run_demo

    config = DemoConfig(
        steps=steps, kill_after=kill_after, size_mib=size_mib, step_seconds=step_seconds
    )
    report = run_demo(config, say=info)
    if as_json:
        emit_json(report)
    else:
        click.echo(format_report(report))
    if not report["ok"]:
        raise click.exceptions.Exit(1)
