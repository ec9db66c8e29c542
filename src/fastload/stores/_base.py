"""The store seam: what fetch and :class:`fastload.Manifest` ask of a backend, and the values
that cross it.

A :class:`Store` reads a byte range of an object and lists a bucket a page at a time; one
implementation per backend (fsspec's generic filesystems, S3 through s3fs, obstore in front of
it, GCS, B2), chosen in one place (:func:`fastload.stores.open_store`), so nothing above this
package branches on the backend.

Reads say which version their bytes are (S3's ETag, a GCS generation, a B2 file id or SHA-1, a
local file's mtime), so :mod:`fastload.fetcher` can refuse bytes of an object replaced since it
was indexed (:class:`fastload.errors.ObjectChangedError`); a store that names no version
(``memory://``) serves ``()``, and nothing is checked.

Every method of a store raises fastload's errors only (:mod:`fastload.errors`), naming the
object: each maps its own client's exceptions at its edge
(:class:`fastload.stores._errors.boundary`). A range is clipped to the object: one that starts
at or past its end reads ``b""`` on every store (:func:`read_edge`).
A read times out when ``timeout`` seconds pass without a byte (before the first, then between
chunks), never on its total duration: a large object on a slow link arrives, a stalled one
fails fast (:class:`Patience`), as a :class:`~fastload.errors.TransientStoreError` raised from
the ``TimeoutError``. Bodies that would arrive within ``timeout`` even at
``FLOOR_RATE`` are read in one piece (streaming cost 150 KB objects 17% more CPU); larger ones,
or of unknown size, are streamed with a watcher.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, Union

from fastload.errors import ConfigError
from fastload.stores._errors import boundary, unsatisfiable

if TYPE_CHECKING:
    from fastload.stores import StoreURL

__all__ = [
    "FLOOR_RATE",
    "PAGE",
    "Body",
    "BucketPages",
    "ByteRange",
    "Listed",
    "PageLister",
    "Patience",
    "Span",
    "Store",
    "Stream",
    "Suffix",
    "fsspec_offsets",
    "http_range",
    "next_chunk",
    "progressing",
    "read_edge",
    "watch",
]

FLOOR_RATE = 256 << 10  # bytes/s: a body that arrives within the timeout at this rate is whole
PAGE = 1000  # keys per listing request, where the store does not say otherwise
T = TypeVar("T")


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, end)`` of an object (``end`` None: to its end)."""

    start: int = 0
    end: int | None = None

    def __post_init__(self) -> None:
        if self.start < 0 or (self.end is not None and self.end < 0):
            raise ConfigError(f"a byte span needs offsets >= 0, got [{self.start}, {self.end})")

    @property
    def empty(self) -> bool:
        return self.end is not None and self.end <= self.start


@dataclass(frozen=True)
class Suffix:
    """The last ``length`` bytes of an object (all of it when shorter)."""

    length: int

    def __post_init__(self) -> None:
        if self.length < 0:
            raise ConfigError(f"a byte suffix needs a length >= 0, got {self.length}")

    @property
    def empty(self) -> bool:
        return self.length == 0


ByteRange = Union[Span, Suffix]  # noqa: UP007 (a runtime alias on Python 3.10)


def fsspec_offsets(span: ByteRange) -> tuple[int | None, int | None]:
    """fsspec's ``(start, end)`` for ``span`` (where a negative start is a suffix)."""
    if isinstance(span, Suffix):
        return (-span.length, None) if span.length else (None, 0)
    return span.start or None, span.end


def http_range(span: ByteRange) -> dict[str, str]:
    """The HTTP ``Range`` header for ``span`` (none for a whole body)."""
    if isinstance(span, Suffix):
        return {"Range": f"bytes=-{span.length}"}
    if span.end is not None:
        return {"Range": f"bytes={span.start}-{span.end - 1}"}
    return {"Range": f"bytes={span.start}-"} if span.start else {}


@dataclass(frozen=True)
class Patience:
    """How long a read may go without a byte, and the body's length when it is known."""

    timeout: float
    expected: int | None = None

    @property
    def whole(self) -> bool:
        """Read the body in one piece: it arrives within ``timeout`` even at ``FLOOR_RATE``."""
        return self.expected is not None and self.expected <= self.timeout * FLOOR_RATE

    @property
    def chunk(self) -> int:
        """Bytes per streamed chunk: a few per ``timeout`` at ``FLOOR_RATE`` (64 KiB-1 MiB)."""
        return int(min(1 << 20, max(64 << 10, self.timeout * FLOOR_RATE / 4)))


@dataclass(frozen=True)
class Body:
    """The bytes read, and the versions the store named for them (``()``: it named none).
    ``data`` is a read-only memoryview where the client hands out its own buffer (obstore):
    :meth:`fastload.Fetcher.fetch` copies it only for callers that want ``bytes``."""

    data: bytes | memoryview
    served: tuple[str, ...] = ()


@dataclass(frozen=True)
class Listed:
    key: str  # the object key within the bucket
    size: int
    version: str  # ETag, generation or file id


@dataclass
class Stream:
    """A listing cursor that cannot resume once it failed (an obstore stream): the last key it
    gave and whether it broke; the lister then goes on another way."""

    stream: Any
    last: str | None = None
    broken: bool = False


class PageLister(Protocol):
    #: whether the store may order keys as a file tree (S3 emulations do): split points are
    #: then checked first (see :mod:`fastload.stores._listing`)
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

    def url(self, prefix: str) -> str:
        """The URL of ``prefix`` in this bucket (what a failed listing names)."""


class EdgedPages:
    """A :class:`PageLister`'s edge: :meth:`page` runs the lister's own :meth:`_page` and
    raises fastload's errors only, naming the prefix's URL (:meth:`url`)."""

    tree_ordered = True
    page_size: int | None = None
    split = True

    def url(self, prefix: str) -> str:
        raise NotImplementedError

    async def page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        with boundary(self.url(prefix)):
            return await self._page(prefix, start_after, token, limit)

    async def _page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        """The page itself, in the client's own terms (:meth:`page` is its edge)."""
        raise NotImplementedError


class BucketPages(EdgedPages):
    """What a :class:`PageLister` over one bucket of a filesystem shares: the bucket, and by
    default ``PAGE`` keys a page, concurrent key ranges and split points checked as for a
    file-tree order (S3 emulations list so). ``scheme`` names the bucket's URLs."""

    scheme: str

    def __init__(self, fs: Any, bucket: str) -> None:
        self.fs, self.bucket = fs, bucket

    def url(self, prefix: str) -> str:
        return f"{self.scheme}://{self.bucket}/{prefix}"


class Store(Protocol):
    """One backend, as fetch and Manifest see it: read a range, list pages, find, stat. Each
    method raises :class:`fastload.errors.FastloadError` subclasses only, naming the object
    (its page listings too)."""

    async def read(
        self, url: StoreURL, span: ByteRange, version: str | None, patience: Patience
    ) -> Body:
        """``url``'s bytes ``span`` (of ``version`` where the store can ask for one); a
        :class:`~fastload.errors.TransientStoreError` from ``TimeoutError`` after
        ``patience.timeout`` s without progress."""

    def lister(self, bucket: str) -> PageLister | None:
        """``bucket``'s pages, or None where only :meth:`find` lists it."""

    def find(self, root: StoreURL) -> list[Listed]:
        """Every object under ``root`` (keys relative to it), sorted, in one blocking call."""

    def stat(self, url: StoreURL) -> Listed:
        """The object's size and version now (one request), its key as ``url`` names it."""


async def read_edge(
    url: StoreURL, span: ByteRange, patience: Patience, read: Awaitable[Body]
) -> Body:
    """A store read's edge: ``read``'s body, or fastload's errors only, naming ``url`` (see
    :class:`boundary`). A range that starts at or past the object's end is no bytes, on every
    store, as Python's slicing and a local file read it (a range is clipped to the object): the
    servers that refuse one (a 416, :func:`unsatisfiable`) answer ``b""`` here. A read of a
    whole object sends no range, so a 416 for one stays an error."""
    with boundary(url, patience.timeout):
        try:
            return await read
        except Exception as exc:
            if span != Span() and unsatisfiable(exc):
                return Body(b"")
            raise


async def progressing(
    next_one: Callable[[], Awaitable[T]], timeout: float, end: type[BaseException]
) -> list[T]:
    """Every chunk ``next_one()`` gives until it raises ``end``; ``TimeoutError`` when
    ``timeout`` seconds pass without one. (One watcher per read: a timer per chunk cost 16 MB
    bodies 47% more CPU in one measurement.)"""
    chunks: list[T] = []

    async def pump() -> None:
        with contextlib.suppress(end):
            while True:
                chunks.append(await next_one())

    await watch(asyncio.ensure_future(pump()), lambda: len(chunks), timeout)
    return chunks


async def watch(task: asyncio.Future[T], progress: Callable[[], int], timeout: float) -> T:
    """``task``'s result, or ``TimeoutError`` (``task`` cancelled) once ``progress()`` has stood
    still for ``timeout`` seconds."""
    seen = 0
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if done:
                return task.result()
            if progress() == seen:
                raise TimeoutError(f"nothing received for {timeout} s")
            seen = progress()
    finally:
        task.cancel()


async def next_chunk(body: Any, size: int) -> bytes:
    """The next ``size`` bytes of an aiohttp-style body; ``EOFError`` at its end."""
    chunk: bytes = await body.read(size)
    if not chunk:
        raise EOFError
    return chunk
