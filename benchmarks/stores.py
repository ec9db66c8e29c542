"""Object fetch and listing: fastload vs s3fs vs s3torchconnector, side by side in one run.

Fetch: N x 150 KB objects on a loopback SeaweedFS behind the fault proxy adding 20 ms per
request. Each client reads every object once per repeat; the table reports the median rate,
the ratio to s3fs's best concurrent rate in the same run, and CPU seconds per GET spent in this
process (s3torchconnector's DataLoader workers are other processes: their CPU is not counted).

Manifest: save/load of 1,000,000 synthetic entries; listing of a real prefix (100,000 objects,
3,000 in --quick) through the same proxy: one ``fs.find`` vs ``Manifest.build`` in parallel.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import torch
from s3torchconnector import S3ClientConfig, S3MapDataset

from fastload import FetchConfig, Fetcher, Manifest
from fastload.stores import filesystem
from fastload.stores.s3 import FAST_PATH
from fastload.testing import FaultProxy, Faults, SeaweedS3Server

BUCKET = "bench"
SIZE = 150_000
LATENCY = 0.020
SMALL_LISTING = 2_000  # keys: the peers scenario's objects, a listing of two pages


def _timed(run: Callable[[], int]) -> tuple[float, float, int]:
    wall, cpu = time.perf_counter(), time.process_time()
    count = run()
    return time.perf_counter() - wall, time.process_time() - cpu, count


def _s3torch_rate(prefix: str, server: SeaweedS3Server, endpoint: str) -> Callable[[], int]:
    os.environ.update(
        AWS_ACCESS_KEY_ID=server.access_key,
        AWS_SECRET_ACCESS_KEY=server.secret_key,
        AWS_REGION="us-east-1",
    )
    dataset = S3MapDataset.from_prefix(
        f"s3://{BUCKET}/{prefix}/",
        region="us-east-1",
        endpoint=endpoint,
        s3client_config=S3ClientConfig(force_path_style=True),
        transform=lambda obj: obj.read(),
    )

    def run() -> int:
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=16, num_workers=4, collate_fn=lambda batch: batch
        )
        return sum(len(batch) for batch in loader)

    return run


def fetch_rows(n: int, repeats: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with SeaweedS3Server() as server:
        server.create_bucket(BUCKET)
        blobs = {f"{BUCKET}/fetch/{i:05d}.bin": os.urandom(SIZE) for i in range(n)}
        filesystem("s3://x", server.storage_options()).pipe(blobs)
        urls = [f"s3://{key}" for key in blobs]
        with FaultProxy(server.endpoint, flavor="s3", faults=Faults(latency=LATENCY)) as proxy:
            options = server.storage_options(proxy.endpoint)
            s3fs_fs = filesystem("s3://x", options)
            paths = list(blobs)

            def s3fs_cat(batch: int) -> Callable[[], int]:
                return lambda: len(s3fs_fs.cat(paths, batch_size=batch))

            def ours(config: FetchConfig, fast_path: bool = True) -> Callable[[], int]:
                store_options = {**options, FAST_PATH: fast_path}
                return lambda: len(Fetcher(store_options, config).fetch(urls))

            clients: dict[str, Callable[[], int]] = {
                "s3fs cat, 32 in flight": s3fs_cat(32),
                "s3fs cat, 128 in flight": s3fs_cat(128),
                "fastload general path (s3fs), 64 in flight": ours(
                    FetchConfig(concurrency=64), fast_path=False
                ),
                "fastload (obstore fast path), 64 in flight": ours(FetchConfig(concurrency=64)),
                "s3torchconnector S3MapDataset, DataLoader 4 workers": _s3torch_rate(
                    "fetch", server, proxy.endpoint
                ),
            }
            measured: dict[str, list[tuple[float, float, int]]] = {k: [] for k in clients}
            for repeat in range(repeats):  # interleaved, so noise hits every client alike
                for name, run in clients.items():
                    progress(f"stores/fetch: {name} (repeat {repeat + 1}/{repeats})")
                    measured[name].append(_timed(run))
    for name, runs in measured.items():
        assert all(count == n for _, _, count in runs), name
        rows.append(
            {
                "client": name,
                "objects": n,
                "GETs/s (median)": statistics.median(n / wall for wall, _, _ in runs),
                "CPU ms/GET (this process)": statistics.median(cpu / n * 1e3 for _, cpu, _ in runs),
            }
        )
    best_s3fs = max(r["GETs/s (median)"] for r in rows if r["client"].startswith("s3fs"))
    s3torch = next(r["GETs/s (median)"] for r in rows if r["client"].startswith("s3torch"))
    for row in rows:
        row["vs best s3fs"] = row["GETs/s (median)"] / best_s3fs
        row["vs s3torchconnector"] = row["GETs/s (median)"] / s3torch
    return rows


def manifest_rows(
    n: int,
    listed: int,
    repeats: int,
    progress: Callable[[str], None],
    small: int = SMALL_LISTING,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    keys = [f"train/shard{i % 100:03d}/img_{i:08d}.jpg" for i in range(n)]
    synthetic = Manifest("s3://bucket/data", keys, [150_000] * n, [f"{i:032x}" for i in range(n)])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.npz"
        saves, loads = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            synthetic.save(path)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            loaded = Manifest.load(path)
            loads.append(time.perf_counter() - start)
        assert loaded.fingerprint == synthetic.fingerprint
        rows.append(
            {
                "case": f"save {n:,} entries (median of {repeats})",
                "seconds": statistics.median(saves),
                "file MB": path.stat().st_size / 1e6,
            }
        )
        rows.append(
            {
                "case": f"load {n:,} entries (median of {repeats})",
                "seconds": statistics.median(loads),
            }
        )

    # a short flat listing (a chain of two pages, never split), flat keys, and directory-shaped
    # ones (plate/well/field_channel: split points land on directory names, which SeaweedFS's
    # StartAfter skips unless the listing checks them)
    layouts = {  # folder: (layout, keys)
        "short": ("flat", [f"img_{i:06d}.jpg" for i in range(small)]),  # one chain of pages
        "flat": ("flat", [f"img_{i:06d}.jpg" for i in range(listed)]),
        "directories": (
            "directories",
            [
                f"P{f // 2000}/w{f // 40 % 50:02d}/f{f % 40:02d}_ch{c}.tiff"
                for f in range(listed // 25)
                for c in range(1, 6)
            ],
        ),
    }
    with SeaweedS3Server() as server:
        server.create_bucket(BUCKET)
        for folder, (layout, keys) in layouts.items():
            progress(f"stores/manifest: writing {len(keys):,} {layout} objects")
            filesystem("s3://x", server.storage_options()).pipe(
                {f"{BUCKET}/{folder}/{key}": b"x" for key in keys}
            )
        with FaultProxy(server.endpoint, flavor="s3", faults=Faults(latency=LATENCY)) as proxy:
            options = server.storage_options(proxy.endpoint)
            fs = filesystem("s3://x", options)
            for folder, (layout, keys) in layouts.items():
                times: dict[str, list[float]] = {"find": [], "parallel": []}
                calls: dict[str, list[int]] = {"find": [], "parallel": []}
                for _ in range(repeats):
                    progress(f"stores/manifest: fs.find vs Manifest.build, {layout}")
                    before, start = proxy.counters()["requests"], time.perf_counter()
                    found = fs.find(f"{BUCKET}/{folder}")
                    fs.invalidate_cache()
                    times["find"].append(time.perf_counter() - start)
                    calls["find"].append(proxy.counters()["requests"] - before)
                    before, start = proxy.counters()["requests"], time.perf_counter()
                    built = Manifest.build(f"s3://{BUCKET}/{folder}", storage_options=options)
                    times["parallel"].append(time.perf_counter() - start)
                    calls["parallel"].append(proxy.counters()["requests"] - before)
                    assert len(found) == len(built) == len(keys), (len(found), len(built))
                find_s, parallel_s = (statistics.median(times[k]) for k in ("find", "parallel"))
                what = f"list {len(keys):,} {layout} objects"
                rows.append(
                    {
                        "case": f"{what}: one fs.find (+20 ms)",
                        "seconds": find_s,
                        "requests": statistics.median(calls["find"]),
                    }
                )
                rows.append(
                    {
                        "case": f"{what}: Manifest.build (+20 ms)",
                        "seconds": parallel_s,
                        "requests": statistics.median(calls["parallel"]),
                        "speed-up": find_s / parallel_s,
                    }
                )
    return rows


def run_fetch(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return fetch_rows(200, 1, progress) if quick else fetch_rows(2000, 3, progress)


def run_manifest(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    if quick:
        return manifest_rows(1_000_000, 3_000, 1, progress)
    return manifest_rows(1_000_000, 100_000, 3, progress)
