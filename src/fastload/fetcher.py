"""Read many objects (or byte ranges) at once: bounded concurrency, retries, hedging, counters.

The requests in flight are bounded per Fetcher and process, across every ``fetch()`` call,
by a limit tuned to what the store answers (:mod:`fastload._inflight`).

Reads go to each URL's :class:`~fastload.stores.Store` (:func:`fastload.stores.open_store`),
driven on fsspec's IO loop (the one s3fs and gcsfs run on); this module does not know which
backend serves them. A store raises fastload's errors only, naming the object: transient ones
(:class:`~fastload.errors.TransientStoreError`) are retried with full-jitter exponential
backoff, the rest, and those that outlast the retries, are raised as they are.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec.asyn

from fastload._inflight import InFlight
from fastload.config import FetchConfig
from fastload.errors import ConfigError, FastloadError, ObjectChangedError, TransientStoreError
from fastload.stats import FetchStats
from fastload.stores import (
    ByteRange,
    Span,
    Store,
    StoreURL,
    Suffix,
    open_store,
    parse_url,
    storage_options_of,
)
from fastload.stores._base import Patience, http_range
from fastload.stores._errors import throttling
from fastload.stores._retry import retrying
from fastload.stores.s3 import FAST_PATH

__all__ = ["Fetcher", "Request", "fetch"]

log = logging.getLogger(__name__)
_OUTAGE_LOG_EVERY = 10.0  # seconds between warnings while the store answers nothing
# stalls (a whole timeout each) after which an object beside a working store is given up; at 2,
# R1's 1% of random stalls quarantined about one read in 10,000
_STALLS = 3


@dataclass(frozen=True)
class Request:
    """One object, or the byte range ``[start, end)`` of it; a negative ``start`` (with no
    ``end``) asks for the last ``-start`` bytes.

    ``size``, when known (e.g. from a Manifest), is the whole object's size: a body shorter than
    expected is then treated as truncated and retried. ``version``, when known, is the version
    the manifest recorded: bytes of any other version raise :class:`ObjectChangedError`.
    """

    url: str
    start: int | None = None
    end: int | None = None
    size: int | None = None
    version: str | None = None

    def __post_init__(self) -> None:
        self.span  # noqa: B018 (checked once, here)

    @functools.cached_property
    def span(self) -> ByteRange:
        """The bytes asked for, as a typed range."""
        start, end = self.start, self.end
        if start is not None and start < 0:
            if end is not None:
                raise ConfigError(f"Request {self.url}: a suffix (start={start}) takes no end")
            return Suffix(-start)
        try:
            return Span(start or 0, end)
        except ConfigError as exc:
            raise ConfigError(f"Request {self.url}: {exc}") from None

    def expected_length(self) -> int | None:
        """The body's length, where the object's size is known."""
        if self.size is None:
            return None
        span = self.span
        if isinstance(span, Suffix):
            return min(span.length, self.size)
        end = self.size if span.end is None else min(span.end, self.size)
        return max(0, end - span.start)

    @functools.cached_property
    def most(self) -> int | None:
        """The most bytes the answer may hold: its length where the size is known, else the
        range's (a range past the object's end comes back shorter); None for a whole object
        of unknown size."""
        expected = self.expected_length()
        if expected is not None:
            return expected
        span = self.span
        if isinstance(span, Suffix):
            return span.length
        return None if span.end is None else span.end - span.start


_Answer = tuple[bytes | memoryview, float | None]  # a body, and its request's seconds


@dataclass(frozen=True)
class _Target:
    store: Store
    url: StoreURL
    span: ByteRange


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
        self.storage_options = storage_options_of(storage_options)
        self.config = config or FetchConfig.from_env()
        self._store_options = _with_deprecated_fast_path(self.storage_options, self.config)
        self.counters = FetchStats()
        self._last_ok = 0.0  # when the latest attempt that succeeded was sent (time.monotonic)
        self._last_ok_target: _Target | None = None  # an object that attempt read bytes of
        self._probe: asyncio.Future[None] | None = None  # see _ask_the_store
        self._transient_failures = 0  # of every request so far
        self._outage_logged = 0.0
        self._quarantined: dict[str, float] = {}  # url -> when it may be tried again
        self._tail = _Tail(self.config)
        self._in_flight: InFlight | None = None  # made on the IO loop, per process
        self._in_flight_pid = 0

    def __getstate__(self) -> dict[str, Any]:
        this_process = {"_probe": None, "_last_ok_target": None, "_in_flight": None}
        return {**self.__dict__, **this_process}

    def stats(self) -> dict[str, float | int]:
        """A snapshot of :attr:`counters`, with latency percentiles."""
        return self.counters.snapshot()

    def fetch(
        self,
        items: Sequence[str | Request],
        *,
        return_exceptions: bool = False,
        buffers: bool = False,
    ) -> list[Any]:
        """The bodies of ``items`` in order, as ``bytes``.

        With ``return_exceptions=True`` a failed item's slot holds its :class:`StoreError`
        instead of raising the first failure. With ``buffers=True`` a body may be a read-only
        ``memoryview`` of the store client's own buffer instead: no copy (a 15 MB body's copy
        cost 6.6 ms of held GIL here).
        """
        if isinstance(items, str | Request):  # a str would be read as one URL per character
            raise ConfigError(f"fetch takes a list of URLs or Requests, got one: pass [{items!r}]")
        requests = [_as_request(item) for item in items]
        if not requests:
            return []
        stores: dict[str, Store] = {}
        targets = [self._target(r, stores) for r in requests]
        loop = fsspec.asyn.get_loop()  # the IO loop s3fs and gcsfs run on by default
        results: list[Any] = fsspec.asyn.sync(loop, self._run, requests, targets, return_exceptions)
        if buffers:
            return results
        return [bytes(r) if isinstance(r, memoryview) else r for r in results]

    def _target(self, request: Request, stores: dict[str, Store]) -> _Target:
        """Where ``request`` goes; ``stores`` memoizes the stores per scheme."""
        parsed = parse_url(request.url)
        if parsed.scheme not in stores:
            stores[parsed.scheme] = open_store(
                parsed, self._store_options, threads=self.config.concurrency
            )
        return _Target(stores[parsed.scheme], parsed, request.span)

    async def _run(
        self,
        requests: list[Request],
        targets: list[_Target],
        return_exceptions: bool,
    ) -> list[Any]:
        gate = self._gate()

        async def bounded(request: Request, target: _Target) -> bytes | memoryview:
            await gate.acquire()
            size = 0
            try:
                data = await self._fetch_one(request, target)
                size = len(data)
                return data
            finally:
                gate.release(size)

        tasks = [
            asyncio.ensure_future(bounded(r, t)) for r, t in zip(requests, targets, strict=True)
        ]
        try:
            return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))
        finally:
            for task in tasks:
                task.cancel()

    def _gate(self) -> InFlight:
        """This process's limit on requests in flight, shared by every ``fetch()``: a forked
        child's requests are not its parent's (whose slots it would never see freed)."""
        pid = os.getpid()
        if self._in_flight is None or self._in_flight_pid != pid:
            self._in_flight, self._in_flight_pid = InFlight(self.config, self.counters), pid
        return self._in_flight

    async def _fetch_one(self, request: Request, target: _Target) -> bytes | memoryview:
        url = request.url
        if self._in_quarantine(url):
            self.counters.failures += 1
            raise TransientStoreError(
                "quarantined: it kept failing while the store answered other requests "
                "(tried again later)",
                url=url,
            )
        try:
            data, took = await retrying(
                lambda: self._hedged(lambda: self._attempt(request, target), request),
                give_up=self._patience(url),
                backoff=self.config.backoff,
                max_backoff=self.config.max_backoff,
                on_retry=lambda exc: log.debug("retrying %s after %r", url, exc),
            )
        except FastloadError as exc:  # the store's own, naming the object
            self.counters.failures += 1
            if url in self._quarantined and isinstance(exc, TransientStoreError):
                raise TransientStoreError(
                    f"quarantined for {self.config.quarantine:g} s: it kept failing while the "
                    f"store answered other requests ({exc})",
                    url=url,
                ) from exc
            raise
        if took is not None:  # the answer's own time (a losing hedge's is not counted)
            self.counters.latency.add(took)
            self._tail.observe(len(data), took)
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

        The store answers others if a request sent after this one first failed succeeded
        while no other request failed (a broken object beside a healthy store). Other requests
        failing too is an outage, whatever succeeded meanwhile; so are successes of requests
        sent before the failure (at an outage's onset those still succeed, and counting them
        quarantined a lone straggler the outage failed). When nothing else is read meanwhile,
        the store is asked (:meth:`_ask_the_store`). A store that never answered this Fetcher
        is not waited for: a wrong endpoint or a store down at the start fails after
        ``retries``.
        """
        config = self.config
        started = time.monotonic()
        mark = self._transient_failures
        stalls = 0
        failed_at = 0.0

        def give_up(failures: int, error: BaseException) -> bool:
            nonlocal stalls, failed_at
            now = time.monotonic()
            failed_at = failed_at or now
            self._transient_failures += 1
            if self._in_flight is not None and throttling(error):
                self._in_flight.throttled()
            stalls += isinstance(error.__cause__, TimeoutError)
            others_failed = self._transient_failures - mark > failures
            answering = self._last_ok > failed_at and not others_failed
            if not answering and not others_failed:
                self._ask_the_store()
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

    def _ask_the_store(self) -> None:
        """Read one byte of an object the store served before (one such read at a time), for
        the patience of a failing object when nothing else is read: its success is a request
        answered after the failure; its failure counts as another request failing. Counted in
        ``requests``, not in ``latency`` (which is per object read)."""
        last = self._last_ok_target
        if self._probe is not None or last is None:
            return
        target = _Target(last.store, last.url, Span(0, 1))
        self._probe = asyncio.ensure_future(self._probe_once(target))

    async def _probe_once(self, target: _Target) -> None:
        sent = time.monotonic()
        self.counters.requests += 1
        try:
            await target.store.read(target.url, target.span, None, Patience(self.config.timeout, 1))
        except Exception:  # any failure: no answer
            self._transient_failures += 1
        else:
            self._last_ok = max(self._last_ok, sent)
        finally:
            self._probe = None

    async def _hedged(self, call: Callable[[], Awaitable[_Answer]], request: Request) -> _Answer:
        """``call()``'s answer; if none came within the hedge delay (:class:`_Tail`), the
        first good answer of ``call()`` and a second ``call()`` sent then."""
        if not self._tail.races(request):
            return await call()
        return await _Race(call, self, request).run()

    async def _attempt(self, request: Request, target: _Target) -> _Answer:
        """The body, and how long the request took (None: no request was needed)."""
        if target.span.empty:
            return b"", None  # stores disagree on empty ranges; the answer is known
        self.counters.requests += 1
        sent, started = time.monotonic(), time.perf_counter()
        url = request.url
        patience = Patience(self.config.timeout, request.expected_length())
        body = await target.store.read(target.url, target.span, request.version, patience)
        if request.version and body.served and request.version not in body.served:
            raise ObjectChangedError(
                f"changed since the manifest was built (indexed version {request.version!r}, "
                f"the store now serves {body.served[0]!r})",
                url=url,
            )
        _check_length(request, len(body.data))
        took = time.perf_counter() - started
        self._last_ok = max(self._last_ok, sent)
        if len(body.data):
            self._last_ok_target = target
        return body.data, took


class _Race:
    """One read and, each time ``delay`` passes without an answer, a hedge (while the budget
    allows, up to ``_RACERS`` requests in all): the first good answer wins and the others are
    cancelled; all failing raise the last error. Made of one task a request, one timer and one
    future (``asyncio.wait`` with a timeout cost every read about 60 us of CPU here, a sixth of
    an obstore GET).

    A hedge can land on the slow replica too (2% of GETs held: one hedge in 50), and a hedge
    with no budget left when the delay passes may have one a delay later: each is tried again
    then. A single hedge, and none without a hedge saved up when the read was sent, left 1.5 s
    reads to hold their batch (a cold epoch at 0.33x of one without tails). The last hedges
    saved are kept for a read unanswered at twice its delay (:meth:`_Tail.spend`).

    A timer that runs late by more than half the delay (and ``_RELOOK``) means this process
    did not run meanwhile (a garbage collection of a large heap holds the GIL 0.15 s here, as
    it may in a training process): the answers that came in are not read yet, and every read
    in flight looks late at once. Such a look only looks again ``_RELOOK`` later. Before, a
    collection in a cold epoch hedged the reads in flight, 6-8 at once, each wasted, and the
    held reads after it found no hedge saved: about one cold epoch with tails in five read
    20-55% slower for it."""

    def __init__(self, call: Callable[[], Awaitable[_Answer]], fetcher: Fetcher, request: Request):
        self.call, self.fetcher, self.request = call, fetcher, request
        self.loop = asyncio.get_running_loop()
        self.answer: asyncio.Future[_Answer] = self.loop.create_future()
        self.running: list[asyncio.Task[_Answer]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.started = 0.0

    async def run(self) -> _Answer:
        self.started = self.loop.time()
        self._start()
        self._arm()
        try:
            return await self.answer
        finally:
            assert self.timer is not None
            self.timer.cancel()
            for task in self.running:
                task.cancel()

    def _start(self) -> None:
        task = asyncio.ensure_future(self.call())
        task.add_done_callback(self._settle)
        self.running.append(task)

    def _due(self) -> float:
        """When the next hedge is due: a delay (as the tail says now) per request sent."""
        return self.started + len(self.running) * self.fetcher._tail.current(self.request)

    def _arm(self, wait: float | None = None) -> None:
        """The timer for the next hedge; while the latencies are being learned, it looks
        again every ``_RELOOK`` s (a read sent before the first answers is hedged by what
        they say, not after the prior)."""
        if wait is None:
            wait = max(0.0, self._due() - self.loop.time())
            if not self.fetcher._tail.learned:
                wait = min(wait, _RELOOK)
        self.timer = self.loop.call_later(wait, self._hedge)

    def _hedge(self) -> None:
        if self.answer.done():
            return
        assert self.timer is not None
        now, tail = self.loop.time(), self.fetcher._tail
        if now - self.timer.when() > max(_RELOOK, tail.current(self.request) / 2):
            self._arm(_RELOOK)  # this process was held, not the store (see the docstring)
            return
        due = self._due()
        if now < due:
            self._arm()
            return
        if not tail.spend(late=now >= 2 * due - self.started):
            self._arm(tail.current(self.request))  # none to spend: look again a delay later
            return
        self.fetcher.counters.hedges += 1
        self._start()
        if len(self.running) < _RACERS:
            self._arm()

    def _settle(self, task: asyncio.Task[_Answer]) -> None:
        error = asyncio.CancelledError() if task.cancelled() else task.exception()  # retrieved
        if self.answer.done():
            return
        if error is None:
            self.fetcher.counters.hedge_wins += task is not self.running[0]
            self.answer.set_result(task.result())
        elif all(t.done() for t in self.running):  # no hedge after a failure: retries follow
            assert self.timer is not None
            self.timer.cancel()
            self.answer.set_exception(error)


class _Tail:
    """When to hedge a read: after ``hedge_after`` when set; else after 1.5 times the 90th
    percentile of the last ``_WINDOW`` small reads' latencies (until ``_LEARN`` were timed, a
    conservative ``_PRIOR``: a first batch's 32 reads are sent before any answers), plus the
    read's size at ``_PRIOR_RATE`` (a row group beside footers is given its transfer time), for
    reads of at most ``_SMALL`` bytes only, while the budget lasts: each such read earns
    ``hedge_budget`` of a hedge, up to ``_BURST`` saved (and at the start), of which the last
    ``_RESERVE`` go only to a read unanswered at twice its delay; with none to spend when a
    read's delay passes, it may have one a delay later (:class:`_Race`).

    Real stores have heavy tails (a few % of GETs far above the median; a slow replica makes
    one 10-100x it), and a batch waits for its slowest member: 2% of GETs held 1.5 s cut a
    cold epoch of 50 KB objects to 0.05x. Sending a second request after a few medians puts
    that tail on a fresh draw for a few % more requests.
    """

    def __init__(self, config: FetchConfig) -> None:
        self.fixed, self.budget = config.hedge_after, config.hedge_budget
        self.times: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self.after: float | None = None
        self.tokens = _BURST
        self.since = 0  # reads timed since ``after`` was worked out

    def races(self, request: Request) -> bool:
        """Whether ``request`` is raced (hedged once its delay passes); each raced read earns
        ``hedge_budget`` of a hedge."""
        if self.fixed is not None:
            return True
        most = request.most
        if not self.budget or most is None or most > _SMALL:
            return False
        self.tokens = min(_BURST, self.tokens + self.budget)
        return True

    def current(self, request: Request) -> float:
        """The delay before a hedge of ``request``, as the latencies say now: until they are
        learned, a conservative prior (a first batch's reads are all sent before any
        answers); a read larger than most is given its transfer time."""
        if self.fixed is not None:
            return self.fixed
        return (_PRIOR if self.after is None else self.after) + (request.most or 0) / _PRIOR_RATE

    @property
    def learned(self) -> bool:
        return self.fixed is not None or self.after is not None

    def spend(self, late: bool) -> bool:
        """Whether a hedge may be sent now (a fixed ``hedge_after`` always may): one saved,
        but the last ``_RESERVE`` only for a ``late`` read (unanswered at twice its delay).

        Hedges are earned by reads sent, and a loop waiting for a held read sends none: at an
        epoch's end, or when the reads before it spent the burst (a few slow at once, as on a
        loaded machine), the held read found none saved and waited its whole 1.5 s, which
        doubled a cold epoch of 0.8 s. The reserve is for it: a read that late is held."""
        if self.fixed is not None:
            return True
        if self.tokens < 1 + (0.0 if late else _RESERVE):
            return False
        self.tokens -= 1
        return True

    def observe(self, size: int, seconds: float) -> None:
        if self.fixed is not None or size > _SMALL:
            return
        self.times.append(seconds)
        self.since += 1
        if len(self.times) >= _LEARN and (self.after is None or self.since >= _EVERY):
            ordered = sorted(self.times)
            self.after = max(_FLOOR, 1.5 * ordered[int(0.9 * (len(ordered) - 1))])
            self.since = 0


_SMALL = 8 << 20  # bytes: reads hedged by observed latency are at most this large
_WINDOW = 512  # latest small reads the hedge delay is worked out from
_LEARN = 16  # small reads timed before the delay follows their latencies
# reads between two workings-out of the delay (a sort of up to 512: 18 us, about 1 us a read);
# at 64, the delay from the first 16 answers (at 16 in flight, the fastest) held for 64 more
# while the limit doubled and latencies rose past it: 8-18 hedges of normal reads per cold epoch
# spent the burst, and the held reads after them waited a delay more for a hedge
_EVERY = 16
_BURST = 8.0  # hedges that may be saved up...
_RESERVE = 2.0  # ...of which the last are for reads unanswered at twice their delay
_RACERS = 3  # requests a read may have sent at once: itself and two hedges
_RELOOK = 0.02  # seconds between looks at a read's hedge while the latencies are learned
_FLOOR = 0.002  # seconds: never hedge sooner (a local or in-memory store)
_PRIOR = 0.25  # seconds before a read is hedged while the latencies are learned...
_PRIOR_RATE = 8 << 20  # ...plus its size at this many bytes/s


def _check_length(request: Request, received: int) -> None:
    """A body of the length asked for: exactly it where the object's size is known, else at
    most the range's length (a range that runs past the object's end comes back shorter). A
    server that answers more than was asked (a proxy ignoring ``Range``'s end) is a transient
    error, retried like a truncated body, never bytes of someone else's range."""
    expected, most = request.expected_length(), request.most
    if expected is not None and received < expected:
        raise TransientStoreError(
            f"truncated body ({received} of {expected} bytes)", url=request.url
        )
    if most is not None and received > most:
        raise TransientStoreError(
            f"the store answered {received} bytes for a range of {most} "
            f"({http_range(request.span).get('Range', 'the whole object')})",
            url=request.url,
        )


def _with_deprecated_fast_path(options: dict[str, Any], config: FetchConfig) -> dict[str, Any]:
    """``options`` with the deprecated ``config.fast_path`` as the S3 store's own option,
    where they do not say."""
    if config.fast_path is None or FAST_PATH in options:
        return options
    return {**options, FAST_PATH: config.fast_path}


def fetch(
    items: Sequence[str | Request],
    *,
    storage_options: Mapping[str, Any] | None = None,
    config: FetchConfig | None = None,
    return_exceptions: bool = False,
) -> list[Any]:
    """Read ``items`` concurrently (see :class:`Fetcher`); bodies in the order given."""
    return Fetcher(storage_options, config).fetch(items, return_exceptions=return_exceptions)
