"""The sample sources by name: the one place that lists them.

``fastload warm-cache --shards tar`` (or ``--group-by``: :func:`source_of_options`) and
:func:`source_named` build a source object from its name and options; an option that the
named source does not take is a ConfigError naming the sources that do, never ignored. A new
source is its module and one line here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastload.errors import ConfigError
from fastload.manifest import Manifest
from fastload.sources import Source
from fastload.sources.groups import Groups
from fastload.sources.parquet import Parquet
from fastload.sources.single import Objects
from fastload.sources.tar import Tar
from fastload.sources.zarr import Zarr

__all__ = [
    "SOURCES",
    "Groups",
    "Objects",
    "Parquet",
    "Tar",
    "Zarr",
    "as_source",
    "source_named",
    "source_of_options",
]

SOURCES: dict[str, type[Source]] = {s.name: s for s in (Objects, Groups, Tar, Parquet, Zarr)}


def as_source(source: object) -> Source:
    """``RemoteDataset``'s ``source``: a source object, or a URL or Manifest of objects."""
    if isinstance(source, Source):
        return source
    if isinstance(source, (str, Manifest)):
        return Objects(source)
    raise ConfigError(
        "RemoteDataset source must be a URL, a Manifest or a source object (fastload.Objects, "
        f"Groups, Tar, Parquet, ...), got {source!r}"
    )


def source_named(name: str, where: str | Manifest, **options: Any) -> Source:
    """The source ``name`` over ``where`` with ``options`` (those left None are its defaults);
    an option it does not take is a ConfigError naming the sources that do."""
    kind = SOURCES.get(name)
    if kind is None:
        raise ConfigError(f"no sample source named {name!r}: one of {sorted(SOURCES)}")
    given = {k: v for k, v in options.items() if v is not None}
    takes = _options(kind)
    foreign = sorted(set(given) - takes)
    if foreign:
        others = {k: sorted(n for n, s in SOURCES.items() if k in _options(s)) for k in foreign}
        said = "; ".join(f"{k} applies to {', '.join(v) or 'no source'}" for k, v in others.items())
        raise ConfigError(f"the {name} source does not take {', '.join(foreign)} ({said})")
    return kind(where, **given)


def source_of_options(
    where: str | Manifest, *, shards: str | None, group_by: Any, **options: Any
) -> Source:
    """The source that the string forms name (``fastload warm-cache``'s options): ``shards``
    names a source of many samples per object (``"tar"``, ``"parquet"``), ``group_by`` makes
    groups of objects, neither reads objects; ``options`` are its own (None: its default)."""
    chunked = sorted(n for n, s in SOURCES.items() if n not in ("objects", "groups"))
    if shards is not None and shards not in chunked:
        raise ConfigError(f"--shards must be one of {', '.join(chunked)}, got {shards!r}")
    if shards is not None and group_by is not None:
        raise ConfigError(
            "--group-by groups objects; --shards reads samples inside each object: give one"
        )
    if group_by is not None:
        return source_named("groups", where, by=group_by, **options)
    return source_named(shards or "objects", where, **options)


def _options(kind: type[Source]) -> set[str]:
    return {f.name for f in dataclasses.fields(kind)} - {"where"}
