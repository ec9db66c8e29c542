"""Slow tails: a cold epoch when a few GETs are held far longer than the rest.

N x 50 KB objects on a loopback SeaweedFS behind the fault proxy adding 20 ms per request;
``fastload.DataLoader`` at its defaults (batch 32) over a ``RemoteDataset`` with no cache, so
every epoch reads every object. With tails, the proxy holds 2% of GETs for 1.5 s before it
answers (a slow replica). Rows, each a fresh dataset and fetcher, interleaved per repeat:

- no tails, defaults (the reference);
- tails, defaults (hedging by observed latency, within 5% of requests);
- tails, hedging off (``hedge_budget=0``: the behaviour before hedging was on by default);
- tails, a fixed ``hedge_after=0.1``.

A batch waits for its slowest member, so without hedging one held GET in 32 holds the batch.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import fastload
from fastload import FetchConfig, RemoteDataset
from fastload.stores import filesystem
from fastload.testing import FaultProxy, Faults, SeaweedS3Server

BUCKET = "bench"
SIZE = 50_000
LATENCY = 0.020
TAIL = Faults(latency=LATENCY, stall=0.02, stall_seconds=1.5, methods=("GET",), seed=11)


def tail_rows(n: int, repeats: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    configs: dict[str, tuple[bool, FetchConfig | None]] = {
        "no tails, defaults": (False, None),
        "tails, defaults (adaptive hedging)": (True, None),
        "tails, hedging off (hedge_budget=0)": (True, FetchConfig(hedge_budget=0)),
        "tails, fixed hedge_after=0.1": (True, FetchConfig(hedge_after=0.1)),
    }
    measured: dict[str, list[tuple[float, float, int, int]]] = {k: [] for k in configs}
    with SeaweedS3Server() as server:
        server.create_bucket(BUCKET)
        root = f"s3://{BUCKET}/tails"
        blobs = {f"{BUCKET}/tails/{i:05d}.bin": os.urandom(SIZE) for i in range(n)}
        filesystem(root, server.storage_options()).pipe(blobs)
        manifest = fastload.Manifest.build(root, storage_options=server.storage_options())
        with FaultProxy(server.endpoint, flavor="s3", faults=Faults(latency=LATENCY)) as proxy:
            options = server.storage_options(proxy.endpoint)
            for repeat in range(repeats):  # interleaved, so noise hits every row alike
                for name, (tails, config) in configs.items():
                    progress(f"tails: {name} (repeat {repeat + 1}/{repeats})")
                    proxy.set_faults(TAIL if tails else Faults(latency=LATENCY))
                    measured[name].append(_epoch(manifest, options, config))
    reference = statistics.median(n / wall for wall, *_ in measured["no tails, defaults"])
    rows = []
    for name, runs in measured.items():
        assert all(count == n for _, _, count, _ in runs), name
        rate = statistics.median(n / wall for wall, *_ in runs)
        rows.append(
            {
                "reader": name,
                "objects": n,
                "cold samples/s (median)": rate,
                "vs no tails": rate / reference,
                "p99 GET ms (median)": statistics.median(p99 for _, p99, _, _ in runs),
                "hedges per 100 GETs": statistics.median(h for *_, h in runs) / n * 100,
            }
        )
    return rows


def _epoch(
    manifest: fastload.Manifest, options: dict[str, Any], config: FetchConfig | None
) -> tuple[float, float, int, int]:
    """One cold epoch: wall seconds, p99 GET latency (ms), samples, hedges."""
    dataset = RemoteDataset(manifest, storage_options=options, fetch_config=config)
    loader = fastload.DataLoader(dataset, batch_size=32, collate_fn=list)
    started = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    wall = time.perf_counter() - started
    fetch = loader.report().counters.fetch if loader.report().counters else None
    p99 = fetch.latency.percentile(99) * 1e3 if fetch else 0.0
    return wall, p99, count, fetch.hedges if fetch else 0


def run_tails(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return tail_rows(200 if quick else 600, 1 if quick else 3, progress)
