"""The scratch folder through which the processes of one chunk reader share chunks.

A DataLoader's workers get the batches of one chunk in turn, so each would read every chunk,
and hold its own copy of each. Instead each chunk is read once, by the first process that wants
it, into a file of its own in the reader's scratch folder (in ``/dev/shm``: memory), and every
process maps that file read-only: a chunk's bytes are in memory once on the machine, whatever
the number of workers. The folder::

    fastload-chunks-XXXXXXXX/
        owner.lock      locked while the process that made it (or a worker it forked) lives
        state           per chunk (int64): samples served from the stored copy, its
                        generation (one more at each store or drop), its size, its last use
        locks           byte i: the lock of chunk i's read; byte n (the number of chunks): the
                        lock of ``state``
        chunks/<i>      chunk i's bytes (decoded, for a source that keeps chunks decoded:
                        a parquet row group's columns), written whole before they get their name

A file is written unnamed (``O_TMPFILE``) and linked in when complete, so a worker killed while
writing one leaves nothing behind. The files together are kept within ``budget`` bytes (the
least recently used go first); where the samples served are cached (``drop_served``), a chunk
whose samples have all been served is dropped at once: the epoch needs it no more, and the next
reads the samples from the cache. A process notices that a chunk it maps was dropped by the
chunk's generation, and lets its mapping go (a dropped file's memory is freed once no process
maps it). The folder goes when the process that made it exits, or, if that process was killed
(a scheduler's SIGTERM runs no exit handler), when the next one makes a scratch folder.

Where ``/dev/shm`` has no room for the budget (a container's is often 64 MB) the folder is
made in the temporary folder, with a warning. Every failure of the folder (a full
``/dev/shm``, a file in the way, a system without open file description locks) is a
:class:`~fastload.errors.CacheError` naming it: the reader then reads chunks itself.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastload.cache._locks import OFD_LOCKS, RangeLock, lock_whole
from fastload.errors import CacheError

__all__ = ["Scratch", "in_memory"]

log = logging.getLogger(__name__)

Mapped = tuple[memoryview, int]
"""A stored chunk's bytes (a read-only view of its file's mapping) and its generation."""
Parts = Sequence[bytes | memoryview]

_PREFIX = "fastload-chunks-"
_OWNER = "owner.lock"
_SERVED, _GENERATION, _SIZE, _USED = range(4)  # the rows of ``state``
_TMPFILE = getattr(os, "O_TMPFILE", 0)  # Linux: a file with no name until linked in
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)  # a file system without it


class Scratch:
    """The chunks of one reader (``samples``: the samples in each chunk, by index) that its
    processes share (see the module docstring)."""

    def __init__(self, budget: int, samples: np.ndarray, *, drop_served: bool) -> None:
        self.budget, self.samples, self.drop_served = budget, samples, drop_served
        owner = os.getpid()
        parent = _parent(budget)
        _sweep(parent)
        self.folder = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=parent))
        # the owner lock is taken before the file has its name: a sweep never finds it unlocked
        making = self.folder / f"{_OWNER}.new"
        held = os.open(making, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        lock_whole(held, shared=False)
        os.rename(making, self.folder / _OWNER)
        weakref.finalize(self, _remove, self.folder, owner, held)
        with open(self.folder / "state", "wb") as state:
            state.truncate(_ROWS * 8 * max(1, len(samples)))
        (self.folder / "locks").touch(0o600)
        self.root.mkdir(0o700)
        self._state: np.ndarray | None = None

    @property
    def root(self) -> Path:
        """The folder of the chunks' files."""
        return self.folder / "chunks"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_state": None}  # each process maps ``state`` itself

    # -- reading ----------------------------------------------------------------------------
    def get(
        self,
        indices: Sequence[int],
        fetch: Callable[[list[int]], Iterable[Parts | BaseException]],
    ) -> list[Mapped | BaseException]:
        """Chunks ``indices`` mapped, each from its file, or first read (``fetch(positions)``:
        each chunk's bytes in parts, or why it could not be read, in order; each is stored
        before the next is asked for) and stored. A chunk another
        process is reading is waited for; one this process reads, the others wait for."""
        out: list[Mapped | BaseException | None] = [self._map(i) for i in indices]
        missing = [p for p, found in enumerate(out) if found is None]
        if missing:
            locks = {p: self._lock(indices[p]) for p in missing}
            ours: list[int] = []
            try:
                with self._io("lock a chunk"):
                    ours += [p for p in missing if locks[p].acquire(blocking=False)]
                self._fill(ours, indices, fetch, out)
            finally:
                for lock in locks.values():  # one not taken has nothing to let go
                    lock.release()
            for p in sorted(set(missing) - set(ours), key=lambda p: indices[p]):
                with self._io("wait for a chunk"):
                    locks[p].acquire()
                try:  # stored by the process that held it, unless that read failed
                    self._fill([p], indices, fetch, out)
                finally:
                    locks[p].release()
        return [found for found in out if found is not None]  # each is found or failed

    def _fill(
        self,
        positions: list[int],
        indices: Sequence[int],
        fetch: Callable[[list[int]], Iterable[Parts | BaseException]],
        out: list[Mapped | BaseException | None],
    ) -> None:
        """Map or else read and store the chunks at ``positions`` (their locks held)."""
        for p in positions:
            out[p] = self._map(indices[p])
        todo = [p for p in positions if out[p] is None]
        for p, parts in zip(todo, fetch(todo) if todo else [], strict=True):
            out[p] = parts if isinstance(parts, BaseException) else self._store(indices[p], parts)
            del parts  # written: let it go before the next is made

    def put(self, index: int, parts: Parts) -> None:
        """Store chunk ``index`` (read already), unless it is stored."""
        lock = self._lock(index)
        with self._io("lock a chunk"):
            lock.acquire()
        try:
            if self._map(index) is None:
                self._store(index, parts)
        finally:
            lock.release()

    def current(self, index: int, generation: int) -> bool:
        """Whether the mapping of chunk ``index`` made at ``generation`` is of the stored copy
        (else the copy was dropped, or stored again: the mapping is to be let go)."""
        return bool(self._rows()[_GENERATION, index] == generation)

    def served(self, counts: Mapping[int, int]) -> list[int]:
        """Count the samples served from stored chunks (``{index: samples}``); with
        ``drop_served``, drop the chunks whose samples have all been served, and name them."""
        if not self.drop_served:
            return []
        dropped = []
        with self._locked() as state:
            for index, count in counts.items():
                if state[_SIZE, index]:
                    state[_SERVED, index] += count
                    if state[_SERVED, index] >= self.samples[index]:
                        self._drop(state, index)
                        dropped.append(index)
        return dropped

    # -- the files ----------------------------------------------------------------------------
    def _map(self, index: int) -> Mapped | None:
        """Chunk ``index``'s stored bytes, or None where none are stored."""
        state = self._rows()
        generation = int(state[_GENERATION, index])  # before the open: a later drop shows
        with self._io("read a chunk"):
            try:
                fd = os.open(self.root / str(index), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                return None
            try:
                view = _mapped(fd)
            finally:
                os.close(fd)
        state[_USED, index] = time.monotonic_ns()  # no lock: the order of eviction, roughly
        return view, generation

    def _store(self, index: int, parts: Parts) -> Mapped:
        """Write chunk ``index`` to its file (named once whole), then count it in ``state``,
        dropping the least recently used others past the budget."""
        path = self.root / str(index)
        with self._io("store a chunk"):
            fd, named = self._new_file(index)
            try:
                _write_all(fd, parts)
                view = _mapped(fd)
                _publish(fd, named, path)
            finally:
                os.close(fd)
            with self._locked() as state:
                state[_GENERATION, index] += 1
                state[_SIZE, index] = len(view)
                state[_SERVED, index] = 0
                state[_USED, index] = time.monotonic_ns()
                self._evict(state, index)
                return view, int(state[_GENERATION, index])

    def _new_file(self, index: int) -> tuple[int, Path | None]:
        """An open file to write chunk ``index`` into: unnamed where the file system allows
        (None), else named for this process (and renamed over the chunk's name when whole)."""
        flags = os.O_RDWR | os.O_CLOEXEC
        if _TMPFILE and os.path.isdir("/proc/self/fd"):
            try:
                return os.open(self.root, flags | _TMPFILE, 0o600), None
            except OSError as exc:
                if exc.errno not in _NO_TMPFILE:
                    raise
        named = self.root / f".{index}.{os.getpid()}.new"
        return os.open(named, flags | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), named

    def _evict(self, state: np.ndarray, keep: int) -> None:
        """Drop the least recently used chunks but ``keep`` while the stored are past the
        budget (under the state lock)."""
        while int(state[_SIZE].sum()) > self.budget:
            stored = np.flatnonzero(state[_SIZE])
            stored = stored[stored != keep]
            if not len(stored):
                return
            self._drop(state, int(stored[np.argmin(state[_USED, stored])]))

    def _drop(self, state: np.ndarray, index: int) -> None:
        """Remove chunk ``index``'s file (under the state lock): the processes that map it let
        it go when they see its new generation."""
        (self.root / str(index)).unlink(missing_ok=True)
        state[_SIZE, index] = state[_SERVED, index] = 0
        state[_GENERATION, index] += 1

    def _rows(self) -> np.ndarray:
        """``state``, mapped into this process (once)."""
        if self._state is None:
            with self._io("map its state"):
                fd = os.open(self._path("state"), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
                try:
                    shared = mmap.mmap(fd, 0)
                finally:
                    os.close(fd)
            self._state = np.frombuffer(shared, np.int64).reshape(_ROWS, -1)
        return self._state

    @contextlib.contextmanager
    def _locked(self) -> Iterator[np.ndarray]:
        """``state``, its lock held (across threads and processes)."""
        state = self._rows()
        lock = self._lock(len(self.samples))
        with self._io("lock its state"):
            lock.acquire()
        try:
            yield state
        finally:
            lock.release()

    def _lock(self, byte: int) -> RangeLock:
        """The lock of byte ``byte`` of ``locks`` (one holder: across threads and processes)."""
        if not OFD_LOCKS:
            raise CacheError(
                f"the scratch folder {self.folder} needs open file description locks (Linux)"
            )
        return RangeLock(self._path("locks"), byte)

    def _path(self, name: str) -> Path:
        return self.folder / name

    @contextlib.contextmanager
    def _io(self, what: str) -> Iterator[None]:
        """The folder's own failures as a CacheError naming it."""
        try:
            yield
        except CacheError:
            raise
        except OSError as exc:
            raise CacheError(
                f"cannot {what} in the scratch folder {self.folder}: {exc.strerror or exc}"
            ) from exc


_ROWS = 4


def _mapped(fd: int) -> memoryview:
    """The whole file ``fd`` as a read-only view of a shared mapping (no copy)."""
    size = os.fstat(fd).st_size
    if not size:
        return memoryview(b"")
    return memoryview(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ))


def _write_all(fd: int, parts: Parts) -> None:
    """Write ``parts`` one after another (``writev`` may write less than asked)."""
    views = [memoryview(part).cast("B") for part in parts if len(part)]
    while views:
        done = os.writev(fd, views)
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][done:]


def _publish(fd: int, named: Path | None, path: Path) -> None:
    """Give the whole file its chunk's name (replacing a copy a killed process left)."""
    if named is not None:
        os.rename(named, path)
        return
    # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/<fd>: Python's os.link makes it only for a
    # src_dir_fd (its plain link() would link the symlink in /proc, another file system)
    here = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            os.link(str(fd), path, src_dir_fd=here, follow_symlinks=True)
        except FileExistsError:
            path.unlink()
            os.link(str(fd), path, src_dir_fd=here, follow_symlinks=True)
    finally:
        os.close(here)


def _parent(budget: int) -> str:
    """``/dev/shm`` where it has room for ``budget`` bytes, else the temporary folder (said
    with a warning where ``/dev/shm`` exists: a container's is often 64 MB)."""
    shm = in_memory(budget)
    if shm is not None:
        return shm
    temporary = tempfile.gettempdir()
    if os.path.isdir("/dev/shm"):
        log.warning(
            "shard chunks: /dev/shm has no room for ChunkConfig.memory_bytes (%d MB) or cannot "
            "be written: DataLoader workers share chunks through files in %s instead (on "
            "disk); give /dev/shm more room (docker run --shm-size) or lower memory_bytes",
            budget >> 20,
            temporary,
        )
    return temporary


def in_memory(nbytes: int, shm: str = "/dev/shm") -> str | None:
    """``shm`` when it is a writable folder with room for ``nbytes``, else None."""
    try:
        room = os.statvfs(shm)
    except OSError:
        return None
    fits = room.f_bavail * room.f_frsize >= nbytes
    return shm if fits and os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def _sweep(parent: str) -> None:
    """Remove the scratch folders in ``parent`` that no live process holds."""
    try:
        names = [name for name in os.listdir(parent) if name.startswith(_PREFIX)]
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


def _remove(folder: Path, owner: int, held: int) -> None:
    if os.getpid() == owner:  # a forked worker's copy must not remove what the others use
        shutil.rmtree(folder, ignore_errors=True)
        os.close(held)
