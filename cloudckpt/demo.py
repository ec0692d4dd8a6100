"""``cloudckpt demo``: the whole product on an embedded S3 endpoint, in well under a minute.

1. Start a moto S3 server on 127.0.0.1 (no network, no cloud account) and a bucket.
2. Host 1: a training process (``cloudckpt._demo_train``) checkpoints every step in the
   background with ``CheckpointManager.save``.
3. Once ``kill_after`` checkpoints are committed and the next one is part-way through its
   upload, host 1 gets SIGKILL: a preemption with no warning.
4. The bucket is inspected: the killed upload's attempt prefix is there, torn (files
   missing, multipart upload incomplete, no manifest), and neither LATEST nor any commit
   record ever named it.
5. Host 2: a new process with an empty staging directory resumes from LATEST (claiming the
   run, which fences host 1), checks the restored weights, and trains on to the last step.
6. ``verify --all --read-data`` reads back every byte of every retained checkpoint, and the
   final weights are compared with those of a run that was never interrupted.

Needs ``moto[server]`` (from the root of a clone: ``pip install '.[demo]'``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloudckpt import attempt_layout, protocol
from cloudckpt._install import install_hint
from cloudckpt.errors import ConfigurationError, DemoError

if TYPE_CHECKING:
    from cloudckpt.stores import Store
    from cloudckpt.verify import VerifyReport

MiB = 1024 * 1024
BUCKET = "cloudckpt-demo"
RUN = "run"


@dataclasses.dataclass
class DemoConfig:
    steps: int = 8
    kill_after: int = 3  # committed checkpoints before the kill
    size_mib: int = 64
    step_seconds: float = 1.5
    seed: int = 42
    timeout: float = 120.0


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": 0.0, "max": 0.0}
    return {"median": round(statistics.median(values), 4), "max": round(max(values), 4)}


class _Child:
    """One training process and its event file."""

    def __init__(self, name: str, work: Path, cfg: dict[str, Any]) -> None:
        self.name = name
        self.events_path = work / f"{name}.events.jsonl"
        self.events_path.touch()
        config_path = work / f"{name}.json"
        config = {**cfg, "events": str(self.events_path), "spawned_at": time.time()}
        config_path.write_text(json.dumps(config))
        self.log_path = work / f"{name}.log"
        env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cloudckpt._demo_train", str(config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        self.events: list[dict[str, Any]] = []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        """New events since the last call."""
        with open(self.events_path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self._offset += end
        new = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        self.events.extend(new)
        return new

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    def failure(self) -> str:
        tail = self.log_path.read_text(errors="replace")[-3000:]
        return f"{self.name} exited with code {self.proc.returncode}. Its output:\n{tail}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def _require_moto() -> None:
    try:
        import moto  # noqa: F401
        import werkzeug  # noqa: F401
    except ImportError:
        raise ConfigurationError(
            "cloudckpt demo needs an embedded S3 server (moto), which is not installed",
            hint=install_hint("demo"),
        ) from None


def run_demo(
    config: DemoConfig | None = None, *, say: Callable[[str], None] = lambda s: None
) -> dict[str, Any]:
    """Run the demo; return its report (see ``format_report``). ``say`` gets progress lines.

    Raises: ConfigurationError (moto missing, bad sizes), DemoError.
    """
    cfg = config or DemoConfig()
    if not 1 <= cfg.kill_after < cfg.steps:
        raise ConfigurationError("the demo needs 1 <= kill_after < steps")
    if not 8 <= cfg.size_mib <= 1024:
        raise ConfigurationError("--size-mib must be between 8 and 1024")
    _require_moto()
    from cloudckpt.testing.moto_server import MotoServer

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cloudckpt-demo-") as tmp, MotoServer() as server:
        work = Path(tmp)
        server.create_bucket(BUCKET)
        url = f"s3://{BUCKET}/{RUN}"
        say(f"S3 endpoint (moto) on {server.endpoint_url}; run {url}")
        base = {
            "url": url,
            "storage_options": server.storage_options(),
            "size": cfg.size_mib * MiB,
            "seed": cfg.seed,
            "steps": cfg.steps,
            "step_seconds": cfg.step_seconds,
        }
        kill, host1, host2 = _run(cfg, work, base, say)
        report: dict[str, Any] = {"endpoint": server.endpoint_url, "url": url, "kill": kill}
        _inspect(report, host1, host2, url, server.storage_options(), cfg, say)
    report["seconds"] = round(time.perf_counter() - began, 2)
    return report


def _run(
    cfg: DemoConfig, work: Path, base: dict[str, Any], say: Callable[[str], None]
) -> tuple[dict[str, Any], _Child, _Child]:
    """Host 1 trains until it is killed mid-upload, then host 2 resumes and finishes.
    Returns (the kill: step and bytes sent, host 1, host 2). Raises DemoError."""
    deadline = time.monotonic() + cfg.timeout
    kill, host1 = _run_host1(cfg, work, base, say, deadline)
    host2 = _run_host2(work, base, say, deadline)
    return kill, host1, host2


def _run_host1(
    cfg: DemoConfig,
    work: Path,
    base: dict[str, Any],
    say: Callable[[str], None],
    deadline: float,
) -> tuple[dict[str, Any], _Child]:
    """Host 1 trains and checkpoints until ``cfg.kill_after`` saves committed, then is
    SIGKILLed while it uploads the next. Returns (the kill, host 1). Raises DemoError."""
    host1 = _Child(
        "host-1",
        work,
        {**base, "staging_dir": str(work / "host-1-staging"), "restore_dir": str(work / "r1")},
    )
    kill: dict[str, Any] | None = None
    try:
        say(f"host 1 (pid {host1.proc.pid}) trains and checkpoints every step in the background")
        while kill is None:
            if time.monotonic() > deadline:
                raise DemoError("host 1 took too long to reach the kill point")
            if host1.proc.poll() is not None:
                host1.read()
                raise DemoError(host1.failure())
            for e in host1.read():
                if e["event"] == "committed":
                    say(f"  host 1 committed step {e['step']} in {e['commit_seconds']:.2f}s")
                elif (
                    e["event"] == "progress"
                    and len(host1.of("committed")) >= cfg.kill_after
                    and e["step"] is not None
                    and 0 < e["step_bytes"] < base["size"]
                ):
                    host1.kill()  # SIGKILL: no handler, no cleanup, like a lost VM
                    kill = {"step": e["step"], "bytes_sent": e["step_bytes"]}
                    break
            else:
                time.sleep(0.005)
    finally:
        host1.kill()
    host1.read()
    say(
        f"SIGKILL host 1 while it uploads step {kill['step']} "
        f"({kill['bytes_sent'] / MiB:.0f} of {base['size'] / MiB:.0f} MiB sent)"
    )
    return kill, host1


def _run_host2(
    work: Path, base: dict[str, Any], say: Callable[[str], None], deadline: float
) -> _Child:
    """Host 2, with an empty staging directory, resumes from LATEST and trains to the
    end. Raises DemoError if it fails or misses ``deadline``."""
    host2 = _Child(
        "host-2",
        work,
        {**base, "staging_dir": str(work / "host-2-staging"), "restore_dir": str(work / "r2")},
    )
    try:
        say(f"host 2 (pid {host2.proc.pid}, empty staging directory) resumes from LATEST")
        while host2.proc.poll() is None:
            if time.monotonic() > deadline:
                raise DemoError("host 2 took too long to finish training")
            for e in host2.read():
                if e["event"] == "resumed":
                    say(
                        f"  host 2 restored step {e['step']} in {e['seconds']:.2f}s "
                        f"(weights digest {'OK' if e['digest_ok'] else 'WRONG'}), "
                        f"claimed epoch {e['epoch']}"
                    )
                elif e["event"] == "committed":
                    say(f"  host 2 committed step {e['step']} in {e['commit_seconds']:.2f}s")
            time.sleep(0.02)
        host2.read()
        if host2.proc.returncode != 0:
            raise DemoError(host2.failure())
    finally:
        host2.kill()
    return host2


def _inspect(
    report: dict[str, Any],
    host1: _Child,
    host2: _Child,
    url: str,
    storage_options: dict[str, Any],
    cfg: DemoConfig,
    say: Callable[[str], None],
) -> None:
    """Read the run back after both hosts finished and fill ``report`` with what happened
    and with the proofs the demo set out to show. Raises DemoError (no LATEST)."""
    from cloudckpt._demo_train import final_digest

    kill = report["kill"]
    latest, h1_epoch, resumed, torn, verified = _read_back(
        url, storage_options, kill["step"], host1, host2, say
    )
    expected = final_digest(cfg.size_mib * MiB, cfg.seed, cfg.steps)
    committed = host1.of("committed") + host2.of("committed")
    saved = host1.of("saved") + host2.of("saved")
    final = latest.current
    report.update(
        {
            "steps": cfg.steps,
            "checkpoint_bytes": max((e["bytes"] for e in committed), default=0),
            "hosts": _hosts(host1, host2, h1_epoch, kill, resumed),
            "saves": _saves(committed, saved, kill),
            "torn_attempt": torn,
            "latest": {
                "step": final.step if final else None,
                "epoch": latest.writer.epoch,
                "seq": latest.seq,
                "retained_steps": [r.step for r in latest.retained()],
            },
            "verify": {
                "ok": verified.ok,
                "checkpoints": len(verified.checkpoints),
                "bytes_read": sum(c.bytes_read for c in verified.checkpoints),
            },
            "final_weights_match_uninterrupted_run": bool(
                final and final.metadata.get("weights_sha256") == expected
            ),
        }
    )
    proofs = {
        "killed_mid_upload": torn is not None and not torn["has_manifest"],
        "torn_attempt_never_referenced": torn is not None
        and not torn["referenced_by_latest"]
        and torn["commit_records_referencing"] == 0,
        "resumed_from_last_committed": resumed["step"] == kill["step"] - 1 and resumed["digest_ok"],
        "old_writer_fenced": latest.writer.epoch > h1_epoch,
        "all_steps_committed": final is not None and final.step == cfg.steps,
        "verify_read_data_ok": verified.ok,
        "final_weights_match_uninterrupted_run": report["final_weights_match_uninterrupted_run"],
    }
    report["proofs"] = proofs
    report["ok"] = all(proofs.values())


def _read_back(
    url: str,
    storage_options: dict[str, Any],
    step: int,
    host1: _Child,
    host2: _Child,
    say: Callable[[str], None],
) -> tuple[protocol.Latest, int, dict[str, Any], dict[str, Any] | None, VerifyReport]:
    """The run's LATEST, host 1's writer epoch, host 2's resume event, what is left of the
    attempt host 1 was killed in while uploading ``step`` (``_torn_attempt``) and
    ``verify --all --read-data``'s report. Raises DemoError (no LATEST)."""
    from cloudckpt.committer import read_latest
    from cloudckpt.stores import open_store
    from cloudckpt.verify import verify_run

    store = open_store(url, storage_options)
    try:
        versioned = read_latest(store)
        if versioned is None:
            raise DemoError(f"the demo's run at {url} has no LATEST after both hosts finished")
        latest = versioned.latest
        h1_epoch = next(e["epoch"] for e in host1.of("claimed"))
        resumed = host2.of("resumed")[0]
        torn = _torn_attempt(store, step, h1_epoch, latest)
        say("verify --all --read-data: reading back every byte of every retained checkpoint")
        verified = verify_run(store, all=True, read_data=True)
    finally:
        store.close()
    return latest, h1_epoch, resumed, torn, verified


def _torn_attempt(
    store: Store, step: int, epoch: int, latest: protocol.Latest
) -> dict[str, Any] | None:
    """What the store holds of the attempt host 1 (writer ``epoch``) was uploading for
    ``step`` when it was killed, and whether anything references it; None if nothing."""
    torn_prefixes = sorted(
        {
            o.key.split("/")[0] + "/" + o.key.split("/")[1] + "/"
            for o in store.list(f"{attempt_layout.CKPT_PREFIX}{step:012d}-e{epoch}-")
        }
    )
    records = [o.key for o in store.list(protocol.COMMITS_PREFIX)]
    referencing = []
    for key in records:
        body = protocol.parse_latest(store.get(key)[0], what=key)
        refs = body.referenced_prefixes()
        referencing += [(key, p) for p in torn_prefixes if p in refs]
    if not torn_prefixes:
        return None
    prefix = torn_prefixes[0]
    objects = [o.key[len(prefix) :] for o in store.list(prefix)]
    uploads = store.list_multipart(prefix)
    return {
        "step": step,
        "prefix": prefix,
        "objects": objects,
        "has_manifest": attempt_layout.MANIFEST_NAME in objects,
        "incomplete_uploads": len(uploads),
        "referenced_by_latest": prefix in latest.referenced_prefixes(),
        "commit_records_checked": len(records),
        "commit_records_referencing": len([k for k, _ in referencing]),
    }


def _hosts(
    host1: _Child, host2: _Child, h1_epoch: int, kill: dict[str, Any], resumed: dict[str, Any]
) -> list[dict[str, Any]]:
    """The report's account of the two hosts: the killed one and the one that resumed."""
    return [
        {
            "name": "host-1",
            "pid": host1.proc.pid,
            "epoch": h1_epoch,
            "trained_steps": [e["step"] for e in host1.of("saved")],
            "committed_steps": [e["step"] for e in host1.of("committed")],
            "killed_while_uploading_step": kill["step"],
            "killed_after_bytes": kill["bytes_sent"],
        },
        {
            "name": "host-2",
            "pid": host2.proc.pid,
            "epoch": resumed["epoch"],
            "resumed_from_step": resumed["step"],
            "restore_seconds": round(resumed["seconds"], 3),
            "restored_weights_verified": resumed["digest_ok"],
            "bytes_downloaded": resumed.get("bytes_downloaded"),
            "time_to_first_step": _first_step(resumed, host2.of("first-step")),
            "trained_steps": [e["step"] for e in host2.of("saved")],
            "committed_steps": [e["step"] for e in host2.of("committed")],
        },
    ]


def _saves(
    committed: list[dict[str, Any]], saved: list[dict[str, Any]], kill: dict[str, Any]
) -> dict[str, Any]:
    """The report's account of the saves: how many, how long they blocked, the bytes."""
    return {
        "committed": len(committed),
        "blocking_seconds": _stats([e["blocking_seconds"] for e in committed]),
        "staging_write_seconds": _stats([e["write_seconds"] for e in saved]),
        "commit_seconds": _stats([e["commit_seconds"] for e in committed]),
        "bytes_uploaded": sum(e["bytes"] for e in committed),
        "bytes_sent_by_killed_upload": kill["bytes_sent"],
    }


def _first_step(resumed: dict[str, Any], first: list[dict[str, Any]]) -> dict[str, float]:
    """Host 2's time from its process start to the end of its first training step, split."""
    parts = ("startup_s", "claim_s", "listing_s", "transfer_s", "verify_s", "load_s")
    out = {k: round(float(resumed.get(k, 0.0)), 4) for k in parts}
    if first:
        out["step_s"] = round(float(first[0]["step_s"]), 4)
        out["total_s"] = round(float(first[0]["since_spawn_s"]), 4)
    return out


def _mib(n: float) -> str:
    return f"{n / MiB:,.0f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1000:,.0f} ms" if s < 10 else f"{s:,.1f} s"


def format_report(r: dict[str, Any]) -> str:
    """The demo's report as a short, readable text."""
    h1, h2 = r["hosts"]
    s, torn, latest = r["saves"], r["torn_attempt"], r["latest"]

    def span(steps: list[int]) -> str:
        return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else ",".join(map(str, steps)) or "-"

    lines = [
        f"cloudckpt demo: {r['steps']} training steps, a {_mib(r['checkpoint_bytes'])} "
        f"checkpoint every step, S3 = moto at {r['endpoint']}",
        "",
        f"host 1  trained {span(h1['trained_steps'])}, committed "
        f"{span(h1['committed_steps'])}; SIGKILL while uploading step "
        f"{h1['killed_while_uploading_step']} ({_mib(h1['killed_after_bytes'])} sent)",
        f"host 2  new process, empty staging: restored step {h2['resumed_from_step']} in "
        f"{_ms(h2['restore_seconds'])} (weights "
        f"{'verified' if h2['restored_weights_verified'] else 'WRONG'}), trained "
        f"{span(h2['trained_steps'])}, committed {span(h2['committed_steps'])}",
        _first_step_line(h2["time_to_first_step"]),
        "",
        f"saves committed      {s['committed']}",
        f"save() blocking      median {_ms(s['blocking_seconds']['median'])}, "
        f"max {_ms(s['blocking_seconds']['max'])}  (writing into staging: median "
        f"{_ms(s['staging_write_seconds']['median'])})",
        f"time to commit       median {_ms(s['commit_seconds']['median'])}, "
        f"max {_ms(s['commit_seconds']['max'])}  (upload + manifest + LATEST, in the background)",
        f"bytes uploaded       {_mib(s['bytes_uploaded'])} committed "
        f"(+ {_mib(s['bytes_sent_by_killed_upload'])} of the killed upload)",
        "",
        "the torn attempt was never visible:",
    ]
    if torn:
        lines += [
            f"  {torn['prefix']} is in the bucket with {len(torn['objects'])} object(s) "
            f"({', '.join(torn['objects']) or 'none'}), "
            f"{torn['incomplete_uploads']} incomplete multipart upload(s), "
            f"{'a' if torn['has_manifest'] else 'no'} MANIFEST.json",
            f"  referenced by LATEST: {'yes' if torn['referenced_by_latest'] else 'no'}; "
            f"by any of the {torn['commit_records_checked']} commit records: "
            f"{'yes' if torn['commit_records_referencing'] else 'no'}",
        ]
    else:
        lines.append("  (no torn attempt found: the kill landed after the upload finished)")
    v = r["verify"]
    lines += [
        f"  LATEST: step {latest['step']}, writer epoch {latest['epoch']} (host 1's epoch "
        f"{h1['epoch']} is fenced), retains steps {', '.join(map(str, latest['retained_steps']))}",
        f"  verify --all --read-data: {v['checkpoints']} checkpoint(s) "
        f"{'OK' if v['ok'] else 'DAMAGED'}, {_mib(v['bytes_read'])} read back and hashed",
        "  final weights equal an uninterrupted run's: "
        + ("yes" if r["final_weights_match_uninterrupted_run"] else "NO"),
        "",
        f"{'PASS' if r['ok'] else 'FAIL'}"
        + f" in {r['seconds']:.1f} s"
        + ("" if r["ok"] else ": " + ", ".join(k for k, v in r["proofs"].items() if not v)),
    ]
    return "\n".join(lines)


def _first_step_line(t: dict[str, float]) -> str:
    if "total_s" not in t:
        return "        (no first step after the resume)"
    return (
        f"        time to first step {_ms(t['total_s'])}: process start "
        f"{_ms(t['startup_s'])}, claim {_ms(t['claim_s'])}, listing {_ms(t['listing_s'])}, "
        f"transfer {_ms(t['transfer_s'])}, verification {_ms(t['verify_s'])} (the rest "
        f"overlaps the transfer), load {_ms(t['load_s'])}, step {_ms(t['step_s'])}"
    )


def report_json(r: dict[str, Any]) -> str:
    return json.dumps(r, indent=2, sort_keys=True)
