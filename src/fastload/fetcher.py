"""Read many objects (or byte ranges) at once: bounded concurrency, retries, hedging, counters.

Async filesystems (s3fs, gcsfs) are driven on fsspec's IO loop; blocking ones (b2://, file://,
memory://) run on a thread pool of the same width. Every failure is classified once
(:func:`fastload.stores.classify`): transient ones are retried with full-jitter exponential
backoff, the rest, and those that outlast the retries, are raised as fastload errors naming the
object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec.asyn
from fsspec import AbstractFileSystem

from fastload.config import FetchConfig
from fastload.errors import ConfigError, ObjectChangedError, TransientStoreError
from fastload.resources import PerProcess
from fastload.stats import FetchStats
from fastload.stores import StoreURL, _fast, _reads, fast_reader, filesystem, parse_url, translate
from fastload.stores._reads import Body, Patience
from fastload.stores._retry import retrying

__all__ = ["Fetcher", "Request", "fetch"]

log = logging.getLogger(__name__)
_OUTAGE_LOG_EVERY = 10.0  # seconds between warnings while the store answers nothing
# stalls (a whole timeout each) after which an object beside a working store is given up; at 2,
# R1's 1% of random stalls quarantined about one read in 10,000
_STALLS = 3


@dataclass(frozen=True)
class Request:
    """One object, or the byte range ``[start, end)`` of it.

    ``size``, when known (e.g. from a Manifest), is the whole object's size: a body shorter than
    expected is then treated as truncated and retried. ``version``, when known, is the version
    the manifest recorded: bytes of any other version raise :class:`ObjectChangedError`.
    """

    url: str
    start: int | None = None
    end: int | None = None
    size: int | None = None
    version: str | None = None

    def expected_length(self) -> int | None:
        if self.size is None:
            return None
        start = self.start or 0
        end = self.size if self.end is None else min(self.end, self.size)
        return max(0, end - start)


@dataclass(frozen=True)
class _Target:
    fs: AbstractFileSystem
    path: str  # the filesystem's path
    url: str  # for messages
    fast: Any  # an obstore store, or None
    key: str  # the object key within the bucket (for the fast path)


# Blocking stores (b2://, file://) run on threads shared by every Fetcher in the process, so
# their clients' per-thread connections live as long as the process instead of leaking with
# short-lived threads.
_pools: PerProcess[int, ThreadPoolExecutor] = PerProcess("fetch pools")


def _as_request(item: str | Request) -> Request:
    if isinstance(item, Request):
        return item
    if isinstance(item, str):
        return Request(item)
    raise ConfigError(f"fetch expects URLs or fastload.Request, got {item!r}")


class Fetcher:
    """Concurrent, retrying reads through the per-process filesystems of :mod:`fastload.stores`.

    ``config`` defaults to :meth:`FetchConfig.from_env` (``FASTLOAD_FETCH_*``), as everywhere.

    One Fetcher may be shared by threads; its :attr:`counters` add up everything it did
    (:meth:`stats`: a snapshot).
    """

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        config: FetchConfig | None = None,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        self.config = config or FetchConfig.from_env()
        self.counters = FetchStats()
        self._last_ok = 0.0  # when an attempt last succeeded (time.monotonic)
        self._transient_failures = 0  # of every request so far
        self._outage_logged = 0.0
        self._quarantined: dict[str, float] = {}  # url -> when it may be tried again

    def stats(self) -> dict[str, float | int]:
        """A snapshot of :attr:`counters`, with latency percentiles."""
        return self.counters.snapshot()

    def fetch(
        self, items: Sequence[str | Request], *, return_exceptions: bool = False
    ) -> list[Any]:
        """The bodies of ``items`` in order.

        With ``return_exceptions=True`` a failed item's slot holds its :class:`StoreError`
        instead of raising the first failure.
        """
        requests = [_as_request(item) for item in items]
        if not requests:
            return []
        clients: dict[tuple[str, str], tuple[AbstractFileSystem, Any]] = {}
        targets = [self._target(r, clients) for r in requests]
        loop = fsspec.asyn.get_loop()  # the IO loop s3fs and gcsfs run on by default
        results: list[Any] = fsspec.asyn.sync(loop, self._run, requests, targets, return_exceptions)
        return results

    def _target(
        self, request: Request, clients: dict[tuple[str, str], tuple[AbstractFileSystem, Any]]
    ) -> _Target:
        """Where ``request`` goes; ``clients`` memoizes the lookups per (scheme, bucket)."""
        parsed: StoreURL = parse_url(request.url)
        where = (parsed.scheme, parsed.bucket)
        if where not in clients:
            fast = fast_reader(parsed, self.storage_options) if self.config.fast_path else None
            clients[where] = (filesystem(parsed, self.storage_options), fast)
        fs, fast = clients[where]
        if (request.start or 0) < 0 or (request.end or 0) < 0:
            fast = None  # suffix ranges need the object's size: the fsspec path knows how
        elif not _fast.readable(parsed.key):
            fast = None  # a key obstore would rewrite (a//b, ./x): the s3fs path reads it as is
        return _Target(fs, fs._strip_protocol(str(parsed)), request.url, fast, parsed.key)

    def _executor(self) -> ThreadPoolExecutor:
        width = self.config.concurrency
        return _pools.get(width, lambda: ThreadPoolExecutor(width, "fastload-fetch"))

    async def _run(
        self,
        requests: list[Request],
        targets: list[_Target],
        return_exceptions: bool,
    ) -> list[Any]:
        gate = asyncio.Semaphore(self.config.concurrency)

        async def bounded(request: Request, target: _Target) -> bytes:
            async with gate:
                return await self._fetch_one(request, target)

        tasks = [
            asyncio.ensure_future(bounded(r, t)) for r, t in zip(requests, targets, strict=True)
        ]
        try:
            return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
        finally:
            for task in tasks:
                task.cancel()

    async def _fetch_one(self, request: Request, target: _Target) -> bytes:
        url = target.url
        if self._in_quarantine(url):
            self.counters.failures += 1
            raise TransientStoreError(
                "quarantined: it kept failing while the store answered other requests "
                "(tried again later)",
                url=url,
            )
        try:
            data = await retrying(
                lambda: self._hedged(lambda: self._attempt(request, target)),
                give_up=self._patience(url),
                backoff=self.config.backoff,
                max_backoff=self.config.max_backoff,
                on_retry=lambda exc: log.debug("retrying %s after %r", url, exc),
            )
        except Exception as exc:  # translated here, at the one boundary
            self.counters.failures += 1
            error = translate(exc, url)
            if url in self._quarantined and isinstance(error, TransientStoreError):
                error = TransientStoreError(
                    f"quarantined for {self.config.quarantine:g} s: it kept failing while the "
                    f"store answered other requests ({error})",
                    url=url,
                )
            raise error from exc
        self.counters.objects += 1
        self.counters.bytes += len(data)
        return data

    def _in_quarantine(self, url: str) -> bool:
        until = self._quarantined.get(url)
        if until is not None and time.monotonic() >= until:
            del self._quarantined[url]
            return False
        return until is not None

    def _patience(self, url: str) -> Callable[[int, BaseException], bool]:
        """When to give up on ``url``: after ``retries`` if the store answers others meanwhile
        (the object is failing: quarantine it), or after its third stall (each cost a whole
        ``timeout``), else when the outage outlasts its budget.

        The store answers others if a request succeeded since this one's previous failure, or
        since its first one while no other request failed (a broken object beside a healthy
        store whose other reads are done). A store that never answered this Fetcher is not
        waited for: a wrong endpoint or a store down at the start fails after ``retries``.
        """
        config = self.config
        started = previous = time.monotonic()
        mark = self._transient_failures
        stalls = 0

        def give_up(failures: int, error: BaseException) -> bool:
            nonlocal previous, stalls
            now, since = time.monotonic(), previous
            previous = now
            self._transient_failures += 1
            stalls += isinstance(error.__cause__, TimeoutError)
            others_failed = self._transient_failures - mark > failures
            answering = self._last_ok > since or (self._last_ok > started and not others_failed)
            if failures <= config.retries and not (stalls >= _STALLS and answering):
                self.counters.retries += 1
                return False
            if answering:
                self._quarantined[url] = now + config.quarantine
                self.counters.quarantined += 1
                return True
            if not self._last_ok or now - started >= config.outage_budget:
                return True
            self.counters.retries += 1
            self.counters.outage_retries += 1
            if now - self._outage_logged >= _OUTAGE_LOG_EVERY:
                self._outage_logged = now
                log.warning(
                    "the store has answered no request for %.0f s; retrying %s (and others) "
                    "for up to %g s (FetchConfig.outage_budget)",
                    now - started,
                    url,
                    config.outage_budget,
                )
            return False

        return give_up

    async def _hedged(self, call: Callable[[], Awaitable[bytes]]) -> bytes:
        if self.config.hedge_after is None:
            return await call()
        first: asyncio.Future[bytes] = asyncio.ensure_future(call())
        finished, _ = await asyncio.wait({first}, timeout=self.config.hedge_after)
        if finished:
            return first.result()
        self.counters.hedges += 1
        second: asyncio.Future[bytes] = asyncio.ensure_future(call())
        pending: set[asyncio.Future[bytes]] = {first, second}
        error: BaseException | None = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    if future.exception() is None:
                        self.counters.hedge_wins += future is second
                        return future.result()
                    error = future.exception()
        finally:
            for future in pending:
                future.cancel()
        assert error is not None
        raise error

    def _call(self, request: Request, target: _Target) -> Awaitable[Body]:
        start, end = request.start, request.end
        patience = Patience(self.config.timeout, request.expected_length())
        if target.fast is not None:
            return _fast.read(target.fast, target.key, (start, end), patience)
        executor = self._executor()
        return _reads.read(
            target.fs,
            target.path,
            (start, end),
            version=request.version,
            executor=executor,
            patience=patience,
        )

    async def _attempt(self, request: Request, target: _Target) -> bytes:
        start, end = request.start, request.end
        if start is not None and end is not None and 0 <= end <= start:
            return b""  # stores disagree on empty ranges; the answer is known
        self.counters.requests += 1
        started = time.perf_counter()
        url = target.url
        try:
            body = await self._call(request, target)
        except TimeoutError as exc:
            message = f"nothing received for {self.config.timeout:g} s"
            raise TransientStoreError(message, url=url) from exc
        if request.version and body.served and request.version not in body.served:
            raise ObjectChangedError(
                f"changed since the manifest was built (indexed version {request.version!r}, "
                f"the store now serves {body.served[0]!r})",
                url=url,
            )
        expected = request.expected_length()
        if expected is not None and len(body.data) != expected:
            raise TransientStoreError(
                f"truncated body ({len(body.data)} of {expected} bytes)", url=url
            )
        self.counters.latency.add(time.perf_counter() - started)
        self._last_ok = time.monotonic()
        return body.data


def fetch(
    items: Sequence[str | Request],
    *,
    storage_options: Mapping[str, Any] | None = None,
    config: FetchConfig | None = None,
    return_exceptions: bool = False,
) -> list[Any]:
    """Read ``items`` concurrently (see :class:`Fetcher`); bodies in the order given."""
    return Fetcher(storage_options, config).fetch(items, return_exceptions=return_exceptions)
