"""Chunks of shards: what the shard sources (tar, parquet) read instead of single samples.

A chunk is a byte range of one shard holding whole samples (a run of tar members, a parquet
row group). The chunks a batch needs are read at once, one ranged request each, and each
process keeps the most recently used ones in memory (``ChunkConfig.memory_bytes``), so the
batches that a shard-aware sampler draws from one chunk cost one read between them. Two
threads that want one chunk at once (the loop and the loader's lookahead) share one read. An
order that is not shard-aware over more chunks than memory holds reads a chunk for nearly every
sample: a warning says so, once per process. Where the samples are cached (``drop_served``), a
chunk whose samples have all been served is let go: the next epoch reads them from the cache.

DataLoader workers get the batches of one chunk in turn, so without more each worker would
read every chunk, and hold a copy of each. Instead the reader's processes share chunks through
its :class:`~fastload.sources._scratch.Scratch` folder (in ``/dev/shm``): a chunk is read by the
first worker that wants it into a file there, and every worker maps that file, so its bytes are
in memory once (see that module). Chunks this process was given already (:meth:`ChunkReader.seed`:
what indexing read) go there when the reader is pickled for a worker, so workers that start by
pickling (forkserver, spawn) do not read them again, and this process then lets its own copies
go; forked workers have them in the memory they share. A source whose chunks are decoded into
values of their own (parquet: a row group's columns) keeps them decoded there instead
(:class:`Decoded`): the first process decodes a chunk, and every process maps what it decoded,
so no worker holds a decoded copy of its own. Without workers a process reads and keeps
chunks in its own memory. A scratch folder that cannot be written (a full disk) costs only the
sharing: the workers then read chunks themselves, and say so once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastload.errors import CacheError, ShardError
from fastload.fetcher import Fetcher, Request
from fastload.sources._scratch import Parts, Scratch
from fastload.sources._scratch import in_memory as _in_memory  # noqa: F401 (tests import it here)

__all__ = ["Chunk", "ChunkReader", "Decoded"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chunk:
    """The byte range ``[start, end)`` of the shard at ``url`` (``size`` bytes, ``version``),
    or only the ``spans`` of it, when given (parquet columns apart: what lies between them is
    not read)."""

    url: str
    version: str
    size: int
    start: int
    end: int
    label: str  # names it in errors: "row group 3", "bytes 0-15728640"
    index: int  # its position among its source's chunks
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The byte ranges read, in order; the chunk's bytes are theirs joined."""
        return self.spans or ((self.start, self.end),)


@dataclass(frozen=True)
class Decoded:
    """How a source keeps its chunks decoded in the scratch folder: ``encode(chunk, body)``
    gives what the chunk's file holds, from the chunk's bytes (run once, by the first process
    that reads the chunk), and ``load(chunk, view)`` the loaded chunk from a read-only mapping of
    that file (in every process: it should copy nothing)."""

    encode: Callable[[Chunk, bytes | memoryview], Parts]
    load: Callable[[Chunk, memoryview], Any]


class ChunkReader:
    """Reads chunks for a batch and keeps recent ones (see the module docstring).

    ``load(chunk, body)`` turns a chunk's bytes into what the source slices samples from (it
    runs once per read; an exception it raises becomes that chunk's failure, not cached), and
    ``weigh`` gives the bytes a loaded chunk holds in memory. ``drop_served``: the samples
    served are cached, so a chunk whose samples have all been served is let go. ``decoded``:
    chunks are kept decoded in the scratch folder (see :class:`Decoded`), not as their bytes.
    """

    def __init__(
        self,
        memory_bytes: int,
        load: Callable[[Chunk, bytes | memoryview], Any],
        weigh: Callable[[Any], int],
        *,
        samples: np.ndarray,
        root: str,
        drop_served: bool = False,
        decoded: Decoded | None = None,
    ) -> None:
        self.memory_bytes = memory_bytes
        self._load, self._weigh, self._decoded = load, weigh, decoded
        # the samples in each chunk (by Chunk.index), which judge the order they are read in
        self._samples, self._root = samples, root
        self._drop_served = drop_served
        self._owner = os.getpid()
        self.shared = Scratch(memory_bytes, samples, drop_served=drop_served)
        self._setup()

    def keep_served(self) -> None:
        """The samples served are no longer cached: keep a chunk whose samples were all served,
        as without a cache (in this process)."""
        self._drop_served = self.shared.drop_served = False

    def _setup(self) -> None:
        self._lock = threading.Lock()
        # each chunk loaded, its weight, and the generation of the scratch file it maps (-1:
        # this process's own bytes)
        self._kept: OrderedDict[Chunk, tuple[Any, int, int]] = OrderedDict()
        self._held = 0
        self._sharing = True  # the scratch folder works (see _unshareable)
        self._handed = False  # pickled for a worker: this process reads through the scratch too
        self._unshared: dict[Chunk, bytes | memoryview] = {}  # seeded, not in ``shared`` yet
        self._reading: dict[Chunk, Future[Any]] = {}
        # by Chunk.index: samples served since the chunk was last read (-1: never read)
        self._served = np.full(len(self._samples), -1, np.int64)
        self._warned = False
        self.reads = 0
        self.early = 0  # chunks read again though their last read served under a quarter
        self.hits = 0
        self.seeded = 0

    def __getstate__(self) -> dict[str, Any]:
        """A worker's copy: nothing kept, the seeded chunks waiting for it in ``shared``."""
        self._share_seeds()
        return {name: self.__dict__[name] for name in _PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def get(self, chunks: Sequence[Chunk], fetcher: Fetcher) -> dict[Chunk, Any]:
        """Each chunk loaded, or the exception its read or load failed with."""
        out: dict[Chunk, Any] = {}
        ours: list[Chunk] = []
        theirs: dict[Chunk, Future[Any]] = {}
        with self._lock:
            self._forget_dropped()
            for chunk in dict.fromkeys(chunks):
                if chunk in self._kept:
                    self._kept.move_to_end(chunk)
                    out[chunk] = self._kept[chunk][0]
                    self.hits += 1
                elif chunk in self._reading:
                    theirs[chunk] = self._reading[chunk]
                else:
                    self._reading[chunk] = Future()
                    ours.append(chunk)
        try:
            if ours:
                self._read(ours, fetcher, out)
        finally:
            with self._lock:  # never leave another thread waiting on a read that died
                for chunk in ours:
                    future = self._reading.pop(chunk, None)
                    if future is not None and not future.done():
                        future.set_exception(ShardError("the read was abandoned", url=chunk.url))
        for chunk, future in theirs.items():
            self.hits += 1
            out[chunk] = future.exception() or future.result()
        self._count_served(chunks, out)
        if ours and not self._warned:
            self._check_order()
        return out

    def _count_served(self, chunks: Sequence[Chunk], out: dict[Chunk, Any]) -> None:
        """Count the samples served (one per chunk in ``chunks``); with ``drop_served``, let
        go of the chunks whose samples have all been served: here, or through the scratch
        folder by all the processes together."""
        counts = Counter(c.index for c in chunks if not isinstance(out[c], BaseException))
        with self._lock:
            for index, count in counts.items():
                if self._served[index] >= 0:
                    self._served[index] += count
        if not self._drop_served:
            return
        if self._through_scratch():
            done = set(self._shared_served(counts))
        else:
            done = {index for index in counts if self._served[index] >= self._samples[index]}
        with self._lock:
            for chunk in [c for c in self._kept if c.index in done]:
                self._forget(chunk)

    def _shared_served(self, counts: Counter[int]) -> list[int]:
        try:
            return self.shared.served(counts)
        except CacheError as exc:
            self._unshareable(exc)
            return []

    def _forget_dropped(self) -> None:
        """Let go of mapped chunks whose scratch file was dropped (under the lock)."""
        for chunk, (_, _, generation) in list(self._kept.items()):
            if generation >= 0 and not self.shared.current(chunk.index, generation):
                self._forget(chunk)

    def _forget(self, chunk: Chunk) -> None:
        _, weight, _ = self._kept.pop(chunk)
        self._held -= weight

    def _check_order(self) -> None:
        """Warn once when the order samples are asked for makes memory drop chunks before they
        serve a quarter of their samples, then read them again: a random order over more chunks
        than memory holds reads a chunk for almost every sample (a shard-aware order reads each
        chunk about once per epoch, and serves all its samples from that read)."""
        if self.early < _EARLY_READS:
            return
        self._warned = True
        log.warning(
            "shard chunks under %s: %d of this process's %d chunk reads read a chunk again that "
            "memory had dropped before it served a quarter of its samples: the samples are not "
            "asked for chunk by chunk, so nearly every sample costs a chunk's read. Shuffle "
            "with fastload.DataLoader(shuffle=True) or fastload.PermutationSampler(len(dataset), "
            "blocks=dataset.blocks), or raise ChunkConfig.memory_bytes (now %d) to hold every "
            "chunk",
            self._root,
            self.early,
            self.reads,
            self.memory_bytes,
        )

    def _fetch(self, chunks: list[Chunk], fetcher: Fetcher) -> list[list[Any] | BaseException]:
        """Each chunk's bytes as the bodies of its ranges, or the first of their failures."""
        requests = [
            Request(c.url, a, b, size=c.size, version=c.version)
            for c in chunks
            for a, b in c.ranges
        ]
        with self._lock:
            self.reads += len(chunks)
            early = sum(self._mark_read(chunk) for chunk in chunks)
            self.early += early
        fetcher.counters.chunks_read_early += early
        bodies = iter(fetcher.fetch(requests, return_exceptions=True, buffers=True))
        return [_failed([next(bodies) for _ in c.ranges]) for c in chunks]

    def _through_scratch(self) -> bool:
        """Whether this process reads chunks through the scratch folder: a worker, or the
        process that handed the reader to workers."""
        return self._sharing and (self._handed or os.getpid() != self._owner)

    def _bodies(self, chunks: list[Chunk], fetcher: Fetcher) -> list[tuple[Any, int]]:
        """Each chunk's bytes (or why it could not be read) and the generation of the scratch
        file they map (-1: read into this process's own memory)."""
        if self._through_scratch():
            try:
                found = self.shared.get(
                    [c.index for c in chunks],
                    lambda positions: self._stored([chunks[p] for p in positions], fetcher),
                )
            except CacheError as exc:
                self._unshareable(exc)
            else:
                return [(b, -1) if isinstance(b, BaseException) else b for b in found]
        return [(_joined(parts), -1) for parts in self._fetch(chunks, fetcher)]

    def _stored(self, chunks: list[Chunk], fetcher: Fetcher) -> Iterator[Parts | BaseException]:
        """What each chunk's scratch file is to hold (its bytes, or those decoded), or why it
        cannot: read at once, then decoded one by one as the scratch folder stores each (where
        the source keeps chunks decoded), so that one chunk's decoding is in memory at a time."""
        bodies = self._fetch(chunks, fetcher)[::-1]
        for chunk in chunks:
            yield self._encoded(chunk, bodies.pop())  # its bytes let go once decoded

    def _encoded(self, chunk: Chunk, parts: Any) -> Parts | BaseException:
        """A chunk's bytes (in ``parts``, or why they could not be read) as its scratch file
        holds them."""
        if isinstance(parts, BaseException) or self._decoded is None:
            return parts  # type: ignore[no-any-return]
        try:
            return self._decoded.encode(chunk, _joined(parts))
        except Exception as exc:
            return _failure(chunk, exc)

    def _unshareable(self, error: CacheError) -> None:
        """Stop sharing chunks through a scratch folder that cannot be written, saying why."""
        if not self._sharing:
            return
        self._sharing = False
        log.warning(
            "shard chunks: process %d reads chunks itself, not through the scratch cache the "
            "DataLoader workers share (%s)",
            os.getpid(),
            error,
        )

    def seed(self, chunk: Chunk, body: bytes | memoryview) -> None:
        """Keep ``chunk``'s bytes, read already (a shard's index read them), as if just read."""
        value = self._loaded(chunk, body)
        if not isinstance(value, BaseException):
            with self._lock:
                self._keep(chunk, value, -1)
                if chunk in self._kept:
                    self._unshared[chunk] = body
                self._mark_read(chunk)
                self.seeded += 1

    def _mark_read(self, chunk: Chunk) -> bool:
        """Note that this process has read ``chunk`` (under the lock); whether it read it
        before and that read served under a quarter of its samples (see :meth:`_check_order`)."""
        served = int(self._served[chunk.index])
        self._served[chunk.index] = 0
        return served >= 0 and served * _EARLY < self._samples[chunk.index]

    def _share_seeds(self) -> None:
        """Put the seeded chunks still kept into ``shared`` (once each), for the workers; from
        then on this process reads through it too, and lets go of its own copies."""
        if os.getpid() != self._owner or not self._sharing:
            return
        with self._lock:
            seeds, self._unshared = list(self._unshared.items()), {}
        try:
            for chunk, body in seeds:
                stored = self._encoded(chunk, [body])
                if not isinstance(stored, BaseException):
                    self.shared.put(chunk.index, stored)
        except CacheError as exc:
            self._unshareable(exc)
            return
        with self._lock:
            self._handed = True
            for chunk in [c for c, (_, _, generation) in self._kept.items() if generation < 0]:
                self._forget(chunk)

    def _read(self, chunks: list[Chunk], fetcher: Fetcher, out: dict[Chunk, Any]) -> None:
        if self._through_scratch() and os.getpid() != self._owner:
            _map_large_buffers()  # in a worker, from its first read (see there)
        bodies = self._bodies(chunks, fetcher)
        for chunk, (body, generation) in zip(chunks, bodies, strict=True):
            failed = isinstance(body, BaseException)
            value = body if failed else self._loaded(chunk, body, generation)
            out[chunk] = value
            with self._lock:
                if not isinstance(value, BaseException):
                    self._keep(chunk, value, generation)
                self._reading.pop(chunk).set_result(value)
        if self._through_scratch():
            _give_back_memory()

    def _loaded(self, chunk: Chunk, body: bytes | memoryview, generation: int = -1) -> Any:
        """The chunk loaded from its bytes, or from its scratch file (``generation`` >= 0: a
        mapping of it, decoded already where ``decoded`` says so); or why it cannot be."""
        try:
            if generation >= 0 and self._decoded is not None:
                return self._decoded.load(chunk, memoryview(body))
            return self._load(chunk, body)
        except Exception as exc:
            return _failure(chunk, exc)

    def _keep(self, chunk: Chunk, value: Any, generation: int) -> None:
        weight = self._weigh(value)
        if weight > self.memory_bytes:
            return
        self._kept[chunk] = (value, weight, generation)
        self._held += weight
        while self._held > self.memory_bytes:
            gone = next(iter(self._kept))
            self._forget(gone)
            self._unshared.pop(gone, None)  # held no longer: not to be shared either


_PICKLED = (
    "memory_bytes",
    "_load",
    "_weigh",
    "shared",
    "_owner",
    "_samples",
    "_root",
    "_drop_served",
    "_decoded",
)
_EARLY = 4  # a chunk dropped before serving a quarter of its samples was dropped early
_EARLY_READS = 32  # chunks read again after an early drop before the order is named


def _give_back_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing), and those of pyarrow's pool where pyarrow is in use. A chunk read through the
    scratch folder leaves only transient buffers of its size in this process (the body fetched,
    what a format's decoding frees), which glibc and pyarrow otherwise keep: each worker would
    hold about as much again as the chunks it decodes."""
    arrow = sys.modules.get("pyarrow")
    if arrow is not None:
        arrow.default_memory_pool().release_unused()
    glibc = _glibc()
    if glibc is not None:
        glibc.malloc_trim(0)


@functools.cache
def _glibc() -> Any:
    """glibc, for ``malloc_trim`` and ``mallopt`` (None elsewhere)."""
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


@functools.cache
def _map_large_buffers() -> None:
    """Tell glibc, once, to map each buffer of ``_MAPPED`` bytes or more on its own. By default
    it raises that threshold to the largest buffer freed (up to 32 MiB), and then keeps the
    chunk-sized buffers of other threads (the store client's bodies) at the top of their
    arenas, which ``malloc_trim`` does not give back: a worker that decodes chunks kept about
    three of them more (tests/test_chunk_memory.py). In DataLoader workers only: the loop's
    process keeps glibc's defaults for the user's own buffers (a buffer mapped on its own costs
    a page fault per 4 KB each time it is made)."""
    glibc = _glibc()
    if glibc is not None:
        glibc.mallopt(_M_MMAP_THRESHOLD, _MAPPED)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MAPPED = 8 << 20  # buffers of a chunk's size, not a sample's


def _failure(chunk: Chunk, exc: Exception) -> ShardError:
    """A chunk's load that failed, as its ShardError (a format library's own errors named)."""
    if isinstance(exc, ShardError):
        return exc
    reason = f"{type(exc).__name__}: {exc}"[:300]
    error = ShardError(f"cannot read {chunk.label} ({reason})", url=chunk.url)
    error.__cause__ = exc
    return error


def _failed(bodies: list[Any]) -> list[Any] | BaseException:
    """The bodies of a chunk's ranges, or the first of their failures."""
    return next((body for body in bodies if isinstance(body, BaseException)), bodies)


def _joined(parts: list[Any] | BaseException) -> Any:
    """A chunk's bytes from the bodies of its ranges (or its failure)."""
    if isinstance(parts, BaseException):
        return parts
    return parts[0] if len(parts) == 1 else b"".join(parts)
