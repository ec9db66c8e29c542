"""Entries packed into append-only segment files, found through an append-only index.

A file per entry cost about 1 ms of kernel time to create on this project's ext4 machines (1.5-
1.9 ms with two levels of folders), against 0.05 ms to append the same bytes to an open file; and
a small entry filled a 4 KB block. So ``pt`` and ``npy`` entries go into segments::

    segments/<id><suffix>     entries one after another, self-checking, and before the first
                              entry of each structure its structure record (see
                              cache/formats.py); one writing process per segment (its id is
                              random), which holds a shared lock on it while it may append;
                              its threads take space at the end under a lock and write
                              into it at once
    index/<a><suffix>         fixed 48-byte records, one per write or removal of an entry whose
                              digest starts with ``a``: digest, segment, offset, length, CRC32C
                              (16 shards; 256, named by two digits, in a cache made before
                              2026-11-28: ``Packed.width``)

An entry's bytes are written before its record, a segment's records are appended in the order
its space was taken (each once all bytes before it are written), and a record is one
``O_APPEND`` write, so a reader never finds a record of bytes not yet written; a torn record
fails its CRC and is skipped (its entry is computed again). A removal is a record of length 0.
The last record of a digest wins. Eviction removes whole segments (the least recently used
first, by mtime), never one a live writer holds; records of a removed segment read as misses.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from crc32c import crc32c

from fastload.cache._batch import Rows, Split
from fastload.cache._locks import lock_whole
from fastload.cache._perms import Modes, exists, naming, open_file, open_regular, regular_file
from fastload.cache.formats import MIN_ENTRY, Encoded, FileFormat, read_at
from fastload.errors import CorruptEntryError

__all__ = ["SEGMENT_BYTES", "Packed", "Where"]

SEGMENT_BYTES = 256 * 2**20
"""A writer starts a new segment past this size (eviction frees space a segment at a time)."""
_RECORD = struct.Struct("<20sQQQI")  # digest, segment id, offset, length, CRC32C of the rest
_OPEN_SEGMENTS = 64  # read descriptors kept open per process
_IOV_MAX = 1024  # buffers one pwritev takes (Linux)
_STRUCTURES = 4096  # parsed structure records kept per process, by segment and offset
_FAR = 1 << 32  # an entry's structure record is less than this before it
_ALIGN, _ALIGN_FROM = 64, 4096  # entries of 4 KiB or more start 64-byte aligned in the file

Entry = tuple[np.ndarray | Split, str, dict[str, Any] | None]
"""An entry's bytes (whole, or in pieces), a description for errors, and its parsed structure
(None: an earlier version's entry, which holds its own)."""
Found = Entry | CorruptEntryError | None
"""An entry, why it cannot be read, or None: no entry."""


@dataclass(frozen=True)
class Where:
    """Where an entry's bytes are."""

    segment: int
    offset: int
    length: int


class Packed:
    """The segments and index of one format under a cache root; one per ``Cache``."""

    def __init__(self, root: Path, layout: FileFormat, width: int, modes: Modes) -> None:
        self.layout = layout
        self.modes = modes  # of the segments and index shards it makes
        self.width = width  # an index shard holds the digests that start with its name
        self.suffix = layout.suffix
        self.segments = root / "segments"
        self._folder = str(self.segments)
        self.index = root / "index"
        self._known: dict[str, dict[bytes, Where]] = {}  # per index shard, as read so far
        self._read_to: dict[str, tuple[int, int]] = {}  # shard -> (inode, bytes read)
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._structures: OrderedDict[tuple[int, int], dict[str, Any]] = OrderedDict()
        self._writer: _Writer | None = None
        self._appending: dict[str, tuple[int, int]] = {}  # index shards open to append: fd, inode
        self._mutex = threading.Condition()  # notified when records are appended
        self._pid = os.getpid()

    def _guard(self) -> threading.Condition:
        """This object's lock; a forked child gets a new one (another thread of the parent
        may have held it at the fork, and no thread of the child would ever release it), and
        opens the index for appending again (the parent's appends are not its own)."""
        if self._pid != os.getpid():
            self._mutex, self._pid = threading.Condition(), os.getpid()
            self._appending = {}
        return self._mutex

    def seal(self) -> None:
        """Finish this process's segment (it becomes evictable; the next write starts one)."""
        with self._guard():
            self._finish_writer()

    def _finish_writer(self) -> None:
        """Close this process's segment and the index shards it appended to (the caller holds
        the lock); a forked child leaves its parent's segment to the parent."""
        if self._writer is not None and self._writer.pid == os.getpid():
            self._writer.retire()
        self._writer = None
        self._close_index()

    def close(self) -> None:
        self.seal()
        with self._guard():
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # --- finding and reading ------------------------------------------------------------------

    def find(self, digest: str) -> Where | None:
        """Where ``digest``'s entry is, re-reading its index shard's new records on a miss."""
        with self._guard():
            return self._find_all([digest])[0]

    def read(self, digest: str, *, touch: bool) -> Entry | None:
        """The entry's bytes and a description for errors; None when there is none (never
        written, removed, or its segment evicted); CorruptEntryError when it is cut short.
        ``touch``: mark its segment used (the least-recently-used order is by segment)."""
        found = self.read_many([digest], touch=touch)[0]
        if isinstance(found, CorruptEntryError):
            raise found
        return found

    def read_many(self, digests: Sequence[str], *, touch: bool, again: bool = True) -> list[Found]:
        """:meth:`read` of many entries at once, each failure in its slot: the index looked
        up and each segment opened and checked once per call, and each run of entries that
        follow one another in a segment read by one ``preadv``. ``again``: look up once more
        the entries whose segment was evicted since the index was read. (Why not a map of
        each segment: docs/benchmarks.md, "Batched segment reads".)"""
        out: list[Found] = [None] * len(digests)
        gone: list[int] = []
        with self._guard():
            places = self._find_all(digests)
            spans = self.layout.spans
            rows = Rows([None if w is None else w.length for w in places], spans) if spans else None
            by_segment: dict[int, list[tuple[int, Where]]] = {}
            for i, where in enumerate(places):
                if where is not None:
                    by_segment.setdefault(where.segment, []).append((i, where))
            for segment, entries in by_segment.items():
                try:
                    self._read_runs(segment, entries, out, rows)
                except FileNotFoundError:
                    gone += [i for i, _ in entries]
                    for i, _ in entries:
                        self._forget(digests[i])
                    continue
                if touch:  # never the mtime of what a link swapped in since points to
                    with contextlib.suppress(FileNotFoundError):
                        os.utime(self._segment_path(segment), follow_symlinks=False)
        if gone and again:
            for i, found in zip(
                gone,
                self.read_many([digests[i] for i in gone], touch=touch, again=False),
                strict=True,
            ):
                out[i] = found
        return out

    def _find_all(self, digests: Sequence[str], fresh: bool = False) -> list[Where | None]:
        """:meth:`find` for each digest, each index shard re-read at most once (the caller
        holds the lock). ``fresh``: each shard is brought up to date first (a ``stat`` when
        nothing was appended), so that a removal another process recorded is seen even for
        a digest this process knows; else a known digest is taken as it is."""
        places: list[Where | None] = []
        refreshed: set[str] = set()
        if fresh:
            refreshed = {digest[: self.width] for digest in digests}
            for shard in refreshed:
                self._refresh(shard)
        for digest in digests:
            shard, key = digest[: self.width], bytes.fromhex(digest)
            known = self._known.get(shard)
            where = None if known is None else known.get(key)
            if where is None and shard not in refreshed:
                refreshed.add(shard)
                self._refresh(shard)
                where = self._known.get(shard, {}).get(key)
            places.append(where)
        return places

    def _read_runs(
        self,
        segment: int,
        entries: list[tuple[int, Where]],
        out: list[Found],
        rows: Rows | None,
    ) -> None:
        """Read ``entries`` (position, place) of one segment into ``out``, a ``preadv`` per run
        of entries that follow one another in it, each into its ``rows`` buffer (the caller
        holds the lock)."""
        fd = self._segment_fd(segment)
        path = self._segment_path(segment)
        raw: dict[int, Raw] = {}
        entries.sort(key=lambda entry: entry[1].offset)
        run: list[tuple[int, Where]] = []
        for entry in entries:
            if run and (run[-1][1].offset + run[-1][1].length != entry[1].offset):
                _read_run(fd, path, run, raw, rows)
                run = []
            run.append(entry)
        _read_run(fd, path, run, raw, rows)
        for i, where in entries:
            out[i] = self._with_structure(fd, segment, where, raw[i])

    def _with_structure(self, fd: int, segment: int, where: Where, raw: Raw) -> Found:
        """The entry read, with its structure record parsed (once per process and record)."""
        if isinstance(raw, CorruptEntryError):
            return raw
        buffer, label = raw
        distance = self.layout.distance(buffer)
        if distance is None:
            return buffer, label, None
        at = (segment, where.offset - distance)
        structure = self._structures.get(at)
        if structure is None:
            try:
                structure = self.layout.structure(fd, at[1], label)
            except (CorruptEntryError, OSError) as exc:
                if self._writer is not None and self._writer.segment == segment:
                    self._writer.structures.clear()  # write a sound one for the next entries
                if isinstance(exc, CorruptEntryError):
                    return exc
                return CorruptEntryError(f"cache entry's structure cannot be read ({exc}): {label}")
            self._structures[at] = structure
            if len(self._structures) > _STRUCTURES:
                self._structures.popitem(last=False)
        return buffer, label, structure

    def holds(self, digests: Sequence[str]) -> list[bool]:
        """Whether the index has each digest and its segment is there (each index shard and
        segment looked at once, the shards brought up to date: what another process removed
        is not said to be there)."""
        with self._guard():
            places = self._find_all(digests, fresh=True)
        there = {
            segment: exists(self._segment_path(segment))
            for segment in {where.segment for where in places if where is not None}
        }
        return [where is not None and there[where.segment] for where in places]

    def count(self) -> int:
        """Entries whose segment is there."""
        present = {int(item.name[:16], 16) for item in self.segment_files()}
        return sum(1 for _, where, _ in self.live() if where.segment in present)

    def name_of(self, where: Where, label: str) -> str:
        """The name an entry was written under, read even from a damaged one when its header
        survived (else where it is)."""
        try:
            with self._guard():
                raw = os.pread(self._segment_fd(where.segment), where.length, where.offset)
            return self.layout.name_in(np.frombuffer(raw, np.uint8), label)
        except (OSError, CorruptEntryError):
            return label

    def _segment_fd(self, segment: int) -> int:
        """An open descriptor of the segment (the caller holds the lock), checked once per
        open to be a regular file: a link to another file (say another cache's segment,
        whose entries would pass their checks) is refused, not served."""
        fd = self._fds.get(segment)
        if fd is not None and os.fstat(fd).st_nlink:
            self._fds.move_to_end(segment)
            return fd
        if fd is not None:  # evicted or cleared since it was opened
            os.close(self._fds.pop(segment))
        fd, _ = open_regular(self._segment_path(segment))
        self._fds[segment] = fd
        if len(self._fds) > _OPEN_SEGMENTS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _forget(self, digest: str) -> None:
        """Drop what the index said of ``digest`` (the caller holds the lock)."""
        self._known.get(digest[: self.width], {}).pop(bytes.fromhex(digest), None)
        self._read_to.pop(digest[: self.width], None)  # read the shard again from its start

    def _refresh(self, shard: str) -> None:
        """Apply the shard's records appended since the last read (all of them if the file was
        replaced or is new to this process)."""
        path = self._index_path(shard)
        try:
            status = os.lstat(path)
            if self._read_to.get(shard) == (status.st_ino, status.st_size):
                return  # nothing new: a stat, not an open and a read (a cold epoch's misses)
            fd, opened = open_regular(path)
        except FileNotFoundError:  # none yet, or cleared
            self._known.pop(shard, None)
            self._read_to.pop(shard, None)
            return
        try:
            inode = opened.st_ino
            seen_inode, start = self._read_to.get(shard, (inode, 0))
            if seen_inode != inode:
                start = 0
            if start == 0:
                self._known[shard] = {}
            known = self._known.setdefault(shard, {})
            raw = _read_all(fd, start)
        finally:
            os.close(fd)
        whole = len(raw) - len(raw) % _RECORD.size
        for key, segment, offset, length, crc in _RECORD.iter_unpack(raw[:whole]):
            if crc32c(_fields(key, segment, offset, length)) != crc:
                continue  # a torn record: its entry is a miss
            if length:
                known[key] = Where(segment, offset, length)
            else:
                known.pop(key, None)
        self._read_to[shard] = (inode, start + whole)

    def live(self) -> list[tuple[str, Where, str]]:
        """Every entry the index holds, as of now (segments maybe gone since): its digest,
        place and a description for reports."""
        with self._guard():
            for shard in {*_shards(self.index, self.suffix, self.width), *self._known}:
                self._refresh(shard)
            return [
                (key.hex(), at, f"{self._segment_path(at.segment)}@{at.offset}")
                for known in self._known.values()
                for key, at in known.items()
            ]

    # --- writing ------------------------------------------------------------------------------

    def append(self, entries: Sequence[tuple[str, Encoded]], limit: int) -> int:
        """Write entries, each after its structure record unless its segment has that one,
        then their index records; the bytes written. Their space at the end of this process's
        segment is taken under the lock and written outside it (one ``pwritev`` per segment),
        so that threads fill the page cache at once; a segment's records are appended in the
        order its space was taken, each once every write before it is done, so no record
        names bytes (or a structure record) not yet written. Returns once the entries are
        recorded (or dropped, after a failed write), as a reader that waited on their entry
        locks expects. A new segment starts when this one would pass ``limit`` bytes (or was
        removed: ``clear``)."""
        taken: list[_Pending] = []
        with self._guard():
            pending: _Pending | None = None
            for digest, entry in entries:
                room = len(entry.structure) + _ALIGN + entry.length
                if pending is None or not pending.writer.fits(
                    pending.length + room, limit, pending.length
                ):
                    if pending is not None:
                        taken.append(pending.writer.take(pending))
                    writer = self._writer
                    if writer is None or not writer.fits(room, limit):
                        writer = self._new_writer()
                    pending = _Pending(writer)
                pending.place(digest, entry)
            if pending is not None:
                taken.append(pending.writer.take(pending))
        try:
            for part in taken:
                part.writer.write(part)
        finally:
            guard = self._guard()
            with guard:
                ready: list[tuple[str, Where]] = []
                for part in taken:
                    ready += part.writer.done(part)
                    if part.writer.broken and part.writer is self._writer:
                        self._finish_writer()  # part of it may be in the file: no more there
                try:
                    self._record_all(ready)
                finally:
                    guard.notify_all()
                while not all(part.settled for part in taken):
                    guard.wait()  # for another thread's earlier write in the same segment
        return sum(part.length for part in taken)

    def _new_writer(self) -> _Writer:
        """Finish this process's segment and start one (the caller holds the lock)."""
        self._finish_writer()
        self._writer = _Writer(self.segments, self.suffix, self.modes)
        return self._writer

    def remove(self, digest: str) -> None:
        """Record that ``digest`` has no entry (its bytes stay until their segment goes)."""
        with self._guard():
            self._record(digest, Where(0, 0, 0))

    def _record(self, digest: str, where: Where) -> None:
        self._record_all([(digest, where)])

    def _record_all(self, places: Sequence[tuple[str, Where]]) -> None:
        """Append index records, one ``write`` per index shard (the caller holds the lock)."""
        by_shard: dict[str, list[bytes]] = {}
        for digest, where in places:
            key = bytes.fromhex(digest)
            fields = _fields(key, where.segment, where.offset, where.length)
            shard = digest[: self.width]
            by_shard.setdefault(shard, []).append(fields + crc32c(fields).to_bytes(4, "little"))
            known = self._known.get(shard)
            if known is not None:  # our own write: no need to read it back
                if where.length:
                    known[key] = where
                else:
                    known.pop(key, None)
        for shard, records in by_shard.items():
            fd, inode = self._index_fd(shard)
            data = b"".join(records)
            with naming(self._index_path(shard)):
                os.write(fd, data)
            end = os.lseek(fd, 0, os.SEEK_CUR)  # appending: the end of what this wrote
            if self._read_to.get(shard) == (inode, end - len(data)):
                # nothing between what was read and this: its records are known already, so
                # the next look at the shard (a cold epoch's next miss) does not read them back
                self._read_to[shard] = (inode, end)

    def _index_fd(self, shard: str) -> tuple[int, int]:
        """The shard's index, open for appending, and its inode (the caller holds the lock).
        Kept open while this process writes to one segment: a cleared index goes with the
        segment, and the next segment opens the index again."""
        opened = self._appending.get(shard)
        if opened is None:
            path = self._index_path(shard)
            fd = open_file(path, os.O_WRONLY | os.O_APPEND, self.modes)
            opened = self._appending[shard] = (fd, regular_file(fd, path).st_ino)
        return opened

    def _index_path(self, shard: str) -> str:
        return f"{self.index}/{shard}{self.suffix}"

    def _close_index(self) -> None:
        """Close the index shards open for appending (the caller holds the lock)."""
        for fd, _ in self._appending.values():
            os.close(fd)
        self._appending = {}

    # --- segments as a whole ------------------------------------------------------------------

    def segment_files(self) -> Iterator[os.DirEntry[str]]:
        """This format's segment files (a stray file or a link is not one)."""
        name = re.compile(r"[0-9a-f]{16}" + re.escape(self.suffix))
        try:
            with os.scandir(self.segments) as items:
                yield from (
                    item
                    for item in items
                    if name.fullmatch(item.name) and item.is_file(follow_symlinks=False)
                )
        except FileNotFoundError:
            return

    def remove_segment(self, path: str) -> tuple[int, int]:
        """Delete a segment no writer holds; the bytes freed and the entries it held (0, 0 when
        held or gone)."""
        try:
            fd, _ = open_regular(path, os.O_RDWR)
        except FileNotFoundError:
            return 0, 0
        try:
            if not lock_whole(fd, shared=False):
                return 0, 0  # its writer may still append
            size = os.fstat(fd).st_size  # once locked: no writer appends any more
            os.unlink(path)
        finally:
            os.close(fd)
        segment = int(os.path.basename(path)[:16], 16)
        entries = sum(1 for _, where, _ in self.live() if where.segment == segment)
        with self._guard():
            stale = self._fds.pop(segment, None)
            if stale is not None:
                os.close(stale)
        return size, entries

    def _segment_path(self, segment: int) -> str:
        return f"{self._folder}/{segment:016x}{self.suffix}"  # a str: no Path per read


class _Writer:
    """This process's open segment, under a shared lock held until it is closed. Its methods
    but :meth:`write` are called under the owning ``Packed``'s lock."""

    def __init__(self, folder: Path, suffix: str, modes: Modes) -> None:
        self.pid = os.getpid()
        self.segment = int.from_bytes(secrets.token_bytes(8), "little") or 1
        self.path = str(folder / f"{self.segment:016x}{suffix}")
        self.fd = open_file(self.path, os.O_RDWR | os.O_EXCL, modes)
        lock_whole(self.fd, shared=True)
        self.size = 0  # bytes taken, written or not
        self.structures: dict[bytes, int] = {}  # structure record -> its offset here
        self.queue: deque[_Pending] = deque()  # taken and not yet recorded, in order
        self.broken = False  # a write failed: nothing more is recorded or taken here
        self._retired = False

    def fits(self, length: int, limit: int, planned: int = 0) -> bool:
        """Whether this process may append ``length`` more bytes to this segment (it is ours,
        under ``limit`` after them, or empty, and still there), ``planned`` of them already
        found to fit."""
        if planned:
            return self.size + length <= limit
        if self.pid != os.getpid() or self.broken:
            return False
        if self.size and self.size + length > limit:
            return False
        return os.fstat(self.fd).st_nlink > 0

    def take(self, pending: _Pending) -> _Pending:
        """Take the space ``pending`` placed its entries in."""
        self.size += pending.length
        self.queue.append(pending)
        return pending

    def write(self, pending: _Pending) -> None:
        """Write ``pending``'s bytes into its space (without the lock)."""
        written = 0
        views: Sequence[bytes | memoryview] = pending.pieces
        while True:
            with naming(self.path):
                written += os.pwritev(self.fd, views[:_IOV_MAX], pending.start + written)
            if written >= pending.length:
                break
            views = _after([memoryview(p).cast("B") for p in pending.pieces], written)
        pending.written = True

    def done(self, pending: _Pending) -> list[tuple[str, Where]]:
        """After :meth:`write` (or its failure, or none: an earlier part's write failed): the
        places to record now, those of the taken space written without a gap before it."""
        pending.failed = not pending.written
        ready: list[tuple[str, Where]] = []
        while self.queue and (self.queue[0].written or self.queue[0].failed):
            first = self.queue.popleft()
            self.broken = self.broken or first.failed
            if not self.broken:
                ready += first.places
            first.settled = True
        if self._retired and not self.queue:
            self.close()
        return ready

    def retire(self) -> None:
        """Close once the writes in progress are done."""
        self._retired = True
        if not self.queue:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:  # once: the number may name another file afterwards
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


class _Pending:
    """Entries placed at the end of a segment and not yet written: their bytes and places."""

    def __init__(self, writer: _Writer) -> None:
        self.writer = writer
        self.start = writer.size
        self.pieces: list[bytes | memoryview] = []
        self.places: list[tuple[str, Where]] = []
        self.length = 0
        self.written = self.failed = False
        self.settled = False  # recorded, or dropped after a failed write

    def place(self, digest: str, entry: Encoded) -> None:
        writer = self.writer
        end = self.start + self.length
        at = writer.structures.get(entry.structure)
        if at is None or end - at >= _FAR:  # the writer is dropped if the write fails
            at = writer.structures[entry.structure] = end
            self.pieces.append(entry.structure)
            end += len(entry.structure)
        gap = -end % _ALIGN if entry.length >= _ALIGN_FROM else 0
        if gap:
            self.pieces.append(bytes(gap))
            end += gap
        self.pieces += entry.body
        self.pieces.append(entry.tail(end - at))
        self.places.append((digest, Where(writer.segment, end, entry.length)))
        self.length = end + entry.length - self.start


def _after(views: list[memoryview], count: int) -> list[memoryview]:
    """What is left of ``views`` once ``count`` bytes of them were written."""
    left = []
    for view in views:
        if count >= view.nbytes:
            count -= view.nbytes
            continue
        left.append(view[count:])
        count = 0
    return left


Raw = tuple[np.ndarray | Split, str] | CorruptEntryError
"""An entry's bytes and a description for errors, or why they cannot be read."""


def _read_one(fd: int, path: str, where: Where) -> Raw:
    label = f"{path}@{where.offset}"
    try:
        return read_at(fd, where.offset, where.length, label), label
    except CorruptEntryError as exc:
        return exc


def _read_run(
    fd: int, path: str, run: list[tuple[int, Where]], out: dict[int, Raw], rows: Rows | None
) -> None:
    """Entries that follow one another in a segment, read by one ``preadv`` into ``out`` by
    position (after a short read, of a segment cut short, each is read alone to say which entry
    is truncated)."""
    if rows is None:
        buffers: list[np.ndarray | Split] = [np.empty(where.length, np.uint8) for _, where in run]
    else:
        buffers = [rows.buffer(i, where.length) for i, where in run]
    start = run[0][1].offset
    total = sum(where.length for _, where in run)
    views: list[memoryview] = []
    for buffer in buffers:
        if isinstance(buffer, Split):
            views += buffer.pieces
        else:
            views.append(buffer.data)
    got = 0
    while got < total and (count := os.preadv(fd, views[:_IOV_MAX], start + got)):
        got += count
        if got < total:  # a run longer than one call takes, or a short read
            views = _after(views, count)
    if got != total:
        for i, where in run:
            out[i] = _read_one(fd, path, where)
        return
    for (i, where), buffer in zip(run, buffers, strict=True):
        label = f"{path}@{where.offset}"
        if where.length < MIN_ENTRY:
            out[i] = CorruptEntryError(f"cache entry is truncated ({where.length} bytes): {label}")
        else:
            if isinstance(buffer, Split):
                buffer.crc()  # now: its bytes are still in the CPU's cache (a third faster)
            out[i] = buffer, label


def _fields(key: bytes, segment: int, offset: int, length: int) -> bytes:
    return _RECORD.pack(key, segment, offset, length, 0)[: _RECORD.size - 4]


def _read_all(fd: int, start: int) -> bytes:
    chunks = []
    while chunk := os.pread(fd, 1 << 20, start):
        chunks.append(chunk)
        start += len(chunk)
    return b"".join(chunks)


def _shards(folder: Path, suffix: str, width: int) -> list[str]:
    try:
        with os.scandir(folder) as items:
            return sorted(
                item.name[: -len(suffix)]
                for item in items
                if item.name.endswith(suffix) and len(item.name) == width + len(suffix)
            )
    except FileNotFoundError:
        return []
