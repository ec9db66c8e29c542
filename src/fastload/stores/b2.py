"""``b2://bucket/key``: an fsspec filesystem over Backblaze's b2sdk (native B2 API).

Registered as the fsspec entry point ``b2``, so ``fsspec.open("b2://bucket/key")`` works once
fastload is installed with the ``b2`` extra. Credentials come from ``storage_options``
(``key_id``, ``key``) or the usual ``B2_APPLICATION_KEY_ID`` / ``B2_APPLICATION_KEY``
environment variables; ``realm`` is ``"production"`` or the URL of another B2 endpoint.
"""

from __future__ import annotations

import asyncio
import io
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from fsspec import AbstractFileSystem
from fsspec.spec import AbstractBufferedFile

from fastload._extras import import_extra
from fastload.errors import AccessDeniedError, ConfigError, ObjectNotFoundError, StoreError
from fastload.stores._b2get import Downloads
from fastload.stores._base import (
    Body,
    BucketPages,
    ByteRange,
    Listed,
    PageLister,
    Patience,
    Span,
    fsspec_offsets,
)
from fastload.stores._errors import translate
from fastload.stores._fsspec import FsspecStore

if TYPE_CHECKING:
    from fastload.stores import StoreURL

__all__ = ["B2FileSystem", "B2Pages", "B2Store"]

_b2 = import_extra("b2sdk.v2", extra="b2", feature="b2:// URLs")

Info = dict[str, Any]


_Http: Any = _b2.B2Http
_Session: Any = _b2.B2Session
_Api: Any = _b2.B2Api


class _OneTryHttp(_Http):  # type: ignore[misc]  # b2sdk is untyped
    """b2sdk's HTTP layer without its own retries (up to 20 tries, sleeping 1 s, 1.5 s, ...
    in the calling thread). fastload's fetch and listing retry with their own bounded,
    counted backoff; b2sdk's sleeps would hide faults, blow through timeouts and keep
    abandoned threads (and interpreter exit) waiting for minutes."""

    @classmethod
    def _translate_and_retry(
        cls, fcn: Any, try_count: int, post_params: dict[str, Any] | None = None
    ) -> Any:
        return super()._translate_and_retry(fcn, 1, post_params)


class _OneTrySession(_Session):  # type: ignore[misc]
    B2HTTP_CLASS = _OneTryHttp


class _B2Api(_Api):  # type: ignore[misc]
    SESSION_CLASS = _OneTrySession


def _sha1(value: str | None) -> str | None:
    """A version's SHA-1, if B2 knows it (large files uploaded in parts say "none")."""
    return None if value in (None, "", "none") else value


@contextmanager
def _translated(path: str) -> Iterator[None]:
    try:
        yield
    except _b2.exception.B2Error as exc:
        raise translate(exc, f"b2://{path}") from exc


class B2FileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec is untyped
    """fsspec filesystem for Backblaze B2 over the native API (b2sdk)."""

    protocol = ("b2",)
    root_marker = ""

    def __init__(
        self,
        key_id: str | None = None,
        key: str | None = None,
        realm: str = "production",
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._key_id = key_id or os.environ.get("B2_APPLICATION_KEY_ID")
        self._key = key or os.environ.get("B2_APPLICATION_KEY")
        if not self._key_id or not self._key:
            raise AccessDeniedError(
                "B2 credentials missing: pass storage_options key_id and key, or set "
                "B2_APPLICATION_KEY_ID and B2_APPLICATION_KEY"
            )
        self._realm = realm
        self._lock = threading.Lock()
        self._api_pid = -1
        self._api_obj: Any = None
        self._buckets: dict[str, Any] = {}
        self._downloads = Downloads(self._download_auth, _b2.b2_url_encode)

    def __repr__(self) -> str:
        return f"B2FileSystem(realm={self._realm!r})"  # never the key

    @property
    def _api(self) -> Any:
        """The authorized B2Api, created lazily and afresh after a fork."""
        with self._lock:
            if self._api_pid != os.getpid():
                api = _B2Api(_b2.InMemoryAccountInfo())
                with _translated(""):
                    api.authorize_account(self._realm, self._key_id, self._key)
                self._api_obj, self._api_pid, self._buckets = api, os.getpid(), {}
            return self._api_obj

    def _download_auth(self, renew: bool) -> tuple[str, str]:
        """Where downloads go and the token they carry (authorized again when ``renew``)."""
        api = self._api
        if renew:
            with self._lock, _translated(""):
                api.authorize_account(self._realm, self._key_id, self._key)
        info = api.account_info
        return info.get_download_url(), info.get_account_auth_token()

    def _bucket(self, name: str) -> Any:
        if not name:
            raise ConfigError("b2:// path has no bucket name")
        api = self._api
        with self._lock:
            bucket = self._buckets.get(name)
        if bucket is None:
            with _translated(name):
                bucket = api.get_bucket_by_name(name)
            with self._lock:
                self._buckets[name] = bucket
        return bucket

    @classmethod
    def _strip_protocol(cls, path: str | list[str]) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        if path.startswith("b2://"):
            path = path[len("b2://") :]
        return path.strip("/")

    @staticmethod
    def _split(path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    # -- listing -------------------------------------------------------------------------

    @staticmethod
    def _file_info(bucket: str, version: Any) -> Info:
        return {
            "name": f"{bucket}/{version.file_name}",
            "size": version.size,
            "type": "file",
            "mtime": version.upload_timestamp / 1000.0,
            "version": version.id_,
            "etag": _sha1(version.content_sha1),
        }

    @staticmethod
    def _dir_info(name: str) -> Info:
        return {"name": name.rstrip("/"), "size": 0, "type": "directory"}

    def _list(self, path: str, recursive: bool) -> list[Info]:
        bucket_name, key = self._split(path)
        bucket = self._bucket(bucket_name)
        folder = f"{key}/" if key else ""
        out: list[Info] = []
        with _translated(path):
            for version, folder_name in bucket.ls(
                folder_to_list=folder, recursive=recursive, latest_only=True
            ):
                if folder_name is not None:
                    out.append(self._dir_info(f"{bucket_name}/{folder_name}"))
                else:
                    out.append(self._file_info(bucket_name, version))
        return out

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        if not path:
            with _translated(""):
                names = sorted(b.name for b in self._api.list_buckets())
            entries = [self._dir_info(n) for n in names]
        else:
            entries = self._list(path, recursive=False)
            if not entries:
                entries = [self.info(path)]  # a file lists as itself; raises if missing
        return entries if detail else [e["name"] for e in entries]

    def find(
        self,
        path: str,
        maxdepth: int | None = None,
        withdirs: bool = False,
        detail: bool = False,
        **kwargs: Any,
    ) -> Any:
        path = self._strip_protocol(path)
        if maxdepth is not None or withdirs or not path:
            return super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail)
        try:
            files = {e["name"]: e for e in self._list(path, recursive=True)}
        except ObjectNotFoundError:
            files = {}
        if not files and self._split(path)[1]:
            try:
                info = self.info(path)
            except FileNotFoundError:
                info = None
            if info is not None and info["type"] == "file":
                files = {info["name"]: info}
        names = sorted(files)
        return {n: files[n] for n in names} if detail else names

    def info(self, path: str, **kwargs: Any) -> Info:
        path = self._strip_protocol(path)
        bucket_name, key = self._split(path)
        bucket = self._bucket(bucket_name)
        if not key:
            return self._dir_info(bucket_name)
        try:
            with _translated(path):
                version = bucket.get_file_info_by_name(key)
            return self._file_info(bucket_name, version)
        except ObjectNotFoundError:
            pass
        with _translated(path):
            for _ in bucket.ls(folder_to_list=f"{key}/", latest_only=True):
                return self._dir_info(path)
        raise ObjectNotFoundError("no such object", url=f"b2://{path}")

    def modified(self, path: str) -> datetime:
        return datetime.fromtimestamp(self.info(path)["mtime"], tz=timezone.utc)

    # -- reading -------------------------------------------------------------------------

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        return bytes(self.read_body(path, start, end).data)  # bytes already: no copy

    async def read_async(self, path: str, span: ByteRange, patience: Patience) -> Body:
        """The bytes ``span`` by one GET on the running event loop (see
        :mod:`fastload.stores._b2get`); ``TimeoutError`` after ``patience.timeout`` s without
        a byte."""
        path = self._strip_protocol(path)
        if isinstance(span, Span):
            bucket, key = self._split(path)
            body = await self._downloads.get(bucket, key, span, patience)
            if body is not None:
                return body
        # a suffix or a range past the end: read_body asks for the size first
        return await asyncio.to_thread(self.read_body, path, *fsspec_offsets(span))

    def read_body(self, path: str, start: int | None = None, end: int | None = None) -> Body:
        """The bytes ``[start, end)`` and the file id and SHA-1 of the version they came from,
        through b2sdk (a suffix or a range past the end: it knows the size)."""
        path = self._strip_protocol(path)
        bucket_name, key = self._split(path)
        if (start or 0) < 0 or (end is not None and end < 0) or (start and end is None):
            size = self.info(path)["size"]
            start = max(0, size + start) if start and start < 0 else start
            end = size if end is None else max(0, size + end) if end < 0 else min(end, size)
        start = start or 0
        if end is not None and end <= start:
            return Body(b"")
        buffer = io.BytesIO()
        bucket = self._bucket(bucket_name)
        try:
            with _translated(path):
                range_ = None if end is None else (start, end - 1)
                downloaded = bucket.download_file_by_name(key, range_=range_)
                try:  # no seeking: b2sdk's parallel strategy would start a writer thread and
                    # hash the body a second time for every object; fastload runs reads at once
                    downloaded.save(buffer, allow_seeking=False)
                finally:  # a body cut short must not leave its connection to the GC
                    downloaded.response.close()
        except StoreError as exc:
            if not isinstance(exc.__cause__, _b2.exception.InvalidRange):
                raise
            size = self.info(path)["size"]  # a range past the end reads to the end
            if start >= size:
                return Body(b"")
            return self.read_body(path, start, min(end or size, size))
        served = downloaded.download_version
        return Body(buffer.getvalue(), (served.id_, served.content_sha1))

    # -- writing -------------------------------------------------------------------------

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        bucket_name, key = self._split(path)
        with _translated(path):
            self._bucket(bucket_name).upload_bytes(bytes(value), key)

    def _upload_stream(self, path: str, stream: Any) -> None:
        bucket_name, key = self._split(path)
        with _translated(path):
            self._bucket(bucket_name).upload_unbound_stream(stream, key)

    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        bucket_name, key = self._split(path)
        bucket = self._bucket(bucket_name)
        with _translated(path):
            versions = list(bucket.list_file_versions(key))
            if not versions:
                raise ObjectNotFoundError("no such object", url=f"b2://{path}")
            for version in versions:
                self._api.delete_file_version(version.id_, version.file_name)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = [path] if isinstance(path, str) else list(path)
        for given in paths:
            item = self._strip_protocol(given)
            targets = self.find(item) if recursive else [item]
            if not targets and not self._split(item)[1]:
                continue  # an empty bucket
            for target in targets:
                self.rm_file(target)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        bucket_name, key = self._split(self._strip_protocol(path))
        if key:
            return  # B2 folders are virtual
        with _translated(bucket_name):
            existing = {b.name for b in self._api.list_buckets()}
            if bucket_name not in existing:
                self._api.create_bucket(bucket_name, kwargs.get("bucket_type", "allPrivate"))

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.mkdir(path)

    def rmdir(self, path: str) -> None:
        bucket_name, key = self._split(self._strip_protocol(path))
        if key:
            return
        bucket = self._bucket(bucket_name)
        with _translated(bucket_name):
            self._api.delete_bucket(bucket)
        with self._lock:
            self._buckets.pop(bucket_name, None)

    def _open(
        self, path: str, mode: str = "rb", block_size: int | None = None, **kwargs: Any
    ) -> B2File:
        return B2File(self, self._strip_protocol(path), mode, block_size or "default", **kwargs)


class B2File(AbstractBufferedFile):  # type: ignore[misc]  # fsspec is untyped
    """A buffered B2 file: range reads; writes spool locally and upload on close."""

    fs: B2FileSystem

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start, end)

    def _initiate_upload(self) -> None:
        self._spool: Any = tempfile.SpooledTemporaryFile(max_size=64 * 2**20)  # noqa: SIM115

    def _upload_chunk(self, final: bool = False) -> bool:
        self._spool.write(self.buffer.getbuffer())
        if final:
            self._spool.seek(0)
            try:
                self.fs._upload_stream(self.path, self._spool)
            finally:
                self._spool.close()
        return True


class B2Store(FsspecStore):
    """B2 as fetch and Manifest see it: reads by :meth:`B2FileSystem.read_async`, listing by
    :class:`B2Pages`."""

    fs: B2FileSystem

    async def read(
        self, url: StoreURL, span: ByteRange, version: str | None, patience: Patience
    ) -> Body:
        return await self.fs.read_async(self.path(url), span, patience)

    def lister(self, bucket: str) -> PageLister | None:
        return B2Pages(self.fs, bucket)


class B2Pages(BucketPages):
    """B2 returns up to 10,000 names per call and bills calls (class C): one chain of full
    pages, as b2sdk's ``ls`` does (3 calls for 24,750 names), not concurrent 1,000-key ranges."""

    fs: B2FileSystem
    tree_ordered = False  # B2 lists file names in UTF-8 byte order
    page_size: int | None = 10_000
    split = False

    async def page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        return await asyncio.to_thread(self._page, prefix, start_after, token, limit)

    def _page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        bucket = self.fs._bucket(self.bucket)
        start = token if token is not None else start_after  # startFileName is inclusive
        out = bucket.api.session.list_file_names(bucket.id_, start, limit, prefix)
        entries = [
            Listed(item["fileName"], int(item["contentLength"]), str(item["fileId"]))
            for item in out["files"]
            if item.get("action", "upload") == "upload"
            and (token is not None or item["fileName"] != start_after)
        ]
        return entries, out.get("nextFileName")
