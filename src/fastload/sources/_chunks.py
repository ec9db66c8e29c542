"""Chunks of shards: what the shard sources (tar, parquet) read instead of single samples.

A chunk is a byte range of one shard holding whole samples (a run of tar members, a parquet
row group). The chunks a batch needs are read at once, one ranged request each, and each
process keeps the most recently used ones in memory (``ChunkConfig.memory_bytes``), so the
batches that a shard-aware sampler draws from one chunk cost one read between them. Two
threads that want one chunk at once (the loop and the loader's lookahead) share one read. An
order that is not shard-aware over more chunks than memory holds reads a chunk for nearly every
sample: a warning says so, once per process.

DataLoader workers get the batches of one chunk in turn, so without more each worker would
read every chunk. Each reader therefore has a scratch :class:`fastload.Cache` (in ``/dev/shm``
where it has room for ``memory_bytes``, else in the temporary folder; bounded by
``memory_bytes``; removed when the process that made it exits, or if that process was killed,
by the next that makes one) that the processes it is copied into (forked or pickled workers)
share: a chunk is fetched by the first worker that wants it and read from there by the others.
Chunks this process was given already (:meth:`ChunkReader.seed`: what indexing read) go there
when the reader is pickled for a worker, so workers that start by pickling (forkserver, spawn)
do not read them again; forked workers have them in the memory they share. A scratch cache that
cannot be written (a full disk) costs only the sharing: the workers then read chunks
themselves, and say so once.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastload.cache import Cache
from fastload.cache._locks import lock_whole
from fastload.errors import CacheError, ShardError
from fastload.fetcher import Fetcher, Request

__all__ = ["Chunk", "ChunkReader"]

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


class ChunkReader:
    """Reads chunks for a batch and keeps recent ones (see the module docstring).

    ``load(chunk, body)`` turns a chunk's bytes into what the source slices samples from (it
    runs once per read; an exception it raises becomes that chunk's failure, not cached), and
    ``weigh`` gives the bytes a loaded chunk holds in memory.
    """

    def __init__(
        self,
        memory_bytes: int,
        load: Callable[[Chunk, bytes | memoryview], Any],
        weigh: Callable[[Any], int],
        *,
        samples: np.ndarray,
        root: str,
    ) -> None:
        self.memory_bytes = memory_bytes
        self._load, self._weigh = load, weigh
        # the samples in each chunk (by Chunk.index), which judge the order they are read in
        self._samples, self._root = samples, root
        self._owner = os.getpid()
        self.shared = _scratch(memory_bytes, self._owner)
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[Chunk, tuple[Any, int]] = OrderedDict()
        self._held = 0
        self._sharing = True  # the scratch cache works (see _unshareable)
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
        with self._lock:
            for chunk in chunks:  # one per sample served
                if self._served[chunk.index] >= 0:
                    self._served[chunk.index] += 1
        if ours and not self._warned:
            self._check_order()
        return out

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

    def _fetch(self, chunks: list[Chunk], fetcher: Fetcher) -> list[Any]:
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
        return [_joined([next(bodies) for _ in c.ranges]) for c in chunks]

    def _bodies(self, chunks: list[Chunk], fetcher: Fetcher) -> list[Any]:
        """The chunks' bytes: fetched, or in a worker through the scratch cache workers share."""
        if os.getpid() == self._owner or not self._sharing:
            return self._fetch(chunks, fetcher)
        names = [_shared_name(c) for c in chunks]

        def fetched(positions: list[int]) -> list[Any]:
            bodies = self._fetch([chunks[p] for p in positions], fetcher)
            return [
                b if isinstance(b, BaseException) else np.frombuffer(b, np.uint8) for b in bodies
            ]

        try:
            found = self.shared.get_many(names, fetched)
        except CacheError as exc:
            self._unshareable(exc)
            return self._fetch(chunks, fetcher)
        return [b if isinstance(b, BaseException) else b.tobytes() for b in found]

    def _unshareable(self, error: CacheError) -> None:
        """Stop sharing chunks through a scratch cache that cannot be written, saying why."""
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
                self._keep(chunk, value)
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
        """Put the seeded chunks still kept into ``shared`` (once each), for the workers."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            seeds, self._unshared = list(self._unshared.items()), {}
        if seeds and self._sharing:
            bodies = [np.frombuffer(body, np.uint8) for _, body in seeds]
            names = [_shared_name(chunk) for chunk, _ in seeds]
            try:
                self.shared.get_many(names, lambda positions: [bodies[p] for p in positions])
            except CacheError as exc:
                self._unshareable(exc)

    def _read(self, chunks: list[Chunk], fetcher: Fetcher, out: dict[Chunk, Any]) -> None:
        bodies = self._bodies(chunks, fetcher)
        for chunk, body in zip(chunks, bodies, strict=True):
            value = body if isinstance(body, BaseException) else self._loaded(chunk, body)
            out[chunk] = value
            with self._lock:
                if not isinstance(value, BaseException):
                    self._keep(chunk, value)
                self._reading.pop(chunk).set_result(value)

    def _loaded(self, chunk: Chunk, body: bytes | memoryview) -> Any:
        try:
            return self._load(chunk, body)
        except ShardError as exc:
            return exc
        except Exception as exc:  # the format library's own errors
            reason = f"{type(exc).__name__}: {exc}"[:300]
            error = ShardError(f"cannot read {chunk.label} ({reason})", url=chunk.url)
            error.__cause__ = exc
            return error

    def _keep(self, chunk: Chunk, value: Any) -> None:
        weight = self._weigh(value)
        if weight > self.memory_bytes:
            return
        self._kept[chunk] = (value, weight)
        self._held += weight
        while self._held > self.memory_bytes:
            gone, (_, dropped) = self._kept.popitem(last=False)
            self._held -= dropped
            self._unshared.pop(gone, None)  # held no longer: not to be shared either


_PICKLED = ("memory_bytes", "_load", "_weigh", "shared", "_owner", "_samples", "_root")
_EARLY = 4  # a chunk dropped before serving a quarter of its samples was dropped early
_EARLY_READS = 32  # chunks read again after an early drop before the order is named


def _joined(bodies: list[Any]) -> Any:
    """A chunk's bytes from the bodies of its ranges, or the first of their failures."""
    failed = [body for body in bodies if isinstance(body, BaseException)]
    if failed:
        return failed[0]
    return bodies[0] if len(bodies) == 1 else b"".join(bodies)


def _shared_name(chunk: Chunk) -> str:
    """The chunk's name in the scratch cache the workers share (by its ranges: two datasets
    reading other columns of one row group share no bytes)."""
    ranges = ",".join(f"{a}-{b}" for a, b in chunk.ranges)
    return Cache.name(chunk.url, chunk.version, f"chunk:{ranges}")


_SCRATCH = "fastload-chunks-"
_OWNER = "owner.lock"


def _scratch(memory_bytes: int, owner: int) -> Cache:
    """A cache for the chunks of the workers this process starts; removed when it exits, and
    by the next process that makes one if it was killed first (a SIGTERM from a job scheduler
    runs no exit handler): its folder's ``owner.lock`` is locked for as long as the process
    (or a worker it forked) lives."""
    parent = _in_memory(memory_bytes) or tempfile.gettempdir()
    _sweep(parent)
    root = tempfile.mkdtemp(prefix=_SCRATCH, dir=parent)
    # the owner lock is taken before the file has its name: a sweep never finds it unlocked
    making = os.path.join(root, f"{_OWNER}.new")
    held = os.open(making, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    lock_whole(held, shared=False)
    os.rename(making, os.path.join(root, _OWNER))
    cache = Cache(os.path.join(root, "chunks"), format="npy", max_bytes=max(memory_bytes, 1))
    weakref.finalize(cache, _remove, root, owner, held)
    return cache


def _sweep(parent: str) -> None:
    """Remove the scratch folders in ``parent`` that no live process holds."""
    try:
        names = [name for name in os.listdir(parent) if name.startswith(_SCRATCH)]
    except OSError:
        return
    for name in names:
        folder = os.path.join(parent, name)
        try:
            fd = os.open(os.path.join(folder, _OWNER), os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # being made, or not a scratch folder of this version
            continue
        try:
            if lock_whole(fd, shared=False):
                shutil.rmtree(folder, ignore_errors=True)
                log.info("shard chunks: removed %s, left by a process that was killed", folder)
        finally:
            os.close(fd)


def _in_memory(nbytes: int, shm: str = "/dev/shm") -> str | None:
    """``shm`` when it is a writable folder with room for ``nbytes`` (a container's is often 64
    MB), else None: the temporary folder."""
    try:
        room = os.statvfs(shm)
    except OSError:
        return None
    fits = room.f_bavail * room.f_frsize >= nbytes
    return shm if fits and os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def _remove(root: str, owner: int, held: int) -> None:
    if os.getpid() == owner:  # a forked worker's copy must not remove what the others use
        shutil.rmtree(root, ignore_errors=True)
        os.close(held)
