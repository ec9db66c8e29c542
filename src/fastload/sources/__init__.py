"""Sample sources: how a manifest's objects become samples.

A source says, for each sample, which objects it needs (its :class:`Part` s), what identifies
it (a URL-like name and a version, for the cache and for errors) and how the fetched bytes are
put together for ``decode``. Fetching, caching, lookahead, ``on_error``, ``warm`` and the stall
report live in :class:`fastload.RemoteDataset` and work the same for every source:

- :class:`~fastload.sources.single.SingleObjects`: one object, one sample;
- :class:`~fastload.sources.groups.Groups`: several objects, one sample (the channels of a
  field, a DICOM series, an image and its mask);
- :class:`~fastload.sources.tar.TarShards` and :class:`~fastload.sources.parquet.ParquetShards`:
  many samples in one object, read in place by byte range (see :mod:`fastload.sources._chunks`).

A source names samples cheaply too (:meth:`SampleSource.identities`: all a warm batch needs
to find them in the cache). It also says how its samples are read (:meth:`SampleSource.read`):
whole objects, all at once (:func:`read_objects`), or chunks of shards. A source with chunks
names them as ``blocks`` (the index of each chunk's first sample), which shard-aware shuffling
follows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from fastload.errors import DecodeError, StoreError
from fastload.fetcher import Fetcher, Request

__all__ = ["Part", "Sample", "SampleSource", "group_version", "read_objects", "refreshed"]


@dataclass(frozen=True)
class Part:
    """One object a sample needs."""

    key: str  # relative to the manifest's root
    url: str
    size: int  # bytes read for it (a whole object, or a sample's share of a chunk)
    version: str = ""  # the object's, as listed


@dataclass(frozen=True)
class Sample:
    """One sample: its name, identity (for the cache and errors), parts and label."""

    name: str  # the key, or the group name
    url: str  # names the sample in errors and in the cache
    version: str  # changes when any part changes
    parts: tuple[Part, ...]
    label: int | None = None
    index: int = -1  # its position in the source


class SampleSource(Protocol):
    """Addressable samples over a manifest (see the module docstring)."""

    root: str
    classes: tuple[str, ...] | None  # label names, when labels are strings

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...

    def identities(self, indices: Sequence[int]) -> list[tuple[str, str, int | None]]:
        """The URL, version and label of the samples at ``indices``, as ``self[i]`` has them,
        without a :class:`Sample` each (a warm batch needs only their cache names)."""

    @property
    def reader_version(self) -> str:
        """Part of every sample's cache name: changes when what ``read`` gives for an unchanged
        object does ("" where that is the object's bytes)."""

    @property
    def blocks(self) -> np.ndarray | None:
        """The first sample of each chunk read as one (None: samples are read one by one)."""

    def read(self, samples: Sequence[Sample], fetcher: Fetcher) -> list[Any]:
        """What ``decode`` receives for each sample, or the exception it failed with."""


def group_version(parts: Sequence[Part]) -> str:
    """A group's version: it changes when any member's key, version or size does."""
    identity = "\0".join(f"{p.key}\0{p.version}\0{p.size}" for p in parts)
    return hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def refreshed(sample: Sample, parts: Sequence[Part]) -> Sample:
    """``sample`` made of its objects' current versions ``parts``."""
    version = parts[0].version if len(parts) == 1 else group_version(parts)
    return replace(sample, version=version, parts=tuple(parts))


def read_objects(
    samples: Sequence[Sample],
    fetcher: Fetcher,
    payload: Callable[[Sample, Sequence[bytes]], Any],
) -> list[Any]:
    """Every part of every sample fetched at once; ``payload`` puts a sample's bodies together.

    A sample whose part failed gets that failure (for a group: naming the group and member).
    """
    requests = [
        Request(part.url, size=part.size, version=part.version or None)
        for s in samples
        for part in s.parts
    ]
    bodies = fetcher.fetch(requests, return_exceptions=True)
    out, start = [], 0
    for sample in samples:
        mine = bodies[start : start + len(sample.parts)]
        start += len(sample.parts)
        failed = next((b for b in mine if isinstance(b, BaseException)), None)
        if failed is None:
            out.append(payload(sample, mine))
        else:
            out.append(_in_group(failed, sample) if len(sample.parts) > 1 else failed)
    return out


def _in_group(error: BaseException, sample: Sample) -> BaseException:
    """``error`` (a member's) as the failure of the whole group, naming group and member."""
    member = getattr(error, "url", None) or ""
    reason = str(error).removesuffix(f": {member}") if member else str(error)
    message = f"group {sample.name!r}: member {member or '?'} failed ({reason})"
    if isinstance(error, (StoreError, DecodeError)):
        wrapped: BaseException = type(error)(message, url=sample.url)
    else:
        wrapped = DecodeError(message, url=sample.url)
    wrapped.__cause__ = error
    return wrapped
