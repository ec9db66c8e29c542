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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any

from fsspec import AbstractFileSystem
from fsspec.spec import AbstractBufferedFile

from fastload._extras import import_extra
from fastload.errors import (
    AccessDeniedError,
    ConfigError,
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
)
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


def _exists(path: str) -> StoreError:
    return ObjectExistsError(
        "an object already exists at this name (exclusive create); nothing was written",
        url=f"b2://{path}",
    )


def _changed(path: str) -> StoreError:
    return ObjectChangedError(
        "another writer replaced, created or deleted the object while it was being appended "
        "to; the append was not written",
        url=f"b2://{path}",
    )


def _refuse_folder_name(path: str) -> None:
    """A write to a name ending in "/" is refused, naming it, before anything is written: B2's
    file names cannot end in "/" (S3 and GCS keep such a key, as a folder marker). fsspec takes
    the "/" off a path before a write sees it, which wrote the object under the name without it
    (``pipe_file("bkt/dir/", b"")`` made an object ``dir``)."""
    name = path.removeprefix("b2://").lstrip("/")
    if name.endswith("/") and name.rstrip("/").count("/"):
        raise ConfigError(
            f"b2://{name}: B2 file names cannot end in '/' (a B2 folder is only the prefix of "
            f"the names in it; B2's web UI keeps an empty one as '{name}.bzEmpty'); nothing "
            "was written"
        )


@dataclass(frozen=True)
class _Expect:
    """What a conditional write expects its new version to follow: the file id of the
    object's version it was based on (``None``: no object), else ``conflict`` is raised.
    B2 has no conditional upload, so the write checks after the fact (see
    :meth:`B2FileSystem._settle`)."""

    previous: str | None
    conflict: Callable[[str], StoreError]


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
        version = self._live_version(path)
        if version is not None:
            return self._file_info(bucket_name, version)
        with _translated(path):
            for _ in bucket.ls(folder_to_list=f"{key}/", latest_only=True):
                return self._dir_info(path)
        raise ObjectNotFoundError("no such object", url=f"b2://{path}")

    def _live_version(self, path: str) -> Any | None:
        """The latest version of the object at ``path`` (bucket/key), or ``None`` when there
        is none (or it is hidden). A missing bucket raises."""
        bucket_name, key = self._split(path)
        bucket = self._bucket(bucket_name)
        try:
            with _translated(path):
                return bucket.get_file_info_by_name(key)
        except ObjectNotFoundError:
            return None

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
            return await self._downloads.get(bucket, key, span, patience)
        # a suffix: read_body asks for the size first
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
        """Upload ``value`` to ``path``. ``mode="create"`` writes only where no object is
        (else :class:`~fastload.errors.ObjectExistsError`). A name ending in "/" is a
        ConfigError: B2 has no such names."""
        _refuse_folder_name(path)
        path = self._strip_protocol(path)
        if mode not in ("overwrite", "create"):
            raise ConfigError(
                f"pipe_file mode {mode!r} for b2://{path}: use 'overwrite' or 'create'"
            )
        expect = self._expect_absent(path) if mode == "create" else None
        data = bytes(value)
        self._write(path, lambda bucket, key: bucket.upload_bytes(data, key), expect)

    def pipe(self, path: str | dict[str, bytes], value: bytes | None = None, **kwargs: Any) -> None:
        for name in [path] if isinstance(path, str) else path:
            _refuse_folder_name(name)  # before fsspec takes the "/" off
        super().pipe(path, value, **kwargs)

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "r" not in mode:
            _refuse_folder_name(path)  # before fsspec takes the "/" off
        return super().open(path, mode, *args, **kwargs)

    def _expect_absent(self, path: str) -> _Expect:
        """An exclusive create's check before it uploads (no object at ``path``), and its
        expectation for after."""
        if self._live_version(path) is not None:
            raise _exists(path)
        return _Expect(None, _exists)

    def _write(self, path: str, upload: Callable[[Any, str], Any], expect: _Expect | None) -> None:
        """``upload(bucket, key)`` a new version of ``path``; with ``expect``, keep it only
        if it follows the version expected."""
        bucket_name, key = self._split(path)
        bucket = self._bucket(bucket_name)
        with _translated(path):
            ours = upload(bucket, key)
        if expect is not None:
            self._settle(bucket, path, ours, expect)

    def _settle(self, bucket: Any, path: str, ours: Any, expect: _Expect) -> None:
        """Keep the version ``ours`` just uploaded only if the version before it is the one
        ``expect``-ed. Otherwise another writer's version landed between this write's check
        (or read) and its upload: ``ours`` is deleted, so the object is as that writer left
        it, and ``expect.conflict`` is raised. B2 orders one name's versions the same for
        every caller, so of two racing exclusive creates exactly one is kept."""
        with _translated(path):
            chain = (
                v
                for v in bucket.list_file_versions(ours.file_name)
                if v.action in ("upload", "hide")  # not "start": an unfinished large file
            )
            for version in chain:  # newest first
                if version.id_ == ours.id_:
                    older = next(chain, None)
                    break
            else:
                return  # deleted since: a later change than this write, not a conflict
        before = older.id_ if older is not None and older.action == "upload" else None
        if before == expect.previous:
            return
        with _translated(path):
            bucket.delete_file_version(ours.id_, ours.file_name)
        raise expect.conflict(path)

    def _download_version(self, path: str, version: Any, out: IO[bytes]) -> None:
        """Write the bytes of ``version`` (of the object at ``path``) to ``out``, checked
        against its SHA-1 by b2sdk."""
        bucket = self._bucket(self._split(path)[0])
        with _translated(path):
            downloaded = bucket.download_file_by_id(version.id_)
            try:
                downloaded.save(out, allow_seeking=False)
            finally:
                downloaded.response.close()

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """Copy the object ``path1`` to ``path2`` on the server (``b2_copy_file``; b2sdk copies
        one over 5 GB in parts), content type and file info included. A folder is only a
        name prefix in B2: copying one copies nothing (its objects are copied one by one)."""
        path1, target = self._strip_protocol(path1), self._strip_protocol(path2)
        source = self._live_version(path1) if self._split(path1)[1] else None
        if source is None:
            if self.isdir(path1):
                return
            raise ObjectNotFoundError("no such object", url=f"b2://{path1}")
        _refuse_folder_name(path2)
        bucket_name, key = self._split(target)
        bucket = self._bucket(bucket_name)
        with _translated(path1):
            bucket.copy(source.id_, key)

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
    """A buffered B2 file: range reads; writes spool locally and upload on close.

    ``"xb"`` writes only where no object is (checked at open and again after the upload).
    B2 cannot append to an object, so ``"ab"`` reads, modifies and writes: the new version
    holds the bytes of the version seen at open followed by those written, and is kept only
    if no other writer changed the object in between (else
    :class:`~fastload.errors.ObjectChangedError`, and nothing is written)."""

    fs: B2FileSystem

    def __init__(self, fs: B2FileSystem, path: str, mode: str = "rb", *args: Any, **kwargs: Any):
        # Checked before the file is set up: a file refused half-built would still be
        # flushed (an empty upload over the object) when the garbage collector closes it.
        self._base: Any | None = fs._live_version(path) if mode == "ab" else None  # appended to
        self._expect: _Expect | None = None
        if mode == "xb":
            self._expect = fs._expect_absent(path)
        elif mode == "ab":
            self._expect = _Expect(None if self._base is None else self._base.id_, _changed)
        super().__init__(fs, path, mode, *args, **kwargs)
        if self._base is not None:
            self.loc = self._base.size

    @property
    def _unchanged(self) -> bool:
        """An append that has written nothing leaves the object as it is (no new version)."""
        return self._base is not None and self.loc == self._base.size

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start, end)

    def _initiate_upload(self) -> None:
        self._spool: Any = tempfile.SpooledTemporaryFile(max_size=64 * 2**20)  # noqa: SIM115
        if self._base is not None and not self._unchanged:
            try:
                self.fs._download_version(self.path, self._base, self._spool)
            except BaseException:
                self._spool.close()
                raise

    def _upload_chunk(self, final: bool = False) -> bool:
        self._spool.write(self.buffer.getbuffer())
        if final:
            try:
                if not self._unchanged:
                    self._spool.seek(0)
                    self.fs._write(self.path, self._upload, self._expect)
            finally:
                self._spool.close()
        return True

    def _upload(self, bucket: Any, key: str) -> Any:
        return bucket.upload_unbound_stream(self._spool, key)


class B2Store(FsspecStore):
    """B2 as fetch and Manifest see it: reads by :meth:`B2FileSystem.read_async`, listing by
    :class:`B2Pages`."""

    fs: B2FileSystem

    async def _read(
        self, url: StoreURL, span: ByteRange, version: str | None, patience: Patience
    ) -> Body:
        return await self.fs.read_async(self.path(url), span, patience)

    def lister(self, bucket: str) -> PageLister | None:
        return B2Pages(self.fs, bucket)


class B2Pages(BucketPages):
    """B2 returns up to 10,000 names per call and bills calls (class C): one chain of full
    pages, as b2sdk's ``ls`` does (3 calls for 24,750 names), not concurrent 1,000-key ranges."""

    fs: B2FileSystem
    scheme = "b2"
    tree_ordered = False  # B2 lists file names in UTF-8 byte order
    page_size: int | None = 10_000
    split = False

    async def _page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        return await asyncio.to_thread(self._names, prefix, start_after, token, limit)

    def _names(
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
