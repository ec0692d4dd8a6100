"""A minimal in-memory S3-compatible endpoint, for throughput benchmarks only.

moto spends about a core per 0.1 GB/s (it parses, hashes and copies every body in Python
objects), so against moto every S3 client measures moto. This endpoint does as little per
byte as a server can in Python: one ``recv_into`` per socket read straight into a buffer
that is reused once freed, no checksums, no MD5 ETags for big bodies (a counter), no signature checks,
ranged GETs sent with ``sendall`` from the stored buffers, multipart completion without
concatenating the parts. It runs in its own process (``S3Endpoint``), so it competes with
the client under test for CPU cores but not for the client's GIL.

Supported, as far as cloudckpt's ``S3Store``, boto3's transfer manager and s3fs need it:
bucket create/HEAD/location, PutObject (``If-None-Match: *`` and ``If-Match``), GetObject
(``Range``, ``If-Match``), HeadObject, DeleteObject, DeleteObjects, ListObjectsV2
(``prefix``, ``delimiter``, ``max-keys``, ``continuation-token``, ``start-after``),
multipart (create, upload part, complete with ``If-None-Match``, abort, list uploads),
CopyObject (whole objects),
``Expect: 100-continue``, chunked and ``aws-chunked`` bodies (decoded), keep-alive.
Anything else answers 501. Not for tests of S3 semantics: use moto for those.

Request accounting (the store's side of byte counts, never a client's report): every
request is counted by the door it came through (``doors``: one listening port each, all
serving the same objects, so a benchmark can give each simulated host its own), by kind
(``PUT``: objects, parts and copies; ``GET``; ``HEAD``; ``LIST``; ``DELETE``; ``POST``:
multipart create/complete, batch deletes) and by key, with the body bytes received and
the object bytes sent. ``S3Endpoint.stats(prefix)`` sums them for keys under a prefix;
``S3Endpoint.reset_stats()`` starts the counts again.

    python benchmarks/s3_endpoint.py --port 9000     # serve until interrupted
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import hashlib
import html
import http.client
import itertools
import json
import mmap
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Any

_HUGE = 1 << 20  # bodies at least this big use pooled, page-aligned buffers
_XMLNS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
_REASONS = {
    100: "Continue",
    200: "OK",
    204: "No Content",
    206: "Partial Content",
    304: "Not Modified",
    400: "Bad Request",
    404: "Not Found",
    409: "Conflict",
    411: "Length Required",
    412: "Precondition Failed",
    416: "Range Not Satisfiable",
    500: "Internal Server Error",
    501: "Not Implemented",
}


class _Pool:
    """Freed body buffers by size. Fresh memory costs a page fault per 4 KiB on first
    touch (expensive in a VM); a benchmark uploads the same part sizes again and again."""

    def __init__(self) -> None:
        self._free: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> Any:
        if size < _HUGE:
            return bytearray(size)
        with self._lock:
            bufs = self._free.get(size)
            if bufs:
                return bufs.pop()
        buf = mmap.mmap(-1, size)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                buf.madvise(mmap.MADV_HUGEPAGE)
        return buf

    def give(self, buf: Any) -> None:
        if isinstance(buf, mmap.mmap):
            with self._lock:
                self._free.setdefault(len(buf), []).append(buf)


class _Object:
    __slots__ = ("checksum", "etag", "mtime", "segments", "size")

    def __init__(self, segments: list[Any], etag: str, checksum: str | None = None) -> None:
        self.segments = segments
        self.size = sum(len(s) for s in segments)
        self.etag = etag
        self.mtime = time.time()
        self.checksum = checksum


class _Upload:
    __slots__ = ("initiated", "key", "parts")

    def __init__(self, key: str) -> None:
        self.key = key
        self.parts: dict[int, tuple[Any, str]] = {}
        self.initiated = time.time()


class _Error(Exception):
    def __init__(self, status: int, code: str, message: str = "") -> None:
        super().__init__(message or code)
        self.status, self.code, self.message = status, code, message or code


def _http_date(t: float | None = None) -> str:
    return email.utils.formatdate(t, usegmt=True)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(t))


class _State:
    def __init__(self) -> None:
        self.buckets: dict[str, dict[str, _Object]] = {}
        self.uploads: dict[str, _Upload] = {}
        self.lock = threading.Lock()  # makes conditional writes atomic
        self.pool = _Pool()
        self.counter = itertools.count(1)
        #: (door, kind, bucket/key) -> [requests, bytes received, object bytes sent]
        self.stats: dict[tuple[int, str, str], list[int]] = {}

    def count(self, door: int, kind: str, key: str, received: int, sent: int) -> None:
        with self.lock:
            row = self.stats.setdefault((door, kind, key), [0, 0, 0])
            row[0] += 1
            row[1] += received
            row[2] += sent

    def etag(self, body: Any = None, suffix: str = "") -> str:
        """S3's MD5 ETag for small bodies (metadata objects behave as on S3); a counter for
        big ones, where an MD5 would cost the server more than the client under test."""
        if body is not None and len(body) < _HUGE:
            return f'"{hashlib.md5(body).hexdigest()}"'
        return f'"{next(self.counter):032x}{suffix}"'

    def release(self, obj: _Object | None) -> None:
        if obj is not None:
            for seg in obj.segments:
                self.pool.give(seg)


class _Connection:
    """One client connection: parse requests, answer them, keep the connection."""

    def __init__(self, sock: socket.socket, state: _State, door: int = 0) -> None:
        self.sock = sock
        self.state = state
        self.door = door
        self.buf = b""
        self.sent = 0  # object bytes the current request's answer carries

    # --- reading ---------------------------------------------------------------------

    def _read_head(self) -> bytes | None:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                head, self.buf = self.buf[:end], self.buf[end + 4 :]
                return head
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buf += chunk

    def _read_into(self, view: memoryview) -> None:
        n = len(view)
        got = min(len(self.buf), n)
        if got:
            view[:got] = self.buf[:got]
            self.buf = self.buf[got:]
        while got < n:
            r = self.sock.recv_into(view[got:])
            if not r:
                raise ConnectionError("client closed mid-body")
            got += r

    def _read_exact(self, n: int) -> bytes:
        out = bytearray(n)
        self._read_into(memoryview(out))
        return bytes(out)

    def _read_line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("client closed mid-body")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _read_chunked(self, aws: bool) -> bytes:
        """``Transfer-Encoding: chunked`` or ``aws-chunked`` (with trailers) bodies."""
        parts = []
        while True:
            size = int(self._read_line().split(b";")[0], 16)
            if size == 0:
                while self._read_line():  # trailers, then the empty line
                    pass
                return b"".join(parts)
            parts.append(self._read_exact(size))
            self._read_line()

    def _read_body(self, headers: dict[str, str]) -> Any:
        if "100-continue" in headers.get("expect", "").lower():
            self.sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        te = headers.get("transfer-encoding", "").lower()
        aws = "aws-chunked" in headers.get("content-encoding", "") or headers.get(
            "x-amz-content-sha256", ""
        ).startswith("STREAMING-")
        if "chunked" in te:
            body = self._read_chunked(aws=False)
            if aws:
                body = self._decode_aws_chunked(body)
            return body
        n = int(headers.get("content-length", "0") or 0)
        if aws:
            return self._decode_aws_chunked(self._read_exact(n))
        buf = self.state.pool.take(n)
        self._read_into(memoryview(buf))
        return buf

    @staticmethod
    def _decode_aws_chunked(raw: bytes) -> bytes:
        out, pos = [], 0
        while True:
            eol = raw.index(b"\r\n", pos)
            size = int(raw[pos:eol].split(b";")[0], 16)
            pos = eol + 2
            if size == 0:
                return b"".join(out)
            out.append(raw[pos : pos + size])
            pos += size + 2

    # --- writing ---------------------------------------------------------------------

    def _send(
        self,
        status: int,
        headers: dict[str, str] | None = None,
        body: bytes = b"",
        segments: list[memoryview] | None = None,
        length: int | None = None,
        head_only: bool = False,
    ) -> None:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        hdrs = {"Date": _http_date(), "Server": "cloudckpt-bench", "x-amz-request-id": "0"}
        hdrs.update(headers or {})
        if length is None:
            length = len(body) if segments is None else sum(len(s) for s in segments)
        hdrs["Content-Length"] = str(length)
        lines += [f"{k}: {v}" for k, v in hdrs.items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if head_only:
            self.sock.sendall(head)
        elif segments is None:
            self.sock.sendall(head + body)
        else:
            self.sock.sendall(head)
            for seg in segments:
                self.sock.sendall(seg)

    def _send_error(self, err: _Error, resource: str, head_only: bool) -> None:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{err.code}</Code>'
            f"<Message>{html.escape(err.message)}</Message>"
            f"<Resource>{html.escape(resource)}</Resource><RequestId>0</RequestId></Error>"
        ).encode()
        self._send(err.status, {"Content-Type": "application/xml"}, body, head_only=head_only)

    def _send_xml(self, text: str, headers: dict[str, str] | None = None) -> None:
        body = ('<?xml version="1.0" encoding="UTF-8"?>\n' + text).encode()
        self._send(200, {"Content-Type": "application/xml", **(headers or {})}, body)

    # --- loop ------------------------------------------------------------------------

    def serve(self) -> None:
        try:
            while True:
                head = self._read_head()
                if head is None:
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    headers[k.strip().lower()] = v.strip()
                self._handle(method, target, headers)
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, OSError):
            return
        finally:
            with contextlib.suppress(OSError):
                self.sock.close()

    def _handle(self, method: str, target: str, headers: dict[str, str]) -> None:
        url = urllib.parse.urlsplit(target)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        path = urllib.parse.unquote(url.path)
        bucket, _, key = path.lstrip("/").partition("/")
        body: Any = b""
        if method in ("PUT", "POST"):
            body = self._read_body(headers)
        if path.startswith("/_bench/"):
            return self._admin(method, path, bytes(body).decode())
        self.sent = 0
        received = len(body)
        try:
            if not bucket:
                return self._list_buckets()
            if not key:
                return self._bucket_op(method, bucket, query, body)
            return self._object_op(method, bucket, key, query, headers, body)
        except _Error as err:
            if isinstance(body, mmap.mmap):
                self.state.pool.give(body)
            self._send_error(err, path, head_only=method == "HEAD")
        finally:
            kind = _kind(method, key, query)
            counted = f"{bucket}/{query.get('prefix', '')}" if kind == "LIST" else path[1:]
            self.state.count(self.door, kind, counted, received, self.sent)

    # --- admin -----------------------------------------------------------------------

    def _admin(self, method: str, path: str, arg: str) -> None:
        """``/_bench/reset`` (drop objects), ``/_bench/stats`` (the counts of keys under
        the prefix ``arg``, as JSON), ``/_bench/reset-stats``."""
        if path == "/_bench/reset" and method == "POST":
            self._reset(arg)
        elif path == "/_bench/stats" and method == "POST":
            with self.state.lock:
                rows = [
                    {
                        "door": d,
                        "kind": k,
                        "key": key,
                        "requests": r[0],
                        "received": r[1],
                        "sent": r[2],
                    }
                    for (d, k, key), r in self.state.stats.items()
                    if key.startswith(arg)
                ]
            return self._send(200, {"Content-Type": "application/json"}, json.dumps(rows).encode())
        elif path == "/_bench/reset-stats" and method == "POST":
            with self.state.lock:
                self.state.stats.clear()
        else:
            return self._send(404)
        self._send(200)

    def _reset(self, spec: str) -> None:
        """``bucket/prefix``: drop its objects (and their uploads); empty: everything."""
        bucket, _, prefix = spec.partition("/")
        st = self.state
        with st.lock:
            for name, objects in st.buckets.items():
                if bucket and name != bucket:
                    continue
                for k in [k for k in objects if k.startswith(prefix)]:
                    st.release(objects.pop(k))
            for uid in [u for u, up in st.uploads.items() if up.key.startswith(spec)]:
                for seg, _ in st.uploads.pop(uid).parts.values():
                    st.pool.give(seg)

    # --- buckets ---------------------------------------------------------------------

    def _objects(self, bucket: str) -> dict[str, _Object]:
        objects = self.state.buckets.get(bucket)
        if objects is None:
            raise _Error(404, "NoSuchBucket", "The specified bucket does not exist")
        return objects

    def _list_buckets(self) -> None:
        items = "".join(
            f"<Bucket><Name>{html.escape(b)}</Name><CreationDate>{_iso(0)}</CreationDate></Bucket>"
            for b in sorted(self.state.buckets)
        )
        self._send_xml(
            f"<ListAllMyBucketsResult {_XMLNS}><Owner><ID>bench</ID></Owner>"
            f"<Buckets>{items}</Buckets></ListAllMyBucketsResult>"
        )

    def _bucket_op(self, method: str, bucket: str, query: dict[str, str], body: Any) -> None:
        st = self.state
        if method == "PUT":
            with st.lock:
                st.buckets.setdefault(bucket, {})
            return self._send(200, {"Location": f"/{bucket}"})
        objects = self._objects(bucket)
        if method == "HEAD":
            return self._send(200, {"x-amz-bucket-region": "us-east-1"})
        if method == "GET" and "location" in query:
            return self._send_xml(f"<LocationConstraint {_XMLNS}></LocationConstraint>")
        if method == "GET" and "uploads" in query:
            return self._list_uploads(bucket, query)
        if method == "GET":
            return self._list_objects(bucket, objects, query)
        if method == "POST" and "delete" in query:
            keys = re.findall(rb"<Key>(.*?)</Key>", bytes(body), re.S)
            with st.lock:
                for k in keys:
                    st.release(objects.pop(html.unescape(k.decode()), None))
            return self._send_xml(f"<DeleteResult {_XMLNS}></DeleteResult>")
        if method == "DELETE":
            with st.lock:
                if objects:
                    raise _Error(409, "BucketNotEmpty")
                del st.buckets[bucket]
            return self._send(204)
        raise _Error(501, "NotImplemented", f"{method} on a bucket")

    def _list_objects(self, bucket: str, objects: dict[str, _Object], q: dict[str, str]) -> None:
        prefix = q.get("prefix", "")
        delimiter = q.get("delimiter", "")
        max_keys = int(q.get("max-keys", "1000"))
        start = q.get("continuation-token") or q.get("start-after") or q.get("marker", "")
        with self.state.lock:
            keys = sorted(k for k in objects if k.startswith(prefix) and k > start)
        contents, prefixes, count, last, truncated = [], [], 0, "", False
        seen: set[str] = set()
        for k in keys:
            if count >= max_keys:
                truncated = True
                break
            if delimiter:
                cut = k.find(delimiter, len(prefix))
                if cut >= 0:
                    p = k[: cut + len(delimiter)]
                    if p not in seen:
                        seen.add(p)
                        prefixes.append(p)
                        count += 1
                    last = k
                    continue
            obj = objects.get(k)
            if obj is None:
                continue
            contents.append(
                f"<Contents><Key>{html.escape(k)}</Key><LastModified>{_iso(obj.mtime)}"
                f"</LastModified><ETag>{html.escape(obj.etag)}</ETag><Size>{obj.size}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>"
            )
            count += 1
            last = k
        v2 = q.get("list-type") == "2"
        parts = [
            f"<ListBucketResult {_XMLNS}><Name>{html.escape(bucket)}</Name>",
            f"<Prefix>{html.escape(prefix)}</Prefix><MaxKeys>{max_keys}</MaxKeys>",
            f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>",
        ]
        if delimiter:
            parts.append(f"<Delimiter>{html.escape(delimiter)}</Delimiter>")
        if v2:
            parts.append(f"<KeyCount>{count}</KeyCount>")
            if truncated:
                parts.append(f"<NextContinuationToken>{html.escape(last)}</NextContinuationToken>")
        elif truncated:
            parts.append(f"<NextMarker>{html.escape(last)}</NextMarker>")
        parts += contents
        parts += [
            f"<CommonPrefixes><Prefix>{html.escape(p)}</Prefix></CommonPrefixes>" for p in prefixes
        ]
        parts.append("</ListBucketResult>")
        self._send_xml("".join(parts))

    def _list_uploads(self, bucket: str, q: dict[str, str]) -> None:
        prefix = f"{bucket}/{q.get('prefix', '')}"
        with self.state.lock:
            ups = sorted(
                (u.key, uid, u.initiated)
                for uid, u in self.state.uploads.items()
                if u.key.startswith(prefix)
            )
        items = "".join(
            f"<Upload><Key>{html.escape(k.partition('/')[2])}</Key><UploadId>{uid}</UploadId>"
            f"<Initiated>{_iso(t)}</Initiated></Upload>"
            for k, uid, t in ups
        )
        self._send_xml(
            f"<ListMultipartUploadsResult {_XMLNS}><Bucket>{html.escape(bucket)}</Bucket>"
            f"<IsTruncated>false</IsTruncated>{items}</ListMultipartUploadsResult>"
        )

    # --- objects ---------------------------------------------------------------------

    def _object_op(
        self,
        method: str,
        bucket: str,
        key: str,
        q: dict[str, str],
        headers: dict[str, str],
        body: Any,
    ) -> None:
        st = self.state
        objects = self._objects(bucket)
        if "uploadId" in q:
            return self._multipart(method, bucket, key, q, headers, body)
        if method == "POST" and "uploads" in q:
            uid = os.urandom(16).hex()
            with st.lock:
                st.uploads[uid] = _Upload(f"{bucket}/{key}")
            return self._send_xml(
                f"<InitiateMultipartUploadResult {_XMLNS}><Bucket>{html.escape(bucket)}</Bucket>"
                f"<Key>{html.escape(key)}</Key><UploadId>{uid}</UploadId>"
                "</InitiateMultipartUploadResult>"
            )
        if method == "PUT":
            if "x-amz-copy-source" in headers:
                return self._copy(objects, key, headers)
            obj = _Object([body], st.etag(body), headers.get("x-amz-checksum-crc32c"))
            self._store(objects, key, obj, headers)
            extra = {"ETag": obj.etag}
            if obj.checksum:
                extra["x-amz-checksum-crc32c"] = obj.checksum
            return self._send(200, extra)
        if method == "DELETE":
            with st.lock:
                st.release(objects.pop(key, None))
            return self._send(204)
        if method in ("GET", "HEAD"):
            return self._get(method, key, objects, headers)
        raise _Error(501, "NotImplemented", f"{method} on an object")

    def _copy(self, objects: dict[str, _Object], key: str, headers: dict[str, str]) -> None:
        """CopyObject (DCP's storage writers rename ``.metadata`` by copy and delete).
        The copy owns its bytes: segments go back to the pool when an object is deleted."""
        source = urllib.parse.unquote(headers["x-amz-copy-source"].split("?")[0]).lstrip("/")
        src_bucket, _, src_key = source.partition("/")
        src = self._objects(src_bucket).get(src_key)
        if src is None:
            raise _Error(404, "NoSuchKey", "The specified key does not exist.")
        buf = self.state.pool.take(src.size)
        pos = 0
        for seg in src.segments:
            buf[pos : pos + len(seg)] = seg
            pos += len(seg)
        obj = _Object([buf], self.state.etag(buf), src.checksum)
        self._store(objects, key, obj, headers)
        self._send_xml(
            f"<CopyObjectResult {_XMLNS}><LastModified>{_iso(obj.mtime)}</LastModified>"
            f"<ETag>{html.escape(obj.etag)}</ETag></CopyObjectResult>"
        )

    def _store(
        self, objects: dict[str, _Object], key: str, obj: _Object, headers: dict[str, str]
    ) -> None:
        st = self.state
        with st.lock:
            old = objects.get(key)
            if headers.get("if-none-match") == "*" and old is not None:
                raise _Error(412, "PreconditionFailed", "At least one of the pre-conditions failed")
            match = headers.get("if-match")
            if match is not None:
                if old is None:
                    raise _Error(404, "NoSuchKey", "The specified key does not exist.")
                if match != old.etag:
                    raise _Error(412, "PreconditionFailed", "If-Match failed")
            objects[key] = obj
        st.release(old)

    def _get(
        self, method: str, key: str, objects: dict[str, _Object], headers: dict[str, str]
    ) -> None:
        obj = objects.get(key)
        if obj is None:
            raise _Error(404, "NoSuchKey", "The specified key does not exist.")
        match = headers.get("if-match")
        if match is not None and match != obj.etag:
            raise _Error(412, "PreconditionFailed", "If-Match failed")
        out = {
            "ETag": obj.etag,
            "Last-Modified": _http_date(obj.mtime),
            "Accept-Ranges": "bytes",
            "Content-Type": "binary/octet-stream",
        }
        start, end, status = 0, obj.size, 200
        rng = headers.get("range")
        if rng:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if m is None:
                raise _Error(400, "InvalidArgument", "bad Range")
            a, b = m.groups()
            if a == "":
                start, end = max(0, obj.size - int(b)), obj.size
            else:
                start = int(a)
                end = min(obj.size, int(b) + 1) if b else obj.size
            if start >= obj.size:
                raise _Error(416, "InvalidRange", "The requested range is not satisfiable")
            status = 206
            out["Content-Range"] = f"bytes {start}-{end - 1}/{obj.size}"
        elif obj.checksum and headers.get("x-amz-checksum-mode", "").upper() == "ENABLED":
            out["x-amz-checksum-crc32c"] = obj.checksum
        segments, pos = [], 0
        for seg in obj.segments:
            lo, hi = max(start, pos), min(end, pos + len(seg))
            if lo < hi:
                segments.append(memoryview(seg)[lo - pos : hi - pos])
            pos += len(seg)
        if method == "GET":
            self.sent = end - start
        self._send(status, out, segments=segments, length=end - start, head_only=method == "HEAD")

    def _multipart(
        self,
        method: str,
        bucket: str,
        key: str,
        q: dict[str, str],
        headers: dict[str, str],
        body: Any,
    ) -> None:
        st = self.state
        uid = q["uploadId"]
        with st.lock:
            upload = st.uploads.get(uid)
        if upload is None or upload.key != f"{bucket}/{key}":
            raise _Error(404, "NoSuchUpload", "The specified upload does not exist.")
        if method == "PUT":
            number = int(q["partNumber"])
            etag = st.etag(body)
            with st.lock:
                old = upload.parts.get(number)
                upload.parts[number] = (body, etag)
            if old is not None:
                st.pool.give(old[0])
            extra = {"ETag": etag}
            if "x-amz-checksum-crc32c" in headers:
                extra["x-amz-checksum-crc32c"] = headers["x-amz-checksum-crc32c"]
            return self._send(200, extra)
        if method == "DELETE":
            with st.lock:
                st.uploads.pop(uid, None)
            for seg, _ in upload.parts.values():
                st.pool.give(seg)
            return self._send(204)
        if method == "POST":
            # One <Part> per part, its elements in any order (boto3: PartNumber first;
            # object_store and the AWS CRT: ETag first, the CRT also adds checksums).
            wanted = []
            for elem in re.findall(r"<Part>(.*?)</Part>", bytes(body).decode(), re.S):
                n = re.search(r"<PartNumber>\s*(\d+)\s*</PartNumber>", elem)
                e = re.search(r"<ETag>(.*?)</ETag>", elem, re.S)
                if n is None or e is None:
                    raise _Error(400, "MalformedXML", "a part without PartNumber or ETag")
                wanted.append((int(n.group(1)), e.group(1)))
            segments = []
            for n, e in wanted:
                part = upload.parts.get(n)
                # S3 compares ETags with or without their quotes (the AWS CRT drops them).
                if part is None or html.unescape(e).strip().strip('"') != part[1].strip('"'):
                    raise _Error(400, "InvalidPart", f"part {n} is missing or has another ETag")
                segments.append(part[0])
            obj = _Object(segments, st.etag(suffix=f"-{len(segments)}"))
            self._store(self._objects(bucket), key, obj, headers)
            with st.lock:
                st.uploads.pop(uid, None)
            used = {id(s) for s in segments}
            for seg, _ in upload.parts.values():
                if id(seg) not in used:
                    st.pool.give(seg)
            return self._send_xml(
                f"<CompleteMultipartUploadResult {_XMLNS}><Location>/{html.escape(bucket)}/"
                f"{html.escape(key)}</Location><Bucket>{html.escape(bucket)}</Bucket>"
                f"<Key>{html.escape(key)}</Key><ETag>{html.escape(obj.etag)}</ETag>"
                "</CompleteMultipartUploadResult>"
            )
        raise _Error(501, "NotImplemented", f"{method} on an upload")


def _kind(method: str, key: str, query: dict[str, str]) -> str:
    """The request's kind in the accounting (see the module docstring)."""
    if method == "GET" and not key:
        return "LIST"
    return method


def serve(
    host: str, port: int, buckets: tuple[str, ...] = (), announce: bool = False, doors: int = 1
) -> None:
    """Accept connections forever, one thread each, on ``doors`` ports (``port`` the
    first; the others free ones) that serve the same objects."""
    state = _State()
    for b in buckets:
        state.buckets[b] = {}
    listeners = [socket.create_server((host, port), backlog=256)]
    listeners += [socket.create_server((host, 0), backlog=256) for _ in range(doors - 1)]
    if announce:
        ports = " ".join(str(sock.getsockname()[1]) for sock in listeners)
        print(f"PORT {ports}", flush=True)

    def accept(door: int, listener: socket.socket) -> None:
        while True:
            sock, _ = listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_Connection(sock, state, door).serve, daemon=True).start()

    for door, listener in enumerate(listeners[1:], 1):
        threading.Thread(target=accept, args=(door, listener), daemon=True).start()
    accept(0, listeners[0])


def endpoint_stats(url: str, prefix: str = "") -> list[dict[str, Any]]:
    """``S3Endpoint.stats`` of the endpoint at ``url`` (any door), from any process."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request("POST", "/_bench/stats", body=prefix.encode())
        rows: list[dict[str, Any]] = json.loads(conn.getresponse().read())
        return rows
    finally:
        conn.close()


class S3Endpoint:
    """The endpoint in a child process on a free loopback port. Context manager."""

    def __init__(
        self, host: str = "127.0.0.1", buckets: tuple[str, ...] = ("bench",), doors: int = 1
    ) -> None:
        self.host = host
        self.buckets = buckets
        self.doors = doors
        self.port: int | None = None
        self.ports: list[int] = []
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def door_url(self, door: int) -> str:
        """The endpoint URL of door ``door`` (0: ``endpoint_url``)."""
        return f"http://{self.host}:{self.ports[door]}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> S3Endpoint:
        cmd = [sys.executable, os.path.abspath(__file__), "--host", self.host, "--port", "0"]
        cmd += ["--watch-parent", "--doors", str(self.doors)]
        cmd += [a for b in self.buckets for a in ("--bucket", b)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        line = self._proc.stdout.readline().decode()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"the benchmark S3 endpoint did not start: {line!r}")
        self.ports = [int(p) for p in line.split()[1:]]
        self.port = self.ports[0]
        return self

    def _admin(self, path: str, arg: str = "") -> bytes:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.request("POST", path, body=arg.encode())
            return conn.getresponse().read()
        finally:
            conn.close()

    def reset(self, spec: str = "") -> None:
        """Drop every object under ``bucket/prefix`` (all buckets' objects if empty)."""
        self._admin("/_bench/reset", spec)

    def stats(self, prefix: str = "") -> list[dict[str, Any]]:
        """The request counts of keys under ``bucket/prefix``: one row per door and kind
        of request and key (``door``, ``kind``, ``requests``, ``received``, ``sent``)."""
        rows: list[dict[str, Any]] = json.loads(self._admin("/_bench/stats", prefix))
        return rows

    def reset_stats(self) -> None:
        """Start the request counts again (objects stay)."""
        self._admin("/_bench/reset-stats")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self) -> S3Endpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--bucket", action="append", default=[])
    parser.add_argument("--doors", type=int, default=1, help="listening ports (accounted apart)")
    parser.add_argument("--watch-parent", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.watch_parent:  # end with the parent, even if it is killed
        parent = os.getppid()

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
    serve(args.host, args.port, tuple(args.bucket), announce=True, doors=args.doors)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
