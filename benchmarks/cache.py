"""Epochs through fastload's cache against local files, and crops of a cached volume.

Epochs: N x 150 KB float32 arrays (.npy objects) on a loopback SeaweedFS behind the proxy adding
20 ms per request; torch DataLoader, batch 32.
- cold: fastload's first epoch (fetch + decode + cache write) through torch's DataLoader at
  batch 32 and 256 in the main process and with 2 workers (their start-up included), and
  through ``fastload.DataLoader`` at its defaults (lookahead, background thread; 0 workers on
  2 cores), against the raw concurrent-fetch ceiling measured just before it (fastload.fetch,
  64 in flight, the same objects);
- warm: later epochs served from the cache (formats npy and pt), against a bare loop reading
  the same arrays from local .npy files (np.load, stack by 32). The peer loaders are in
  ``benchmarks.peers``.
Each reader runs ``repeats`` times, interleaved; the table gives medians.

Crops: one 64x384x384 float32 volume (36 MB) in a zarr cache: a full warm read against
np.load of the same array, and a random 16x128x128 crop against the full read.

Small samples (``--only small``): N events as the parquet scenario's (an id and 20-80 float32
pulses, about 200 bytes) put one by one into an npy cache on this machine's disk, then read back
one by one in a shuffled order: rates, CPU per event, and the bytes on disk (allocated blocks of
every file under the cache folder) against the events' own bytes.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

import fastload
from fastload import Cache, FetchConfig, Fetcher, Manifest, RemoteDataset, versioned
from fastload.stores import filesystem
from fastload.testing import FaultProxy, Faults, SeaweedS3Server
from fastload.warm import warm_cache

BUCKET = "bench"
SHAPE = (150, 250)  # float32: 150,000 bytes
LATENCY = 0.020
BATCH = 32


def sample_array(i: int) -> np.ndarray:
    return np.random.default_rng(i).random(SHAPE, dtype=np.float32)


def npy_bytes(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


@contextlib.contextmanager
def remote_arrays(prefix: str, n: int) -> Iterator[tuple[Path, dict[str, Any], Manifest]]:
    """``n`` arrays as .npy objects under ``s3://bench/<prefix>`` on SeaweedFS, read through
    the proxy adding ``LATENCY``: a scratch directory, the storage options, the manifest."""
    with tempfile.TemporaryDirectory() as tmp, SeaweedS3Server() as server:
        server.create_bucket(BUCKET)
        filesystem("s3://x", server.storage_options()).pipe(
            {f"{BUCKET}/{prefix}/{i:05d}.npy": npy_bytes(sample_array(i)) for i in range(n)}
        )
        with FaultProxy(server.endpoint, flavor="s3", faults=Faults(latency=LATENCY)) as proxy:
            options = server.storage_options(proxy.endpoint)
            manifest = Manifest.build(f"s3://{BUCKET}/{prefix}", storage_options=options)
            yield Path(tmp), options, manifest


def fetch_ceiling(options: dict[str, Any], urls: list[str], repeats: int) -> float:
    """Median samples/s of fetching ``urls`` raw, 64 in flight."""
    return statistics.median(
        _rate(lambda: len(Fetcher(options, FetchConfig(concurrency=64)).fetch(urls)))
        for _ in range(repeats)
    )


def _rate(run: Callable[[], int]) -> float:
    started = time.perf_counter()
    count = run()
    return count / (time.perf_counter() - started)


def _epoch(loader: DataLoader[Any]) -> Callable[[], int]:
    return lambda: sum(len(batch) for batch in loader)


def _bare_loop(folder: Path, n: int) -> Callable[[], int]:
    paths = [folder / f"{i:05d}.npy" for i in range(n)]

    def run() -> int:
        count = 0
        for start in range(0, n, BATCH):
            batch = [torch.from_numpy(np.load(p)) for p in paths[start : start + BATCH]]
            count += len(torch.stack(batch))
        return count

    return run


@versioned(1)
def denoise(x: np.ndarray) -> np.ndarray:
    """A preprocessing step of about 2.3 ms of CPU for a 150 KB sample here: quantile
    normalisation, then a 3-tap median filter along rows (numpy, partly outside the GIL)."""
    lo, hi = np.quantile(x, [0.01, 0.99])
    y = np.clip((x - lo) / (hi - lo), 0, 1)
    filtered: np.ndarray = np.median(np.stack([y[:, :-2], y[:, 1:-1], y[:, 2:]]), axis=0)
    return filtered.astype(np.float32)


def _cold_epoch(
    folder: Path,
    manifest: Manifest,
    options: dict[str, Any],
    kind: str,
    workers: int,
    batch: int,
    transform: Callable[[Any], Any] | None,
) -> float:
    """Samples/s of one epoch filling a new cache, through torch's or fastload's DataLoader."""
    dataset = RemoteDataset(
        manifest, decode="npy", transform=transform, cache=Cache(folder), storage_options=options
    )
    with warnings.catch_warnings():  # more workers than cores: on purpose, to see the cost
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        loader = (
            fastload.DataLoader(dataset, batch_size=batch, num_workers=workers)
            if kind == "fastload"
            else DataLoader(dataset, batch_size=batch, num_workers=workers)
        )
        return _rate(_epoch(loader))


def epoch_rows(n: int, repeats: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with remote_arrays("epochs", n) as (workdir, options, manifest):
        local = workdir / "local"
        local.mkdir()
        for i in range(n):
            np.save(local / f"{i:05d}.npy", sample_array(i))
        ceiling = fetch_ceiling(options, manifest.urls(), repeats)
        rows.append(
            {
                "reader": "raw concurrent fetch (ceiling), 64 in flight",
                "samples/s (median)": ceiling,
            }
        )
        colds: list[tuple[str, int, int, Callable[[Any], Any] | None]] = [
            ("torch", 0, BATCH, None),
            ("torch", 0, 256, None),
            ("torch", 2, BATCH, None),
            ("fastload", 0, BATCH, None),
            *(("fastload", workers, BATCH, denoise) for workers in (0, 2, 4)),
        ]
        for kind, workers, batch, transform in colds:
            cold: list[float] = []
            for repeat in range(repeats):
                progress(f"cache/epochs: cold, {kind}, {workers} workers, batch {batch}")
                folder = workdir / f"cold-{len(rows)}-{repeat}"
                cold.append(_cold_epoch(folder, manifest, options, kind, workers, batch, transform))
            step = ", ~2 ms preprocessing" if transform else ""
            rows.append(
                {
                    "reader": f"fastload cold epoch (npy cache filling), {kind} DataLoader, "
                    f"{workers} workers, batch {batch}{step}",
                    "samples/s (median)": statistics.median(cold),
                    "vs ceiling": statistics.median(cold) / ceiling,
                }
            )
        readers: dict[str, Callable[[], int]] = {
            "local .npy files, bare loop": _bare_loop(local, n)
        }
        for fmt in ("npy", "pt"):
            cache = Cache(workdir / f"warm-{fmt}", format=fmt)  # type: ignore[arg-type]
            dataset = RemoteDataset(manifest, decode="npy", cache=cache, storage_options=options)
            _epoch(DataLoader(dataset, batch_size=BATCH))()  # fill
            for workers in (0, 2):
                loader = DataLoader(
                    dataset,
                    batch_size=BATCH,
                    num_workers=workers,
                    persistent_workers=workers > 0,
                )
                _epoch(loader)()  # start the workers outside the timing
                readers[f"fastload warm epoch, {fmt} cache, {workers} workers"] = _epoch(loader)
        measured: dict[str, list[float]] = {name: [] for name in readers}
        for repeat in range(repeats):  # interleaved, so noise hits every reader alike
            for name, run in readers.items():
                progress(f"cache/epochs: {name} (repeat {repeat + 1}/{repeats})")
                measured[name].append(_rate(run))
    bare = statistics.median(measured["local .npy files, bare loop"])
    for name, rates in measured.items():
        rate = statistics.median(rates)
        rows.append({"reader": name, "samples/s (median)": rate, "vs bare loop": rate / bare})
    return rows


def volume_rows(repeats: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    shape = (64, 384, 384)
    rng = np.random.default_rng(0)
    volume = rng.random(shape, dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "v.npy", volume)
        cache = Cache(Path(tmp) / "cache", format="zarr")
        cache.put("volume", volume)
        corners = [
            tuple(int(rng.integers(0, n - c)) for n, c in zip(shape, (16, 128, 128), strict=True))
            for _ in range(repeats)
        ]

        def crop(corner: tuple[int, ...]) -> Callable[[], Any]:
            def run() -> Any:
                a, b, c = corner
                with cache.open("volume") as lazy:
                    return lazy[a : a + 16, b : b + 128, c : c + 128]

            return run

        timings: dict[str, list[float]] = {
            "np.load (36 MB .npy)": [],
            "zarr cache, full read": [],
            "zarr cache, 16x128x128 crop": [],
        }
        for repeat in range(repeats):
            progress(f"cache/crops: repeat {repeat + 1}/{repeats}")
            for name, run in (
                ("np.load (36 MB .npy)", lambda: np.load(Path(tmp) / "v.npy")),
                ("zarr cache, full read", lambda: cache.get("volume")),
                ("zarr cache, 16x128x128 crop", crop(corners[repeat])),
            ):
                started = time.perf_counter()
                run()
                timings[name].append(time.perf_counter() - started)
    base = statistics.median(timings["np.load (36 MB .npy)"])
    full = statistics.median(timings["zarr cache, full read"])
    rows = []
    for name, values in timings.items():
        ms = statistics.median(values) * 1e3
        rows.append(
            {
                "read": name,
                "ms (median)": ms,
                "vs np.load": ms / 1e3 / base,
                "full read / this": full / (ms / 1e3),
            }
        )
    return rows


def run_epochs(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return epoch_rows(200 if quick else 2000, 1 if quick else 3, progress)


def run_crops(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return volume_rows(5 if quick else 31, progress)


@versioned(1)
def _scale(x: np.ndarray) -> np.ndarray:
    """A cheap transform: what warm-cache's fill rate must carry besides the fetch."""
    return x * np.float32(2)


def warm_rows(n: int, repeats: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """``warm_cache`` (what ``fastload warm-cache`` runs) against the raw fetch ceiling."""
    rows: list[dict[str, Any]] = []
    with remote_arrays("warm", n) as (workdir, options, manifest):
        urls = manifest.urls()
        ceiling: list[float] = []
        fill: list[float] = []
        for repeat in range(repeats):  # interleaved
            progress(f"cache/warm: repeat {repeat + 1}/{repeats}")
            ceiling.append(_rate(lambda: len(Fetcher(options).fetch(urls))))
            cache = Cache(workdir / f"c{repeat}", format="npy")
            dataset = RemoteDataset(
                manifest, decode="npy", transform=_scale, cache=cache, storage_options=options
            )
            fill.append(_rate(partial(_warm_all, dataset, n)))
    top = statistics.median(ceiling)
    rows.append(
        {"reader": "raw concurrent fetch (ceiling), 64 in flight", "samples/s (median)": top}
    )
    rows.append(
        {
            "reader": "warm_cache (fastload warm-cache), 4 x 64, npy + transform",
            "samples/s (median)": statistics.median(fill),
            "vs ceiling": statistics.median(fill) / top,
        }
    )
    return rows


def _warm_all(dataset: RemoteDataset, n: int) -> int:
    return warm_cache(dataset, np.arange(n)).samples


def run_warm(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return warm_rows(200 if quick else 2000, 1 if quick else 3, progress)


def _event(rng: np.random.Generator, i: int) -> dict[str, Any]:
    return {"event_id": np.int64(i), "pulses": rng.random(int(rng.integers(20, 81)), np.float32)}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _allocated(folder: Path) -> int:
    total = 0
    for where, _dirs, files in os.walk(folder):
        total += os.lstat(where).st_blocks * 512
        total += sum(os.lstat(os.path.join(where, f)).st_blocks * 512 for f in files)
    return total


def small_rows(n: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Fill and read back ``n`` small events through an npy cache (one pass each)."""
    rng = np.random.default_rng(0)
    events = [_event(rng, i) for i in range(n)]
    names = [f"s3://bench/events/batch_{i // 4000:03d}.parquet#{i % 4000}" for i in range(n)]
    source = sum(e["pulses"].nbytes + 8 for e in events)
    with tempfile.TemporaryDirectory(dir="/var/tmp" if Path("/var/tmp").is_dir() else None) as tmp:
        cache = Cache(Path(tmp) / "c", format="npy")
        progress(f"small: filling {n} events")
        cpu, started = _cpu(), time.perf_counter()
        for name, event in zip(names, events, strict=True):
            cache.put(name, event)
        fill = (n / (time.perf_counter() - started), (_cpu() - cpu) / n * 1e6)
        disk = _allocated(Path(tmp) / "c")
        files = sum(len(found) for _, _, found in os.walk(Path(tmp) / "c"))
        order = np.random.default_rng(1).permutation(n)
        cpu, started = _cpu(), time.perf_counter()
        got = sum(cache.get(names[i]) is not None for i in order)
        read = (n / (time.perf_counter() - started), (_cpu() - cpu) / n * 1e6)
    assert got == n, f"read back {got} of {n} events"
    common = {"events": n, "event bytes": source}
    return [
        {"step": "fill: Cache.put one by one", **common, "events/s": fill[0],
         "CPU us/event": fill[1], "bytes on disk": disk, "disk vs event bytes": disk / source,
         "files": files},
        {"step": "read: Cache.get, shuffled", **common, "events/s": read[0],
         "CPU us/event": read[1], "fill vs read": fill[0] / read[0]},
    ]  # fmt: skip


def run_small(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return small_rows(2_000 if quick else 200_000, progress)
