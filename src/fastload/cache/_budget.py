"""One format's bytes and byte budget in a cache folder, and the eviction that keeps to it.

The file ``usage-<format>`` holds ``<bytes> <budget>`` (0: none), read and written in place
under its own lock: every process sharing the folder keeps to one budget. Bytes written to
segments are added to it later, in a batch (:class:`_Unrecorded`); a folder entry's are added
as it is renamed into place. Eviction removes the least recently used units of the format's
layout (:meth:`fastload.cache._layout.Layout.units`) until the bytes are under the budget.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.util import Finalize
from pathlib import Path

from fastload.cache._layout import Layout
from fastload.cache._locks import FileLock
from fastload.cache._perms import PRIVATE, Modes, naming, read_regular
from fastload.stats import CacheStats

__all__ = ["Budget"]

log = logging.getLogger(__name__)

_LOW_WATER = 0.9  # eviction frees space down to this share of the budget
_UNRECORDED = 4 * 2**20  # bytes a process may add before it records them (no budget)


class _Unrecorded:
    """Bytes this process wrote to segments and has yet to add to the usage files, by file:
    added by the next use of the file in this process (at once with a budget, else every
    4 MiB) and when the process exits (a DataLoader worker's too). Kept per process, not per
    Cache, so a Cache collected before its bytes were recorded loses none, and a forked child
    starts at 0: what its parent wrote is the parent's to record."""

    def __init__(self) -> None:
        self._pid = -1

    def add(self, path: Path, delta: int, modes: Modes) -> int:
        """Add ``delta`` to ``path``'s (a usage file of a cache of ``modes``); the bytes now
        unrecorded there."""
        with self._own():
            self._bytes[path] = self._bytes.get(path, 0) + delta
            self._modes[path] = modes
            return self._bytes[path]

    def take(self, path: Path) -> int:
        """``path``'s unrecorded bytes, now the caller's to record."""
        with self._own():
            return self._bytes.pop(path, 0)

    def _own(self) -> threading.Lock:
        if self._pid != os.getpid():
            self._pid, self._lock = os.getpid(), threading.Lock()
            self._bytes: dict[Path, int] = {}
            self._modes: dict[Path, Modes] = {}
            Finalize(None, self._record_all, exitpriority=0)  # at exit, in this process only
        return self._lock

    def _record_all(self) -> None:
        with self._own():
            pending, self._bytes = self._bytes, {}
        for path, count in pending.items():  # a thread of this process may hold the lock
            modes = self._modes.get(path, PRIVATE)
            with contextlib.suppress(Exception), usage_file(path, _no_count, modes, 2.0) as state:
                state[0] += count


_UNRECORDED_BYTES = _Unrecorded()


class Budget:
    """The bytes of ``layout``'s entries and their budget, in the usage file ``path`` (made of
    ``modes``; read only: read, never written). ``max_bytes`` is the folder's budget as last
    read (None: none); ``counters`` counts evictions and samples too big for the budget."""

    def __init__(
        self, path: Path, layout: Layout, modes: Modes, read_only: bool, counters: CacheStats
    ) -> None:
        self.path, self.modes, self.read_only = path, modes, read_only
        self.max_bytes: int | None = None
        self._layout, self._counters = layout, counters
        self._warned: set[str] = set()

    @contextlib.contextmanager
    def usage(self) -> Iterator[list[int]]:
        """``[bytes of the entries, budget (0: none)]``, read and written back in place under
        the usage file's lock, with the bytes this process had yet to record."""
        if not self.read_only:
            with usage_file(self.path, self.scan, self.modes) as state:
                state[0] += _UNRECORDED_BYTES.take(self.path)
                yield state
            return
        try:
            raw = read_regular(self.path)
        except FileNotFoundError:
            yield [self.scan(), 0]
            return
        yield _parse_usage(raw[:64], self.scan)

    def adopt(self, max_bytes: int | None) -> None:
        """Keep to the folder's budget, or record ``max_bytes`` as its budget."""
        with self.usage() as state:
            recorded = state[1] or None
            if self.read_only:
                self.max_bytes = recorded
                return
            if max_bytes is not None and recorded not in (None, max_bytes):
                log.warning(
                    "%s: the cache budget (%s) changes from %d to %d bytes for every process "
                    "sharing this folder",
                    self.path.parent,
                    self.path.name.removeprefix("usage-"),
                    recorded,
                    max_bytes,
                )
            if max_bytes is not None:
                state[1] = max_bytes
            self.max_bytes = state[1] or None

    def add(self, delta: int) -> None:
        with self.usage() as used:
            used[0] += delta

    def scan(self) -> int:
        """The entries' bytes, counted on disk."""
        return sum(unit.size for unit in self._layout.units())

    def admits(self, name: str, size: int) -> bool:
        """Whether an entry of ``size`` bytes fits in the budget at all; one that does not is
        counted and warned of once per name."""
        if self.max_bytes is None or size <= self.max_bytes:
            return True
        self._counters.oversize += 1
        if name not in self._warned:
            self._warned.add(name)
            log.warning("not cached: %d bytes exceed max_bytes=%d: %s", size, self.max_bytes, name)
        return False

    def record(self, delta: int) -> None:
        """Add ``delta`` bytes written to segments: at once under a budget (evicting when the
        bytes pass it), else once this process's unrecorded bytes pass 4 MiB, or at exit."""
        pending = _UNRECORDED_BYTES.add(self.path, delta, self.modes)
        if self.max_bytes is not None or pending >= _UNRECORDED:
            with self.usage() as used:
                self.max_bytes = used[1] or None  # the folder's, as another process set it
                if self.max_bytes is not None and used[0] > self.max_bytes:
                    used[0] = self.evict(int(self.max_bytes * _LOW_WATER))

    @contextlib.contextmanager
    def room(self, size: int) -> Iterator[list[int]]:
        """:meth:`usage`, once what the budget needs evicted for ``size`` more bytes is: the
        caller adds them when its entry is in place."""
        with self.usage() as used:
            self.max_bytes = used[1] or None  # the folder's, as another process set it
            if self.max_bytes is not None and used[0] + size > self.max_bytes:
                used[0] = self.evict(int(self.max_bytes * _LOW_WATER) - size)
            yield used

    def evict(self, target: int) -> int:
        """Remove the least recently used units until at most ``target`` bytes remain; the
        bytes that do. This process's open segment is finished first, so it can go too;
        another process's stays until it finishes it, and an entry in use stays."""
        self._layout.seal()
        units = sorted(self._layout.units(), key=lambda unit: unit.used)
        total = sum(unit.size for unit in units)
        for unit in units:
            if total <= target:
                break
            freed, entries = unit.evict()
            total -= freed
            self._counters.evictions += entries
        return total

    def forget(self) -> None:
        """Drop the bytes this process had yet to record (their entries are gone: ``clear``)."""
        _UNRECORDED_BYTES.take(self.path)


@contextlib.contextmanager
def usage_file(
    path: Path, scan: Callable[[], int], modes: Modes, patience: float | None = None
) -> Iterator[list[int]]:
    """``[bytes, budget]`` in the usage file ``path`` (made of ``modes`` when missing), written
    back in place under its lock; ``scan`` counts the bytes when the file holds no count.
    ``patience``: seconds to wait for the lock before TimeoutError (None: as long as it takes)."""
    lock = FileLock(path, modes=modes)
    if patience is None:
        lock.acquire()
    else:
        deadline = time.monotonic() + patience
        while not lock.acquire(blocking=False):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} stayed locked")
            time.sleep(0.01)
    try:  # the lock's descriptor: a regular file, never opened through a symlink
        state = _parse_usage(os.pread(lock.fd, 64, 0), scan)
        yield state
        with naming(path):  # a full disk, for a new file
            os.pwrite(lock.fd, b"%020d %020d\n" % (max(0, state[0]), state[1]), 0)
    finally:
        lock.release()


def _parse_usage(raw: bytes, scan: Callable[[], int]) -> list[int]:
    fields = raw.split()
    used = int(fields[0]) if fields and fields[0].isdigit() else scan()
    budget = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0
    return [used, budget]


def _no_count() -> int:
    raise ValueError("the usage file holds no count: the next Cache counts the entries")
