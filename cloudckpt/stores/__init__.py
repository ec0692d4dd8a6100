"""Stores: one narrow interface (``base.Store``), one adapter per backend, a URL registry.

``open_store(url, storage_options)`` picks the adapter by URL scheme:

======================  ===============================================================
``memory://b/prefix``   ``MemoryStore``: in-process, exact semantics (tests, demos)
``file:///abs/path``    ``LocalStore``: POSIX, create-only by ``os.link``, CAS by ``flock``
``s3://bucket/prefix``  ``S3Store``: botocore with s3fs-style storage options
``gs://bucket/prefix``  ``GCSStore``: gcsfs session and credentials (extra ``[gcs]``)
``az://container/pfx``  ``AzureStore``: azure-storage-blob (extra ``[azure]``); also
                        ``abfs://``, ``abfss://`` and ``container@account.dfs...`` hosts
anything else fsspec    ``FsspecStore``: read-only unless ``unsafe_single_writer=True``
======================  ===============================================================
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from cloudckpt.errors import (
    ConfigurationError,
    MissingDependencyError,
    UnsupportedBackendError,
    redact_url,
)
from cloudckpt.stores.base import (
    CREATE,
    OVERWRITE,
    Capabilities,
    Create,
    MultipartUpload,
    ObjectInfo,
    Overwrite,
    PartInfo,
    PendingUpload,
    PutMode,
    Store,
    Update,
    crc32c_b64,
)

__all__ = [
    "CREATE",
    "OVERWRITE",
    "Capabilities",
    "Create",
    "MultipartUpload",
    "ObjectInfo",
    "Overwrite",
    "PartInfo",
    "PendingUpload",
    "PutMode",
    "RunURL",
    "Store",
    "Update",
    "crc32c_b64",
    "open_store",
    "parse_url",
    "split_url",
]


def split_url(url: str) -> tuple[str, str, str]:
    """Split ``url`` into (scheme, bucket-or-netloc, prefix). Plain paths become file://.

    Raises:
        ConfigurationError: a malformed URL, credentials in an s3/gs/memory URL, or a
            local path that is a mistyped URL (``s3:/bucket/run``; see
            ``_refuse_mistyped_url``). Messages carry the URL redacted.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(
            f"invalid run URL {url!r}",
            hint="Pass a URL such as s3://bucket/runs/exp1, gs://bucket/run, "
            "file:///data/run or a local path",
        )
    if "://" not in url:
        _refuse_mistyped_url(url)
        return "file", "", os.path.abspath(os.path.expanduser(url))
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            host = urlsplit(redact_url(url)).netloc
            raise ConfigurationError(
                f"invalid file URL {redact_url(url)!r}: host {host!r} is not local",
                hint="Use file:///absolute/path (three slashes)",
            )
        if parts.query or parts.fragment:  # else silently dropped: another directory
            raise ConfigurationError(
                f"invalid file URL {redact_url(url)!r}: query strings and fragments are not "
                "supported",
                hint="Pass a directory whose name holds '?' or '#' as a plain path, without "
                "file://",
            )
        return "file", "", os.path.abspath(parts.path or "/")
    if scheme in ("s3", "s3a", "gs", "gcs", "memory", *_AZURE_SCHEMES) and not parts.netloc:
        raise ConfigurationError(
            f"invalid URL {redact_url(url)!r}: no "
            f"{'container' if scheme in _AZURE_SCHEMES else 'bucket'} name",
            hint=f"Write it as {scheme}://CONTAINER/prefix"
            if scheme in _AZURE_SCHEMES
            else f"Write it as {scheme}://BUCKET/prefix",
        )
    if scheme in ("s3", "s3a", "gs", "gcs", "memory") and "@" in parts.netloc:
        raise ConfigurationError(
            f"invalid URL {redact_url(url)!r}: credentials in the URL are not supported",
            hint="memory:// needs no credentials: write memory://BUCKET/prefix"
            if scheme == "memory"
            else "Pass credentials through storage_options (or the usual environment)",
        )
    if parts.query or parts.fragment:
        raise ConfigurationError(
            f"invalid URL {redact_url(url)!r}: query strings and fragments are not supported",
            hint="Pass options through storage_options instead",
        )
    return scheme, parts.netloc, parts.path.strip("/")


@dataclasses.dataclass(frozen=True, repr=False)
class RunURL:
    """A run URL split and checked once (``parse_url``), to hand to ``open_store`` as is.

    ``text`` is the URL as given, which may carry user-info: show ``redacted`` (also what
    ``str()`` and ``repr()`` give). ``scheme``, ``netloc`` (bucket, container or host) and
    ``prefix`` are ``split_url``'s parts.
    """

    text: str
    scheme: str
    netloc: str
    prefix: str

    @functools.cached_property
    def redacted(self) -> str:
        return redact_url(self.text)

    def __str__(self) -> str:
        return self.redacted

    def __repr__(self) -> str:
        return f"RunURL({self.redacted!r})"


def parse_url(url: str | RunURL) -> RunURL:
    """``url`` split and checked once; a ``RunURL`` is returned as it is.

    Raises:
        ConfigurationError: what ``split_url`` raises.
    """
    if isinstance(url, RunURL):
        return url
    return RunURL(url, *split_url(url))


_AZURE_SCHEMES = ("az", "abfs", "abfss")
_OWN_SCHEMES = ("s3", "s3a", "gs", "gcs", "memory", "file", *_AZURE_SCHEMES)

# A scheme, then ":" or ":/" (not "://") or "//": a URL with its "://" mistyped, which
# would otherwise become a local directory such as ./s3:/bucket/run.
_MISTYPED_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]+)(?P<sep>:/?|//)(?P<rest>.*)$")


def _url_schemes() -> frozenset[str]:
    """Every scheme ``open_store`` would treat as a URL: its own and fsspec's."""
    from fsspec.registry import known_implementations, registry

    return frozenset(_OWN_SCHEMES) | frozenset(known_implementations) | frozenset(registry)


def _refuse_mistyped_url(path: str) -> None:
    """Raise ``ConfigurationError`` if the local path ``path`` is a mistyped URL
    (``s3:/bucket/run``, ``s3:bucket/run``, ``s3//bucket/run``, ``file:run``), naming the
    URL it probably meant. A path that starts with ``./`` or ``/`` is always local."""
    m = _MISTYPED_URL.match(path)
    if m is None or m["scheme"].lower() not in _url_schemes():
        return
    scheme, sep, rest = m["scheme"].lower(), m["sep"], m["rest"]
    if scheme == "file":
        local = ("/" if sep == ":/" else "") + rest
        meant = f"file://{os.path.abspath(os.path.expanduser(local or '.'))}"
        intent = f"did you mean {meant}, or the local path {local or '.'!r}?"
    else:
        meant = redact_url(f"{scheme}://{rest}") if rest else f"{scheme}://BUCKET/prefix"
        intent = f"did you mean {meant}?"
    # As typed, but with any user-info masked (redact_url only touches the host part).
    typed = m["scheme"] + sep + (redact_url(f"x://{rest}")[4:] if rest else "")
    raise ConfigurationError(
        f"{typed!r} looks like a mistyped URL (no '://'), not a local path ({intent})",
        hint=f"Write URLs as {scheme}://... ; to use a local directory of that name, "
        f"write it as ./{typed}",
    )


# scheme -> (the modules its adapter imports, the extra that installs them). The core
# (fsspec + botocore) carries S3; the Google stack is opt-in (docs/install.md).
_BACKEND_EXTRAS: dict[str, tuple[tuple[str, ...], str]] = {
    "gs": (("gcsfs", "google.auth", "aiohttp"), "gcs"),
    "gcs": (("gcsfs", "google.auth", "aiohttp"), "gcs"),
    **{s: (("azure.storage.blob", "azure.core"), "azure") for s in _AZURE_SCHEMES},
}


# The package (as the index names it) that brings each module: "azure" is no package.
_DISTRIBUTIONS = {
    "gcsfs": "gcsfs",
    "google.auth": "google-auth",
    "aiohttp": "aiohttp",
    "azure.storage.blob": "azure-storage-blob",
    "azure.core": "azure-core",
}


def _require_backend(run: RunURL) -> None:
    """Raise ``MissingDependencyError`` naming the extra if the library of ``run``'s
    scheme is absent."""
    scheme = run.scheme
    modules, extra = _BACKEND_EXTRAS.get(scheme, ((), ""))
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            package = _DISTRIBUTIONS.get(module, module)
            imported = "" if package == module else f" (to import {module})"
            raise MissingDependencyError(
                f"cannot open {run.redacted}: the {scheme}:// backend needs the "
                f"'{package}' package{imported}, which is not installed",
                extra=extra,
            )


def open_store(
    url: str | RunURL,
    storage_options: Mapping[str, Any] | None = None,
    *,
    writable: bool = True,
    unsafe_single_writer: bool = False,
) -> Store:
    """Open the store rooted at ``url``.

    ``storage_options`` are passed to the backend the way fsspec users already pass them
    (s3fs: ``key``, ``secret``, ``token``, ``endpoint_url``, ``client_kwargs``, ``profile``;
    gcsfs: ``token``, ``project``, ``endpoint_url``; adlfs: ``connection_string``,
    ``account_name``, ``account_key``, ``sas_token``, ``credential``, ``account_url``;
    memory: ``clock``).

    With ``writable=True`` (the default) a backend that cannot do create-only and
    compare-and-swap writes is refused, unless ``unsafe_single_writer=True``.

    ``url`` may be a ``RunURL`` (``parse_url``): it is not split again.

    Raises:
        ConfigurationError: malformed URL or options.
        MissingDependencyError: the backend's library is not installed (names the extra).
        UnsupportedBackendError: writing was asked of a backend that cannot do it safely.
    """
    run = parse_url(url)
    scheme, netloc, prefix = run.scheme, run.netloc, run.prefix
    _require_backend(run)
    options = dict(storage_options or {})
    if scheme == "memory":
        from cloudckpt.stores.memory import MemoryStore

        _refuse_unknown_options(run, options, MemoryStore)
        return MemoryStore(netloc, prefix, **options)
    if scheme == "file":
        from cloudckpt.stores.local import LocalStore

        _refuse_unknown_options(run, options, LocalStore)
        return LocalStore(prefix, **options)
    if scheme in ("s3", "s3a"):
        from cloudckpt.stores.s3 import S3Store

        return S3Store(netloc, prefix, **options)
    if scheme in ("gs", "gcs"):
        from cloudckpt.stores.gcs import GCSStore

        return GCSStore(netloc, prefix, **options)
    if scheme in _AZURE_SCHEMES:
        from cloudckpt.stores.azure import AzureStore

        return AzureStore(netloc, prefix, scheme=scheme, **options)

    from cloudckpt.stores.fsspec_store import FsspecStore

    if writable and not unsafe_single_writer:
        _refuse_writing(run)
    return FsspecStore(run.text, options, unsafe_single_writer=unsafe_single_writer)


def _refuse_unknown_options(run: RunURL, options: Mapping[str, Any], cls: type) -> None:
    """Raise ``ConfigurationError`` naming the storage options of ``options`` that the
    store class ``cls`` does not take (its keyword-only parameters) and those it does. The
    values are never shown: they may be secrets."""
    accepted = [
        name
        for name, p in inspect.signature(cls).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = sorted(str(k) for k in options if k not in accepted)
    if unknown:
        raise ConfigurationError(
            f"{run.scheme}:// takes no storage option{'s' * (len(unknown) > 1)} "
            + ", ".join(repr(k) for k in unknown)
            + f" (it accepts: {', '.join(accepted) or 'none'})",
            hint=f"Drop {'it' if len(unknown) == 1 else 'them'}: credentials, endpoints and "
            "the like are options of the s3://, gs:// and az:// stores",
        )


def _refuse_writing(run: RunURL) -> None:
    """Refuse to write through fsspec's backend for ``run`` (no conditional writes), before
    the filesystem is opened: some (ftp, sftp) connect when opened.

    Raises:
        ConfigurationError: fsspec has no implementation for the scheme.
        UnsupportedBackendError: otherwise (it names the missing capabilities).
    """
    import fsspec

    try:
        fsspec.get_filesystem_class(run.scheme)
    except (ImportError, ValueError) as exc:
        raise ConfigurationError(
            f"cannot open {run.redacted}: {exc}",
            hint="Install the fsspec implementation for this scheme, or check the URL",
        ) from None
    missing = Capabilities(create=False, update=False).missing_for_writing()
    raise UnsupportedBackendError(
        f"cannot write checkpoints to {run.redacted}: the {run.scheme}:// backend lacks "
        + " and ".join(missing),
        capability=", ".join(missing),
    )
