"""Requests in flight: one limit per Fetcher and process, tuned by what the store answers.

Every ``fetch()`` of a :class:`~fastload.fetcher.Fetcher` runs on fsspec's IO loop, so the
limit lives there (one loop thread: no lock) and is shared by every call, threads included.
With ``FetchConfig.adaptive`` (the default) :class:`_Climb` moves it between 4 and
``FetchConfig.concurrency``:

- it starts at 16 and doubles while throughput (bytes/s over a round of answers) rises by a
  tenth or more;
- then it tries a step of a quarter up or down now and then, and keeps it only where
  throughput rose with it: by a tenth of the step's share for a step up (+2.5% for a quarter),
  by a tenth for a step down. Fewer in flight saves only memory, and a round on a loaded
  2-core machine varies by a tenth or so: a step down kept unless throughput fell by 2.5% (the
  rule until 2026-11-28) was kept on ties, and on a single slow round, and left the limit
  below where it read best. A step undone waits twice as long as the last before the next;
- a throttling answer (503 SlowDown, 429) cuts it to 0.7 of itself at once, at most once per
  round (the answers of requests sent before the cut do not cut again). A store that answers
  503 at random, whatever the load, keeps it near its floor: 5% of answers did so in a test
  (half the rate); a throttling store is told apart from a failing one by nothing else.

A round is at least 16 answers, twice the limit and 50 ms, all while requests waited for the
limit: an answer that frees a slot nobody waits for (the caller asks for fewer, or waits for a
slow read of its own before it asks for more) ends the round unjudged, and the next begins
when a request waits again. So a round measures what the limit lets through, not the caller's
pace: a cold epoch's loop held behind one slow read timed rounds a third slower through that
pause, and such rounds walked the limit down from 32 to 18. Per request this costs a few
counters; a decision, a clock read per round.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from fastload.config import FetchConfig
from fastload.stats import FetchStats

__all__ = ["InFlight"]

log = logging.getLogger("fastload.fetcher")

_START = 16  # requests in flight at first (the ceiling, if lower)
_FLOOR = 4  # throttling and steps down stop here (the ceiling, if lower)
_CUT = 0.7  # a throttling answer leaves this share of the limit
_ROUND = 16  # answers in a round, at least (and twice the limit)...
_ROUND_S = 0.05  # ...and seconds, all while requests wait for the limit
_GAIN = 0.1  # a step up is kept if throughput rose by this share of the step's, a step down
# if it rose by this share
_QUIET = 4  # rounds at a limit before a step, after a cut or a step kept...
_QUIET_MOST = 64  # ...doubling with each step undone, up to this


class InFlight:
    """At most :attr:`limit` requests between :meth:`acquire` and :meth:`release`; waiters
    are served in order. :meth:`throttled` tells it the store asked for fewer."""

    def __init__(self, config: FetchConfig, counters: FetchStats) -> None:
        self.ceiling = config.concurrency
        self.counters = counters
        self.busy = 0
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self.limit = 0
        self.set_limit(min(self.ceiling, _START) if config.adaptive else self.ceiling)
        self.tuner = _Climb(self) if config.adaptive else None

    async def acquire(self) -> None:
        if self.busy < self.limit:  # after _wake, a live waiter means busy >= limit
            self.busy += 1
            return
        if self.tuner is not None:
            self.tuner.waited()
        waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot as it was cancelled
                self._free()
            raise

    def release(self, size: int) -> None:
        """A request is done; ``size``: the bytes it read (0 for a failure)."""
        if self.tuner is not None:
            self.tuner.answered(size)
        self._free()

    def throttled(self) -> None:
        self.counters.throttled += 1
        if self.tuner is not None:
            self.tuner.throttled()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self.counters.limit = limit
        self.counters.limit_peak = max(self.counters.limit_peak, limit)
        self._wake()

    def _free(self) -> None:
        self.busy -= 1
        self._wake()

    def _wake(self) -> None:
        while self.waiting and self.busy < self.limit:
            waiter = self.waiting.popleft()
            if not waiter.done():  # (a cancelled waiter is skipped)
                self.busy += 1
                waiter.set_result(None)


class _Climb:
    """The adaptive limit's hill climb (see the module's docstring)."""

    def __init__(self, gate: InFlight) -> None:
        self.gate = gate
        self.floor = min(gate.ceiling, _FLOOR)
        self.doubling = True  # until a doubling does not pay, or a cut
        self.stepped = False  # the limit is a step from base_limit, not judged yet
        self.up = True  # the next step's way
        self.quiet = 0  # rounds to wait before the next step
        self.patience = _QUIET  # ...after the next step undone
        self.base_limit = gate.limit
        self.base_rate = 0.0  # bytes/s at base_limit (0: not measured)
        self.bound = False  # a request waited for the limit since the last answer none did
        self.cut = False  # a throttling answer cut the limit in this round
        self._new_round(time.perf_counter())

    def _new_round(self, now: float) -> None:
        self.started = now
        self.answers = self.bytes = 0
        self.size = max(_ROUND, 2 * self.gate.limit)

    def waited(self) -> None:
        """A request waits for the limit: the first since the limit stopped binding begins a
        round."""
        if not self.bound:
            self.bound = True
            self._new_round(time.perf_counter())

    def answered(self, size: int) -> None:
        if not self.gate.waiting:  # the slot it frees is nobody's: the round ends unjudged
            self.bound = False
            return
        self.answers += 1
        self.bytes += size
        if self.answers >= self.size:
            self._end_round()

    def throttled(self) -> None:
        self.answers += 1
        if self.cut:  # once per round: these requests were sent before the cut
            if self.answers >= self.size:
                self._end_round()
            return
        gate = self.gate
        limit = max(self.floor, int(gate.limit * _CUT))
        if limit < gate.limit:
            log.debug("requests in flight %d -> %d: the store throttled", gate.limit, limit)
            gate.counters.limit_cuts += 1
            gate.set_limit(limit)
        self.doubling = self.stepped = False
        self.base_limit, self.base_rate = limit, 0.0
        self.up, self.quiet, self.patience = True, _QUIET, _QUIET
        self._new_round(time.perf_counter())
        self.cut = True

    def _end_round(self) -> None:
        now = time.perf_counter()
        seconds = now - self.started
        if seconds < _ROUND_S:
            return
        if not self.cut and self.bytes:
            self._judge(self.bytes / seconds)
        self.cut = False
        self._new_round(now)

    def _judge(self, rate: float) -> None:
        gate = self.gate
        log.debug("%d in flight: %.3g MB/s", gate.limit, rate / 1e6)
        if self.stepped:
            self.stepped = False
            up = gate.limit > self.base_limit
            gain = _GAIN * (gate.limit / self.base_limit - 1) if up else _GAIN
            if rate >= self.base_rate * (1 + gain):
                self.base_limit, self.base_rate = gate.limit, rate
                self.patience = _QUIET
                self._step(up)  # on the same way while it pays
                return
            gate.set_limit(self.base_limit)
            self.doubling = False
            self.up, self.quiet = not up, self.patience
            self.patience = min(_QUIET_MOST, 2 * self.patience)
            return
        if not self.base_rate or gate.limit != self.base_limit:
            self.base_limit, self.base_rate = gate.limit, rate
        else:
            self.base_rate += (rate - self.base_rate) / 2
        if self.quiet:
            self.quiet -= 1
            return
        self._step(self.up)

    def _step(self, up: bool) -> None:
        gate, limit = self.gate, self.gate.limit
        if up:
            target = min(gate.ceiling, 2 * limit if self.doubling else limit + max(1, limit // 4))
        else:
            target = max(self.floor, limit - max(1, limit // 4))
        if target == limit:  # at the ceiling or the floor: try the other way later
            self.doubling = False
            self.up, self.quiet = not up, self.patience
            return
        self.stepped = True
        gate.set_limit(target)
