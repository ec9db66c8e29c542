"""Many samples in one parquet file, read in place: one sample per row, or per run of rows.

``decode`` receives a row as ``{column: value}`` (numbers as numpy scalars, list columns as
numpy arrays, strings as str; a null is None, NaN in a floating-point column, NaT in a time
column); with ``decode=None`` the row is the sample. With ``row_key`` (e.g. ``"event_id"``,
when an event's pulses are consecutive rows) each run of rows sharing a value of that column is
one sample, ``{column: array of its rows}``; a file in which a value comes back later (not
sorted by it) is an error naming the value, never two samples, and so are a null key and a run
cut between two files (a value that ends one file and starts another).

Indexing a file reads its footer (one suffix read, two for a large footer) and, with
``row_key``, that column's chunks only; the index is kept in the dataset's cache by the file's
version. A row group is one chunk (row groups that a run spans are one chunk together): the
batches that shard-aware shuffling draws from it cost one ranged read, decoded once. DataLoader
workers share it decoded: the first worker that wants a row group decodes it into a file in the
reader's scratch folder (see :mod:`fastload.sources._chunks`), each column as numpy values (a
numeric column, a list column's items) or, for other values, each row's pickle, and every worker
maps that file, taking a sample's values from it (its own copies of that row alone). Needs
``fastload[parquet]``.
"""

from __future__ import annotations

import copy
import io
import json
import pickle
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from fastload._extras import import_extra
from fastload.config import ChunkConfig
from fastload.errors import ConfigError, ShardError
from fastload.fetcher import Fetcher
from fastload.manifest import Entry, Manifest, Strings
from fastload.sources import Opening, Source
from fastload.sources._chunks import Chunk, Decoded
from fastload.sources._scratch import Parts
from fastload.sources._shards import Shards, check_chunks

__all__ = ["Parquet", "ParquetShards"]

# 2: row_key values exact (pyarrow's to_numpy was not); 3: list columns' rows exact and alike
# (a fixed-size list of integers beside a null list was float64, nested lists with nulls 2-d)
INDEX_VERSION = "parquet-index/3"
_MAGIC = b"PAR1"
_TAIL = 64 << 10  # the first suffix read: most footers fit
_SPAN_GAP = 1 << 20  # bytes between chosen columns read rather than skipped (a request costs more)


_T = TypeVar("_T")
_STORED = b"fastload-rowgroup/1\n"  # a row group decoded, as its scratch file holds it
_ALIGN = 64  # where each of its arrays starts: numpy reads them in place


class _Column(Protocol):
    """A decoded column of a row group, from which a sample takes its values."""

    def row(self, i: int) -> Any:
        """Row ``i``'s value, its own (see ``ParquetShards._payload``)."""

    def rows(self, a: int, b: int) -> np.ndarray:
        """Rows ``a`` to ``b`` as an array of their own."""


@dataclass(frozen=True)
class _Values:
    """A column as numpy values (see :func:`_numpy`): decoded here, or a mapping of them."""

    values: np.ndarray

    def row(self, i: int) -> Any:
        return _own(self.values[i])

    def rows(self, a: int, b: int) -> np.ndarray:
        out: np.ndarray = _own(self.values[a:b])
        return out


@dataclass(frozen=True)
class _Nullable:
    """Numbers among nulls (integers, which ``_numpy`` keeps exact as objects): the values (0
    at a null) and where the nulls are."""

    values: np.ndarray
    nulls: np.ndarray

    def row(self, i: int) -> Any:
        return None if self.nulls[i] else self.values[i]

    def rows(self, a: int, b: int) -> np.ndarray:
        return _objects([self.row(i) for i in range(a, b)])


@dataclass(frozen=True)
class _Ragged:
    """Arrays of one dtype, or nulls (a list column's rows): their items one after another,
    where each row's end, and where the nulls are."""

    items: np.ndarray
    ends: np.ndarray
    nulls: np.ndarray

    def row(self, i: int) -> Any:
        return None if self.nulls[i] else self.items[_start(self.ends, i) : self.ends[i]].copy()

    def rows(self, a: int, b: int) -> np.ndarray:
        return _objects([self.row(i) for i in range(a, b)])


@dataclass(frozen=True)
class _Bytes:
    """A binary column's values: their bytes one after another, where each row's end, and
    where the nulls are."""

    data: np.ndarray
    ends: np.ndarray
    nulls: np.ndarray

    def row(self, i: int) -> Any:
        if self.nulls[i]:
            return None
        return self._value(self.data[_start(self.ends, i) : self.ends[i]].data)

    def rows(self, a: int, b: int) -> np.ndarray:
        return _objects([self.row(i) for i in range(a, b)])

    def _value(self, raw: memoryview) -> Any:
        return bytes(raw)


class _Strings(_Bytes):
    """A string column's values (see :class:`_Bytes`), UTF-8."""

    def _value(self, raw: memoryview) -> Any:
        return str(raw, "utf-8")


@dataclass(frozen=True)
class _Pickled:
    """Any other values (strings, bytes, structs' dicts, ...): each row's pickle, one after
    another, and where each ends."""

    blob: np.ndarray
    ends: np.ndarray

    def row(self, i: int) -> Any:
        return pickle.loads(self.blob[_start(self.ends, i) : self.ends[i]].data)

    def rows(self, a: int, b: int) -> np.ndarray:
        return _objects([self.row(i) for i in range(a, b)])


_KINDS: dict[str, Any] = {
    "values": _Values,
    "nullable": _Nullable,
    "ragged": _Ragged,
    "bytes": _Bytes,
    "strings": _Strings,
    "pickled": _Pickled,
}
# pyarrow's string and binary types: kept as their bytes (with offsets of this width)
_TEXT: dict[str, tuple[str, np.dtype[Any]]] = {
    "string": ("strings", np.dtype(np.int32)),
    "large_string": ("strings", np.dtype(np.int64)),
    "binary": ("bytes", np.dtype(np.int32)),
    "large_binary": ("bytes", np.dtype(np.int64)),
}


@dataclass(frozen=True)
class _RowGroup:
    columns: dict[str, _Column]
    nbytes: int


@dataclass(frozen=True, eq=False)
class Parquet(Source):
    """Many samples in each parquet file, read in place (see the module docstring and
    :class:`Source` for ``where``, ``pattern``, ``manifest_path`` and ``reuse_listing``).

    row_key: each run of rows sharing a value of this column is one sample
        (``{column: array}``), e.g. the pulses of one ``event_id``; by default a row is one.
    columns: read only these columns (a row holds them alone; the bytes of the others are not
        fetched).
    chunks: how row groups are read whole and kept in memory (a :class:`fastload.ChunkConfig`;
        default :meth:`ChunkConfig.from_env`).

    ``on_error="skip"`` also leaves out a file that cannot be indexed, naming it.
    """

    _: KW_ONLY
    row_key: str | None = None
    columns: Sequence[str] | None = None
    chunks: ChunkConfig | None = None

    name = "parquet"

    def __post_init__(self) -> None:
        super().__post_init__()
        _chosen(self.columns)
        if self.row_key is not None and not isinstance(self.row_key, str):
            raise ConfigError(f"row_key must be a column name, got {self.row_key!r}")
        check_chunks(self.chunks)

    def open(self, manifest: Manifest, opening: Opening) -> ParquetShards:
        return ParquetShards(
            manifest,
            opening.fetcher,
            row_key=self.row_key,
            columns=self.columns,
            cache=opening.cache,
            config=self.chunks,
            on_error=opening.on_error,
        )


class ParquetShards(Shards):
    """The rows of the ``.parquet`` objects of a manifest (see the module docstring)."""

    suffixes = (".parquet", ".parq", ".pq")
    kind = "parquet"

    def __init__(
        self,
        manifest: Manifest,
        fetcher: Fetcher,
        *,
        row_key: str | None = None,
        columns: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        _parquet()  # the extra is missing: say so now, not at the first read
        self.row_key = row_key
        self.columns = _chosen(columns)
        self.index_version = INDEX_VERSION + ("" if row_key is None else f"|runs of {row_key}")
        # by shard (its position in ``shards``): a file left out has none, and moves no other's
        self._footers: dict[int, bytes] = {}
        self._groups: list[list[int]] = []  # per chunk: its row groups
        self._rows_before: list[int] = []  # per chunk: rows of its shard before it
        self._runs: list[tuple[int, int]] = []  # with row_key, per sample: its rows in its chunk
        self._run_keys: list[str] = []
        self._left_out: set[tuple[str, str]] = set()  # (file, row_key value) cut in two
        super().__init__(manifest, fetcher, **kwargs)

    def _index(self, shard: Entry, fetcher: Fetcher) -> dict[str, np.ndarray]:
        footer = _footer(shard, fetcher)
        index: dict[str, np.ndarray] = {"footer": np.frombuffer(footer, dtype=np.uint8)}
        if self.row_key is not None:
            keys = self._key_column(shard, self._parsed(shard, footer), fetcher)
            starts = np.flatnonzero(keys[1:] != keys[:-1]) + 1 if len(keys) else keys[:0]
            starts = np.concatenate([[0], starts]).astype(np.int64) if len(keys) else starts
            names = Strings.of([str(k) for k in keys[starts]])
            _check_sorted(shard, self.row_key, names.tolist(), starts)
            index.update(runs=starts, key_blob=names.blob, key_ends=names.ends)
        return index

    def _parsed(self, shard: Entry, footer: bytes) -> Any:
        try:
            return self._metadata(footer)
        except Exception as exc:  # pyarrow's own errors
            reason = f"{type(exc).__name__}: {exc}"[:300]
            raise ShardError(f"corrupt parquet footer ({reason})", url=shard.url) from exc

    def _key_column(self, shard: Entry, meta: Any, fetcher: Fetcher) -> np.ndarray:
        """The ``row_key`` column of the whole file: its column chunks only, read at once."""
        groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
        paths = (
            [groups[0].column(c).path_in_schema for c in range(groups[0].num_columns)]
            if groups
            else []
        )
        if self.row_key not in paths:
            raise ShardError(
                f"row_key {self.row_key!r} is not a column (columns: {paths})", url=shard.url
            )
        c = paths.index(self.row_key)
        ranges = [_column_range(group.column(c)) for group in groups]
        requests = [shard.request(a, b) for a, b in ranges]
        bodies = fetcher.fetch(requests)
        parts = {a: body for (a, _), body in zip(ranges, bodies, strict=True)}
        file = _parquet().ParquetFile(_Sparse(shard.size, parts), metadata=meta, pre_buffer=False)
        columns = [
            file.read_row_group(g, columns=[self.row_key]).column(0) for g in range(len(groups))
        ]
        nulls = sum(column.null_count for column in columns)
        if nulls:
            raise ShardError(
                f"row_key {self.row_key!r} is null in {nulls} rows: a row without a key belongs "
                "to no sample",
                url=shard.url,
            )
        return np.concatenate([_numpy(c) for c in columns]) if columns else np.zeros(0)

    @property
    def reader_version(self) -> str:
        """The index's version, and the columns read: a row of other columns is another
        sample to the cache."""
        chosen = "" if self.columns is None else f"|columns {list(self.columns)}"
        return self.index_version + chosen

    def _check_across(self, indexes: list[tuple[Entry, dict[str, np.ndarray]]]) -> None:
        """Files whose columns are not most files' (see :meth:`_unlike`), then ``row_key`` runs
        cut between two files (see :meth:`_cut`)."""
        self._metas: dict[str, Any] = {}  # each file's parsed footer, or why it is not one
        for entry, index in indexes:
            try:
                self._metas[entry.url] = self._parsed(entry, index["footer"].tobytes())
            except ShardError as exc:  # ``_add`` names it
                self._metas[entry.url] = exc
        self._unlike([e for e, _ in indexes if not isinstance(self._metas[e.url], ShardError)])
        self._cut([(e, index) for e, index in indexes if self._metas[e.url] is not None])

    def _unlike(self, files: list[Entry]) -> None:
        """A file whose columns (those read) or their types are not most files' is an error
        naming the difference, never rows of which a batch from both would lose a column or
        mix its types (pyarrow and pandas refuse to read such files as one table too); with
        ``on_error="skip"`` it is left out (its footer None), named. Types alike in value are
        one: dictionary-encoded or not, large or not (polars writes large strings and lists).
        A file without rows adds nothing to a batch (pandas writes an empty frame's text
        columns as type null): it is not judged."""
        metas = {entry.url: self._metas[entry.url] for entry in files}
        found = {url: _columns(meta, self.columns) for url, meta in metas.items() if meta.num_rows}
        kinds = Counter(tuple(sorted(columns.items())) for columns in found.values())
        if len(kinds) < 2:
            return
        most, count = kinds.most_common(1)[0]
        common = dict(most)
        like = next(url for url, columns in found.items() if columns == common)
        for entry in files:
            if found.get(entry.url, common) != common:
                self._metas[entry.url] = None
                self._bad(
                    entry,
                    f"its columns are not those of {count} of the {len(found)} files (as "
                    f"{like}): {_difference(found[entry.url], common)}; a batch of rows from "
                    "both would lose a column or mix its types: read the columns they share "
                    "alike (columns=[...]) or rewrite the file",
                )

    def _cut(self, indexes: list[tuple[Entry, dict[str, np.ndarray]]]) -> None:
        """A ``row_key`` run that ends one file and starts another is one sample cut in two (a
        writer that starts a new file every N rows, as ``pyarrow.dataset.write_dataset(
        max_rows_per_file=...)`` does, cuts events): an error naming both files, never two half
        samples; with ``on_error="skip"`` both halves are left out, named. A value found
        elsewhere in two files is two samples (event numbers that restart in each file)."""
        if self.row_key is None:
            return
        ends = []  # (entry, first key, last key) of each file with rows
        for entry, index in indexes:
            keys = Strings(index["key_blob"], index["key_ends"])
            if len(keys):
                ends.append((entry, keys[0], keys[len(keys) - 1]))
        starting: dict[str, list[Entry]] = {}
        for entry, first, _ in ends:
            starting.setdefault(first, []).append(entry)
        for entry, _, last in ends:
            for other in starting.get(last, []):
                if other is not entry:
                    self._bad(
                        other,
                        f"{self.row_key}={last} ends {entry.url} and starts this file: one "
                        f"sample cut in two (write each {self.row_key}'s rows to one file)",
                    )
                    self._left_out.update({(entry.url, last), (other.url, last)})

    def _add(self, shard: int, entry: Entry, index: dict[str, np.ndarray]) -> None:
        footer = index["footer"].tobytes()
        meta = self._metas.pop(entry.url)
        if meta is None:  # its columns are not the others': ``_unlike`` named it
            return
        if isinstance(meta, ShardError):
            self._bad(entry, str(meta), meta)
            return
        names = meta.schema.to_arrow_schema().names
        missing = [c for c in self.columns or () if c not in names]
        if missing:
            self._bad(entry, f"no column {missing[0]!r} to read (columns: {names})")
            return
        self._footers[shard] = footer
        runs = index.get("runs")
        keys = None if runs is None else Strings(index["key_blob"], index["key_ends"]).tolist()
        starts = set() if runs is None else set(runs.tolist())
        groups: list[int] = []
        first = rows = 0  # the chunk's first row, and rows so far in this shard
        for g in range(meta.num_row_groups):
            count = meta.row_group(g).num_rows
            if count == 0:
                continue
            groups.append(g)
            rows += count
            if g + 1 < meta.num_row_groups and runs is not None and rows not in starts:
                continue  # a run goes on into the next row group: one chunk holds both
            self._group_chunk(shard, meta, groups, first=first, stop=rows, runs=runs, keys=keys)
            groups, first = [], rows

    def _group_chunk(
        self,
        shard: int,
        meta: Any,
        groups: list[int],
        *,
        first: int,
        stop: int,
        runs: np.ndarray | None,
        keys: list[str] | None,
    ) -> None:
        """One chunk: the row groups ``groups`` (rows ``first`` to ``stop`` of the shard),
        unless every run in it is left out."""
        kept: list[tuple[tuple[int, int], str]] = []
        if runs is not None and keys is not None:
            lo, hi = np.searchsorted(runs, [first, stop])
            ends = np.append(runs[1:], stop)
            kept = [
                ((int(runs[r]) - first, int(ends[r]) - first), keys[r])
                for r in range(int(lo), int(hi))
                if (self.shards[shard].url, keys[r]) not in self._left_out
            ]
            if not kept:
                return
        spans = _spans([meta.row_group(g) for g in groups], self.columns)
        label = f"row group {groups[0]}" + (f"-{groups[-1]}" if len(groups) > 1 else "")
        apart = tuple(spans) if len(spans) > 1 else ()
        self._chunk(shard, self._count, spans[0][0], spans[-1][1], label, spans=apart)
        self._groups.append(groups)
        self._rows_before.append(first)
        if runs is None:
            self._count += stop - first
            return
        for rows, key in kept:
            self._runs.append(rows)
            self._run_keys.append(key)
        self._count += len(kept)

    def _metadata(self, footer: bytes) -> Any:
        """The file's metadata from its footer alone (behind a magic, as if the file were empty:
        the metadata's offsets are not checked when it is parsed)."""
        return _parquet().read_metadata(io.BytesIO(_MAGIC + footer))

    def _name(self, index: int) -> str:
        if self.row_key is not None:
            return f"{self.row_key}={self._run_keys[index]}"
        c = self._chunk_of(index)
        return f"row={index - self._firsts[c] + self._rows_before[c]}"

    def _load(self, chunk: Chunk, body: bytes | memoryview) -> _RowGroup:
        """The chunk's row groups decoded, from its bytes, into this process's own memory:
        each column as numpy values (see :func:`_numpy`)."""
        table = self._table(chunk, body)
        columns: dict[str, _Column] = {
            name: _Values(_converted(chunk, table, name, _numpy)) for name in table.column_names
        }
        loaded = _RowGroup(columns, int(table.nbytes))
        del table  # what decoding allocated, given back: pyarrow's pool keeps it else
        _arrow().default_memory_pool().release_unused()
        return loaded

    def _table(self, chunk: Chunk, body: bytes | memoryview) -> Any:
        """The chunk's row groups as a pyarrow table, from its bytes."""
        meta = self._metadata(self._footers[self._chunk_shard[chunk.index]])
        parts, at = {}, 0  # views of the chunk's bytes (a worker's map its scratch file): no copy
        for a, b in chunk.ranges:
            parts[a] = body[at : at + b - a]
            at += b - a
        file = _parquet().ParquetFile(_Sparse(chunk.size, parts), metadata=meta)
        chosen = None if self.columns is None else list(self.columns)
        return file.read_row_groups(self._groups[chunk.index], columns=chosen, use_threads=False)

    def _weigh(self, loaded: Any) -> int:
        return int(loaded.nbytes)

    def _decoded(self) -> Decoded:
        """Row groups are shared decoded (see the module docstring)."""
        return Decoded(self._encode, _open)

    def _encode(self, chunk: Chunk, body: bytes | memoryview) -> Parts:
        """The chunk decoded, as its scratch file holds it: after a header (``_STORED``, then
        the length and JSON of each column's kind and arrays: dtype, start, length), each
        column's arrays (see :func:`_stored`), each at a multiple of ``_ALIGN`` bytes after it.
        A string or binary column's bytes are pyarrow's own, not copied before the write."""
        described: list[dict[str, Any]] = []
        arrays: list[bytes | memoryview] = []
        at = 0
        table = self._table(chunk, body)
        for name in table.column_names:
            kind, parts = _converted(chunk, table, name, _stored)
            spans = []
            for part in parts:
                pad = bytes(-part.nbytes % _ALIGN)
                spans.append((part.dtype.str, at, len(part)))
                arrays += [part.view(np.uint8).data, pad]
                at += part.nbytes + len(pad)
            described.append({"name": name, "kind": kind, "arrays": spans})
        del table  # its buffers live on in ``arrays`` until written
        _arrow().default_memory_pool().release_unused()  # what decoding freed: pyarrow keeps it
        header = json.dumps(described).encode()
        pad = bytes(-(len(_STORED) + 8 + len(header)) % _ALIGN)
        return [_STORED, len(header).to_bytes(8, "little"), header, pad, *arrays]

    def _payload(self, index: int, chunk: int, loaded: Any) -> dict[str, Any]:
        """The sample's values, its own arrays: views of the chunk (read-only, which
        ``torch.from_numpy`` shares with a warning) would let a transform that changes its input
        in place change what the next read of the chunk in memory gives."""
        if self.row_key is not None:
            a, b = self._runs[index]
            return {name: column.rows(a, b) for name, column in loaded.columns.items()}
        row = index - self._firsts[chunk]
        return {name: column.row(row) for name, column in loaded.columns.items()}


def _converted(chunk: Chunk, table: Any, name: str, convert: Callable[[Any], _T]) -> _T:
    """``convert`` of the column ``name`` of a chunk's ``table``, or a ShardError naming the
    column, the chunk and its file (pyarrow cannot give some values as Python's: a nanosecond
    time in a struct...)."""
    try:
        return convert(table.column(name))
    except Exception as exc:  # pyarrow's own errors
        reason = f"{type(exc).__name__}: {exc}"[:300]
        raise ShardError(
            f"cannot read column {name!r} of {chunk.label} ({reason})", url=chunk.url
        ) from exc


def _open(chunk: Chunk, view: memoryview) -> _RowGroup:
    """A chunk decoded by :meth:`ParquetShards._encode`, from a mapping of its file: its
    columns' arrays are views of that mapping (no copy)."""
    head = len(_STORED) + 8
    if view[: len(_STORED)] != _STORED:
        raise ShardError(f"{chunk.label} in the scratch folder is not a decoded row group")
    length = int.from_bytes(view[len(_STORED) : head], "little")
    base = head + length + (-(head + length) % _ALIGN)
    columns: dict[str, _Column] = {}
    for column in json.loads(view[head : head + length].tobytes()):
        arrays = [
            np.frombuffer(view, np.dtype(dtype), count=count, offset=base + start)
            for dtype, start, count in column["arrays"]
        ]
        columns[column["name"]] = _KINDS[column["kind"]](*arrays)
    return _RowGroup(columns, len(view))


def _stored(column: Any) -> tuple[str, list[np.ndarray]]:
    """A pyarrow column as one of the kinds of ``_KINDS`` and its arrays, from which each
    row's value comes back as :func:`_numpy` gives it (its type too)."""
    types = _arrow().types
    if types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if _TEXT.get(str(column.type)) is not None:
        return _text(column)
    return _kept_as(_numpy(column))


def _text(column: Any) -> tuple[str, list[np.ndarray]]:
    """A string or binary column as its bytes (pyarrow's, not copied), where each row ends,
    and where the nulls are."""
    kind, width = _TEXT[str(column.type)]
    whole = column.chunks[0] if column.num_chunks == 1 else column.combine_chunks()
    nulls = whole.is_null().to_numpy(zero_copy_only=False)
    if not len(whole):
        return kind, [np.zeros(0, np.uint8), np.zeros(0, np.int64), nulls]
    _, offsets, data = whole.buffers()
    ends = np.frombuffer(offsets, width, count=len(whole) + 1, offset=whole.offset * width.itemsize)
    first, last = int(ends[0]), int(ends[-1])
    text = np.zeros(0, np.uint8) if data is None else np.frombuffer(data, np.uint8)[first:last]
    return kind, [text, (ends[1:] - first).astype(np.int64), nulls]


def _kept_as(values: np.ndarray) -> tuple[str, list[np.ndarray]]:
    """A column's numpy values (:func:`_numpy`) as one of the kinds of ``_KINDS`` and its
    arrays, from which each row's value comes back as it was (its type too)."""
    if values.dtype != object:
        return "values", [np.ascontiguousarray(values)]
    nulls = np.array([value is None for value in values], dtype=bool)
    present = [value for value in values if value is not None]
    kinds = {type(value) for value in present}
    kind = next(iter(kinds)) if len(kinds) == 1 else None
    # numbers whose numpy type an array of them gives back
    if kind is not None and issubclass(kind, np.number | np.bool_) and np.dtype(kind).type is kind:
        numbers = np.zeros(len(values), dtype=kind)
        numbers[~nulls] = present
        return "nullable", [numbers, nulls]
    if kind is np.ndarray:
        dtypes = {(value.dtype, value.ndim) for value in present}
        (dtype, ndim), *others = dtypes
        if not others and ndim == 1 and not dtype.hasobject:
            lengths = np.array([0 if value is None else len(value) for value in values])
            items = np.concatenate(present) if present else np.zeros(0, dtype)
            return "ragged", [items, np.cumsum(lengths, dtype=np.int64), nulls]
    pickles = [pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) for value in values]
    ends = np.cumsum([len(p) for p in pickles], dtype=np.int64)
    return "pickled", [np.frombuffer(b"".join(pickles), dtype=np.uint8), ends]


def _start(ends: np.ndarray, i: int) -> int:
    """Where row ``i`` starts, of rows that end at ``ends``."""
    return int(ends[i - 1]) if i else 0


def _objects(values: list[Any]) -> np.ndarray:
    """``values`` as a 1-d object array (arrays among them stay items, not a dimension)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _own(value: Any) -> Any:
    """``value`` as a copy of its own (the arrays, dicts and lists in it too): one it shared
    with the chunk in memory would be read-only (pyarrow's) or, changed in place by a
    transform, change what the next read of the chunk gives."""
    if isinstance(value, np.ndarray) and value.dtype != object:
        return value.copy()
    if isinstance(value, np.ndarray | dict | list):
        return copy.deepcopy(value)
    return value


def _check_sorted(shard: Entry, row_key: str, keys: list[str], starts: np.ndarray) -> None:
    """Each key's rows must be one run: a key that comes back later would be two samples."""
    first: dict[str, int] = {}
    for key, start in zip(keys, starts.tolist(), strict=True):
        if key in first:
            raise ShardError(
                f"{row_key}={key} has rows at {first[key]} and again at {start}, apart: sort the "
                f"file by {row_key} (each value's rows must be adjacent)",
                url=shard.url,
            )
        first[key] = start


def _numpy(column: Any) -> np.ndarray:
    """A pyarrow column (or array) as numpy, each null a null and every value exact.

    pyarrow's own ``to_numpy`` gives a dictionary-encoded null another row's value, and turns
    integers into float64 wherever a null sits among them (a column, the items of a list
    column, those behind a null fixed-size list, a field of a struct), so an id above 2**53
    changes. Here a dictionary column is decoded first; an integer column with nulls is an
    object array of its numpy integers and None; a list column pyarrow would not keep exact has
    for each row a 1-d array of its items as this function gives them (a list column with
    integer nulls inside: object arrays of numpy integers and None; a nested list: arrays of
    arrays), None for a null list; a struct or map column is its rows' Python values.
    """
    arrow = _arrow()
    whole = column.combine_chunks() if isinstance(column, arrow.ChunkedArray) else column
    if isinstance(whole, arrow.ExtensionArray):  # a tensor, a uuid...: as what stores it
        whole = whole.storage
    types = arrow.types
    if types.is_dictionary(whole.type):
        whole = whole.cast(whole.type.value_type)
    kind = whole.type
    if _exact(types, kind, whole):
        return whole.to_numpy(zero_copy_only=False)  # type: ignore[no-any-return]
    if types.is_integer(kind):
        values = np.array(list(whole.fill_null(0).to_numpy()), dtype=object)
        values[whole.is_null().to_numpy(zero_copy_only=False)] = None
        return values
    if _is_list(types, kind):
        return _lists(whole)
    return _objects(whole.to_pylist())


def _lists(whole: Any) -> np.ndarray:
    """A list array's rows (see :func:`_numpy`): slices of its items (those of its lists that
    are not null, one after another), each row's as long as its list; None for a null list."""
    items = _numpy(whole.flatten())
    compute = import_extra("pyarrow.compute", extra="parquet", feature="fastload.Parquet")
    lengths = compute.list_value_length(whole).fill_null(0).to_numpy()
    ends = np.cumsum(lengths, dtype=np.int64).tolist()
    nulls = whole.is_null().to_numpy(zero_copy_only=False).tolist()
    return _objects(
        [
            None if null else items[end - length : end]
            for null, length, end in zip(nulls, lengths.tolist(), ends, strict=True)
        ]
    )


def _exact(types: Any, kind: Any, values: Any) -> bool:
    """Whether pyarrow's ``to_numpy`` keeps every value of ``values`` (of type ``kind``)."""
    if types.is_integer(kind):
        return bool(values.null_count == 0)
    if _is_list(types, kind):  # its conversion takes all the items, those behind a null too
        return _exact(types, kind.value_type, values.values)
    return not (
        types.is_struct(kind)
        or types.is_map(kind)
        or types.is_union(kind)
        or types.is_dictionary(kind)
    )


def _is_list(types: Any, kind: Any) -> bool:
    return any(getattr(types, name, _never)(kind) for name in _LISTS)


_LISTS = ("is_list", "is_large_list", "is_fixed_size_list", "is_list_view", "is_large_list_view")


def _never(_: Any) -> bool:  # a type test this pyarrow lacks (list views came in pyarrow 16)
    return False


def _parquet() -> Any:
    return import_extra("pyarrow.parquet", extra="parquet", feature="fastload.Parquet")


def _arrow() -> Any:
    return import_extra("pyarrow", extra="parquet", feature="fastload.Parquet")


def _footer(shard: Entry, fetcher: Fetcher) -> bytes:
    """The footer (metadata, its length, ``PAR1``) by one suffix read, or two when it is large."""
    if shard.size < 12:
        raise ShardError(f"not parquet: {shard.size} bytes is too short", url=shard.url)
    first = max(0, shard.size - _TAIL)
    (tail,) = fetcher.fetch([shard.request(first, shard.size)])
    if tail[-4:] != _MAGIC:
        raise ShardError("not parquet: the file does not end with PAR1", url=shard.url)
    length = int.from_bytes(tail[-8:-4], "little") + 8
    if length > shard.size - 4:
        raise ShardError(f"corrupt parquet footer (it claims {length} bytes)", url=shard.url)
    if length > len(tail):
        start = shard.size - length
        (tail,) = fetcher.fetch([shard.request(start, shard.size)])
    return bytes(tail[-length:])


def _spans(groups: list[Any], columns: tuple[str, ...] | None) -> list[tuple[int, int]]:
    """The bytes of row groups' ``columns`` (all when None), in order: their column chunks'
    ranges, joined where less than ``_SPAN_GAP`` lies between (a nested column's chunks are
    named ``column.field...``)."""
    chunks = [group.column(c) for group in groups for c in range(group.num_columns)]
    if columns is not None:
        chunks = [
            chunk
            for chunk in chunks
            if any(
                chunk.path_in_schema.startswith(f"{c}.") or chunk.path_in_schema == c
                for c in columns
            )
        ]
    spans: list[tuple[int, int]] = []
    for a, b in sorted(_column_range(chunk) for chunk in chunks):
        if spans and a - spans[-1][1] < _SPAN_GAP:
            spans[-1] = (spans[-1][0], max(b, spans[-1][1]))
        else:
            spans.append((a, b))
    return spans


def _chosen(columns: Sequence[str] | None) -> tuple[str, ...] | None:
    """``columns`` as a tuple of distinct names, or a ConfigError."""
    if columns is None:
        return None
    chosen = (columns,) if isinstance(columns, str) else tuple(columns)
    if not chosen or not all(isinstance(c, str) and c for c in chosen):
        raise ConfigError(f"columns must be a non-empty list of column names, got {columns!r}")
    if len(set(chosen)) < len(chosen):
        raise ConfigError(f"columns names a column twice: {columns!r}")
    return chosen


def _columns(meta: Any, chosen: tuple[str, ...] | None) -> dict[str, str]:
    """The type of each column read (all when ``chosen`` is None) of a file, by name."""
    types = import_extra("pyarrow", extra="parquet", feature="fastload.Parquet").types
    return {
        field.name: _kind(types, field.type)
        for field in meta.schema.to_arrow_schema()
        if chosen is None or field.name in chosen
    }


_ALIKE = {  # types whose values are another's
    "large_string": "string",
    "string_view": "string",
    "large_binary": "binary",
    "binary_view": "binary",
}


def _kind(types: Any, kind: Any) -> str:
    """A pyarrow type as the values it gives: a dictionary's as its values', a large string
    or list as a string or list, a list's or struct's by its items' (not their field names)."""
    if types.is_dictionary(kind):
        return _kind(types, kind.value_type)
    if types.is_fixed_size_list(kind):
        return f"list<{_kind(types, kind.value_type)}>[{kind.list_size}]"
    if _is_list(types, kind):
        return f"list<{_kind(types, kind.value_type)}>"
    if types.is_struct(kind):
        fields = sorted(f"{f.name}: {_kind(types, f.type)}" for f in kind)
        return f"struct<{', '.join(fields)}>"
    if types.is_map(kind):
        return f"map<{_kind(types, kind.key_type)}, {_kind(types, kind.item_type)}>"
    return _ALIKE.get(str(kind), str(kind))


def _difference(mine: dict[str, str], common: dict[str, str]) -> str:
    """How a file's columns differ from the others' (the first three ways)."""
    ways = [f"no column {name!r}" for name in common if name not in mine]
    ways += [f"a column {name!r} they lack" for name in mine if name not in common]
    ways += [
        f"{name!r} is {kind} here, {common[name]} there"
        for name, kind in mine.items()
        if common.get(name, kind) != kind
    ]
    return ", ".join(ways[:3]) + (f" and {len(ways) - 3} more" if len(ways) > 3 else "")


def _column_range(column: Any) -> tuple[int, int]:
    """A column chunk's bytes: from its first page (a dictionary page, when there is one)."""
    start = column.data_page_offset
    if column.has_dictionary_page and 0 < column.dictionary_page_offset < start:
        start = column.dictionary_page_offset
    return start, start + column.total_compressed_size


class _Sparse(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only some ranges are known (the footer, a
    row group): what pyarrow reads a row group from. Reading elsewhere is an error, not zeros."""

    def __init__(self, size: int, parts: dict[int, bytes | memoryview]) -> None:
        self.size, self.parts, self.position = size, parts, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = {0: 0, 1: self.position, 2: self.size}[whence] + offset
        return self.position

    def read(self, n: int = -1) -> bytes | memoryview:
        n = self.size - self.position if n is None or n < 0 else min(n, self.size - self.position)
        for start, body in self.parts.items():
            if start <= self.position and self.position + n <= start + len(body):
                at = self.position - start
                self.position += n
                return body[at : at + n]
        raise ShardError(f"bytes {self.position}-{self.position + n} were not read")

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)
