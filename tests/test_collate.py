"""The collate of loops without workers: the same batches as torch's default_collate."""

from __future__ import annotations

import io
import re
import uuid
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import default_collate

import fastload
from fastload import ConfigError, _collate
from fastload.testing import S3Server
from tests.conftest import BUCKET, write

Pair = namedtuple("Pair", ["x", "y"])
rng = np.random.default_rng(3)


def _images(dtype: Any, n: int = 4) -> list[np.ndarray]:
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    top = info.max if info else 1.0
    return [(rng.random((3, 5, 7)) * top).astype(dtype) for _ in range(n)]


CASES: dict[str, list[Any]] = {
    "uint16 images": _images(np.uint16),  # 16-bit: no value may be flattened
    "uint8 images": _images(np.uint8),
    "float32 arrays": _images(np.float32),
    "bool arrays": [rng.random(5) > 0.5 for _ in range(3)],
    "0-d arrays": [np.float64(i) * np.ones(()) for i in range(3)],
    "tensors": [torch.randn(2, 3) for _ in range(3)],
    "int64 tensors": [torch.arange(6) * i for i in range(3)],
    "(image, label)": [(a, i) for i, a in enumerate(_images(np.uint16))],
    "dicts": [{"image": a, "name": f"s{i}", "label": i} for i, a in enumerate(_images(np.uint8))],
    "nested": [
        {"pair": (a, torch.tensor(i)), "n": float(i)} for i, a in enumerate(_images(np.int16))
    ],
    "namedtuples": [Pair(a, i) for i, a in enumerate(_images(np.float32))],
    "bfloat16 tensors": [torch.randn(4).to(torch.bfloat16) for _ in range(3)],
    "non-contiguous tensors": [torch.randn(4, 6)[:, ::2] for _ in range(3)],
    "tensors that need grad": [torch.randn(3, requires_grad=True) for _ in range(2)],
    "strings": ["a", "b"],
    "mixed arrays and tensors": [np.zeros(3, np.float32), torch.zeros(3)],
    "ints": [1, 2, 3],
}


def _same(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert ours.requires_grad == theirs.requires_grad
        assert torch.equal(ours.detach(), theirs.detach())
    elif isinstance(theirs, dict):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            _same(ours[key], theirs[key])
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            _same(a, b)
    else:
        assert ours == theirs


@pytest.mark.parametrize("case", sorted(CASES))
def test_batches_are_the_same_as_torchs(case: str) -> None:
    _same(_collate.collate(CASES[case]), default_collate(CASES[case]))


def test_sixteen_bit_values_survive() -> None:
    batch = [np.full((2, 2), 65535 - i, np.uint16) for i in range(3)]
    out = _collate.collate(batch)
    assert out.dtype == torch.uint16
    assert out.numpy()[:, 0, 0].tolist() == [65535, 65534, 65533]


@pytest.mark.parametrize(
    "batch",
    [
        [np.zeros(3, ">f4"), np.zeros(3, ">f4")],  # big-endian: torch refuses it
        [np.array(["a"]), np.array(["b"])],  # strings
    ],
    ids=["big-endian", "strings"],
)
def test_what_torch_refuses_fails_with_torchs_error(batch: list[np.ndarray]) -> None:
    with pytest.raises(Exception) as theirs:
        default_collate(batch)
    with pytest.raises(type(theirs.value)) as ours:
        _collate.collate(batch)
    assert str(ours.value) == str(theirs.value)


def test_a_loader_without_workers_uses_it_and_one_with_workers_does_not() -> None:
    data = _images(np.uint16, 10)
    loader = fastload.DataLoader(data, batch_size=4, shuffle=False, num_workers=0)
    assert loader.collate_fn is _collate.collate
    for ours, theirs in zip(loader, TorchLoader(data, batch_size=4), strict=True):
        _same(ours, theirs)
    threaded = fastload.DataLoader(data, batch_size=4, num_workers=1)
    assert getattr(threaded.collate_fn, "collate", None) is default_collate
    mine = fastload.DataLoader(data, batch_size=4, num_workers=0, collate_fn=len)
    assert mine.collate_fn is len


@pytest.mark.parametrize("kind", ["arrays", "tensors"])
def test_rows_of_a_users_array_are_copied_so_a_step_cannot_change_the_data(kind: str) -> None:
    """A dataset of rows of one array, read whole in order (batch = dataset), still gets a
    batch of its own, as from default_collate: changing it in place leaves the data alone."""
    flat = np.arange(4 * 6, dtype=np.uint16).reshape(4, 6) * 2_000
    data = flat if kind == "arrays" else torch.from_numpy(flat)
    rows = [data[i].reshape(2, 3) for i in range(4)]
    batch = _collate.collate(rows)
    _same(batch, default_collate(rows))
    batch.numpy()[...] = 1
    assert (flat % 2_000 == 0).all()


@pytest.mark.parametrize(
    ("batch", "where"),
    [
        ([np.zeros((3, 4)), np.zeros((3, 5))], "a sample has shapes [3, 4], [3, 5]"),
        ([torch.zeros(2), torch.zeros(3), torch.zeros(1)], "a sample has shapes [2], [3], [1]"),
        ([{"x": np.zeros(2), "n": 1}, {"x": np.zeros(4), "n": 2}], "sample['x'] has shapes"),
        ([(np.zeros(1), [1, 2]), (np.zeros(1), [3])], "sample[1] has shapes [2], [1]"),
    ],
    ids=["arrays", "tensors", "dicts", "lists in tuples"],
)
def test_a_ragged_batch_points_to_collate_fn(batch: list[Any], where: str) -> None:
    """torch's error says "stack expects each tensor to be equal size" and no more: fastload's
    default collates (its own, and torch's in a worker) name the place, the shapes, collate_fn
    and the docs' example."""
    for collate in (_collate.collate, lambda b: _collate.noted(default_collate, b)):
        with pytest.raises(ConfigError, match=re.escape(where)) as caught:
            collate(batch)
        assert "collate_fn=" in str(caught.value) and 'docs/shapes.md, "Ragged samples"' in str(
            caught.value
        )
        assert isinstance(caught.value.__cause__, RuntimeError)  # torch's own, kept as cause

    def users(samples: list[Any]) -> Any:  # a collate_fn of the user's: its error is its own
        return default_collate(samples)

    with pytest.raises(RuntimeError):
        _collate.noted(users, batch)


def pad_pulses_of_the_docs() -> Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]:
    """The collate_fn docs/shapes.md gives under "Ragged samples"."""
    page = (Path(__file__).parents[1] / "docs" / "shapes.md").read_text()
    section = page.split("## Ragged samples", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    namespace: dict[str, Any] = {}
    exec(code.group(1), namespace)
    pad: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]] = namespace["pad_pulses"]
    return pad


def pulses_parquet(events: int) -> bytes:
    """IceCube-like pulses, one row per pulse: event e has 2 + e % 3 pulses at times e, e + 1..."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    counts = [2 + e % 3 for e in range(events)]
    ids = np.repeat(np.arange(events), counts)
    times = np.concatenate([np.arange(n, dtype=np.float32) + e for e, n in enumerate(counts)])
    table = pa.table({"event_id": ids, "time": times, "sensor_id": (ids % 7).astype(np.int16)})
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


@pytest.mark.parametrize("workers", [0, 1])
def test_ragged_parquet_events_need_a_collate_fn_and_the_docs_one_works(
    seaweed: S3Server, workers: int
) -> None:
    root = f"s3://{BUCKET}/ragged-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    write(root, options, {"events/a.parquet": pulses_parquet(12)})
    events = fastload.RemoteDataset(
        fastload.Parquet(f"{root}/events", row_key="event_id"), storage_options=options
    )
    plain = fastload.DataLoader(events, batch_size=4, shuffle=False, num_workers=workers)
    shapes = "sample['event_id'] has shapes [2], [3], [4], [2]"  # its first column
    with pytest.raises(ConfigError, match=re.escape(shapes)):
        next(iter(plain))
    padded = fastload.DataLoader(
        events,
        batch_size=4,
        shuffle=False,
        num_workers=workers,
        collate_fn=pad_pulses_of_the_docs(),
    )
    batches = list(padded)
    assert [b["event_id"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    first = batches[0]
    assert first["mask"].sum(dim=1).tolist() == [2, 3, 4, 2]
    assert first["time"].shape == (4, 4) and first["time"][1].tolist() == [1.0, 2.0, 3.0, 0.0]
    assert first["sensor_id"].dtype == torch.int16
