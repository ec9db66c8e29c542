"""Requests in flight: the adaptive limit against a sweep of fixed settings.

64 KB objects on a loopback SeaweedFS behind the fault proxy, every request held 100 ms (a
distant store). Two stores: one whose responses share a 20 MB/s link (``total_bandwidth``:
past about 30 requests in flight more only queue), and the same store uncapped (throughput
then rises with requests in flight until this machine's CPUs, which serve the store and the
proxy too, run out). Four threads call one fresh ``Fetcher`` at once, 64 objects a call (256
asked for at a time), for a fixed time; a row is the bytes read over that time. Rows:
``FetchConfig(adaptive=False, concurrency=c)`` for each c of the sweep, and the default
(adaptive, ceiling 64), interleaved per repeat, medians.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastload import FetchConfig
from fastload.fetcher import Fetcher
from fastload.stores import filesystem
from fastload.testing import FaultProxy, Faults, SeaweedS3Server

BUCKET = "bench"
SIZE = 64_000
LATENCY = 0.1
LINK = 20e6  # bytes/s, shared by every response of the capped store
THREADS, PER_CALL = 4, 64
SWEEP = (4, 8, 16, 32, 64)
ADAPTIVE = "adaptive (default, ceiling 64)"
STORES = {
    f"+{LATENCY * 1e3:.0f} ms, {LINK / 1e6:.0f} MB/s shared": Faults(
        latency=LATENCY, total_bandwidth=LINK
    ),
    f"+{LATENCY * 1e3:.0f} ms, uncapped": Faults(latency=LATENCY),
}


Run = tuple[float, int, int]  # bytes/s, the limit at the end, its peak


def configs() -> dict[str, FetchConfig]:
    fixed = {f"fixed {c}": FetchConfig(concurrency=c, adaptive=False) for c in SWEEP}
    return {**fixed, ADAPTIVE: FetchConfig()}


def concurrency_rows(
    objects: int, seconds: float, repeats: int, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with SeaweedS3Server() as server:
        server.create_bucket(BUCKET)
        root = f"s3://{BUCKET}/concurrency"
        blobs = {f"{BUCKET}/concurrency/{i:05d}.bin": os.urandom(SIZE) for i in range(objects)}
        filesystem(root, server.storage_options()).pipe(blobs)
        urls = [f"s3://{key}" for key in blobs]
        with FaultProxy(server.endpoint, flavor="s3") as proxy:
            options = server.storage_options(proxy.endpoint)
            for store, faults in STORES.items():
                proxy.set_faults(faults)
                measured: dict[str, list[Run]] = {k: [] for k in configs()}
                for repeat in range(repeats):  # interleaved, so noise hits every row alike
                    for name, config in configs().items():
                        progress(f"concurrency: {store}, {name} ({repeat + 1}/{repeats})")
                        measured[name].append(_run(options, urls, config, seconds))
                rows += _store_rows(store, measured)
    return rows


def _store_rows(store: str, measured: dict[str, list[Run]]) -> list[dict[str, Any]]:
    rates = {name: statistics.median(run[0] for run in runs) for name, runs in measured.items()}
    best = max((name for name in rates if name != ADAPTIVE), key=rates.__getitem__)
    rows = []
    for name, runs in measured.items():
        rows.append(
            {
                "store": store,
                "requests in flight": name,
                "MB/s (median)": rates[name] / 1e6,
                "vs best fixed": rates[name] / rates[best],
                "limit at end (median)": statistics.median(limit for _, limit, _ in runs),
                "limit peak (max)": max(peak for _, _, peak in runs),
                "runs": len(runs),
            }
        )
    rows.append(
        {
            "store": store,
            "requests in flight": f"adaptive / best fixed ({best})",
            "vs best fixed": rates[ADAPTIVE] / rates[best],
        }
    )
    return rows


def _run(options: dict[str, Any], urls: list[str], config: FetchConfig, seconds: float) -> Run:
    """Bytes/s of a fresh Fetcher called by THREADS threads for ``seconds``; its limit at the
    end and its peak."""
    fetcher = Fetcher(options, config)
    calls = _calls(urls)
    lock = threading.Lock()
    read = [0]
    stop = time.monotonic() + seconds

    def work() -> None:
        while time.monotonic() < stop:
            with lock:
                batch = next(calls)
            got = sum(len(body) for body in fetcher.fetch(batch))
            with lock:
                read[0] += got

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return read[0] / wall, fetcher.counters.limit, fetcher.counters.limit_peak


def _calls(urls: list[str]) -> Iterator[list[str]]:
    for at in itertools.cycle(range(0, len(urls), PER_CALL)):
        yield urls[at : at + PER_CALL]


def run_concurrency(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return concurrency_rows(512, 4.0 if quick else 10.0, 1 if quick else 3, progress)
