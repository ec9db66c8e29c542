"""Where a training loop's time goes: waiting for data, or computing.

:class:`Meter` times an iterator of batches from the consumer's side: how long each ``next()``
blocked (the loop starved) and how long the loop worked before asking again (the step).
:func:`stall_report` turns that, with the dataset/fetch/cache counters when there are some,
into a verdict. :func:`diagnose` runs the loader alone, the step alone and both together, the
overfit-style test users otherwise write by hand.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from itertools import islice
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from fastload.errors import ConfigError
from fastload.stats import QUEUE_KNOWN, CacheStats, StageCounters, StepStats

__all__ = [
    "DATA_BOUND_ABOVE",
    "Hook",
    "Meter",
    "StallReport",
    "Window",
    "batch_size_of",
    "diagnose",
    "stall_report",
    "window_report",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
Hook = Callable[[dict[str, float], int], None]
"""Called as ``hook(metrics, step)`` every ``log_every`` steps, e.g. ``wandb.log``-style."""

DATA_BOUND_ABOVE = 0.10  # share of the loop's time spent waiting that makes it data-bound
_MISSES_MATTER = 0.2  # share of samples that missed the cache before misses are named the cause
_EARLY_READS_MATTER = 0.25  # share of fetches re-reading chunks dropped early, named the cause
_PREPARE_MATTERS = 0.3  # decode+transform time, as a share of the wait, named as the cause


def batch_size_of(batch: Any, batch_size: int | None = None) -> int:
    """Samples in a batch: the leading size of its first tensor or array (1 for a scalar), as
    torch's collation makes them. Batches of samples as they are, which torch's collation never
    makes (their first array is one sample's): a list of dict, tuple or numpy samples
    (``collate_fn=list``; torch's collation gives tensors) holds ``len`` of them, and so does
    a list of strings or bytes (torch's collation of them: a tar sample's raw members), a tuple of
    tuples (``tuple(zip(*samples))``, as torchvision's detection examples collate) ``len`` of
    its first. A list of tensors is batched fields (``[images, labels]``) unless the loader's
    ``batch_size`` says otherwise: as many tensors as that, not all with it as their leading
    size, are samples (``collate_fn=list`` over images of different sizes; a short last batch
    of them still reads as fields, counted by its first tensor)."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, (list, tuple)) and batch:
        if (
            all(isinstance(s, (Mapping, str, bytes)) for s in batch)
            or (isinstance(batch, list) and all(isinstance(s, (tuple, np.ndarray)) for s in batch))
            or _tensor_samples(batch, batch_size)
        ):
            return len(batch)
        if isinstance(batch, tuple) and all(isinstance(field, tuple) for field in batch):
            return len(batch[0])
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size_of(item)
            if size:
                return size
    return 0


def _tensor_samples(batch: list[Any] | tuple[Any, ...], batch_size: int | None) -> bool:
    """Whether ``batch`` is a list of ``batch_size`` tensors that are samples, not fields."""
    return (
        isinstance(batch, list)
        and len(batch) == batch_size
        and all(isinstance(t, torch.Tensor) for t in batch)
        and not all(t.ndim and t.shape[0] == batch_size for t in batch)
    )


class Meter:
    """Times the batches a loop takes from an iterator, since the start and per pass.

    One meter per loop: a :class:`fastload.DeviceLoader` over a :class:`fastload.DataLoader`
    shares the loader's, and a pass timed inside another pass on the same meter (the loader's
    own, under the device loader's) passes its batches through untimed.
    """

    def __init__(
        self, hooks: Sequence[Hook] = (), log_every: int = 50, batch_size: int | None = None
    ) -> None:
        self.stats = StepStats()  # since the meter was made
        self.epoch = StepStats()  # the current (or last) pass
        self.listeners = [Listener(hooks, log_every)]  # its own, then those of loops over it
        self.batch_size = batch_size  # the loader's, when it batches (see batch_size_of)
        self._waiting = False  # inside a timed next(): a pass started now is nested in it

    @contextlib.contextmanager
    def listening(self, listener: Listener) -> Iterator[None]:
        """``listener``'s hooks called too while the block runs (a pass of a loop over the
        meter's loader: a :class:`fastload.DeviceLoader`'s hooks, at its own ``log_every``,
        for as long as it iterates)."""
        self.listeners.append(listener)
        try:
            yield
        finally:
            self.listeners.remove(listener)

    def timed(self, batches: Iterator[T], *, before: float = 0.0) -> Iterator[T]:
        """Yield ``batches`` unchanged, timing each wait and each step between them;
        ``before``: seconds the pass already waited to start (its workers starting), counted
        in its first batch's wait."""
        if self._waiting:  # started while an outer pass on this meter waits for a batch
            return batches
        self.epoch = StepStats()
        return self._timed(batches, before)

    def _timed(self, batches: Iterator[T], before: float) -> Iterator[T]:
        handed_out: float | None = None
        while True:
            asked = time.perf_counter() - (before if handed_out is None else 0.0)
            if handed_out is not None:
                self._step(asked - handed_out)
            self._waiting = True
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self._waiting = False
            first = handed_out is None
            handed_out = time.perf_counter()
            self._batch(handed_out - asked, batch, first=first)
            yield batch

    def _batch(self, waited: float, batch: Any, *, first: bool) -> None:
        samples = batch_size_of(batch, self.batch_size)
        for stats in (self.stats, self.epoch):
            stats.samples += samples
            if first:
                stats.passes += 1
                stats.first_batch_s += waited
            else:
                stats.wait.add(waited)
        for listener in self.listeners:
            listener.window[0] += waited
            listener.window[2] += samples

    def _step(self, seconds: float) -> None:
        for stats in (self.stats, self.epoch):
            stats.step.add(seconds)
            stats.steps += 1
        for listener in self.listeners:
            listener.window[1] += seconds
            if listener.hooks and self.stats.steps % listener.log_every == 0:
                listener.call(self.stats.steps)


class Listener:
    """Hooks called every ``log_every`` steps of a :class:`Meter` with the metrics of the
    steps since their last call."""

    def __init__(self, hooks: Sequence[Hook] = (), log_every: int = 50) -> None:
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ConfigError(f"log_every must be an int >= 1, got {log_every!r}")
        for hook in hooks:
            if not callable(hook):
                raise ConfigError(f"hooks must be callables hook(metrics, step), got {hook!r}")
        self.hooks = tuple(hooks)
        self.log_every = log_every
        self.window = [0.0, 0.0, 0.0]  # wait, step, samples since the last call

    def call(self, step: int) -> None:
        wait, seconds, samples = self.window
        busy = wait + seconds
        metrics = {
            "data/wait_ms": wait / self.log_every * 1e3,
            "data/step_ms": seconds / self.log_every * 1e3,
            "data/wait_share": wait / busy if busy else 0.0,
            "data/samples_per_s": samples / busy if busy else 0.0,
        }
        self.window = [0.0, 0.0, 0.0]
        for hook in self.hooks:
            try:
                hook(metrics, step)
            except Exception:  # a logging hook must never stop training
                log.exception("stall hook %r failed; training goes on", hook)


Window = Literal["epoch", "all"]


Bound = Literal["data", "compute", "unknown"]


@dataclass(frozen=True)
class StallReport:
    """Where a loop's time went over one window, and the verdict.

    ``bound`` is "data", "compute" or "unknown" (too few steps). ``wait_share`` counts the
    first batch of each pass (also reported apart, as ``first_batch_s``), so a loop that mostly
    waited for its first batch is data-bound; ``steady_wait_share`` leaves it out, and
    ``steady_bound`` is the verdict on the batches after the first (a long run that waited 4%
    after a slow first batch is compute-bound there, and the verdict says both). ``counters``
    are the dataset/fetch/cache counters of the window (None when the loop has none).
    """

    window: str
    passes: int
    steps: int
    samples: int
    first_batch_s: float
    wait_s: float
    step_s: float
    wait_share: float
    steady_wait_share: float
    samples_per_s: float
    batches_per_s: float
    wait_p50_ms: float
    wait_p99_ms: float
    step_p50_ms: float
    step_p99_ms: float
    bound: Bound
    cause: str | None
    verdict: str
    counters: StageCounters | None = None
    steady_bound: Bound = "unknown"

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for hooks, logs, JSON): the counters' snapshot under
        ``dataset``/``fetch``/``cache``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "counters"}
        if self.counters is not None:
            out.update(self.counters.snapshot())
        return out


def stall_report(
    steps: StepStats,
    counters: StageCounters | None = None,
    *,
    window: str = "all",
    data_bound_above: float = DATA_BOUND_ABOVE,
) -> StallReport:
    """Figures and a verdict for the time ``steps`` covers (``window`` names it)."""
    return _noted(
        _stall_report(steps, counters, window=window, data_bound_above=data_bound_above),
        counters,
    )


def _noted(report: StallReport, figures: StageCounters | None) -> StallReport:
    """``report`` with its verdict saying that the cache was bypassed, when it was, with the
    costs judged in ``figures`` (counters that cover the judgement)."""
    counters = report.counters
    if counters is None or not counters.cache.bypassed:
        return report
    note = _bypass_note(counters.cache, (figures or counters).cache)
    return replace(report, verdict=f"{report.verdict}; {note}")


def _bypass_note(cache: CacheStats, figures: CacheStats) -> str:
    """What the report says of samples served past the cache (see fastload.cache._worth)."""
    said = (
        f"cache bypassed for {cache.bypassed} samples: making them again from their chunks "
        "costs less than the cache"
    )
    judged = figures.bypass_judged
    if judged:
        mean = f", the mean of {judged} processes" if judged > 1 else ""
        said += (
            f" ({figures.bypass_make_us / judged:.1f} µs a sample, against "
            f"{figures.bypass_write_us / judged:.1f} µs to store one and "
            f"{figures.bypass_read_us / judged:.1f} µs to read it back{mean})"
        )
    return f"{said}; Cache(always=True) keeps caching them"


def _stall_report(
    steps: StepStats,
    counters: StageCounters | None,
    *,
    window: str,
    data_bound_above: float,
) -> StallReport:
    elapsed = steps.elapsed_s
    report = StallReport(
        window=window,
        passes=steps.passes,
        steps=steps.steps,
        samples=steps.samples,
        first_batch_s=steps.first_batch_s,
        wait_s=steps.first_batch_s + steps.wait.total,
        step_s=steps.step.total,
        wait_share=steps.wait_share,
        steady_wait_share=steps.steady_wait_share,
        samples_per_s=steps.samples / elapsed if elapsed else 0.0,
        batches_per_s=(steps.steps + steps.passes) / elapsed if elapsed else 0.0,
        wait_p50_ms=steps.wait.percentile(50) * 1e3,
        wait_p99_ms=steps.wait.percentile(99) * 1e3,
        step_p50_ms=steps.step.percentile(50) * 1e3,
        step_p99_ms=steps.step.percentile(99) * 1e3,
        bound="unknown",
        cause=None,
        verdict="not enough steps measured yet",
        counters=copy.deepcopy(counters),
    )
    if steps.steps < 2 or elapsed <= 0:
        return report
    share, where = steps.wait_share, f"{window}: "
    first = f"{steps.first_batch_s:.2f} s" + (" in all" if steps.passes > 1 else "")
    steady: Bound = "compute" if steps.steady_wait_share <= data_bound_above else "data"
    report = replace(report, steady_bound=steady)
    if share <= data_bound_above:
        return replace(
            report,
            bound="compute",
            verdict=(
                f"{where}compute-bound: the loop waited for data {share:.1%} of the time "
                f"(first batch {first}, p99 wait {report.wait_p99_ms:.1f} ms); a faster "
                "data path would not help"
            ),
        )
    if steady == "compute":  # only the first batch made it so: a verdict on each
        cause = (
            f"the first batch: {first}, {steps.first_batch_s / elapsed:.0%} of the time "
            f"({_first_batch_why(counters)})"
        )
        verdict = (
            f"{where}the first batch waited {first} ({_first_batch_why(counters)}), "
            f"{steps.first_batch_s / elapsed:.0%} of the time; after it the loop is "
            f"compute-bound: later batches waited {steps.steady_wait_share:.1%} of the time "
            f"(p99 wait {report.wait_p99_ms:.1f} ms), so a faster data path would not help them"
        )
        return replace(report, bound="data", cause=cause, verdict=verdict)
    cause = _cause(steps, counters)
    return replace(
        report,
        bound="data",
        cause=cause,
        verdict=f"{where}data-bound: the loop waited for data {share:.1%} of the time "
        f"({steps.steady_wait_share:.1%} after the first batch); cause: {cause}",
    )


def window_report(
    meter: Meter,
    counters: StageCounters | None,
    pass_start: StageCounters | None,
    window: str,
    *,
    this_pass: str,
    data_bound_above: float = DATA_BOUND_ABOVE,
) -> StallReport:
    """The report of ``meter`` for one window: ``"epoch"`` (the current or last pass, named
    ``this_pass``; counters since ``pass_start``) or ``"all"`` (since the meter was made)."""
    if not 0 < data_bound_above < 1:
        raise ConfigError(f"data_bound_above must be in (0, 1), got {data_bound_above!r}")
    if window == "all":
        label = f"since start ({meter.stats.passes} passes)"
        return stall_report(meter.stats, counters, window=label, data_bound_above=data_bound_above)
    if window != "epoch":
        raise ConfigError(f"report window must be 'epoch' or 'all', got {window!r}")
    figures = counters
    if counters is not None and pass_start is not None:
        counters = counters.since(pass_start)
    report = _stall_report(
        meter.epoch, counters, window=this_pass, data_bound_above=data_bound_above
    )
    return _noted(report, figures)  # the costs judged in an earlier pass


def _first_batch_why(counters: StageCounters | None) -> str:
    """What a first batch waited for: the workers' start when it was counted, then fetches.
    Without counters (a plain torch loader's) fastload cannot tell whether workers started;
    with them and no start counted, there were none (0 workers)."""
    if counters is None:
        return "worker start-up, if any, and the first fetches"
    started = counters.dataset.worker_start
    if not started.count:
        return "the first fetches"
    return (
        f"{started.count} workers took {started.total / started.count:.2f} s on average to "
        "start, then the first fetches"
    )


def _missed(counters: StageCounters) -> float | None:
    """The share of the samples handed out that missed the cache (were made); None when there
    were no cache lookups. Against the samples handed out, not hits + misses: with DataLoader
    workers, a sample a worker's lookahead made counts as a miss there and again as a hit where
    its batch is filled (often in another worker, which cannot know)."""
    cache = counters.cache
    lookups = cache.hits + cache.misses
    if not lookups or cache.bypassed > lookups:  # most samples went past the cache
        return None
    return min(1.0, cache.misses / (counters.dataset.samples or lookups))


def _cause(steps: StepStats, counters: StageCounters | None) -> str:
    if counters is None:
        return (
            "the loader (no stage counters: load through fastload.DataLoader and a fastload "
            "dataset for a breakdown)"
        )
    cache, fetch = counters.cache, counters.fetch
    prepare, compute = counters.dataset.prepare, counters.dataset.compute
    missed = _missed(counters)
    latency = (
        f"fetch latency p50 {fetch.latency.percentile(50) * 1e3:.0f} ms, "
        f"p99 {fetch.latency.percentile(99) * 1e3:.0f} ms, {fetch.retries} retries"
    )
    if fetch.throttled:
        latency += (
            f"; the store throttled {fetch.throttled} requests (503 SlowDown or 429), which cut "
            f"the requests in flight {fetch.limit_cuts} times, to {fetch.limit} now"
        )
    if fetch.chunks_read_early >= _EARLY_READS_MATTER * fetch.objects > 0:
        return (
            f"shard chunks read again: {fetch.chunks_read_early} of {fetch.objects} reads "
            "fetched a chunk that memory had dropped before it served a quarter of its samples "
            "(the order is not by chunk); shuffle with fastload.DataLoader(shuffle=True) or "
            "PermutationSampler(blocks=dataset.blocks), or raise ChunkConfig.memory_bytes"
        )
    if missed is not None and missed >= _MISSES_MATTER and fetch.objects:
        return (
            f"cache misses: {missed:.0%} of samples were fetched remotely "
            f"({latency}); warm the cache first (fastload warm-cache)"
        )
    if missed is None and fetch.objects:
        cached = "the cache is bypassed" if cache.bypassed else "no cache"
        return f"{latency}; {cached}, so every epoch fetches again"
    if compute.count and compute.total >= _PREPARE_MATTERS * steps.wait.total:
        share = "samples" if missed is None else f"{missed:.0%} of samples"
        return (
            f"the wrapped dataset making missing samples ({share} missed the cache; "
            f"p50 {compute.percentile(50) * 1e3:.1f} ms per sample, its own reads and "
            "preprocessing, which fastload cannot see into); warm the cache first "
            "(fastload warm-cache) or read through fastload.RemoteDataset"
        )
    matters = _PREPARE_MATTERS * steps.wait.total
    if cache.writes and cache.write_s >= max(matters, prepare.total):
        return (
            f"filling the cache: {cache.writes} samples ({cache.bytes_written / 2**20:.0f} MiB) "
            f"took {cache.write_s:.2f} s to write, beside {prepare.total:.2f} s to decode and "
            "transform (both summed over the threads that made them); later epochs read them "
            f"back; {_write_time(cache)}"
        )
    augment = counters.dataset.augment
    if augment.count and augment.total >= max(matters, prepare.total):
        return (
            f"augment=: {augment.total:.2f} s, p50 {augment.percentile(50) * 1e3:.1f} ms per "
            "sample, run on every read after the cache (the cache cannot keep random crops); "
            f"a cheaper augment (or one on the device after the batch), {_workers_advice()}"
        )
    if prepare.count and prepare.total >= matters:
        keep = (
            "the cache keeps them for later epochs (fastload warm-cache fills it beforehand)"
            if missed is not None
            else "Cache(always=True) keeps them cached"
            if cache.bypassed
            else "cache the preprocessed samples (cache=fastload.Cache(...))"
        )
        return (
            f"decode/transform: {prepare.total:.2f} s, p50 {prepare.percentile(50) * 1e3:.1f} "
            f"ms per sample; {keep}, {_workers_advice()}"
        )
    hit_rate = (
        ("the cache bypassed" if cache.bypassed else "no cache lookups")
        if missed is None
        else f"cache hit rate {1 - missed:.0%}"
    )
    return (
        f"the loader itself ({hit_rate}): collation, worker hand-off or too few workers; "
        f"a deeper prefetch, {_workers_advice()}"
    )


def _workers_advice() -> str:
    """More workers help where cores are free: on 2 (where the docs' default is 0 workers),
    they take the step's cores and the hand-off costs more than they make."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (cores or 1) <= 2:
        return (
            f"or a machine with cores to spare: on this one's {cores}, DataLoader workers would "
            "share the step's cores (its documented default here is 0 workers)"
        )
    return f"or more DataLoader workers ({cores} cores here)"


def _write_time(cache: CacheStats) -> str:
    """Where the cache's write time went, and what helps: waiting for a CPU (the cores were
    busy), waiting on the disk, or the writes' own work (copying into the page cache)."""
    beforehand = "fill it beforehand (fastload warm-cache)"
    if not QUEUE_KNOWN:  # queued and blocked cannot be told apart
        return f"{beforehand} or put the cache on faster storage"
    blocked = max(0.0, cache.write_s - cache.write_cpu_s - cache.write_queued_s)
    split = (
        f"{cache.write_cpu_s:.2f} s on a CPU, {cache.write_queued_s:.2f} s waiting for one, "
        f"{blocked:.2f} s blocked (on the disk, Python's GIL or a lock: not told apart)"
    )
    most = max(cache.write_cpu_s, cache.write_queued_s, blocked)
    if most == cache.write_queued_s:
        return (
            f"its largest part waiting for a CPU, not the disk ({split}): the cores were "
            f"busy; {beforehand}, or run fewer workers or threads on these cores"
        )
    if most == blocked:
        return (
            f"its largest part blocked ({split}); {beforehand}, put the cache on faster storage "
            "if its disk is slow, or run fewer threads if many share the process"
        )
    return (
        f"its largest part on a CPU, not the disk ({split}: encoding the samples and copying "
        f"them into the page cache); {beforehand}"
    )


# --- diagnose -----------------------------------------------------------------------------------


def diagnose(
    loader: Iterable[Any],
    step: Callable[[Any], object] | None = None,
    *,
    steps: int = 30,
    warmup: int = 2,
) -> dict[str, Any]:
    """Say whether ``loader`` or ``step`` limits throughput, by running them apart and together.

    The loader alone is timed over ``steps`` batches (after ``warmup``), then ``step`` alone on
    one batch repeated (as an overfit test would), then both together. ``step`` must finish its
    work before returning (call ``.item()`` or synchronise), or it looks free. Batches keep
    coming from one pass of the loader, restarted when it ends. A loader with ``counters``
    (a :class:`fastload.DataLoader`) gets the cause named from them.
    """
    if not isinstance(loader, Iterable):
        raise ConfigError(f"diagnose needs an iterable of batches (a DataLoader), got {loader!r}")
    if step is not None and not callable(step):
        raise ConfigError(f"diagnose: step must be a callable step(batch), got {step!r}")
    if steps < 1 or warmup < 0:
        raise ConfigError(f"diagnose: steps must be >= 1 and warmup >= 0, got {steps}, {warmup}")
    source = _endless(loader)
    started = time.perf_counter()
    batch = None
    for _ in range(max(1, warmup)):
        batch = next(source)
    result: dict[str, Any] = {"first_batches_s": time.perf_counter() - started}
    loader_s, samples, batch = _time_loader(source, steps, getattr(loader, "batch_size", None))
    result["loader_batches_per_s"] = steps / loader_s
    result["loader_samples_per_s"] = samples / loader_s
    if step is None:
        result.update(
            bound="unknown",
            verdict=(
                f"the loader alone delivers {steps / loader_s:.1f} batches/s "
                f"({samples / loader_s:.0f} samples/s); give a step function to compare"
            ),
        )
        return result
    step_s = _time_step(step, batch, steps)
    meter = Meter()
    for item in islice(meter.timed(source), steps + 1):
        step(item)
        _synchronize()
    counters = getattr(loader, "counters", None)
    together = stall_report(meter.stats, counters if isinstance(counters, StageCounters) else None)
    result.update(
        step_per_s=steps / step_s,
        together_batches_per_s=together.batches_per_s,
        together_wait_share=together.wait_share,
    )
    loader_rate, step_rate = steps / loader_s, steps / step_s
    if loader_rate < step_rate:
        cause = together.cause or "the loader"
        result.update(
            bound="data",
            cause=cause,
            verdict=(
                f"data-bound: the loader delivers {loader_rate:.1f} batches/s, the step alone "
                f"runs {step_rate:.1f}/s; together {together.batches_per_s:.1f}/s with "
                f"{together.wait_share:.0%} of the time waiting for data; cause: {cause}"
            ),
        )
    else:
        result.update(
            bound="compute",
            cause=None,
            verdict=(
                f"compute-bound: the step alone runs {step_rate:.1f} batches/s, the loader "
                f"delivers {loader_rate:.1f}/s; together {together.batches_per_s:.1f}/s"
            ),
        )
    return result


def _endless(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ConfigError(f"diagnose: {loader!r} yielded no batches")


def _time_loader(
    source: Iterator[Any], steps: int, batch_size: int | None
) -> tuple[float, int, Any]:
    samples, batch = 0, None
    started = time.perf_counter()
    for batch in islice(source, steps):
        samples += batch_size_of(batch, batch_size)
    return time.perf_counter() - started, samples, batch


def _time_step(step: Callable[[Any], object], batch: Any, steps: int) -> float:
    step(batch)  # warm-up (compilation, allocation)
    _synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step(batch)
    _synchronize()
    return time.perf_counter() - started


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
