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
import string
import time
from collections.abc import Awaitable
from functools import partial
from typing import Any

from fastload.config import FetchConfig
from fastload.errors import StoreError, TransientStoreError
from fastload.stores._base import PAGE, Listed, PageLister, Stream
from fastload.stores._retry import retrying

__all__ = ["common_prefix", "guards", "list_parallel"]

PROBE = 100  # first page of a bounded range: most such ranges are small or empty
_DEPTH = 4  # character positions tried above the varying one
_CHAIN = 3  # full pages a listing reads one after another before it splits


def _split_points(page: list[Listed], prefix: str, last: str, hi: str | None) -> list[str]:
    varying = max(len(prefix), len(common_prefix(page[0].key, last)))
    alphabet = sorted({ch for e in page for ch in e.key[varying:]} | {"~"})
    points: list[str] = []
    for position in range(min(varying, len(last) - 1), max(len(prefix), varying - _DEPTH) - 1, -1):
        stem, here = last[:position], last[position]
        # a digit's place holds digits: the page's other characters (a suffix's ".jpg") there
        # would start ranges past the last key, each an empty request or two
        chars = string.digits if here in string.digits else alphabet
        points.extend(stem + ch for ch in chars if ch > here)
    return [p for p in points if p > last and (hi is None or p < hi)]


def common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def guards(point: str, prefix: str) -> set[str]:
    """Prefixes that must hold no keys for ``point`` to split a tree-ordered listing safely."""
    below = {point[:i] + "/" for i in range(len(prefix), len(point)) if point[i] < "/"}
    return {point + "/", *below}


class _Progress:
    """What one chain of pages has read: a token given twice, or the same page twice in a
    row, means the store would list forever (seen: a server answering ``IsTruncated=true``
    with one token for ever, 9,000 pages in 15 s). A stream's cursor (obstore) is the same
    object page after page, so only plain tokens are compared."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.pages = 0
        self.tokens: set[Any] = set()
        self.last: tuple[str, str, int] | None = None
        self.last_streamed = False

    def check(self, page: list[Listed], token: Any) -> None:
        self.pages += 1
        shape = (page[0].key, page[-1].key, len(page)) if page else None
        streamed = isinstance(token, Stream)
        # a stream handed over to botocore lists its range again from its start: the page
        # after the handover may repeat the stream's last one (kept once, by value)
        handover = self.last_streamed and not streamed
        repeated = not streamed and token in self.tokens
        again = shape is not None and shape == self.last and not handover
        if token is not None and (repeated or again):
            what = "a continuation token it gave before" if repeated else "the same page again"
            raise StoreError(
                f"the store answered {what} after {self.pages} pages: its listing would never "
                f"end (a server bug; fastload stops rather than list forever)",
                url=self.prefix or "/",
            )
        if token is not None and not streamed:
            self.tokens.add(token)
        self.last, self.last_streamed = shape, streamed


async def _page_in_time(
    lister: PageLister,
    scope: str,
    start_after: str | None,
    token: Any,
    limit: int,
    *,
    timeout: float,
) -> tuple[list[Listed], Any]:
    """``lister``'s page, or a :class:`TransientStoreError` naming the prefix when none came
    within ``timeout`` seconds (a stream cut off mid-page is not read again)."""
    try:
        return await asyncio.wait_for(lister.page(scope, start_after, token, limit), timeout)
    except TimeoutError as exc:
        if isinstance(token, Stream):
            token.broken = True
        silence = f"no page within {timeout:g} s"
        raise TransientStoreError(silence, url=lister.url(scope)) from exc


async def list_parallel(
    lister: PageLister,
    prefix: str,
    *,
    concurrency: int = 32,
    config: FetchConfig,
    split: bool = True,
) -> list[Listed]:
    """Every key under ``prefix``, sorted, listed over concurrently running key ranges (one
    chain of pages with ``split=False``).

    Each page request gets ``config.timeout`` seconds; one that fails transiently is asked for
    again as fetches are (``retries``, then, once the store has answered a page, for as long as
    ``outage_budget`` lasts). A store that gives a continuation token it gave before, or the
    same page twice in a row, would be listed forever: that is a :class:`StoreError` naming the
    prefix and the pages read. Like the lister's own, every error is fastload's.
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
        page = await _page_in_time(lister, scope, start_after, token, limit, timeout=config.timeout)
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
        needed = [sorted(guards(p, prefix)) for p in points]
        flat = sorted({g for gs in needed for g in gs})
        ok = dict(zip(flat, await asyncio.gather(*(checked(g) for g in flat)), strict=True))
        return [p for p, gs in zip(points, needed, strict=True) if all(ok[g] for g in gs)]

    async def walk(lo: str | None, hi: str | None, token: Any = None) -> None:
        full = lister.page_size or PAGE
        limit = full if hi is None or token is not None else PROBE
        full_pages = 0
        progress = _Progress(prefix)
        while True:
            page, token = await ask(prefix, lo, token, limit)
            progress.check(page, token)
            full_pages += len(page) >= limit  # (a stream's last page may come short, not last)
            limit = full
            inside = [e for e in page if hi is None or e.key <= hi]
            found.update((e.key, e) for e in inside)
            if token is None or len(inside) < len(page) or not inside:
                return
            # Split a range only once it has proved long (every split costs requests, and each
            # request server time): a bounded one usually ends within a page of its start, and
            # a listing of a few pages is quicker as one chain (2,000 keys: 2 requests, where
            # splitting after the first page sent 58 and took 2-3x as long on moto and
            # fake-gcs-server through +20 ms). Three pages, not two: obstore's stream tells
            # its end only on the page after its last, so a listing of exactly two pages
            # would split.
            if not (split and lister.split) or full_pages < (_CHAIN if hi is None else 2):
                continue
            points = await usable(_split_points(inside, prefix, inside[-1].key, hi))
            if points:
                # the first part goes on from this page; the others start at split points
                first = walk(lo, points[0], token)
                rest = (walk(a, b) for a, b in itertools.pairwise([*points, hi]))
                await asyncio.gather(first, *rest)
                return

    await walk(None, None)
    return sorted(found.values(), key=lambda e: e.key)
