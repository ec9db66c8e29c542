"""The persistent cache of preprocessed samples: keys, atomic writes, locks, budget, repair.

Layout under ``root``::

    fastload-cache.json   marker (layout version, shard width, shared or private: see
                          cache/_perms.py); a non-empty folder without it is refused
    CACHEDIR.TAG          tells backup tools to skip the folder
    segments/<id><suffix>            pt and npy entries, many to a file (see cache/_packed.py)
    index/<a><suffix>                where each pt or npy entry is in the segments
    entries/ab/cd/<digest><suffix>   one Zarr group per zarr entry (and pt/npy entries of
                                     earlier versions, still read, one file each)
    locks/a.lock                     entry locks, one byte per entry (Linux OFD locks): held while
                                     a sample is computed (zarr: also while read); elsewhere
                                     locks/ab/<digest>.lock, one file per entry being computed
    tmp/<digest>.<pid>.<random>      writes in progress; renamed into entries/ when complete
    usage-<format>                   bytes of that format's entries and its budget (kept under its
                                     own lock): every process sharing the folder keeps to one budget
    manifests/<digest>.npz           saved listings of the datasets using this cache (not entries:
                                     ``clear`` and the budget leave them)

A sample's digest is a hash of its name and the format, so no name can reach outside ``root``.
Readers never see a partial entry (segment entries appear by their index record, written after
their bytes; zarr entries by rename); a crashed writer leaves unindexed bytes in its segment or
a file in tmp/, which the next Cache removes once no one holds the entry's lock. The
cache deletes only what it wrote: names it made, in folders it made, never through a symlink;
it opens only regular files, never through a symlink, and sets a folder's mode through the
folder's own descriptor (see cache/_perms.py: what a member of a shared cache's group may put
in its folders).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.util import Finalize
from pathlib import Path
from typing import Any, Literal

from fastload.cache._locks import OFD_LOCKS, EntryLock, FileLock, RangeLock
from fastload.cache._packed import SEGMENT_BYTES, Entry, Packed
from fastload.cache._perms import (
    PRIVATE,
    SHARED,
    Modes,
    denied,
    exists,
    make_dir,
    make_dirs,
    naming,
    open_file,
    read_regular,
)
from fastload.cache._tree import unflatten
from fastload.cache.formats import (
    CHECK_BYTES,
    FORMATS,
    FileFormat,
    Format,
    ZarrFormat,
    entry_bytes,
)
from fastload.errors import (
    CacheError,
    CacheFullError,
    ConfigError,
    CorruptEntryError,
    UnsupportedSampleError,
)
from fastload.stats import CacheStats, thread_times

__all__ = ["Cache", "CacheFormat", "VerifyReport"]

log = logging.getLogger(__name__)

CacheFormat = Literal["pt", "npy", "zarr"]
_LAYOUT = 1
_MARKER = "fastload-cache.json"
# Index shards and lock files are named by the first hex digit of a digest: 16 of each. A cache
# made before 2026-11-28 has no "shard_width" in its marker and keeps its 256 of each (two
# digits), which processes of earlier versions also use. Each is a file made once: on this
# project's VM making a file cost 0.1-0.95 ms of CPU, and a new cache's first epoch made 512.
_SHARD_WIDTH, _OLD_SHARD_WIDTH = 1, 2
_TAG = "Signature: 8a477f597d28d172789f06886806bc55\n# a fastload cache: safe to delete\n"
_LOW_WATER = 0.9  # eviction frees space down to this share of the budget
_SUBDIRS = ("entries", "locks", "tmp", "segments", "index")
_NEWER_SUBDIRS = ("segments", "index")  # a read-only cache of an earlier version lacks them
_UNRECORDED = 4 * 2**20  # bytes a process may add before it records them (no budget)
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a write failing so leaves a read's sample uncached
_FULL_PAUSE = 10.0  # s: after a full disk, reads store nothing for this long, then try again
_FULL_WARN_EVERY = 600.0  # s between warnings while the disk stays full
_SEGMENTS_PER_BUDGET = 16  # a budget's segments are at most 1/16 of it: eviction can keep to it
_DIGEST = re.compile(r"[0-9a-f]{40}")
_SHARD = re.compile(r"[0-9a-f]{2}")
_TMP_NAME = re.compile(r"([0-9a-f]{40})\.\d+\.[0-9a-f]{8}")
_MISSING: Any = object()


@dataclass
class VerifyReport:
    """What :meth:`Cache.verify` found: entries checked, corrupt ones (by name) and bytes freed."""

    checked: int = 0
    corrupt: list[str] = field(default_factory=list)
    removed_bytes: int = 0


@dataclass(frozen=True)
class _Entry:
    digest: str
    path: str
    size: int
    used: float  # last read or write (mtime)
    segment: bool = False  # a segment of packed entries (digest ""), not one entry


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
            with contextlib.suppress(Exception), _usage_file(path, _no_count, modes, 2.0) as state:
                state[0] += count


_UNRECORDED_BYTES = _Unrecorded()


class Cache:
    """Preprocessed samples on local disk, shared safely by every process on the node.

    ``format``: ``"npy"`` (raw array buffers, the fastest; the default), ``"pt"`` (torch.save,
    loaded with ``weights_only=True``) or ``"zarr"`` (chunked and compressed; crops read only
    what they touch, see :meth:`open`). ``max_bytes`` bounds this format's entries; the least
    recently used are evicted past it (reads are recorded only while a budget is set: entries
    read while there was none are ordered by when they were written). The budget is the
    directory's: it is recorded there, a Cache opened without ``max_bytes`` keeps to the
    recorded one, and a different ``max_bytes`` replaces it for every process sharing the
    folder (with a warning). Formats may share a
    directory; each keeps to its own.

    Names are any strings that identify a sample and everything that shaped it (object URL,
    version, transform fingerprint); :meth:`name` builds one.

    ``read_only``: True reads entries and never writes (misses are computed and served, not
    stored), for a warmed cache on a read-only mount; None (default) does so, with a warning,
    when the folder holds a cache and cannot be written; False requires a writable folder.

    ``shared``: True makes a cache that every member of its folder's group uses as its maker
    does (folders 2770, files 0660; see docs/cache.md, "Sharing a cache between users or
    jobs"); False, a cache of its maker's alone (folders 0700, files 0600). The cache's marker
    records which, and every later process keeps to it: None (default) takes what the marker
    says (private for a new cache), True or False require it (else ConfigError). A folder or
    file this process may not use is a :class:`CacheError` naming it and the permission
    missing (read, write or traverse), from here and from every later call.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        format: CacheFormat = "npy",
        max_bytes: int | None = None,
        read_only: bool | None = None,
        shared: bool | None = None,
    ) -> None:
        if format not in FORMATS:
            raise ConfigError(f"Cache format must be one of {sorted(FORMATS)}, got {format!r}")
        ok = max_bytes is None or (type(max_bytes) is int and max_bytes > 0)
        if not ok:
            raise ConfigError(f"Cache.max_bytes must be None or an int > 0, got {max_bytes!r}")
        if shared is not None and type(shared) is not bool:
            raise ConfigError(f"Cache.shared must be None, True or False, got {shared!r}")
        self.root = Path(root).expanduser().absolute()
        self.format: CacheFormat = format
        self.max_bytes = max_bytes
        self.counters = CacheStats()
        self._layout: Format = FORMATS[format]()
        self._digest_prefix = f"{format}\0".encode()
        self._entry_root = str(self.root / "entries")
        self._lock_root = str(self.root / "locks")
        self._usage_path = self.root / f"usage-{format}"
        self._warned: set[str] = set()
        self._full_until = self._full_warned = -_FULL_WARN_EVERY  # time.monotonic()
        self._modes = PRIVATE  # until the marker says
        self.read_only = bool(read_only)
        with self._own_files("open the cache"):
            self.read_only = self.read_only or (read_only is None and self._unwritable())
            if self.read_only:
                self._check_cache()
                if not read_only:
                    log.warning("%s cannot be written: the cache is read only", self.root)
            else:
                self._prepare(SHARED if shared else PRIVATE)
            self._keeps(shared)
            self._packed = self._segments()
            self._adopt_budget(max_bytes)
            # pt/npy entries of an earlier version (a file each) were here when this Cache was
            # opened: a miss looks for one, a write replaces one (else neither costs a syscall)
            self._legacy = self._packed is None or any(True for _ in self._files())

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_packed"]  # open files and a lock stay here
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._packed = self._segments()

    def _segments(self) -> Packed | None:
        """pt and npy entries go into segments (see cache/_packed.py); zarr ones are folders."""
        layout = self._layout
        if not isinstance(layout, FileFormat):
            return None
        return Packed(self.root, layout, self._shard_width, self._modes)

    def __bool__(self) -> bool:
        return True  # a handle: ``if cache:`` must not count the entries on disk

    def __repr__(self) -> str:
        extra = (", read_only=True" if self.read_only else "") + (
            ", shared=True" if self._modes.shared else ""
        )
        return (
            f"Cache({str(self.root)!r}, format={self.format!r}, max_bytes={self.max_bytes}{extra})"
        )

    @staticmethod
    def name(url: str, version: str = "", fingerprint: str = "") -> str:
        """The name of ``url`` at ``version`` preprocessed by a transform with ``fingerprint``."""
        return f"{url}@{version}#{fingerprint}"

    # --- setup --------------------------------------------------------------------------------

    def _prepare(self, made: Modes) -> None:
        """Make the cache (of ``made`` modes) unless the folder holds one; make its subfolders."""
        marker = self.root / _MARKER
        try:
            make_dirs(self.root, made)
            if not marker.exists():
                names = os.listdir(self.root)  # the marker comes before all but _being_made
                if not marker.exists() and not all(_being_made(name) for name in names):
                    raise CacheError(
                        f"{self.root} is not empty and is not a fastload cache; "
                        "choose a new or empty directory"
                    )
                if made.shared:
                    self._share_root()
                _atomic_text(self.root / "CACHEDIR.TAG", _TAG, made)
                about = {"layout": _LAYOUT, "shard_width": _SHARD_WIDTH, "shared": made.shared}
                _atomic_text(marker, json.dumps(about), made)
            self._read_marker(marker)
            for sub in (*_SUBDIRS, "manifests"):  # the datasets' saved listings go in manifests/
                with contextlib.suppress(FileExistsError):
                    make_dir(self.root / sub, self._modes)
            self._check_subdirs()
        except CacheError:
            raise
        except OSError as exc:
            raise self._error(exc, f"use {self.root} as a cache") from exc
        except ValueError as exc:
            raise CacheError(f"cannot use {self.root} as a cache ({_why(exc)})") from exc
        self._check_access()
        self._remove_stale_tmp()

    def _share_root(self) -> None:
        """A shared cache's folder is its group's to read, write and traverse, and hands its
        group down (setgid): add what a folder made before the cache lacks. Through a
        descriptor, so the mode read and the one set are one folder's (the root itself may be
        a link the user named)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode | SHARED.folder == mode:
                return
            try:
                os.fchmod(fd, mode | SHARED.folder)
            except PermissionError as exc:
                raise CacheError(
                    f"a shared cache's folder must be its group's to read, write and traverse "
                    f"and hand its group down (chmod g+rwxs): {self.root} has mode {mode:04o}, "
                    "which only its owner can change"
                ) from exc
        finally:
            os.close(fd)

    def _check_access(self) -> None:
        """The cache's folders are this process's to read and traverse (and write, unless read
        only), or a CacheError names the first that is not and the permission missing: now,
        once per open, rather than at some later write."""
        need = os.R_OK | os.X_OK | (0 if self.read_only else os.W_OK)
        for folder in (self.root, *(self.root / sub for sub in _SUBDIRS)):
            if not os.access(folder, need) and os.path.lexists(folder):
                why = denied(folder, writing=not self.read_only)
                kind = "readable" if self.read_only else "writable"
                raise CacheError(f"cache directory is not {kind}: {why}")

    def _keeps(self, shared: bool | None) -> None:
        """``shared`` (when given) is what the marker says the cache is."""
        if shared is None or shared == self._modes.shared:
            return
        made = "shared with its group" if self._modes.shared else "private to its maker"
        raise ConfigError(
            f"{self.root} holds a cache {made}, and its marker keeps it so for every process: "
            f"Cache(shared={shared}) cannot change that (leave shared out, or make a new cache "
            "folder)"
        )

    def _adopt_budget(self, max_bytes: int | None) -> None:
        """Keep to the directory's budget, or record ``max_bytes`` as its budget."""
        with self._usage() as state:
            recorded = state[1] or None
            if self.read_only:
                self.max_bytes = recorded
                return
            if max_bytes is not None and recorded not in (None, max_bytes):
                log.warning(
                    "%s: the cache budget (%s) changes from %d to %d bytes for every process "
                    "sharing this folder",
                    self.root,
                    self.format,
                    recorded,
                    max_bytes,
                )
            if max_bytes is not None:
                state[1] = max_bytes
            self.max_bytes = state[1] or None

    def _unwritable(self) -> bool:
        """A cache is here but its folder cannot be written (a read-only mount, say)."""
        tmp = self.root / "tmp"
        return (self.root / _MARKER).is_file() and tmp.is_dir() and not os.access(tmp, os.W_OK)

    def _check_cache(self) -> None:
        """What a read-only cache needs: the marker of this layout, real subfolders, and
        leave to read them."""
        try:
            self._read_marker(self.root / _MARKER)
        except (CacheError, PermissionError):
            raise
        except (OSError, ValueError) as exc:
            raise CacheError(f"{self.root} is not a fastload cache ({_why(exc)})") from exc
        self._check_subdirs()
        self._check_access()

    def _read_marker(self, marker: Path) -> None:
        """This layout's marker: its shard width and modes (a cache made before 2026-11-28 is
        private), or a CacheError."""
        found = json.loads(read_regular(marker))
        if not isinstance(found, dict):
            found = {}
        width = found.get("shard_width", _OLD_SHARD_WIDTH)
        shared = found.get("shared", False)
        if (
            found.get("layout") != _LAYOUT
            or width not in (_SHARD_WIDTH, _OLD_SHARD_WIDTH)
            or type(shared) is not bool
        ):
            raise CacheError(f"{self.root} holds a cache of another fastload layout")
        self._shard_width: int = width
        self._modes = SHARED if shared else PRIVATE

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise CacheError(f"cannot {what}: the cache is read only: {self.root}")

    def _check_subdirs(self) -> None:
        """entries/, locks/, tmp/, segments/ and index/ must be real folders: the cache deletes
        inside them, and a symlink would lead it out of its root. A read-only cache may lack
        any of them (the process making the cache writes its marker first, then makes them:
        nothing is in them yet); others may lack those an earlier version did not make."""
        for sub in _SUBDIRS:
            missing = not os.path.lexists(self.root / sub)
            if missing and (self.read_only or sub in _NEWER_SUBDIRS):
                continue
            if not _real_dir(self.root / sub):
                raise CacheError(
                    f"{self.root / sub} is a symlink or not a folder; a cache never follows "
                    "links out of its root (remove it, or choose another cache directory)"
                )

    def _remove_stale_tmp(self) -> None:
        """Delete temporary files whose writer is gone: a writer holds its entry's lock while
        its file exists (a PID says nothing across containers). Files not ours stay."""
        with os.scandir(self.root / "tmp") as items:
            for item in items:
                digest = _TMP_NAME.fullmatch(item.name)
                if digest is None:
                    continue
                lock = self._lock(digest[1])
                if lock.acquire(blocking=False):
                    try:
                        _remove(item.path)
                    finally:
                        lock.release(remove=True)

    # --- paths --------------------------------------------------------------------------------

    def _digest(self, name: str) -> str:
        if not isinstance(name, str):
            raise ConfigError(f"a cache entry's name must be a str, got {name!r}")
        return self._raw_digest(name.encode("utf-8", "surrogatepass"))

    def _raw_digest(self, name: bytes) -> str:
        return hashlib.sha256(self._digest_prefix + name).hexdigest()[:40]

    def _path(self, digest: str) -> str:
        # plain strings: building Path objects cost more than reading a small entry
        return f"{self._entry_root}/{digest[:2]}/{digest[2:4]}/{digest}{self._layout.suffix}"

    def manifest_path(self, identity: str) -> Path:
        """Where the listing of the dataset ``identity`` (its URL and store) is saved."""
        digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:40]
        return self.root / "manifests" / f"{digest}.npz"

    def _lock(self, digest: str) -> EntryLock:
        """The entry's lock: a byte of one of 16 shared files (256 in a cache made before
        2026-11-28), or, without OFD locks, a file of its own, removed by its last exclusive
        holder."""
        if OFD_LOCKS:
            width = self._shard_width
            offset = int(digest[width : width + 8], 16)
            return RangeLock(f"{self._lock_root}/{digest[:width]}.lock", offset, modes=self._modes)
        return FileLock(Path(self._lock_root, digest[:2], f"{digest}.lock"), modes=self._modes)

    # --- reading ------------------------------------------------------------------------------

    def _load(self, digest: str, held: bool = False) -> Any:
        """The entry's sample, or _MISSING when it is absent or corrupt (corrupt ones go).

        ``held``: the caller holds the name's exclusive lock.
        """
        return self._load_all([digest], held)[0]

    def _load_all(self, digests: Sequence[str], held: bool = False) -> list[Any]:
        """:meth:`_load` of each digest; segment entries are read together (one call to the
        segments for the batch)."""
        with self._own_files("read cache entries"):
            return self._load_each(digests, held)

    def _load_each(self, digests: Sequence[str], held: bool) -> list[Any]:
        if self._packed is None:
            return [self._load_file(digest, held) for digest in digests]
        touch = self.max_bytes is not None and not self.read_only
        out = []
        for digest, found in zip(
            digests, self._packed.read_many(digests, touch=touch), strict=True
        ):
            if found is None:  # maybe an entry of an earlier version, a file of its own
                out.append(self._load_file(digest, held) if self._legacy else _MISSING)
                continue
            try:
                out.append(self._unpacked(digest, found))
            except CorruptEntryError as exc:
                self._discard_packed(digest, exc, held)
                out.append(_MISSING)
        return out

    def _load_file(self, digest: str, held: bool) -> Any:
        path = self._path(digest)
        try:
            value = self._read(digest, path, held)
        except FileNotFoundError:
            return _MISSING
        except CorruptEntryError as exc:
            self._discard_file(digest, path, exc, held)
            return _MISSING
        if self.max_bytes is not None and not self.read_only:  # no budget: nothing to order
            with contextlib.suppress(FileNotFoundError):  # mtime orders eviction (LRU first)
                os.utime(path, follow_symlinks=False)
        return value

    def _unpacked(self, digest: str, found: Entry | CorruptEntryError) -> Any:
        """The sample in a segment entry's bytes; CorruptEntryError when they fail their
        checks or were written for another sample than the one looked up."""
        if isinstance(found, CorruptEntryError):
            raise found
        assert self._packed is not None
        layout = self._packed.layout
        value = layout.decode(*found)
        if not layout.matches(found[0], digest, self._raw_digest):
            raise CorruptEntryError(f"cache entry holds another sample: {found[1]}")
        return value

    def _discard_packed(self, digest: str, why: Exception, held: bool) -> None:
        """Drop a corrupt segment entry (a removal record; its bytes go with the segment)."""
        packed = self._packed
        assert packed is not None

        def remove() -> int:
            packed.remove(digest)
            return 0

        self._discard(digest, why, held, remove)

    def _discard_file(self, digest: str, path: str, why: Exception, held: bool = False) -> None:
        """Delete a corrupt entry of its own file or folder."""

        def remove() -> int | None:
            return (_remove(path) if self._in_root(path) else 0) or None  # gone: no repair

        self._discard(digest, why, held, remove)

    def _read(self, digest: str, path: str, held: bool = False) -> Any:
        if held or not self._layout.directory or self.read_only:  # read only: no eviction
            return self._layout.read(path)  # an open file outlives its eviction
        lock = self._lock(digest)  # a folder does not: keep eviction away while reading
        lock.acquire(shared=True)
        try:
            return self._layout.read(path)
        finally:
            lock.release()

    def _discard(
        self, digest: str, why: Exception, held: bool, remove: Callable[[], int | None]
    ) -> None:
        """Drop a corrupt entry under its lock: ``remove`` returns the bytes it freed, 0 or
        None when there was nothing to drop (gone already, or outside the root)."""
        if self.read_only:
            log.warning("a corrupt cache entry (read only: not deleted): %s", why)
            return
        lock = self._lock(digest)
        if not held and not lock.acquire(blocking=False):
            return  # its holder is rewriting it
        try:
            freed = remove()
        finally:
            if not held:
                lock.release(remove=True)
        if freed is None:
            return
        self.counters.repairs += 1
        if freed:
            self._add_usage(-freed)
        log.warning("dropped a corrupt cache entry (it will be recomputed): %s", why)

    def get(self, name: str, default: Any = None) -> Any:
        """The cached sample, or ``default`` when there is none (a corrupt one counts as none)."""
        value = self._load(self._digest(name))
        self._count(value is not _MISSING)
        return default if value is _MISSING else value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.contains_many([name])[0]

    def contains_many(self, names: Sequence[str]) -> list[bool]:
        """Whether each name has an entry (a batch's lookahead check: the index is looked at
        once for all of them)."""
        digests = [self._digest(name) for name in names]
        with self._own_files("look up cache entries"):
            held = [False] * len(digests) if self._packed is None else self._packed.holds(digests)
            return [
                there or (self._legacy and exists(self._path(digest)))
                for there, digest in zip(held, digests, strict=True)
            ]

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[Any]:
        """A zarr entry with lazy leaves (:class:`fastload.cache.ZarrArray`): index them to read
        only the chunks a crop touches. The entry is kept from eviction inside the block."""
        if not isinstance(self._layout, ZarrFormat):
            raise ConfigError(
                f"Cache.open reads zarr entries; this cache is format={self.format!r}"
            )
        digest = self._digest(name)
        lock = self._lock(digest)
        if not self.read_only:
            with self._own_files(f"lock the cache entry for {name}"):
                lock.acquire(shared=True)
        try:
            with self._own_files(f"read the cache entry for {name}"):
                try:
                    spec, values, arrays = self._layout.arrays(self._path(digest))
                except FileNotFoundError:
                    self._count(False)
                    raise KeyError(name) from None
            self._count(True)
            yield unflatten(spec, list(arrays), values)  # type: ignore[arg-type]
        finally:
            if not self.read_only:
                lock.release()

    @contextlib.contextmanager
    def _own_files(self, what: str) -> Iterator[None]:
        """An OSError of the cache's own files that the code inside does not handle (a file
        where a folder should be, EIO, EACCES, ENOSPC) raised as the CacheError naming the
        cache and the path (see :meth:`_error`). Never around a caller's code (``compute``,
        the body of ``open``): its own OSErrors are its own."""
        try:
            yield
        except CacheError:
            raise
        except OSError as exc:
            raise self._error(exc, f"{what} in {self.root}") from exc

    def _error(self, exc: OSError, doing: str) -> CacheError:
        """``exc``, met while ``doing`` (what the message says could not be done), as the
        CacheError that names the file or folder: a refusal (EACCES, EPERM) says which
        permission this process lacks on which path; a full disk or quota is a
        :class:`CacheFullError`. Its ``errno`` is the one met."""
        kind = CacheFullError if exc.errno in _FULL else CacheError
        if isinstance(exc, PermissionError):
            why = denied(exc.filename or self.root, writing=not self.read_only)
            error = kind(f"cannot {doing}: {why}")
        else:
            at = f": {exc.filename}" if exc.filename else ""
            error = kind(f"cannot {doing} ({_why(exc)}){at}")
        error.errno = exc.errno
        return error

    def _count(self, hit: bool) -> None:
        if hit:
            self.counters.hits += 1
        else:
            self.counters.misses += 1

    # --- computing and writing ----------------------------------------------------------------

    def get_or_compute(self, name: str, compute: Callable[[], Any]) -> Any:
        """The cached sample, or ``compute()`` stored first; one process computes a name at once."""
        (value,) = self.get_many([name], lambda positions: [compute()])
        if isinstance(value, BaseException):
            raise value
        return value

    def get_many(
        self,
        names: Sequence[str],
        compute: Callable[[list[int]], Sequence[Any]],
        *,
        counted: bool = True,
    ) -> list[Any]:
        """The samples for ``names``; ``compute(positions)`` makes the missing ones.

        Across threads and processes each missing name is computed once: the others wait and
        then read it. ``compute`` returns one value per position; a value that is an exception
        is handed back in its slot and not cached. ``counted=False``: no hit, miss or wait is
        counted (the samples were counted where they were looked up first: a DataLoader
        worker that filled the cache); what is made and written still is.
        """
        tally = self.counters if counted else CacheStats()
        digests = [self._digest(n) for n in names]
        out = self._load_all(digests)
        first: dict[str, int] = {}
        for i, value in enumerate(out):
            if value is _MISSING:
                tally.misses += 1
                first.setdefault(digests[i], i)
            else:
                tally.hits += 1
        if first and self.read_only:
            positions = sorted(first.values())
            for i, value in zip(positions, compute(positions), strict=True):
                out[i] = value  # served, never stored
        elif first:
            ours, theirs = self._claim(first)
            self._fill(out, names, digests, ours, compute, tally=tally)
            left = self._wait_for(theirs, out, digests, tally)
            self._fill(out, names, digests, left, compute, tally=tally)
        for i, value in enumerate(out):
            if value is _MISSING:  # a name given twice in one call
                out[i] = out[first[digests[i]]]
        return out

    def _claim(self, first: dict[str, int]) -> tuple[dict[int, EntryLock], dict[int, EntryLock]]:
        """Lock what no one else is computing; the rest are someone else's to finish."""
        ours: dict[int, EntryLock] = {}
        theirs: dict[int, EntryLock] = {}
        try:
            with self._own_files("lock cache entries"):
                for digest, i in sorted(first.items()):
                    lock = self._lock(digest)
                    (ours if lock.acquire(blocking=False) else theirs)[i] = lock
        except BaseException:
            for lock in ours.values():
                lock.release()
            raise
        return ours, theirs

    def _wait_for(
        self,
        theirs: dict[int, EntryLock],
        out: list[Any],
        digests: list[str],
        tally: CacheStats,
    ) -> dict[int, EntryLock]:
        """Wait (in digest order: no deadlock) for entries others hold; keep those still missing
        (their holder failed, or only read: a zarr reader's shared lock also blocks a claim)."""
        left: dict[int, EntryLock] = {}
        try:
            for i, lock in theirs.items():
                with self._own_files("lock cache entries"):
                    lock.acquire()
                out[i] = self._load(digests[i], held=True)
                if out[i] is _MISSING:
                    left[i] = lock  # ours to compute: not a wait
                else:
                    tally.waits += 1
                    lock.release(remove=True)
        except BaseException:
            for lock in left.values():
                lock.release()
            raise
        return left

    def _fill(
        self,
        out: list[Any],
        names: Sequence[str],
        digests: list[str],
        locked: dict[int, EntryLock],
        compute: Callable[[list[int]], Sequence[Any]],
        *,
        tally: CacheStats,
    ) -> None:
        """Compute and store the positions in ``locked`` (whose locks we hold), then unlock."""
        try:
            todo = []
            positions = sorted(locked)  # in the caller's order; done between read and lock?
            again = self._load_all([digests[i] for i in positions], held=True)
            for i, value in zip(positions, again, strict=True):
                out[i] = value
                if value is _MISSING:
                    todo.append(i)
                else:
                    tally.waits += 1
            if not todo:
                return
            values = list(compute(todo))
            if len(values) != len(todo):
                raise ConfigError(f"compute returned {len(values)} values for {len(todo)} names")
            made = []
            for i, value in zip(todo, values, strict=True):
                out[i] = value
                if not isinstance(value, BaseException):
                    made.append(i)
            refused = self._store_made([(digests[i], names[i], out[i]) for i in made])
            for k, error in refused.items():  # in its slot, as a failure to make it would be
                out[made[k]] = error
        finally:
            for lock in locked.values():
                lock.release(remove=True)

    def put(self, name: str, sample: Any) -> None:
        """Store ``sample`` under ``name`` (replacing what was there)."""
        self._writable(f"store {name}")
        digest = self._digest(name)
        # a segment entry is an append and its record: no lock (the last one wins)
        lock = None if self._packed is not None else self._lock(digest)
        if lock is not None:
            with self._own_files(f"lock the cache entry for {name}"):
                lock.acquire()
        try:
            refused = self._store_all([(digest, name, sample)])
        finally:
            if lock is not None:
                lock.release(remove=True)
        if refused:
            raise refused[0]

    @property
    def full(self) -> bool:
        """Whether reads store nothing for now: a write found the disk full moments ago."""
        return time.monotonic() < self._full_until

    def _store_made(
        self, items: Sequence[tuple[str, str, Any]]
    ) -> dict[int, UnsupportedSampleError]:
        """Store what a read made; what the format cannot hold is refused (see
        :meth:`_store_all`). On a full disk the read still gets its samples, uncached
        (counted in ``unstored``; a warning every ``_FULL_WARN_EVERY`` s), and reads store
        nothing for ``_FULL_PAUSE`` s before trying again: a training run outlives a full disk."""
        if self.full:
            self.counters.unstored += len(items)
            return {}
        now = time.monotonic()
        try:
            return self._store_all(items)
        except CacheFullError as exc:
            self.counters.unstored += len(items)  # a batch whose first part landed: all counted
            self._full_until = now + _FULL_PAUSE
            if now - self._full_warned >= _FULL_WARN_EVERY:
                self._full_warned = now
                log.warning(
                    "%s; samples are served uncached until there is room (free space, or give "
                    "the cache a budget: Cache(max_bytes=...))",
                    exc,
                )
            return {}

    def _store_all(
        self, items: Sequence[tuple[str, str, Any]]
    ) -> dict[int, UnsupportedSampleError]:
        """Store each ``(digest, name, sample)``: segment entries together, zarr ones one by
        one. A sample the format cannot hold is left out and does not stop the others: its
        error, naming it, by its position in ``items``. The time it takes is counted
        (``write_s``: the stall report names it when filling the cache is what a loop waits on)."""
        started, (running, queued) = time.perf_counter(), thread_times()
        try:
            if self._packed is not None:
                return self._store_packed(items)
            refused = {}
            for k, (digest, name, sample) in enumerate(items):
                try:
                    self._store(digest, name, sample)
                except UnsupportedSampleError as exc:
                    refused[k] = _refused(exc, name)
            return refused
        finally:
            ran, waited = thread_times()
            self.counters.write_s += time.perf_counter() - started
            self.counters.write_cpu_s += ran - running
            self.counters.write_queued_s += waited - queued

    def _store(self, digest: str, name: str, sample: Any) -> None:
        tmp = self.root / "tmp" / f"{digest}.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            assert isinstance(self._layout, ZarrFormat)  # pt and npy: segments, above
            size = self._layout.write(sample, name, tmp, self._modes)
            if self.max_bytes is not None and size > self.max_bytes:
                self.counters.oversize += 1
                self._warn_once(name, f"not cached: {size} bytes exceed max_bytes={self.max_bytes}")
                return
            path = self._path(digest)
            make_dirs(Path(path).parent, self._modes)
            if not self._in_root(path):
                raise CacheError(
                    f"{os.path.dirname(path)} is a symlink; the cache will not follow it"
                )
            with self._usage() as used:
                self.max_bytes = used[1] or None  # the folder's, as another process set it
                if self.max_bytes is not None and used[0] + size > self.max_bytes:
                    used[0] = self._evict(int(self.max_bytes * _LOW_WATER) - size)
                used[0] += size - _remove(path)  # a stale or corrupt one may be in the way
                os.rename(tmp, path)
        except OSError as exc:
            if isinstance(exc, CacheError):
                raise
            raise self._write_error(exc, name) from exc
        finally:
            _remove(tmp)
        self.counters.writes += 1
        self.counters.bytes_written += size

    def _store_packed(
        self, items: Sequence[tuple[str, str, Any]]
    ) -> dict[int, UnsupportedSampleError]:
        """Append the entries of ``items`` to this process's segment together (what the format
        cannot hold is refused, as :meth:`_store_all` says)."""
        assert self._packed is not None
        layout, entries, names = self._packed.layout, [], []
        refused = {}
        for k, (digest, name, sample) in enumerate(items):
            try:
                entry = layout.encode(sample, bytes.fromhex(digest)[:CHECK_BYTES])
            except UnsupportedSampleError as exc:
                refused[k] = _refused(exc, name)
                continue
            if self.max_bytes is not None and entry.length > self.max_bytes:
                self.counters.oversize += 1
                self._warn_once(
                    name, f"not cached: {entry.length} bytes exceed max_bytes={self.max_bytes}"
                )
                continue
            entries.append((digest, entry))
            names.append(name)
        if not entries:
            return refused
        limit = SEGMENT_BYTES
        if self.max_bytes is not None:
            limit = min(limit, self.max_bytes // _SEGMENTS_PER_BUDGET)
        try:
            size = self._packed.append(entries, limit)
            stale = sum(self._remove_legacy(digest) for digest, _ in entries) if self._legacy else 0
            pending = _UNRECORDED_BYTES.add(self._usage_path, size - stale, self._modes)
            if self.max_bytes is not None or pending >= _UNRECORDED:
                with self._usage() as used:
                    self.max_bytes = used[1] or None  # the folder's, as another process set it
                    if self.max_bytes is not None and used[0] > self.max_bytes:
                        used[0] = self._evict(int(self.max_bytes * _LOW_WATER))
        except CacheError:
            raise  # names its file already (a link or a FIFO refused)
        except OSError as exc:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise self._write_error(exc, f"{names[0]}{more}") from exc
        self.counters.writes += len(entries)
        self.counters.bytes_written += size
        return refused

    def _write_error(self, exc: OSError, what: str) -> CacheError:
        return self._error(exc, f"write the cache entry for {what} in {self.root}")

    def _remove_legacy(self, digest: str) -> int:
        """Delete the entry an earlier version wrote as a file of its own; the bytes freed."""
        path = self._path(digest)
        return _remove(path) if self._in_root(path) else 0

    def _warn_once(self, name: str, message: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.warning("%s: %s", message, name)

    # --- the byte budget ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _usage(self) -> Iterator[list[int]]:
        """``[bytes in entries/, budget (0: none)]``, read and written back in place under the
        usage file's lock, with the bytes this process had yet to record (read only: read,
        never written)."""
        path = self._usage_path
        if not self.read_only:
            with _usage_file(path, self._scan_bytes, self._modes) as state:
                state[0] += _UNRECORDED_BYTES.take(self._usage_path)
                yield state
            return
        try:
            raw = read_regular(path)
        except FileNotFoundError:
            yield [self._scan_bytes(), 0]
            return
        yield _parse_usage(raw[:64], self._scan_bytes)

    def _add_usage(self, delta: int) -> None:
        with self._usage() as used:
            used[0] += delta

    def _files(self) -> Iterator[os.DirEntry[str]]:
        """This format's entries on disk (another format's are its own Cache's business).

        Only what the cache writes is seen: two levels of two-hex-digit folders (never a
        symlink) holding files named by a digest; a stray ``.DS_Store`` or a link is ignored.
        """
        for shard in _subfolders(self._entry_root):
            for inner in _subfolders(shard):
                with os.scandir(inner) as items:
                    yield from (item for item in items if self._ours(item))

    def _ours(self, item: os.DirEntry[str]) -> bool:
        suffix = self._layout.suffix
        name = item.name
        if not (name.endswith(suffix) and _DIGEST.fullmatch(name[: len(name) - len(suffix)])):
            return False
        return item.is_dir(follow_symlinks=False) == self._layout.directory

    def _in_root(self, path: str) -> bool:
        """Whether ``path``'s shard folders are real folders (never links out of the root)."""
        inner = os.path.dirname(path)
        return _real_dir(inner) and _real_dir(os.path.dirname(inner))

    def _entries(self) -> Iterator[_Entry]:
        """Entries in files of their own, then segments (each a unit of eviction)."""
        for item in self._files():
            with contextlib.suppress(FileNotFoundError):
                size = entry_bytes(item.path, self._layout.directory)
                yield _Entry(item.name.split(".")[0], item.path, size, item.stat().st_mtime)
        if self._packed is not None:
            for item in self._packed.segment_files():
                with contextlib.suppress(FileNotFoundError):
                    found = item.stat(follow_symlinks=False)
                    yield _Entry("", item.path, found.st_size, found.st_mtime, segment=True)

    def _scan_bytes(self) -> int:
        return sum(e.size for e in self._entries())

    def _evict(self, target: int) -> int:
        """Delete least recently used entries (pt, npy: segments of them) until at most
        ``target`` bytes remain; the rest. This process's open segment is finished first, so it
        can go too; another process's stays until it finishes it."""
        if self._packed is not None:
            self._packed.seal()
        entries = sorted(self._entries(), key=lambda e: e.used)
        total = sum(e.size for e in entries)
        for entry in entries:
            if total <= target:
                break
            if entry.segment:
                assert self._packed is not None
                freed, held = self._packed.remove_segment(entry.path)
                total -= freed
                self.counters.evictions += held
                continue
            lock = self._lock(entry.digest)
            if not lock.acquire(blocking=False):
                continue  # being read (zarr) or rewritten: never pulled from under a reader
            try:
                total -= _remove(entry.path)
            finally:
                lock.release(remove=True)
            self.counters.evictions += 1
        return total

    # --- maintenance --------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int | None]:
        """This process's counters plus the bytes in the cache and the budget."""
        with self._own_files("read the cache's usage"), self._usage() as used:
            size, self.max_bytes = used[0], used[1] or None
        return {**self.counters.snapshot(), "used_bytes": size, "max_bytes": self.max_bytes}

    def __len__(self) -> int:
        with self._own_files("count the cache's entries"):
            packed = 0 if self._packed is None else self._packed.count()
            return packed + sum(1 for _ in self._files())  # no sizes needed: no stat per entry

    def delete(self, name: str) -> bool:
        """Remove ``name``'s entry; False when there was none."""
        self._writable(f"delete {name}")
        digest = self._digest(name)
        with self._own_files(f"delete the cache entry for {name}"):
            lock = self._lock(digest)
            path = self._path(digest)
            lock.acquire()
            try:
                packed = self._packed is not None and self._packed.holds([digest])[0]
                if packed and self._packed is not None:
                    self._packed.remove(digest)  # its bytes go with their segment
                freed = _remove(path) if self._in_root(path) else 0
            finally:
                lock.release(remove=True)
            self._add_usage(-freed)
            return packed or freed > 0

    def verify(self) -> VerifyReport:
        """Read every entry in full; delete the corrupt ones (they are recomputed on next use)."""
        with self._own_files("verify the cache"):
            report = VerifyReport()
            for entry in self._entries():
                if entry.segment:
                    continue  # its entries are checked one by one below
                report.checked += 1
                try:
                    self._read(entry.digest, entry.path)
                except FileNotFoundError:
                    continue
                except CorruptEntryError as exc:
                    report.corrupt.append(self._name_of(entry.path))
                    report.removed_bytes += entry.size
                    self._discard_file(entry.digest, entry.path, exc)
            if self._packed is not None:
                self._verify_packed(report)
            if not self.read_only:
                self._remove_stale_tmp()
            with self._usage() as used:
                used[0] = self._scan_bytes()
            return report

    def _verify_packed(self, report: VerifyReport) -> None:
        assert self._packed is not None
        for digest, where, label in self._packed.live():
            try:
                found = self._packed.read(digest, touch=False)
                if found is None:
                    continue  # its segment went meanwhile
                self._unpacked(digest, found)
                report.checked += 1
            except CorruptEntryError as exc:
                report.checked += 1
                report.corrupt.append(self._packed.name_of(where, label))
                report.removed_bytes += where.length
                self._discard_packed(digest, exc, held=False)

    def _name_of(self, path: str) -> str:
        try:
            return self._layout.name_of(path)
        except (OSError, CorruptEntryError):
            return os.path.basename(path)  # too damaged to say: the file name (a digest)

    def prune(self, max_bytes: int | None = None) -> int:
        """Evict down to ``max_bytes`` (default: the folder's budget); entries removed."""
        self._writable("prune")
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
            raise ConfigError(
                f"Cache.prune max_bytes must be None or an int >= 0, got {max_bytes!r}"
            )
        before = self.counters.evictions
        with self._own_files("prune the cache"), self._usage() as used:
            target = (used[1] or None) if max_bytes is None else max_bytes
            if target is None:
                raise ConfigError("Cache.prune needs max_bytes (this cache has no budget)")
            used[0] = self._evict(target)
        return self.counters.evictions - before

    def clear(self) -> None:
        """Remove every entry of every format (the directory stays a fastload cache); every
        format's byte count goes back to zero with them."""
        self._writable("clear")
        with self._own_files("clear the cache"):
            self._check_subdirs()
            self._full_until = -_FULL_WARN_EVERY  # room again: reads store at once
            _UNRECORDED_BYTES.take(self._usage_path)  # those bytes go too
            if self._packed is not None:
                self._packed.close()
                self._packed = self._segments()
            self._clear_all()

    def _clear_all(self) -> None:
        """Empty the entries' folders and zero every format's count, under their locks."""
        counters = sorted(self.root.glob("usage-*"))
        locks = [FileLock(path, modes=self._modes) for path in counters]
        try:  # (one refused: those taken before it are let go)
            for lock in locks:  # in name order: two clears never wait on each other
                lock.acquire()
            for sub in ("entries", "locks", "segments", "index"):
                folder = self.root / sub
                shutil.rmtree(folder, ignore_errors=True)
                try:
                    make_dir(folder, self._modes)
                except FileExistsError:
                    raise CacheError(
                        f"cannot clear the cache in {self.root}: {_stuck(folder)}"
                    ) from None
            for lock in locks:  # written through the lock's descriptor: a checked regular file
                os.pwrite(lock.fd, b"%020d" % 0, 0)
        finally:
            for lock in locks:
                lock.release()


def _refused(error: UnsupportedSampleError, name: str) -> UnsupportedSampleError:
    """``error`` naming the sample the cache cannot hold (its message names the place)."""
    refused = UnsupportedSampleError(f"{error}; not cached: {name}")
    refused.__cause__ = error
    return refused


@contextlib.contextmanager
def _usage_file(
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


def _remove(path: str | Path) -> int:
    """Delete a file or folder if present; the bytes freed."""
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


def _being_made(name: str) -> bool:
    """Whether a file of a cache directory's root is one another process writes first when it
    makes the cache (before the marker): its tag, or the tag's or the marker's temporary file."""
    return name == "CACHEDIR.TAG" or name.startswith(("CACHEDIR.TAG.", f"{_MARKER}."))


def _atomic_text(path: Path, text: str, modes: Modes) -> None:
    """``text`` as the file ``path``: written whole as a new file of a random name (``O_EXCL``:
    nothing already there is truncated or written through), then renamed over it."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with naming(tmp), open(open_file(tmp, os.O_WRONLY | os.O_EXCL, modes), "w") as out:
        out.write(text)
    os.replace(tmp, path)


def _stuck(folder: Path) -> str:
    """Why ``folder`` is still there after ``rmtree``: the first folder in it that this process
    may not empty, and the permission it lacks."""
    refused: list[OSError] = []
    for here, _, _ in os.walk(folder, onerror=refused.append):
        if refused:
            break
        if not os.access(here, os.R_OK | os.W_OK | os.X_OK):
            return denied(here, writing=True)
    if refused:
        return denied(refused[0].filename or folder, writing=True)
    return f"{folder} is not empty (another process wrote in it meanwhile)"


def _real_dir(path: str | Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


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


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno)) + ": " + os.strerror(exc.errno)
    return type(exc).__name__
