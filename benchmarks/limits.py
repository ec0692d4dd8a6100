"""Physical limits of this machine, measured in the same run as the contenders.

Every contender's figure is set against one of these (``fraction of the limit``):

- ``memcpy``: 1 GiB copied into a reused (already faulted-in) buffer, one thread and two
  threads (what ``save_state``'s stall is made of);
- ``sha256`` / ``crc32c``: one core hashing 1 GiB in 8 MiB pieces (``hashlib`` with
  OpenSSL; ``google-crc32c``): what cloudckpt's digests cost per GiB, per core;
- ``http put`` / ``http get``: the loopback HTTP ceiling, 1 GiB through a minimal Python
  server in its own process that discards what it receives (PUT) or sends one reused
  buffer (GET), with 8 connections and 8 MiB bodies; the benchmark S3 endpoint is a Python
  server of the same shape, so no client can beat this against it;
- ``disk write+fsync``: 1 GiB written from a reused buffer to the work directory and
  fsynced (what a durable restore or staging write needs at least).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
BODY = 8 * MiB
CONNECTIONS = 8


def _touch(buf: bytearray) -> bytearray:
    memoryview(buf)[::4096] = b"\x01" * len(range(0, len(buf), 4096))
    return buf


class Limits:
    """The limit measurements as benchmark contenders (one ``run`` per limit)."""

    def __init__(self, nbytes: int, work: Path) -> None:
        import numpy as np

        self.nbytes = nbytes
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        self.blob = os.urandom(nbytes)  # read-only bytes: what the hashes take
        self.src = np.frombuffer(self.blob, dtype=np.uint8)
        self.pieces = [self.blob[i : i + BODY] for i in range(0, nbytes, BODY)]
        self.dst = np.empty_like(self.src)
        self.dst[:] = 0  # fault it in: the measurement is of a reused buffer
        self.server = _HTTPSink().start()
        self.body = bytes(self.src[: min(BODY, nbytes)])
        self._pool = cf.ThreadPoolExecutor(CONNECTIONS)

    def close(self) -> None:
        self._pool.shutdown()
        self.server.stop()

    def memcpy_1(self, r: int) -> None:
        import numpy as np

        np.copyto(self.dst, self.src)

    def memcpy_2(self, r: int) -> None:
        import numpy as np

        half = len(self.src) // 2
        f = self._pool.submit(np.copyto, self.dst[:half], self.src[:half])
        np.copyto(self.dst[half:], self.src[half:])
        f.result()

    def sha256(self, r: int) -> None:
        view = memoryview(self.blob)
        for i in range(0, len(view), BODY):
            hashlib.sha256(view[i : i + BODY]).digest()

    def crc32c(self, r: int) -> None:
        import google_crc32c

        for piece in self.pieces:  # google-crc32c takes bytes only, not memoryviews
            google_crc32c.value(piece)

    def _parallel(self, fn: Any) -> None:
        n = max(1, self.nbytes // len(self.body))
        per = [n // CONNECTIONS + (1 if i < n % CONNECTIONS else 0) for i in range(CONNECTIONS)]
        list(self._pool.map(fn, [k for k in per if k]))

    def http_put(self, r: int) -> None:
        port, body = self.server.port, self.body

        def send(k: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            try:
                for _ in range(k):
                    conn.request("PUT", "/sink", body=body)
                    conn.getresponse().read()
            finally:
                conn.close()

        self._parallel(send)

    def http_get(self, r: int) -> None:
        port, size = self.server.port, len(self.body)

        def fetch(k: int) -> None:
            buf = memoryview(bytearray(size))
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            try:
                for _ in range(k):
                    conn.request("GET", f"/source?n={size}")
                    resp = conn.getresponse()
                    got = 0
                    while got < size:
                        got += resp.readinto(buf[got:]) or size
            finally:
                conn.close()

        self._parallel(fetch)

    def disk(self, r: int) -> None:
        path = self.work / f"limit-{r}.bin"
        view = memoryview(self.src)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for i in range(0, len(view), 64 * MiB):
                part = view[i : i + 64 * MiB]
                done = 0
                while done < len(part):
                    done += os.write(fd, part[done:])
            os.fsync(fd)
        finally:
            os.close(fd)

    def after_disk(self, r: int) -> None:
        (self.work / f"limit-{r}.bin").unlink(missing_ok=True)

    def contenders(self) -> list[tuple[str, Any, Any]]:
        return [
            ("memcpy 1 thread", self.memcpy_1, None),
            ("memcpy 2 threads", self.memcpy_2, None),
            ("sha256 1 core", self.sha256, None),
            ("crc32c 1 core", self.crc32c, None),
            ("http put (sink)", self.http_put, None),
            ("http get (source)", self.http_get, None),
            ("disk write+fsync", self.disk, self.after_disk),
        ]


class _HTTPSink:
    """``python limits.py --serve``: PUT bodies discarded, GET ``?n=`` bytes sent."""

    def __init__(self) -> None:
        self.port = 0
        self.pid: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> _HTTPSink:
        cmd = [sys.executable, os.path.abspath(__file__), "--serve"]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.port = int(self._proc.stdout.readline().split()[1])
        self.pid = self._proc.pid
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdout.close()
            self._proc.stdin.close()
            self._proc = None


def _serve_conn(sock: socket.socket, source: bytes) -> None:
    buf = bytearray(16 * MiB)
    view = memoryview(buf)
    pending = b""
    try:
        while True:
            while b"\r\n\r\n" not in pending:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                pending += chunk
            head, _, pending = pending.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            left = length - len(pending)
            pending = pending[length:] if left < 0 else b""
            while left > 0:
                left -= sock.recv_into(view[: min(left, len(buf))])
            if method == "GET":
                n = int(target.partition("n=")[2] or 0)
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
                sock.sendall(memoryview(source)[:n])
            else:
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    except OSError:
        return
    finally:
        sock.close()


def _serve() -> None:
    source = os.urandom(32 * MiB)
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    print(f"PORT {listener.getsockname()[1]}", flush=True)

    def watch() -> None:  # end with the parent
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    while True:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve_conn, args=(sock, source), daemon=True).start()


if __name__ == "__main__":
    if "--serve" in sys.argv:
        _serve()
    else:  # a quick look: python benchmarks/limits.py
        lim = Limits(256 * MiB, Path("/tmp/cloudckpt-limits"))
        try:
            for name, fn, after in lim.contenders():
                t0 = time.perf_counter()
                fn(0)
                dt = time.perf_counter() - t0
                if after:
                    after(0)
                print(f"{name:<20} {lim.nbytes / GiB / dt:6.2f} GiB/s")
        finally:
            lim.close()
