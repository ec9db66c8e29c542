"""Whether caching a chunked source's samples pays, judged on the first batches a process makes.

A sample of a tar, parquet or Zarr source is a slice of a chunk that one request brings with
thousands of others. Making it again can cost less than the cache: on this project's machine
a 200-byte parquet event cost about 10 µs to make again from its row group, against 40-60 µs to
store in the cache and 15-20 µs to read back, so a cached cold epoch ran at 0.2x and warm
epochs at 0.75x the uncached rate.

So for such a source :class:`Worth` times the first batches a process makes through the cache
(making the samples, storing them, then reading them back once) and, when the cache would not
pay for its writes within ``PAYBACK_EPOCHS`` later epochs, stops using it for that dataset in that
process: its samples are made from their chunks on every read, neither looked up nor stored.
The figures are logged once and counted (:class:`fastload.stats.CacheStats`), and the loader's
report says so. ``Cache(always=True)`` keeps every sample cached (to spare the store its
requests and bytes: the judge weighs time alone). Sources of one object per sample are never
judged: each of their samples is a request of its own.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastload.stats import CacheStats

__all__ = ["PAYBACK_EPOCHS", "Costs", "Worth", "Wrap"]

log = logging.getLogger(__name__)

PAYBACK_EPOCHS = 10
"""A cache that takes longer than this many later epochs to pay for its writes is bypassed."""
Make = Callable[[list[int]], list[Any]]
"""Makes the samples at some positions of a batch."""
Wrap = Callable[[Make], Make]
JUDGED_BATCHES = 8  # batches that made samples, timed before the judgement...
JUDGED_SAMPLES = 256  # ...holding at least this many made samples between them


@dataclass(frozen=True)
class Costs:
    """CPU time per sample, in microseconds: making one again from its chunk (its share of the
    chunk's request and load, then its slice, decode and transform), storing it in the cache
    (looking it up, locking, encoding, writing) and reading it back."""

    make_us: float
    write_us: float
    read_us: float

    def pays(self, payback_epochs: float = PAYBACK_EPOCHS) -> bool:
        """Whether the cache pays for its writes within ``payback_epochs`` later epochs: each
        later epoch saves ``make_us - read_us`` a sample, the first costs ``write_us`` more."""
        saved = self.make_us - self.read_us
        return saved > 0 and self.write_us <= saved * payback_epochs

    def __str__(self) -> str:
        return (
            f"making a sample again from its chunk costs {self.make_us:.1f} µs, the cache "
            f"{self.write_us:.1f} µs to store it and {self.read_us:.1f} µs to read it back"
        )


@dataclass
class _Batch:
    """One judged batch: samples made, seconds making them, the cache's seconds around that,
    samples read back and seconds reading them, and the chunks the made samples came from."""

    made: int
    make_s: float
    cache_s: float
    read: int
    read_s: float
    chunks: np.ndarray


class Worth:
    """The judge of one dataset's cache in one process (see the module docstring).

    ``blocks``: the first sample of each chunk (None: samples are objects of their own, never
    judged); ``length``: the samples there are; ``counters``: the cache's counters of this
    dataset, where a bypass is counted.
    ``judge=False``: never judge (the cache is forced, read only, or there is no cache);
    ``root`` names the dataset in the log; ``bypassing`` is called when the cache is bypassed
    (the source then keeps its chunks as without a cache).
    """

    def __init__(
        self,
        root: str,
        blocks: np.ndarray | None,
        length: int,
        counters: CacheStats,
        *,
        judge: bool,
        bypassing: Callable[[], None],
    ) -> None:
        self._root, self._blocks, self._bypassing = root, blocks, bypassing
        self._sizes = None if blocks is None else np.diff(blocks, append=length)
        self._counters = counters
        self.bypassed = False
        """Whether the cache is bypassed (decided once, then kept for this process)."""
        self.costs: Costs | None = None
        """The figures judged (None until judged)."""
        self._open = judge and blocks is not None and len(blocks) > 0
        self._deferred_in: int | None = None  # the process that left judging to its workers
        self._batches: list[_Batch] = []
        self._lock, self._pid = threading.Lock(), os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A DataLoader worker's copy judges on its own batches (its parent's decision kept)."""
        self.__dict__.update(state, _lock=threading.Lock(), _pid=os.getpid(), _batches=[])

    @property
    def judging(self) -> bool:
        if self._deferred_in not in (None, os.getpid()):  # a DataLoader worker's copy judges
            self._open, self._deferred_in = True, None
        return self._open

    def defer(self) -> None:
        """Leave the judgement to this process's DataLoader workers, which fill the cache (this
        process reads their batches back from it): what it makes itself, the first batches
        while they start, it caches. Their copies judge, forked or unpickled."""
        if self._open:
            self._open, self._deferred_in = False, os.getpid()

    def force(self) -> None:
        """Cache from now on, judged or not (an explicit fill: ``warm``)."""
        self._open = self.bypassed = False

    def timed(
        self,
        indices: Sequence[int],
        run: Callable[[Wrap], list[Any]],
        read_back: Callable[[Sequence[int]], None],
    ) -> list[Any]:
        """``run(wrap)``: the cache's read of the batch at ``indices`` (naming its samples,
        looking them up, making the missing ones with the function ``wrap`` is given, storing
        them), timed, and the making apart; when it made samples, ``read_back(indices)`` is
        timed too (naming them and reading them from the cache, as a later epoch does). After
        enough batches, the judgement.

        Times are this thread's CPU time: the lookahead's threads make batches at once, and
        their wall times counted each other's turns with the GIL (a 200-byte event's making
        took 130 µs of wall time, 7 µs of CPU). What a sample waits for off the CPU is not
        counted (see :meth:`_costs`): a transform that waits (a sleep, a GPU, a request of its
        own) looks as cheap as its CPU time, and a store so slow that a chunk's request takes
        longer than the loop takes to consume its samples is not seen here (the report then
        names fetching as the cause): ``Cache(always=True)`` keeps such samples cached."""
        spent = [0.0]  # CPU seconds making
        chosen: list[int] = []  # the indices made

        def wrap(make: Make) -> Make:
            def timed_make(positions: list[int]) -> list[Any]:
                started = time.thread_time()
                try:
                    return make(positions)
                finally:
                    spent[0] += time.thread_time() - started
                    chosen.extend(indices[p] for p in positions)

            return timed_make

        started = time.thread_time()
        values = run(wrap)
        total = time.thread_time() - started
        if not chosen or not self._open:
            return values
        started = time.thread_time()
        read_back(indices)
        read_s = time.thread_time() - started
        assert self._blocks is not None
        chunks = np.unique(np.searchsorted(self._blocks, chosen, side="right") - 1)
        batch = _Batch(len(chosen), spent[0], total - spent[0], len(values), read_s, chunks)
        self._add(batch)
        return values

    def _add(self, batch: _Batch) -> None:
        if self._pid != os.getpid():  # a forked child: its own lock and judgement
            self._lock, self._pid, self._batches = threading.Lock(), os.getpid(), []
        with self._lock:
            if not self._open:
                return
            self._batches.append(batch)
            made = sum(b.made for b in self._batches)
            if len(self._batches) < JUDGED_BATCHES or made < JUDGED_SAMPLES:
                return
            self._open = False
            self.costs = self._costs(self._batches)
            self._batches = []
        self._decide(self.costs)

    def _costs(self, batches: list[_Batch]) -> Costs:
        """Medians over the batches; making a sample also bears its share of loading its
        chunk: what the batches spent making beyond the median, spread over every sample of
        the chunks they touched (each is loaded once an epoch). A chunk's request is not
        counted: its wait is off the CPU, and the lookahead's threads wait for several at once
        (at 20 ms a request, a 4,000-event row group's request is 5 µs of wall time a sample,
        which they hide)."""
        assert self._sizes is not None
        each = statistics.median(b.make_s / b.made for b in batches)
        beyond = sum(b.make_s for b in batches) - each * sum(b.made for b in batches)
        touched = np.unique(np.concatenate([b.chunks for b in batches]))
        share = max(0.0, beyond) / max(1, int(self._sizes[touched].sum()))
        return Costs(
            make_us=(each + share) * 1e6,
            write_us=statistics.median(b.cache_s / b.made for b in batches) * 1e6,
            read_us=statistics.median(b.read_s / max(1, b.read) for b in batches) * 1e6,
        )

    def _decide(self, costs: Costs) -> None:
        if costs.pays():
            log.debug("the cache pays for itself: %s", costs)
            return
        self.bypassed = True
        self._bypassing()
        counters = self._counters
        counters.bypass_judged += 1
        counters.bypass_make_us += costs.make_us
        counters.bypass_write_us += costs.write_us
        counters.bypass_read_us += costs.read_us
        log.warning(
            "%s: the cache is bypassed for this dataset in this process: %s, so it would not pay "
            "for its writes within %d later epochs; samples are made from their chunks on every "
            "read from now on (Cache(always=True) keeps caching them)",
            self._root,
            costs,
            PAYBACK_EPOCHS,
        )
