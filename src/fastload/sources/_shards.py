"""What the shard sources (tar, parquet) share: indexing every shard once, chunks, reading.

A subclass says which objects are its shards (``suffixes``), how one is indexed (``_index``: a
dict of numpy arrays, kept in the dataset's cache by the shard's version), how an index becomes
samples and chunks (``_add``, calling ``_sample`` and ``_chunk``), what a read chunk becomes in
memory (``_load``, ``_weigh``) and how a sample is taken from it (``_payload``).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from fastload.cache import Cache
from fastload.config import ChunkConfig
from fastload.errors import ConfigError, DecodeError, FastloadError, ShardError, StoreError
from fastload.fetcher import Fetcher
from fastload.manifest import Entry, Manifest
from fastload.ranks import on_every_rank
from fastload.sources import Part, Sample, parts_bytes
from fastload.sources._chunks import Chunk, ChunkReader, Decoded
from fastload.sources._indexes import SLOT, ShardIndexes

__all__ = ["Shards"]

log = logging.getLogger(__name__)

OnBad = Literal["raise", "skip"]
_INDEXERS = 32  # shards indexed at once
_EVERY = 30.0  # seconds between lines saying how indexing goes


class Shards:
    """Samples inside shard objects, read chunk by chunk (see the module docstring)."""

    suffixes: tuple[str, ...]  # lower case; keys are matched in any case (.TAR is a shard)
    unreadable: tuple[str, ...] = ()  # the format's names it cannot read in place (.tar.gz)
    kind: str
    index_version: str  # of the index kept in the cache, and of what a sample holds
    classes: tuple[str, ...] | None = None

    def __init__(
        self,
        manifest: Manifest,
        fetcher: Fetcher,
        *,
        cache: Cache | None = None,
        config: ChunkConfig | None = None,
        on_error: OnBad = "raise",
    ) -> None:
        self.root = manifest.root
        self.config = config or ChunkConfig.from_env()
        self.on_error = on_error
        # what on_error="skip" (and a format's incomplete="skip") left out, each with its reason
        self.left_out: list[str] = []
        found = [e for e in manifest if e.key.lower().endswith(self.suffixes)]
        self._refuse_unreadable(manifest)
        if not found:
            raise ConfigError(
                f"no {self.kind} shards ({', '.join(self.suffixes)}) under {self.root} "
                f"(keys look like {manifest.keys()[:3]})"
            )
        if len(found) < len(manifest):
            log.info(
                "%s: %d objects are not %s shards", self.root, len(manifest) - len(found), self.kind
            )
        # bytes that indexing read from the start of a shard, by URL: they seed the chunk
        # memory, so a shard of small members (read whole to be indexed) is not read again
        self._seeds: dict[str, bytes | memoryview] = {}
        self._seed_limit = self.config.memory_bytes // max(1, len(found))
        saved = ShardIndexes.kept_by(manifest)
        stored = {} if saved is None else saved.lookup(self.index_version)
        indexes: list[tuple[Entry, dict[str, np.ndarray]]] = []
        for entry, index in zip(found, self._indexes(found, fetcher, cache, stored), strict=True):
            if isinstance(index, BaseException):
                self._bad(entry, str(index), index)
            elif (fault := self._fault(entry, index)) is not None:
                self._bad(entry, str(fault), fault)
            else:
                indexes.append((entry, index))
        self._check_across(indexes)
        self._add_all(indexes)
        if all((entry.key, entry.version) in stored for entry, _ in indexes):
            self.manifest = manifest
        else:  # saving this manifest saves the indexes: a restart (or another host) reads none
            kept = ShardIndexes.of(self.index_version, indexes).kept()
            self.manifest = manifest.keeping(SLOT, kept)
        if self._count == 0:
            raise ConfigError(
                f"the {len(found)} {self.kind} shards under {self.root} hold no samples"
            )
        self.blocks = np.asarray(self._firsts, dtype=np.int64)
        self.reader = ChunkReader(
            self.config.memory_bytes,
            self._load,
            self._weigh,
            samples=np.diff(self.blocks, append=self._count),
            root=self.root,
            drop_served=cache is not None,  # served samples come from the cache from then on
            decoded=self._decoded(),
        )
        for chunk in self._chunks:
            seed = memoryview(self._seeds.get(chunk.url, b""))
            if chunk.end <= len(seed):
                self.reader.seed(chunk, seed[chunk.start : chunk.end])  # a view: no copy
        self._seeds.clear()

    @property
    def reader_version(self) -> str:
        return self.index_version

    def nbytes(self, indices: Sequence[int] | np.ndarray) -> int:
        return parts_bytes(self, indices)

    def uncached(self) -> None:
        self.reader.keep_served()

    # -- what a format says ----------------------------------------------------------------
    def _index(self, shard: Entry, fetcher: Fetcher) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _fault(self, shard: Entry, index: dict[str, np.ndarray]) -> ShardError | None:
        """What a shard's index, made now or kept by an earlier fastload (which may have checked
        less when it made it), shows to be wrong with the shard, or None."""
        return None

    def _check_across(self, indexes: list[tuple[Entry, dict[str, np.ndarray]]]) -> None:
        """What only all the shards' indexes together can show to be wrong (before ``_add``)."""

    def _add_all(self, indexes: list[tuple[Entry, dict[str, np.ndarray]]]) -> None:
        """The samples and chunks of every shard, in order (``_add`` each), from none."""
        self.shards: list[Entry] = []
        self._chunks: list[Chunk] = []
        self._chunk_shard: list[int] = []
        self._firsts: list[int] = []
        self._count = 0
        for entry, index in indexes:
            self.shards.append(entry)
            self._add(len(self.shards) - 1, entry, index)

    def _add(self, shard: int, entry: Entry, index: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def _name(self, index: int) -> str:
        raise NotImplementedError

    def _load(self, chunk: Chunk, body: bytes | memoryview) -> Any:
        return body

    def _weigh(self, loaded: Any) -> int:
        return len(loaded)

    def _decoded(self) -> Decoded | None:
        """How chunks are kept decoded in the scratch folder that DataLoader workers share (see
        :class:`~fastload.sources._chunks.Decoded`); None: as their bytes."""
        return None

    def _payload(self, index: int, chunk: int, loaded: Any) -> Any:
        raise NotImplementedError

    # -- building --------------------------------------------------------------------------
    def _indexes(
        self,
        shards: list[Entry],
        fetcher: Fetcher,
        cache: Cache | None,
        stored: dict[tuple[str, str], dict[str, np.ndarray]],
    ) -> list[dict[str, np.ndarray] | BaseException]:
        """Every shard's index (or its failure): ``stored`` with the manifest, else from the
        cache when it holds this version, else read from the shard. Under several ranks each
        indexes a share of the shards and all get every index: a job on ``N`` hosts reads
        the shards' headers (for small members, the whole shards) once, not ``N`` times, and
        every rank sees the same shards fail, so all hold the same samples."""

        def made(entry: Entry) -> dict[str, np.ndarray] | BaseException:
            try:
                return self._index(entry, fetcher)
            except FastloadError as exc:
                return exc

        def one(entry: Entry) -> dict[str, np.ndarray] | BaseException:
            if (entry.key, entry.version) in stored:
                return stored[entry.key, entry.version]
            if cache is None:
                return made(entry)
            name = Cache.name(entry.url, entry.version, self.index_version)
            (index,) = cache.get_many([name], lambda _: [made(entry)])
            return index  # type: ignore[no-any-return]

        def part(rank: int, world: int) -> list[dict[str, np.ndarray] | BaseException]:
            mine = todo[rank::world]
            progress = _Progress(
                f"{len(mine)} {self.kind} shards under {self.root}", fetcher, self.config
            )

            def counted(entry: Entry) -> dict[str, np.ndarray] | BaseException:
                index = one(entry)
                progress.one_more()
                return index

            with ThreadPoolExecutor(_INDEXERS, "fastload-index") as pool:
                indexes = list(pool.map(counted, mine))
            progress.done()
            return indexes

        todo = [entry for entry in shards if (entry.key, entry.version) not in stored]
        parts = on_every_rank(part, "shard-indexes") if todo else []
        made_by = {
            (entry.key, entry.version): index
            for rank, indexes in enumerate(parts)
            for entry, index in zip(todo[rank :: len(parts)], indexes, strict=True)
        }
        return [
            made_by[e.key, e.version] if (e.key, e.version) in made_by else stored[e.key, e.version]
            for e in shards
        ]

    def _refuse_unreadable(self, manifest: Manifest) -> None:
        """Shards of this format it cannot read in place (compressed): never left out quietly."""
        unreadable = [e for e in manifest if e.key.lower().endswith(self.unreadable)]
        if unreadable:
            more = f" (and {len(unreadable) - 1} more like it)" if len(unreadable) > 1 else ""
            self._bad(
                unreadable[0],
                f"a compressed {self.kind} shard{more} cannot be read in place: its members "
                "have no byte ranges to read (decompress the shards, e.g. with gunzip)",
            )

    def _bad(self, shard: Entry, message: str, cause: BaseException | None = None) -> None:
        """A shard (or a member of one) that cannot be used: raise, or leave it out and say so."""
        error = cause if isinstance(cause, (StoreError, ShardError)) else None
        if error is None:
            error = ShardError(message, url=shard.url)
            error.__cause__ = cause
        if self.on_error == "raise":
            raise error
        self.left_out.append(str(error))
        log.warning("%s shards (on_error='skip'): leaving out %s", self.kind, error)

    def _chunk(
        self,
        shard: int,
        first: int,
        start: int,
        end: int,
        label: str = "",
        *,
        spans: tuple[tuple[int, int], ...] = (),
    ) -> None:
        entry = self.shards[shard]
        label = label or f"bytes {start}-{end}"
        index = len(self._chunks)
        chunk = Chunk(entry.url, entry.version, entry.size, start, end, label, index, spans)
        self._chunks.append(chunk)
        self._chunk_shard.append(shard)
        self._firsts.append(first)

    # -- reading ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def _chunk_of(self, index: int) -> int:
        """The chunk holding sample ``index`` (a bisection of the chunks' first samples)."""
        return bisect.bisect_right(self._firsts, index) - 1

    def __getitem__(self, index: int) -> Sample:
        c = self._chunk_of(index)
        chunk, entry = self._chunks[c], self.shards[self._chunk_shard[c]]
        name = self._name(index)
        nbytes = sum(b - a for a, b in chunk.ranges) // max(1, self._samples_in(c))
        part = Part(entry.key, entry.url, nbytes, entry.version)
        return Sample(name, f"{entry.url}#{name}", entry.version, (part,), index=index)

    def identities(self, indices: Sequence[int]) -> list[tuple[str, str, int | None]]:
        out: list[tuple[str, str, int | None]] = []
        for index in indices:
            entry = self.shards[self._chunk_shard[self._chunk_of(index)]]
            out.append((f"{entry.url}#{self._name(index)}", entry.version, None))
        return out

    def _samples_in(self, chunk: int) -> int:
        stop = self._firsts[chunk + 1] if chunk + 1 < len(self._firsts) else self._count
        return stop - self._firsts[chunk]

    def read(self, samples: Sequence[Sample], fetcher: Fetcher) -> list[Any]:
        chunk_ids = [self._chunk_of(s.index) for s in samples]
        loaded = self.reader.get([self._chunks[c] for c in chunk_ids], fetcher)
        out: list[Any] = []
        for sample, c in zip(samples, chunk_ids, strict=True):
            chunk = self._chunks[c]
            value = loaded[chunk]
            if isinstance(value, BaseException):
                out.append(_in_chunk(value, sample, chunk))
                continue
            try:
                out.append(self._payload(sample.index, c, value))
            except ShardError as exc:
                out.append(_in_chunk(exc, sample, chunk))
        return out


def _in_chunk(error: BaseException, sample: Sample, chunk: Chunk) -> BaseException:
    """A chunk's failure as the failure of one of its samples (naming sample, shard, chunk)."""
    reason = str(error).removesuffix(f": {chunk.url}")
    message = f"sample {sample.name!r} ({chunk.label} of {chunk.url}): {reason}"
    kind = type(error) if isinstance(error, (StoreError, DecodeError)) else ShardError
    wrapped = kind(message, url=sample.url)
    wrapped.__cause__ = error
    return wrapped


class _Progress:
    """Says at INFO what indexing shards costs: a first start over a large dataset of small
    members reads every byte of it before the first batch (minutes), and says so, where it is
    every ``_EVERY`` seconds, and what it read in all, with a warning where that is more than
    the chunk memory keeps (the samples' reads then read the shards again); a start that
    finds every index saved says nothing."""

    def __init__(self, what: str, fetcher: Fetcher, config: ChunkConfig) -> None:
        self._what, self._fetcher, self._keep = what, fetcher, config.memory_bytes
        self._lock = threading.Lock()
        self._bytes = fetcher.counters.bytes
        self._started = self._said = time.monotonic()
        self._count = 0
        self._read = False

    def one_more(self) -> None:
        with self._lock:
            self._count += 1
            now, read = time.monotonic(), self._fetcher.counters.bytes - self._bytes
            if read and not self._read:
                self._read = True
                log.info(
                    "indexing %s: a shard of small members is read whole (the cache or the "
                    "saved listing keeps the index, so a later start reads none of it)",
                    self._what,
                )
            if read and now - self._said >= _EVERY:
                self._said = now
                log.info(
                    "indexed %d of %s, %.1f GB read in %.0f s",
                    self._count, self._what, read / 1e9, now - self._started,
                )  # fmt: skip

    def done(self) -> None:
        read = self._fetcher.counters.bytes - self._bytes
        if read:
            log.info(
                "indexed %s in %.1f s, %.2f GB read",
                self._what, time.monotonic() - self._started, read / 1e9,
            )  # fmt: skip
        if read > self._keep:
            log.warning(
                "indexing %s read %.2f GB, more than the chunk memory that keeps what it read "
                "(ChunkConfig.memory_bytes, %.2f GB): reading their samples reads the shards "
                "again once (`fastload warm-cache --shards` reads each shard once)",
                self._what, read / 1e9, self._keep / 1e9,
            )  # fmt: skip


def check_chunks(chunks: object) -> None:
    """A shard source's ``chunks=``: None or a ChunkConfig."""
    if chunks is not None and not isinstance(chunks, ChunkConfig):
        raise ConfigError(f"chunks must be a fastload.ChunkConfig, got {chunks!r}")
