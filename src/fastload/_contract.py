"""What :class:`fastload.DataLoader` and a dataset say to each other, beyond torch's protocol.

A dataset that has every member of :class:`LoaderDataset` (``RemoteDataset``,
``CachedDataset``) gets the loader's extras: shard-aware shuffling (``blocks``), the
lookahead (``prefetch``), workers that only fill the cache (``fillable``, ``read_filled``),
the workers' counters carried back (``counters``), a fork that waits for the listing check.
Whether it has them is checked once, when the loader is made (:func:`loader_dataset`); any
other dataset is loaded as torch's DataLoader loads it.

Two values cross the seam besides samples. Into a worker's batch: a :class:`BatchHead` in
place of the batch's first index, saying what the worker does beyond reading the batch. Back
out: :class:`Filled`, a worker's answer for a batch it made and cached, read in the loop's
process.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from fastload.cache import Cache
    from fastload.stats import StageCounters

__all__ = ["BatchHead", "Filled", "LoaderDataset", "loader_dataset", "opened"]


@dataclass(frozen=True)
class BatchHead:
    """The first index of a batch handed to a DataLoader worker, with what the worker does
    beyond reading the batch: ``fill``: make and cache its samples and answer
    :class:`Filled` (the loop's process reads them, ``DataLoader.fills``); ``ahead``: the
    indices of a batch further on to cache in the background (the ``lookahead``)."""

    index: int
    fill: bool = False
    ahead: tuple[int, ...] = ()


class Filled:
    """A DataLoader worker's answer for a batch whose samples it has made and cached: the
    loop's process reads them from the cache (``indices``: positions in the dataset).
    ``looked``: whether the worker looked at the cache (and counted its hits and misses); a
    worker on a warm streak does not, and the loop's process counts them and makes what is
    missing."""

    __slots__ = ("indices", "looked")

    def __init__(self, indices: list[int], looked: bool = True) -> None:
        self.indices, self.looked = indices, looked

    def __reduce__(self) -> tuple[type[Filled], tuple[list[int], bool]]:
        return Filled, (self.indices, self.looked)


@runtime_checkable
class LoaderDataset(Protocol):
    """What the loader needs from a dataset to do more than torch's loader does."""

    @property
    def counters(self) -> StageCounters:
        """This process's live counters; a worker drains its own into each batch."""

    @property
    def cache(self) -> Cache | None:
        """Where made samples are kept: the lookahead works only with one."""

    @property
    def blocks(self) -> np.ndarray | None:
        """The first sample of each chunk read as one (shard-aware shuffling), or None."""

    @property
    def listing_check(self) -> Future[Any] | None:
        """Background work with the store that a forked worker must not copy mid-request."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int | BatchHead) -> Any: ...

    def __getitems__(self, indices: Sequence[int | BatchHead]) -> list[Any] | Filled:
        """The batch's samples, or :class:`Filled` for a batch whose head says ``fill``."""

    def fillable(self) -> bool:
        """Whether workers may only fill the cache, the loop's process reading it back."""

    def workers_fill(self) -> None:
        """Workers fill the cache from now on, this process reads it back: it keeps what it
        makes, and leaves judging whether the cache pays to the workers."""

    def prefetch(self, indices: Sequence[int]) -> Future[None]:
        """Make and cache ``indices`` in the background (a batch the loop reads soon)."""

    def read_filled(self, filled: Filled) -> list[Any]:
        """The samples of a worker's :class:`Filled` batch, read from the cache here."""


if TYPE_CHECKING:  # mypy checks here that fastload's datasets keep the contract
    from fastload.dataset import CachedDataset, RemoteDataset

    _KEPT: tuple[type[LoaderDataset], ...] = (RemoteDataset, CachedDataset)


def loader_dataset(dataset: object) -> LoaderDataset | None:
    """``dataset`` when it has every member of :class:`LoaderDataset`, else None: the loader
    then treats it as torch's would (a dataset with only some of them, too)."""
    return dataset if isinstance(dataset, LoaderDataset) else None


def opened(indices: Sequence[int | BatchHead]) -> tuple[Sequence[int], BatchHead | None]:
    """A batch's indices as plain indices, and the :class:`BatchHead` that stood for the first
    one (None when it has none: only a worker's batch does)."""
    first = indices[0] if len(indices) else None
    if not isinstance(first, BatchHead):
        return cast("Sequence[int]", indices), None  # only the first index may be a head
    return [first.index, *cast("Sequence[int]", indices[1:])], first
