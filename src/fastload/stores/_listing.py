"""Parallel listing: split a prefix's key range into many ranges and list them at once.

Object stores list 1,000 keys per request, one page after another, so a single listing of a
large prefix is a long chain of round trips. Every store here can start a listing *after* a
given key (S3 StartAfter, GCS startOffset, B2 startFileName), so the key space can be cut into
ranges ``(lo, hi]`` that are listed concurrently; the split points are guessed from the first
page (after the last key listed, the next keys probably differ where the page's keys differed).

Not every server orders keys as S3 specifies (UTF-8 byte order). Servers built on a file tree
(SeaweedFS, among others) walk directories: ``StartAfter="data/P2"`` skips everything under
``data/P2/``, and ``data/P2/x`` sorts before ``data/P2.txt``. The two orders agree about a split
point ``p`` for every key unless ``p`` names a "directory" (``p + "/"`` has keys) or passes
through one where ``p`` has a character that sorts below ``/`` (``data/P2-b`` when ``data/P2/``
has keys). So a split point is used only once such prefixes are shown empty (one small listing
each, shared), every range asks for the whole prefix, a page's keys are kept by value (not by
their place in the page), and a range goes on with the store's own continuation token, never a
key of ours. The result is complete on either kind of server; split points only decide how much
runs in parallel.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from fsspec import AbstractFileSystem

from fastload.config import FetchConfig
from fastload.stores import _fast
from fastload.stores._errors import Kind, classify
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
    #: whether the store may order keys as a file tree (S3 emulations do): split points are
    #: then checked first (see the module docstring)
    tree_ordered: bool
    #: the most keys one request returns (None: ``PAGE``)
    page_size: int | None
    #: whether key ranges are listed concurrently (the store bills or limits list calls: no)
    split: bool

    async def page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        """Up to ``limit`` (<= the page size) keys under ``prefix``: the first page after
        ``start_after`` when ``token`` is None, else the page ``token`` continues; and the
        token of the next page (None at the end)."""


class _S3Pages:
    tree_ordered = True
    page_size: int | None = None
    split = True

    def __init__(self, fs: Any, bucket: str) -> None:
        self.fs, self.bucket = fs, bucket

    async def page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        where: dict[str, str] = {}
        if token is not None:
            where["ContinuationToken"] = token
        elif start_after:
            where["StartAfter"] = start_after
        out = await self.fs._call_s3(
            "list_objects_v2", Bucket=self.bucket, Prefix=prefix, MaxKeys=limit, **where
        )
        entries = [
            Listed(item["Key"], int(item["Size"]), str(item.get("ETag", "")).strip('"'))
            for item in out.get("Contents", [])
        ]
        more = out.get("NextContinuationToken") if out.get("IsTruncated") else None
        return entries, more


@dataclass
class _Stream:
    """Where an obstore listing stands: its stream (which keeps S3's own continuation token)
    and the last key it gave; a stream that failed once is not trusted again."""

    stream: Any
    last: str | None
    broken: bool = False


class _ObstorePages:
    """S3 pages through obstore: a twentieth of botocore's CPU per key.

    obstore renames some keys (a ``sub/`` marker comes back as ``sub``) and refuses others
    (``a//b``, ``./c``, control characters): a page holding an empty object, or one obstore
    cannot parse, is asked for again through botocore, which then lists the rest of the range.
    """

    tree_ordered = True
    page_size: int | None = None
    split = True

    def __init__(self, store: Any, general: _S3Pages) -> None:
        self.store, self.general = store, general

    async def page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        if not isinstance(token, _Stream | None):  # this range went through botocore
            return await self.general.page(prefix, start_after, token, limit)
        if token is not None and token.broken:
            return await self.general.page(prefix, token.last or start_after, None, limit)
        directory = prefix.rstrip("/") or None
        if not _fast.readable(directory or "x") or not _fast.readable(start_after or "x"):
            return await self.general.page(prefix, start_after, None, limit)
        # whole pages always: the stream keeps its chunk size for every page it gives, and a
        # range probed with a small first page would go on 100 keys at a time
        cursor = token or _Stream(_fast.list_stream(self.store, directory, start_after, PAGE), None)
        try:
            rows = await _fast.next_page(cursor.stream)
        except Exception as exc:
            if token is None and classify(exc) is Kind.TRANSIENT:
                raise  # a first page is simply asked for again
            # a key obstore cannot parse, or a stream that failed midway (it cannot resume)
            cursor.broken = True
            return await self.general.page(prefix, cursor.last or start_after, None, limit)
        if rows is None:
            return [], None
        if any(size == 0 for _, size, _ in rows):  # a marker, or a key obstore renamed
            return await self.general.page(prefix, cursor.last or start_after, None, limit)
        cursor.last = rows[-1][0] if rows else cursor.last
        return [Listed(*row) for row in rows], cursor


class _GcsPages:
    tree_ordered = True  # real GCS is not, but emulators may be
    page_size: int | None = None
    split = True

    def __init__(self, fs: Any, bucket: str) -> None:
        self.fs, self.bucket = fs, bucket

    async def page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        where: dict[str, str] = {}
        if token is not None:
            where["pageToken"] = token
        elif start_after:
            where["startOffset"] = start_after  # inclusive: start_after itself is dropped
        out = await self.fs._call(
            "GET", "b/{}/o", self.bucket, prefix=prefix, maxResults=limit, json_out=True, **where
        )
        entries = [
            Listed(item["name"], int(item["size"]), str(item.get("generation", "")))
            for item in out.get("items", [])
            if token is not None or item["name"] != start_after
        ]
        return entries, out.get("nextPageToken")


class _B2Pages:
    """B2 returns up to 10,000 names per call and bills calls (class C): one chain of full
    pages, as b2sdk's ``ls`` does (3 calls for 24,750 names), not concurrent 1,000-key ranges."""

    tree_ordered = False  # B2 lists file names in UTF-8 byte order
    page_size: int | None = 10_000
    split = False

    def __init__(self, fs: Any, bucket: str) -> None:
        self.fs, self.bucket = fs, bucket

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
        return _ObstorePages(fast, _S3Pages(fs, bucket))
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


def _guards(point: str, prefix: str) -> set[str]:
    """Prefixes that must hold no keys for ``point`` to split a tree-ordered listing safely."""
    below = {point[:i] + "/" for i in range(len(prefix), len(point)) if point[i] < "/"}
    return {point + "/", *below}


async def list_parallel(
    lister: PageLister, prefix: str, *, concurrency: int = 32, config: FetchConfig
) -> list[Listed]:
    """Every key under ``prefix``, sorted, listed over concurrently running key ranges.

    Each page request gets ``config.timeout`` seconds; one that fails transiently is asked for
    again as fetches are (``retries``, then, once the store has answered a page, for as long as
    ``outage_budget`` lasts).
    """
    gate = asyncio.Semaphore(concurrency)
    found: dict[str, Listed] = {}
    empty: dict[str, asyncio.Task[bool]] = {}
    started = time.monotonic()
    answered = False

    def give_up(failures: int, _error: BaseException) -> bool:
        outlasted = time.monotonic() - started >= config.outage_budget
        return failures > config.retries and (outlasted or not answered)

    async def timed(scope: str, start_after: str | None, token: Any, limit: int) -> Any:
        nonlocal answered
        try:
            page = await asyncio.wait_for(
                lister.page(scope, start_after, token, limit), config.timeout
            )
        except TimeoutError:
            if isinstance(token, _Stream):
                token.broken = True  # a stream cut off mid-page is not read again
            raise
        answered = True
        return page

    async def ask(scope: str, start_after: str | None, token: Any, limit: int) -> Any:
        async with gate:
            return await retrying(
                partial(timed, scope, start_after, token, limit),
                give_up=give_up,
                backoff=config.backoff,
                max_backoff=config.max_backoff,
            )

    async def holds_nothing(scope: str) -> bool:
        page, _ = await ask(scope, None, None, 1)
        return not page

    def checked(scope: str) -> Awaitable[bool]:
        if scope not in empty:
            empty[scope] = asyncio.ensure_future(holds_nothing(scope))
        return empty[scope]

    async def usable(points: list[str]) -> list[str]:
        if not lister.tree_ordered:
            return points
        guards = [sorted(_guards(p, prefix)) for p in points]
        flat = sorted({g for gs in guards for g in gs})
        ok = dict(zip(flat, await asyncio.gather(*(checked(g) for g in flat)), strict=True))
        return [p for p, gs in zip(points, guards, strict=True) if all(ok[g] for g in gs)]

    async def walk(lo: str | None, hi: str | None, token: Any = None) -> None:
        full = lister.page_size or PAGE
        limit = full if hi is None or token is not None else PROBE
        full_pages = 0
        while True:
            page, token = await ask(prefix, lo, token, limit)
            limit = full
            inside = [e for e in page if hi is None or e.key <= hi]
            found.update((e.key, e) for e in inside)
            if token is None or len(inside) < len(page) or not inside:
                return
            full_pages += 1
            # A bounded range usually ends within a page of its start: split it only once it
            # has proved long (every split costs requests, and each request server time).
            if not lister.split or (hi is not None and full_pages < 2):
                continue
            points = await usable(_split_points(inside, prefix, inside[-1].key, hi))
            if points:
                # the first part goes on from this page; the others start at split points
                first = walk(None, points[0], token)
                rest = (walk(a, b) for a, b in itertools.pairwise([*points, hi]))
                await asyncio.gather(first, *rest)
                return

    await walk(None, None)
    return sorted(found.values(), key=lambda e: e.key)
