"""The backend conformance suite, written once and run against every store.

Each ``check_*`` function takes a ``StoreOpener`` (a zero-argument callable returning a new,
independent ``Store`` client on the same root) and raises ``AssertionError`` if the backend
breaks the contract of ``cloudckpt.stores.base``. Users can run it against their own
bucket or S3-compatible service::

    from cloudckpt.testing.conformance import run_all
    run_all(lambda: open_store("s3://my-bucket/conformance", opts))

The racing checks use real concurrency: one thread per writer, each with its own client;
``check_racing_creates_processes`` uses separate processes (for ``file://``).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "ALL_CHECKS",
    "StoreOpener",
    "check_cas_increments",
    "check_chunked_checkpoint_roundtrip",
    "check_clock",
    "check_create_refuses_existing",
    "check_cut_responses",
    "check_listing",
    "check_multipart_roundtrip",
    "check_racing_creates",
    "check_racing_creates_processes",
    "check_ranged_reads_into",
    "check_read_write_basics",
    "check_stale_version_fails",
    "check_update_missing_fails",
    "check_versions_change",
    "run_all",
]

from cloudckpt.errors import (
    ChecksumMismatchError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreConflictError,
    TransientStoreError,
)
from cloudckpt.stores import (
    CREATE,
    OVERWRITE,
    ObjectInfo,
    Store,
    Update,
    crc32c_b64,
    open_store,
)

StoreOpener = Callable[[], Store]

MiB = 1024 * 1024


def _key(name: str) -> str:
    return f"conformance/{name}-{uuid.uuid4().hex[:8]}"


def _race(opener: StoreOpener, n: int, fn: Callable[[Store, int], Any]) -> list[Any]:
    """Run ``fn(store_i, i)`` in ``n`` threads released together; return results or errors."""
    stores = [opener() for _ in range(n)]
    barrier = threading.Barrier(n)

    def run(i: int) -> Any:
        barrier.wait()
        try:
            return fn(stores[i], i)
        except Exception as exc:  # collected and judged by the caller
            return exc

    try:
        with cf.ThreadPoolExecutor(n) as pool:
            return list(pool.map(run, range(n)))
    finally:
        for s in stores:
            s.close()


def check_racing_creates(opener: StoreOpener, writers: int = 8) -> None:
    """N racing create-only puts of one key: exactly one wins, the rest are refused."""
    key = _key("race-create")
    results = _race(opener, writers, lambda s, i: s.put(key, b"writer-%d" % i, mode=CREATE))
    winners = [i for i, r in enumerate(results) if not isinstance(r, Exception)]
    losers = [r for r in results if isinstance(r, Exception)]
    assert len(winners) == 1, f"expected exactly one create to win, got {len(winners)}: {results}"
    assert all(isinstance(r, PreconditionFailedError) for r in losers), losers
    with opener() as store:
        data, _ = store.get(key)
    assert data == b"writer-%d" % winners[0], "the stored bytes are not the winner's"


def check_cas_increments(opener: StoreOpener, writers: int = 4, increments: int = 10) -> None:
    """N writers x M compare-and-swap increments of one counter: no update is lost."""
    key = _key("cas-counter")
    with opener() as store:
        store.put(key, b"0", mode=CREATE)

    def worker(store: Store, i: int) -> int:
        done = attempts = 0
        while done < increments:
            attempts += 1
            assert attempts < increments * writers * 50, "compare-and-swap never succeeds"
            data, info = store.get(key)
            time.sleep(0.001)  # widen the read-modify-write window, as network latency does
            try:
                store.put(key, b"%d" % (int(data) + 1), mode=Update(info.version))
            except (PreconditionFailedError, StoreConflictError):
                continue
            done += 1
        return done

    results = _race(opener, writers, worker)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    with opener() as store:
        data, _ = store.get(key)
    assert int(data) == writers * increments, (
        f"lost updates: counter is {int(data)}, expected {writers * increments}"
    )


def check_stale_version_fails(opener: StoreOpener) -> None:
    """A compare-and-swap from a version that is no longer current is refused."""
    key = _key("stale")
    with opener() as store:
        first = store.put(key, b"one", mode=CREATE)
        second = store.put(key, b"two", mode=Update(first.version))
        try:
            store.put(key, b"three", mode=Update(first.version))
        except PreconditionFailedError:
            pass
        else:
            raise AssertionError("compare-and-swap from a stale version was applied")
        data, info = store.get(key)
        assert data == b"two", data
        assert info.version == second.version, (info.version, second.version)
        store.put(key, b"four", mode=Update(second.version))
        assert store.get(key)[0] == b"four"


def check_create_refuses_existing(opener: StoreOpener) -> None:
    """A create-only put of an existing key is refused and leaves the object alone."""
    key = _key("exists")
    with opener() as store:
        store.put(key, b"original", mode=OVERWRITE)
        try:
            store.put(key, b"intruder", mode=CREATE)
        except PreconditionFailedError:
            pass
        else:
            raise AssertionError("create-only put overwrote an existing object")
        assert store.get(key)[0] == b"original"


def check_versions_change(opener: StoreOpener) -> None:
    """Every write changes the version; for identical bytes too where the store promises it."""
    key = _key("versions")
    with opener() as store:
        seen = [store.put(key, b"a", mode=CREATE).version]
        for body in (b"b", b"c", b"b"):
            info = store.put(key, body, mode=Update(seen[-1]))
            if store.capabilities.unique_versions:
                assert info.version not in seen, f"version {info.version} repeated after a write"
            else:  # S3: an ETag is the MD5 of the bytes, so "b" again is the old "b" ETag
                assert info.version != seen[-1], "version unchanged after a write"
            assert store.head(key).version == info.version
            seen.append(info.version)
        same = store.put(key, b"b", mode=OVERWRITE)  # identical to the current bytes
        if store.capabilities.unique_versions:
            assert same.version != seen[-1], "identical bytes kept the same version"
            # And the old version must now be stale.
            try:
                store.put(key, b"x", mode=Update(seen[-1]))
            except PreconditionFailedError:
                pass
            else:
                raise AssertionError("compare-and-swap blind to a write of identical bytes")
        else:
            # S3 ETags are MD5s: identical bytes give the identical version, which is why
            # the protocol never writes the same LATEST body twice (seq, commit_id).
            assert same.version == seen[-1]


def check_update_missing_fails(opener: StoreOpener) -> None:
    """A compare-and-swap of a key that does not exist is refused and creates nothing."""
    key = _key("missing")
    with opener() as store:
        other = store.put(_key("other"), b"x")
        try:
            store.put(key, b"y", mode=Update(other.version))
        except PreconditionFailedError:
            pass
        else:
            raise AssertionError("compare-and-swap of a missing key was applied")
        assert not store.exists(key)


def check_read_write_basics(opener: StoreOpener) -> None:
    """get/head/get_range/delete/list behave, and missing keys raise ObjectNotFoundError."""
    key = _key("basics")
    body = bytes(range(256)) * 64
    with opener() as store:
        info = store.put(key, body)
        assert info.size == len(body)
        data, got = store.get(key)
        assert data == body and got.version == info.version and got.size == len(body)
        head = store.head(key)
        assert head.size == len(body) and head.version == info.version
        assert head.last_modified is not None and head.last_modified.tzinfo is not None
        assert store.get_range(key, 10, 100) == body[10:110]
        assert store.get_range(key, len(body) - 5, 100) == body[-5:]
        store.put(key + "-empty", b"")
        assert store.get(key + "-empty")[0] == b""
        for fn in (store.get, store.head):
            try:
                fn(key + "-nope")
            except ObjectNotFoundError:
                pass
            else:
                raise AssertionError(f"{fn.__name__} of a missing key did not raise")
        store.delete(key)
        store.delete(key)  # deleting a missing key is fine
        assert not store.exists(key)


def check_ranged_reads_into(opener: StoreOpener) -> None:
    """``get_range_into`` (part of every store, the restore path's read) fills the buffer,
    answers fewer bytes only at the end of the object, none past it, and raises
    ObjectNotFoundError for a missing key."""
    key = _key("into")
    body = bytes(range(256)) * 40
    with opener() as store:
        store.put(key, body)
        buf = bytearray(1000)
        assert store.get_range_into(key, 123, memoryview(buf)) == 1000
        assert bytes(buf) == body[123:1123]
        buf = bytearray(100)
        assert store.get_range_into(key, len(body) - 30, memoryview(buf)) == 30
        assert bytes(buf[:30]) == body[-30:]
        assert store.get_range_into(key, len(body), memoryview(bytearray(10))) == 0
        try:
            store.get_range_into(key + "-nope", 0, memoryview(bytearray(10)))
        except ObjectNotFoundError:
            pass
        else:
            raise AssertionError("get_range_into of a missing key did not raise")


def check_cut_responses(
    opener: StoreOpener, cut: Callable[[bool], Any], key: str, body: bytes
) -> None:
    """A response cut short is a TransientStoreError for ``get``, ``get_range`` and
    ``get_range_into``, never fewer bytes: ``key`` holds ``body`` in the store ``opener``
    opens, and ``cut(True)`` makes every answer to a read of it end early (through a proxy,
    say), ``cut(False)`` stops that. After the cuts the same store reads it whole."""
    with opener() as store:
        start, length = len(body) // 4, len(body) // 2
        reads: dict[str, Callable[[], Any]] = {
            "get": lambda: store.get(key)[0],
            "get_range": lambda: store.get_range(key, start, length),
            "get_range_into": lambda: store.get_range_into(
                key, start, memoryview(bytearray(length))
            ),
        }
        cut(True)
        for name, read in reads.items():
            try:
                got = read()
            except TransientStoreError:
                continue
            size = got if isinstance(got, int) else len(got)
            raise AssertionError(f"{name} of a cut response returned {size} bytes, no error")
        cut(False)
        assert store.get(key)[0] == body
        assert store.get_range(key, start, length) == body[start : start + length]
        buf = bytearray(length)
        assert store.get_range_into(key, start, memoryview(buf)) == length
        assert bytes(buf) == body[start : start + length]


def check_listing(opener: StoreOpener) -> None:
    """Listing sees completed writes at once, in key order, filtered by prefix."""
    base = _key("list")
    keys = [f"{base}/a/1", f"{base}/a/2", f"{base}/b/1", f"{base}/c"]
    with opener() as store:
        for k in reversed(keys):
            store.put(k, k.encode())
        listed = [o.key for o in store.list(base + "/")]
        assert listed == keys, listed
        assert [o.key for o in store.list(base + "/a/")] == keys[:2]
        assert all(o.size == len(o.key) for o in store.list(base + "/"))
        store.delete(keys[0])
        assert [o.key for o in store.list(base + "/a/")] == keys[1:2]
        assert not any(o.key.startswith(".cloudckpt/") for o in store.list(""))


def check_multipart_roundtrip(opener: StoreOpener, verifies_checksums: bool = True) -> None:
    """A multipart upload with per-part CRC32C assembles the exact bytes; listing and abort
    of incomplete uploads work; CREATE completion refuses an existing key."""
    key = _key("multipart")
    with opener() as store:
        size = store.capabilities.min_part_size
        parts_data = [os.urandom(size), os.urandom(size), os.urandom(1234)]
        upload = store.create_multipart(key)
        pending = store.list_multipart(key)
        assert [p.upload_id for p in pending] == [upload.upload_id], pending
        assert pending[0].key == key and pending[0].initiated is not None
        parts = []
        for n, chunk in reversed(list(enumerate(parts_data, start=1))):  # out of order
            parts.append(store.upload_part(upload, n, chunk, crc32c=crc32c_b64(chunk)))
        parts.sort(key=lambda p: p.part_number)
        assert not store.exists(key), "an incomplete upload is visible"
        info = store.complete_multipart(upload, parts, mode=CREATE)
        data, got = store.get(key)
        assert data == b"".join(parts_data)
        assert info.size == len(data) and got.version == info.version
        assert store.list_multipart(key) == []
        if verifies_checksums:
            _check_part_checksum_refused(store, key + "-bad", parts_data[0])
        _check_create_completion_refused(store, key, data)
        _check_overwrite_completion(store, key, info)


def _check_part_checksum_refused(store: Store, key: str, data: bytes) -> None:
    """A part sent with a CRC32C of other bytes is refused."""
    bad = store.create_multipart(key)
    try:
        store.upload_part(bad, 1, data, crc32c=crc32c_b64(b"other bytes"))
    except ChecksumMismatchError:
        pass
    else:
        raise AssertionError("a part with a wrong CRC32C was accepted")
    finally:
        store.abort_multipart(bad)


def _check_create_completion_refused(store: Store, key: str, data: bytes) -> None:
    """Completing a multipart upload with CREATE onto ``key`` (holding ``data``) fails and
    leaves ``data``; the aborted upload is no longer listed."""
    again = store.create_multipart(key)
    part = store.upload_part(again, 1, b"late", crc32c=crc32c_b64(b"late"))
    try:
        store.complete_multipart(again, [part], mode=CREATE)
    except PreconditionFailedError:
        pass
    else:
        raise AssertionError("create-only multipart completion overwrote an object")
    finally:
        store.abort_multipart(again)
    assert store.get(key)[0] == data
    assert store.list_multipart(key) == []


def _check_overwrite_completion(store: Store, key: str, info: ObjectInfo) -> None:
    """Completing onto an existing key (OVERWRITE) is a write like any other: the version
    changes and a compare-and-swap from the old version (``info``'s) must fail."""
    size = store.capabilities.min_part_size
    replacement = os.urandom(size) + b"tail"
    again = store.create_multipart(key)
    parts = [
        store.upload_part(again, 1, replacement[:size], crc32c=crc32c_b64(replacement[:size])),
        store.upload_part(again, 2, replacement[size:], crc32c=crc32c_b64(replacement[size:])),
    ]
    replaced = store.complete_multipart(again, parts, mode=OVERWRITE)
    assert store.get(key)[0] == replacement
    assert replaced.version != info.version
    try:
        store.put(key, b"stale", mode=Update(info.version))
    except PreconditionFailedError:
        pass
    else:
        raise AssertionError("compare-and-swap blind to a multipart overwrite")


def check_clock(opener: StoreOpener) -> None:
    """``now()`` is timezone-aware and agrees with the modification time of a fresh write."""
    key = _key("clock")
    with opener() as store:
        info = store.put(key, b"t")
        head = store.head(key)
        now = store.now()
        assert now.tzinfo is not None
        assert head.last_modified is not None, "head() of a fresh write has no modification time"
        delta = abs((now - head.last_modified).total_seconds())
        assert delta < 120, f"store clock and object times disagree by {delta:.0f}s"
        del info


def _create_in_process(url: str, options: Mapping[str, Any], key: str, i: int, go: Any) -> str:
    go.wait(timeout=60)
    store = open_store(url, options)
    try:
        store.put(key, b"process-%d" % i, mode=CREATE)
        return "won"
    except PreconditionFailedError:
        return "lost"
    finally:
        store.close()


def check_racing_creates_processes(
    url: str, options: Mapping[str, Any] | None = None, writers: int = 6
) -> None:
    """Like ``check_racing_creates``, with one OS process per writer."""
    key = _key("race-process")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        go = manager.Barrier(writers)  # every process is up before any writes
        with cf.ProcessPoolExecutor(writers, mp_context=ctx) as pool:
            futures = [
                pool.submit(_create_in_process, url, dict(options or {}), key, i, go)
                for i in range(writers)
            ]
            results = [f.result() for f in futures]
    assert results.count("won") == 1, results
    with open_store(url, options) as store:
        data, _ = store.get(key)
    assert data == b"process-%d" % results.index("won")


def check_chunked_checkpoint_roundtrip(opener: StoreOpener) -> None:
    """The chunked layout end to end on this store: two saves by a ``CheckpointManager``
    whose unchanged file is stored once (the second names the first's chunks, created
    create-only), then a restore through a fresh client, byte for byte."""
    import tempfile
    from pathlib import Path

    from cloudckpt.committer import read_latest
    from cloudckpt.manager import CheckpointManager
    from cloudckpt.reader import fetch_manifest
    from cloudckpt.restore import restore
    from cloudckpt.transfer import TransferEngine

    shared = os.urandom(9 * MiB + 4321)  # two chunks: a whole 8 MiB leaf and a tail
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        writer = opener()
        try:
            with CheckpointManager(writer, staging_dir=Path(tmp) / "s", auto_gc=False) as mgr:
                for step in (1, 2):
                    files = {"shared.bin": shared, "step.txt": b"%d" % step}
                    with mgr.save(step) as d:
                        for name, data in files.items():
                            (d / name).write_bytes(data)
                    mgr.wait()
        finally:
            writer.close()
        store = opener()
        try:
            versioned = read_latest(store)
            assert versioned is not None, "no LATEST after two committed saves"
            current = versioned.latest.current
            assert current is not None, "LATEST has no current checkpoint after two saves"
            manifest = fetch_manifest(store, current)
            (entry,) = [f for f in manifest.files if f.path == "shared.bin"]
            assert entry.chunks is not None and len(entry.chunks) == 2, entry
            assert all(c.owner != current.ckpt for c in entry.chunks), "shared.bin re-sent"
            with TransferEngine() as engine:
                res = restore(store, Path(tmp) / "r", engine)
            got = {p.name: p.read_bytes() for p in res.path.iterdir()}
            assert got == files, sorted(got)
        finally:
            store.close()


ALL_CHECKS = (
    check_read_write_basics,
    check_ranged_reads_into,
    check_listing,
    check_create_refuses_existing,
    check_stale_version_fails,
    check_update_missing_fails,
    check_versions_change,
    check_racing_creates,
    check_cas_increments,
    check_multipart_roundtrip,
    check_clock,
    check_chunked_checkpoint_roundtrip,
)


def run_all(opener: StoreOpener) -> None:
    """Run every single-process check against the store ``opener`` returns."""
    for check in ALL_CHECKS:
        check(opener)
