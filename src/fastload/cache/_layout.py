"""How one format's entries lie under a cache root: the one interface :class:`~fastload.cache.
Cache` uses, whichever the layout, chosen once when the cache is opened (``Cache._open_layout``).

- :class:`~fastload.cache._segments.Segments` (``pt``, ``npy``): entries packed into segment
  files, found through an index (cache/_packed.py);
- :class:`~fastload.cache._entries.Folders` (``zarr``): a folder of its own per entry,
  ``entries/ab/cd/<digest>.zarr``;
- :class:`~fastload.cache._entries.WithEarlier`: segments in front of the ``pt`` and ``npy``
  entries of earlier versions, a file each in ``entries/`` (:class:`~fastload.cache._entries.
  OwnFiles`): read, counted, evicted and verified like the rest until a write replaces them.

The Cache keeps what is the same for every layout: names and their digests, entry locks, the
byte budget (:class:`~fastload.cache._budget.Budget`, which a layout's writes keep to) and the
counters. A new layout is a class with the methods of :class:`Layout` and a line in
``Cache._open_layout``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fastload.errors import CorruptEntryError, UnsupportedSampleError

if TYPE_CHECKING:
    from fastload.cache._budget import Budget

__all__ = ["MISSING", "Damaged", "Item", "Layout", "Stored", "Unit", "name_digest", "refusal"]

MISSING: Any = object()
"""A read's slot for an entry that is not there (or was damaged: see :class:`Damaged`)."""

Item = tuple[str, str, Any]
"""An entry to store: its digest, its name and its sample."""


@dataclass(frozen=True)
class Damaged:
    """An entry that failed its checks: its digest and why; for :meth:`Layout.check`'s report
    also the name it was written under (or where it is, when it keeps none) and its bytes."""

    digest: str
    error: CorruptEntryError
    name: str = ""
    size: int = 0


@dataclass(frozen=True)
class Unit:
    """What eviction removes at once (an entry of its own, or a segment of many): where it is,
    its bytes, when it was last used (mtime), and how to remove it (the bytes freed and the
    entries that went; ``(0, 0)`` when it is in use, or gone)."""

    path: str
    size: int
    used: float
    evict: Callable[[], tuple[int, int]]


@dataclass(frozen=True)
class Stored:
    """What a layout's write did: the entries it wrote and their bytes, and the samples its
    format cannot hold, by their position in the items (each error names its sample)."""

    writes: int = 0
    bytes: int = 0
    refused: dict[int, UnsupportedSampleError] = field(default_factory=dict)


class Layout(Protocol):
    """One format's entries under a cache root. The Cache holds the entry locks around these
    calls where it must (see each); an ``OSError`` of the layout's files propagates, and the
    Cache reports it naming the cache."""

    def read(
        self, digests: Sequence[str], *, held: bool, touch: bool
    ) -> tuple[list[Any], list[Damaged]]:
        """Each entry's sample, or :data:`MISSING`; the entries among them that failed their
        checks (the Cache drops them). ``held``: the caller holds each entry's exclusive lock;
        ``touch``: mark what is read as used (the order eviction follows)."""
        ...

    def holds(self, digests: Sequence[str]) -> list[bool]:
        """Whether each entry is there (what another process removed is not)."""
        ...

    def store(self, items: Sequence[Item], budget: Budget, *, held: bool) -> Stored:
        """Write each entry (replacing what was there), keeping to ``budget``. ``held``: the
        caller holds each entry's exclusive lock."""
        ...

    def lazy(self, digest: str) -> AbstractContextManager[Any]:
        """The entry with lazy leaves, kept from eviction inside the block
        (``FileNotFoundError`` when there is none); a ``ConfigError`` for a layout that has no
        lazy reads."""
        ...

    def drop(self, digest: str) -> int | None:
        """Remove the entry (the caller holds its exclusive lock); the bytes freed, None when
        there was none."""
        ...

    def units(self) -> Iterator[Unit]:
        """What eviction may remove, each once."""
        ...

    def count(self) -> int:
        """The entries there."""
        ...

    def check(self) -> Iterator[Damaged | None]:
        """Read every entry in full: None for each sound one, its :class:`Damaged` (name and
        bytes given) for each that is not."""
        ...

    def seal(self) -> None:
        """Let what this process is writing be evicted (it writes anew next time)."""
        ...

    def cleared(self) -> None:
        """The cache's folders were emptied: start afresh."""
        ...


def name_digest(prefix: bytes, name: bytes) -> str:
    """The digest of the entry of ``name`` in the format of ``prefix`` (``b"npy\\0"``): a hash,
    so no name reaches outside the cache's root."""
    return hashlib.sha256(prefix + name).hexdigest()[:40]


def refusal(error: UnsupportedSampleError, name: str) -> UnsupportedSampleError:
    """``error`` naming the sample the cache cannot hold (its message names the place)."""
    refused = UnsupportedSampleError(f"{error}; not cached: {name}")
    refused.__cause__ = error
    return refused
