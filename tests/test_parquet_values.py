"""Parquet rows come back as pyarrow reads them, value for value and null for null, in every
shape a list column takes (its rows all one length or not, fixed-size, nested, of strings, of
floats with NaN beside nulls, null lists), read in place and from the row groups DataLoader
workers share decoded; a value pyarrow cannot give is a ShardError naming its column."""

from __future__ import annotations

import importlib.util
import uuid
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import fastload
from fastload import Parquet, RemoteDataset, ShardError
from fastload.testing import FakeGcsServer, S3Server
from tests.conftest import BUCKET, write
from tests.test_chunk_memory import same
from tests.test_shards import parquet

BIG = 2**53 + 1  # a float64 rounds it: an id that comes back as 2**53 is another id
NAN = float("nan")


def list_shapes() -> pa.Table:
    """Four rows in two row groups: rows 0-1, then 2-3 (in most columns one group's lists are
    all one length, the other's not)."""
    ints, floats = pa.int64(), pa.float64()
    return pa.table(
        {
            "equal": pa.array([[1, None], [3, 4], [None, 2], [3, None]], pa.list_(ints)),
            "ragged": pa.array([[BIG, None], [3, 4], [None, 2], [BIG]], pa.list_(ints)),
            "ones": pa.array([[None], [BIG], [1], [2]], pa.list_(ints)),
            "null_lists": pa.array([[BIG, 2], None, [3, None], None], pa.list_(ints)),
            "large": pa.array([[BIG, None], [3, 4], None, [5]], pa.large_list(ints)),
            "fixed": pa.array([[BIG, None], [3, 4], [BIG, 2], None], pa.list_(ints, 2)),
            "fixed_null_list": pa.array([[BIG, 2], None, [3, 4], [5, 6]], pa.list_(ints, 2)),
            "nested": pa.array(
                [[[BIG, None], [3, 4]], [[5, 6], [7, 8]], [[1], None], [[2, None, 3]]],
                pa.list_(pa.list_(ints)),
            ),
            "nested_exact": pa.array(
                [[[BIG, 2], [3, 4]], [[5, 6], [7, 8]], [[1], None], [[2, 3]]],
                pa.list_(pa.list_(ints)),
            ),
            "strings": pa.array([["a", None], ["b", "c"], None, ["dé"]], pa.list_(pa.string())),
            "floats": pa.array([[1.0, None], [NAN, 4.0], None, [5.0, NAN, None]], pa.list_(floats)),
            "fixed_floats": pa.array(
                [[1.5, None], [NAN, 2.5], None, [3.0, 4.0]], pa.list_(pa.float32(), 2)
            ),
        }
    )


def expected(value: Any, kind: pa.DataType, objects: bool) -> Any:
    """What a row's ``value`` as pyarrow gives it (``to_pylist``) is in a sample: numpy scalars
    of the column's type, a null float NaN; a list an array of its items, of objects where a
    list holds lists or where integers sit among nulls in the row group (``objects``)."""
    numpy = np.dtype(kind.to_pandas_dtype()) if not pa.types.is_nested(kind) else None
    if pa.types.is_floating(kind):
        return numpy.type(NAN if value is None else value)  # type: ignore[union-attr]
    if value is None:
        return None
    if pa.types.is_integer(kind):
        return numpy.type(value)  # type: ignore[union-attr]
    if not pa.types.is_nested(kind):
        return value
    inner = kind.value_type
    items = [expected(v, inner, objects) for v in value]
    if pa.types.is_floating(inner):
        return np.array(items, dtype=inner.to_pandas_dtype())
    if pa.types.is_integer(inner) and not objects:
        return np.array(items, dtype=inner.to_pandas_dtype())
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def nulls_among_items(column: pa.ChunkedArray) -> bool:
    """Whether a list column's innermost items hold a null (its lists that are not null)."""
    items = column.combine_chunks()
    while pa.types.is_nested(items.type):
        items = items.flatten()
    return bool(items.null_count)


def shown(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{[shown(v) for v in value.tolist()]} ({value.dtype}, shape {value.shape})"
    return f"{value!r} ({type(value).__name__})"


def test_list_columns_in_every_shape_are_the_rows_pyarrow_reads(seaweed: S3Server) -> None:
    """Each row read in place is pyarrow's row, type for type: before, a fixed-size list of
    integers beside a null list came back as float64 (the id 2**53 + 1 as 2**53), and a nested
    list with a null among its integers as a 2-d array where its lists were all one length but
    an array of Python lists where not. And DataLoader workers, which take the rows from row
    groups decoded once into the scratch folder, give the same samples."""
    root = f"s3://{BUCKET}/parquet-values-{uuid.uuid4().hex[:8]}"
    table = list_shapes()
    options = seaweed.storage_options()
    write(root, options, {"part-0.parquet": parquet(table, row_group_size=2)})
    dataset = RemoteDataset(Parquet(root), storage_options=options)
    here = [dataset[i] for i in range(len(dataset))]
    assert len(here) == 4
    wrong = []
    for i, row in enumerate(here):
        group = table.slice(i - i % 2, 2)
        (theirs,) = table.slice(i, 1).to_pylist()
        for name in table.column_names:
            kind, column = table.schema.field(name).type, group.column(name)
            want = expected(theirs[name], kind, nulls_among_items(column))
            if not same(row[name], want):
                wrong.append(f"row {i} {name}: {shown(row[name])}, pyarrow: {shown(want)}")
    assert not wrong, "\n".join(wrong)

    loader = fastload.DataLoader(
        dataset, batch_size=3, shuffle=False, num_workers=2, collate_fn=list
    )
    there = [sample for batch in loader for sample in batch]
    assert len(there) == len(here)
    for i, (mine, theirs) in enumerate(zip(here, there, strict=True)):
        for name in table.column_names:
            assert same(mine[name], theirs[name]), (i, name, shown(mine[name]), shown(theirs[name]))


def bump(row: dict[str, Any]) -> dict[str, Any]:
    """A transform that changes its input in place (as one through ``torch.from_numpy`` does)."""
    row["pulses"][0][0] += 1.0
    row["origin"][0]["run"] += 1
    return row


def bump_row(row: dict[str, Any]) -> dict[str, Any]:
    row["pulses"][0] += 1.0
    row["origin"]["run"] += 1
    return row


def test_a_transform_that_changes_its_sample_in_place_changes_no_later_read(
    gcs: FakeGcsServer,
) -> None:
    """A sample's values are its own, down to the arrays and dicts in it: before, an event's
    list column was an array of the row group's own read-only arrays (a transform that added
    to one failed), and a struct was the row group's dict, so a transform that changed it
    changed what every later read of that row gave (DataLoader workers gave the first value)."""
    root = f"gs://{BUCKET}/parquet-own-{uuid.uuid4().hex[:8]}"
    table = pa.table(
        {
            "event_id": [1, 1, 2],
            "pulses": pa.array([[1.0, 2.0], [3.0], [4.0]]),
            "origin": pa.array([{"run": 10}, {"run": 20}, {"run": 30}]),
        }
    )
    options = gcs.storage_options()
    write(root, options, {"part-0.parquet": parquet(table)})
    events = RemoteDataset(
        Parquet(root, row_key="event_id"), transform=bump, storage_options=options
    )
    for _ in range(2):
        event = events[0]
        assert event["pulses"][0].tolist() == [2.0, 2.0]
        assert [origin["run"] for origin in event["origin"]] == [11, 20]
    rows = RemoteDataset(Parquet(root), transform=bump_row, storage_options=options)
    for _ in range(2):
        row = rows[0]
        assert row["pulses"].tolist() == [2.0, 2.0]
        assert row["origin"] == {"run": 11}


def test_a_value_pyarrow_cannot_give_is_an_error_naming_its_column(gcs: FakeGcsServer) -> None:
    """A struct holding a time of nanoseconds that are not whole microseconds: pyarrow cannot
    make it a Python time. The row group's samples fail with a ShardError that names the
    column, not only the row group, and the file."""
    if importlib.util.find_spec("pandas") is not None:
        pytest.skip("pyarrow gives such a time through pandas where pandas is installed")
    root = f"gs://{BUCKET}/parquet-column-{uuid.uuid4().hex[:8]}"
    times = pa.array([1_001, 2_000], pa.time64("ns"))
    table = pa.table({"n": [1, 2], "when": pa.StructArray.from_arrays([times], ["t"])})
    options = gcs.storage_options()
    write(root, options, {"part-0.parquet": parquet(table)})
    rows = RemoteDataset(Parquet(root), storage_options=options)
    with pytest.raises(ShardError, match=r"cannot read column 'when' of row group 0.*part-0"):
        rows[0]
