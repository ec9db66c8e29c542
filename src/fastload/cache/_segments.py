"""The ``pt`` and ``npy`` layout: entries packed into segment files, found through an index.

The segments and index are :class:`fastload.cache._packed.Packed`'s; an entry's bytes are its
format's (:class:`fastload.cache.formats.FileFormat`). A write is an append and its index
record, with no entry lock (the last one wins); eviction removes a whole segment, never one a
live writer holds, and a corrupt entry is dropped by a removal record (its bytes go with its
segment).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from fastload.cache._budget import Budget
from fastload.cache._layout import MISSING, Damaged, Item, Stored, Unit, refusal
from fastload.cache._packed import SEGMENT_BYTES, Entry, Packed
from fastload.cache._perms import Modes
from fastload.cache.formats import CHECK_BYTES, FileFormat
from fastload.errors import ConfigError, CorruptEntryError, UnsupportedSampleError

__all__ = ["Segments"]

_SEGMENTS_PER_BUDGET = 16  # a budget's segments are at most 1/16 of it: eviction can keep to it


class Segments:
    """The segments of ``format``'s entries under ``root`` (index shards ``width`` hex digits
    wide, files of ``modes``); ``digest_of`` is the digest of a name (its bytes): an earlier
    version's entry is matched to the digest looked up by the name it holds."""

    def __init__(
        self,
        root: Path,
        format: FileFormat,
        width: int,
        modes: Modes,
        digest_of: Callable[[bytes], str],
    ) -> None:
        self.format, self._digest_of = format, digest_of
        self._made = (root, format, width, modes, digest_of)
        self.packed = Packed(root, format, width, modes)

    def __reduce__(self) -> tuple[Any, ...]:
        return Segments, self._made  # open files and a lock stay here: a copy opens its own

    def read(
        self, digests: Sequence[str], *, held: bool, touch: bool
    ) -> tuple[list[Any], list[Damaged]]:
        out: list[Any] = []
        damaged: list[Damaged] = []
        for digest, found in zip(digests, self.packed.read_many(digests, touch=touch), strict=True):
            if found is None:
                out.append(MISSING)
                continue
            try:
                out.append(self._unpacked(digest, found))
            except CorruptEntryError as exc:
                damaged.append(Damaged(digest, exc))
                out.append(MISSING)
        return out, damaged

    def _unpacked(self, digest: str, found: Entry | CorruptEntryError) -> Any:
        """The sample in an entry's bytes; CorruptEntryError when they fail their checks or
        were written for another sample than the one looked up."""
        if isinstance(found, CorruptEntryError):
            raise found
        value = self.format.decode(*found)
        if not self.format.matches(found[0], digest, self._digest_of):
            raise CorruptEntryError(f"cache entry holds another sample: {found[1]}")
        return value

    def holds(self, digests: Sequence[str]) -> list[bool]:
        return self.packed.holds(digests)

    def store(self, items: Sequence[Item], budget: Budget, *, held: bool) -> Stored:
        """Append the entries to this process's segment together (a segment is at most a
        sixteenth of the budget, so that eviction can keep to it)."""
        entries, refused = [], {}
        for k, (digest, name, sample) in enumerate(items):
            try:
                entry = self.format.encode(sample, bytes.fromhex(digest)[:CHECK_BYTES])
            except UnsupportedSampleError as exc:
                refused[k] = refusal(exc, name)
                continue
            if budget.admits(name, entry.length):
                entries.append((digest, entry))
        if not entries:
            return Stored(refused=refused)
        limit = SEGMENT_BYTES
        if budget.max_bytes is not None:
            limit = min(limit, budget.max_bytes // _SEGMENTS_PER_BUDGET)
        size = self.packed.append(entries, limit)
        budget.record(size)
        return Stored(len(entries), size, refused)

    def lazy(self, digest: str) -> NoReturn:
        raise ConfigError(
            f"Cache.open reads zarr entries; this cache is format={self.format.name!r}"
        )

    def drop(self, digest: str) -> int | None:
        if not self.packed.holds([digest])[0]:
            return None
        self.packed.remove(digest)  # its bytes go with their segment
        return 0

    def units(self) -> Iterator[Unit]:
        for item in self.packed.segment_files():
            with contextlib.suppress(FileNotFoundError):
                found = item.stat(follow_symlinks=False)
                evict = functools.partial(self.packed.remove_segment, item.path)
                yield Unit(item.path, found.st_size, found.st_mtime, evict)

    def count(self) -> int:
        return self.packed.count()

    def check(self) -> Iterator[Damaged | None]:
        for digest, where, label in self.packed.live():
            try:
                found = self.packed.read(digest, touch=False)
                if found is None:
                    continue  # its segment went meanwhile
                self._unpacked(digest, found)
            except CorruptEntryError as exc:
                yield Damaged(digest, exc, self.packed.name_of(where, label), where.length)
                continue
            yield None

    def seal(self) -> None:
        self.packed.seal()

    def cleared(self) -> None:
        self.packed.close()
        self.packed = Packed(*self._made[:4])
