"""Events in parquet files: shuffled batches read in place against a per-sample reader.

``files`` parquet files of ``EVENTS`` events each (an event: its id and a list of 20-80 float32
pulses; one row group per file, as pandas writes them) on loopback SeaweedFS behind the proxy
adding 20 ms per request. Readers, one after another in this process, batch 256:

- the user's reader: a ``Dataset`` whose ``__getitem__`` reads the file holding the event
  (s3fs ``cat_file`` + ``pyarrow.parquet.read_table``) unless it is the file it read last, then
  takes the row; ``torch.utils.data.DataLoader`` with 2 workers. With ``shuffle=False`` it reads
  each file about once per worker; with ``shuffle=True`` nearly every sample reads a file, so
  only its first ``SLOW_BATCHES`` batches are timed (the rate is steady from the first).
- fastload: ``RemoteDataset(Parquet(url))`` and ``fastload.DataLoader(shuffle=True)``
  defaults (shard-aware shuffling), a whole epoch; the requests it made and the shards a batch
  touched are reported beside the rate.
"""

from __future__ import annotations

import io
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch.utils.data import DataLoader, Dataset

import fastload
from benchmarks.groups import medians
from fastload.sampler import block_locality
from fastload.stores import filesystem
from fastload.testing import FaultProxy, Faults, SeaweedS3Server

BUCKET = "fastload-bench"
EVENTS = 4000
BATCH = 256
LATENCY = 0.020
SLOW_BATCHES = 4


def _events(file: int, count: int) -> bytes:
    rng = np.random.default_rng(file)
    ids = np.arange(file * count, (file + 1) * count)
    pulses = [rng.random(int(rng.integers(20, 80)), dtype=np.float32) for _ in ids]
    out = io.BytesIO()
    pq.write_table(pa.table({"event_id": ids, "pulses": pulses}), out)
    return out.getvalue()


class PerSampleEvents(Dataset[Any]):
    """The user's reader: the file of the event (unless read last), then its row."""

    def __init__(self, root: str, files: int, events: int, options: dict[str, Any]) -> None:
        self.root, self.files, self.events, self.options = root, files, events, options
        self._last: tuple[int, dict[str, Any]] | None = None

    def __len__(self) -> int:
        return self.files * self.events

    def __getitem__(self, index: int) -> dict[str, Any]:
        file, row = divmod(index, self.events)
        if self._last is None or self._last[0] != file:
            fs = filesystem(self.root, self.options)
            body = fs.cat_file(f"{fs._strip_protocol(self.root)}/batch_{file:03d}.parquet")
            table = pq.read_table(io.BytesIO(body))
            columns = {
                n: table.column(n).to_numpy(zero_copy_only=False) for n in table.column_names
            }
            self._last = (file, columns)
        return {name: values[row] for name, values in self._last[1].items()}


def _rows(batch: list[Any]) -> list[Any]:
    return batch


def _rate(loader: Any, limit: int | None = None) -> tuple[float, int]:
    started = time.perf_counter()
    count = 0
    for step, batch in enumerate(loader):
        count += len(batch)
        if limit is not None and step + 1 >= limit:
            break
    return count / (time.perf_counter() - started), count


def parquet_rows(
    files: int, progress: Callable[[str], None], events: int = EVENTS, repeats: int = 1
) -> list[dict[str, Any]]:
    """Every reader ``repeats`` times, interleaved; the median rate of each."""
    runs: list[list[dict[str, Any]]] = []
    with SeaweedS3Server() as server:
        server.create_bucket(BUCKET)
        root = f"s3://{BUCKET}/events"
        fs = filesystem(root, server.storage_options())
        progress(f"parquet: writing {files} files of {events} events")
        fs.pipe(
            {f"{BUCKET}/events/batch_{f:03d}.parquet": _events(f, events) for f in range(files)}
        )
        with FaultProxy(server.endpoint, flavor="s3", faults=Faults(latency=LATENCY)) as proxy:
            options = server.storage_options(proxy.endpoint)
            for repeat in range(repeats):
                progress(f"parquet: repeat {repeat + 1}/{repeats}")
                runs.append(
                    [
                        _per_sample(root, files, events, options, shuffle=True),
                        _per_sample(root, files, events, options, shuffle=False),
                        _shards(root, options),
                    ]
                )
    return medians(runs, "samples/s", "x per-sample shuffle=True")


def _per_sample(
    root: str, files: int, events: int, options: dict[str, Any], *, shuffle: bool
) -> dict[str, Any]:
    plain = DataLoader(
        PerSampleEvents(root, files, events, options), batch_size=BATCH, shuffle=shuffle,
        num_workers=2, collate_fn=_rows, multiprocessing_context="fork",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning)
        rate, count = _rate(plain, SLOW_BATCHES if shuffle else None)
    return {
        "reader": f"per-sample reader, 2 workers, shuffle={shuffle}",
        "samples/s": rate,
        "samples timed": count,
        "requests": "",
        "shards per batch": "",
    }


def _shards(root: str, options: dict[str, Any]) -> dict[str, Any]:
    dataset = fastload.RemoteDataset(fastload.Parquet(root), storage_options=options)
    before = dataset.fetcher.counters.requests  # the footers
    loader = fastload.DataLoader(dataset, batch_size=BATCH, shuffle=True, collate_fn=_rows)
    rate, count = _rate(loader)
    stats = loader.counters
    order = getattr(loader.sampler, "lookahead_source", loader.sampler)  # the lookahead's
    assert stats is not None and isinstance(order, fastload.PermutationSampler)
    locality = block_locality(order, BATCH, batches=len(dataset) // BATCH)
    return {
        "reader": "fastload Parquet source, DataLoader defaults, shuffle=True",
        "samples/s": rate,
        "samples timed": count,
        "requests": stats.fetch.requests - before,
        "shards per batch": locality["blocks_per_batch"],
    }


def run_parquet(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return parquet_rows(4, progress) if quick else parquet_rows(50, progress, repeats=3)
