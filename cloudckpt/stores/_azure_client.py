"""The Azure SDK client of an Azure store, set up: URL forms, storage options, credentials
(first match wins, see ``cloudckpt.stores.azure``), the account endpoint, and a pooled
HTTP session without SDK retries. A logging filter keeps SAS signatures out of urllib3's
DEBUG logs.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import requests
import requests.adapters
from azure.core.pipeline.transport import RequestsTransport
from azure.storage.blob import BlobServiceClient

from cloudckpt.errors import ConfigurationError, CredentialsError
from cloudckpt.stores._azure_errors import WHAT_TO_SET

_CONTAINER = re.compile(r"\$root|[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]")
_ACCOUNT = re.compile(r"[a-z0-9]{3,24}")
_MAX_SINGLE_PUT = 256 * 1024 * 1024  # one Put Blob (Azure allows 5000 MiB)
_POOL = 32  # connections per store: the transfer engine uploads parts in parallel

#: Storage options this backend understands (adlfs's names where adlfs has them).
OPTIONS = frozenset(
    {
        "account_name",
        "account_key",
        "connection_string",
        "sas_token",
        "credential",
        "account_url",
        "endpoint_url",
        "account_host",
        "anon",
        "connection_timeout",
        "read_timeout",
    }
)


def parse_azure_netloc(scheme: str, netloc: str) -> tuple[str, str | None]:
    """``container`` or ``container@account.dfs.core.windows.net`` → (container, account)."""
    container, at, host = netloc.partition("@")
    account = None
    if at:
        account = host.split(".", 1)[0].lower()
        if "." not in host or not _ACCOUNT.fullmatch(account):
            raise ConfigurationError(
                f"invalid {scheme}:// URL: {host!r} is not an Azure storage account host",
                hint=f"Write it as {scheme}://CONTAINER@ACCOUNT.dfs.core.windows.net/prefix "
                f"or {scheme}://CONTAINER/prefix",
            )
    if not _CONTAINER.fullmatch(container):
        raise ConfigurationError(
            f"invalid Azure container name {container!r} in a {scheme}:// URL",
            hint="Container names are 3-63 lowercase letters, digits and single hyphens, "
            f"starting and ending with a letter or digit: {scheme}://CONTAINER/prefix",
        )
    return container, account


def check_options(storage_options: Mapping[str, Any], url: str) -> None:
    """Raises ConfigurationError for a storage option this backend does not know."""
    unknown = set(storage_options) - OPTIONS
    if unknown:
        raise ConfigurationError(
            f"unknown Azure storage option(s) {', '.join(sorted(map(repr, unknown)))} for {url}",
            hint=f"Accepted options: account_name, {', '.join(sorted(OPTIONS))}",
        )


_SAS_SIGNATURE = re.compile(r"([?&]sig=)[^&\s\"']+")


class _RedactSasSignatures(logging.Filter):
    """Masks ``sig=`` in log records: a SAS token travels in the request URL, and urllib3
    logs every URL at DEBUG level (azure-core's own logging policy redacts it; urllib3's
    does not), so a user who turns on debug logging would otherwise log a live credential."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "sig=" in message:
            record.msg, record.args = _SAS_SIGNATURE.sub(r"\1REDACTED", message), None
        return True


_REDACTOR = _RedactSasSignatures()


def hide_sas_signatures_in_http_logs() -> None:
    """Install the redacting filter on urllib3's request logger (once per process)."""
    urllib3_log = logging.getLogger("urllib3.connectionpool")
    if _REDACTOR not in urllib3_log.filters:
        urllib3_log.addFilter(_REDACTOR)


def _parse_connection_string(value: str) -> dict[str, str]:
    parts = (p.split("=", 1) for p in value.split(";") if "=" in p)
    return {k.strip().lower(): v.strip() for k, v in parts}


def make_client(
    url: str, url_account: str | None, account_name: str | None, opts: Mapping[str, Any]
) -> BlobServiceClient:
    """The SDK client: from a connection string (options, else the environment, when no
    other credential is given), else from an account URL and a credential. Raises
    ConfigurationError (inconsistent options) or CredentialsError (none found)."""
    kwargs = _client_kwargs(opts)
    account = account_name or url_account
    if account_name and url_account and account_name.lower() != url_account:
        raise ConfigurationError(
            f"{url}: the URL names account {url_account!r}, account_name {account_name!r}"
        )
    conn = opts.get("connection_string")
    has_credential = any(opts.get(k) for k in ("account_key", "sas_token", "credential", "anon"))
    if not conn and not has_credential:
        conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING") or None
    if conn:
        return _client_from_connection_string(url, conn, account, opts, kwargs)
    account = account or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") or None
    account_url = _account_url(url, account, opts)
    credential = _credential(url, account, opts)
    try:
        return BlobServiceClient(account_url, credential=credential, **kwargs)
    except ValueError as exc:
        raise ConfigurationError(f"{url}: invalid Azure account URL ({exc})") from None


def _client_from_connection_string(
    url: str, conn: str, account: str | None, opts: Mapping[str, Any], kwargs: dict[str, Any]
) -> BlobServiceClient:
    """A client from a connection string; an explicit ``account_url`` (or
    ``endpoint_url``) option wins over the string's endpoint."""
    parsed = _parse_connection_string(conn)
    named = parsed.get("accountname", "").lower()
    if account and named and named != account.lower():
        raise ConfigurationError(
            f"{url}: the connection string is for account {named!r}, the URL "
            f"or options name {account!r}"
        )
    override = opts.get("account_url") or opts.get("endpoint_url")
    if override:  # an explicit endpoint wins over the connection string's
        credential: Any = parsed.get("sharedaccesssignature")
        if parsed.get("accountkey"):
            credential = {"account_name": named, "account_key": parsed["accountkey"]}
        try:
            return BlobServiceClient(override, credential=credential, **kwargs)
        except ValueError as exc:
            raise ConfigurationError(f"{url}: invalid Azure account URL ({exc})") from None
    try:
        return BlobServiceClient.from_connection_string(conn, **kwargs)
    except ValueError as exc:  # malformed; the message quotes no secrets
        raise ConfigurationError(f"{url}: invalid Azure connection string ({exc})") from None


def _account_url(url: str, account: str | None, opts: Mapping[str, Any]) -> str:
    """The blob endpoint: ``account_url``/``endpoint_url``, else ``account_host``, else
    the account's public endpoint. Raises CredentialsError without any of them."""
    account_url = opts.get("account_url") or opts.get("endpoint_url")
    if account_url:
        return account_url
    if opts.get("account_host"):
        return f"https://{opts['account_host']}"
    if account:
        return f"https://{account}.blob.core.windows.net"
    raise CredentialsError(f"no Azure storage account or credentials for {url}", hint=WHAT_TO_SET)


def _credential(url: str, account: str | None, opts: Mapping[str, Any]) -> Any:
    """The credential, first found of: ``credential``; an account key (option, else
    environment); a SAS token (likewise); none for ``anon``; else DefaultAzureCredential.
    Raises CredentialsError (an account key without an account name; nothing found)."""
    env = os.environ
    if opts.get("credential") is not None:
        return opts["credential"]
    if opts.get("account_key") or (
        not opts.get("sas_token") and not opts.get("anon") and env.get("AZURE_STORAGE_ACCOUNT_KEY")
    ):
        key = opts.get("account_key") or env["AZURE_STORAGE_ACCOUNT_KEY"]
        if not account:
            raise CredentialsError(
                f"an account key for {url} needs the account name",
                hint="Set AZURE_STORAGE_ACCOUNT_NAME or storage_options['account_name']",
            )
        return {"account_name": account, "account_key": key}
    if opts.get("sas_token") or (not opts.get("anon") and env.get("AZURE_STORAGE_SAS_TOKEN")):
        return str(opts.get("sas_token") or env["AZURE_STORAGE_SAS_TOKEN"]).lstrip("?")
    if opts.get("anon"):
        return None
    return _default_credential(url)


def _default_credential(url: str) -> Any:
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise CredentialsError(f"no Azure credentials found for {url}", hint=WHAT_TO_SET) from None
    # Creating it contacts nothing; the first request asks for a token.
    return DefaultAzureCredential()


def _client_kwargs(opts: Mapping[str, Any]) -> dict[str, Any]:
    """The SDK client's options: no SDK retries (ours retry), the timeouts, the single-put
    size, and a pooled requests session of its own."""
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=_POOL, pool_maxsize=_POOL)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return {
        "retry_total": 0,
        "connection_timeout": opts.get("connection_timeout", 30),
        "read_timeout": opts.get("read_timeout", 120),
        "max_single_put_size": _MAX_SINGLE_PUT,
        "transport": RequestsTransport(session=session, session_owner=True),
    }
