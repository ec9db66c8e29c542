"""URL → store: one fsspec filesystem per process and per (scheme, options), and the
:class:`~fastload.stores._base.Store` over it that fetch and Manifest use.

``s3://`` (s3fs, with obstore in front when it can and ``storage_options`` do not turn it off:
:data:`fastload.stores.s3.FAST_PATH`), ``gs://`` (gcsfs), ``b2://`` (fastload's own filesystem
over b2sdk), ``file://`` and ``memory://``. :func:`open_store` is the one place that picks a
backend; each backend's knowledge lives in its module (``s3``, ``_obstore``, ``gcs``, ``b2``,
``_fsspec``). Filesystems are created lazily, cached per process, and created afresh in a forked
child (a client's connection pool must never be shared across a fork). Each store raises
fastload's errors only: its methods translate their client's own at their edge
(:class:`fastload.stores._errors.boundary`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from fsspec import AbstractFileSystem

from fastload._extras import import_extra
from fastload.errors import ConfigError
from fastload.resources import PerProcess
from fastload.stores._base import ByteRange, Span, Store, Suffix
from fastload.stores._errors import Kind, classify, translate
from fastload.stores._fsspec import FsspecStore
from fastload.stores._obstore import ObstoreStore
from fastload.stores.gcs import GcsStore
from fastload.stores.s3 import FAST_PATH, S3Store, fast_path

__all__ = [
    "SCHEMES",
    "ByteRange",
    "Kind",
    "Span",
    "Store",
    "StoreURL",
    "Suffix",
    "classify",
    "filesystem",
    "open_store",
    "parse_url",
    "storage_options_of",
    "translate",
]


@dataclass(frozen=True)
class _Backend:
    module: str
    extra: str | None
    attr: str


SCHEMES: Mapping[str, _Backend] = {
    "s3": _Backend("s3fs", "s3", "S3FileSystem"),
    "gs": _Backend("gcsfs", "gcs", "GCSFileSystem"),
    "gcs": _Backend("gcsfs", "gcs", "GCSFileSystem"),
    "b2": _Backend("fastload.stores.b2", "b2", "B2FileSystem"),
    "file": _Backend("fsspec.implementations.local", None, "LocalFileSystem"),
    "memory": _Backend("fsspec.implementations.memory", None, "MemoryFileSystem"),
}


@dataclass(frozen=True)
class StoreURL:
    """A parsed object URL: ``scheme://path``, where path is ``bucket/key`` for object stores."""

    scheme: str
    path: str

    def __str__(self) -> str:
        if self.scheme == "memory":
            return f"memory://{self.path.lstrip('/')}"
        return f"{self.scheme}://{self.path}"

    def join(self, key: str) -> StoreURL:
        base = self.path.rstrip("/")
        return StoreURL(self.scheme, f"{base}/{key}" if base else key)

    @property
    def bucket(self) -> str:
        return self.path.split("/", 1)[0]

    @property
    def key(self) -> str:
        return self.path.partition("/")[2]


def parse_url(url: str | os.PathLike[str]) -> StoreURL:
    """Split and validate ``url``; a bare local path means ``file://``."""
    text = os.fspath(url)
    if not isinstance(text, str) or not text:
        raise ConfigError(f"expected a non-empty URL string, got {url!r}")
    if text.startswith("pipe:"):  # WebDataset's: a shell command that writes the shard
        raise ConfigError(
            f"{text!r} is a WebDataset pipe: command; give fastload the shard URLs themselves "
            "(s3://bucket/train/shard-{000000..000146}.tar)"
        )
    if "://" not in text:
        if ":" in text.split("/", 1)[0] and not os.path.isabs(text):
            raise ConfigError(f"malformed URL (expected scheme://...): {text!r}")
        return StoreURL("file", os.path.abspath(text))
    scheme, path = text.split("://", 1)
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise ConfigError(f"unknown URL scheme {scheme!r} in {text!r} (supported: {known})")
    if scheme == "file":
        return StoreURL("file", os.path.abspath(path or "/"))
    if scheme == "memory":
        return StoreURL("memory", "/" + path.lstrip("/"))
    if not path or path.startswith("/"):  # keys may hold anything, even "//" (S3 allows it)
        raise ConfigError(f"malformed URL (expected {scheme}://bucket/key): {text!r}")
    return StoreURL(scheme, path)


_filesystems: PerProcess[tuple[str, str], AbstractFileSystem] = PerProcess("filesystems")


def storage_options_of(storage_options: object) -> dict[str, Any]:
    """``storage_options`` as a dict of its own: a mapping of option names, or None for none;
    anything else is a :class:`ConfigError` (``dict()`` of a list or a string fails obscurely).
    They may hold fastload's own (:data:`~fastload.stores.s3.FAST_PATH`), which no client
    is given."""
    if storage_options is None:
        return {}
    if not isinstance(storage_options, Mapping) or not all(
        isinstance(name, str) for name in storage_options
    ):
        raise ConfigError(
            "storage_options must be a mapping of option names (strings) to values, as "
            f"fsspec takes (e.g. {{'endpoint_url': ...}}), got a {type(storage_options).__name__}"
        )  # its values are not shown: they may hold credentials
    return dict(storage_options)


def _options_key(options: Mapping[str, Any]) -> str:
    return json.dumps(dict(options), sort_keys=True, default=repr)


def filesystem(
    url: str | StoreURL, storage_options: Mapping[str, Any] | None = None
) -> AbstractFileSystem:
    """The process's filesystem for ``url``'s scheme and ``storage_options`` (created lazily).

    In a forked child the cache starts empty, so no connection pool crosses a fork.
    """
    parsed = url if isinstance(url, StoreURL) else parse_url(url)
    options = _client_options(storage_options_of(storage_options))
    key = (parsed.scheme, _options_key(options))
    return _filesystems.get(key, lambda: _create(parsed.scheme, options))


def _client_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` without fastload's own: what a client is given."""
    return {name: value for name, value in options.items() if name != FAST_PATH}


def open_store(
    url: StoreURL, storage_options: Mapping[str, Any] | None = None, *, threads: int = 32
) -> Store:
    """The store for ``url``'s scheme: obstore in front of s3fs for ``s3://`` (where obstore is
    installed, the options suit it, and their :data:`~fastload.stores.s3.FAST_PATH` does not
    turn it off), gcsfs's session for ``gs://``, B2's downloads and pages for ``b2://``, else
    the filesystem itself (``threads`` wide when it blocks)."""
    given = storage_options_of(storage_options)
    options = _client_options(given)
    if url.scheme == "s3" and fast_path(given):
        general = partial(_s3fs_store, url, options, threads)
        return ObstoreStore(general, options, _options_key(options))
    fs = filesystem(url, options)
    if url.scheme == "s3":
        return S3Store(fs, threads)
    if url.scheme in ("gs", "gcs"):
        return GcsStore(fs, threads)
    if url.scheme == "b2":
        from fastload.stores.b2 import B2Store  # noqa: PLC0415 (imports the 'b2' extra)

        return B2Store(fs, threads)
    return FsspecStore(fs, threads)


def _s3fs_store(url: StoreURL, options: dict[str, Any], threads: int) -> S3Store:
    return S3Store(filesystem(url, options), threads)


def _create(scheme: str, options: dict[str, Any]) -> AbstractFileSystem:
    backend = SCHEMES[scheme]
    if backend.extra is None:
        module = __import__(backend.module, fromlist=[backend.attr])
    else:
        module = import_extra(backend.module, extra=backend.extra, feature=f"{scheme}:// URLs")
    cls = getattr(module, backend.attr)
    if scheme == "s3":
        # botocore's default pool (10 connections) would cap concurrency, and fastload retries
        # with its own policy: s3fs's and botocore's retries under it would multiply the wait.
        config_kwargs = {
            "max_pool_connections": 256,
            "retries": {"max_attempts": 1, "mode": "standard"},
            **options.get("config_kwargs", {}),
        }
        options = {**options, "config_kwargs": config_kwargs}
    try:
        fs: AbstractFileSystem = cls(skip_instance_cache=True, **options)
    except TypeError as exc:
        raise ConfigError(f"bad storage_options for {scheme}://: {exc}") from exc
    if scheme == "s3":
        fs.retries = 1  # s3fs's own retry loop (a class attribute, not an option)
    return fs
