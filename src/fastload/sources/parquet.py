"""Many samples in one parquet file, read in place: one sample per row.

``decode`` receives a row as ``{column: value}`` (numbers as numpy scalars, list columns as
numpy arrays, strings as str); with ``decode=None`` the row is the sample. Indexing a file reads
only its footer (one suffix read, two for a large footer), kept in the dataset's cache by the
file's version. A row group is one chunk: the batches that shard-aware shuffling draws from it
cost one ranged read of the row group, decoded once per process. Needs ``fastload[parquet]``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastload._extras import import_extra
from fastload.errors import ShardError
from fastload.fetch import Fetcher, Request
from fastload.manifest import Entry
from fastload.sources._chunks import Chunk
from fastload.sources._shards import Shards

__all__ = ["ParquetShards"]

INDEX_VERSION = "parquet-index/1"
_MAGIC = b"PAR1"
_TAIL = 64 << 10  # the first suffix read: most footers fit


@dataclass(frozen=True)
class _RowGroup:
    columns: dict[str, np.ndarray]
    nbytes: int


class ParquetShards(Shards):
    """The rows of the ``.parquet`` objects of a manifest (see the module docstring)."""

    suffixes = (".parquet", ".parq", ".pq")
    kind = "parquet"
    index_version = INDEX_VERSION

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._pq: Any = import_extra("pyarrow.parquet", extra="parquet", feature="shards='parquet'")
        self._footers: list[bytes] = []  # per shard
        self._groups: list[int] = []  # per chunk: its row group in its shard
        self._rows_before: list[int] = []  # per chunk: rows before its row group in its shard
        super().__init__(*args, **kwargs)

    def _index(self, shard: Entry, fetcher: Fetcher) -> dict[str, np.ndarray]:
        return {"footer": np.frombuffer(_footer(shard, fetcher), dtype=np.uint8)}

    def _add(self, shard: int, entry: Entry, index: dict[str, np.ndarray]) -> None:
        footer = index["footer"].tobytes()
        try:
            meta = self._metadata(footer)
        except Exception as exc:  # pyarrow's own errors
            self._bad(entry, f"corrupt parquet footer ({type(exc).__name__}: {exc})"[:300], exc)
            return
        self._footers.append(footer)
        rows = 0
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            if group.num_rows == 0:
                continue
            start, end = _byte_range(group)
            self._groups.append(g)
            self._rows_before.append(rows)
            rows += group.num_rows
            self._chunk(shard, self._count, start, end, f"row group {g}")
            self._count += group.num_rows

    def _metadata(self, footer: bytes) -> Any:
        """The file's metadata from its footer alone (behind a magic, as if the file were empty:
        the metadata's offsets are not checked when it is parsed)."""
        return self._pq.read_metadata(io.BytesIO(_MAGIC + footer))

    def _name(self, index: int) -> str:
        c = int(self._chunk_of([index])[0])
        return f"row={index - self._firsts[c] + self._rows_before[c]}"

    def _load(self, chunk: Chunk, body: bytes) -> _RowGroup:
        meta = self._metadata(self._footers[self._chunk_shard[chunk.index]])
        file = self._pq.ParquetFile(_Sparse(chunk.size, {chunk.start: body}), metadata=meta)
        table = file.read_row_group(self._groups[chunk.index])
        columns = {
            name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names
        }
        return _RowGroup(columns, int(table.nbytes))

    def _weigh(self, loaded: Any) -> int:
        return int(loaded.nbytes)

    def _payload(self, index: int, chunk: int, loaded: Any) -> dict[str, Any]:
        row = index - self._firsts[chunk]
        return {name: values[row] for name, values in loaded.columns.items()}


def _footer(shard: Entry, fetcher: Fetcher) -> bytes:
    """The footer (metadata, its length, ``PAR1``) by one suffix read, or two when it is large."""
    if shard.size < 12:
        raise ShardError(f"not parquet: {shard.size} bytes is too short", url=shard.url)
    first = max(0, shard.size - _TAIL)
    (tail,) = fetcher.fetch([Request(shard.url, first, shard.size, size=shard.size)])
    if tail[-4:] != _MAGIC:
        raise ShardError("not parquet: the file does not end with PAR1", url=shard.url)
    length = int.from_bytes(tail[-8:-4], "little") + 8
    if length > shard.size - 4:
        raise ShardError(f"corrupt parquet footer (it claims {length} bytes)", url=shard.url)
    if length > len(tail):
        start = shard.size - length
        (tail,) = fetcher.fetch([Request(shard.url, start, shard.size, size=shard.size)])
    return bytes(tail[-length:])


def _byte_range(group: Any) -> tuple[int, int]:
    """The bytes of a row group: from its first page (a dictionary page, when there is one) to
    the end of its last column chunk."""
    starts, ends = [], []
    for c in range(group.num_columns):
        column = group.column(c)
        start = column.data_page_offset
        if column.has_dictionary_page and 0 < column.dictionary_page_offset < start:
            start = column.dictionary_page_offset
        starts.append(start)
        ends.append(start + column.total_compressed_size)
    return min(starts), max(ends)


class _Sparse(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only some ranges are known (the footer, a
    row group): what pyarrow reads a row group from. Reading elsewhere is an error, not zeros."""

    def __init__(self, size: int, parts: dict[int, bytes]) -> None:
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

    def read(self, n: int = -1) -> bytes:
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
