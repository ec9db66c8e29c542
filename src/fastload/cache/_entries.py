"""Entries of their own: a file or folder per entry, ``entries/ab/cd/<digest><suffix>``.

:class:`Folders` is the ``zarr`` layout (a Zarr group per entry, written under ``tmp/`` and
renamed into place; read under the entry's shared lock, which keeps eviction away: an open file
outlives its deletion, a folder does not). :class:`OwnFiles` alone reads the ``pt`` and ``npy``
entries earlier versions wrote as a file each, and :class:`WithEarlier` puts the segments in
front of them, so a cache of an earlier version keeps being read (and read-only mounts of one
too) without a migration: a miss looks among them, a write replaces one. A cache opened with
none of them never looks (no syscall more per miss).

Only what the cache writes is seen: two levels of two-hex-digit folders (never a symlink)
holding entries named by a digest; a stray ``.DS_Store`` or a link is ignored, and nothing is
deleted through a link.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fastload.cache._budget import Budget
from fastload.cache._layout import MISSING, Damaged, Item, Stored, Unit, refusal
from fastload.cache._locks import EntryLocks
from fastload.cache._perms import Modes, exists, make_dirs
from fastload.cache._segments import Segments
from fastload.cache._tree import unflatten
from fastload.cache.formats import Format, ZarrFormat, entry_bytes
from fastload.errors import CacheError, CorruptEntryError, UnsupportedSampleError

__all__ = ["Folders", "OwnFiles", "WithEarlier", "real_dir", "remove_entry"]

_DIGEST = re.compile(r"[0-9a-f]{40}")
_SHARD = re.compile(r"[0-9a-f]{2}")


class OwnFiles:
    """The entries of ``format`` under ``root``, each a file (or folder) of its own; read,
    counted, evicted and dropped under the entry locks of ``locks``."""

    def __init__(self, root: Path, format: Format, locks: EntryLocks) -> None:
        self.format, self._locks = format, locks
        self._entry_root = str(root / "entries")

    def path(self, digest: str) -> str:
        # plain strings: building Path objects cost more than reading a small entry
        return f"{self._entry_root}/{digest[:2]}/{digest[2:4]}/{digest}{self.format.suffix}"

    def read(
        self, digests: Sequence[str], *, held: bool, touch: bool
    ) -> tuple[list[Any], list[Damaged]]:
        out: list[Any] = []
        damaged: list[Damaged] = []
        for digest in digests:
            path = self.path(digest)
            try:
                out.append(self._read_one(digest, path, held))
            except FileNotFoundError:
                out.append(MISSING)
                continue
            except CorruptEntryError as exc:
                damaged.append(Damaged(digest, exc))
                out.append(MISSING)
                continue
            if touch:  # mtime orders eviction (LRU first)
                with contextlib.suppress(FileNotFoundError):
                    os.utime(path, follow_symlinks=False)
        return out, damaged

    def _read_one(self, digest: str, path: str, held: bool) -> Any:
        return self.format.read(path)  # an open file outlives its eviction: no lock

    def holds(self, digests: Sequence[str]) -> list[bool]:
        return [exists(self.path(digest)) for digest in digests]

    def drop(self, digest: str) -> int | None:
        path = self.path(digest)
        return (remove_entry(path) if _in_root(path) else 0) or None  # gone: nothing dropped

    def units(self) -> Iterator[Unit]:
        for item in self.files():
            with contextlib.suppress(FileNotFoundError):
                size = entry_bytes(item.path, self.format.directory)
                digest = item.name[: -len(self.format.suffix)]
                evict = functools.partial(self._evict, digest, item.path)
                yield Unit(item.path, size, item.stat().st_mtime, evict)

    def _evict(self, digest: str, path: str) -> tuple[int, int]:
        lock = self._locks(digest)
        if not lock.acquire(blocking=False):
            return 0, 0  # being read (zarr) or rewritten: never pulled from under a reader
        try:
            return remove_entry(path), 1
        finally:
            lock.release(remove=True)

    def count(self) -> int:
        return sum(1 for _ in self.files())  # no sizes needed: no stat per entry

    def check(self) -> Iterator[Damaged | None]:
        for item in self.files():
            digest = item.name[: -len(self.format.suffix)]
            try:
                self._read_one(digest, item.path, False)
            except FileNotFoundError:
                pass  # evicted meanwhile
            except CorruptEntryError as exc:
                size = 0
                with contextlib.suppress(FileNotFoundError):
                    size = entry_bytes(item.path, self.format.directory)
                yield Damaged(digest, exc, self._name_of(item.path), size)
                continue
            yield None

    def _name_of(self, path: str) -> str:
        try:
            return self.format.name_of(path)
        except (OSError, CorruptEntryError):
            return os.path.basename(path)  # too damaged to say: the file name (a digest)

    def files(self) -> Iterator[os.DirEntry[str]]:
        """This format's entries on disk (another format's are its own Cache's business)."""
        for shard in _subfolders(self._entry_root):
            for inner in _subfolders(shard):
                with os.scandir(inner) as items:
                    yield from (item for item in items if self._ours(item))

    def _ours(self, item: os.DirEntry[str]) -> bool:
        suffix = self.format.suffix
        name = item.name
        if not (name.endswith(suffix) and _DIGEST.fullmatch(name[: len(name) - len(suffix)])):
            return False
        return item.is_dir(follow_symlinks=False) == self.format.directory


class Folders(OwnFiles):
    """The ``zarr`` layout: a Zarr group per entry (see the module's docstring)."""

    format: ZarrFormat

    def __init__(
        self, root: Path, format: ZarrFormat, locks: EntryLocks, modes: Modes, read_only: bool
    ) -> None:
        super().__init__(root, format, locks)
        self._tmp, self._modes, self._read_only = root / "tmp", modes, read_only

    def _read_one(self, digest: str, path: str, held: bool) -> Any:
        if held or self._read_only:  # read only: no eviction
            return self.format.read(path)
        lock = self._locks(digest)  # a folder does not outlive its eviction: keep it away
        lock.acquire(shared=True)
        try:
            return self.format.read(path)
        finally:
            lock.release()

    @contextlib.contextmanager
    def lazy(self, digest: str) -> Iterator[Any]:
        lock = self._locks(digest)
        if not self._read_only:
            lock.acquire(shared=True)
        try:
            spec, values, arrays = self.format.arrays(self.path(digest))
            yield unflatten(spec, list(arrays), values)  # type: ignore[arg-type]
        finally:
            if not self._read_only:
                lock.release()

    def store(self, items: Sequence[Item], budget: Budget, *, held: bool) -> Stored:
        """Each entry written whole under ``tmp/``, then renamed into place under its
        exclusive lock (taken here unless ``held``) and the budget's."""
        writes = written = 0
        refused = {}
        for k, (digest, name, sample) in enumerate(items):
            lock = None if held else self._locks(digest)
            if lock is not None:
                lock.acquire()
            try:
                size = self._store(digest, name, sample, budget)
            except UnsupportedSampleError as exc:
                refused[k] = refusal(exc, name)
                continue
            finally:
                if lock is not None:
                    lock.release(remove=True)
            if size is not None:
                writes, written = writes + 1, written + size
        return Stored(writes, written, refused)

    def _store(self, digest: str, name: str, sample: Any, budget: Budget) -> int | None:
        """The bytes written (None: too big for the budget, not cached)."""
        tmp = self._tmp / f"{digest}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            size = self.format.write(sample, name, tmp, self._modes)
            if not budget.admits(name, size):
                return None
            path = self.path(digest)
            make_dirs(Path(path).parent, self._modes)
            if not _in_root(path):
                raise CacheError(
                    f"{os.path.dirname(path)} is a symlink; the cache will not follow it"
                )
            with budget.room(size) as used:
                used[0] += size - remove_entry(path)  # a stale or corrupt one may be in the way
                os.rename(tmp, path)
        finally:
            remove_entry(tmp)
        return size

    def seal(self) -> None:
        pass  # each entry is finished when written

    def cleared(self) -> None:
        pass  # nothing is kept open


class WithEarlier:
    """The segments of ``primary``, in front of the entries ``earlier`` versions wrote as a file
    each: looked among on a miss, replaced by a write, counted, evicted and verified."""

    def __init__(self, primary: Segments, earlier: OwnFiles) -> None:
        self.primary, self.earlier = primary, earlier

    def read(
        self, digests: Sequence[str], *, held: bool, touch: bool
    ) -> tuple[list[Any], list[Damaged]]:
        out, damaged = self.primary.read(digests, held=held, touch=touch)
        bad = {entry.digest for entry in damaged}
        misses = [i for i, value in enumerate(out) if value is MISSING and digests[i] not in bad]
        found, more = self.earlier.read([digests[i] for i in misses], held=held, touch=touch)
        for i, value in zip(misses, found, strict=True):
            out[i] = value
        return out, damaged + more

    def holds(self, digests: Sequence[str]) -> list[bool]:
        there = self.primary.holds(digests)
        misses = [i for i, held in enumerate(there) if not held]
        for i, held in zip(misses, self.earlier.holds([digests[i] for i in misses]), strict=True):
            there[i] = held
        return there

    def store(self, items: Sequence[Item], budget: Budget, *, held: bool) -> Stored:
        """Write to the segments, then delete the earlier files of what was written (not of a
        sample refused, or too big for the budget: its earlier entry stays)."""
        stored = self.primary.store(items, budget, held=held)
        digests = [digest for digest, _, _ in items]
        written = self.primary.holds(digests) if stored.writes else [False] * len(digests)
        stale = sum(
            self.earlier.drop(digest) or 0
            for digest, replaced in zip(digests, written, strict=True)
            if replaced
        )
        if stale:
            budget.record(-stale)
        return stored

    def lazy(self, digest: str) -> contextlib.AbstractContextManager[Any]:
        return self.primary.lazy(digest)

    def drop(self, digest: str) -> int | None:
        dropped = [self.primary.drop(digest), self.earlier.drop(digest)]
        freed = [size for size in dropped if size is not None]
        return sum(freed) if freed else None

    def units(self) -> Iterator[Unit]:
        return itertools.chain(self.earlier.units(), self.primary.units())

    def count(self) -> int:
        return self.earlier.count() + self.primary.count()

    def check(self) -> Iterator[Damaged | None]:
        return itertools.chain(self.earlier.check(), self.primary.check())

    def seal(self) -> None:
        self.primary.seal()

    def cleared(self) -> None:
        self.primary.cleared()


def remove_entry(path: str | Path) -> int:
    """Delete a file or folder if present (never through a link); the bytes freed."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            size = entry_bytes(path, True)
            shutil.rmtree(path, ignore_errors=True)
            return size
        size = os.lstat(path).st_size
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return size


def real_dir(path: str | Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _in_root(path: str) -> bool:
    """Whether ``path``'s shard folders are real folders (never links out of the root)."""
    inner = os.path.dirname(path)
    return real_dir(inner) and real_dir(os.path.dirname(inner))


def _subfolders(path: str) -> list[str]:
    """The two-hex-digit shard folders in ``path`` (real folders only), sorted."""
    try:
        with os.scandir(path) as items:
            return sorted(
                i.path
                for i in items
                if _SHARD.fullmatch(i.name) and i.is_dir(follow_symlinks=False)
            )
    except (FileNotFoundError, NotADirectoryError):
        return []
