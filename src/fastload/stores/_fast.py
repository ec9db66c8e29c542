"""The fast read path: obstore (a Rust object-store client) behind the same s3:// URLs.

s3fs/botocore spend about 2 ms of CPU per GET; obstore about a quarter of that, which is what
decides throughput on a small machine (see docs/benchmarks.md). It is used only for reads, only
when obstore is installed and the ``storage_options`` say everything it needs (explicit keys or
AWS_* variables, a known region or endpoint); anything else keeps the general s3fs path.
Retries stay in :mod:`fastload.fetcher` (obstore's own are switched off) so every attempt is
counted and backed off the same way on every store.

obstore's async runtime does not survive ``fork``: a child forked after the parent used it
(a DataLoader worker under the default start method) would hang on its first read. Such a child
takes the s3fs path instead; children started by spawn or forkserver keep the fast path.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from fastload.resources import PerProcess
from fastload.stores._reads import Body, Patience, progressing

log = logging.getLogger(__name__)

__all__ = ["fast_store", "list_stream", "next_page", "read", "readable"]

_OPTIONS = {"key", "secret", "token", "endpoint_url", "client_kwargs", "config_kwargs", "anon"}
_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_CONFIG_KWARGS = {"max_pool_connections", "s3", "connect_timeout", "read_timeout"}

_stores: PerProcess[tuple[str, str], Any] = PerProcess("obstore clients")
_runtime = {"started": False, "inherited": False}


def _after_fork_in_child() -> None:
    _runtime["inherited"] = _runtime["inherited"] or _runtime["started"]


os.register_at_fork(after_in_child=_after_fork_in_child)


def _obstore() -> Any:
    try:
        importlib.import_module("obstore.store")
        return importlib.import_module("obstore")
    except ImportError:
        return None


def _s3_kwargs(options: Mapping[str, Any]) -> dict[str, Any] | None:
    client_kwargs = dict(options.get("client_kwargs") or {})
    config_kwargs = dict(options.get("config_kwargs") or {})
    if set(options) - _OPTIONS or set(client_kwargs) - _CLIENT_KWARGS:
        return None
    if set(config_kwargs) - _CONFIG_KWARGS or set(config_kwargs.get("s3", {})) - {
        "addressing_style"
    }:
        return None
    endpoint = options.get("endpoint_url") or client_kwargs.get("endpoint_url")
    region = (
        client_kwargs.get("region_name")
        or os.environ.get("AWS_REGION")
        or os.environ.get("AWS_DEFAULT_REGION")
    )
    anon = bool(options.get("anon"))
    has_keys = bool(options.get("key") and options.get("secret")) or bool(
        os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY")
    )
    if not (anon or has_keys) or not (region or endpoint):
        return None  # profiles, SSO, bucket-region discovery: botocore knows them, keep s3fs
    style = config_kwargs.get("s3", {}).get("addressing_style")
    kwargs: dict[str, Any] = {
        "region": region or "us-east-1",
        "virtual_hosted_style_request": style == "virtual" or (not endpoint and style != "path"),
        "client_options": {
            "allow_http": bool(endpoint and str(endpoint).startswith("http://")),
            "timeout": timedelta(hours=1),  # silence timeouts (read_timeout's role) are fastload's
            "connect_timeout": timedelta(seconds=config_kwargs.get("connect_timeout", 10)),
        },
        "retry_config": {"max_retries": 0, "retry_timeout": timedelta(hours=1)},
    }
    if endpoint:
        kwargs["endpoint"] = str(endpoint)
    if anon:
        kwargs["skip_signature"] = True
    elif options.get("key"):
        kwargs["access_key_id"] = options["key"]
        kwargs["secret_access_key"] = options["secret"]
        if options.get("token"):
            kwargs["session_token"] = options["token"]
    return kwargs


def fast_store(scheme: str, bucket: str, options: Mapping[str, Any], key: str) -> Any | None:
    """An obstore store for ``scheme://bucket`` (cached per process), or None to use fsspec."""
    obstore = _obstore() if scheme == "s3" else None
    if obstore is None:
        return None
    if _runtime["inherited"]:
        log.debug("s3://%s: forked after obstore ran in the parent; fast path off", bucket)
        return None

    def create() -> Any:
        kwargs = _s3_kwargs(options)
        if kwargs is None:
            log.debug("s3://%s: these storage_options need s3fs; fast path off", bucket)
            return None
        _runtime["started"] = True
        return obstore.store.S3Store(bucket, **kwargs)

    return _stores.get((bucket, key), create)


def readable(key: str) -> bool:
    """Whether obstore can address ``key`` as it is: it refuses empty, ``.`` and ``..`` path
    segments and control characters, and drops a trailing ``/`` (such keys take the s3fs path)."""
    if any(part in ("", ".", "..") for part in key.split("/")):
        return False
    return not any(ord(ch) < 0x20 or ch == "\x7f" for ch in key)


async def read(
    store: Any, key: str, span: tuple[int | None, int | None], patience: Patience
) -> Body:
    """``key``'s bytes ``span`` = ``[start, end)`` (non-negative offsets) through obstore, with
    the ETag the store served them under; ``TimeoutError`` after ``patience.timeout`` s without
    a byte."""
    obstore = _obstore()
    start, end = span
    begin = start or 0
    if end is not None and end <= begin:
        return Body(b"")
    options: dict[str, Any] = {}
    if end is not None:
        options["range"] = (begin, end)
    elif begin:
        options["range"] = {"offset": begin}
    timeout = patience.timeout
    result = await asyncio.wait_for(obstore.get_async(store, key, options=options), timeout)
    if patience.whole:
        data = bytes(await asyncio.wait_for(result.bytes_async(), timeout))
    else:
        stream = result.stream(min_chunk_size=patience.chunk)
        data = b"".join(await progressing(stream.__anext__, timeout, StopAsyncIteration))
    etag = result.meta.get("e_tag")
    return Body(data, (str(etag).strip('"'),) if etag else ())


def list_stream(store: Any, directory: str | None, start_after: str | None, limit: int) -> Any:
    """obstore's listing of the keys under ``directory`` (a whole path segment) after
    ``start_after``, in chunks of ``limit``; it follows S3's continuation tokens itself."""
    return _obstore().list(store, directory, offset=start_after, chunk_size=limit)


async def next_page(stream: Any) -> list[tuple[str, int, str]] | None:
    """The stream's next chunk as (key, size, etag), or None at its end."""
    try:
        chunk = await stream.__anext__()
    except StopAsyncIteration:
        return None
    return [(m["path"], int(m["size"]), str(m.get("e_tag") or "").strip('"')) for m in chunk]
