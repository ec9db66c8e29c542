"""Map-style datasets: objects as they are in the store, and a cache around any dataset.

Both implement ``__getitems__``, which torch's DataLoader calls with a whole batch of indices:
the batch's missing samples are fetched concurrently (one request per object, all in flight at
once) instead of one after another.
"""

from __future__ import annotations

import json
import logging
import operator
import os
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from torch.utils.data import Dataset, get_worker_info

from fastload._contract import BatchHead, Filled, opened
from fastload._handoff import HANDOFF_BYTES, Handoff
from fastload.cache import Cache
from fastload.cache._tree import flatten
from fastload.cache._worth import Worth, Wrap
from fastload.config import FetchConfig
from fastload.errors import (
    CacheError,
    ConfigError,
    DecodeError,
    ObjectChangedError,
    StoreError,
    TransientStoreError,
    UnsupportedSampleError,
)
from fastload.fetcher import Fetcher
from fastload.manifest import (
    Manifest,
    ManifestChanges,
    current,
    save_listing,
    saved_or_listed,
)
from fastload.ranks import rank_world
from fastload.resources import PerProcess
from fastload.sources import DecodeSpec, Opening, Sample, SampleSource, Source, refreshed
from fastload.sources.labels import Labels, LabelSource
from fastload.sources.registry import as_source
from fastload.stats import CacheStats, DatasetStats, FetchStats, StageCounters
from fastload.stores import storage_options_of
from fastload.transforms import fingerprint, state_print

__all__ = ["CachedDataset", "RemoteDataset"]

log = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]
OnChange = Literal["raise", "skip", "refresh"]
Read = Literal["read", "ahead", "filled"]
"""How a batch is read: ``read`` (the loop's batch), ``ahead`` (made by the lookahead and held
for the read of its batch, :class:`Handoff`), ``filled`` (a worker made or found every sample
and counted it as a cache hit or miss: read back without counting it again)."""
_REPLACE_ROUNDS = 8  # how far on_error="skip" looks for stand-ins when a whole batch failed
PREFETCH_BATCHES = 4
"""Batches :meth:`RemoteDataset.prefetch` works on at once (per process)."""
_prefetchers: PerProcess[str, ThreadPoolExecutor] = PerProcess("prefetch pools")
_WARM_STREAK = 8  # batches prefetch found cached before it checks only one in _WARM_PROBE
_WARM_PROBE = 8
_DONE: Future[None] = Future()  # what a prefetch with nothing to do returns
_DONE.set_result(None)


def _unlooked(found: int) -> bool:
    """Whether a batch, the ``found``-th in a row since one had a sample missing from the
    cache, goes unchecked: after ``_WARM_STREAK`` found whole, all but one in ``_WARM_PROBE``."""
    return found > _WARM_STREAK and found % _WARM_PROBE != 0


def _why_remade(max_bytes: int | None) -> str:
    """What evicts a filled batch before its read: the budget, or (with none) something else."""
    if max_bytes is None:
        return (
            "the cache has no budget, so something else removed them (a 'fastload cache' clear "
            "or prune, or entries found damaged and dropped)"
        )
    return (
        f"the cache's max_bytes ({max_bytes / 2**20:.0f} MiB) is smaller than what the workers "
        "cache ahead; give it more room (or collate_fn=torch.utils.data.default_collate, which "
        "sends the workers' batches instead)"
    )


class _Batched(Dataset[Any]):
    """What both datasets share: a batch of indices in, its samples out; ``on_error``,
    ``augment``, ``limit``, ``warm``, ``prefetch`` (the loader's lookahead) and the counters.
    It keeps the dataset's side of :class:`fastload._contract.LoaderDataset`.

    A subclass makes the samples of a batch (:meth:`_items`: a failure sits in its slot as an
    exception) and names them (:meth:`_cache_names` for the cache, :meth:`_display` in reports).
    """

    cache: Cache | None
    on_error: OnError
    on_change: OnChange | None = None  # RemoteDataset's: changed objects, apart from on_error
    augment: Callable[[Any], Any] | None
    counters: StageCounters
    """This process's live counters: ``dataset``, ``fetch`` and ``cache`` (see :meth:`stats`)."""
    _length: int
    _labelled: bool = False
    _warm_batches = 0  # prefetched batches since one had a sample missing from the cache
    _filled_batches = 0  # batches a filling worker found cached since one had a sample missing
    listing_check: Future[ManifestChanges] | None = None
    """RemoteDataset's listing of the store again, in the background (None: none running)."""
    _remade_said = False  # the warning of _remaking, once per process
    _holds_not = False  # with no cache, the lookahead could not hold what it made: it stops

    def _items(self, indices: list[int], how: Read = "read") -> list[Any]:
        """The samples at ``indices`` (a failure sits in its slot as an exception); ``how``:
        see :data:`Read`."""
        raise NotImplementedError

    def _get_many(
        self, names: list[str], produce: Callable[[list[int]], list[Any]], how: Read = "read"
    ) -> list[Any]:
        """``cache.get_many(names, produce)``, with the samples the lookahead made and held
        taken instead of read back (see :data:`Read`)."""
        cache = self.cache
        assert cache is not None
        counted = how != "filled"  # a worker counted those
        if not counted:
            produce = self._remaking(produce, cache)

        def get(at: list[int]) -> list[Any]:
            if len(at) == len(names):  # nothing held: the whole batch
                return cache.get_many(names, produce, counted=counted)
            return cache.get_many(
                [names[p] for p in at], lambda q: produce([at[i] for i in q]), counted=counted
            )

        return self._handed(names, get, how)

    def _handed(
        self, keys: Sequence[Hashable], produce: Callable[[list[int]], list[Any]], how: Read
    ) -> list[Any]:
        """``produce``'s samples at positions of ``keys``: made ahead and held (``ahead``), or
        with those the lookahead made and holds taken instead (with workers, what the head start
        made: DataLoader)."""
        handoff = self._handoff_here()
        if how == "ahead":
            made = produce(list(range(len(keys))))
            if handoff.keep(keys, made) and self._cacheless() and not self._holds_not:
                self._holds_not = True  # made again at their read: a lookahead would cost twice
                log.info(
                    "%r: the lookahead stops (no cache): its samples cannot be held in memory "
                    "for their read (too large for %d MiB, or of a kind it cannot size)",
                    self,
                    HANDOFF_BYTES >> 20,
                )
            return made
        held = handoff.take(keys)
        if not held:
            return produce(list(range(len(keys))))
        rest = [p for p in range(len(keys)) if p not in held]
        if rest:
            held.update(zip(rest, produce(rest), strict=True))
        return [held[p] for p in range(len(keys))]

    def _remaking(
        self, produce: Callable[[list[int]], list[Any]], cache: Cache
    ) -> Callable[[list[int]], list[Any]]:
        """``produce`` for a batch a DataLoader worker made and cached: what it makes again
        (gone before this process read it back) is said once, with the likely cause."""

        def again(positions: list[int]) -> list[Any]:
            if not self._remade_said:
                self._remade_said = True
                log.warning(
                    "samples a DataLoader worker had cached were gone before the loop's process "
                    "read them, and are made again there (each costs twice): %s",
                    _why_remade(cache.max_bytes),
                )
            return produce(positions)

        return again

    def _handoff_here(self) -> Handoff:
        """This process's :class:`Handoff` (a new one in a forked worker)."""
        handoff: Handoff | None = self.__dict__.get("_handoff")
        if handoff is None or handoff.pid != os.getpid():
            handoff = self.__dict__["_handoff"] = Handoff()
        return handoff

    def _cache_names(self, indices: list[int]) -> list[str]:
        raise NotImplementedError

    def _display(self, index: int) -> str:
        raise NotImplementedError

    def __len__(self) -> int:
        return self._length

    @property
    def blocks(self) -> np.ndarray | None:
        """The first sample of each chunk read as one, for shard-aware shuffling (None: each
        sample is read on its own)."""
        return None

    def __getitem__(self, index: int | BatchHead) -> Any:
        positions, _ = self._positions([index])
        return self._settled(positions, self._items(positions))[0]

    def __getitems__(self, indices: Sequence[int | BatchHead]) -> list[Any] | Filled:
        positions, fill = self._positions(indices)
        items = self._fill(positions) if fill else self._items(positions)
        return items if isinstance(items, Filled) else self._settled(positions, items)

    def _positions(self, indices: Sequence[int | BatchHead]) -> tuple[list[int], bool]:
        """Checked positions of ``indices``, and whether to only fill the cache with their
        samples: a batch a fastload.DataLoader hands a worker may start with a
        :class:`BatchHead` that says so, and names a batch further on to cache in the
        background (which another worker may read: nothing is held)."""
        plain, head = opened(indices)
        if head is not None and head.ahead and self.cache is not None:
            self._prefetch(head.ahead, hold=False)
        return [self._index(i) for i in plain], head is not None and head.fill

    def _settled(self, positions: list[int], items: list[Any]) -> list[Any]:
        """``items`` with their failures raised or skipped, counted, augmented."""
        if any(isinstance(item, BaseException) for item in items):
            items = self._settle(positions, items)
        self.counters.dataset.samples += len(items)
        return items if self.augment is None else [self._augmented(item) for item in items]

    def _fill(self, positions: list[int]) -> Filled | list[Any]:
        """Make and cache the samples of ``positions`` missing from the cache: :class:`Filled`
        when all are there now (each counted as a cache hit or miss here), else the batch's
        items (failures in their slots) to settle here as usual. Nothing is made twice.

        On a warm streak (:func:`_unlooked`) the cache is not looked at: the loop's process
        reads the batch as its own (a look costs a worker about 2.4 µs a sample, on the same
        cores as the reads; a sample missing then is made there)."""
        cache = self.cache
        if cache is None or not self.fillable():
            return self._items(positions)
        self._filled_batches += 1
        if _unlooked(self._filled_batches):
            return Filled(positions, looked=False)
        there = cache.contains_many(self._cache_names(positions))
        missing = list(dict.fromkeys(p for p, hit in zip(positions, there, strict=True) if not hit))
        if missing:
            self._filled_batches = 0
        cache.counters.hits += len(positions) - len(missing)
        made = dict(zip(missing, self._items(missing) if missing else [], strict=True))
        failed = any(isinstance(item, BaseException) for item in made.values())
        if not failed and self._reads_cache():  # not bypassed meanwhile: all are cached
            return Filled(positions)
        rest = [p for p in dict.fromkeys(positions) if p not in made]
        made.update(zip(rest, self._items(rest) if rest else [], strict=True))
        return [made[p] for p in positions]

    def fillable(self) -> bool:
        """Whether DataLoader workers may only fill the cache and leave the reads to the loop's
        process: reads go through a cache that keeps what is made, and nothing is done per
        read (``augment``)."""
        cache = self.cache
        return (
            cache is not None
            and self._reads_cache()
            and not cache.read_only
            and not cache.full
            and self.augment is None
        )

    def _reads_cache(self) -> bool:
        return self.cache is not None

    def workers_fill(self) -> None:
        """See :class:`fastload._contract.LoaderDataset`: nothing to leave here."""

    def _cacheless(self) -> bool:
        """Whether samples are made on every read: no cache, or one bypassed (RemoteDataset)."""
        return self.cache is None

    def _force_cache(self) -> None:
        """Cache what is made from now on (an explicit fill: :meth:`warm`)."""

    def read_filled(self, filled: Filled) -> list[Any]:
        """The samples of a worker's :class:`Filled` batch, read from the cache here."""
        how: Read = "filled" if filled.looked else "read"
        return self._settled(filled.indices, self._items(filled.indices, how))

    def _augmented(self, item: Any) -> Any:
        augment = self.augment
        assert augment is not None
        started = time.perf_counter()
        try:
            if self._labelled:
                sample, label = item
                return augment(sample), label
            return augment(item)
        finally:
            self.counters.dataset.augment.add(time.perf_counter() - started)

    def _index(self, index: int) -> int:
        try:  # numpy and torch integers too; int() would take 2.7 as 2 and "2" as 2
            index = operator.index(index)
        except TypeError:
            raise TypeError(
                f"{type(self).__name__} indices must be integers, got "
                f"{type(index).__name__} {index!r}"
            ) from None
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is out of range for {len(self)} samples")
        return index % len(self)

    def _settle(self, indices: list[int], items: list[Any]) -> list[Any]:
        """Raise the first failure that may not be skipped, or put stand-ins in the failed
        slots (``on_error="skip"``, ``on_change="skip"``)."""
        good = self._skipped(indices, items)
        if not good:
            good = self._stand_ins(indices[0])
        return [
            good[i % len(good)] if isinstance(item, BaseException) else item
            for i, item in enumerate(items)
        ]

    def _skipped(self, indices: list[int], items: list[Any]) -> list[Any]:
        """The good ``items`` (of the samples at ``indices``), after skipping the failed ones,
        or the failure to raise.

        A transient failure (the store answered nothing good within the retry budget) is
        skipped, as a quarantined object, only beside samples that were read: when nothing
        could be read, the store is out, and an outage is never a bad object.
        """
        good = [item for item in items if not isinstance(item, BaseException)]
        failed = [
            (i, item)
            for i, item in zip(indices, items, strict=True)
            if isinstance(item, BaseException)
        ]
        for _, error in failed:
            policy = self.on_error
            if isinstance(error, ObjectChangedError) and self.on_change in ("raise", "skip"):
                policy = self.on_change
            if policy == "raise" or (not good and isinstance(error, TransientStoreError)):
                raise error
        for index, error in failed:
            self._skip(error, index)
        return good

    def _skip(self, error: BaseException, index: int) -> None:
        """Count a skipped sample; the first time, name it (the error's object, else the
        sample's own name) in ``skipped_keys`` and the log."""
        key = str(getattr(error, "url", "") or self._display(index))
        self.counters.dataset.skipped += 1
        if key not in self.counters.dataset.skipped_keys:
            self.counters.dataset.skipped_keys.append(key)
            log.warning("skipping a sample: %s", error)

    def _stand_ins(self, index: int) -> list[Any]:
        """Samples after ``index`` for a batch in which every sample failed."""
        n = len(self)
        for step in range(1, _REPLACE_ROUNDS + 1):
            candidates = [(index + step * k) % n for k in range(1, 5)]
            good = self._skipped(candidates, self._items(candidates))
            if good:
                return good
        raise ConfigError(
            f"on_error='skip' found no readable sample near index {index} after "
            f"{_REPLACE_ROUNDS * 4} tries; skipped so far: {self.counters.dataset.skipped_keys[:5]}"
        )

    def warm(self, indices: Sequence[int]) -> list[tuple[str, BaseException]]:
        """Cache ``indices`` now (one concurrent batch); the ``(name, error)`` of each failure
        (nothing is raised or skipped: ``fastload warm-cache`` reports them)."""
        if self.cache is None:
            raise ConfigError(f"{type(self).__name__}.warm needs a cache to fill")
        self._force_cache()
        positions = [self._index(i) for i in indices]
        results = self._items(positions)
        return [
            (self._display(i), result)
            for i, result in zip(positions, results, strict=True)
            if isinstance(result, BaseException)
        ]

    def prefetch(self, indices: Sequence[int]) -> Future[None]:
        """Make ``indices`` in the background; their read soon takes what it made.

        With a cache, they are cached (later reads hit); entries already there are skipped:
        the index is looked at here, once per batch, before anything is handed to a thread.
        After ``_WARM_STREAK`` batches with nothing missing, only one batch in
        ``_WARM_PROBE`` is checked until one misses again: a batch left unchecked that
        misses is made when it is read. Without a cache, nothing is kept beyond their read.

        A loader that knows the sampler's order calls this for the batches ahead. What it
        makes is held in memory (up to ``HANDOFF_BYTES``) for the read of the batch, which
        then need not read it back from the cache or make it again: so a batch whose read is
        slow (a request in a store's tail) holds up its own read, not the batches behind it.
        """
        return self._prefetch(indices, hold=True)

    def _prefetch(self, indices: Sequence[int], hold: bool) -> Future[None]:
        cache = self.cache
        if cache is None or self._cacheless():
            if not hold or self._holds_not or not self._handoff_here().room():
                return _DONE  # made at their read
            positions = [self._index(i) for i in indices]
            return self._ahead(positions, positions, hold)
        self._warm_batches += 1
        if _unlooked(self._warm_batches) or cache.full:
            return _DONE  # a warm cache: one batch in _WARM_PROBE is checked (a look per
            # sample competes with the reads); a full one would keep nothing
        positions = [self._index(i) for i in indices]
        # checked here: handing the check to a thread cost about 0.8 ms a batch on 2 cores
        # (the threads' hand-offs of the GIL), the check itself about 0.1 ms
        names = self._cache_names(positions)
        there = cache.contains_many(names)
        missing = [i for i, hit in enumerate(there) if not hit]
        if not missing:
            return _DONE
        self._warm_batches = 0
        return self._ahead([positions[i] for i in missing], [names[i] for i in missing], hold)

    def _ahead(self, positions: list[int], keys: Sequence[Hashable], hold: bool) -> Future[None]:
        """Make ``positions`` in a prefetch thread; held for their read (``hold``: their
        ``keys`` said to be in the making now, so a read of them waits, even before a thread
        takes the work up) or only cached."""
        executor = _prefetchers.get(
            "prefetch", lambda: ThreadPoolExecutor(PREFETCH_BATCHES, "fastload-prefetch")
        )
        how: Read = "ahead" if hold else "read"

        def run() -> None:
            self._items(positions, how)

        if not hold:
            return executor.submit(run)
        ended = self._handoff_here().making(keys)
        try:
            future = executor.submit(run)
        except BaseException:
            ended()
            raise
        future.add_done_callback(lambda _: ended())
        return future

    def stats(self) -> dict[str, Any]:
        """A snapshot of this process's counters (samples, skips, preprocessing time, fetch,
        cache), with the cache's bytes on disk."""
        out: dict[str, Any] = self.counters.snapshot()
        if self.cache is not None:
            out["cache"] = self.cache.stats()
        return out


class RemoteDataset(_Batched):
    """The samples of a source (objects under a URL, or in a :class:`Manifest`, or a source
    object: :class:`fastload.Groups`, :class:`fastload.Tar`, :class:`fastload.Parquet`),
    decoded, transformed and cached.

    ``dataset[i]`` is ``transform(decode(payload))``, or ``(sample, label)`` when the manifest
    has labels (or ``labels=`` joins them).

    source: a URL or a :class:`Manifest` (each object is a sample: :class:`fastload.Objects`),
        or a source object carrying where its samples are (a URL or Manifest, a key
        ``pattern``, where the listing is saved) and the options of its shape: several
        objects per sample (:class:`fastload.Groups`), many samples inside each object, read
        in place (:class:`fastload.Tar`, :class:`fastload.Parquet`). See docs/shapes.md.
    decode: a decoder name (``"image"``, ``"npy"``, ...), a callable, or None: the payload as
        read (bytes; ``{member: bytes}`` for groups and tar samples, which may also be decoded
        member by member: ``decode="tiff"`` or ``{"*.tiff": "tiff", "*.json": my_json}``; a
        parquet row's ``{column: value}``).
    transform: deterministic preprocessing, cached with the sample.
    augment: random augmentation applied after the cache on every read (never cached).
    cache: a :class:`fastload.Cache`; entries are keyed by object URL (or group), version and
        the fingerprints of ``decode`` and ``transform``, so a changed object or a changed
        transform is fetched and computed again.
    labels: each object's (or group's) label: a mapping or CSV/JSON file by key, a callable
        ``key -> label``, ``"folders"`` (the folder holding each object, as torchvision's
        ImageFolder), or :class:`fastload.Labels` naming a file's columns and the class
        names (``Labels("folders", classes=train.classes)``).
    on_error: ``"raise"`` stops at the first sample that cannot be fetched or decoded;
        ``"skip"`` puts another sample of the batch in its place (batches keep their size), logs
        its name once and lists it in :meth:`stats` (a group is skipped whole; a shard that
        cannot be indexed is left out, named).
    on_change: what to do with an object replaced since the manifest was listed (its bytes are
        never used under the old version): ``"raise"`` :class:`fastload.ObjectChangedError`,
        ``"skip"`` it as ``on_error="skip"`` does, or ``"refresh"``: read its current version
        (one stat) and cache it under that, counted in ``counters.dataset.refreshed``;
        shards cannot be refreshed mid-epoch (their samples would move): list them again.
        Default: as ``on_error``.
    limit: use only the first ``limit`` samples (a quick debug run).
    storage_options: the store's options, as fsspec's (credentials, ``endpoint_url``, ...).
    fetch_config: timeouts, retries, requests in flight (default :meth:`FetchConfig.from_env`).

    A saved listing of a URL (in ``cache``'s folder, or the source's ``manifest_path``) is used
    at once and listed again in the background (:attr:`listing_check`): if the store's listing
    changed, a warning says how and the next start uses the new one.
    """

    def __init__(
        self,
        source: str | Manifest | Source,
        *,
        decode: DecodeSpec = None,
        transform: Callable[[Any], Any] | None = None,
        augment: Callable[[Any], Any] | None = None,
        cache: Cache | None = None,
        labels: Labels | LabelSource | None = None,
        on_error: OnError = "raise",
        on_change: OnChange | None = None,
        limit: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        fetch_config: FetchConfig | None = None,
    ) -> None:
        storage_options = storage_options_of(storage_options)
        spec = as_source(source)
        labelled = Labels.of(labels)
        _check_arguments(
            spec, on_error=on_error, on_change=on_change, limit=limit, cache=cache, labels=labelled
        )
        self.decode = spec.decoder(decode)  # a wrong one fails before any listing
        listing = None
        if isinstance(spec.where, Manifest):
            manifest = spec.where
            manifest = manifest if spec.pattern is None else manifest.filter(pattern=spec.pattern)
            self.listing_check: Future[ManifestChanges] | None = None
        else:
            listing = _listing_path(
                spec.where, spec.pattern, spec.manifest_path, cache, storage_options
            )
            manifest, self.listing_check = self._listing(
                spec.where,
                listing,
                spec.reuse_listing,
                pattern=spec.pattern,
                storage_options=storage_options,
                fetch_config=fetch_config,
            )
        self.fetcher = Fetcher(storage_options, fetch_config or FetchConfig.from_env())
        self.source: SampleSource = spec.open(
            manifest, Opening(self.fetcher, cache, on_error, labelled)
        )
        self.manifest = self.source.manifest  # with what the source keeps: save it to reuse it
        if listing is not None and rank_world()[0] == 0:
            _save_kept(manifest, self.manifest, listing)  # a restart indexes no shard again
        self._length = len(self.source) if limit is None else min(limit, len(self.source))
        if self._length == 0:
            raise ConfigError(f"RemoteDataset has no samples: {manifest.root}")
        self._labelled = self.source[0].label is not None
        self.transform = transform
        self.augment = augment
        self.cache = cache
        self.on_error = on_error
        self.on_change: OnChange = on_change or on_error
        self._storage_options = storage_options
        self._fresh: dict[int, Sample] = {}  # samples refreshed to their objects' new versions
        self.fingerprint = f"{fingerprint(self.decode)}|{fingerprint(transform)}"
        if self.source.reader_version:  # a fixed reader makes its samples again
            self.fingerprint += f"|{self.source.reader_version}"
        self.counters = StageCounters(
            DatasetStats(left_out=list(self.source.left_out)),
            self.fetcher.counters,
            CacheStats() if cache is None else cache.counters,
        )
        judge = cache is not None and not cache.always and not cache.read_only
        self._worth = Worth(
            self.source.root,
            self.blocks,
            self._length,
            self.counters.cache,
            judge=judge,
            bypassing=self.source.uncached,
        )

    @property
    def classes(self) -> tuple[str, ...] | None:
        """Label names, when labels were strings (labels are their indices)."""
        return self.source.classes

    def __getstate__(self) -> dict[str, Any]:
        """A copy for DataLoader workers: the listing check stays with this process (a future
        holds a lock, which does not pickle, and the check is rank 0's alone)."""
        return {**self.__dict__, "listing_check": None}

    @staticmethod
    def _listing(
        url: str,
        path: Path | None,
        reuse: bool,
        *,
        pattern: str | None,
        storage_options: Mapping[str, Any] | None,
        fetch_config: FetchConfig | None,
    ) -> tuple[Manifest, Future[ManifestChanges] | None]:
        if path is None or not reuse:
            manifest = Manifest.build(
                url, pattern=pattern, storage_options=storage_options, fetch_config=fetch_config
            )
            if path is not None:
                save_listing(manifest, path)
            return manifest, None
        return saved_or_listed(
            url, path, pattern=pattern, storage_options=storage_options, fetch_config=fetch_config
        )

    def __repr__(self) -> str:
        return f"RemoteDataset({self.source.root!r}, n={len(self)}, cache={self.cache!r})"

    def _items(self, indices: list[int], how: Read = "read") -> list[Any]:
        if self._reads_cache():
            return self._cached(indices, how)
        if self._cacheless():  # what the lookahead made ahead, held by position
            return self._handed(
                indices, lambda at: self._samples([self._sample(indices[p]) for p in at]), how
            )
        return self._samples([self._sample(i) for i in indices])

    def _reads_cache(self) -> bool:
        return self.cache is not None and self.on_change != "refresh" and not self._cacheless()

    def _cacheless(self) -> bool:
        return self.cache is None or self._worth.bypassed

    def _force_cache(self) -> None:
        self._worth.force()

    def workers_fill(self) -> None:
        self._worth.defer()

    def _cached(self, indices: list[int], how: Read) -> list[Any]:
        """:meth:`_samples` through the cache, with no :class:`Sample` made for a sample the
        cache holds (they cost a warm batch about a tenth of its CPU). The first batches made
        are timed, to judge whether the cache pays (:class:`fastload.cache._worth.Worth`)."""
        if self._worth.judging:
            return self._worth.timed(
                indices, lambda wrap: self._through_cache(indices, how, wrap), self._read_back
            )
        return self._through_cache(indices, how)

    def _through_cache(self, indices: list[int], how: Read, wrap: Wrap | None = None) -> list[Any]:
        found = self.source.identities(indices)

        def make(positions: list[int]) -> list[Any]:
            return self._produce([self._sample(indices[p]) for p in positions])

        made = self._get_many(self._names(found), make if wrap is None else wrap(make), how)
        return self._with_labels(made, [label for _, _, label in found])

    def _read_back(self, indices: Sequence[int]) -> None:
        """Read the entries of ``indices`` just stored, as a later epoch does (uncounted)."""
        assert self.cache is not None
        names = self._names(self.source.identities(indices))
        gone = CacheError(f"evicted before it was read back: {self.cache.root}")
        self.cache.get_many(names, lambda positions: [gone] * len(positions), counted=False)

    def _sample(self, index: int) -> Sample:
        return self._fresh.get(index) or self.source[index]

    @property
    def blocks(self) -> np.ndarray | None:
        """The first sample of each chunk read as one (shards), which shard-aware shuffling
        follows (:class:`fastload.DataLoader` does on its own); None for objects and groups."""
        blocks = self.source.blocks
        return None if blocks is None else blocks[blocks < len(self)]

    def nbytes(self, indices: Sequence[int] | np.ndarray) -> int:
        """The bytes the samples at ``indices`` read from the store (all their parts)."""
        return self.source.nbytes(indices)

    def _cache_names(self, indices: list[int]) -> list[str]:
        return self._names(self.source.identities(indices))

    def _names(self, found: list[tuple[str, str, int | None]]) -> list[str]:
        """The cache names of samples of these identities (URL, version, label)."""
        return [Cache.name(url, version, self.fingerprint) for url, version, _ in found]

    def _display(self, index: int) -> str:
        return self._sample(index).url

    def _name(self, sample: Sample) -> str:
        return Cache.name(sample.url, sample.version, self.fingerprint)

    def _samples(self, samples: list[Sample]) -> list[Any]:
        """Samples (with labels) in order; a failure sits in its slot as an exception."""
        made = self._made(samples)
        if self.on_change == "refresh":
            made = self._refreshed(samples, made)
        return self._with_labels(made, [s.label for s in samples])

    def _with_labels(self, made: list[Any], labels: list[int | None]) -> list[Any]:
        """``(sample, label)`` pairs when the dataset has labels; failures stay as they are."""
        if not self._labelled:
            return made
        return [
            m if isinstance(m, BaseException) else (m, label)
            for m, label in zip(made, labels, strict=True)
        ]

    def _made(self, samples: list[Sample]) -> list[Any]:
        if self._cacheless():
            if self.cache is not None:
                self.counters.cache.bypassed += len(samples)
            return self._produce(samples)
        assert self.cache is not None
        names = [self._name(s) for s in samples]
        return self.cache.get_many(names, lambda pos: self._produce([samples[p] for p in pos]))

    def _refreshed(self, samples: list[Sample], made: list[Any]) -> list[Any]:
        """``made`` with each sample whose object changed read again at its current version."""
        stale = [i for i, item in enumerate(made) if isinstance(item, ObjectChangedError)]
        if not stale:
            return made
        fresh = []
        for i in stale:
            sample = samples[i]
            try:
                now = [replace(p, **current(p.url, self._storage_options)) for p in sample.parts]
            except StoreError as exc:
                made[i] = exc  # deleted since, say
                continue
            log.warning(
                "%s changed since the manifest was built: reading its new version", sample.url
            )
            self._fresh[sample.index] = refreshed(sample, now)
            fresh.append(i)
        again = self._made([self._fresh[samples[i].index] for i in fresh])
        self.counters.dataset.refreshed += sum(
            not isinstance(item, BaseException) for item in again
        )
        for i, item in zip(fresh, again, strict=True):
            made[i] = item
        return made

    @property
    def _undecodable(self) -> dict[tuple[str, str], str]:
        """(url, version) -> why it failed: a sample that failed to decode or transform is not
        read again while this process runs (a corrupt image was fetched every warm epoch);
        its object at another version is. Each failure is raised as a new DecodeError (one
        raised again and again would keep every traceback's frames)."""
        known: dict[tuple[str, str], str] = self.__dict__.setdefault("_failed", {})
        return known

    def _produce(self, samples: list[Sample]) -> list[Any]:
        """Read every sample of the batch at once (its source knows how), then decode and
        transform each. A sample that failed to decode or transform before, at the version it
        has now, fails again without a read (:attr:`_undecodable`)."""
        known = self._undecodable
        todo = [s for s in samples if (s.url, s.version) not in known]
        payloads = iter(self.source.read(todo, self.fetcher) if todo else [])
        made: list[Any] = []
        for sample in samples:
            failed = known.get((sample.url, sample.version))
            if failed is not None:
                made.append(DecodeError(failed, url=sample.url))
                continue
            payload = next(payloads)
            made.append(
                payload if isinstance(payload, BaseException) else self._prepare(payload, sample)
            )
        return made

    def _prepare(self, payload: Any, sample: Sample) -> Any:
        started = time.perf_counter()
        try:
            made = self.decode(payload)
            if self.transform is not None:
                made = self.transform(made)
        except Exception as exc:  # the user's code: name the object, keep the cause
            reason = f"{type(exc).__name__}: {exc}"[:300]
            why = f"cannot decode or transform the sample ({reason})"
            if not isinstance(exc, MemoryError | ConfigError):  # the sample's own failure
                self._undecodable[(sample.url, sample.version)] = (
                    f"{why}; not read again while this process runs"
                )
            return DecodeError(why, url=sample.url)
        finally:
            self.counters.dataset.prepare.add(time.perf_counter() - started)
        return made


def _check_arguments(
    source: Source,
    *,
    on_error: object,
    on_change: object,
    limit: object,
    cache: object,
    labels: Labels | None,
) -> None:
    """Values that can be checked before any listing (which can take minutes)."""
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"RemoteDataset on_error must be 'raise' or 'skip', got {on_error!r}")
    if on_change not in (None, "raise", "skip", "refresh"):
        raise ConfigError(
            f"RemoteDataset on_change must be 'raise', 'skip' or 'refresh', got {on_change!r}"
        )
    if on_change == "refresh" and not source.refreshable:
        raise ConfigError(
            f"on_change='refresh' cannot apply to {source.name} samples (samples inside a "
            "changed object move): build the manifest again, or use on_change='skip'"
        )
    if labels is not None and not source.takes_labels:
        raise ConfigError(
            f"{source.name} samples take no labels=: their labels are inside them (a tar "
            "sample's member, a parquet column): take them out in decode or transform"
        )
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ConfigError(f"RemoteDataset limit must be None or an int >= 1, got {limit!r}")
    if cache is not None and not isinstance(cache, Cache):
        raise ConfigError(f"RemoteDataset cache must be a fastload.Cache, got {cache!r}")


def _save_kept(listed: Manifest, opened: Manifest, path: Path) -> None:
    """Save the listing ``listed`` again at ``path`` with what its source keeps (``opened``'s
    new slots: a grouping, the shards' indexes), so that a restart does not compute it again.
    The source's own view of the listing (labels joined, objects left out) is never saved: the
    listing serves datasets of other options too."""
    new = {slot: kept for slot, kept in opened.kept.items() if listed.kept.get(slot) is not kept}
    if not new or opened.fingerprint != listed.fingerprint:
        return
    for slot, kept in new.items():
        listed = listed.keeping(slot, kept)
    save_listing(listed, path)


def _listing_path(
    url: str,
    pattern: str | None,
    path: str | os.PathLike[str] | None,
    cache: Cache | None,
    storage_options: Mapping[str, Any] | None,
) -> Path | None:
    """Where the listing of ``url`` (keys matching ``pattern``) is saved: ``path``, else in
    ``cache``'s folder, else none."""
    if path is None and cache is not None:
        store = json.dumps(dict(storage_options or {}), sort_keys=True, default=str)
        listed = url if pattern is None else f"{url}\0pattern={pattern}"
        path = cache.manifest_path(f"{listed}\0{store}")
    return None if path is None else Path(path)


def _dataset_print(dataset: Dataset[Any]) -> str:
    """A wrapped dataset's fingerprint: its class, its ``__getitem__`` and its attributes."""
    kind = type(dataset)
    state, unseen = state_print(dataset)
    if unseen:
        log.warning(
            "CachedDataset(%s): the cache cannot tell when the attributes %s change (only "
            "constants and functions are followed): pass version= and change it with them",
            kind.__qualname__,
            unseen,
        )
    return f"{kind.__module__}.{kind.__qualname__}|{fingerprint(kind.__getitem__)}|{state}"


class CachedDataset(_Batched):
    """Any map-style dataset whose samples are computed once, then served from ``cache``.

    The misses of a batch are computed together, through the wrapped dataset's
    ``__getitems__`` when it has one; a :class:`fastload.DataLoader` computes the batches
    ahead (``lookahead``) in the background, and ``fastload warm-cache --dataset module:attr``
    fills the cache before training.

    key: ``key(index)`` names a sample (default: its index). Give one when the order of the
        wrapped dataset can change between runs (e.g. ``lambda i: files[i]``).
    version: bump it when the wrapped dataset's output changes; by default its class name, its
        ``__getitem__`` (as :func:`fastload.transforms.fingerprint` follows a function) and
        what its attributes hold (constants, functions) are used. Attributes holding other
        objects (a DataFrame, a transform object) cannot be followed: a warning names them,
        and ``version`` is then how to say that they changed.
    augment: random augmentation applied after the cache on every read. The wrapped dataset
        must be deterministic: its first computed sample is computed a second time (once per
        run: main process or worker 0) and a difference is warned about, since the cache would
        keep one random draw forever.
    on_error: ``"raise"`` or ``"skip"`` (a sample the wrapped dataset fails on is replaced by
        another of its batch, named by its key, and never cached).
    limit: only the first ``limit`` samples.
    """

    cache: Cache

    def __init__(
        self,
        dataset: Dataset[Any],
        cache: Cache,
        *,
        key: Callable[[int], str] | None = None,
        version: str | None = None,
        augment: Callable[[Any], Any] | None = None,
        on_error: OnError = "raise",
        limit: int | None = None,
    ) -> None:
        if not isinstance(cache, Cache):
            raise ConfigError(f"CachedDataset cache must be a fastload.Cache, got {cache!r}")
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ConfigError(
                "CachedDataset wraps a map-style dataset (with __getitem__ and __len__), "
                f"got {dataset!r}"
            )
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"CachedDataset on_error must be 'raise' or 'skip', got {on_error!r}")
        if limit is not None and (type(limit) is not int or limit < 1):
            raise ConfigError(f"CachedDataset limit must be None or an int >= 1, got {limit!r}")
        self.dataset = dataset
        self.cache = cache
        self.key = key
        self.augment = augment
        self.on_error = on_error
        size = len(dataset)
        self._length = size if limit is None else min(limit, size)
        self.counters = StageCounters(DatasetStats(), FetchStats(), cache.counters)
        self._checked_random = False
        self.fingerprint = version or _dataset_print(dataset)

    def __repr__(self) -> str:
        return f"CachedDataset({self.dataset!r}, {self.cache!r})"

    def _items(self, indices: list[int], how: Read = "read") -> list[Any]:
        names = self._cache_names(indices)
        return self._get_many(names, lambda pos: self._compute([indices[p] for p in pos]), how)

    def _cache_names(self, indices: list[int]) -> list[str]:
        return [Cache.name(self._display(i), "", self.fingerprint) for i in indices]

    def _display(self, index: int) -> str:
        return self.key(index) if self.key is not None else f"index:{int(index)}"

    def _compute(self, indices: list[int]) -> list[Any]:
        started = time.perf_counter()
        items = self._made(indices)
        each = (time.perf_counter() - started) / max(1, len(items))
        for _ in items:
            self.counters.dataset.compute.add(
                each
            )  # the wrapped dataset's time, its reads included
        if not self._checked_random:
            self._checked_random = True
            info = get_worker_info()
            if info is None or info.id == 0:  # one extra computation per run, not per worker
                self._warn_if_random(indices, items)
        return items

    def _made(self, indices: list[int]) -> list[Any]:
        """The wrapped dataset's samples; one it fails on is a DecodeError in its slot."""
        many = getattr(self.dataset, "__getitems__", None)
        if many is None:
            return [self._one(i) for i in indices]
        try:
            return list(many(indices))
        except Exception:
            return [self._one(i) for i in indices]  # find which ones fail

    def _one(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"[:300]
            error = DecodeError(f"the wrapped dataset failed ({reason})", url=self._display(index))
            error.__cause__ = exc
            return error

    def _warn_if_random(self, indices: list[int], items: list[Any]) -> None:
        first = next(
            (
                i
                for i, item in zip(indices, items, strict=True)
                if not isinstance(item, BaseException)
            ),
            None,
        )
        if first is None:
            return
        again = self.dataset[first]
        if not _same(items[indices.index(first)], again):
            log.warning(
                "CachedDataset: %r gave two different samples for %s: its output is random, "
                "and the cache would keep one draw forever. Move the random part to augment= "
                "(applied after the cache on every read).",
                self.dataset,
                self._display(first),
            )


def _same(a: Any, b: Any) -> bool:
    """Whether two samples are equal, leaf by leaf (tensors, arrays, nested containers)."""
    try:
        spec_a, values_a, leaves_a = flatten(a)
        spec_b, values_b, leaves_b = flatten(b)
    except UnsupportedSampleError:
        return True  # the cache refuses such samples anyway
    if spec_a != spec_b or values_a != values_b or len(leaves_a) != len(leaves_b):
        return False
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )
