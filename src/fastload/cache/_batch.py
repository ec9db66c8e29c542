"""Batches read into place: a batch of like cache entries read straight into batch arrays.

A reader that knows where the blobs of an entry of some length lie (learned from an entry of
that length read before) reads each entry of a batch in pieces (:class:`Split`): every blob
into a row of one batch array per blob, the bytes around them into a small buffer. The format
checks the guess when it decodes (:meth:`fastload.cache.formats.FileFormat.decode`), and the
collate without workers hands out a batch array whose rows are a whole batch in order
(:func:`whole_of` says which arrays those are) instead of stacking copies of them.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from crc32c import crc32c

from fastload.cache._tree import Leaf

__all__ = ["Rows", "Shared", "Spans", "Split", "made_rows", "whole_of"]

Spans = tuple[tuple[int, int], ...]
"""Where the blobs of an entry lie in it: (start, size) of each."""


@dataclass(slots=True)
class Split:
    """An entry read in pieces: row ``row`` of ``group``. Its ``pieces`` are the bytes before
    its first blob, then each blob (a row of the group's batch array for it) and the bytes
    after it. The group's spans are where the reader guessed the blobs lie; the format checks
    that guess when it decodes, and joins the pieces when it was wrong."""

    group: _Alike
    row: int
    pieces: list[memoryview]
    _crc: int | None = None

    @property
    def spans(self) -> Spans:
        return self.group.spans

    @property
    def length(self) -> int:
        return self.group.length

    def crc(self) -> int:
        """The CRC32C of all the entry's bytes but its last four (worked out once: the reader
        asks for it as soon as they are read, while they are still in the CPU's cache)."""
        if self._crc is None:
            *pieces, end = self.pieces
            crc = 0
            for piece in pieces:
                crc = crc32c(piece, crc)
            self._crc = crc32c(end[:-4], crc)
        return self._crc

    def head(self) -> memoryview:
        """The bytes before the first blob."""
        return self.pieces[0]

    def tail(self) -> memoryview:
        """The bytes after the last blob."""
        return self.pieces[-1]

    def whole(self) -> np.ndarray:
        return np.concatenate([np.frombuffer(piece, np.uint8) for piece in self.pieces])

    def blob(self, index: int, kind: str) -> Leaf:
        """The ``index``-th blob: a row of its batch tensor for a tensor leaf, else of its
        numpy array."""
        rows = self.group.batches if kind[0] == "t" else self.group.arrays
        return rows[index][self.row]


@dataclass(frozen=True, slots=True)
class Shared:
    """The leaves of a group's entries of one ``structure`` and leaf ``values`` (shapes), made
    once for the group by its format: leaf j of row r is ``columns[j][r]``, a row of the group's
    batch arrays, typed and shaped. An entry whose head but for its digest's check bytes is
    ``prefix`` also has these ``scalars``."""

    structure: dict[str, Any]
    prefix: bytes
    scalars: list[Any]
    values: list[Any]
    columns: list[list[Leaf]]


class Rows:
    """Where one batch read puts each entry: when several are of a length whose blob spans are
    known (``FileFormat.spans``), their blobs go into rows of a batch tensor per blob (a
    :class:`Split` each), in the order asked for; any other entry into a buffer of its own."""

    def __init__(self, lengths: Sequence[int | None], spans: dict[int, Spans]) -> None:
        alike: dict[int, tuple[Spans, list[int]]] = {}
        for i, length in enumerate(lengths):
            # one look per entry: another thread's decode may clear ``spans`` meanwhile
            known = None if length is None else spans.get(length)
            if known is not None and length is not None:
                alike.setdefault(length, (known, []))[1].append(i)
        self._rows: dict[int, tuple[_Alike, int]] = {}
        for length, (known, positions) in alike.items():
            if len(positions) > 1:
                group = _Alike(len(positions), length, known)
                for row, i in enumerate(positions):
                    self._rows[i] = group, row

    def buffer(self, i: int, length: int) -> np.ndarray | Split:
        """The buffer of the entry at position ``i`` of the batch, ``length`` bytes long."""
        placed = self._rows.get(i)
        if placed is None:
            return np.empty(length, np.uint8)
        group, row = placed
        return Split(group, row, group.pieces(row))


class _Alike:
    """The batch arrays of ``count`` entries of one length and blob ``spans`` (a tensor each
    too), and a buffer for the bytes around their blobs."""

    shared: Shared | None = None
    """Its entries' leaves, once its format has made them (see :meth:`fastload.cache.formats.
    FileFormat.decode`)."""

    def __init__(self, count: int, length: int, spans: Spans) -> None:
        self.arrays = [_BATCHES.take((count, size)) for _, size in spans]
        self.batches = [torch.from_numpy(array) for array in self.arrays]
        self.spans, self.length = spans, length
        self._flat = [array.reshape(-1).data for array in self.arrays]
        ends = [0] + [start + size for start, size in spans]
        self._around = [start - end for (start, _), end in zip(spans, ends, strict=False)]
        self._around.append(length - ends[-1])
        self._starts = [0]  # of each run of bytes around the blobs, within a row's share
        for n in self._around:
            self._starts.append(self._starts[-1] + n)
        self._rest = memoryview(bytearray(count * self._starts[-1]))

    def pieces(self, row: int) -> list[memoryview]:
        """Row ``row``'s entry as buffers in order: around, blob, around, ..., around."""
        rest, starts, around = self._rest, self._starts, self._around
        at = row * starts[-1]
        pieces = [rest[at : at + around[0]]]
        for j, (_, size) in enumerate(self.spans):
            start = at + starts[j + 1]
            pieces += [
                self._flat[j][row * size : (row + 1) * size],
                rest[start : start + around[j + 1]],
            ]
        return pieces


class _Reuse:
    """The last batch arrays handed out, each reused once nothing else refers to it.

    A new array's pages cost the kernel a fault and a zeroing each, which here cost as much as
    the copy of the entries into them; memory the allocator returned to the kernel between
    batches (it does for large blocks) would pay that every batch. Reference counts say when
    an array is free; where they cannot be trusted (a build without the GIL) none is reused.
    """

    def __init__(self, most: int, most_bytes: int) -> None:
        self._most, self._most_bytes = most, most_bytes
        held = [np.empty(0)]  # what getrefcount says of an array one list alone holds
        self._free = sys.getrefcount(held[0])
        self._reuse = getattr(sys, "_is_gil_enabled", lambda: True)()
        self.forget()
        os.register_at_fork(after_in_child=self.forget)

    def forget(self) -> None:
        """A new lock (another thread may have held this one at a fork) and no arrays."""
        self._arrays: list[np.ndarray] = []
        self._rows: dict[int, tuple[weakref.ref[np.ndarray], list[weakref.ref[Any]]]] = {}
        """The leaves made of each array's rows (:meth:`made`), by the id of the first."""
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, int]) -> np.ndarray:
        with self._lock:
            arrays = self._arrays
            for k in range(len(arrays) if self._reuse else 0):
                if arrays[k].shape == shape and sys.getrefcount(arrays[k]) == self._free:
                    return arrays[k]
            array = np.empty(shape, np.uint8)
            self._arrays.append(array)
            while len(self._arrays) > self._most or (
                sum(a.nbytes for a in self._arrays) > self._most_bytes and len(self._arrays) > 1
            ):
                self._arrays.pop(0)
            return array

    def made(self, array: np.ndarray, rows: list[Any]) -> None:
        with self._lock:
            # weakly held: a row alive keeps its array from reuse, and is the only proof
            self._rows = {k: v for k, v in self._rows.items() if v[1][0]() is not None}
            self._rows[id(rows[0])] = (weakref.ref(array), [weakref.ref(row) for row in rows])

    def whole(self, rows: Sequence[Any]) -> np.ndarray | None:
        with self._lock:
            entry = self._rows.get(id(rows[0]))
        array = None if entry is None else entry[0]()
        if entry is None or array is None or len(entry[1]) != len(rows):
            return None
        for ref, row in zip(entry[1], rows, strict=True):
            if ref() is not row:
                return None
        return array


_BATCHES = _Reuse(8, 256 * 2**20)


def made_rows(array: np.ndarray, rows: list[Any]) -> None:
    """Say that ``rows`` (arrays or tensors) view each row of the batch array ``array``, in
    order: a format's leaves, which :func:`whole_of` then knows."""
    _BATCHES.made(array, rows)


def whole_of(rows: Sequence[Any]) -> np.ndarray | None:
    """The batch array that entries were read into whose rows, all of them and in order, are
    ``rows``: the very leaves :func:`made_rows` was told of, checked by identity (a row alive
    keeps its array from reuse). :mod:`fastload._collate` may hand it out as the batch: no one
    else's data can be changed through it. None for anything else."""
    return _BATCHES.whole(rows)
