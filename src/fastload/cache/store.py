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
                                     own lock: cache/_budget.py): every process sharing the folder
                                     keeps to one budget
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

How a format's entries lie (segments, or a folder each) is its layout's business
(cache/_layout.py), chosen once when the Cache is opened; the Cache keeps names, locks, the
budget and the counters.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastload.cache._budget import Budget
from fastload.cache._entries import Folders, OwnFiles, WithEarlier, real_dir, remove_entry
from fastload.cache._layout import MISSING, Damaged, Item, Layout, name_digest
from fastload.cache._locks import EntryLock, EntryLocks, FileLock
from fastload.cache._perms import (
    PRIVATE,
    SHARED,
    Modes,
    denied,
    make_dir,
    make_dirs,
    naming,
    open_file,
    read_regular,
)
from fastload.cache._segments import Segments
from fastload.cache.formats import FORMATS, FileFormat, ZarrFormat
from fastload.errors import (
    CacheError,
    CacheFullError,
    ConfigError,
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
_SUBDIRS = ("entries", "locks", "tmp", "segments", "index")
_NEWER_SUBDIRS = ("segments", "index")  # a read-only cache of an earlier version lacks them
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a write failing so leaves a read's sample uncached
_FULL_PAUSE = 10.0  # s: after a full disk, reads store nothing for this long, then try again
_FULL_WARN_EVERY = 600.0  # s between warnings while the disk stays full
_TMP_NAME = re.compile(r"([0-9a-f]{40})\.\d+\.[0-9a-f]{8}")


@dataclass
class VerifyReport:
    """What :meth:`Cache.verify` found: entries checked, corrupt ones (by name) and bytes freed."""

    checked: int = 0
    corrupt: list[str] = field(default_factory=list)
    removed_bytes: int = 0


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

    ``always``: cache every sample. By default a dataset whose samples are read in chunks
    (:class:`fastload.Tar`, :class:`fastload.Parquet`, :class:`fastload.Zarr`) times its first
    batches and stops using the cache, in that process, when making a sample again from its
    chunk costs less than the cache would save within ten epochs (tiny rows with a cheap
    decode); a warning and the loader's report say so (see docs/cache.md, "When fastload does
    not cache"). ``always=True`` keeps them cached, to spare the store its requests and bytes.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        format: CacheFormat = "npy",
        max_bytes: int | None = None,
        read_only: bool | None = None,
        shared: bool | None = None,
        always: bool = False,
    ) -> None:
        if format not in FORMATS:
            raise ConfigError(f"Cache format must be one of {sorted(FORMATS)}, got {format!r}")
        ok = max_bytes is None or (type(max_bytes) is int and max_bytes > 0)
        if not ok:
            raise ConfigError(f"Cache.max_bytes must be None or an int > 0, got {max_bytes!r}")
        if shared is not None and type(shared) is not bool:
            raise ConfigError(f"Cache.shared must be None, True or False, got {shared!r}")
        if type(always) is not bool:
            raise ConfigError(f"Cache.always must be True or False, got {always!r}")
        self.always = always
        self.root = Path(root).expanduser().absolute()
        self.format: CacheFormat = format
        self.counters = CacheStats()
        self._digest_prefix = f"{format}\0".encode()
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
            self._layout = self._open_layout()
            self._budget = Budget(
                self.root / f"usage-{format}",
                self._layout,
                self._modes,
                self.read_only,
                self.counters,
            )
            self._budget.adopt(max_bytes)

    def _open_layout(self) -> Layout:
        """The layout of this format's entries (cache/_layout.py): chosen here, once."""
        entries = FORMATS[self.format]()
        if isinstance(entries, ZarrFormat):
            return Folders(self.root, entries, self._lock, self._modes, self.read_only)
        assert isinstance(entries, FileFormat)
        digest_of = functools.partial(name_digest, self._digest_prefix)
        segments = Segments(self.root, entries, self._shard_width, self._modes, digest_of)
        # pt/npy entries of an earlier version (a file each) were here when this Cache was
        # opened: a miss looks for one, a write replaces one (else neither costs a syscall)
        earlier = OwnFiles(self.root, entries, self._lock)
        return segments if next(earlier.files(), None) is None else WithEarlier(segments, earlier)

    @property
    def max_bytes(self) -> int | None:
        """The budget of this format's entries (the folder's, as last read; None: none)."""
        return self._budget.max_bytes

    def __bool__(self) -> bool:
        return True  # a handle: ``if cache:`` must not count the entries on disk

    def __repr__(self) -> str:
        extra = (
            (", read_only=True" if self.read_only else "")
            + (", shared=True" if self._modes.shared else "")
            + (", always=True" if self.always else "")
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
        self._lock = EntryLocks(str(self.root / "locks"), width, self._modes)

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
            if not real_dir(self.root / sub):
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
                        remove_entry(item.path)
                    finally:
                        lock.release(remove=True)

    # --- names --------------------------------------------------------------------------------

    def _digest(self, name: str) -> str:
        if not isinstance(name, str):
            raise ConfigError(f"a cache entry's name must be a str, got {name!r}")
        return name_digest(self._digest_prefix, name.encode("utf-8", "surrogatepass"))

    def manifest_path(self, identity: str) -> Path:
        """Where the listing of the dataset ``identity`` (its URL and store) is saved."""
        digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:40]
        return self.root / "manifests" / f"{digest}.npz"

    # --- reading ------------------------------------------------------------------------------

    def _load_all(self, digests: Sequence[str], held: bool = False) -> list[Any]:
        """Each digest's sample, or MISSING when it is absent or corrupt (corrupt ones go).

        ``held``: the caller holds each name's exclusive lock.
        """
        with self._own_files("read cache entries"):
            touch = self._budget.max_bytes is not None and not self.read_only  # no budget: no order
            out, damaged = self._layout.read(digests, held=held, touch=touch)
            for entry in damaged:
                self._discard(entry, held)
            return out

    def _discard(self, entry: Damaged, held: bool) -> None:
        """Drop a corrupt entry under its lock (unless its holder is rewriting it)."""
        if self.read_only:
            log.warning("a corrupt cache entry (read only: not deleted): %s", entry.error)
            return
        lock = self._lock(entry.digest)
        if not held and not lock.acquire(blocking=False):
            return  # its holder is rewriting it
        try:
            freed = self._layout.drop(entry.digest)
        finally:
            if not held:
                lock.release(remove=True)
        if freed is None:
            return  # gone already: nothing repaired
        self.counters.repairs += 1
        if freed:
            self._budget.add(-freed)
        log.warning("dropped a corrupt cache entry (it will be recomputed): %s", entry.error)

    def get(self, name: str, default: Any = None) -> Any:
        """The cached sample, or ``default`` when there is none (a corrupt one counts as none)."""
        (value,) = self._load_all([self._digest(name)])
        self._count(value is not MISSING)
        return default if value is MISSING else value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.contains_many([name])[0]

    def contains_many(self, names: Sequence[str]) -> list[bool]:
        """Whether each name has an entry (a batch's lookahead check: the index is looked at
        once for all of them)."""
        digests = [self._digest(name) for name in names]
        with self._own_files("look up cache entries"):
            return self._layout.holds(digests)

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[Any]:
        """A zarr entry with lazy leaves (:class:`fastload.cache.ZarrArray`): index them to read
        only the chunks a crop touches. The entry is kept from eviction inside the block."""
        digest = self._digest(name)
        with contextlib.ExitStack() as held:
            with self._own_files(f"read the cache entry for {name}"):
                try:
                    sample = held.enter_context(self._layout.lazy(digest))
                except FileNotFoundError:
                    self._count(False)
                    raise KeyError(name) from None
            self._count(True)
            yield sample

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
            if value is MISSING:
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
            if value is MISSING:  # a name given twice in one call
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
                (out[i],) = self._load_all([digests[i]], held=True)
                if out[i] is MISSING:
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
                if value is MISSING:
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
            refused = self._store_made([(digests[i], names[i], out[i]) for i in made], held=True)
            for k, error in refused.items():  # in its slot, as a failure to make it would be
                out[made[k]] = error
        finally:
            for lock in locked.values():
                lock.release(remove=True)

    def put(self, name: str, sample: Any) -> None:
        """Store ``sample`` under ``name`` (replacing what was there)."""
        self._writable(f"store {name}")
        refused = self._store_all([(self._digest(name), name, sample)], held=False)
        if refused:
            raise refused[0]

    @property
    def full(self) -> bool:
        """Whether reads store nothing for now: a write found the disk full moments ago."""
        return time.monotonic() < self._full_until

    def _store_made(self, items: Sequence[Item], held: bool) -> dict[int, UnsupportedSampleError]:
        """Store what a read made; what the format cannot hold is refused (see
        :meth:`_store_all`). On a full disk the read still gets its samples, uncached
        (counted in ``unstored``; a warning every ``_FULL_WARN_EVERY`` s), and reads store
        nothing for ``_FULL_PAUSE`` s before trying again: a training run outlives a full disk."""
        if self.full:
            self.counters.unstored += len(items)
            return {}
        now = time.monotonic()
        try:
            return self._store_all(items, held)
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

    def _store_all(self, items: Sequence[Item], held: bool) -> dict[int, UnsupportedSampleError]:
        """Store each ``(digest, name, sample)`` (``held``: the caller holds their locks). A
        sample the format cannot hold is left out and does not stop the others: its error,
        naming it, by its position in ``items``. The time it takes is counted (``write_s``:
        the stall report names it when filling the cache is what a loop waits on)."""
        started, (running, queued) = time.perf_counter(), thread_times()
        try:
            stored = self._layout.store(items, self._budget, held=held)
        except CacheError:
            raise  # names its file already (a link or a FIFO refused)
        except OSError as exc:
            more = f" and {len(items) - 1} more" if len(items) > 1 else ""
            what = f"{items[0][1]}{more}"
            raise self._error(exc, f"write the cache entry for {what} in {self.root}") from exc
        finally:
            ran, waited = thread_times()
            self.counters.write_s += time.perf_counter() - started
            self.counters.write_cpu_s += ran - running
            self.counters.write_queued_s += waited - queued
        self.counters.writes += stored.writes
        self.counters.bytes_written += stored.bytes
        return stored.refused

    # --- maintenance --------------------------------------------------------------------------

    def stats(self) -> dict[str, float | int | None]:
        """This process's counters plus the bytes in the cache and the budget."""
        with self._own_files("read the cache's usage"), self._budget.usage() as used:
            size, self._budget.max_bytes = used[0], used[1] or None
        return {**self.counters.snapshot(), "used_bytes": size, "max_bytes": self.max_bytes}

    def __len__(self) -> int:
        with self._own_files("count the cache's entries"):
            return self._layout.count()

    def delete(self, name: str) -> bool:
        """Remove ``name``'s entry; False when there was none."""
        self._writable(f"delete {name}")
        digest = self._digest(name)
        with self._own_files(f"delete the cache entry for {name}"):
            lock = self._lock(digest)
            lock.acquire()
            try:
                freed = self._layout.drop(digest)
            finally:
                lock.release(remove=True)
            if freed:
                self._budget.add(-freed)
            return freed is not None

    def verify(self) -> VerifyReport:
        """Read every entry in full; delete the corrupt ones (they are recomputed on next use)."""
        with self._own_files("verify the cache"):
            report = VerifyReport()
            for damaged in self._layout.check():
                report.checked += 1
                if damaged is not None:
                    report.corrupt.append(damaged.name)
                    report.removed_bytes += damaged.size
                    self._discard(damaged, held=False)
            if not self.read_only:
                self._remove_stale_tmp()
            with self._budget.usage() as used:
                used[0] = self._budget.scan()
            return report

    def prune(self, max_bytes: int | None = None) -> int:
        """Evict down to ``max_bytes`` (default: the folder's budget); entries removed."""
        self._writable("prune")
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 0):
            raise ConfigError(
                f"Cache.prune max_bytes must be None or an int >= 0, got {max_bytes!r}"
            )
        before = self.counters.evictions
        with self._own_files("prune the cache"), self._budget.usage() as used:
            target = (used[1] or None) if max_bytes is None else max_bytes
            if target is None:
                raise ConfigError("Cache.prune needs max_bytes (this cache has no budget)")
            used[0] = self._budget.evict(target)
        return self.counters.evictions - before

    def clear(self) -> None:
        """Remove every entry of every format (the directory stays a fastload cache); every
        format's byte count goes back to zero with them."""
        self._writable("clear")
        with self._own_files("clear the cache"):
            self._check_subdirs()
            self._full_until = -_FULL_WARN_EVERY  # room again: reads store at once
            self._budget.forget()  # those bytes go too
            self._layout.cleared()
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


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno)) + ": " + os.strerror(exc.errno)
    return type(exc).__name__
