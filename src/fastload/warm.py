"""Fill a cache ahead of training: fetch, decode, transform and store every sample once.

``warm_cache`` is what ``fastload warm-cache`` runs. It is resumable (what is cached and valid
is a hit and costs no request) and safe to interrupt (entries appear whole or not at all), and
shards split the work between machines or processes so that together they cover each sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np

from fastload.dataset import CachedDataset, RemoteDataset
from fastload.errors import ConfigError
from fastload.sampler import PermutationSampler

__all__ = ["WarmReport", "cache_holds", "warm_cache", "warm_order"]

_LOOK = 4096  # samples looked up in the cache at once, after a warm under a byte budget


@dataclass
class WarmReport:
    """What one warm-up did. ``failures`` maps each failed object's URL to its error;
    ``unstored`` counts samples made but not cached because the cache's disk was full;
    ``left_out`` names the shards, samples or groups the dataset left out when it was made,
    under ``on_error="skip"`` or ``incomplete="skip"``, each with its reason; ``stopped`` says
    why warming stopped before the end (its first samples all failed alike), else None;
    ``evicted`` counts samples warmed (made, or found cached) that the cache no longer holds
    when the warm ends: its byte budget evicted them for later ones, or they were larger than
    the whole budget. Training makes those again."""

    samples: int = 0
    hits: int = 0  # already cached (a rerun skips them)
    unstored: int = 0
    requests: int = 0
    bytes_fetched: int = 0
    seconds: float = 0.0
    failures: dict[str, str] = field(default_factory=dict)
    interrupted: bool = False
    left_out: list[str] = field(default_factory=list)
    stopped: str | None = None
    evicted: int = 0

    def __add__(self, other: WarmReport) -> WarmReport:
        """Both warm-ups' counts, as one (the seconds added: the caller times a whole run)."""
        return WarmReport(
            self.samples + other.samples,
            self.hits + other.hits,
            self.unstored + other.unstored,
            self.requests + other.requests,
            self.bytes_fetched + other.bytes_fetched,
            self.seconds + other.seconds,
            {**self.failures, **other.failures},
            self.interrupted or other.interrupted,
            self.left_out + other.left_out,
            self.stopped or other.stopped,
            self.evicted + other.evicted,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "hits": self.hits,
            "unstored": self.unstored,
            "requests": self.requests,
            "bytes_fetched": self.bytes_fetched,
            "seconds": round(self.seconds, 3),
            "failures": dict(self.failures),
            "interrupted": self.interrupted,
            "left_out": list(self.left_out),
            "stopped": self.stopped,
            "evicted": self.evicted,
        }


def warm_order(
    n: int,
    *,
    shard: tuple[int, int] = (0, 1),
    seed: int | None = None,
    blocks: np.ndarray | None = None,
) -> np.ndarray:
    """Indices for shard ``(i, count)``: every count-th from i, or with ``seed`` this shard's
    epoch-0 order of a :class:`PermutationSampler` (what that rank reads first in training).

    With ``blocks`` (the chunks of a dataset read in shards: the first index of each) the
    shard takes every count-th chunk whole, so each chunk is read by one machine, once.
    """
    index, count = shard
    if count < 1 or not 0 <= index < count:
        raise ConfigError(f"shard must be I/N with 0 <= I < N, got {index}/{count}")
    if blocks is not None:
        ends = np.append(blocks[1:], n)
        ranges = [
            np.arange(a, b) for a, b in zip(blocks[index::count], ends[index::count], strict=True)
        ]
        return np.concatenate(ranges) if ranges else np.zeros(0, dtype=np.int64)
    if seed is None:
        return np.arange(index, n, count, dtype=np.int64)
    order = PermutationSampler(n, seed=seed, rank=index, world_size=count).indices()
    _, first = np.unique(order, return_index=True)  # even shards repeat a few indices
    return order[np.sort(first)]


def warm_cache(
    dataset: RemoteDataset | CachedDataset,
    indices: Sequence[int] | np.ndarray,
    *,
    batch_size: int = 64,
    threads: int = 4,
    on_progress: Callable[[WarmReport], None] | None = None,
    stop_after: int | None = None,
) -> WarmReport:
    """Cache ``dataset[i]`` for each index, ``threads`` batches at a time (a
    :class:`fastload.RemoteDataset` of any sample shape, or a :class:`fastload.CachedDataset`).

    Failures are recorded, not raised. Ctrl-C stops after the batches in flight are stored and
    returns the report with ``interrupted=True``.

    With ``stop_after``, the first ``stop_after`` samples are warmed alone, before any other:
    when every one of them fails, all with one type of error (a decoder that does not fit the
    objects, a transform that raises, a store that refuses every read), nothing more is
    fetched and ``stopped`` says so, naming the first failure: the rest would have failed
    alike, after fetching the whole dataset.

    Under a byte budget (or where the warm evicted entries), the cache is looked up once more at
    the end, for ``evicted``: the samples warmed that it no longer holds.
    """
    if dataset.cache is None:
        raise ConfigError("warm_cache needs a dataset with a cache")
    if batch_size < 1 or threads < 1 or (stop_after is not None and stop_after < 1):
        raise ConfigError(
            "warm_cache needs batch_size, threads and stop_after (when given) >= 1, got "
            f"{batch_size}, {threads}, {stop_after}"
        )
    counters = dataset.counters
    report = WarmReport(left_out=list(counters.dataset.left_out))
    fetch, cache = counters.fetch, counters.cache
    start_requests, start_bytes, start_hits = fetch.requests, fetch.bytes, cache.hits
    start_unstored, start_evictions = cache.unstored, cache.evictions
    warmed: list[int] = []  # the samples of the batches done
    started = time.perf_counter()
    first = stop_after or 0  # warmed alone, and checked, before the rest
    batches = [list(map(int, indices[:first]))] if first and len(indices) else []
    batches += [
        list(map(int, indices[i : i + batch_size])) for i in range(first, len(indices), batch_size)
    ]

    def done(batch: list[int], failures: list[tuple[str, BaseException]]) -> None:
        warmed.extend(batch)
        report.samples += len(batch)
        for url, error in failures:
            report.failures[url] = f"{type(error).__name__}: {error}"
        report.requests = fetch.requests - start_requests
        report.bytes_fetched = fetch.bytes - start_bytes
        report.hits = cache.hits - start_hits
        report.unstored = cache.unstored - start_unstored
        report.seconds = time.perf_counter() - started
        if on_progress is not None:
            on_progress(report)

    with ThreadPoolExecutor(threads, "fastload-warm") as pool:
        pending = iter(batches)
        alone = bool(first)  # the first batch is in flight alone
        width = 1 if alone else threads
        running = {pool.submit(dataset.warm, b): b for b in islice(pending, width)}
        try:
            while running:
                future = next(iter(running))
                batch = running.pop(future)
                failures = future.result()
                done(batch, failures)
                if alone:
                    alone, report.stopped = False, _all_failed_alike(batch, failures)
                    if report.stopped is not None:
                        break
                for more in islice(pending, threads - len(running)):
                    running[pool.submit(dataset.warm, more)] = more
        except KeyboardInterrupt:
            report.interrupted = True
            for future, batch in running.items():
                done(batch, future.result())  # let the batches in flight land whole
    if dataset.cache.max_bytes is not None or cache.evictions > start_evictions:
        report.evicted = _evicted(dataset, warmed, report)
    report.seconds = time.perf_counter() - started
    return report


def cache_holds(
    dataset: RemoteDataset | CachedDataset, indices: Sequence[int] | np.ndarray
) -> tuple[list[int], list[str]]:
    """Of the samples at ``indices``, those the dataset's cache does not hold, and the cache
    names of those it holds (the index looked up ``_LOOK`` samples at a time)."""
    cache = dataset.cache
    if cache is None:
        raise ConfigError("cache_holds needs a dataset with a cache")
    missing: list[int] = []
    held: list[str] = []
    for start in range(0, len(indices), _LOOK):
        batch = [dataset._index(i) for i in indices[start : start + _LOOK]]
        names = dataset._cache_names(batch)
        for index, name, there in zip(batch, names, cache.contains_many(names), strict=True):
            if there:
                held.append(name)
            else:
                missing.append(index)
    return missing, held


def _evicted(dataset: RemoteDataset | CachedDataset, warmed: list[int], report: WarmReport) -> int:
    """The samples of ``warmed`` the cache does not hold now, but for those that failed and
    those a full disk kept out (``unstored``): the budget's doing."""
    missing, _ = cache_holds(dataset, warmed)
    failed = set(report.failures)
    gone = sum(dataset._display(i) not in failed for i in missing)
    return max(0, gone - report.unstored)


def _all_failed_alike(batch: list[int], failures: list[tuple[str, BaseException]]) -> str | None:
    """Why to stop when every sample of ``batch`` failed with one type of error, else None."""
    kinds = {type(error).__name__ for _, error in failures}
    if not batch or len(failures) < len(batch) or len(kinds) != 1:
        return None
    url, error = failures[0]
    text = str(error)
    named = text if url in text else f"{url}: {text}"  # fastload's errors name their object
    return (
        f"the first {len(batch)} samples all failed with {kinds.pop()}, so no other was fetched "
        f"(the first: {named})"
    )
