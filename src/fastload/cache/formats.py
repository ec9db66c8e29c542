"""How a cached sample is laid out on disk: ``pt``, ``npy`` or ``zarr``.

``pt`` and ``npy`` entries go into segment files (:mod:`fastload.cache._packed`), each entry::

    b"FLC3" | u32 length of its values | values JSON | 8 bytes of its digest |
    blobs (aligned: 16 bytes when under 1 KiB, else 64) | u32 distance back to its structure |
    u32 CRC32C of everything before

and, once per segment for each structure used in it, before the first entry of that structure::

    b"FLS3" | u32 length | structure JSON | u32 CRC32C

A structure is the sample's shape of containers, keys and leaf kinds (see
:mod:`fastload.cache._tree`); the values are what differs between samples of one structure:
scalars, strings, array shapes. So a small sample carries about 40 bytes besides its own, a
reader parses each structure once per segment, and a torn, truncated or bit-flipped entry or
structure fails its checksum. The digest bytes tell an entry found through a misfiled index
record from the one looked up. ``pt`` keeps the arrays as one ``torch.save`` blob, loaded with
``weights_only=True`` (a planted pickle cannot run code); ``npy`` keeps each array's raw buffer,
the fastest to read.

Entries of earlier versions are still read: ``FLCACHE2`` (a JSON header of structure and values,
then the name) in segments or a file each, and ``FLCACHE1`` (the name in the header) files.

``zarr`` entries are Zarr v3 groups (readable by zarr-python): one chunked array per leaf,
each chunk Blosc-compressed and followed by its CRC32C. They are read chunk by chunk on a
thread pool, and a crop reads only the chunks it touches.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import json
import math
import os
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import torch
from crc32c import crc32c

from fastload._extras import import_extra
from fastload.cache._batch import Shared, Spans, Split, made_rows
from fastload.cache._perms import (
    Modes,
    denied,
    make_dir,
    make_dirs,
    naming,
    open_file,
    open_regular,
    read_regular,
)
from fastload.cache._tree import Leaf, Spec, descr, flatten, unflatten
from fastload.errors import CacheError, CorruptEntryError, UnsupportedSampleError
from fastload.resources import PerProcess

__all__ = ["CHECK_BYTES", "FORMATS", "MIN_ENTRY", "Encoded", "FileFormat", "Format", "ZarrArray"]

_MAGIC = b"FLC3"
_HEAD = struct.Struct("<4sI")  # magic, values length
_TAIL = struct.Struct("<II")  # distance back to the structure record, CRC32C of all before
_STRUCTURE = struct.Struct("<4sI")  # magic, JSON length; then the JSON and its CRC32C
_STRUCTURE_MAGIC = b"FLS3"
CHECK_BYTES = 8
"""Bytes of its digest an entry carries (to tell it from another sample's)."""
_SMALL_BLOB = 1024  # blobs under this are aligned to 16 bytes (any dtype's), others to 64
_MAGIC_V2 = b"FLCACHE2"
_PREFIX_V2 = struct.Struct("<8sQQ")  # magic, header length, name length
_MAGIC_V1 = b"FLCACHE1"
_PREFIX_V1 = struct.Struct("<8sQ")  # magic, header length (the name inside the header)
_FOOTER_V2 = struct.Struct("<I4s")  # CRC32C of everything before it, end mark
_END_V2 = b"FLC."
_PARSED = 4096  # parsed structures (and earlier versions' headers) kept per process
MIN_ENTRY = _HEAD.size + 2 + CHECK_BYTES + _TAIL.size
"""The fewest bytes an entry can have (an earlier version's need more)."""
# Entries with fewer blob bytes are read whole (cache/_batch.py): reading a 12 KB entry in
# pieces cost more than the copy it saved (-5 to -11% in an A/B), a 77 KB one gained 2-9%.
_ROWS_FROM = 64 << 10
_SPANS = 4096  # entry lengths whose blob spans a format keeps


class Format(ABC):
    """One on-disk layout."""

    name: ClassVar[str]
    suffix: ClassVar[str]
    directory: ClassVar[bool] = False

    @abstractmethod
    def read(self, path: str | Path) -> Any:
        """The sample at ``path``; :class:`CorruptEntryError` when it fails its checks,
        ``FileNotFoundError`` when it is gone."""

    def name_of(self, path: str | Path) -> str:
        """The name the entry was written under (for reports), read even from a damaged entry
        when its header survived."""
        header = self._header(path)
        return str(header.get("name", ""))

    @abstractmethod
    def _header(self, path: str | Path) -> dict[str, Any]: ...


# --- segment entries (pt, npy) ----------------------------------------------------------------


def _aligned(position: int, size: int, small: int = 16) -> int:
    """Where a blob of ``size`` bytes starts at or after ``position``: aligned to ``small``
    bytes under 1 KiB, else to 64 (earlier versions: 64 always)."""
    align = small if size < _SMALL_BLOB else 64
    return -(-position // align) * align


@dataclass(frozen=True)
class Encoded:
    """An entry before its place in a segment is known: its structure record (written once per
    segment), its bytes up to the tail, and their length and CRC32C."""

    structure: bytes
    body: list[bytes | memoryview]
    length: int  # the whole entry's, tail included
    crc: int

    def tail(self, distance: int) -> bytes:
        """The entry's last bytes, its structure record ``distance`` bytes before it."""
        head = distance.to_bytes(4, "little")
        return head + crc32c(head, self.crc).to_bytes(4, "little")


def _head(buffer: np.ndarray | Split) -> memoryview:
    return buffer.head() if isinstance(buffer, Split) else buffer.data


def _whole(buffer: np.ndarray | Split) -> np.ndarray:
    return buffer.whole() if isinstance(buffer, Split) else buffer


def _undecodable(exc: Exception, where: str | Path) -> CorruptEntryError:
    """Why an entry whose checksum passed does not decode (another format or version wrote
    it)."""
    return CorruptEntryError(f"cache entry does not decode ({type(exc).__name__}): {where}")


def _spans(sizes: list[int], position: int, end: int, small: int = 16) -> Spans:
    """Where blobs of ``sizes`` lie when the first may start at ``position`` and the last
    ends at ``end``; ValueError when they do not add up to that."""
    spans = []
    for size in sizes:
        position = _aligned(position, size, small)
        spans.append((position, size))
        position += size
    if position != end:
        raise ValueError("the blobs do not add up to the entry")
    return tuple(spans)


class FileFormat(Format):
    """The entries shared by ``pt`` and ``npy``: a structure, values and blobs each."""

    views_blobs: ClassVar[bool] = False
    """Whether its leaves are views of their blobs (then batches are read into place)."""

    def __init__(self) -> None:
        self.spans: dict[int, Spans] = {}
        """Where the blobs of an entry of each length were last found (see :class:`Split`)."""

    @abstractmethod
    def _encode(self, leaves: list[Leaf]) -> tuple[list[Any], list[memoryview]]:
        """The leaves' per-sample values (shapes, sizes) and their blobs."""

    @abstractmethod
    def _sizes(self, kinds: list[str], values: list[Any]) -> list[int]: ...

    @abstractmethod
    def _decode(self, kinds: list[str], values: list[Any], blobs: Sequence[Leaf]) -> list[Leaf]:
        """The leaves, from their kinds (see :func:`_leaf_kinds`), values and blobs."""

    @abstractmethod
    def _v2(self, header: dict[str, Any]) -> tuple[list[str], list[Any]]:
        """An ``FLCACHE2`` header's leaf kinds and values (it held both in its own way)."""

    def encode(self, sample: Any, check: bytes) -> Encoded:
        """``sample``'s entry, carrying ``check`` (:data:`CHECK_BYTES` of its digest)."""
        spec, scalars, leaves = flatten(sample)
        leaf_values, blobs = self._encode(leaves)
        values = _json_bytes([scalars, leaf_values])
        head = _HEAD.pack(_MAGIC, len(values))
        body: list[bytes | memoryview] = [head, values, check]
        crc = crc32c(check, crc32c(values, crc32c(head)))
        position = len(head) + len(values) + len(check)
        for blob in blobs:
            pad = bytes(_aligned(position, blob.nbytes) - position)
            body += [pad, blob]
            crc = crc32c(blob, crc32c(pad, crc))
            position += len(pad) + blob.nbytes
        record = _structure_record(self.name, spec, _leaf_kinds(leaves))
        return Encoded(record, body, position + _TAIL.size, crc)

    @staticmethod
    def distance(buffer: np.ndarray | Split) -> int | None:
        """How far before the entry its structure record is; None for an earlier version's."""
        if isinstance(buffer, Split):
            head, tail = buffer.head(), buffer.tail()
        else:
            head = tail = buffer.data
        if head[:4] != _MAGIC:
            return None
        return int.from_bytes(tail[-_TAIL.size : -4], "little")

    def decode(
        self,
        buffer: np.ndarray | Split,
        where: str | Path,
        structure: dict[str, Any] | None = None,
    ) -> Any:
        """The sample in an entry's bytes (a writable uint8 array, or its pieces) and its
        parsed ``structure`` (None for an earlier version's entry); ``where`` names it in
        errors. :class:`CorruptEntryError` when it fails its checksum or does not parse."""
        if isinstance(buffer, Split):
            return self._decode_split(buffer, where, structure)
        if structure is None:
            return self._decode_v2(buffer, where)
        view, size = buffer.data, buffer.nbytes
        magic, length = _HEAD.unpack_from(view)
        crc = int.from_bytes(view[size - 4 :], "little")
        if magic != _MAGIC or crc32c(view[: size - 4]) != crc:
            raise CorruptEntryError(f"cache entry fails its checksum: {where}")
        try:
            scalars, leaf_values = _values(bytes(view[_HEAD.size : _HEAD.size + length]))
            kinds = structure["kinds"]
            sizes = self._sizes(kinds, leaf_values)
            spans = _spans(sizes, _HEAD.size + length + CHECK_BYTES, size - _TAIL.size)
            if self.views_blobs and size >= _ROWS_FROM and self.spans.get(size) != spans:
                self._remember(size, spans)
            blobs = [buffer[start : start + n] for start, n in spans]
            return unflatten(structure["spec"], self._decode(kinds, leaf_values, blobs), scalars)
        except Exception as exc:
            raise _undecodable(exc, where) from exc

    def _decode_split(
        self, split: Split, where: str | Path, structure: dict[str, Any] | None
    ) -> Any:
        """:meth:`decode` of an entry read in pieces: its blobs are the pieces when they lie
        where the reader guessed, else it is decoded whole."""
        head = split.head()
        magic, length = _HEAD.unpack_from(head)
        position = _HEAD.size + length + CHECK_BYTES
        if structure is None or magic != _MAGIC or position > len(head):
            return self.decode(split.whole(), where, structure)
        if split.crc() != int.from_bytes(split.tail()[-4:], "little"):
            raise CorruptEntryError(f"cache entry fails its checksum: {where}")
        prefix = head[: _HEAD.size + length]  # all of the head but the digest's check bytes
        shared: Shared | None = split.group.shared
        if shared is not None and shared.structure is structure and shared.prefix == prefix:
            leaves = [column[split.row] for column in shared.columns]
            return unflatten(structure["spec"], leaves, shared.scalars)
        try:
            scalars, leaf_values = _values(bytes(prefix[_HEAD.size :]))
            kinds = structure["kinds"]
            spans = _spans(self._sizes(kinds, leaf_values), position, split.length - _TAIL.size)
            if spans != split.spans:
                return self.decode(split.whole(), where, structure)
            if shared is None:  # the group's first: its leaves are made for all rows at once
                columns = self._columns(kinds, leaf_values, split)
                shared = Shared(structure, bytes(prefix), scalars, leaf_values, columns)
                split.group.shared = shared
            if shared.structure is structure and shared.values == leaf_values:
                leaves = [column[split.row] for column in shared.columns]
            else:  # another structure, or shapes, with blobs where the first's lie
                blobs = [split.blob(j, kind) for j, kind in enumerate(kinds)]
                leaves = self._decode(kinds, leaf_values, blobs)
            return unflatten(structure["spec"], leaves, scalars)
        except CorruptEntryError:
            raise
        except Exception as exc:
            raise _undecodable(exc, where) from exc

    def _columns(self, kinds: list[str], values: list[Any], split: Split) -> list[list[Leaf]]:
        """Each leaf of every entry of ``split``'s group, taken as having ``values`` (the
        format reads batches into place only when its leaves view their blobs)."""
        raise NotImplementedError

    def _remember(self, length: int, spans: Spans) -> None:
        """Where the blobs of an entry of ``length`` lie, for the next batch's reads."""
        if sum(size for _, size in spans) >= _ROWS_FROM:
            if len(self.spans) >= _SPANS:
                self.spans.clear()
            self.spans[length] = spans

    def _decode_v2(self, buffer: np.ndarray, where: str | Path) -> Any:
        _check_v2(buffer, where)
        header, start = _parse_header(buffer, where, named=False)
        try:
            end = buffer.nbytes - _FOOTER_V2.size
            blobs = [buffer[a : a + n] for a, n in _spans(header["sizes"], start, end, 64)]
            return unflatten(header["spec"], self._decode(*self._v2(header), blobs))
        except Exception as exc:
            raise _undecodable(exc, where) from exc

    def structure(self, fd: int, offset: int, where: str) -> dict[str, Any]:
        """The structure record at ``offset`` of a segment, parsed (shared: not to be changed).
        :class:`CorruptEntryError` when it is not one or fails its checksum."""
        raw = os.pread(fd, 512, offset)
        magic, length = _STRUCTURE.unpack_from(raw) if len(raw) >= _STRUCTURE.size else (b"", 0)
        end = _STRUCTURE.size + length
        if magic == _STRUCTURE_MAGIC and len(raw) < end + 4:
            raw += os.pread(fd, end + 4 - len(raw), offset + len(raw))
        if (
            magic != _STRUCTURE_MAGIC
            or len(raw) < end + 4
            or crc32c(raw[:end]) != int.from_bytes(raw[end : end + 4], "little")
        ):
            raise CorruptEntryError(f"cache entry's structure record is damaged: {where}")
        return _parsed_json(raw[_STRUCTURE.size : end], where)

    def matches(
        self, buffer: np.ndarray | Split, digest: str, digest_of: Callable[[bytes], str]
    ) -> bool:
        """Whether the entry was written for ``digest`` (an earlier version's by its name,
        hashed by ``digest_of``)."""
        view = _head(buffer)
        if view[:4] == _MAGIC:
            start = _HEAD.size + _HEAD.unpack_from(view)[1]
            if start + CHECK_BYTES > len(view):
                view = _whole(buffer).data
            return view[start : start + CHECK_BYTES] == bytes.fromhex(digest)[:CHECK_BYTES]
        buffer = _whole(buffer)
        if buffer[:8].tobytes() != _MAGIC_V2 or buffer.nbytes < _PREFIX_V2.size:
            return False
        _, length, name_length = _PREFIX_V2.unpack_from(buffer.data)
        start = _PREFIX_V2.size + length
        return digest_of(buffer[start : start + name_length].tobytes()) == digest

    def name_in(self, buffer: np.ndarray, where: str) -> str:
        """The name in an entry's bytes (for reports), unchecked; ``where`` for an entry of
        this version, which keeps no name."""
        if buffer[:4].tobytes() == _MAGIC:
            return where
        header, _ = _parse_header(buffer, where)
        return str(header.get("name", ""))

    def read(self, path: str | Path) -> Any:
        """An earlier version's entry, a file of its own."""
        return self.decode(_read_checked(path), path)

    def _header(self, path: str | Path) -> dict[str, Any]:
        """An earlier version's file entry's header and name alone, unchecked: enough to name
        an entry whose body is damaged."""
        with open(open_regular(path)[0], "rb") as f:
            prefix = f.read(_PREFIX_V2.size)
            if prefix[:8] == _MAGIC_V1 and len(prefix) >= _PREFIX_V1.size:
                size = _PREFIX_V1.size + _PREFIX_V1.unpack_from(prefix)[1]
            elif prefix[:8] == _MAGIC_V2 and len(prefix) == _PREFIX_V2.size:
                size = _PREFIX_V2.size + sum(_PREFIX_V2.unpack(prefix)[1:])
            else:
                raise CorruptEntryError(f"cache entry is truncated or not one: {path}")
            if size > 1 << 24:
                raise CorruptEntryError(f"cache entry header is unreadable: {path}")
            body = np.frombuffer(prefix + f.read(size - len(prefix)), np.uint8)
        header, _ = _parse_header(body, path)
        return header


_COMPACT = json.JSONEncoder(separators=(",", ":"))


def _json_bytes(value: Any) -> bytes:
    return _COMPACT.encode(value).encode()


@functools.lru_cache(maxsize=_PARSED)
def _structure_record(format: str, spec: Spec, kinds: tuple[str, ...]) -> bytes:
    """The structure record of samples of ``spec`` with leaves of ``kinds``: built once per
    process and structure (its JSON cost a small sample's write a sixth of its CPU)."""
    document = _json_bytes({"format": format, "spec": spec, "kinds": kinds})
    record = _STRUCTURE.pack(_STRUCTURE_MAGIC, len(document)) + document
    return record + crc32c(record).to_bytes(4, "little")


@functools.lru_cache(maxsize=_PARSED)
def _values(raw: bytes) -> Any:
    """An entry's values, parsed once per distinct bytes (samples of one shape share them)."""
    return json.loads(raw)


@contextlib.contextmanager
def _create(path: Path, modes: Modes) -> Iterator[io.BufferedWriter]:
    """A new file of ``modes.file`` to write; an OSError writing it names it (a full disk)."""
    with naming(path), open(open_file(path, os.O_WRONLY | os.O_EXCL, modes), "wb") as out:
        yield out


def _read_checked(path: str | Path) -> np.ndarray:
    """The whole file as a writable uint8 array. (Plain descriptors: a file object cost a warm
    read of a 77 KB entry a sixth of its time.)"""
    fd, found = open_regular(path)
    try:
        return read_at(fd, 0, found.st_size, path)
    finally:
        os.close(fd)


def read_at(fd: int, offset: int, size: int, where: str | Path) -> np.ndarray:
    """``size`` bytes at ``offset`` of ``fd`` as a writable uint8 array."""
    if size < MIN_ENTRY:
        raise CorruptEntryError(f"cache entry is truncated ({size} bytes): {where}")
    buffer = np.empty(size, np.uint8)
    view, got = buffer.data, 0
    while got < size and (count := os.preadv(fd, [view[got:]], offset + got)):
        got += count
    if got != size:
        raise CorruptEntryError(f"cache entry is truncated or changed while read: {where}")
    return buffer


def _check_v2(buffer: np.ndarray, where: str | Path) -> None:
    size = buffer.nbytes
    if size < _PREFIX_V1.size + _FOOTER_V2.size:
        raise CorruptEntryError(f"cache entry is truncated ({size} bytes): {where}")
    crc, end = _FOOTER_V2.unpack_from(buffer.data, size - _FOOTER_V2.size)
    if end != _END_V2 or crc32c(buffer[: size - _FOOTER_V2.size].data) != crc:
        raise CorruptEntryError(f"cache entry fails its checksum: {where}")


_parsed: dict[bytes, dict[str, Any]] = {}


def _parsed_json(raw: bytes, where: str | Path) -> dict[str, Any]:
    """``raw`` parsed once per process (a structure, or an earlier version's header): shared,
    not to be changed."""
    parsed = _parsed.get(raw)
    if parsed is None:
        if len(_parsed) >= _PARSED:
            _parsed.clear()
        parsed = _parsed[raw] = _json(raw, where)
    return parsed


def _parse_header(
    buffer: np.ndarray, path: str | Path, *, named: bool = True
) -> tuple[dict[str, Any], int]:
    """An earlier version's header and where its blobs start; ``named``: with the entry's
    ``name`` (a copy), else the parsed header shared by every entry of that structure."""
    magic = buffer[:8].tobytes()
    if magic == _MAGIC_V1:
        _, length = _PREFIX_V1.unpack_from(buffer.data)
        return _json(bytes(buffer[_PREFIX_V1.size : _PREFIX_V1.size + length]), path), (
            _PREFIX_V1.size + length
        )
    if magic != _MAGIC_V2 or buffer.nbytes < _PREFIX_V2.size:
        raise CorruptEntryError(f"not a fastload cache entry: {path}")
    _, length, name_length = _PREFIX_V2.unpack_from(buffer.data)
    start = _PREFIX_V2.size + length
    header = _parsed_json(buffer[_PREFIX_V2.size : start].tobytes(), path)
    if not named:
        return header, start + name_length
    name = buffer[start : start + name_length].tobytes().decode("utf-8", "surrogatepass")
    return {**header, "name": name}, start + name_length


def _json(raw: bytes, path: str | Path) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CorruptEntryError(f"cache entry header is unreadable: {path}") from exc
    if not isinstance(header, dict):
        raise CorruptEntryError(f"cache entry header is unreadable: {path}")
    return header


def _leaf_kinds(leaves: list[Leaf]) -> tuple[str, ...]:
    """ "t:<dtype>" for a tensor (earlier versions wrote "t"), else the array's dtype (its byte
    order included)."""
    return tuple(
        f"t:{str(leaf.dtype)[6:]}" if isinstance(leaf, torch.Tensor) else str(descr(leaf.dtype))
        for leaf in leaves
    )


@functools.lru_cache(maxsize=256)
def _itemsize(kind: str) -> int:
    return _torch_dtype(kind).itemsize if kind[0] == "t" else _dtype(kind).itemsize


def _torch_dtype(kind: str) -> torch.dtype:
    dtype = getattr(torch, kind[2:], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {kind!r}")
    return dtype


def _contiguous(array: np.ndarray) -> np.ndarray:
    """C-contiguous, keeping 0-d arrays 0-d (unlike np.ascontiguousarray)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


class PtFormat(FileFormat):
    name = "pt"
    suffix = ".flpt"

    def _encode(self, leaves: list[Leaf]) -> tuple[list[Any], list[memoryview]]:
        tensors = [_as_tensor(leaf, i) for i, leaf in enumerate(leaves)]
        blob = io.BytesIO()
        torch.save(tensors, blob)
        return [blob.tell()], [blob.getbuffer()]

    def _sizes(self, kinds: list[str], values: list[Any]) -> list[int]:
        return values

    def _v2(self, header: dict[str, Any]) -> tuple[list[str], list[Any]]:
        return header["kinds"], header["sizes"]

    def _decode(self, kinds: list[str], values: list[Any], blobs: Sequence[Leaf]) -> list[Leaf]:
        raw = np.asarray(blobs[0])
        tensors = torch.load(io.BytesIO(raw.data), weights_only=True, map_location="cpu")
        if not isinstance(tensors, list) or len(tensors) != len(kinds):
            raise ValueError("the .pt blob does not match its structure")
        return [
            t if k[0] == "t" else t.numpy().astype(_dtype(k), copy=False)
            for t, k in zip(tensors, kinds, strict=True)
        ]


def _as_tensor(leaf: Leaf, index: int) -> torch.Tensor:
    if isinstance(leaf, torch.Tensor):
        # torch.save writes a view's whole storage; keep only the view.
        return leaf.clone() if leaf.untyped_storage().nbytes() != leaf.nbytes else leaf
    try:
        native = _contiguous(leaf.astype(leaf.dtype.newbyteorder("="), copy=False))
        if not native.flags.writeable:  # np.frombuffer's, say: torch warns, and would share it
            native = native.copy()
        return torch.from_numpy(native)
    except TypeError as exc:
        raise UnsupportedSampleError(
            f"array leaf {index} has dtype {leaf.dtype}, which format 'pt' cannot hold"
        ) from exc


class NpyFormat(FileFormat):
    name = "npy"
    suffix = ".flnpy"
    views_blobs = True

    def _encode(self, leaves: list[Leaf]) -> tuple[list[Any], list[memoryview]]:
        blobs: list[memoryview] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                blobs.append(leaf.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            else:
                blobs.append(_contiguous(leaf).reshape(-1).view(np.uint8).data)
        return [[*leaf.shape] for leaf in leaves], blobs

    def _sizes(self, kinds: list[str], values: list[Any]) -> list[int]:
        return [
            math.prod(shape) * _itemsize(kind) for kind, shape in zip(kinds, values, strict=True)
        ]

    def _v2(self, header: dict[str, Any]) -> tuple[list[str], list[Any]]:
        kinds = [f"t:{a['torch']}" if "torch" in a else a["dtype"] for a in header["arrays"]]
        return kinds, [meta["shape"] for meta in header["arrays"]]

    def _columns(self, kinds: list[str], values: list[Any], split: Split) -> list[list[Leaf]]:
        columns: list[list[Leaf]] = []
        for j, (kind, shape) in enumerate(zip(kinds, values, strict=True)):
            array = split.group.arrays[j]
            if kind[0] == "t":
                batch = split.group.batches[j].view(_torch_dtype(kind)).reshape(-1, *shape)
                columns.append(list(batch.unbind(0)))
            else:
                columns.append(list(array.view(_dtype(kind)).reshape(-1, *shape)))
            made_rows(array, columns[-1])
        return columns

    def _decode(self, kinds: list[str], values: list[Any], blobs: Sequence[Leaf]) -> list[Leaf]:
        leaves: list[Leaf] = []
        for kind, shape, blob in zip(kinds, values, blobs, strict=True):
            if kind[0] == "t":
                tensor = blob if isinstance(blob, torch.Tensor) else torch.from_numpy(blob)
                leaves.append(tensor.view(_torch_dtype(kind)).reshape(shape))
            else:
                leaves.append(cast(np.ndarray, blob).view(_dtype(kind)).reshape(shape))
        return leaves


_dtypes: dict[str, np.dtype[Any]] = {}


def _dtype(descr: Any) -> np.dtype[Any]:
    """The dtype of an .npy ``descr`` (plain ones parsed once per process)."""
    key = descr if isinstance(descr, str) else None  # a structured dtype's is a list
    dtype = None if key is None else _dtypes.get(key)
    if dtype is None:
        dtype = np.lib.format.descr_to_dtype(descr)
        if key is not None:
            _dtypes[key] = dtype
    return dtype


# --- zarr -------------------------------------------------------------------------------------

_CHUNK_BYTES = 1 << 20
_ZARR_TYPES = {
    np.dtype(name): name
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}  # fmt: skip
_pools: PerProcess[str, ThreadPoolExecutor] = PerProcess("zarr pools")
_scratch = threading.local()


def _pool() -> ThreadPoolExecutor:
    width = min(16, 2 * (os.cpu_count() or 2))  # reads wait on the disk as well
    return _pools.get("zarr", lambda: ThreadPoolExecutor(width, "fastload-zarr"))


def _blosc() -> Any:
    return import_extra("numcodecs.blosc", extra="zarr", feature="the 'zarr' cache format")


def chunk_shape(shape: Sequence[int], itemsize: int, target: int = _CHUNK_BYTES) -> list[int]:
    """Halve the longest leading axis until a chunk holds at most ``target`` bytes; the last axis
    is halved only when a single row is too big. Whole rows keep a chunk a few long runs of
    the array, which are read straight into place."""
    chunks = [max(1, n) for n in shape]
    while math.prod(chunks) * itemsize > target and max(chunks) > 1:
        leading = chunks[:-1]
        axis = leading.index(max(leading)) if leading and max(leading) > 1 else len(chunks) - 1
        chunks[axis] = -(-chunks[axis] // 2)
    return chunks


def _compress(blosc: Any, block: np.ndarray) -> bytes:
    shuffle = blosc.SHUFFLE if block.dtype.itemsize > 1 else blosc.NOSHUFFLE
    return bytes(blosc.compress(block, b"lz4", 5, shuffle))


def _codecs(dtype: np.dtype[Any], compressed: bool) -> list[dict[str, Any]]:
    shuffle = "shuffle" if dtype.itemsize > 1 else "noshuffle"
    blosc = {
        "cname": "lz4",
        "clevel": 5,
        "shuffle": shuffle,
        "typesize": dtype.itemsize,
        "blocksize": 0,
    }
    return [
        {"name": "bytes", "configuration": {"endian": "little"}},
        *([{"name": "blosc", "configuration": blosc}] if compressed else []),
        {"name": "crc32c"},
    ]


def _array_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The zarr.json of an array described by our ``{shape, dtype, chunks, compressed}``."""
    dtype = np.dtype(meta["dtype"])
    fill: Any = [0.0, 0.0] if dtype.kind == "c" else (False if dtype.kind == "b" else 0)
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": meta["shape"],
        "data_type": _ZARR_TYPES[dtype.newbyteorder("=")],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": meta["chunks"]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": _codecs(dtype, meta["compressed"]),
        "attributes": {},
    }


def _chunk_key(index: Sequence[int]) -> str:
    return "/".join(["c", *map(str, index)])


def _grid(
    shape: Sequence[int], chunks: Sequence[int], region: Sequence[slice] | None = None
) -> Iterator[tuple[int, ...]]:
    """The indices of the chunks that ``region`` (default: all) touches."""
    region = [slice(0, n) for n in shape] if region is None else region
    ranges = [
        range(r.start // c, -(-r.stop // c)) if r.stop > r.start else range(0)
        for r, c in zip(region, chunks, strict=True)
    ]
    return itertools.product(*ranges)


def _block(array: np.ndarray, chunks: list[int], index: tuple[int, ...]) -> np.ndarray:
    """Chunk ``index`` of ``array``, padded with zeros (the fill value) to the full chunk shape."""
    part = array[tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunks, strict=True))]
    if list(part.shape) == chunks:
        return _contiguous(part)
    block = np.zeros(chunks, array.dtype)
    block[tuple(slice(0, n) for n in part.shape)] = part
    return block


def _pays(blosc: Any, block: np.ndarray) -> bool:
    """Compress when it saves a fifth or more: decompression costs more read time than it saves
    on noise-like floats (normalised volumes often compress by only 10-20%)."""
    return len(_compress(blosc, block)) * 1.25 <= block.nbytes


def _zarr_array(leaf: Leaf, index: int) -> np.ndarray:
    if isinstance(leaf, torch.Tensor):
        try:
            leaf = leaf.numpy()
        except TypeError as exc:
            raise UnsupportedSampleError(
                f"tensor leaf {index} has dtype {leaf.dtype}, which format 'zarr' cannot hold "
                "(use format='pt' or 'npy')"
            ) from exc
    if leaf.dtype.newbyteorder("=") not in _ZARR_TYPES:
        raise UnsupportedSampleError(
            f"array leaf {index} has dtype {leaf.dtype}, which format 'zarr' cannot hold"
        )
    return _contiguous(leaf.astype(leaf.dtype.newbyteorder("<"), copy=False))


def _write_json(path: Path, document: dict[str, Any], modes: Modes) -> None:
    with _create(path, modes) as out:
        out.write(json.dumps(document).encode())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        document: dict[str, Any] = json.loads(read_regular(path))
    except ValueError as exc:
        raise CorruptEntryError(f"cache entry metadata is unreadable: {path}") from exc
    return document


class ZarrArray:
    """One array of a zarr entry, read lazily: index it (ints and step-1 slices) to read a crop,
    or ``np.asarray(a)`` for all of it. Valid inside the ``Cache.open`` block that returned it."""

    def __init__(self, path: Path, meta: dict[str, Any], as_tensor: bool) -> None:
        self.path = path
        self.shape = tuple(meta["shape"])
        self.dtype = np.dtype(meta["dtype"]).newbyteorder("<")
        self.chunks = tuple(meta["chunks"])
        self.compressed = bool(meta["compressed"])
        self.as_tensor = as_tensor

    def __repr__(self) -> str:
        return f"ZarrArray(shape={self.shape}, dtype={self.dtype}, chunks={self.chunks})"

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.read()
        return array if dtype is None else array.astype(dtype)

    def __getitem__(self, key: Any) -> np.ndarray | torch.Tensor:
        region, drop = _region(key, self.shape)
        out = self.read(region)[tuple(0 if d else slice(None) for d in drop)]
        return torch.from_numpy(_contiguous(out)) if self.as_tensor else out

    def read(self, region: Sequence[slice] | None = None) -> np.ndarray:
        """The array, or the ``region`` of it (one non-negative slice per axis)."""
        region = [slice(0, n) for n in self.shape] if region is None else list(region)
        out = np.empty([r.stop - r.start for r in region], self.dtype)
        blosc = _blosc()

        def one(index: tuple[int, ...]) -> None:
            src: list[Any] = []
            dst: list[Any] = []
            for i, r, c in zip(index, region, self.chunks, strict=True):
                lo, hi = max(r.start, i * c), min(r.stop, (i + 1) * c)
                src.append(slice(lo - i * c, hi - i * c))
                dst.append(slice(lo - r.start, hi - r.start))
            target = out[tuple([*dst, Ellipsis])]  # a view, even of a 0-d array
            whole = list(target.shape) == list(self.chunks)
            pieces = _runs(target) if whole and not self.compressed else None
            if pieces is not None:
                self._read_into(index, pieces)  # straight into place, no copy
            else:
                target[...] = self._chunk(blosc, index)[tuple(src)]

        chunks = _grid(self.shape, self.chunks, region)
        # Decompression is CPU work that threads share; plain reads are the kernel copying
        # pages, which extra threads only slow down on a small machine.
        list(_pool().map(one, chunks) if self.compressed else map(one, chunks))
        return out

    def _open(self, key: str) -> tuple[io.FileIO, int]:
        """Chunk ``key``'s file, unbuffered, and its size (a regular file, never through a
        link)."""
        try:
            fd, found = open_regular(self.path / key)
            return open(fd, "rb", buffering=0), found.st_size
        except FileNotFoundError as exc:
            raise CorruptEntryError(f"cache entry lacks chunk {key}: {self.path}") from exc
        except PermissionError as exc:
            why = denied(self.path / key, writing=False)
            raise CacheError(
                f"cannot read chunk {key} of the cache entry {self.path}: {why}"
            ) from exc

    def _read_into(self, index: tuple[int, ...], pieces: list[np.ndarray]) -> None:
        """Read an uncompressed chunk into ``pieces`` (its place in the output, in order)."""
        key = _chunk_key(index)
        tail = bytearray(4)
        f, size = self._open(key)
        with f:
            got = os.readv(f.fileno(), [*(p.data for p in pieces), tail])
        crc = 0
        for piece in pieces:
            crc = crc32c(piece.data, crc)
        if (
            got != size
            or got != sum(p.nbytes for p in pieces) + 4
            or crc != int.from_bytes(tail, "little")
        ):
            raise CorruptEntryError(f"chunk {key} fails its checksum: {self.path}")

    def _chunk(self, blosc: Any, index: tuple[int, ...]) -> np.ndarray:
        """One chunk, checked and decompressed into this thread's reused buffers."""
        key = _chunk_key(index)
        nbytes = math.prod(self.chunks) * self.dtype.itemsize
        f, size = self._open(key)
        with f:
            data = _scratch_buffer("data", size)
            got = f.readinto(data.data)
        if got != size or size < 4 or crc32c(data[:-4].data) != int(data[-4:].view("<u4")[0]):
            raise CorruptEntryError(f"chunk {key} fails its checksum: {self.path}")
        if not self.compressed:
            if size - 4 != nbytes:
                raise CorruptEntryError(
                    f"chunk {key} has {size - 4} bytes, not {nbytes}: {self.path}"
                )
            chunk: np.ndarray = data[:-4].view(self.dtype).reshape(self.chunks)
            return chunk
        out = _scratch_buffer("out", nbytes)
        try:
            blosc.decompress(data[:-4], dest=out)
        except Exception as exc:  # numcodecs raises RuntimeError on bad input
            raise CorruptEntryError(f"chunk {key} does not decompress: {self.path}") from exc
        chunk = out.view(self.dtype).reshape(self.chunks)
        return chunk


def _runs(view: np.ndarray, limit: int = 64) -> list[np.ndarray] | None:
    """``view`` as at most ``limit`` C-contiguous pieces in order, or None."""
    if view.flags.c_contiguous:
        return [view]
    for k in range(1, view.ndim):  # sub-views of the first k axes, each at least 1-d
        lead = view.shape[:k]
        if math.prod(lead) > limit:
            return None
        if view[(0,) * k].flags.c_contiguous:  # the sub-views share strides: one check will do
            return [view[i] for i in np.ndindex(*lead)]
    return None


def _scratch_buffer(name: str, nbytes: int) -> np.ndarray:
    """A per-thread buffer reused across chunks (fresh large buffers cost page faults)."""
    buffer: np.ndarray | None = getattr(_scratch, name, None)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = np.empty(nbytes, np.uint8)
        setattr(_scratch, name, buffer)
    return buffer[:nbytes]


def _region(key: Any, shape: tuple[int, ...]) -> tuple[list[slice], list[bool]]:
    """Basic indexing (ints and step-1 slices) as one slice per axis, plus which axes to drop."""
    parts = key if isinstance(key, tuple) else (key,)
    if Ellipsis in parts:
        at = parts.index(Ellipsis)
        parts = (*parts[:at], *[slice(None)] * (len(shape) - len(parts) + 1), *parts[at + 1 :])
    if len(parts) > len(shape):
        raise IndexError(f"too many indices for an array of shape {shape}")
    region, drop = [], []
    for axis, n in enumerate(shape):
        part = parts[axis] if axis < len(parts) else slice(None)
        if isinstance(part, (int, np.integer)):
            i = int(part) + (n if part < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {part} is out of bounds for axis {axis} with size {n}")
            region.append(slice(i, i + 1))
            drop.append(True)
        elif isinstance(part, slice) and part.step in (None, 1):
            start, stop, _ = part.indices(n)
            region.append(slice(start, max(start, stop)))
            drop.append(False)
        else:
            raise IndexError(f"a zarr cache entry takes ints and step-1 slices, got {part!r}")
    return region, drop


class ZarrFormat(Format):
    name = "zarr"
    suffix = ".zarr"
    directory = True

    def write(self, sample: Any, name: str, path: Path, modes: Modes) -> int:
        """Write the entry as a new folder ``path``, its folders and files of ``modes``; the
        bytes written."""
        blosc = _blosc()
        spec, values, leaves = flatten(sample)
        arrays = [_zarr_array(leaf, i) for i, leaf in enumerate(leaves)]
        make_dir(path, modes)
        metas, jobs = [], []
        for i, array in enumerate(arrays):
            chunks = chunk_shape(array.shape, array.dtype.itemsize)
            blocks = [(index, _block(array, chunks, index)) for index in _grid(array.shape, chunks)]
            meta = {
                "shape": [*array.shape],
                "dtype": array.dtype.str,
                "chunks": chunks,
                "compressed": bool(blocks) and _pays(blosc, blocks[0][1]),
            }
            metas.append(meta)
            make_dir(path / str(i), modes)
            _write_json(path / str(i) / "zarr.json", _array_meta(meta), modes)
            for index, block in blocks:
                target = path / str(i) / _chunk_key(index)
                make_dirs(target.parent, modes)
                jobs.append((block, meta["compressed"], target))
        attributes = {
            "name": name,
            "spec": spec,
            "values": values,
            "kinds": _leaf_kinds(leaves),
            "arrays": metas,
        }
        group = {"zarr_format": 3, "node_type": "group", "attributes": {"fastload": attributes}}
        _write_json(path / "zarr.json", group, modes)

        def one(job: tuple[np.ndarray, bool, Path]) -> int:
            block, compressed, target = job
            data = _compress(blosc, block) if compressed else block.tobytes()
            with _create(target, modes) as out:
                out.write(data)
                out.write(crc32c(data).to_bytes(4, "little"))
            return len(data) + 4

        return sum(_pool().map(one, jobs)) + _tree_bytes(path, files_only="zarr.json")

    def _header(self, path: str | Path) -> dict[str, Any]:
        header = _read_json(Path(path) / "zarr.json").get("attributes", {}).get("fastload")
        if not isinstance(header, dict):
            raise CorruptEntryError(f"not a fastload zarr entry: {path}")
        return header

    def arrays(self, path: str | Path) -> tuple[list[Any], list[Any] | None, list[ZarrArray]]:
        """The entry's spec, values (None: in the spec, as earlier versions wrote it) and a
        lazy :class:`ZarrArray` per leaf, metadata cross-checked."""
        path = Path(path)
        header = self._header(path)
        arrays = []
        try:
            for i, (meta, kind) in enumerate(zip(header["arrays"], header["kinds"], strict=True)):
                if _read_json(path / str(i) / "zarr.json") != _array_meta(meta):
                    raise CorruptEntryError(f"array {i} metadata disagrees with the entry: {path}")
                arrays.append(ZarrArray(path / str(i), meta, kind[0] == "t"))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptEntryError(f"cache entry metadata is malformed: {path}") from exc
        return header["spec"], header.get("values"), arrays

    def read(self, path: str | Path) -> Any:
        spec, values, arrays = self.arrays(path)
        leaves: list[Leaf] = []
        for array in arrays:
            data = array.read()
            leaves.append(torch.from_numpy(data) if array.as_tensor else data)
        return unflatten(spec, leaves, values)


def _tree_bytes(path: str | Path, files_only: str | None = None) -> int:
    """Bytes of the files under ``path`` (or only those named ``files_only``)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            if files_only is None or name == files_only:
                total += os.stat(os.path.join(folder, name)).st_size
    return total


def entry_bytes(path: str | Path, directory: bool) -> int:
    return _tree_bytes(path) if directory else os.stat(path).st_size


FORMATS: dict[str, Callable[[], Format]] = {"pt": PtFormat, "npy": NpyFormat, "zarr": ZarrFormat}
