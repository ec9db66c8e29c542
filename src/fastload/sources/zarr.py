"""One Zarr array read in place: a sample per index along its first axis, or per patch.

The listing of the store (``s3://bucket/scans.zarr``, Zarr v3 or v2) names the array's metadata
object (``zarr.json``, or ``.zarray``) and its chunk objects, each with its size and version.
The metadata is read once, through the dataset's fetcher, and kept with the manifest (its
``"zarr"`` slot), so a restart from a saved listing reads none. A chunk object is read whole, one
request, and decoded by zarr itself (the array's own codecs, as ``zarr.open_array`` reads
them); a chunk the listing does not hold reads as the array's fill value, as zarr reads it.

The samples that read the same chunk objects are one block (``blocks``): shard-aware shuffling
visits blocks, the chunks a batch needs are read once between its samples, and each process
keeps the decoded chunks it read in memory (:mod:`fastload.sources._chunks`, bounded by
``ChunkConfig.memory_bytes``; DataLoader workers share the chunks' bytes), so an epoch reads
each chunk once. A chunk that fails to decode (a codec's error; zarr's default zstd has no
checksum: a ``crc32c`` codec makes a flipped byte an error too) or a chunk rewritten since the
listing fails the samples that read it, naming the chunk's URL.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, replace
from functools import reduce
from typing import Any

import numpy as np

from fastload._extras import import_extra
from fastload.config import ChunkConfig
from fastload.errors import ConfigError, DecodeError, ShardError, StoreError
from fastload.fetcher import Fetcher
from fastload.manifest import Entry, Kept, Manifest
from fastload.sources import (
    DecodeSpec,
    Opening,
    Part,
    Sample,
    Source,
    group_version,
    parts_bytes,
)
from fastload.sources._chunks import Chunk, ChunkReader
from fastload.sources._shards import check_chunks

__all__ = ["Zarr", "ZarrArray"]

log = logging.getLogger(__name__)

SLOT = "zarr"  # the manifest's slot for the array's metadata
KEPT_TAG = "zarr-metadata/1"
READER_VERSION = "zarr/1"
_METADATA = ("zarr.json", ".zarray")  # an array's metadata object: v3, v2
_MEMO = 4096  # blocks whose chunks and version are remembered
_NAME_ONE = "array=, or fastload warm-cache's --array"  # how to name an array of a group


@dataclass(frozen=True, eq=False)
class Zarr(Source):
    """The samples of one Zarr array, read in place (see the module docstring, and
    :class:`Source` for ``pattern``, ``manifest_path`` and ``reuse_listing``).

    where: the URL of the store (``s3://bucket/scans.zarr``), an array or a group holding it.
    array: the array's path in that group (``"raw"``, ``"scans/raw"``); None: ``where`` is the
        array. (The whole store is listed; ``where`` the array's own URL lists only it.) Both
        forms name the same samples alike: same URLs, versions and cache names.
    patch: sizes along the array's first axes: a sample is the patch
        ``array[i0:i0+p0, i1:i1+p1, ...]`` (the other axes whole), the patches tiling the
        array from index 0 without overlap. A patch that would cross the array's edge is no
        sample: where an axis is not a multiple of the patch, its last ``size % patch``
        indices are left out (a warning says how many). Samples are numbered block by block
        (the patches that read the same chunks), each named by its region
        (``s3://bucket/scans.zarr#[0:256,256:512]``). None: a sample is ``array[i]`` (named
        ``...#[i]``), one per index along the first axis.
    chunks: the decoded chunks each process keeps (:class:`fastload.ChunkConfig`'s
        ``memory_bytes``; ``chunk_bytes`` does not apply: a chunk is the store's object).

    ``decode`` receives the sample, a numpy array of the array's dtype (None: the sample is
    that array). Needs ``fastload[zarr]``.
    """

    _: KW_ONLY
    array: str | None = None
    patch: Sequence[int] | None = None
    chunks: ChunkConfig | None = None

    name = "zarr"

    def __post_init__(self) -> None:
        super().__post_init__()
        _array_path(self.array)
        _patch(self.patch)
        check_chunks(self.chunks)

    def open(self, manifest: Manifest, opening: Opening) -> ZarrArray:
        return ZarrArray(
            manifest, opening.fetcher, array=self.array, patch=self.patch, config=self.chunks
        )

    def decoder(self, decode: DecodeSpec) -> Callable[[Any], Any]:
        if decode is not None and (isinstance(decode, str) or not callable(decode)):
            raise ConfigError(
                "zarr samples are numpy arrays: decode takes a callable of one (or None: the "
                f"array is the sample), got {decode!r}"
            )
        return super().decoder(decode)


def _array_path(array: object) -> str:
    """``array=`` as a path under the store's root ("" for the root itself)."""
    if array is None:
        return ""
    if not isinstance(array, str) or not array.strip("/"):
        raise ConfigError(f'array must be the array\'s path in the group ("raw"), got {array!r}')
    return array.strip("/")


def _patch(patch: object) -> tuple[int, ...] | None:
    """``patch=`` as a tuple of sizes >= 1 (None: a sample per index of the first axis)."""
    if patch is None:
        return None
    sizes = tuple(patch) if isinstance(patch, (tuple, list)) else ()
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
        raise ConfigError(f"patch must be a tuple of sizes (ints), got {patch!r}")
    if min(sizes) < 1:
        raise ConfigError(f"patch sizes must be >= 1, got {patch!r}")
    return sizes


# -- zarr itself ---------------------------------------------------------------------------------


class _Decoder:
    """The array as zarr reads it: its metadata parsed from the metadata object's bytes, its
    fill value, and a chunk object's bytes decoded (made in each process: zarr's objects are
    not pickled).

    A chunk is decoded by the array's codecs called in turn, synchronously
    (:func:`_codec_chain`), where each has a synchronous decode (zarr's bytes, transpose,
    zstd, blosc, gzip and crc32c codecs; a v2 array's numcodecs): reading it through a zarr
    array over a store holding only it cost about 0.4 ms a chunk in zarr's async layer (4.0 s
    against 0.44 s for zarr reading the whole array, 1,250 chunks of 32 KB). The first chunk
    (the first of more than one value) is decoded both ways: if they differ in any way (dtype,
    shape, values), or the chain cannot be built (sharding, object dtypes, another zarr's
    internals), every chunk goes through zarr's array; a chunk the chain fails on does too, so
    its error is zarr's own."""

    def __init__(self, name: str, document: bytes) -> None:
        zarr = _zarr("zarr")
        self._storage, self._buffer = _zarr("zarr.storage"), _zarr("zarr.buffer.cpu").Buffer
        self._zarr = zarr
        store = self._storage.MemoryStore({name: self._buffer.from_bytes(document)})
        array = zarr.open_array(store=store, mode="r")
        self.metadata = array.metadata
        # read where no chunk is: the fill value, of the array's dtype (none to read in an
        # array of no elements, which has no values to fill either)
        empty = array.size == 0
        self.fill = np.zeros((), array.dtype) if empty else np.asarray(array[(0,) * array.ndim])
        self._chain = _codec_chain(self.metadata)
        self._checked = False  # a chunk of the chain's compared with zarr's reading
        self._checking = threading.Lock()

    def decoded(self, key: str, region: tuple[slice, ...], body: bytes | memoryview) -> Any:
        """The chunk object ``key`` (relative to the array) of bytes ``body``, as zarr reads
        ``region`` (the chunk's, clipped to the array's edge) from a store holding only it."""
        chain = self._chain
        if chain is None:
            return self._through_zarr(key, region, body)
        try:
            whole = chain(body)
        except Exception:  # zarr's array says what is wrong with the chunk
            return self._through_zarr(key, region, body)
        out = np.array(whole[tuple(slice(0, r.stop - r.start) for r in region)])
        return out if self._checked else self._check(out, key, region, body)

    def _check(
        self, out: np.ndarray, key: str, region: tuple[slice, ...], body: bytes | memoryview
    ) -> Any:
        """The chain's ``out`` compared with zarr's reading of the chunk: zarr's, and the chain
        given up, where they differ. Until a chunk of more than one value passes (one value
        repeated would pass a chain that puts values in the wrong places), each chunk is
        compared, one at a time: a chunk that other threads decode meanwhile waits for the
        verdict, never taken from the chain before it."""
        with self._checking:
            if self._chain is None:  # another thread's chunk differed
                return self._through_zarr(key, region, body)
            if self._checked:
                return out
            expected = np.asarray(self._through_zarr(key, region, body))
            if not _same(out, expected):
                log.debug("zarr chunks are decoded through zarr's array: the codecs differ")
                self._chain = None
                return expected
            self._checked = _varied(out)
            return out

    def _through_zarr(self, key: str, region: tuple[slice, ...], body: bytes | memoryview) -> Any:
        store = self._storage.MemoryStore({key: self._buffer.from_bytes(body)})
        path = self._storage.StorePath(store)
        return self._zarr.Array(self._zarr.AsyncArray(self.metadata, path))[region]


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _varied(a: np.ndarray) -> bool:
    """Whether ``a`` holds more than one value (bit for bit)."""
    raw = a.tobytes()
    return raw != raw[: a.itemsize] * a.size


def _codec_chain(metadata: Any) -> Callable[[bytes | memoryview], np.ndarray] | None:
    """A whole chunk's bytes to its array by the array's codecs, called synchronously; None
    where a codec has no synchronous decode, or zarr's internals are not as expected."""
    try:
        if metadata.zarr_format == 2:
            return _v2_chain(metadata)
        return _v3_chain(metadata)
    except Exception:  # another zarr version's internals: zarr's array reads every chunk
        log.debug("zarr chunks are decoded through zarr's array", exc_info=True)
        return None


def _v2_chain(metadata: Any) -> Callable[[bytes | memoryview], np.ndarray] | None:
    dtype = np.dtype(metadata.dtype.to_native_dtype())
    if dtype.hasobject:
        return None
    compressor, filters = metadata.compressor, tuple(reversed(metadata.filters or ()))
    shape, order = tuple(metadata.chunks), metadata.order

    def decode(body: bytes | memoryview) -> np.ndarray:
        data = compressor.decode(body) if compressor is not None else body
        for codec in filters:
            data = codec.decode(data)
        flat: np.ndarray = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype)
        chunk: np.ndarray = flat.view(dtype).reshape(shape, order=order)
        return chunk

    return decode


def _v3_chain(metadata: Any) -> Callable[[bytes | memoryview], np.ndarray] | None:
    config = _zarr("zarr.core.array_spec").ArrayConfig.from_dict({})
    prototype = _zarr("zarr.core.buffer").default_buffer_prototype()
    buffer = _zarr("zarr.buffer.cpu").Buffer
    arrays, to_bytes, compressors = _zarr("zarr.core.codec_pipeline").codecs_from_list(
        metadata.codecs
    )
    if not all(hasattr(c, "_decode_sync") for c in (*arrays, to_bytes, *compressors)):
        return None  # sharding, or a codec decoded only in a thread
    spec = metadata.get_chunk_spec((0,) * metadata.ndim, config, prototype)
    dtype = np.dtype(spec.dtype.to_native_dtype())  # zarr's reads are of it (a big-endian
    # serializer's bytes too)
    array_specs = []
    for codec in arrays:
        array_specs.append(spec)
        spec = codec.resolve_metadata(spec)
    byte_specs = []
    for codec in (to_bytes, *compressors):
        byte_specs.append(spec)
        spec = codec.resolve_metadata(spec)
    undo_bytes = list(zip(reversed(compressors), reversed(byte_specs[1:]), strict=True))
    undo_arrays = list(zip(reversed(arrays), reversed(array_specs), strict=True))

    def decode(body: bytes | memoryview) -> np.ndarray:
        data = buffer.from_bytes(body)
        for codec, at in undo_bytes:
            data = codec._decode_sync(data, at)
        array = to_bytes._decode_sync(data, byte_specs[0])
        for codec, at in undo_arrays:
            array = codec._decode_sync(array, at)
        return np.asarray(array.as_numpy_array()).astype(dtype, copy=False)

    return decode


def _zarr(module: str) -> Any:
    return import_extra(module, extra="zarr", feature="fastload.Zarr")


def _metadata(name: str, document: bytes, url: str) -> _Decoder:
    try:
        return _Decoder(name, document)
    except Exception as exc:  # zarr's own errors
        reason = f"{type(exc).__name__}: {exc}"[:300]
        raise DecodeError(f"cannot read the Zarr array's metadata ({reason})", url=url) from exc


# -- which samples read which chunks -------------------------------------------------------------


@dataclass(frozen=True)
class _Axis:
    """How the patches along one axis fall on its chunks: runs of consecutive patches that read
    the same chunks (``first`` to ``last``, inclusive)."""

    starts: np.ndarray  # each run's first patch
    lengths: np.ndarray  # patches in each run
    first: np.ndarray
    last: np.ndarray

    @classmethod
    def of(cls, size: int, patch: int, chunk: int) -> _Axis:
        t = np.arange(size // patch, dtype=np.int64)
        first, last = t * patch // chunk, ((t + 1) * patch - 1) // chunk
        moved = np.flatnonzero((first[1:] != first[:-1]) | (last[1:] != last[:-1])) + 1
        starts = np.concatenate([[0], moved]).astype(np.int64)
        lengths = np.diff(np.append(starts, len(t)))
        return cls(starts, lengths, first[starts], last[starts])

    def weights(self, chunks: int) -> np.ndarray:
        """The patches that read each of this axis's ``chunks``."""
        out = np.zeros(chunks, dtype=np.int64)
        for step in range(int((self.last - self.first).max(initial=0)) + 1):
            reach = self.first + step <= self.last
            np.add.at(out, self.first[reach] + step, self.lengths[reach])
        return out


class _Tiling:
    """The samples of an array of ``shape`` in chunks of ``chunk``: patches of ``patch`` along
    the first axes (the others whole), numbered block by block (a block: the patches whose
    runs, one per axis, are the same), within a block in C order."""

    def __init__(self, shape: tuple[int, ...], chunk: tuple[int, ...], patch: tuple[int, ...]):
        self.shape, self.chunk, self.patch = shape, chunk, patch
        self.grid = tuple(-(-s // c) for s, c in zip(shape, chunk, strict=True))
        self.axes = [_Axis.of(shape[j], patch[j], chunk[j]) for j in range(len(patch))]
        self.runs = tuple(len(axis.starts) for axis in self.axes)
        sizes = reduce(np.multiply.outer, [axis.lengths for axis in self.axes]).ravel()
        self.count = int(sizes.sum())
        self.blocks = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    def locate(self, index: int) -> tuple[int, tuple[int, ...]]:
        """The block of sample ``index`` and its patch's position along each patched axis."""
        block = int(np.searchsorted(self.blocks, index, side="right")) - 1
        runs = np.unravel_index(block, self.runs)
        lengths = tuple(int(a.lengths[r]) for a, r in zip(self.axes, runs, strict=True))
        inner = np.unravel_index(index - int(self.blocks[block]), lengths)
        at = (int(a.starts[r]) + int(o) for a, r, o in zip(self.axes, runs, inner, strict=True))
        return block, tuple(at)

    def box(self, block: int) -> list[np.ndarray]:
        """The chunks a block reads, along each axis."""
        runs = np.unravel_index(block, self.runs)
        patched = [
            np.arange(int(a.first[r]), int(a.last[r]) + 1)
            for a, r in zip(self.axes, runs, strict=True)
        ]
        return patched + [np.arange(g) for g in self.grid[len(self.axes) :]]

    def region(self, at: tuple[int, ...]) -> list[tuple[int, int]]:
        """The bounds of the patch at ``at`` along every axis."""
        head = [(t * p, (t + 1) * p) for t, p in zip(at, self.patch, strict=True)]
        return head + [(0, size) for size in self.shape[len(at) :]]

    def chunk_region(self, coords: Sequence[int]) -> list[tuple[int, int]]:
        """The bounds of the chunk at ``coords``, clipped to the array's edge."""
        return [
            (c * n, min((c + 1) * n, size))
            for c, n, size in zip(coords, self.chunk, self.shape, strict=True)
        ]

    def weights(self, coords: np.ndarray) -> np.ndarray:
        """The samples that read each chunk at ``coords`` (one row of coordinates a chunk)."""
        out = np.ones(len(coords), dtype=np.int64)
        for j, axis in enumerate(self.axes):
            out *= axis.weights(self.grid[j])[coords[:, j]]
        return out


@dataclass(frozen=True)
class _Block:
    """What the samples of one block read: the chunk objects listed (by their position among
    them, in C order), whether every chunk of the block is listed, and the block's version."""

    chunks: tuple[Chunk, ...]
    parts: tuple[Part, ...]
    complete: bool
    version: str


# -- the reader ----------------------------------------------------------------------------------


class ZarrArray:
    """The samples of one Zarr array in the listing of its store (see the module docstring)."""

    reader_version = READER_VERSION
    classes: tuple[str, ...] | None = None

    def __init__(
        self,
        manifest: Manifest,
        fetcher: Fetcher,
        *,
        array: str | None = None,
        patch: Sequence[int] | None = None,
        config: ChunkConfig | None = None,
    ) -> None:
        self.root = manifest.root
        self.left_out: list[str] = []
        path = _array_path(array)
        self.url = manifest.url(path) if path else manifest.root
        self._prefix = f"{path}/" if path else ""
        keys = {k: i for i, k in enumerate(manifest.keys()) if k.startswith(self._prefix)}
        meta = self._metadata_entry(manifest, keys)
        self._document_name = meta.key.rsplit("/", 1)[-1]
        self._document, self.manifest = _document(manifest, meta, fetcher)
        self._meta_part = Part(meta.key, meta.url, meta.size, meta.version)
        self._decoder: _Decoder | None = _metadata(self._document_name, self._document, meta.url)
        metadata = self._decoder.metadata
        shape = tuple(int(n) for n in metadata.shape)
        chunk = tuple(int(n) for n in (metadata.shards or metadata.chunks))
        self._squeeze = patch is None
        self._tiling = _Tiling(shape, chunk, self._checked_patch(shape, _patch(patch)))
        self._listed(manifest, keys, metadata.encode_chunk_key)
        self._memo: dict[int, _Block] = {}
        self.blocks = self._tiling.blocks
        config = config or ChunkConfig.from_env()
        self.reader = ChunkReader(
            config.memory_bytes,
            self._load,
            self._weigh,
            samples=self._weights,
            root=self.url,
        )

    def __getstate__(self) -> dict[str, Any]:
        """A worker's copy: zarr's objects are made again there, the blocks remembered anew."""
        return {**self.__dict__, "_decoder": None, "_memo": {}}

    # -- opening ---------------------------------------------------------------------------
    def _metadata_entry(self, manifest: Manifest, keys: dict[str, int]) -> Entry:
        """The array's metadata object in the listing, or a ConfigError saying what is there."""
        for name in _METADATA:
            if self._prefix + name in keys:
                return manifest[keys[self._prefix + name]]
        nodes = _nodes(keys, self._prefix)
        hint = (
            f": its arrays and groups are {nodes[:10]} (name one with {_NAME_ONE})" if nodes else ""
        )
        raise ConfigError(
            f"no Zarr array at {self.url}: neither {' nor '.join(_METADATA)} is listed there" + hint
        )

    def _checked_patch(
        self, shape: tuple[int, ...], patch: tuple[int, ...] | None
    ) -> tuple[int, ...]:
        """The patch sizes (``(1,)`` for a sample per index), checked against ``shape``; the
        indices that no whole patch covers are named in a warning."""
        if not shape:
            raise ConfigError(f"the Zarr array {self.url} has no axes (a scalar): no samples")
        sizes = patch or (1,)
        if len(sizes) > len(shape):
            raise ConfigError(
                f"patch {patch} has {len(sizes)} sizes, the Zarr array {self.url} has "
                f"{len(shape)} axes (shape {shape})"
            )
        small = [j for j, p in enumerate(sizes) if shape[j] < p]
        if small:
            why = (
                f"axis {small[0]} is shorter than the patch" if patch else "its first axis is empty"
            )
            raise ConfigError(f"the Zarr array {self.url} (shape {shape}) holds no samples: {why}")
        cut = [(j, shape[j] % p) for j, p in enumerate(sizes) if shape[j] % p]
        if cut:
            said = ", ".join(f"the last {n} along axis {j}" for j, n in cut)
            log.warning(
                "Zarr array %s (shape %s) in patches of %s: %s are in no sample (a patch "
                "that would cross the array's edge is left out)",
                self.url, shape, sizes, said,
            )  # fmt: skip
        return sizes

    def _listed(
        self, manifest: Manifest, keys: dict[str, int], encode: Callable[[tuple[int, ...]], str]
    ) -> None:
        """The chunk objects the listing holds: their place in the chunk grid (``_linear``,
        sorted), in the manifest, and the samples that read each."""
        grid = self._tiling.grid
        pattern = _key_pattern(encode, len(grid))
        found: list[tuple[tuple[int, ...], int]] = []
        for key, position in keys.items():
            relative = key[len(self._prefix) :]
            match = pattern.fullmatch(relative)
            if match is None:
                continue
            coords = tuple(int(n) for n in match.groups())
            if all(c < g for c, g in zip(coords, grid, strict=True)) and encode(coords) == relative:
                found.append((coords, position))
        others = len(keys) - len(found) - 1
        if others:
            log.info("Zarr array %s: %d listed objects are not its chunks", self.url, others)
        places = np.array([c for c, _ in found], dtype=np.int64).reshape(len(found), len(grid))
        linear = np.asarray(np.ravel_multi_index(places.T, grid), dtype=np.int64).reshape(-1)
        order = np.argsort(linear)
        self._linear = linear[order]
        self._positions = np.array([p for _, p in found], dtype=np.int64)[order]
        self._weights = self._tiling.weights(places[order])
        self._listing = manifest

    # -- what a SampleSource gives -------------------------------------------------------
    def __len__(self) -> int:
        return self._tiling.count

    def __getitem__(self, index: int) -> Sample:
        block, at = self._tiling.locate(index)
        name = self._name(at)
        found = self._block(block)
        return Sample(name, f"{self.url}#{name}", found.version, found.parts, index=index)

    def identities(self, indices: Sequence[int]) -> list[tuple[str, str, int | None]]:
        out: list[tuple[str, str, int | None]] = []
        for index in indices:
            block, at = self._tiling.locate(int(index))
            out.append((f"{self.url}#{self._name(at)}", self._block(block).version, None))
        return out

    def nbytes(self, indices: Sequence[int] | np.ndarray) -> int:
        return parts_bytes(self, indices)

    def uncached(self) -> None:
        pass  # nothing it reads is let go for the cache

    def read(self, samples: Sequence[Sample], fetcher: Fetcher) -> list[Any]:
        """Each sample's region put together from its decoded chunks (the fill value where a
        chunk is not listed); the chunks of the whole batch are read at once, each once."""
        where = [self._tiling.locate(s.index) for s in samples]
        blocks = [self._block(block) for block, _ in where]
        loaded = self.reader.get([c for b in blocks for c in b.chunks], fetcher)
        return [
            self._assembled(sample, at, block, loaded)
            for sample, (_, at), block in zip(samples, where, blocks, strict=True)
        ]

    # -- blocks and chunks -----------------------------------------------------------------
    def _name(self, at: tuple[int, ...]) -> str:
        if self._squeeze:
            return f"[{at[0]}]"
        bounds = self._tiling.region(at)[: len(at)]
        return "[" + ",".join(f"{a}:{b}" for a, b in bounds) + "]"

    def _block(self, block: int) -> _Block:
        """What block ``block`` reads (remembered, up to ``_MEMO`` blocks at a time)."""
        found = self._memo.get(block)
        if found is not None:
            return found
        box = np.meshgrid(*self._tiling.box(block), indexing="ij")
        wanted = np.asarray(np.ravel_multi_index(box, self._tiling.grid)).reshape(-1)
        at = np.searchsorted(self._linear, wanted)
        listed: np.ndarray = at < len(self._linear)
        listed[listed] = self._linear[at[listed]] == wanted[listed]
        chunks = tuple(self._chunk(int(o)) for o in at[listed])
        parts = tuple(
            Part(self._entry(c.index).key, c.url, c.size // self._shared(c.index), c.version)
            for c in chunks
        )
        version = group_version([self._in_array(p) for p in (self._meta_part, *parts)])
        found = _Block(chunks, parts, bool(listed.all()), version)
        if len(self._memo) >= _MEMO:
            self._memo.clear()
        self._memo[block] = found
        return found

    def _in_array(self, part: Part) -> Part:
        """``part`` keyed relative to the array, not to the listing's root: a block's version
        is then the same whether the array was named by its own URL or by its group's URL and
        ``array=`` (the same samples, so the same cache names)."""
        return replace(part, key=part.key[len(self._prefix) :])

    def _shared(self, chunk: int) -> int:
        """The samples that read chunk ``chunk`` (each reads its share of the bytes)."""
        return max(1, int(self._weights[chunk]))

    def _entry(self, chunk: int) -> Entry:
        return self._listing[int(self._positions[chunk])]

    def _coords(self, chunk: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(self._linear[chunk], self._tiling.grid))

    def _chunk(self, chunk: int) -> Chunk:
        entry = self._entry(chunk)
        label = f"chunk {self._coords(chunk)}"
        return Chunk(entry.url, entry.version, entry.size, 0, entry.size, label, chunk)

    def _zarr(self) -> _Decoder:
        if self._decoder is None:  # in a worker: made again from the metadata's bytes
            self._decoder = _Decoder(self._document_name, self._document)
        return self._decoder

    def _load(self, chunk: Chunk, body: bytes | memoryview) -> np.ndarray:
        coords = self._coords(chunk.index)
        key = self._entry(chunk.index).key[len(self._prefix) :]
        region = tuple(slice(a, b) for a, b in self._tiling.chunk_region(coords))
        return np.asarray(self._zarr().decoded(key, region, body))

    def _weigh(self, loaded: Any) -> int:
        return int(loaded.nbytes)

    def _assembled(
        self, sample: Sample, at: tuple[int, ...], block: _Block, loaded: dict[Chunk, Any]
    ) -> Any:
        """The sample's own array: its region of each chunk copied in, the fill value where a
        chunk is not listed; or the failure of a chunk it reads, naming the chunk."""
        bounds = self._tiling.region(at)
        fill = self._zarr().fill
        shape = tuple(b - a for a, b in bounds)
        out = np.empty(shape, fill.dtype) if block.complete else np.full(shape, fill, fill.dtype)
        for chunk in block.chunks:
            value = loaded[chunk]
            if isinstance(value, BaseException):
                return self._failed(value, sample, chunk)
            inside = self._tiling.chunk_region(self._coords(chunk.index))
            common = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(bounds, inside, strict=True)]
            out[_within(common, bounds)] = value[_within(common, inside)]
        return out.reshape(shape[1:]) if self._squeeze else out

    def _failed(self, error: BaseException, sample: Sample, chunk: Chunk) -> BaseException:
        """A chunk's failure as the failure of one of its samples: named by the chunk's URL
        (what ``on_error="skip"`` lists), the message naming the sample too."""
        reason = str(error).removesuffix(f": {chunk.url}")
        where = "" if chunk.label in reason else f" ({chunk.label})"
        message = f"sample {sample.name} of {self.url}{where}: {reason}"
        kind = type(error) if isinstance(error, (StoreError, DecodeError)) else ShardError
        wrapped = kind(message, url=chunk.url)
        wrapped.__cause__ = error
        return wrapped


def _within(common: list[tuple[int, int]], bounds: list[tuple[int, int]]) -> tuple[slice, ...]:
    """The region ``common`` as slices of an array holding the region ``bounds``."""
    return tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(common, bounds, strict=True))


def _nodes(keys: dict[str, int], prefix: str) -> list[str]:
    """The arrays and groups under ``prefix`` (their paths relative to it)."""
    found = {
        key[len(prefix) : -len(name) - 1]
        for key in keys
        for name in (*_METADATA, ".zgroup")
        if key.endswith(f"/{name}")
    }
    return sorted(found)


def _document(manifest: Manifest, entry: Entry, fetcher: Fetcher) -> tuple[bytes, Manifest]:
    """The metadata object's bytes, as the manifest keeps them when they are of this version
    of it, else read (and the manifest that keeps them); a group's is a ConfigError."""
    kept = manifest.kept.get(SLOT)
    if kept is not None and kept.tag == KEPT_TAG:
        arrays = kept.arrays
        same = (_text(arrays["key"]), _text(arrays["version"])) == (entry.key, entry.version)
        if same and len(arrays["document"]) == entry.size:
            return arrays["document"].tobytes(), manifest
    (body,) = fetcher.fetch([entry.request()])
    document = bytes(body)
    _refuse_group(document, entry, manifest)
    arrays = {
        "key": np.frombuffer(entry.key.encode(), np.uint8),
        "version": np.frombuffer(entry.version.encode(), np.uint8),
        "document": np.frombuffer(document, np.uint8),
    }
    return document, manifest.keeping(SLOT, Kept(KEPT_TAG, arrays, by_key=True))


def _refuse_group(document: bytes, entry: Entry, manifest: Manifest) -> None:
    """A v3 group's ``zarr.json`` holds no array: a ConfigError naming its arrays."""
    try:
        node = json.loads(document).get("node_type")
    except (ValueError, AttributeError):
        return  # not a JSON object: zarr names what is wrong with it
    if node == "group":
        folder = entry.key[: -len("zarr.json")]
        keys = {k: 0 for k in manifest.keys() if k.startswith(folder)}  # noqa: SIM118
        nodes = [n for n in _nodes(keys, folder) if n]
        raise ConfigError(
            f"{entry.url} is a Zarr group: name one of its arrays with {_NAME_ONE} (found: "
            f"{nodes[:10]})"
        )


def _text(array: np.ndarray) -> str:
    return array.tobytes().decode()


def _key_pattern(encode: Callable[[tuple[int, ...]], str], ndim: int) -> re.Pattern[str]:
    """What the array's chunk keys look like (``c/1/2``, ``1.2``), read off the key zarr
    encodes for coordinates no other part of a key can be mistaken for; a key it matches is
    a chunk's only if zarr encodes its coordinates back to it."""
    probe = tuple(10**15 + j for j in range(ndim))
    key, at, pieces = encode(probe), 0, []
    for number in map(str, probe):
        found = key.index(number, at)
        pieces.append(re.escape(key[at:found]))
        at = found + len(number)
    return re.compile(r"(\d+)".join([*pieces, re.escape(key[at:])]))
