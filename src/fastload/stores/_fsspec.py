"""Any fsspec filesystem as a :class:`~fastload.stores._base.Store`: ``file://``,
``memory://`` and the general path the other backends fall back on.

Async filesystems are read on their event loop; blocking ones on a thread pool shared by every
Fetcher of the process (so their clients' per-thread connections live as long as the process,
not as short-lived threads), into a buffer whose growth is watched. Local files are read
directly, with their mtime as the version served. Listing is the filesystem's own ``find``,
a stat its ``info``, each naming the version as a listing does. What the filesystem raises
leaves as fastload's errors (:class:`~fastload.stores._errors.boundary`), and a range past
the object's end as no bytes (:func:`~fastload.stores._base.read_edge`); the stores built on
this one (S3, GCS, B2) keep that edge for their own reads and pages.
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any

from fsspec import AbstractFileSystem

from fastload.resources import PerProcess
from fastload.stores._base import (
    Body,
    ByteRange,
    Listed,
    PageLister,
    Patience,
    Span,
    fsspec_offsets,
    read_edge,
    watch,
)
from fastload.stores._errors import boundary

if TYPE_CHECKING:
    from fastload.stores import StoreURL

__all__ = ["FsspecStore"]

_LOCAL_CHUNK = 1 << 20
_pools: PerProcess[int, ThreadPoolExecutor] = PerProcess("blocking read pools")


class FsspecStore:
    """Reads through ``fs`` (``threads`` wide when it blocks); lists with its ``find``."""

    def __init__(self, fs: AbstractFileSystem, threads: int = 32) -> None:
        self.fs, self.threads = fs, threads

    def path(self, url: StoreURL) -> str:
        return str(self.fs._strip_protocol(str(url)))

    def lister(self, bucket: str) -> PageLister | None:
        return None

    def find(self, root: StoreURL) -> list[Listed]:
        base = self.path(root).rstrip("/")
        with boundary(root):
            found = self.fs.find(base, detail=True)
        return sorted(
            (
                Listed(name[len(base) + 1 :], int(info.get("size") or 0), version(info))
                for name, info in found.items()
                if info.get("type", "file") == "file" and name.startswith(base + "/")
            ),
            key=lambda e: e.key,
        )

    def stat(self, url: StoreURL) -> Listed:
        path = self.path(url)
        with boundary(url):
            self.fs.invalidate_cache(path)  # a listing cached by the client would tell the old one
            info = self.fs.info(path)
        return Listed(url.key, int(info.get("size") or 0), version(info))

    async def read(
        self, url: StoreURL, span: ByteRange, version: str | None, patience: Patience
    ) -> Body:
        return await read_edge(url, span, patience, self._read(url, span, version, patience))

    async def _read(
        self, url: StoreURL, span: ByteRange, version: str | None, patience: Patience
    ) -> Body:
        """The read itself, in the client's own terms (:meth:`read` is its edge)."""
        path = self.path(url)
        if self.fs.async_impl:
            start, end = fsspec_offsets(span)
            data = await asyncio.wait_for(
                self.fs._cat_file(path, start=start, end=end), patience.timeout
            )
            return Body(bytes(data))
        pool = _pools.get(self.threads, lambda: ThreadPoolExecutor(self.threads, "fastload-fetch"))
        sink = io.BytesIO()
        job = partial(self._blocking, path, span, sink)
        future = asyncio.get_running_loop().run_in_executor(pool, job)
        return await watch(future, sink.tell, patience.timeout)

    def _blocking(self, path: str, span: ByteRange, sink: io.BytesIO) -> Body:
        if "file" in _protocols(self.fs) and isinstance(span, Span):
            return _local(path, span, sink)
        start, end = fsspec_offsets(span)
        sink.write(self.fs.cat_file(path, start=start, end=end))
        return Body(sink.getvalue())


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _local(path: str, span: Span, sink: io.BytesIO) -> Body:
    """A local file's bytes, and its mtime (the version a manifest of ``file://`` records)."""
    with open(path, "rb") as f:
        mtime = os.fstat(f.fileno()).st_mtime
        f.seek(span.start)
        stop = None if span.end is None else max(span.start, span.end)
        while chunk := f.read(_LOCAL_CHUNK if stop is None else min(_LOCAL_CHUNK, stop - f.tell())):
            sink.write(chunk)
    return Body(sink.getvalue(), (str(mtime),))


def version(info: Mapping[str, Any]) -> str:
    """The version an fsspec ``info`` names (a generation, an ETag, a file id, an mtime)."""
    for field in ("generation", "ETag", "etag", "version", "mtime", "LastModified", "created"):
        value = info.get(field)
        if value not in (None, ""):
            return str(value).strip('"')
    return ""
