"""Where a training loop's time goes: waiting for data, or computing.

:class:`Meter` times an iterator of batches from the consumer's side: how long each ``next()``
blocked (the loop starved) and how long the loop worked before asking again (the step).
:func:`stall_report` turns that, with the dataset/fetch/cache counters when there are some,
into a verdict. :func:`diagnose` runs the loader alone, the step alone and both together, the
overfit-style test users otherwise write by hand.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any, TypeVar

import numpy as np
import torch

from fastload.errors import ConfigError
from fastload.stats import StageCounters, StepStats

__all__ = ["DATA_BOUND_ABOVE", "Hook", "Meter", "batch_size_of", "diagnose", "stall_report"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Hook = Callable[[dict[str, float], int], None]
"""Called as ``hook(metrics, step)`` every ``log_every`` steps, e.g. ``wandb.log``-style."""

DATA_BOUND_ABOVE = 0.10  # share of the loop's time spent waiting that makes it data-bound
_MISSES_MATTER = 0.2  # share of cache lookups that missed before misses are named the cause
_PREPARE_MATTERS = 0.3  # decode+transform time, as a share of the wait, named as the cause


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor or array (1 for a scalar)."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = batch_size_of(item)
            if size:
                return size
    return 0


class Meter:
    """Times the batches a loop takes from an iterator into a :class:`StepStats`."""

    def __init__(self, hooks: Sequence[Hook] = (), log_every: int = 50) -> None:
        if log_every < 1:
            raise ConfigError(f"log_every must be >= 1, got {log_every}")
        for hook in hooks:
            if not callable(hook):
                raise ConfigError(f"hooks must be callables hook(metrics, step), got {hook!r}")
        self.stats = StepStats()
        self.hooks = tuple(hooks)
        self.log_every = log_every
        self._window = [0.0, 0.0, 0.0]  # wait, step, samples since the last hook call

    def timed(self, batches: Iterator[T]) -> Iterator[T]:
        """Yield ``batches`` unchanged, timing each wait and each step between them."""
        handed_out: float | None = None
        while True:
            asked = time.perf_counter()
            if handed_out is not None:
                self._step(asked - handed_out)
            try:
                batch = next(batches)
            except StopIteration:
                return
            first = handed_out is None
            handed_out = time.perf_counter()
            self._batch(handed_out - asked, batch, first=first)
            yield batch

    def _batch(self, waited: float, batch: Any, *, first: bool) -> None:
        stats = self.stats
        samples = batch_size_of(batch)
        stats.samples += samples
        if first:
            stats.first_batch_s = waited
        else:
            stats.wait.add(waited)
            self._window[0] += waited
        self._window[2] += samples

    def _step(self, seconds: float) -> None:
        self.stats.step.add(seconds)
        self.stats.steps += 1
        self._window[1] += seconds
        if self.hooks and self.stats.steps % self.log_every == 0:
            self._call_hooks()

    def _call_hooks(self) -> None:
        wait, step, samples = self._window
        busy = wait + step
        metrics = {
            "data/wait_ms": wait / self.log_every * 1e3,
            "data/step_ms": step / self.log_every * 1e3,
            "data/wait_share": wait / busy if busy else 0.0,
            "data/samples_per_s": samples / busy if busy else 0.0,
        }
        self._window = [0.0, 0.0, 0.0]
        for hook in self.hooks:
            try:
                hook(metrics, self.stats.steps)
            except Exception:  # a logging hook must never stop training
                log.exception("stall hook %r failed; training goes on", hook)


def stall_report(
    steps: StepStats,
    counters: StageCounters | None = None,
    *,
    data_bound_above: float = DATA_BOUND_ABOVE,
) -> dict[str, Any]:
    """Figures and a verdict: ``bound`` is "data", "compute" or "unknown" (too few steps)."""
    busy = steps.wait.total + steps.step.total
    report: dict[str, Any] = {
        "steps": steps.steps,
        "samples": steps.samples,
        "first_batch_s": steps.first_batch_s,
        "wait_s": steps.wait.total,
        "step_s": steps.step.total,
        "wait_share": steps.wait_share,
        "samples_per_s": steps.samples / busy if busy else 0.0,
        "batches_per_s": steps.steps / busy if busy else 0.0,
        "wait_p50_ms": steps.wait.percentile(50) * 1e3,
        "wait_p99_ms": steps.wait.percentile(99) * 1e3,
        "step_p50_ms": steps.step.percentile(50) * 1e3,
        "step_p99_ms": steps.step.percentile(99) * 1e3,
    }
    if counters is not None:
        report.update(counters.snapshot())
    if steps.steps < 2 or busy <= 0:
        report.update(bound="unknown", cause=None, verdict="not enough steps measured yet")
        return report
    share = steps.wait_share
    if share <= data_bound_above:
        report.update(
            bound="compute",
            cause=None,
            verdict=(
                f"compute-bound: the loop waited for data {share:.1%} of the time "
                f"(p99 wait {report['wait_p99_ms']:.1f} ms); a faster data path would not help"
            ),
        )
        return report
    cause = _cause(steps, counters)
    report.update(
        bound="data",
        cause=cause,
        verdict=f"data-bound: the loop waited for data {share:.1%} of the time; cause: {cause}",
    )
    return report


def _cause(steps: StepStats, counters: StageCounters | None) -> str:
    if counters is None:
        return (
            "the loader (no stage counters: load through fastload.DataLoader and a fastload "
            "dataset for a breakdown)"
        )
    cache, fetch, prepare = counters.cache, counters.fetch, counters.dataset.prepare
    lookups = cache.hits + cache.misses
    latency = (
        f"fetch latency p50 {fetch.latency.percentile(50) * 1e3:.0f} ms, "
        f"p99 {fetch.latency.percentile(99) * 1e3:.0f} ms, {fetch.retries} retries"
    )
    if lookups and cache.misses / lookups >= _MISSES_MATTER and fetch.objects:
        return (
            f"cache misses: {cache.misses / lookups:.0%} of samples were fetched remotely "
            f"({latency}); warm the cache first (fastload warm-cache)"
        )
    if not lookups and fetch.objects:
        return f"fetch latency ({latency}); no cache, so every epoch fetches again"
    if prepare.count and prepare.total >= _PREPARE_MATTERS * steps.wait.total:
        return (
            f"decode/transform: p50 {prepare.percentile(50) * 1e3:.1f} ms per sample; "
            "cache the preprocessed samples or add workers"
        )
    hit_rate = f"cache hit rate {cache.hits / lookups:.0%}" if lookups else "no cache lookups"
    return (
        f"the loader itself ({hit_rate}): collation, worker hand-off or too few workers; "
        "try more workers or a deeper prefetch"
    )


# --- diagnose -----------------------------------------------------------------------------------


def diagnose(
    loader: Iterable[Any],
    step: Callable[[Any], object] | None = None,
    *,
    steps: int = 30,
    warmup: int = 2,
    counters: Callable[[], StageCounters | None] | None = None,
) -> dict[str, Any]:
    """Say whether ``loader`` or ``step`` limits throughput, by running them apart and together.

    The loader alone is timed over ``steps`` batches (after ``warmup``), then ``step`` alone on
    one batch repeated (as an overfit test would), then both together. ``step`` must finish its
    work before returning (call ``.item()`` or synchronise), or it looks free. Batches keep
    coming from one pass of the loader, restarted when it ends.
    """
    if steps < 1 or warmup < 0:
        raise ConfigError(f"diagnose: steps must be >= 1 and warmup >= 0, got {steps}, {warmup}")
    source = _endless(loader)
    started = time.perf_counter()
    batch = None
    for _ in range(max(1, warmup)):
        batch = next(source)
    result: dict[str, Any] = {"first_batches_s": time.perf_counter() - started}
    loader_s, samples, batch = _time_loader(source, steps)
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
    together = stall_report(meter.stats, counters() if counters else None)
    result.update(
        step_per_s=steps / step_s,
        together_batches_per_s=together["batches_per_s"],
        together_wait_share=together["wait_share"],
    )
    loader_rate, step_rate = steps / loader_s, steps / step_s
    if loader_rate < step_rate:
        cause = together["cause"] or "the loader"
        result.update(
            bound="data",
            cause=cause,
            verdict=(
                f"data-bound: the loader delivers {loader_rate:.1f} batches/s, the step alone "
                f"runs {step_rate:.1f}/s; together {together['batches_per_s']:.1f}/s with "
                f"{together['wait_share']:.0%} of the time waiting for data; cause: {cause}"
            ),
        )
    else:
        result.update(
            bound="compute",
            cause=None,
            verdict=(
                f"compute-bound: the step alone runs {step_rate:.1f} batches/s, the loader "
                f"delivers {loader_rate:.1f}/s; together {together['batches_per_s']:.1f}/s"
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


def _time_loader(source: Iterator[Any], steps: int) -> tuple[float, int, Any]:
    samples, batch = 0, None
    started = time.perf_counter()
    for batch in islice(source, steps):
        samples += batch_size_of(batch)
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
