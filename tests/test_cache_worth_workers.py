"""The cache's judge (fastload.cache._worth) with DataLoader workers that fill the cache while
the loop's process makes the first batches (the head start): nothing is made twice, nothing
is left held."""

from __future__ import annotations

import io
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fastload
import fastload.loader
from fastload import Cache, Parquet, RemoteDataset
from fastload.testing import S3Server
from tests.conftest import BUCKET, write

FILES, ROWS, BATCH = 2, 1200, 64


def events(file: int) -> bytes:
    """Tiny rows (an id and 4 float32 pulses), which the judge finds cheaper to make again."""
    ids = np.arange(file * ROWS, (file + 1) * ROWS)
    out = io.BytesIO()
    pq.write_table(
        pa.table({"event_id": ids, "pulses": [np.full(4, i, np.float32) for i in ids]}), out
    )
    return out.getvalue()


def slow_start(worker: int) -> None:
    """Workers that start late: the head start makes all its batches, enough to judge."""
    time.sleep(3)


def test_the_loop_process_leaves_judging_to_the_filling_workers_and_holds_nothing(
    seaweed: S3Server,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With cores to spare the loop's process caches the first batches while the workers start
    (DataLoader._head_start). It leaves judging whether the cache pays to the workers, which
    fill the cache: it caches what it makes, holds nothing after the epoch, and the workers
    still judge (each bypasses the cache for these tiny rows). Seen before: the loop's process
    judged its head start and bypassed the cache, making the head start's later batches past
    it and holding them for reads that never came (768 samples held for good, 4,066 made)."""
    monkeypatch.setattr(fastload.loader, "_cores", lambda: 8)  # a head start on 2 cores too
    root = f"s3://{BUCKET}/worth-workers-{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = seaweed.storage_options()
    write(root, options, {f"part-{f}.parquet": events(f) for f in range(FILES)})
    dataset = RemoteDataset(Parquet(root), cache=Cache(tmp_path / "c"), storage_options=options)
    loader = fastload.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, num_workers=2, seed=1, worker_init_fn=slow_start
    )
    assert loader.fills
    ids = sorted(i for batch in loader for i in batch["event_id"].tolist())
    assert ids == list(range(FILES * ROWS))
    assert dataset._worth.costs is None  # the loop's process judged no batch of its own
    gone = [r.getMessage() for r in caplog.records if "were gone before" in r.getMessage()]
    assert not gone, gone  # a worker that bypassed the cache while filling a batch said so
    assert loader.stats()["cache"]["bypass_judged"] >= 1  # the workers' judgement
    held = dataset._handoff_here()._held  # the loop's process's
    assert not held, f"{len(held)} samples held after the epoch"
