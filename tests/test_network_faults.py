"""Network faults between cloudckpt and a real moto S3 server, injected by a loopback HTTP
proxy (cloudckpt.testing.proxy): 503s, 500s after the write was applied, connection resets
before and after the request reached the server, truncated answers, stalls past the
client's read timeout.

Saves either succeed (through retries) or fail cleanly without committing; restores either
succeed with verified bytes or fail with a clear StoreError (never a silent fallback to an
older checkpoint); no acknowledged save is lost.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from urllib.parse import unquote

import pytest

from cloudckpt import (
    CheckpointManager,
    CloudCkptError,
    CommitStateUnknownError,
    StoreError,
    TransferConfig,
)
from cloudckpt.committer import read_latest
from cloudckpt.restore import restore
from cloudckpt.stores import _s3_client, open_store
from cloudckpt.testing.proxy import FaultProxy, ProxyRule
from cloudckpt.transfer import TransferEngine

# Small retries and timeouts keep the test fast; the stall outlasts the read timeout.
CLIENT = {"retries": {"mode": "standard", "max_attempts": 2}, "connect_timeout": 1, "read_timeout": 1}  # fmt: skip
TRANSFER = TransferConfig(concurrency=2, multipart_threshold=48 * 1024, attempts=3)


def _content(step: int) -> dict[str, bytes]:
    rng = random.Random(step)
    return {"model.bin": rng.randbytes(rng.choice([2_000, 60_000])), "meta.json": b"%d" % step}


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def proxied(moto_server, s3_target, request):
    # Our own retries (not only the SDK's) must cope: most tests turn the SDK's off.
    sdk_attempts = getattr(request, "param", 1)
    config = {**CLIENT, "retries": {"mode": "standard", "max_attempts": sdk_attempts}}
    with FaultProxy(moto_server.endpoint_url, seed=5, stall_seconds=1.2) as proxy:
        options = {
            **s3_target.storage_options,
            "endpoint_url": proxy.endpoint_url,
            "config_kwargs": config,
        }
        yield proxy, s3_target.url, options


def _save(mgr, step):
    handle = mgr.save(step=step, metadata={"step": step})
    with handle as d:
        for rel, data in _content(step).items():
            (d / rel).write_bytes(data)
    return handle


@pytest.mark.parametrize("proxied", [2], indirect=True)  # an SDK retry may meet our own write
@pytest.mark.parametrize("fault", ["503", "500_after", "reset_before", "reset_after", "stall"])
def test_lost_or_failed_commit_of_latest_resolves_to_what_latest_shows(proxied, tmp_path, fault):
    proxy, url, options = proxied
    mgr = CheckpointManager(
        url, storage_options=options, staging_dir=tmp_path / "s", transfer=TRANSFER
    )
    _save(mgr, 1).result()
    proxy.add(ProxyRule(fault, methods={"PUT"}, path="/LATEST", times=1))
    try:
        info = _save(mgr, 2).result()
    except CommitStateUnknownError:
        info = None
    assert proxy.injected[fault] == 1
    latest = read_latest(open_store(url, options)).latest
    if info is not None:  # acknowledged: it is current, committed exactly once
        assert latest.current.commit_id == info.commit_id
        assert [r.step for r in latest.retained()] == [2, 1]
    else:
        assert latest.current.step in (1, 2)
    mgr.close()


def test_saves_under_random_network_faults_succeed_or_fail_cleanly(proxied, tmp_path):
    proxy, url, options = proxied
    for fault, p in [("503", 0.05), ("reset_before", 0.03), ("reset_after", 0.03),
                     ("500_after", 0.03), ("cut_response", 0.02), ("stall", 0.01)]:  # fmt: skip
        proxy.add(ProxyRule(fault, probability=p))
    mgr = CheckpointManager(
        url, storage_options=options, staging_dir=tmp_path / "s", keep_last=None, transfer=TRANSFER
    )
    acked, failed, unknown = {}, [], []
    with contextlib.suppress(CloudCkptError):  # else the first save claims
        mgr.resume(into=tmp_path / "first")
    for step in range(1, 8):
        try:
            acked[step] = _save(mgr, step).result().commit_id
        except CommitStateUnknownError:
            unknown.append(step)
        except CloudCkptError as exc:
            assert exc.hint, exc  # a clear error says what to do
            failed.append(step)
    faults = sum(proxy.injected.values())
    proxy.clear()
    store = open_store(url, options)
    latest = read_latest(store).latest
    retained = {r.commit_id: r for r in latest.retained()}
    for step, cid in acked.items():  # nothing acknowledged is lost
        assert cid in retained and retained[cid].step == step
    for step in failed:  # a clean failure committed nothing
        assert all(r.step != step for r in retained.values()), step
    with TransferEngine(TRANSFER) as engine:
        for rec in latest.retained():  # and everything committed is intact
            res = restore(store, tmp_path / f"check-{rec.step}", engine, step=rec.step)
            assert _tree(res.path) == _content(rec.step) and not res.skipped
    print(f"\n{len(acked)} acked, {len(failed)} failed, {len(unknown)} unknown, {faults} faults")
    assert faults >= 5 and len(acked) >= 3
    with contextlib.suppress(CloudCkptError):  # close() reports failed saves again
        mgr.close()


def _data(target: str) -> bool:
    """A request for checkpoint data: a whole file or a chunk (not a listing)."""
    return "/files/" in target or ("/chunks/" in target and "prefix=" not in target)


def test_persistent_faults_fail_cleanly_and_lose_nothing(proxied, tmp_path):
    proxy, url, options = proxied
    mgr = CheckpointManager(
        url, storage_options=options, staging_dir=tmp_path / "s", transfer=TRANSFER
    )
    _save(mgr, 1).result()
    store = open_store(url, options)
    before = {o.key: o.version for o in store.list("") if not o.key.startswith("ckpt/")}
    proxy.add(ProxyRule("503", methods={"PUT"}, path=_data))  # every data upload
    with pytest.raises(StoreError) as err:
        _save(mgr, 2).result()
    assert "SlowDown" in str(err.value) and err.value.hint
    after = {o.key: o.version for o in store.list("") if not o.key.startswith("ckpt/")}
    assert after == before  # LATEST and the commit records are untouched
    proxy.clear()
    proxy.add(ProxyRule("reset_before", methods={"GET"}, path=_data))  # every download
    engine = TransferEngine(TRANSFER)
    with pytest.raises(StoreError) as err:
        restore(store, tmp_path / "r", engine)
    assert not (tmp_path / "r").exists()
    assert "no complete answer" in str(err.value) or "could not reach" in str(err.value)
    proxy.clear()
    res = restore(store, tmp_path / "r", engine)  # the network is back: all is there
    assert res.step == 1 and _tree(res.path) == _content(1)
    engine.close()
    with contextlib.suppress(CloudCkptError):
        mgr.close()


@pytest.fixture(params=["s3", "seaweedfs", "seaweedfs-lean"])
def read_proxied(request, behind_proxy, monkeypatch):
    """``proxied`` on moto and on SeaweedFS. On moto the client asks for response
    checksums (``response_checksum_validation="when_supported"``, botocore's default, not
    the store's): moto then sends the object's CRC32C and botocore wraps the body in its
    checksum reader, so moto's downloads take the S3 store's copy read path. On SeaweedFS
    with the lean ranged GET switched off they take the direct one; with it on (the
    default), the lean one after the first: the faults meet all three."""
    if request.param == "seaweedfs":
        monkeypatch.setitem(_s3_client.SAVINGS, "lean_get", False)
    target = request.getfixturevalue(f"{request.param.split('-')[0]}_target")
    proxy, options = behind_proxy(target, seed=5, stall_seconds=1.2)
    options["config_kwargs"] = {**CLIENT, "retries": {"mode": "standard", "max_attempts": 1}}
    if request.param == "s3":
        options["config_kwargs"]["response_checksum_validation"] = "when_supported"
    return proxy, target.url, options, request.param


#: The S3 store's read path each server's ranged downloads take (``S3Store.read_paths``)
#: under ``read_proxied``'s options, and with the store's defaults.
READ_PATH = {"s3": "copy", "seaweedfs": "direct", "seaweedfs-lean": "lean"}
DEFAULT_READ_PATH = {"s3": "direct", "seaweedfs": "direct"}


@pytest.mark.parametrize("fault", ["503", "reset_before", "cut_response", "cut_fin", "stall"])
def test_restore_under_network_faults_is_verified_or_fails_clearly(read_proxied, tmp_path, fault):
    proxy, url, options, server = read_proxied
    mgr = CheckpointManager(
        url, storage_options=options, staging_dir=tmp_path / "s", transfer=TRANSFER
    )
    for step in (1, 2):
        _save(mgr, step).result()
    mgr.close()
    store = open_store(url, options)
    engine = TransferEngine(TRANSFER)
    outcomes = []
    for i in range(3):
        proxy.clear()
        proxy.add(ProxyRule(fault, methods={"GET"}, probability=0.5, times=2))
        into = tmp_path / f"r{i}"
        try:
            res = restore(store, into, engine)
        except StoreError as exc:
            outcomes.append(type(exc).__name__)
            assert not into.exists() or not any(into.iterdir()), "a failed restore left files"
            assert not list(tmp_path.glob(f".r{i}.cloudckpt-tmp-*")), "temporary files left"
            continue
        # Never a silent fallback: a network blip is not damage.
        assert res.step == 2 and not res.skipped, res.skipped
        assert _tree(res.path) == _content(2)
        outcomes.append("ok")
    engine.close()
    print(f"\n{fault}: {outcomes}")
    assert "ok" in outcomes and proxy.injected[fault] > 0
    assert store.read_paths[READ_PATH[server]] > 0, store.read_paths
    if server == "seaweedfs-lean":  # faults met the lean path, and botocore took over
        assert store.read_paths["fallback"] > 0, store.read_paths
    else:
        assert store.read_paths["lean"] == 0, store.read_paths


def _media(target: str) -> bool:
    """A download of checkpoint data (for GCS: ``alt=media``, not a metadata GET)."""
    target = unquote(target)
    return _data(target) and ("/storage/v1/" not in target or "alt=media" in target)


@pytest.mark.parametrize("cut", ["cut_fin", "cut_response"], ids=["FIN", "RST"])
@pytest.mark.parametrize("backend", ["s3", "seaweedfs", "gcs", "azurite"])
def test_a_download_cut_short_is_read_again_not_taken_for_a_truncated_file(
    request, behind_proxy, tmp_path, backend, cut
):
    """Issue 28 #5: a ranged GET of checkpoint data whose body ends early (FIN: a clean
    close, RST: a reset) is read again; the newest checkpoint is restored, nothing skipped.
    (On GCS a FIN made the download look short, and restore fell back to the older step.)"""
    target = request.getfixturevalue(f"{backend}_target")
    mgr = CheckpointManager(
        target.url, storage_options=target.storage_options, staging_dir=tmp_path / "s",
        transfer=TRANSFER,
    )  # fmt: skip
    for step in (1, 2):
        _save(mgr, step).result()
    mgr.close()
    proxy, options = behind_proxy(target)
    rule = proxy.add(ProxyRule(cut, methods={"GET"}, path=_media, times=1))
    store = open_store(target.url, options)
    with TransferEngine(TRANSFER) as engine:
        res = restore(store, tmp_path / "r", engine)
    assert rule.fired == 1, "the proxy cut no download"
    assert res.step == 2 and not res.skipped, res.skipped
    assert _tree(res.path) == _content(2)
    if backend in DEFAULT_READ_PATH:  # the cut met the read path this server's downloads take
        assert store.read_paths[DEFAULT_READ_PATH[backend]] > 0, store.read_paths
