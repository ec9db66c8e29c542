"""What the cache tests look at inside a :class:`fastload.Cache`: the segments of a ``pt`` or
``npy`` cache, and where an entry of its own (``zarr``, or an earlier version's file) lies."""

from __future__ import annotations

from pathlib import Path

from fastload import Cache
from fastload.cache._entries import OwnFiles, WithEarlier
from fastload.cache._packed import Packed
from fastload.cache._segments import Segments
from fastload.cache.formats import FORMATS

__all__ = ["entry_path", "segments_of"]


def segments_of(cache: Cache) -> Packed:
    """The segments and index of a ``pt`` or ``npy`` cache."""
    layout = cache._layout
    if isinstance(layout, WithEarlier):
        layout = layout.primary
    assert isinstance(layout, Segments), layout
    return layout.packed


def entry_path(cache: Cache, name: str) -> Path:
    """Where ``name``'s entry of its own is (a zarr folder, or a file an earlier version wrote)."""
    own = OwnFiles(cache.root, FORMATS[cache.format](), cache._lock)
    return Path(own.path(cache._digest(name)))
