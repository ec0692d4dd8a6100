"""docker-compose.yml, the trainer's Dockerfile and examples/compose_trainer.py.

There is no Docker engine here, so the stack is validated offline, with Python packages
only (no docker-compose binary): ``tests/compose_check.py`` checks the file as ``docker
compose config -q`` does (interpolation, the Compose Specification's JSON schema, and the
references between services, volumes and ports), then a structural check of what the stack
must hold, and the trainer script itself run twice against the test moto server (train and
checkpoint, then resume from LATEST). Nothing is skipped: a missing torch fails with the fix
in the message.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_check import interpolate, problems

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
TRAINER = "examples/compose_trainer.py"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on", {})
    assert isinstance(deps, dict), "depends_on must use the long form with conditions"
    return {name: spec.get("condition", "") for name, spec in deps.items()}


def _command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def test_compose_config_is_valid():
    """What ``docker compose config -q`` checks, offline: with no variables set (every
    default applies) and with the image overrides the file's header documents."""
    assert problems(COMPOSE_FILE) == []
    overrides = {"MINIO_IMAGE": "minio/minio:latest", "TOTAL_STEPS": "10", "SAVE_EVERY": "5"}
    assert problems(COMPOSE_FILE, overrides) == []


def _broken(tmp_path: Path, change) -> Path:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    change(doc)
    out = tmp_path / "docker-compose.yml"
    out.write_text(yaml.safe_dump(doc))
    for needed in ("Dockerfile",):  # the trainer's build context is the file's directory
        (tmp_path / needed).write_text((REPO / needed).read_text())
    return out


_BREAKAGES = {
    "unknown service key": lambda d: d["services"]["minio"].update(imagee="x"),
    "depends on a missing service": lambda d: d["services"]["trainer"]["depends_on"].update(
        {"create-bucket": {"condition": "service_completed_successfully"}}
    ),
    "unknown depends_on condition": lambda d: d["services"]["trainer"]["depends_on"][
        "create-buckets"
    ].update(condition="service_done"),
    "undeclared named volume": lambda d: d["volumes"].pop("trainer-staging"),
    "port out of range": lambda d: d["services"]["minio"]["ports"].append("127.0.0.1:70000:9000"),
    "bad interpolation": lambda d: d["services"]["trainer"]["environment"].update(X="${BAD"),
    "environment value a mapping": lambda d: d["services"]["trainer"]["environment"].update(
        X={"a": 1}
    ),
    "healthcheck interval a number": lambda d: d["services"]["minio"]["healthcheck"].update(
        interval=[5]
    ),
    "dependency cycle": lambda d: d["services"]["minio"].update(
        depends_on={"create-buckets": {"condition": "service_started"}}
    ),
    "missing Dockerfile": lambda d: d["services"]["trainer"]["build"].update(
        dockerfile="Dockerfile.missing"
    ),
}


@pytest.mark.parametrize("breakage", sorted(_BREAKAGES))
def test_the_offline_check_refuses_what_compose_refuses(tmp_path, breakage):
    """Each mistake docker compose config refuses is found, named by where it is."""
    found = problems(_broken(tmp_path, _BREAKAGES[breakage]))
    assert found, f"{breakage}: not found"


def test_interpolation_follows_compose():
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} $SET $$SET", env) == (
        "v d d  v $SET"
    )
    assert interpolate("${SET:+alt}${UNSET:+alt}", env) == "alt"
    with pytest.raises(ValueError, match="required variable UNSET"):
        interpolate("${UNSET:?set it}", env)
    with pytest.raises(ValueError, match="invalid interpolation"):
        interpolate("cost $5", env)


def test_compose_services_healthchecks_and_dependencies(compose):
    services = compose["services"]
    for name in ("minio", "fake-gcs", "create-buckets", "trainer"):
        assert name in services, f"docker-compose.yml lacks service {name}"

    for name in ("minio", "fake-gcs", "trainer"):
        health = services[name].get("healthcheck")
        assert health and health.get("test"), f"{name} has no healthcheck"
        assert health["test"][0] in ("CMD", "CMD-SHELL"), name

    assert "fsouza/fake-gcs-server:" in services["fake-gcs"]["image"]
    assert "minio/minio:" in services["minio"]["image"]
    assert "minio/mc:" in services["create-buckets"]["image"]

    assert _depends_on(services["create-buckets"]) == {"minio": "service_healthy"}
    assert _depends_on(services["trainer"]) == {"create-buckets": "service_completed_successfully"}
    assert _depends_on(services["create-gcs-bucket"]) == {"fake-gcs": "service_healthy"}

    # The bucket the trainer writes to is the one create-buckets makes.
    env = services["trainer"]["environment"]
    bucket = re.match(r"s3://([^/]+)/", env["CKPT_URL"]).group(1)
    assert f"local/{bucket}" in " ".join(_command(services["create-buckets"]))
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_SECRET_ACCESS_KEY"]


def test_trainer_build_and_command_reference_real_files(compose):
    trainer = compose["services"]["trainer"]
    build = trainer["build"]
    context = REPO / build.get("context", ".")
    dockerfile = context / build.get("dockerfile", "Dockerfile")
    assert dockerfile.is_file(), f"trainer builds from {dockerfile}, which does not exist"

    scripts = [arg for arg in _command(trainer) if arg.endswith(".py")]
    assert scripts == [TRAINER]
    assert (REPO / TRAINER).is_file()

    text = dockerfile.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    torch_line = next(line for line in text.splitlines() if "torch==" in line)
    assert "torch==2.13.0" in torch_line
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_line
    # The image installs with the lock CI tested, so a rebuild resolves to the same set.
    assert re.search(r"^RUN pip install -c constraints\.txt \.$", text, re.M)
    # Everything the image copies must exist and must not be excluded by .dockerignore.
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for copy in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for src in copy.split():
            assert src not in ignored, f".dockerignore excludes {src}, which the image copies"
            assert (REPO / src).exists(), f"Dockerfile copies missing {src}"
    assert {".git", ".venv"} <= ignored


def test_trainer_checkpoints_and_resumes(moto_server, tmp_path):
    """The compose trainer, run here against moto: it trains and saves, and a second run
    resumes from the last committed step instead of starting over."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.fail(
            "torch is not installed: examples/compose_trainer.py is a PyTorch job "
            "(pip install torch --index-url https://download.pytorch.org/whl/cpu)",
            pytrace=False,
        )
    bucket = f"compose-{uuid.uuid4().hex[:10]}"
    moto_server.create_bucket(bucket)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        {
            "CKPT_URL": f"s3://{bucket}/runs/compose-demo",
            "AWS_ENDPOINT_URL": moto_server.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "SAVE_EVERY": "10",
            "STEP_SLEEP": "0",
            "STAGING_DIR": str(tmp_path / "staging"),
            "HEARTBEAT_FILE": str(tmp_path / "heartbeat"),
            "PYTHONPATH": str(REPO),
        }
    )

    def run(total_steps: int) -> list[dict[str, Any]]:
        proc = subprocess.run(
            [sys.executable, str(REPO / TRAINER)],
            cwd=tmp_path,
            env={**env, "TOTAL_STEPS": str(total_steps)},
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert proc.returncode == 0, f"trainer failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]

    first = run(25)
    assert first[0]["event"] == "started"
    assert [e["step"] for e in first if e["event"] == "saved"] == [10, 20, 25]
    assert first[-1] == {**first[-1], "event": "done", "step": 25}
    assert (tmp_path / "heartbeat").exists()

    second = run(40)
    assert second[0]["event"] == "resumed"
    assert second[0]["step"] == 25
    assert [e["step"] for e in second if e["event"] == "saved"] == [30, 40]
    assert second[-1]["event"] == "done" and second[-1]["step"] == 40
    # Training continued from the restored state: the loss kept falling.
    first_loss = next(e["loss"] for e in first if e["event"] == "saved")
    assert second[-1]["loss"] < first_loss


def test_azurite_service_matches_the_tests_version(compose):
    """Azurite for az:// runs: the same version as the tests' (.ci/node/package.json), a
    healthcheck, loopback-only port, and a one-shot that creates the container."""
    services = compose["services"]
    azurite = services["azurite"]
    pinned = json.loads((REPO / ".ci" / "node" / "package.json").read_text())
    version = pinned["dependencies"]["azurite"]
    assert f"azure-storage/azurite:{version}" in azurite["image"], azurite["image"]
    assert azurite["healthcheck"]["test"][0] == "CMD"
    assert all(str(p).startswith("127.0.0.1:") for p in azurite["ports"])
    assert "--inMemoryPersistence" in azurite["command"]
    assert _depends_on(services["create-azure-container"]) == {"azurite": "service_healthy"}
    script = " ".join(_command(services["create-azure-container"]))
    assert 'create_container("checkpoints")' in script
    assert (
        "azurite:10000"
        in services["create-azure-container"]["environment"]["AZURE_STORAGE_CONNECTION_STRING"]
    )
