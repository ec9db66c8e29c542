"""Parallel listing: split a prefix's key range into many ranges and list them at once.

Object stores list 1,000 keys per request, one page after another, so a single listing of a
large prefix is a long chain of round trips. Every store here can start a listing *after* a
given key (S3 StartAfter, GCS startOffset, B2 startFileName), so the key space can be cut into
ranges ``(lo, hi]`` that are listed concurrently. Ranges always partition the key space, so the
result is complete whatever the split points; the points only decide how much runs in parallel.
They are guessed from the first page: after the last key listed, the next keys probably differ
at the positions where the page's keys already differed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from fsspec import AbstractFileSystem

from fastload.stores import _fast
from fastload.stores._retry import retrying

__all__ = ["Listed", "PageLister", "list_parallel", "page_lister"]

PAGE = 1000
PROBE = 100  # first page of a bounded range: most such ranges are small or empty
_DEPTH = 4  # character positions tried above the varying one


@dataclass(frozen=True)
class Listed:
    key: str  # the object key within the bucket
    size: int
    version: str  # ETag, generation or file id


class PageLister(Protocol):
    async def page(
        self, prefix: str, start_after: str | None, limit: int
    ) -> tuple[list[Listed], bool]:
        """Up to ``limit`` (<= 1000) keys under ``prefix``, sorted, all > ``start_after``;
        and whether more may follow."""


class _S3Pages:
    def __init__(self, fs: Any, bucket: str) -> None:
        self.fs, self.bucket = fs, bucket

    async def page(
        self, prefix: str, start_after: str | None, limit: int
    ) -> tuple[list[Listed], bool]:
        extra = {"StartAfter": start_after} if start_after else {}
        out = await self.fs._call_s3(
            "list_objects_v2", Bucket=self.bucket, Prefix=prefix, MaxKeys=limit, **extra
        )
        entries = [
            Listed(item["Key"], int(item["Size"]), str(item.get("ETag", "")).strip('"'))
            for item in out.get("Contents", [])
        ]
        return entries, bool(out.get("IsTruncated"))


class _ObstorePages:
    """S3 through obstore: the same pages for a twentieth of botocore's CPU per key."""

    def __init__(self, store: Any) -> None:
        self.store = store

    async def page(
        self, prefix: str, start_after: str | None, limit: int
    ) -> tuple[list[Listed], bool]:
        rows, more = await _fast.list_page(self.store, prefix, start_after, limit)
        return [Listed(*row) for row in rows], more


class _GcsPages:
    def __init__(self, fs: Any, bucket: str) -> None:
        self.fs, self.bucket = fs, bucket

    async def page(
        self, prefix: str, start_after: str | None, limit: int
    ) -> tuple[list[Listed], bool]:
        extra = {"startOffset": start_after} if start_after else {}
        out = await self.fs._call(
            "GET",
            "b/{}/o",
            self.bucket,
            prefix=prefix,
            maxResults=limit + 1,  # startOffset is inclusive: room for start_after itself
            json_out=True,
            **extra,
        )
        entries = [
            Listed(item["name"], int(item["size"]), str(item.get("generation", "")))
            for item in out.get("items", [])
        ]
        return _after(entries, start_after, limit, bool(out.get("nextPageToken")))


class _B2Pages:
    def __init__(self, fs: Any, bucket: str) -> None:
        self.fs, self.bucket = fs, bucket

    async def page(
        self, prefix: str, start_after: str | None, limit: int
    ) -> tuple[list[Listed], bool]:
        return await asyncio.to_thread(self._page, prefix, start_after, limit)

    def _page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[Listed], bool]:
        bucket = self.fs._bucket(self.bucket)
        entries: list[Listed] = []
        start = start_after  # startFileName is inclusive: _after drops start_after itself
        while True:  # B2 may answer with fewer files than asked for; follow nextFileName
            out = bucket.api.session.list_file_names(bucket.id_, start, limit + 1, prefix)
            entries.extend(
                Listed(item["fileName"], int(item["contentLength"]), str(item["fileId"]))
                for item in out["files"]
                if item.get("action", "upload") == "upload"
            )
            start = out.get("nextFileName")
            if start is None or len(entries) > limit:
                return _after(entries, start_after, limit, start is not None)


def _after(
    entries: list[Listed], start_after: str | None, limit: int, more: bool
) -> tuple[list[Listed], bool]:
    """A page from a store whose start key is inclusive, cut to keys > start_after."""
    if start_after is not None:
        entries = [e for e in entries if e.key > start_after]
    return entries[:limit], more or len(entries) > limit


_LISTERS: dict[str, Callable[[Any, str], PageLister]] = {
    "s3": _S3Pages,
    "gs": _GcsPages,
    "gcs": _GcsPages,
    "b2": _B2Pages,
}


def page_lister(
    scheme: str, fs: AbstractFileSystem, bucket: str, fast: Any = None
) -> PageLister | None:
    """A page-at-a-time lister for ``scheme`` (over obstore's ``fast`` store when given), or
    None where only ``fs.find`` is available."""
    if fast is not None:
        return _ObstorePages(fast)
    factory = _LISTERS.get(scheme)
    return None if factory is None else factory(fs, bucket)


def _split_points(page: list[Listed], prefix: str, last: str, hi: str | None) -> list[str]:
    varying = max(len(prefix), len(_common_prefix(page[0].key, last)))
    alphabet = sorted({ch for e in page for ch in e.key[varying:]} | {"~"})
    points: list[str] = []
    for position in range(min(varying, len(last) - 1), max(len(prefix), varying - _DEPTH) - 1, -1):
        stem = last[:position]
        points.extend(stem + ch for ch in alphabet if ch > last[position])
    return [p for p in points if p > last and (hi is None or p < hi)]


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


async def list_parallel(
    lister: PageLister, prefix: str, *, concurrency: int = 32, retries: int = 6
) -> list[Listed]:
    """Every key under ``prefix``, sorted, listed over concurrently running key ranges.

    A page that fails transiently is asked for again (up to ``retries`` times, backing off).
    """
    gate = asyncio.Semaphore(concurrency)
    found: list[Listed] = []

    async def walk(lo: str | None, hi: str | None) -> None:
        # Every key in (lo, hi] starts with their common prefix: asking for only that prefix
        # keeps the store from sending a page of keys beyond hi.
        narrowed = _common_prefix(lo, hi) if lo is not None and hi is not None else ""
        scope = max(prefix, narrowed, key=len)
        cursor = lo
        if hi is None or lo is None:
            limit = PAGE
        elif len(scope) < len(lo) - 1:
            limit = 1  # the tail of a split up to the parent's bound: almost always empty
        else:
            limit = PROBE
        full_pages = 0
        while True:
            async with gate:
                page, more = await retrying(
                    partial(lister.page, scope, cursor, limit),
                    retries=retries,
                    backoff=0.05,
                    max_backoff=5.0,
                )
            limit = PAGE
            inside = [e for e in page if hi is None or e.key <= hi]
            found.extend(inside)
            if not more or len(inside) < len(page) or not inside:
                return
            cursor = inside[-1].key
            full_pages += 1
            # A bounded range usually ends within a page of its start: split it only once it
            # has proved long (every split costs requests, and each request server time).
            points = (
                _split_points(inside, prefix, cursor, hi) if hi is None or full_pages > 1 else []
            )
            if points:
                bounds = [cursor, *points, hi]
                await asyncio.gather(*(walk(a, b) for a, b in itertools.pairwise(bounds)))
                return

    await walk(None, None)
    found.sort(key=lambda e: e.key)
    return found
