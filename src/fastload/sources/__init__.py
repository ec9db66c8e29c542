"""Sample sources: how a manifest's objects become samples.

A source says, for each sample, which objects it needs (its :class:`Part` s), what identifies
it (a URL-like name and a version, for the cache and for errors) and how the fetched bytes are
put together for ``decode``. Fetching, caching, lookahead, ``on_error``, ``warm`` and the stall
report live in :class:`fastload.RemoteDataset` and work the same for every source:

- :class:`~fastload.sources.single.SingleObjects`: one object, one sample;
- :class:`~fastload.sources.groups.Groups`: several objects, one sample (the channels of a
  field, a DICOM series, an image and its mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Part", "Sample", "SampleSource"]


@dataclass(frozen=True)
class Part:
    """One object a sample needs."""

    key: str  # relative to the manifest's root
    url: str
    size: int


@dataclass(frozen=True)
class Sample:
    """One sample: its name, identity (for the cache and errors), parts and label."""

    name: str  # the key, or the group name
    url: str  # names the sample in errors and in the cache
    version: str  # changes when any part changes
    parts: tuple[Part, ...]
    label: int | None = None


class SampleSource(Protocol):
    """Addressable samples over a manifest (see the module docstring)."""

    root: str
    classes: tuple[str, ...] | None  # label names, when labels are strings

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...

    def payload(self, sample: Sample, bodies: Sequence[bytes]) -> Any:
        """What ``decode`` receives for ``sample``, given its parts' bytes in order."""
