"""torch's DataLoader with defaults for remote data, a stall meter and an exact resume point.

Nothing of torch's loader is forked: :class:`DataLoader` subclasses it and only chooses the
arguments, wraps ``collate_fn``/``worker_init_fn`` (to carry the workers' counters back with each
batch) and wraps the iterator (to time the loop and count what it consumed).
"""

from __future__ import annotations

import atexit
import copy
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import re
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, wait
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.utils.data as tud

from fastload import _collate
from fastload.dataset import Filled
from fastload.device._batch import pinned
from fastload.errors import ConfigError
from fastload.ranks import rank_world, sharding_rank_world, xla_rank_world
from fastload.sampler import PermutationSampler, WeightedSampler, _splitmix64
from fastload.stall import DATA_BOUND_ABOVE, Hook, Meter, StallReport, Window, window_report
from fastload.stats import StageCounters

__all__ = ["DataLoader", "default_workers"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1
BLOCK_WINDOW = 2
"""Chunks a shard-aware shuffle mixes at once (see :class:`DataLoader`)."""
_END = object()
_HANDED_BACK = object()  # the loading thread is done: the loop's thread goes on with the batches
_QUICK_STEP = 1e-4  # a loop step shorter than a thread's hand-off of a batch (s)
_QUICK_STEPS = 8  # ... so many times in a row: the loading thread hands the iterator back
_FORK_WAIT = 120.0  # seconds workers wait to fork for a dataset's listing check


def default_workers() -> int:
    """Worker processes when none are asked for: none on 1-2 cores (a background thread loads
    instead, without pickling every batch), else half the cores, at most 8."""
    cores = _cores()
    return 0 if cores <= 2 else min(8, cores // 2)


def _cores() -> int:
    """The cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


class DataLoader(tud.DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` (same arguments) with defaults for remote data.

    Differences from torch's defaults, each overridable:

    - map-style datasets get a :class:`fastload.PermutationSampler` (``shuffle`` and ``seed``),
      sharded over torch.distributed / torch_xla ranks, so no rank ever gets zero samples; with
      ``shuffle=True`` each new pass takes the next epoch's order, as torch's loader reshuffles;
      without ``seed=``, so does a new loader in the same process over as many samples, as
      torch's unseeded loader draws a new order (under several ranks it warns instead); with
      ``seed=`` every new loader starts at epoch 0, as a seeded generator would. An explicit
      :meth:`set_epoch` or :meth:`load_state_dict` chooses the epoch. The
      order follows ``seed``, not ``generator`` (which still seeds the workers), so that every
      rank draws the same order to split: a warning says so when both are given;
    - ``num_workers``: :func:`default_workers`; with 0, batches load in a background thread
      (``background=True``) so loading overlaps the training step, and are collated as
      ``default_collate`` would, numeric arrays stacked by numpy (see
      :mod:`fastload._collate`: torch's stack shares the training step's thread pool);
    - workers start with ``forkserver`` (fork-safe: no inherited client connections or
      threads) when the dataset pickles, stay alive across epochs, and prefetch 4 batches each;
    - ``pin_memory`` when CUDA is available; worker seeds derive from ``seed`` and the rank;
    - a dataset read in chunks (``RemoteDataset(shards=...)``: its ``blocks``) is shuffled
      shard-aware: chunks in a new order each epoch, samples shuffled within windows of
      ``BLOCK_WINDOW`` chunks, so a batch reads about that many chunks; under
      torch.distributed each rank takes a contiguous share of the epoch (shuffled or not), so
      a chunk is read by one rank, not by all;
    - ``lookahead``: batches ahead of the loop whose missing samples a caching
      :class:`fastload.RemoteDataset` fetches into its cache in the background: without
      workers in this process, with workers in the workers themselves (each batch a worker
      gets names a batch ``lookahead`` beyond those already handed out, for it to cache), so
      a cold epoch's fetching, decoding and preprocessing spread over the workers;
    - with workers and a cache (and no ``collate_fn`` of the user's), the workers fill the
      cache and this process reads each batch from it in its loading thread (``fills``), and
      pins it there with ``pin_memory``: a warm batch does not cross through fresh shared memory;
      once a whole pass has left every sample cached, on a machine without a core to spare
      beside the workers, the next passes are read in this process as without workers (same
      batches; see :meth:`_read_here`).

    :meth:`state_dict` records the next sample the loop has not seen (batches prefetched by
    workers are not counted); :meth:`load_state_dict` resumes there in O(1); ``len()`` stays
    the whole epoch's batches, as torch's. A pass begins at its first batch, and the sampler
    looks the ranks up then (a loader made before ``init_process_group`` shards once it is
    up). Under Lightning, Accelerate, torchrun and torchdata: docs/frameworks.md.
    :meth:`report` says whether the loop is data- or compute-bound.
    """

    def __init__(  # noqa: PLR0917 (torch's DataLoader takes these positionally)
        self,
        dataset: tud.Dataset[Any],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: tud.Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: tud.Sampler[Sequence[Any]] | Iterable[Sequence[Any]] | None = None,
        num_workers: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool | None = None,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        seed: int | None = None,
        background: bool = True,
        lookahead: int = 4,
        hooks: Sequence[Hook] = (),
        log_every: int = 50,
        **kwargs: Any,
    ) -> None:
        workers = default_workers() if num_workers is None else num_workers
        reshuffle, first_epoch, chosen = False, 0, seed is not None
        seed = 0 if seed is None else seed
        if not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"DataLoader num_workers must be an int >= 0, got {num_workers!r}")
        if not isinstance(lookahead, int) or lookahead < 0:
            raise ConfigError(f"DataLoader lookahead must be an int >= 0, got {lookahead!r}")
        if (
            sampler is None
            and batch_sampler is None
            and not isinstance(dataset, tud.IterableDataset)
        ):
            if shuffle and generator is not None:
                log.warning(
                    "DataLoader: the shuffled order follows seed=%d, not generator= (every rank "
                    "must draw the same order to split it); pass seed= for another order",
                    seed,
                )
            sampler = _own_sampler(dataset, bool(shuffle), seed)
            reshuffle = bool(shuffle)
            shuffle = None
            if reshuffle and not chosen and (first_epoch := _Epochs.next(sampler.n)):
                sampler.set_epoch(first_epoch)
        _claim(sampler if batch_sampler is None else batch_sampler, dataset)
        auto_collation = batch_sampler is not None or batch_size is not None
        collate = collate_fn or (
            (tud.default_collate if workers else _collate.collate)
            if auto_collation
            else tud.default_convert
        )
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        # workers fill the cache, this process reads it (see _fills)
        fills = bool(workers) and collate_fn is None and auto_collation
        fills = fills and _fills(dataset)
        prefetch = _prefetch(dataset, lookahead)
        factor = prefetch_factor if prefetch_factor or not workers else 4
        # with workers, each batch tells its worker which batch to cache ahead (see _Ahead)
        handed = workers * (factor or 0)
        if prefetch is not None and batch_sampler is not None:
            batch_sampler = _lookahead(batch_sampler, prefetch, lookahead, 0, handed)
        elif prefetch is not None and sampler is not None:
            sampler = _lookahead(sampler, prefetch, lookahead, batch_size or 1, handed)
        if workers:
            collate = _WorkerCollate(collate)
            worker_init_fn = _WorkerInit(worker_init_fn, fills)
            if multiprocessing_context is None:
                multiprocessing_context = _fork_safe_context(dataset, collate, worker_init_fn)
        super().__init__(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,  # type: ignore[arg-type]
            num_workers=workers,
            collate_fn=collate,
            pin_memory=pin,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator or torch.Generator().manual_seed(_worker_seed(seed, first_epoch)),
            prefetch_factor=factor,
            persistent_workers=bool(workers) if persistent_workers is None else persistent_workers,
            **kwargs,
        )
        self.background = background
        self.lookahead = lookahead
        self.fills = fills
        self._pins = fills and pin and _accelerated()
        self.meter = Meter(hooks, log_every, self.batch_size)
        self._consumed = 0  # batches handed to the loop in the current pass
        self._worker_counters = StageCounters()
        self._reshuffle = reshuffle  # our own shuffled sampler: a new order each pass
        self._follows = reshuffle and not chosen  # a new loader takes the next epoch
        self._pass_start: StageCounters | None = None  # counters when the pass began
        self._passes = 0
        self._heading = False  # a head start is caching the pass's first batches
        self._cached_whole = False  # the last pass left every sample in the cache (fills)
        # the worker seeds' (seed, epoch, rank) when they are ours and the rank may change: a
        # loader made before the process group is up is reseeded for its rank at its first pass
        settled = generator is not None or _ranks_settled()
        self._seeded = None if settled else (seed, first_epoch, _rank())

    # -- iteration -----------------------------------------------------------------------------
    @property
    def _order(self) -> Any:
        """The sampler (or a user's batch sampler) the indices come from, lookahead unwrapped."""
        custom = self.batch_sampler is not None and self.batch_size is None
        source = self.batch_sampler if custom else self.sampler
        return source.lookahead_source if isinstance(source, _Lookahead) else source

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """A pass, begun at its first ``next()``: a ``set_epoch`` (or ``load_state_dict``)
        between ``iter()`` and it still chooses the pass's order, as frameworks call them
        (Lightning makes the iterator, then sets the epoch)."""
        yield from self._begin()

    def _begin(self) -> Iterator[Any]:
        """Start a pass: its order, its producers; the batches, timed."""
        self._reseed()
        permutation = _permutation_in(self._order)
        if permutation is not None:
            permutation._grant_pass()
        if self._reshuffle and isinstance(self._order, PermutationSampler):
            self._order._new_pass(advance=self._passes > 0)
            if self._follows:
                _Epochs.used(self._order.n, self._order.epoch)
        self._passes += 1
        self._consumed = 0
        self._pass_start = self.counters
        here = self._cached_whole and not self._core_to_spare
        self._cached_whole = False  # until this pass says so
        for source in self._lookaheads:
            source.here = here
        if not here:
            self._before_fork()
            self._head_start()
        started = time.perf_counter()
        batches: Iterator[Any]
        if here:
            batches = self._read_here()
        else:
            if isinstance(self.worker_init_fn, _WorkerInit):
                self.worker_init_fn.started = time.time()  # workers start below (if not running)
            batches = super().__iter__()
            if self.num_workers:
                batches = self._unwrapped(batches)
        if self.background and (self.num_workers == 0 or self.fills):  # reads in this process
            batches = iter(_Background(batches, depth=2))
        return self._deliver(batches, time.perf_counter() - started)

    def _reseed(self) -> None:
        """Seed the workers for this process's rank if it was not known when the loader was
        made (before ``init_process_group``): each rank's workers draw their own numbers."""
        if self._seeded is None or self.generator is None:
            return
        seed, epoch, rank = self._seeded
        now = _rank()
        if now != rank:
            self._seeded = (seed, epoch, now)
            self.generator.manual_seed(_worker_seed(seed, epoch, now))

    def _read_here(self) -> Iterator[Any]:
        """A pass of a loader whose workers fill the cache, read in this process as without
        workers, once a whole pass left every sample in the cache (:meth:`_left_whole`) and
        without a core to spare beside the workers: a worker's part of a warm batch (a look at
        the cache's index, the hand-over) only adds to the read this process makes anyway,
        and competes with it for the CPU. Same batches, same order; a sample missing after all
        (evicted, the cache cleared) is made and cached here; a pass that leaves samples
        uncached gives the next back to the workers. With cores
        to spare (16 on the H100 machine, 8 workers) the workers keep the warm passes: there
        it was not shown to pay (docs/benchmarks.md, GPU)."""
        for indices in self.batch_sampler:  # type: ignore[union-attr]
            batch = _collate.collate(self.dataset.__getitems__(indices))  # type: ignore[attr-defined]
            yield pinned(batch) if self._pins else batch

    def _left_whole(self) -> bool:
        """Whether the pass that just ended left every sample of the dataset in the cache: it
        went through all of them (a permutation, on one rank, not resumed mid-pass; but for a
        last batch dropped), and each it missed was written (or waited for), none evicted,
        skipped, left unstored or served oversize. Workers' counts arrive with their batches,
        so a write not yet counted can only make this say no."""
        now, then = self.counters, self._pass_start
        per_batch = self.batch_size or 1
        permuted = isinstance(self._order, PermutationSampler | tud.SequentialSampler)
        every = permuted and (self._consumed + 1) * per_batch > len(self.dataset)  # type: ignore[arg-type]
        if not (self.fills and every) or now is None or then is None:
            return False
        cache, dataset = now.cache, now.dataset
        made = cache.writes - then.cache.writes + cache.waits - then.cache.waits
        return (
            cache.misses - then.cache.misses <= made
            and cache.evictions == then.cache.evictions
            and cache.unstored == then.cache.unstored
            and cache.oversize == then.cache.oversize
            and dataset.skipped == then.dataset.skipped
        )

    def _before_fork(self) -> None:
        """Workers forked while a dataset's listing check talks to the store would copy its
        half-used connections: let the check finish first (forkserver workers need not)."""
        check = getattr(self.dataset, "listing_check", None)
        if self.num_workers and self._forks and isinstance(check, Future) and not check.done():
            wait([check], timeout=_FORK_WAIT)

    def _head_start(self) -> None:
        """Workers filling the cache start in this pass: its first batches are cached here
        meanwhile (:meth:`_Lookahead.head_start`), held for this process's reads of them. Not
        before a fork, which would copy this process's fetches mid-request; and only with a
        core to spare beside the workers: on 2 cores it competed with the forkserver's import
        for the CPU and gained nothing, for 110-160 MB more peak memory (docs/benchmarks.md)."""
        starting = self._passes == 1 or not self.persistent_workers
        if not (self.fills and starting and self._core_to_spare) or self._forks:
            return
        for source in self._lookaheads:
            source.head_start()
            self._heading = True

    @property
    def _core_to_spare(self) -> bool:
        """More cores than the workers and this process: nothing here competes with the
        workers for the CPU (a head start; warm passes left to the workers)."""
        return _cores() > self.num_workers + 1

    def _head_end(self) -> None:
        if self._heading:
            self._heading = False
            for source in self._lookaheads:
                source.head_end()

    @property
    def _lookaheads(self) -> list[_Lookahead]:
        """The lookahead around the sampler or the batch sampler (none without one)."""
        return [s for s in (self.sampler, self.batch_sampler) if isinstance(s, _Lookahead)]

    @property
    def _forks(self) -> bool:
        """Whether workers start by forking this process."""
        context = self.multiprocessing_context
        return context is None or context.get_start_method() == "fork"

    def _deliver(self, batches: Iterator[Any], starting: float) -> Iterator[Any]:
        """``batches`` timed (``starting``: seconds iter() took, workers started in it)."""
        try:
            for item in self.meter.timed(batches, before=starting):
                self._consumed += 1
                yield item
            self._cached_whole = self._left_whole()
        finally:  # left early (break, an exception): stop the producers before going on
            close = getattr(batches, "close", None)
            if close is not None:
                close()
            for source in self._lookaheads:
                source.close()

    def _unwrapped(self, batches: Iterator[Any]) -> Iterator[Any]:
        for item in batches:
            self._head_end()
            batch = item
            if isinstance(batch, _Counted):
                self._worker_counters.merge(batch.counters)
                batch = batch.batch
            if isinstance(batch, Filled):  # made and cached by a worker: read here
                batch = _collate.collate(self.dataset.read_filled(batch))  # type: ignore[attr-defined]
                if self._pins:
                    batch = pinned(batch)  # what torch's pinning thread does for workers' batches
            yield batch

    # -- metrics -------------------------------------------------------------------------------
    @property
    def counters(self) -> StageCounters | None:
        """Dataset/fetch/cache counters of this process and every worker so far (None if the
        dataset keeps none); :meth:`stats` is their snapshot."""
        own = getattr(self.dataset, "counters", None)
        if not isinstance(own, StageCounters):
            return None
        total = copy.deepcopy(own)
        total.merge(self._worker_counters)
        return total

    def stats(self) -> dict[str, Any]:
        """A snapshot of :attr:`counters` (empty if the dataset keeps none)."""
        counters = self.counters
        return {} if counters is None else counters.snapshot()

    def report(
        self, window: Window = "epoch", *, data_bound_above: float = DATA_BOUND_ABOVE
    ) -> StallReport:
        """Wait vs step time, throughput, stage counters and the data/compute verdict, for the
        current (or last) pass (``window="epoch"``) or since the loader was made (``"all"``).
        A :class:`fastload.DeviceLoader` over this loader shares its meter and this report."""
        this_pass = f"pass {self._passes}"
        if getattr(self._order, "shuffle", False):  # the epoch names the order
            this_pass += f" (epoch {getattr(self._order, 'epoch', '?')})"
        return window_report(
            self.meter,
            self.counters,
            self._pass_start,
            window,
            this_pass=this_pass,
            data_bound_above=data_bound_above,
        )

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self, consumed_batches: int | None = None) -> dict[str, Any]:
        """Where the current pass stands: the sampler's state at the next unseen sample.

        ``consumed_batches``: batches the loop really used, when something between this loader
        and the loop (e.g. a :class:`fastload.DeviceLoader`) holds some back; by default, all
        batches this loader handed out.
        """
        sampler = self._resumable_sampler()
        consumed = self._consumed if consumed_batches is None else consumed_batches
        if not 0 <= consumed <= self._consumed:
            raise ConfigError(
                f"DataLoader.state_dict: consumed_batches must be in [0, {self._consumed}], "
                f"got {consumed}"
            )
        per_batch = self.batch_size or 1
        samples = min(consumed * per_batch, sampler.num_left)  # a resumed pass: what it had
        return {"version": _STATE_VERSION, "sampler": sampler.state_dict(local_consumed=samples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position: the next pass starts with the first unseen sample
        (after a state saved at the end of an epoch, the next epoch, in its own order).

        Also takes the state of a ``torchdata`` ``StatefulDataLoader`` whose sampler was a
        :class:`fastload.PermutationSampler`: it continues where that loader stopped.
        """
        sampler = self._resumable_sampler()
        if isinstance(state, dict) and _TORCHDATA_KEYS & state.keys():
            sampler.load_state_dict(_from_torchdata(state, sampler, self.batch_size or 1))
        elif isinstance(state, dict) and state.get("version") == _STATE_VERSION:
            sampler.load_state_dict(state["sampler"])
        else:
            raise ConfigError(
                f"DataLoader.load_state_dict: not a fastload DataLoader state (version "
                f"{_STATE_VERSION}) nor a torchdata StatefulDataLoader's: {str(state)[:80]!r}"
            )
        self._consumed = 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order (forwarded to the sampler)."""
        set_epoch = getattr(self._order, "set_epoch", None)
        if set_epoch is None:
            raise ConfigError(f"DataLoader.set_epoch: {self._order!r} has no set_epoch")
        set_epoch(epoch)

    def _resumable_sampler(self) -> PermutationSampler:
        sampler = self._order
        if self.batch_sampler is not None and self.batch_size is None:
            raise ConfigError(
                "DataLoader: resuming needs batch_size and sampler (a custom batch_sampler's "
                "position cannot be known)"
            )
        if isinstance(sampler, tud.DistributedSampler) and not isinstance(
            sampler, PermutationSampler | WeightedSampler
        ):
            raise ConfigError(
                f"DataLoader: cannot resume with {type(sampler).__name__}, a distributed sampler "
                "a framework put around the sampler given to this loader (Lightning does so "
                "for any sampler that is not a DistributedSampler): leave sampler= out, and the "
                "loader's own fastload.PermutationSampler shards over the ranks, resumes, and "
                "is left in place"
            )
        if not isinstance(sampler, PermutationSampler):
            raise ConfigError(
                f"DataLoader: cannot resume with {type(sampler).__name__}; use "
                "fastload.PermutationSampler (the default) to get a resumable position"
            )
        return sampler


_TORCHDATA_KEYS = {"_snapshot", "_sampler_iter_state", "_index_sampler_state"}


def _from_torchdata(
    state: dict[str, Any], sampler: PermutationSampler, batch_size: int
) -> dict[str, Any]:
    """The PermutationSampler state inside a torchdata ``StatefulDataLoader`` state, moved on
    by the batches the loop took since that loader's snapshot of it (with workers); a
    ConfigError saying what to do when its sampler was another."""
    snapshot = state.get("_snapshot")
    main = snapshot.get("_main_snapshot", {}) if isinstance(snapshot, dict) else state
    inner = main.get("_sampler_iter_state")
    found = inner.get("sampler_state") if isinstance(inner, dict) else None
    found = found if found is not None else main.get("_index_sampler_state")
    if not (isinstance(found, dict) and {"n", "position", "epoch"} <= found.keys()):
        raise ConfigError(
            "DataLoader.load_state_dict: a torchdata StatefulDataLoader state whose sampler was "
            "not a fastload.PermutationSampler: its position in that sampler's order cannot be "
            "continued in fastload's. Finish the interrupted epoch with the StatefulDataLoader, "
            "or start this loader at the next epoch (loader.set_epoch(epoch + 1)); a "
            "StatefulDataLoader given sampler=fastload.PermutationSampler(...) saves states that "
            "fastload.DataLoader loads"
        )
    taken = state.get("_steps_since_snapshot", 0) if isinstance(snapshot, dict) else 0
    sampler.load_state_dict(found)
    return sampler.state_dict(local_consumed=min(int(taken) * batch_size, sampler.num_left))


# --- workers --------------------------------------------------------------------------------


class _Counted:
    """A batch from a worker, with the counters the worker gathered since its last batch."""

    __slots__ = ("batch", "counters")

    def __init__(self, batch: Any, counters: StageCounters) -> None:
        self.batch = batch
        self.counters = counters

    def pin_memory(self) -> _Counted:  # called by torch's pin-memory thread
        return _Counted(pinned(self.batch), self.counters)


def _worker_counters() -> StageCounters | None:
    info = tud.get_worker_info()
    counters = getattr(info.dataset, "counters", None) if info is not None else None
    return counters if isinstance(counters, StageCounters) else None


class _WorkerCollate:
    """Collate, then attach the worker's counters (drained) to the batch, if it counted any.

    A drain, its pickling and the loop's merge cost about 85 µs a batch here (2.7 µs a sample
    at batch 32); a worker's warm batch that it leaves unlooked counts nothing.
    """

    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any] | Filled) -> Any:
        batch = samples if isinstance(samples, Filled) else _collate.noted(self.collate, samples)
        counters = _worker_counters()
        taken = None if counters is None else counters.drain()
        return batch if taken is None or taken.empty else _Counted(batch, taken)


class _WorkerInit:
    """Start each worker's counters at zero (a worker's dataset copy carries the parent's) and
    count how long it took to start (since ``started``, when the loader's pass began); with
    ``fills``, make the worker's dataset only fill the cache (``DataLoader.fills``)."""

    started = 0.0

    def __init__(self, user: Callable[[int], None] | None, fills: bool = False) -> None:
        self.user, self.fills = user, fills

    def __call__(self, worker_id: int) -> None:
        counters = _worker_counters()
        if counters is not None:
            counters.drain()
            if self.started:
                counters.dataset.worker_start.add(max(0.0, time.time() - self.started))
        if self.fills:
            tud.get_worker_info().dataset.fills_only = True  # type: ignore[union-attr]
        if self.user is not None:
            self.user(worker_id)


def _fork_safe_context(*parts: object) -> Any:
    """forkserver where it works as a drop-in, else None (multiprocessing's default: fork on
    Linux, unless the program chose another with ``multiprocessing.set_start_method``).

    forkserver workers re-import the main script (as ``__mp_main__``), so it must be guarded by
    ``if __name__ == "__main__":``; the dataset and functions must pickle, by reference to
    something the worker can import; and they must be small and hold no tensors: each worker
    gets its own pickled copy, and every tensor storage travels as a file descriptor (more than
    about 250 fail with "too many fds"), where forked workers share the parent's memory.
    The forkserver preloads torch and fastload (Python's own preload of ``__main__`` does not
    happen in 3.11 and 3.12), else every worker imports torch itself: 5 s for 8 workers on a
    16-core GPU machine, at every loader's start. It then freezes its garbage collector
    (``fastload._frozen``), so workers' collections do not copy the pages they share with it.
    The forkserver starts here, so its imports overlap what the script does before its first
    batch (building a model, say).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    main_path = getattr(sys.modules.get("__main__"), "__file__", None)
    why = None
    if main_path is not None and not _guarded(main_path):
        why = f"the main script {main_path} has no 'if __name__ == \"__main__\":' guard"
    else:
        why = _why_not_pickled(parts, interactive=main_path is None)
    if why is not None:
        log.info("DataLoader: workers start with fork, not forkserver: %s", why)
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    forkserver.ensure_running()  # its imports overlap what the script does before iterating
    return context


_PRELOAD = ("__main__", "torch", "numpy", "fastload", "fastload._frozen")
PICKLED_LIMIT = 64 * 2**20
"""Bytes of pickled dataset above which workers fork (sharing it) rather than each unpickle it."""


class _Sizer(pickle.Pickler):
    """Pickles without keeping the bytes: counts them, out-of-band buffers and tensor storages
    (which it does not serialize), and notes a reference to ``__main__``."""

    def __init__(self) -> None:
        self.size = 0
        self.storages = 0
        self.interactive = False
        super().__init__(self, protocol=5, buffer_callback=self._buffer)

    def write(self, data: bytes) -> None:
        self.size += len(data)
        self.interactive = self.interactive or b"__main__" in data

    def _buffer(self, buffer: pickle.PickleBuffer) -> None:
        self.size += buffer.raw().nbytes

    def persistent_id(self, obj: object) -> int | None:
        if isinstance(obj, torch.UntypedStorage | torch.TypedStorage):
            self.storages += 1
            return self.storages
        return None


def _why_not_pickled(parts: tuple[object, ...], interactive: bool) -> str | None:
    sizer = _Sizer()
    try:
        sizer.dump(parts)
    except Exception as exc:  # lambdas, local classes, open handles...
        return f"the dataset or its functions do not pickle ({type(exc).__name__}: {exc})"
    if interactive and sizer.interactive:
        return "the dataset uses classes defined interactively (in __main__)"
    if sizer.storages:
        return f"the dataset holds {sizer.storages} tensors (forked workers share them)"
    if sizer.size > PICKLED_LIMIT:
        return f"the dataset pickles to {sizer.size / 2**20:.0f} MiB (forked workers share it)"
    return None


_MAIN_GUARD = re.compile(rb"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:""", re.MULTILINE)


def _guarded(path: str) -> bool:
    try:
        return _MAIN_GUARD.search(Path(path).read_bytes()) is not None
    except OSError:
        return False


def _own_sampler(dataset: Any, shuffle: bool, seed: int) -> PermutationSampler:
    """The sampler a loader makes for a map-style dataset."""
    if not hasattr(dataset, "__len__"):
        raise ConfigError(f"DataLoader: map-style dataset {dataset!r} has no __len__")
    return PermutationSampler(
        len(dataset),
        shuffle=shuffle,
        seed=seed,
        blocks=getattr(dataset, "blocks", None),  # ranks then take whole chunks
        window=BLOCK_WINDOW,
    )


def _claim(order: Any, dataset: Any) -> None:
    """Make the PermutationSampler behind ``order`` (made here or given) this loader's: under
    several ranks it then refuses to be iterated by another loader built from it, which would
    shard its batches again (:meth:`PermutationSampler._check_driver`)."""
    permutation = _permutation_in(order)
    if permutation is not None and permutation._owner is None:
        name = type(dataset).__name__
        permutation._owner = f"the fastload.DataLoader over {name} ({permutation.n} samples)"


def _rank() -> int:
    """This process's rank, as the samplers shard (the launcher's before a process group)."""
    return sharding_rank_world()[0]


def _ranks_settled() -> bool:
    """Whether the ranks are known for good: a process group or torch_xla's runtime is up
    (whose ordinal a loader's threads may not see: it is read when the loader is made)."""
    group = torch.distributed.is_available() and torch.distributed.is_initialized()
    return group or xla_rank_world() is not None


def _worker_seed(seed: int, epoch: int, rank: int | None = None) -> int:
    rank = _rank() if rank is None else rank
    mixed = (seed & (2**64 - 1)) ^ _splitmix64(rank + 1) ^ _splitmix64(epoch + 0x51ED)
    return _splitmix64(mixed) >> 1


class _Epochs:
    """The epochs the shuffled loaders of this process with the default seed have taken, by
    dataset length, so that a new one (a loop that makes its loader, or its dataset and loader,
    each epoch) takes the next epoch's order and worker seeds, as torch's unseeded loader draws
    a new order, instead of the first loader's again. Under several ranks a new loader cannot
    move on by itself (a rank that made an extra loader would draw another order than the
    others, and their shares would overlap): it warns instead."""

    _next: ClassVar[dict[int, int]] = {}  # length -> the epoch after the last one taken

    @classmethod
    def next(cls, length: int) -> int:
        """The epoch a new shuffled loader over ``length`` samples starts at."""
        epoch = cls._next.get(length, 0)
        if epoch and rank_world()[1] > 1:
            log.warning(
                "DataLoader: a new shuffled loader of %d samples starts at epoch 0 again, as "
                "the one before it did, and repeats its order: keep one loader across epochs, "
                "or call loader.set_epoch(epoch) on every rank",
                length,
            )
            return 0
        return epoch

    @classmethod
    def used(cls, length: int, epoch: int) -> None:
        cls._next[length] = max(cls._next.get(length, 0), epoch + 1)


# --- background loading and lookahead ---------------------------------------------------------


class _Background:
    """Batches made in a daemon thread, ``depth`` ahead; errors re-raise in the consumer.

    A thread only helps while the loop's steps leave it time to work in (a training step that
    lets go of the GIL); each hand-off costs a few thread switches (0.1-0.3 ms a batch on 2
    cores). When ``_QUICK_STEPS`` steps in a row each take under ``_QUICK_STEP`` s, nothing is
    left to overlap: the thread finishes the batch in hand and hands the iterator back, and
    the pass goes on in the loop's thread (the next pass starts with a thread again).

    :meth:`close` stops the thread and waits for it (it finishes the batch in hand): the loop's
    end, a ``break`` or an exception closes it before control returns, and so does interpreter
    exit for one left open, so no thread is inside a dataset's ``__getitem__`` (a pyarrow read,
    say) while the interpreter shuts down; that aborted or hung the process.
    """

    running: ClassVar[set[_Background]] = set()

    def __init__(self, batches: Iterator[Any], depth: int) -> None:
        self.batches = batches
        # made batches, and a token for each one more the thread may hand over (C queues:
        # Queue(maxsize)'s conditions cost each hand-off a fifth more here)
        self.ready: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
        self.room: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(depth):
            self.room.put(None)
        self.stop = threading.Event()
        self.hand_back = threading.Event()  # the loop's steps are too short to overlap
        self.thread = threading.Thread(target=self._produce, name="fastload-loader", daemon=True)
        _Background.running.add(self)
        self.thread.start()

    def _put(self, item: Any, error: BaseException | None = None) -> bool:
        while not self.stop.is_set():
            try:
                self.room.get(timeout=0.1)
            except queue.Empty:
                continue
            self.ready.put((item, error))
            return True
        return False

    def _produce(self) -> None:
        try:
            for batch in self.batches:
                if not self._put(batch):
                    return
                if self.hand_back.is_set():
                    self._put(_HANDED_BACK)
                    return
            self._put(_END)
        except BaseException as exc:
            self._put(_END, exc)

    def __iter__(self) -> Iterator[Any]:
        quick = 0  # steps in a row under _QUICK_STEP
        try:
            while True:
                item, error = self.ready.get()
                self.room.put(None)
                if error is not None:
                    raise error
                if item is _END:
                    return
                if item is _HANDED_BACK:
                    self.close()  # the thread has returned
                    yield from self.batches
                    return
                handed = time.perf_counter()
                yield item
                quick = quick + 1 if time.perf_counter() - handed < _QUICK_STEP else 0
                if quick == _QUICK_STEPS:
                    self.hand_back.set()
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join()
        _Background.running.discard(self)

    @classmethod
    def close_all(cls, timeout: float = 60.0) -> None:
        """At interpreter exit: stop every producer and give each ``timeout`` s to finish."""
        for background in list(cls.running):
            background.stop.set()
            background.thread.join(timeout)
            if background.thread.is_alive():
                log.warning("fastload-loader thread still busy after %.0f s at exit", timeout)


atexit.register(_Background.close_all)


def _fills(dataset: object) -> bool:
    """Whether workers should only fill ``dataset``'s cache and leave the reading to the loop's
    process (:meth:`fastload.RemoteDataset.fillable`).

    A warm batch is then a look at the cache's index in a worker and one read in this process,
    where a worker's batch would cross into this process through fresh shared memory (its
    allocation and a page fault per 4 KB on both sides cost more than the read). Not with a
    ``collate_fn`` of the user's (which may expect to run in a worker).
    """
    fillable = getattr(dataset, "fillable", None)
    return callable(fillable) and bool(fillable())


def _accelerated() -> bool:
    """Whether pinned memory can be had (torch's loader skips ``pin_memory`` otherwise)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return bool(accelerator.is_available() if accelerator else torch.cuda.is_available())


def _prefetch(dataset: object, depth: int) -> Callable[[Any], Future[None]] | None:
    """The dataset's ``prefetch`` when a lookahead helps: it caches, and one is asked for."""
    prefetch = getattr(dataset, "prefetch", None)
    if depth and callable(prefetch) and getattr(dataset, "cache", None) is not None:
        return prefetch  # type: ignore[no-any-return]
    return None


class _Ahead(int):
    """The first index of a batch, carrying the indices of a batch further on (``lookahead``)
    for the worker that reads this one to cache in the background (``_Batched.__getitems__``).

    With workers, a lookahead in the main process would fetch, decode and preprocess most of
    a cold epoch there, one process for all (2 workers waited on it for 88% of 2,000 samples
    here), so the workers do it themselves: their batches carry what to cache next.
    """

    lookahead: tuple[int, ...]

    def __new__(cls, index: int, lookahead: Sequence[int]) -> _Ahead:
        self = super().__new__(cls, index)
        self.lookahead = tuple(int(i) for i in lookahead)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Ahead, (int(self), self.lookahead))


class _Lookahead(tud.Sampler[Any]):
    """A sampler (``group``: indices per batch) or batch sampler (``group=0``) as it is, asking
    ``prefetch`` for the batches ``depth`` batches ahead of what the loader has taken; with
    workers (``handed``: batches they may hold at once), handing each batch's worker the batch
    ``depth`` beyond those instead (:class:`_Ahead`).

    Attributes it does not have come from the wrapped ``lookahead_source`` (``set_epoch``,
    ``epoch``, ``rank``...), so ``loader.sampler.set_epoch(e)`` works as with torch's loader.
    """

    def __init__(
        self,
        source: Any,
        prefetch: Callable[[Any], Future[None]],
        depth: int,
        group: int,
        handed: int = 0,
    ) -> None:
        self.lookahead_source = source
        self.prefetch, self.depth, self.group, self.handed = prefetch, depth, group, handed
        self.passes: weakref.WeakSet[_Pass] = weakref.WeakSet()
        self._begun: Iterator[Any] | None = None  # a pass its head start began (workers)
        self.here = False  # this pass is read in the loader's process, not by its workers

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "lookahead_source" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.lookahead_source, name)

    def __len__(self) -> int:
        return len(self.lookahead_source)

    def __iter__(self) -> Iterator[Any]:
        begun, self._begun = self._begun, None
        return begun or self._pass(iter(self.lookahead_source))

    def _pass(self, items: Iterator[Any], head: Sequence[Any] = ()) -> Iterator[Any]:
        """A pass over ``items``; ``head`` (batches) taken from them already, prefetched now."""
        one = _Pass(self.prefetch, self.depth, 0 if self.here else self.handed)
        self.passes.add(one)
        one.started.extend(map(self.prefetch, head))
        return one.run(items, self.group)

    def head_start(self) -> None:
        """Begin the next pass now, caching its first batches in this process while the
        workers start: ``depth`` beyond those the workers are handed first, where their own
        lookahead begins.

        A worker's start waits for the forkserver's imports (about 1 s here), and a cold first
        batch waited for it with this process idle.
        """
        self.close()  # a head start never taken
        items, size = iter(self.lookahead_source), max(self.group, 1)
        taken = list(itertools.islice(items, (self.depth + self.handed) * size))
        head = [taken[i : i + size] for i in range(0, len(taken), size)] if self.group else taken
        self._begun = self._pass(itertools.chain(taken, items), head)

    def head_end(self) -> None:
        """The workers have started: leave the head start's batches not begun to them."""
        for one in list(self.passes):
            for future in one.started:
                future.cancel()

    def close(self) -> None:
        self._begun = None
        for one in list(self.passes):
            one.close()


class _ShardedLookahead(_Lookahead, tud.DistributedSampler[Any]):
    """A lookahead around a sampler that shards over the ranks itself (a
    ``DistributedSampler``: fastload's own), and says so as its source does: frameworks that
    shard a loader's sampler unless it is one (Lightning, Ray Train) leave it alone."""

    def set_epoch(self, epoch: int) -> None:
        self.lookahead_source.set_epoch(epoch)


def _lookahead(
    source: Any, prefetch: Callable[[Any], Future[None]], depth: int, group: int, handed: int
) -> _Lookahead:
    """A :class:`_Lookahead` around ``source``, a distributed one around a distributed one."""
    sharded = isinstance(source, tud.DistributedSampler)
    return (_ShardedLookahead if sharded else _Lookahead)(source, prefetch, depth, group, handed)


def _permutation_in(order: Any) -> PermutationSampler | None:
    """The PermutationSampler a loader's order comes from: itself, or inside the lookahead
    and batch samplers around it (a framework's, too: Lightning's prediction wraps the batch
    sampler)."""
    for _ in range(4):
        if isinstance(order, PermutationSampler):
            return order
        inner = getattr(order, "lookahead_source", None)
        order = inner if inner is not None else getattr(order, "sampler", None)
    return None


class _Pass:
    """One pass of a :class:`_Lookahead`: the prefetches it started, or (``handed``: workers)
    the batch it is to hand a worker next."""

    def __init__(self, prefetch: Callable[[Any], Future[None]], depth: int, handed: int) -> None:
        self.prefetch, self.depth, self.handed = prefetch, depth, handed
        self.started: deque[Future[None]] = deque()
        self.newest: Sequence[Any] | None = None  # entered the window, not handed yet

    def _start(self, batch: Sequence[Any]) -> None:
        if self.handed:
            self.newest = batch
            return
        self.started.append(self.prefetch(batch))  # as it enters the window
        if len(self.started) > self.depth + 1:
            self.started.popleft()

    def run(self, items: Iterator[Any], group: int) -> Iterator[Any]:
        window = (self.depth + self.handed) * max(group, 1)
        ahead: deque[Any] = deque()
        given = 0  # items handed on
        # a batch's indices taken at once (a step per index cost a warm sample 1 µs)
        batches = iter(lambda: list(itertools.islice(items, group)), []) if group else items
        try:
            for batch in batches:
                self._start(batch)
                if group:
                    ahead.extend(batch)
                else:
                    ahead.append(batch)
                while len(ahead) > window:
                    yield self._given(ahead.popleft(), given, group)
                    given += 1
            for item in ahead:
                yield self._given(item, given, group)
                given += 1
        finally:
            self.close()

    def _given(self, item: Any, given: int, group: int) -> Any:
        """``item`` (the ``given``-th index, or a batch if ``group`` is 0), carrying the newest
        batch to cache when it starts a batch and one is waiting (workers only)."""
        newest = self.newest  # only ever set with workers
        inside = given % group if group else not len(item)  # not a batch's first index
        if newest is None or inside:
            return item
        self.newest = None
        return _Ahead(item, newest) if group else [_Ahead(item[0], newest), *item[1:]]

    def close(self) -> None:
        """Cancel the prefetches not started; wait for those running (none outlives a pass)."""
        started = list(self.started)
        self.started.clear()
        for future in started:
            future.cancel()
        wait(started)
