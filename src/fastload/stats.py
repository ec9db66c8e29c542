"""Counters and latency histograms shared by the stages (fetch, cache, loaders).

A :class:`Histogram` has fixed logarithmic buckets (about 9% wide), so it costs O(1) memory
however many requests it sees and merges across workers by adding counts.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

__all__ = [
    "CacheStats",
    "DatasetStats",
    "FetchStats",
    "Histogram",
    "StageCounters",
    "StepStats",
    "merge_counters",
    "thread_times",
]

_MAX_KEYS = 100  # skipped keys kept per process
_SCHEDSTAT = "/proc/thread-self/schedstat"  # Linux: ns on a CPU, ns waiting for one, slices
QUEUE_KNOWN = os.path.exists(_SCHEDSTAT)
"""Whether :func:`thread_times` can tell waiting for a CPU from waiting on a disk."""


def thread_times() -> tuple[float, float]:
    """Seconds the calling thread has run on a CPU and waited, ready, for one. Where the
    kernel does not say (not Linux), the second is 0 and the first is ``time.thread_time``.

    Beside wall time this tells where a stretch of work went: on a CPU, queued for one (the
    cores busy with other threads and processes) or neither (blocked: a disk, the GIL, a lock).
    """
    if QUEUE_KNOWN:
        try:
            running, queued, _ = os.pread(_schedstat(), 128, 0).split()
            return int(running) / 1e9, int(queued) / 1e9
        except (OSError, ValueError):  # a sandbox that hides /proc: never fail a write for it
            pass
    return time.thread_time(), 0.0


class _Schedstat:
    """A thread's schedstat file, open while the thread (in this process) lives."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.fd = os.open(_SCHEDSTAT, os.O_RDONLY | os.O_CLOEXEC)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


_OWN = threading.local()


def _schedstat() -> int:
    """The calling thread's schedstat file, kept open by the thread (a read from its start
    says what is true now): 0.8 µs a look against 10 µs to open it each time, which was a
    quarter of a small ``Cache.put``. A forked child opens its own (the file names a thread)."""
    held: _Schedstat | None = getattr(_OWN, "held", None)
    if held is None or held.pid != os.getpid():
        held = _OWN.held = _Schedstat()
    return held.fd


_PER_OCTAVE = 8
_MIN_SECONDS = 1e-6
_BUCKETS = 40 * _PER_OCTAVE  # 1 µs .. ~12 days


class Histogram:
    """Durations in seconds, bucketed logarithmically; percentiles accurate to one bucket."""

    def __init__(self) -> None:
        self.counts = np.zeros(_BUCKETS, dtype=np.int64)
        self.total = 0.0

    def add(self, seconds: float) -> None:
        ratio = max(seconds, _MIN_SECONDS) / _MIN_SECONDS
        bucket = min(int(math.log2(ratio) * _PER_OCTAVE), _BUCKETS - 1)
        self.counts[bucket] += 1
        self.total += seconds

    def merge(self, other: Histogram) -> None:
        self.counts += other.counts
        self.total += other.total

    def copy(self) -> Histogram:
        out = Histogram()
        out.counts = self.counts.copy()
        out.total = self.total
        return out

    def minus(self, earlier: Histogram) -> Histogram:
        """What was added since ``earlier`` (a copy of this histogram taken before)."""
        out = Histogram()
        out.counts = self.counts - earlier.counts
        out.total = self.total - earlier.total
        return out

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def percentile(self, q: float) -> float:
        """Upper edge of the bucket holding the ``q``-th percentile (0 when empty)."""
        n = self.count
        if n == 0:
            return 0.0
        rank = max(1, math.ceil(q / 100.0 * n))
        bucket = int(np.searchsorted(np.cumsum(self.counts), rank))
        return float(_MIN_SECONDS * 2 ** ((bucket + 1) / _PER_OCTAVE))


# fields that are levels, not counts: a window or a drain gives their value as it is, and
# merging another process's keeps the latest it reported ("latest") or the most ("peak")
_LATEST = {"level": "latest"}
_PEAK = {"level": "peak"}


@dataclass
class FetchStats:
    """What :class:`fastload.fetcher.Fetcher` did: every attempt, retry, hedge and byte."""

    requests: int = 0  # attempts sent, including retries and hedges
    objects: int = 0  # requests answered in full
    failures: int = 0  # requests given up (after retries, or not retryable)
    retries: int = 0
    outage_retries: int = 0  # retries beyond ``retries`` while the store answered nothing
    quarantined: int = 0  # objects given up while the store answered others (see FetchConfig)
    hedges: int = 0  # duplicate requests sent for the slow tail
    hedge_wins: int = 0  # hedges that answered first
    # requests allowed in flight now and the most so far, per process (FetchConfig.adaptive
    # tunes each process's; merged: the latest a process reported, and the most), throttling
    # answers (503 SlowDown, 429) and the cuts of the limit they made
    limit: int = field(default=0, metadata=_LATEST)
    limit_peak: int = field(default=0, metadata=_PEAK)
    throttled: int = 0
    limit_cuts: int = 0
    # shard chunks read again after memory dropped them before they served a quarter of their
    # samples: an order that is not by chunk (see fastload.sources._chunks)
    chunks_read_early: int = 0
    bytes: int = 0
    latency: Histogram = field(default_factory=Histogram)

    def snapshot(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name != "latency"
        }
        out["latency_p50_ms"] = self.latency.percentile(50) * 1e3
        out["latency_p99_ms"] = self.latency.percentile(99) * 1e3
        out["latency_mean_ms"] = (
            self.latency.total / self.latency.count * 1e3 if self.latency.count else 0.0
        )
        return out


@dataclass
class CacheStats:
    """What one process's :class:`fastload.Cache` did (each DataLoader worker counts its own)."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    bytes_written: int = 0
    waits: int = 0  # misses another process or thread was already computing
    evictions: int = 0
    repairs: int = 0  # corrupt entries found, deleted and recomputed
    oversize: int = 0  # samples larger than the whole budget, served without caching
    unstored: int = 0  # samples served without caching because the cache's disk was full
    write_s: float = 0.0  # seconds spent writing entries (encoding, appending, index records)
    write_cpu_s: float = 0.0  # of write_s, on a CPU (see thread_times)
    write_queued_s: float = 0.0  # of write_s, ready to run but waiting for a CPU
    # samples made from their chunks and served past the cache (neither looked up nor stored):
    # re-reading them costs less than the cache (fastload.cache._worth)
    bypassed: int = 0
    bypass_judged: int = 0  # processes that chose to bypass the cache (each worker judges alone)
    bypass_make_us: float = 0.0  # what they measured, summed over them: µs to make a sample,
    bypass_write_us: float = 0.0  # to store one in the cache,
    bypass_read_us: float = 0.0  # and to read it back

    def snapshot(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass
class DatasetStats:
    """What one process's :class:`fastload.RemoteDataset` did."""

    samples: int = 0
    skipped: int = 0  # failed samples replaced under on_error="skip"
    skipped_keys: list[str] = field(default_factory=list)
    refreshed: int = 0  # samples read at their objects' new versions (on_change="refresh")
    # shards, samples or groups left out when the dataset was made, under on_error="skip" or
    # incomplete="skip", each with its reason
    left_out: list[str] = field(default_factory=list)
    prepare: Histogram = field(default_factory=Histogram)  # decode + transform, per object
    augment: Histogram = field(default_factory=Histogram)  # augment=, per sample read
    # CachedDataset: the wrapped dataset making a missing sample (its own reads included)
    compute: Histogram = field(default_factory=Histogram)
    # a fastload.DataLoader worker's start: from the loader's iter() to its worker_init_fn
    worker_start: Histogram = field(default_factory=Histogram)

    def snapshot(self) -> dict[str, object]:
        return {
            "samples": self.samples,
            "skipped": self.skipped,
            "skipped_keys": list(self.skipped_keys),
            "refreshed": self.refreshed,
            "left_out": list(self.left_out),
            "prepare_p50_ms": self.prepare.percentile(50) * 1e3,
            "prepare_p99_ms": self.prepare.percentile(99) * 1e3,
            "prepare_total_s": self.prepare.total,
            "augment_p50_ms": self.augment.percentile(50) * 1e3,
            "augment_total_s": self.augment.total,
            "compute_p50_ms": self.compute.percentile(50) * 1e3,
            "compute_total_s": self.compute.total,
            "workers_started": self.worker_start.count,
            "worker_start_mean_s": self.worker_start.total / max(self.worker_start.count, 1),
        }


_STAGES = ("dataset", "fetch", "cache")


@dataclass
class StageCounters:
    """The dataset, fetch and cache counters of one process, as one mergeable value.

    A dataset's ``counters`` attribute is a view on its live counters; DataLoader workers
    send :meth:`drain`-ed copies with each batch and the main process :meth:`merge`-s them.
    """

    dataset: DatasetStats = field(default_factory=DatasetStats)
    fetch: FetchStats = field(default_factory=FetchStats)
    cache: CacheStats = field(default_factory=CacheStats)

    def merge(self, other: StageCounters) -> None:
        for name in _STAGES:
            merge_counters(getattr(self, name), getattr(other, name))

    def drain(self) -> StageCounters:
        """What was counted since the last drain (everything, the first time).

        The live counters are never reset: a count another thread adds while this runs (a
        DataLoader worker's lookahead fetches while its batch is collated) lands in the next
        drain. Copying and then zeroing them lost such counts.
        """
        now = StageCounters(*(_copied(getattr(self, n)) for n in _STAGES))
        taken = now.since(self.__dict__.get("_drained") or StageCounters())
        self.__dict__["_drained"] = now
        return taken

    @property
    def empty(self) -> bool:
        """Whether nothing was counted (a drain of a worker's warm batch left unlooked)."""
        return not any(_counted(getattr(self, name)) for name in _STAGES)

    def since(self, earlier: StageCounters) -> StageCounters:
        """What was counted since ``earlier`` (a copy of these counters taken before), with
        the levels (``FetchStats.limit``, ``limit_peak``) as they are now."""
        out = StageCounters()
        for name in _STAGES:
            _minus(getattr(out, name), getattr(self, name), getattr(earlier, name))
        return out

    def restart(self) -> None:
        """Counting starts here, in a process of its own (a DataLoader worker, whose dataset
        copy carries its parent's counters): nothing counted so far is sent by :meth:`drain`,
        and the levels are this process's, none yet."""
        for name in _STAGES:
            stats = getattr(self, name)
            for f in fields(stats):
                if f.metadata.get("level"):
                    setattr(stats, f.name, 0)
        self.drain()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {
            "dataset": self.dataset.snapshot(),
            "fetch": self.fetch.snapshot(),
            "cache": self.cache.snapshot(),
        }


def merge_counters(into: Any, other: Any) -> None:
    """Add the counter dataclass ``other`` into ``into`` field by field."""
    for f in fields(into):
        mine, theirs = getattr(into, f.name), getattr(other, f.name)
        level = f.metadata.get("level")
        if isinstance(mine, Histogram):
            mine.merge(theirs)
        elif isinstance(mine, list):
            mine.extend(k for k in theirs if k not in mine)
            del mine[_MAX_KEYS:]
        elif level == "latest":
            setattr(into, f.name, theirs or mine)  # 0: that process has none yet
        elif level == "peak":
            setattr(into, f.name, max(mine, theirs))
        else:
            setattr(into, f.name, mine + theirs)


def _copied(stats: Any) -> Any:
    """A copy of the counter dataclass ``stats`` (a third of ``copy.deepcopy``'s cost: a
    DataLoader worker drains its counters with every batch)."""
    out = type(stats)()
    for f in fields(stats):
        value = getattr(stats, f.name)
        if isinstance(value, Histogram):
            value = value.copy()
        elif isinstance(value, list):
            value = list(value)
        setattr(out, f.name, value)
    return out


def _counted(stats: Any) -> bool:
    for f in fields(stats):
        value = getattr(stats, f.name)
        if value.count if isinstance(value, Histogram) else value:
            return True
    return False


def _minus(into: Any, now: Any, earlier: Any) -> None:
    for f in fields(into):
        new, old = getattr(now, f.name), getattr(earlier, f.name)
        if f.metadata.get("level"):
            setattr(into, f.name, new)
        elif isinstance(new, Histogram):
            setattr(into, f.name, new.minus(old))
        elif isinstance(new, list):
            setattr(into, f.name, [k for k in new if k not in old])
        else:
            setattr(into, f.name, new - old)


@dataclass
class StepStats:
    """How a training loop spent its time: waiting for batches vs working between them.

    ``wait`` holds the time each ``next()`` blocked; ``step`` the time from handing a batch
    out to the next request (the training step). The wait for the first batch of each pass is
    kept apart (``first_batch_s``, summed over ``passes``): it holds worker start-up and the
    first fetches, so it is reported on its own, and counted in :attr:`wait_share`.
    """

    steps: int = 0
    samples: int = 0
    passes: int = 0
    first_batch_s: float = 0.0
    wait: Histogram = field(default_factory=Histogram)
    step: Histogram = field(default_factory=Histogram)

    @property
    def elapsed_s(self) -> float:
        """The loop's time: every wait (first batches included) and every step."""
        return self.first_batch_s + self.wait.total + self.step.total

    @property
    def wait_share(self) -> float:
        """Share of the loop's time spent waiting for data, first batches included."""
        elapsed = self.elapsed_s
        return (self.first_batch_s + self.wait.total) / elapsed if elapsed > 0 else 0.0

    @property
    def steady_wait_share(self) -> float:
        """The same without the first batches: the steady state."""
        busy = self.wait.total + self.step.total
        return self.wait.total / busy if busy > 0 else 0.0
