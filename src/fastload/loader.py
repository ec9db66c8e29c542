"""torch's DataLoader with defaults for remote data, a stall meter and an exact resume point.

Nothing of torch's loader is forked: :class:`DataLoader` subclasses it and only chooses the
arguments, wraps ``collate_fn``/``worker_init_fn`` (to carry the workers' counters back with each
batch) and wraps the iterator (to time the loop and count what it consumed). Its stages live
beside it: what it needs from a dataset (:mod:`fastload._contract`, checked once), the lookahead
around the sampler (:mod:`fastload._lookahead`), the loading thread
(:mod:`fastload._background`) and the workers' start and returns (:mod:`fastload._workers`).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import wait
from typing import Any, ClassVar

import torch
import torch.utils.data as tud

from fastload import _collate, _lookahead
from fastload._background import Background
from fastload._contract import Filled, LoaderDataset, loader_dataset
from fastload._workers import Returns, WorkerCollate, WorkerInit, fork_safe_context
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
    - a dataset read in chunks (``RemoteDataset(Tar(url))``, ``Parquet``, ``Zarr``: its
      ``blocks``) is shuffled shard-aware: chunks in a new order each epoch, samples shuffled
      within windows of ``BLOCK_WINDOW`` chunks, so a batch reads about that many chunks; under
      torch.distributed each rank takes a contiguous share of the epoch (shuffled or not), so
      a chunk is read by one rank, not by all;
    - ``lookahead``: batches ahead of the loop whose missing samples a caching
      :class:`fastload.RemoteDataset` fetches into its cache in the background: without
      workers in this process, with workers in the workers themselves (each batch a worker
      gets names a batch ``lookahead`` beyond those already handed out, for it to cache), so
      a cold epoch's fetching, decoding and preprocessing spread over the workers; with no
      cache and no workers, this process makes those batches ahead and holds them in memory
      for their reads (up to ``fastload._handoff.HANDOFF_BYTES``), so a batch held up by a
      slow request (a store's tail) does not hold up the batches behind it;
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
        contract = loader_dataset(dataset)  # None: loaded as torch's loader would
        own = sampler is None and batch_sampler is None
        if own and not isinstance(dataset, tud.IterableDataset):
            if shuffle and generator is not None:
                log.warning(
                    "DataLoader: the shuffled order follows seed=%d, not generator= (every rank "
                    "must draw the same order to split it); pass seed= for another order",
                    seed,
                )
            sampler = _own_sampler(dataset, contract, bool(shuffle), seed, follows=not chosen)
            reshuffle, first_epoch, shuffle = bool(shuffle), sampler.epoch, None
        _claim(sampler if batch_sampler is None else batch_sampler, dataset)
        auto_collation = batch_sampler is not None or batch_size is not None
        collate = collate_fn or (
            (tud.default_collate if workers else _collate.collate)
            if auto_collation
            else tud.default_convert
        )
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        # workers fill the cache, this process reads it (see _fills)
        fills = bool(workers) and collate_fn is None and auto_collation and _fills(contract)
        prefetch = _prefetch(contract, lookahead, workers)
        factor = prefetch_factor if prefetch_factor or not workers else 4
        if prefetch is not None or fills:  # see fastload._lookahead
            plan = _lookahead.Plan(prefetch, lookahead, workers * (factor or 0), fills)
            sampler, batch_sampler = plan.around(sampler, batch_sampler, batch_size or 1)
        if workers:
            collate = WorkerCollate(collate, counted=contract is not None)
            worker_init_fn = WorkerInit(worker_init_fn, counted=contract is not None)
            if multiprocessing_context is None:
                multiprocessing_context = fork_safe_context(dataset, collate, worker_init_fn)
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
        self._contract = contract
        self.lookahead = lookahead
        self.fills = fills
        self._pins = fills and pin and _accelerated()
        self.meter = Meter(hooks, log_every, self.batch_size)
        self._consumed = 0  # batches handed to the loop in the current pass
        self._returns = Returns(contract, pins=self._pins)  # what the workers send back
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
        return source.lookahead_source if isinstance(source, _lookahead.Lookahead) else source

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
            source.begin(workers=bool(self.num_workers) and not here)
        if not here:
            if self.fills and self._contract is not None:
                self._contract.workers_fill()
            self._before_fork()
            self._head_start()
        started = time.perf_counter()
        batches: Iterator[Any]
        if here:
            batches = self._read_here()
        else:
            if isinstance(self.worker_init_fn, WorkerInit):
                self.worker_init_fn.started = time.time()  # workers start below (if not running)
            batches = super().__iter__()
            if self.num_workers:
                batches = self._returns.batches(batches, arrived=self._head_end)
        if self.background and (self.num_workers == 0 or self.fills):  # reads in this process
            batches = iter(Background(batches, depth=2))
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
        contract, batches = self._contract, self.batch_sampler
        assert contract is not None and batches is not None  # workers fill: a batched dataset
        for indices in batches:
            samples = contract.__getitems__(indices)
            assert not isinstance(samples, Filled)  # indices without a head: read, not filled
            batch = _collate.collate(samples)
            yield pinned(batch) if self._pins else batch

    def _left_whole(self) -> bool:
        """Whether the pass that just ended left every sample of the dataset in the cache: it
        went through all of them (a permutation, on one rank, not resumed mid-pass; but for a
        last batch dropped), and each it missed was written (or waited for), none evicted,
        skipped, left unstored or served oversize. Workers' counts arrive with their batches,
        so a write not yet counted can only make this say no."""
        now, then, contract = self.counters, self._pass_start, self._contract
        if not self.fills or contract is None or now is None or then is None:
            return False
        permuted = isinstance(self._order, PermutationSampler | tud.SequentialSampler)
        if not (permuted and (self._consumed + 1) * (self.batch_size or 1) > len(contract)):
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
        check = None if self._contract is None else self._contract.listing_check
        if self.num_workers and self._forks and check is not None and not check.done():
            wait([check], timeout=_FORK_WAIT)

    def _head_start(self) -> None:
        """Workers filling the cache start in this pass: its first batches are cached here
        meanwhile (:meth:`fastload._lookahead.Lookahead.head_start`), held for this process's
        reads of them. Not before a fork, which would copy this process's fetches mid-request;
        and only with a core to spare beside the workers: on 2 cores it competed with the
        forkserver's import for the CPU and gained nothing, for 110-160 MB more peak memory
        (docs/benchmarks.md)."""
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
    def _lookaheads(self) -> list[_lookahead.Lookahead]:
        """The lookahead around the sampler or the batch sampler (none without one)."""
        orders = (self.sampler, self.batch_sampler)
        return [s for s in orders if isinstance(s, _lookahead.Lookahead)]

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

    # -- metrics -------------------------------------------------------------------------------
    @property
    def counters(self) -> StageCounters | None:
        """Dataset/fetch/cache counters of this process and every worker so far (None if the
        dataset keeps none); :meth:`stats` is their snapshot."""
        if self._contract is None:
            return None
        total = copy.deepcopy(self._contract.counters)
        total.merge(self._returns.counters)
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


def _own_sampler(
    dataset: Any, contract: LoaderDataset | None, shuffle: bool, seed: int, follows: bool
) -> PermutationSampler:
    """The sampler a loader makes for a map-style dataset: shard-aware over the ``contract``'s
    blocks; shuffled with the default seed (``follows``), at the epoch after the last one a
    loader over as many samples took (:class:`_Epochs`)."""
    if not hasattr(dataset, "__len__"):
        raise ConfigError(f"DataLoader: map-style dataset {dataset!r} has no __len__")
    sampler = PermutationSampler(
        len(dataset),
        shuffle=shuffle,
        seed=seed,
        blocks=None if contract is None else contract.blocks,  # ranks then take whole chunks
        window=BLOCK_WINDOW,
    )
    if shuffle and follows and (epoch := _Epochs.next(sampler.n)):
        sampler.set_epoch(epoch)
    return sampler


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


def _fills(dataset: LoaderDataset | None) -> bool:
    """Whether workers should only fill ``dataset``'s cache and leave the reading to the loop's
    process (:meth:`fastload.RemoteDataset.fillable`).

    A warm batch is then a look at the cache's index in a worker and one read in this process,
    where a worker's batch would cross into this process through fresh shared memory (its
    allocation and a page fault per 4 KB on both sides cost more than the read). Not with a
    ``collate_fn`` of the user's (which may expect to run in a worker).
    """
    return dataset is not None and dataset.fillable()


def _prefetch(
    dataset: LoaderDataset | None, depth: int, workers: int
) -> _lookahead.Prefetch | None:
    """The dataset's ``prefetch`` when a lookahead helps and one is asked for: it caches, or
    this process reads the batches (no workers) and holds what it made for their reads."""
    if depth and dataset is not None and (dataset.cache is not None or not workers):
        return dataset.prefetch
    return None


def _accelerated() -> bool:
    """Whether pinned memory can be had (torch's loader skips ``pin_memory`` otherwise)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return bool(accelerator.is_available() if accelerator else torch.cuda.is_available())


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
