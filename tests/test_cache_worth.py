"""A cache that costs more than it saves is bypassed (fastload.cache._worth): tiny parquet rows
on SeaweedFS are made from their row groups on every read, an expensive transform's samples are
cached, ``Cache(always=True)`` caches regardless, and the loader's report says which."""

from __future__ import annotations

import io
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fastload
from fastload import Cache, ConfigError, Parquet, RemoteDataset
from fastload.cache._worth import JUDGED_BATCHES, Costs
from fastload.stores import filesystem
from fastload.testing import S3Server
from tests.conftest import BUCKET

FILES, ROWS, BATCH = 2, 1200, 64


def _events(file: int) -> bytes:
    """``ROWS`` events (an id and a few float32 pulses, about 50 bytes) in one row group."""
    ids = np.arange(file * ROWS, (file + 1) * ROWS)
    pulses = [np.full(3 + int(i) % 5, i, np.float32) for i in ids]
    out = io.BytesIO()
    pq.write_table(pa.table({"event_id": ids, "pulses": pulses}), out)
    return out.getvalue()


@pytest.fixture(scope="module")
def events(seaweed: S3Server) -> tuple[str, dict[str, Any]]:
    root = f"s3://{BUCKET}/worth-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    filesystem(root, options).pipe(
        {f"{root[5:]}/part-{f}.parquet": _events(f) for f in range(FILES)}
    )
    return root, options


def _epoch(loader: fastload.DataLoader) -> list[tuple[int, list[float]]]:
    return [(int(r["event_id"]), r["pulses"].tolist()) for batch in loader for r in batch]


def _loader(dataset: RemoteDataset) -> fastload.DataLoader:
    return fastload.DataLoader(dataset, batch_size=BATCH, shuffle=True, collate_fn=list, seed=1)


def test_costs_pay_within_ten_epochs_or_not_at_all() -> None:
    """The judgement alone: the cache pays when reading a sample back saves enough on making
    it again to repay storing it within PAYBACK_EPOCHS later epochs; never when reading costs
    as much as making."""
    assert not Costs(make_us=7.5, write_us=31.0, read_us=15.0).pays()  # the 200K-event case
    assert not Costs(make_us=16.0, write_us=31.0, read_us=15.0).pays()  # 31 epochs to repay
    assert Costs(make_us=20.0, write_us=31.0, read_us=15.0).pays()  # 6.2 epochs
    assert Costs(make_us=2000.0, write_us=31.0, read_us=15.0).pays()  # an expensive transform
    assert not Costs(make_us=20.0, write_us=31.0, read_us=15.0).pays(payback_epochs=5)
    assert "7.5 µs" in str(Costs(make_us=7.5, write_us=31.0, read_us=15.0))


def test_tiny_rows_bypass_the_cache_and_the_report_says_so(
    events: tuple[str, dict[str, Any]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows that cost a few µs to slice from their row group are served past the cache once the
    first batches were judged: identical samples, most never stored, a warning with the
    figures, and the counters and the report (this epoch's and a later one's) say it; the
    row groups are kept as without a cache, so a later epoch reads none again."""
    root, options = events
    plain = RemoteDataset(Parquet(root), storage_options=options)
    expected = _epoch(_loader(plain))
    cache = Cache(tmp_path / "c")
    dataset = RemoteDataset(Parquet(root), cache=cache, storage_options=options)
    loader = _loader(dataset)
    with caplog.at_level(logging.WARNING, logger="fastload.cache._worth"):
        first = _epoch(loader)
    assert first == expected  # the same order (same seed), the same samples
    stats = loader.stats()["cache"]
    assert stats["bypass_judged"] == 1
    made, stored = FILES * ROWS, stats["writes"]
    assert stats["bypassed"] + stored >= made and stored < made / 2
    costs = Costs(stats["bypass_make_us"], stats["bypass_write_us"], stats["bypass_read_us"])
    assert not costs.pays() and costs.make_us > 0 and costs.read_us > 0
    assert [r.message for r in caplog.records if "bypassed" in r.message] == [
        r.message for r in caplog.records
    ]
    assert len(caplog.records) == 1 and root in caplog.text and "always=True" in caplog.text
    assert "cache bypassed for" in loader.report().verdict
    assert f"{costs.make_us:.1f} µs a sample" in loader.report().verdict

    loader.set_epoch(1)
    requests = dataset.fetcher.counters.requests
    again = _epoch(loader)
    assert sorted(again) == sorted(expected)
    # its row groups kept as without a cache (before, let go once served: read every epoch)
    assert dataset.fetcher.counters.requests == requests
    later = loader.counters
    assert later is not None and later.cache.writes == stored  # nothing more stored
    verdict = loader.report().verdict  # this pass: its counters hold no judgement...
    assert "cache bypassed for" in verdict and f"{costs.read_us:.1f} µs" in verdict  # ...but it


def test_an_expensive_transform_keeps_the_cache(
    events: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """A transform burning 1 ms of CPU a sample is judged worth caching: every sample stored,
    the next epoch served from the cache. (A sample the loop reads while the lookahead makes
    it may be made twice, as before this judgement: at least one write a sample.)"""

    def burn(row: dict[str, Any]) -> dict[str, Any]:
        until = time.thread_time() + 0.001
        while time.thread_time() < until:
            pass
        return row

    root, options = events
    cache = Cache(tmp_path / "c")
    dataset = RemoteDataset(
        Parquet(root), cache=cache, transform=burn, limit=BATCH * (JUDGED_BATCHES + 1),
        storage_options=options,
    )  # fmt: skip
    loader = _loader(dataset)
    _epoch(loader)
    costs = dataset._worth.costs
    assert costs is not None and costs.pays() and costs.make_us >= 900
    assert not dataset._worth.bypassed and cache.counters.bypassed == 0
    assert cache.counters.writes >= len(dataset)
    _epoch(loader)
    assert cache.counters.hits >= len(dataset) and "bypassed" not in loader.report().verdict


def test_always_caches_tiny_rows_and_objects_are_never_judged(
    events: tuple[str, dict[str, Any]], seaweed: S3Server, tmp_path: Path
) -> None:
    """Cache(always=True) stores every row whatever it costs; a source of one object per
    sample is never judged (each sample is a request of its own)."""
    root, options = events
    cache = Cache(tmp_path / "c", always=True)
    assert "always=True" in repr(cache)
    dataset = RemoteDataset(Parquet(root), cache=cache, storage_options=options)
    plain = RemoteDataset(Parquet(root), storage_options=options)
    assert _epoch(_loader(dataset)) == _epoch(_loader(plain))
    assert dataset._worth.costs is None and cache.counters.bypassed == 0
    assert cache.counters.writes >= FILES * ROWS  # (a few may be made twice, as before)

    objects = RemoteDataset(root, decode=len, cache=Cache(tmp_path / "o"), storage_options=options)
    assert not objects._worth.judging
    with pytest.raises(ConfigError, match="always"):
        Cache(tmp_path / "x", always=1)  # type: ignore[arg-type]
