"""Sample sources: how a manifest's objects become samples.

A *source object* (:class:`Source`) is what users give :class:`fastload.RemoteDataset`: where
the samples are (a URL or a :class:`~fastload.Manifest`, a key ``pattern``, where the listing
is saved) and the options of its shape, which no other class takes. The registry
(:mod:`fastload.sources.registry`) names them: :class:`~fastload.sources.single.Objects`,
:class:`~fastload.sources.groups.Groups`, :class:`~fastload.sources.tar.Tar`,
:class:`~fastload.sources.parquet.Parquet`, :class:`~fastload.sources.zarr.Zarr` and what a
project adds. Opened over a listed manifest (:meth:`Source.open`), a source object gives the
reader of its samples, a :class:`SampleSource`. A new format is one module with both, and a
line in the registry.

A reader says, for each sample, which objects it needs (its :class:`Part` s), what identifies
it (a URL-like name and a version, for the cache and for errors) and how the fetched bytes are
put together for ``decode``. Fetching, caching, lookahead, ``on_error``, ``warm`` and the stall
report live in :class:`fastload.RemoteDataset` and work the same for every source:

- :class:`~fastload.sources.single.SingleObjects`: one object, one sample;
- :class:`~fastload.sources.groups.GroupedObjects`: several objects, one sample (the channels
  of a field, a DICOM series, an image and its mask);
- :class:`~fastload.sources.tar.TarShards` and :class:`~fastload.sources.parquet.ParquetShards`:
  many samples in one object, read in place by byte range (see :mod:`fastload.sources._chunks`);
- :class:`~fastload.sources.zarr.ZarrArray`: samples along an array's first axes, read chunk by
  chunk.

A source names samples cheaply too (:meth:`SampleSource.identities`: all a warm batch needs
to find them in the cache). It also says how its samples are read (:meth:`SampleSource.read`):
whole objects, all at once (:func:`read_objects`), or chunks of shards. A source with chunks
names them as ``blocks`` (the index of each chunk's first sample), which shard-aware shuffling
follows.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import numpy as np

from fastload.errors import ConfigError, DecodeError, StoreError
from fastload.fetcher import Fetcher, Request
from fastload.manifest import Manifest
from fastload.transforms import decoder

if TYPE_CHECKING:
    from fastload.cache import Cache
    from fastload.sources.labels import Labels

__all__ = [
    "Opening",
    "Part",
    "Sample",
    "SampleSource",
    "Source",
    "group_version",
    "read_objects",
    "refreshed",
]

DecodeSpec = str | Callable[[Any], Any] | Mapping[str, str | Callable[[bytes], Any]] | None
"""What ``RemoteDataset(decode=...)`` takes: a decoder name, a callable, a mapping of member
patterns to decoders (sources whose samples are ``{member: bytes}``), or None."""


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
    """Addressable samples over a manifest: what a :class:`Source` opens (see the module
    docstring)."""

    root: str
    classes: tuple[str, ...] | None  # label names, when labels are strings
    manifest: Manifest  # what it read, carrying what it keeps (:meth:`Manifest.keeping`)
    left_out: list[str]  # what on_error="skip" or incomplete="skip" left out: what and why

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

    def nbytes(self, indices: Sequence[int] | np.ndarray) -> int:
        """The bytes the samples at ``indices`` read from the store (all their parts)."""

    def uncached(self) -> None:
        """The samples it serves are no longer cached (the dataset bypasses its cache): keep
        what it reads as without a cache (a chunk whose samples were all served is not let
        go). Nothing where nothing is let go."""


def parts_bytes(source: SampleSource, indices: Sequence[int] | np.ndarray) -> int:
    """:meth:`SampleSource.nbytes` from each sample's parts."""
    return sum(part.size for i in indices for part in source[int(i)].parts)


@dataclass(frozen=True)
class Opening:
    """What a :class:`Source` is opened with besides its manifest: the dataset's fetcher,
    cache (a reader may keep its indexes there), ``on_error`` and labels."""

    fetcher: Fetcher
    cache: Cache | None
    on_error: Literal["raise", "skip"]
    labels: Labels | None = None


@dataclass(frozen=True, eq=False)
class Source:
    """Where samples are and how objects make them: what :class:`fastload.RemoteDataset`
    reads (a URL or a Manifest alone is :class:`~fastload.sources.single.Objects`).

    where: a URL (``s3://``, ``gs://``, ``b2://``, ``file://``; a brace list in it is a key
        pattern) or a :class:`fastload.Manifest`.
    pattern: keep only the keys (relative to the URL) it matches, as :meth:`Manifest.build`'s
        (``"*.tar"``, ``"{train,val}/*.jpg"``); over a Manifest, as :meth:`Manifest.filter`'s.
    manifest_path: where the listing of a URL is saved (default: in the dataset's cache
        folder; with neither, the URL is listed at every start).
    reuse_listing: use a saved listing at once and list again in the background (the default;
        a changed listing is warned about and used at the next start), or list at start.
    """

    where: str | Manifest
    _: KW_ONLY
    pattern: str | None = None
    manifest_path: str | os.PathLike[str] | None = None
    reuse_listing: bool = True

    name: ClassVar[str] = "objects"
    """Its name in the registry and in messages (``fastload warm-cache --shards tar``)."""
    by_member: ClassVar[bool] = False
    """Whether ``decode`` receives ``{member: bytes}`` (and may decode members by pattern)."""
    refreshable: ClassVar[bool] = False
    """Whether ``on_change="refresh"`` can read a changed object's new version mid-epoch."""
    takes_labels: ClassVar[bool] = False
    """Whether it takes ``labels=`` (a shard sample's label is one of its members)."""
    default_decode: ClassVar[str | None] = None
    """``fastload warm-cache``'s decoder when none is given."""

    def __post_init__(self) -> None:
        if not isinstance(self.where, (str, Manifest)):
            raise ConfigError(
                f"{type(self).__name__} reads a URL or a Manifest, got {self.where!r}"
            )
        if not isinstance(self.reuse_listing, bool):
            raise ConfigError(f"reuse_listing must be a bool, got {self.reuse_listing!r}")

    def open(self, manifest: Manifest, opening: Opening) -> SampleSource:
        """The reader of ``manifest``'s samples (the listing of :attr:`where`)."""
        raise NotImplementedError

    def decoder(self, decode: DecodeSpec) -> Callable[[Any], Any]:
        """What ``decode`` becomes for this source's samples (checked: a wrong one is a
        ConfigError before any listing)."""
        if decode is None:
            return as_read
        if isinstance(decode, Mapping):
            raise ConfigError(
                f"decode as a mapping of member patterns decodes the members of a sample: "
                f"{type(self).__name__} samples are whole objects"
            )
        return decoder(decode)

    def warm_part(self, manifest: Manifest, part: tuple[int, int]) -> Manifest | None:
        """The objects that part ``part`` = (i, count) of ``fastload warm-cache`` reads, when
        this source splits its work across hosts by object (None: by sample)."""
        return None

    def warm_rounds(self, manifest: Manifest, memory_bytes: int) -> list[Manifest]:
        """``manifest`` in runs to open and warm one after another, each fitting in
        ``memory_bytes`` of what opening reads (one run: all at once)."""
        return [manifest]


def as_read(payload: Any) -> Any:
    """No decoding: bytes, ``{name: bytes}`` or a parquet row as read."""
    return payload


# the name cache entries were made under before it moved here (a new one would make them again)
as_read.fingerprint = "fastload.dataset._as_read:v1"  # type: ignore[attr-defined]


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
