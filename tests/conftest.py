"""Shared fixtures: real test servers (moto, SeaweedFS, fake-gcs-server, Azurite) and per-test store
targets.

Servers start once per session on free 127.0.0.1 ports and stop at the end; every test that
asks for a target gets a fresh bucket (or directory, or memory bucket).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any, NamedTuple

import pytest

# Never let a test reach a cloud metadata service or real credentials.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
for _var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
    os.environ.pop(_var, None)
# Nor real Azure credentials (tests set the variables they need themselves).
for _var in [v for v in os.environ if v.startswith(("AZURE_STORAGE_", "AZURE_CLIENT_"))]:
    os.environ.pop(_var, None)
# pytest stops truncating assertion explanations where CI or BUILD_NUMBER is set, and then
# explains a failed == between multi-MiB bytes by diffing their reprs for minutes: a failing
# test looked like a hang and died on its timeout (a mutant's guard did, in CI). Keep the
# truncation; big_bytes (the hook below) says what differs in large bytes instead.
for _var in ("CI", "BUILD_NUMBER"):
    os.environ.pop(_var, None)
os.environ["AWS_CONFIG_FILE"] = os.devnull
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull


class Target(NamedTuple):
    """Where a test's store lives: a URL and the storage options to open it with."""

    backend: str
    url: str
    storage_options: dict[str, Any]


def fresh_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def moto_server():
    from cloudckpt.testing.moto_server import MotoServer

    with MotoServer() as server:
        yield server


@pytest.fixture(scope="session")
def seaweedfs_server():
    from cloudckpt.testing.seaweedfs_server import SeaweedFSServer

    with SeaweedFSServer() as server:
        yield server


@pytest.fixture(scope="session")
def gcs_server():
    from cloudckpt.testing.gcs_server import FakeGCSServer

    with FakeGCSServer() as server:
        yield server


@pytest.fixture(scope="session")
def azurite_server():
    from cloudckpt.testing.azurite_server import AzuriteServer

    with AzuriteServer() as server:
        yield server


@pytest.fixture
def memory_target():
    from cloudckpt.stores.memory import drop_memory_bucket

    bucket = fresh_name("mem")
    yield Target("memory", f"memory://{bucket}/run", {})
    drop_memory_bucket(bucket)


@pytest.fixture
def file_target(tmp_path):
    return Target("file", f"file://{tmp_path}/bucket/run", {})


@pytest.fixture
def s3_target(moto_server):
    bucket = fresh_name("s3")
    moto_server.create_bucket(bucket)
    return Target("s3", f"s3://{bucket}/run", moto_server.storage_options())


@pytest.fixture
def seaweedfs_target(seaweedfs_server):
    """A fresh bucket on SeaweedFS: a second, real S3 implementation whose conditional
    writes are atomic (moto's are only because MotoServer serialises its requests)."""
    bucket = fresh_name("sw")
    seaweedfs_server.create_bucket(bucket)
    return Target("seaweedfs", f"s3://{bucket}/run", seaweedfs_server.storage_options())


@pytest.fixture
def gcs_target(gcs_server):
    bucket = fresh_name("gcs")
    gcs_server.create_bucket(bucket)
    return Target("gcs", f"gs://{bucket}/run", gcs_server.storage_options())


@pytest.fixture
def azurite_target(azurite_server):
    """A fresh container on Azurite (Azure Blob Storage's emulator), opened with a
    connection string for its development account."""
    container = fresh_name("az")
    azurite_server.create_container(container)
    return Target("azurite", f"az://{container}/run", azurite_server.storage_options())


BACKENDS = ["memory", "file", "s3", "seaweedfs", "gcs", "azurite"]


@pytest.fixture(params=BACKENDS)
def target(request) -> Target:
    """A fresh, empty run location on each backend (two S3 servers: moto and SeaweedFS;
    fake-gcs-server; Azurite)."""
    return request.getfixturevalue(f"{request.param}_target")


def _through(t: Target, proxy_url: str) -> dict[str, Any]:
    """``t``'s storage options, sent to ``proxy_url`` instead of its server."""
    options = dict(t.storage_options)
    if "connection_string" in options:  # Azurite: BlobEndpoint=http://host:port/account
        endpoint = options["connection_string"].split("BlobEndpoint=")[1].split(";")[0]
        server = endpoint.rsplit("/", 1)[0]
        options["connection_string"] = options["connection_string"].replace(server, proxy_url)
    else:
        options["endpoint_url"] = proxy_url
    return options


def _upstream(t: Target) -> str:
    options = t.storage_options
    if "connection_string" in options:
        return (
            options["connection_string"].split("BlobEndpoint=")[1].split(";")[0].rsplit("/", 1)[0]
        )
    return options["endpoint_url"]


@pytest.fixture
def behind_proxy():
    """Put a ``FaultProxy`` between a networked target's clients and its server:
    ``behind_proxy(target, **proxy_kwargs)`` -> (proxy, storage options that reach the
    server through it). The proxies stop at the end of the test."""
    from cloudckpt.testing.proxy import FaultProxy

    with contextlib.ExitStack() as stack:

        def _behind(t: Target, **kwargs: Any):
            proxy = stack.enter_context(FaultProxy(_upstream(t), **kwargs))
            return proxy, _through(t, proxy.endpoint_url)

        yield _behind


@pytest.fixture
def open_target():
    """Open a store on a target (each call is a new, independent client)."""
    from cloudckpt.stores import open_store

    opened = []

    def _open(t: Target, **kwargs: Any):
        store = open_store(t.url, t.storage_options, **kwargs)
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.close()


@pytest.fixture
def manager_factory(tmp_path):
    """Build CheckpointManagers on a target; each gets its own staging dir (a new host)."""
    from cloudckpt import CheckpointManager

    made = []

    def _make(t: Target | Any, **kwargs: Any):
        staging = tmp_path / f"staging-{len(made)}"
        if isinstance(t, Target):
            mgr = CheckpointManager(
                t.url, storage_options=t.storage_options, staging_dir=staging, **kwargs
            )
        else:  # a Store object
            mgr = CheckpointManager(t, staging_dir=staging, **kwargs)
        made.append(mgr)
        return mgr

    yield _make
    for mgr in made:
        # A test may leave failed saves behind on purpose; close() re-raises those.
        with contextlib.suppress(BaseException):
            mgr.close(timeout=60)


# CI time. The README's command runs the suite in 4 xdist workers (`-n 4`). Each test file
# runs whole on one worker, so its module fixtures (some take minutes: the install
# resolutions, the terraform init, the framework runs) are set up once; only
# test_mutations.py's tests (each an independent pytest subprocess, 5-230 s) are handed out
# one by one. Workers take files in this order, the longest first (per-file worker time of a
# 4-worker run, 2026-12-07: test_install 750 s, test_benchmarks 544 s, the mutation guards
# 3,409 s in all), so that no long file starts last while the other workers sit idle.
# (xdist's own `--dist loadgroup` cannot do this with pytest 9.2: it renames `item._nodeid`,
# which pytest no longer reads.)
LONGEST_FIRST = (
    "test_install.py",
    "test_benchmarks.py",
    "test_terraform.py",
    "test_mutations.py",
    "test_network_faults.py",
    "test_watch.py",
    "test_examples.py",
    "test_simulation.py",
    "test_integration_hf.py",
    "test_distributed_timeouts.py",
    "test_cli.py",
    "test_crash_kill.py",
    "test_integration_lightning.py",
    "test_integration_deepspeed.py",
)
SPREAD_ONE_BY_ONE = ("test_mutations.py",)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_xdist_make_scheduler(config, log):
    """Whole files to a worker, in collection order (pyproject's addopts turn xdist's
    reordering by test count off), but each of SPREAD_ONE_BY_ONE's tests on its own."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path.endswith(SPREAD_ONE_BY_ONE) else path

    return FileScheduling(config, log)


def pytest_configure(config):
    """``CLOUDCKPT_MUTANT=<name>``: run the session with one safety rule broken on purpose
    (``tests/mutants.py``; ``tests/test_mutations.py`` checks that its guards fail)."""
    name = os.environ.get("CLOUDCKPT_MUTANT")
    if name:
        import mutants

        config._cloudckpt_mutant = mutants.applied(name)
        config._cloudckpt_mutant.__enter__()


def pytest_assertrepr_compare(config, op, left, right):
    """Failed ``==`` on large bytes: say what differs, not a diff of reprs (``big_bytes``)."""
    import big_bytes

    if op == "==" and (big_bytes.holds_large_bytes(left) or big_bytes.holds_large_bytes(right)):
        return big_bytes.explain(left, right)
    return None


@pytest.fixture
def refused_url():
    """An http:// run URL whose port refuses connections (nothing listens there)."""
    from cloudckpt.testing.static_http import refused_port

    with refused_port() as port:
        yield f"http://127.0.0.1:{port}/run"
