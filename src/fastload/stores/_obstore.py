"""The fast path: obstore (a Rust object-store client) in front of s3fs for the same s3:// URLs.

s3fs/botocore spend about 2 ms of CPU per GET; obstore about a quarter of that, which is what
decides throughput on a small machine (see docs/benchmarks.md); listing a page costs a twentieth
of botocore's CPU per key. It is used only when obstore is installed and the
``storage_options`` say everything it needs (explicit keys or AWS_* variables, a known region or
endpoint); anything else keeps the general s3fs path.
Retries stay in :mod:`fastload.fetcher` (obstore's own are switched off) so every attempt is
counted and backed off the same way on every store.

obstore's async runtime does not survive ``fork``: a child forked after the parent used it
(a DataLoader worker under the default start method) would hang on its first read. Such a child
takes the s3fs path instead; children started by spawn or forkserver keep the fast path.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import importlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from fastload.errors import StoreError
from fastload.resources import PerProcess
from fastload.stores._base import (
    PAGE,
    Body,
    ByteRange,
    EdgedPages,
    Listed,
    PageLister,
    Patience,
    Span,
    Stream,
    progressing,
    read_edge,
)
from fastload.stores._errors import Kind, boundary, classify
from fastload.stores._listing import guards
from fastload.stores.s3 import S3Store

if TYPE_CHECKING:
    from fastload.stores import StoreURL

log = logging.getLogger(__name__)

__all__ = ["ObstoreStore", "readable"]

_OPTIONS = {"key", "secret", "token", "endpoint_url", "client_kwargs", "config_kwargs", "anon"}
_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_CONFIG_KWARGS = {"max_pool_connections", "s3", "connect_timeout", "read_timeout"}

_CONTROL = re.compile("[\x00-\x1f\x7f]")
_stores: PerProcess[tuple[str, str], Any] = PerProcess("obstore clients")
_runtime = {"started": False, "inherited": False, "read": False, "exiting": False}


def _after_fork_in_child() -> None:
    _runtime["inherited"] = _runtime["inherited"] or _runtime["started"]
    _runtime["read"] = False  # the parent's reads, on its runtime's threads
    _unanswered.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)

_unanswered: set[asyncio.Future[Any]] = set()
"""obstore's futures its runtime has not answered yet, in this process."""
_SETTLE_SECONDS = 0.05
_SETTLE_ROUNDS = 4


def _started(call: Callable[[], Awaitable[Any]], url: object) -> asyncio.Future[Any]:
    """``call()``, an obstore call whose runtime answers it from a thread of its own, its
    future known until done (:func:`_drain`); none is started once the process exits (a
    :class:`StoreError` naming ``url``). Cancelling the future (a read given up, a hedge
    that lost) aborts the request."""
    if _runtime["exiting"]:
        raise StoreError("not read: the process is exiting", url=str(url))
    _runtime["read"] = True
    future = asyncio.ensure_future(call())
    if not future.done():
        _unanswered.add(future)
        future.add_done_callback(_unanswered.discard)
    return future


@atexit.register
def _drain() -> None:
    """At exit, where obstore read anything: start no more calls, cancel those unanswered (on
    their loop's thread, which runs on during exit), and let the runtime's threads finish with
    the interpreter's lock, ``_SETTLE_SECONDS`` at a time, until none is unanswered.

    A runtime thread answers a call by taking that lock and waking the loop's thread; one
    that takes it while the interpreter finalizes is ended by it, which aborts the process
    (a training script's exit status 134: about one exit in four after 20 concurrent reads
    here, with every read answered: the loop's thread took the answer and the program ended
    before the answering thread had the lock back from its socket write)."""
    if not _runtime["read"] or threading.current_thread() is not threading.main_thread():
        return
    _runtime["exiting"] = True
    for _ in range(_SETTLE_ROUNDS):
        for future in list(_unanswered):
            with contextlib.suppress(RuntimeError):  # its loop is closed
                future.get_loop().call_soon_threadsafe(future.cancel)
        time.sleep(_SETTLE_SECONDS)
        if not _unanswered:
            return


@functools.cache
def _obstore() -> Any:
    """The obstore module, or None where it is not installed (looked for once: it was four
    imports per GET)."""
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
    endpoint = (  # botocore reads the service's then the global variable, as obstore does
        options.get("endpoint_url")
        or client_kwargs.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
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


def _bucket_store(bucket: str, options: Mapping[str, Any], key: str) -> Any | None:
    """An obstore store for ``s3://bucket`` (cached per process), or None to use s3fs."""
    obstore = _obstore()
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
    return _CONTROL.search(key) is None


class ObstoreStore:
    """obstore where it can serve, ``general`` (s3fs) for the rest: buckets whose options it
    cannot take, suffixes (they need the size), and keys it would rewrite (``a//b``, ``./x``).
    ``general`` is made on first use: reads obstore serves never import s3fs (0.14 s of CPU
    at a process's first fetch here, in every DataLoader worker)."""

    def __init__(
        self, general: Callable[[], S3Store], options: Mapping[str, Any], options_key: str
    ) -> None:
        self._make_general, self.options, self.options_key = general, options, options_key

    @functools.cached_property
    def general(self) -> S3Store:
        return self._make_general()

    def _store(self, bucket: str) -> Any | None:
        return _bucket_store(bucket, self.options, self.options_key)

    async def read(
        self, url: StoreURL, span: ByteRange, version: str | None, patience: Patience
    ) -> Body:
        return await read_edge(url, span, patience, self._read(url, span, version, patience))

    async def _read(
        self, url: StoreURL, span: ByteRange, version: str | None, patience: Patience
    ) -> Body:
        store = self._store(url.bucket)
        if store is None or not isinstance(span, Span) or not readable(url.key):
            return await self.general.read(url, span, version, patience)
        return await self._get(store, url, span, patience)

    async def _get(self, store: Any, url: StoreURL, span: Span, patience: Patience) -> Body:
        """One GET through obstore, in its own terms (:meth:`read` is its edge)."""
        if span.empty:
            return Body(b"")
        options: dict[str, Any] = {}
        if span.end is not None:
            options["range"] = (span.start, span.end)
        elif span.start:
            options["range"] = {"offset": span.start}
        timeout = patience.timeout
        get = _started(lambda: _obstore().get_async(store, url.key, options=options), url)
        data: bytes | memoryview
        if patience.whole:  # obstore's own buffer, not copied (Fetcher.fetch copies if asked)
            result, data = await _whole(get, timeout, url)
        else:
            result = await asyncio.wait_for(get, timeout)
            stream = result.stream(min_chunk_size=patience.chunk)
            chunk = lambda: _started(stream.__anext__, url)  # noqa: E731
            data = b"".join(await progressing(chunk, timeout, StopAsyncIteration))
        etag = result.meta.get("e_tag")
        return Body(data, (str(etag).strip('"'),) if etag else ())

    def find(self, root: StoreURL) -> list[Listed]:
        with boundary(root):  # (s3fs is made here on first use)
            return self.general.find(root)

    def stat(self, url: StoreURL) -> Listed:
        with boundary(url):
            return self.general.stat(url)

    def lister(self, bucket: str) -> PageLister | None:
        with boundary(f"s3://{bucket}"):
            general = self.general.lister(bucket)
            store = self._store(bucket)
        return general if store is None or general is None else _ObstorePages(store, general)


class _ObstorePages(EdgedPages):
    """S3 pages through obstore.

    obstore renames some keys (a ``sub/`` marker comes back as ``sub``) and refuses others
    (``a//b``, ``./c``, control characters): a page holding an empty object, or one obstore
    cannot parse, is asked for again through botocore, which then lists the rest of the range.

    A stream cannot resume after a failure, and resuming "after the last key listed" is safe
    on a server that orders keys as a file tree only when no key lies under a directory that
    key could name (after ``P2`` such a server skips all of ``P2/``): one small listing of each
    such directory (:func:`fastload.stores._listing.guards`) says so. Otherwise botocore lists
    the range again from its start (``start_after``, a point already shown safe), and the keys
    listed twice are kept once, by value.
    """

    def __init__(self, store: Any, general: PageLister) -> None:
        self.store, self.general = store, general

    def url(self, prefix: str) -> str:
        return self.general.url(prefix)

    async def _page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        if not isinstance(token, Stream | None):  # this range went through botocore
            return await self.general.page(prefix, start_after, token, limit)
        if token is not None and token.broken:
            return await self._resumed(prefix, start_after, token.last, limit)
        directory = prefix.rstrip("/") or None
        whole = prefix.endswith("/") or not prefix  # obstore's prefixes are whole path segments
        if not whole or not readable(directory or "x") or not readable(start_after or "x"):
            return await self.general.page(prefix, start_after, None, limit)
        # whole pages always: the stream keeps its chunk size for every page it gives, and a
        # range probed with a small first page would go on 100 keys at a time
        cursor = token or Stream(
            _obstore().list(self.store, directory, offset=start_after, chunk_size=PAGE)
        )
        try:
            rows = await _next_page(cursor.stream, self.url(prefix))
        except Exception as exc:
            if token is None and classify(exc) is Kind.TRANSIENT:
                raise  # a first page is simply asked for again
            # a key obstore cannot parse, or a stream that failed midway (it cannot resume)
            cursor.broken = True
            return await self._resumed(prefix, start_after, cursor.last, limit)
        if rows is None:
            return [], None
        if any(e.size == 0 for e in rows):  # a marker, or a key obstore renamed
            return await self._resumed(prefix, start_after, cursor.last, limit)
        cursor.last = rows[-1].key if rows else cursor.last
        return rows, cursor

    async def _resumed(
        self, prefix: str, start_after: str | None, last: str | None, limit: int
    ) -> tuple[list[Listed], Any]:
        """Botocore's page of the range after ``last`` where that is safe, else from the
        range's start ``start_after``."""
        if last is not None:
            below = sorted(guards(last, prefix))
            pages = await asyncio.gather(*(self.general.page(g, None, None, 1) for g in below))
            if not any(found for found, _ in pages):
                return await self.general.page(prefix, last, None, limit)
        return await self.general.page(prefix, start_after, None, limit)


async def _next_page(stream: Any, url: str) -> list[Listed] | None:
    """The stream's next chunk (of the listing of ``url``), or None at its end."""
    try:
        chunk = await _started(stream.__anext__, url)
    except StopAsyncIteration:
        return None
    return [Listed(m["path"], int(m["size"]), str(m.get("e_tag") or "").strip('"')) for m in chunk]


async def _whole(get: Awaitable[Any], timeout: float, url: object) -> tuple[Any, memoryview]:
    """A GET's result and its whole body, each of the two waits within ``timeout`` seconds
    (``TimeoutError``), under one timer renewed between them: ``asyncio.wait_for`` makes a
    task and a timer for each wait, a tenth of the CPU fastload spends on a small GET."""
    if sys.version_info < (3, 11):
        result = await asyncio.wait_for(get, timeout)
        body = await asyncio.wait_for(_started(result.bytes_async, url), timeout)
        return result, memoryview(body)
    async with asyncio.timeout(timeout) as deadline:
        result = await get
        deadline.reschedule(asyncio.get_running_loop().time() + timeout)
        return result, memoryview(await _started(result.bytes_async, url))
