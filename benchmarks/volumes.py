"""Large volumes on B2: re-download and re-preprocess every epoch, or fastload's cache.

N float32 volumes of 64x384x384 (36 MB, .npy objects) on our B2 server behind the proxy adding
20 ms per request and capping each response at ``BANDWIDTH`` bytes/s. The preprocessing is
``benchmarks.peers.PREPROCESS`` (quantile normalisation on a 1/64 probe, trilinear resize to
48x256x256). Each reader runs in a fresh process (see ``benchmarks.peers``) for ``EPOCHS`` epochs,
batch 1, shuffled:
- baseline: torch DataLoader + RandomSampler, 2 workers, each sample downloaded with the b2
  fsspec filesystem and preprocessed again every epoch;
- fastload: ``RemoteDataset(transform=PREPROCESS, cache=Cache(format="zarr" | "pt"))`` with
  ``fastload.DataLoader`` defaults: the first epoch fetches, preprocesses and caches; later
  epochs read the preprocessed volumes from the cache.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peers import Spec, objects_on, run_reader, summary, with_ratios
from fastload import Manifest
from fastload.testing import Faults

SHAPE = (64, 384, 384)
BANDWIDTH = 25e6  # bytes/s per response
LATENCY = 0.020
EPOCHS = 3


def volume(i: int) -> np.ndarray:
    """A volume of gamma-distributed intensities (skewed, as scanner data is)."""
    return np.random.default_rng(i).gamma(2.0, 100.0, SHAPE).astype(np.float32)


def volume_rows(n: int, epochs: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    readers = {
        "baseline: download + preprocess every epoch, torch DataLoader, 2 workers": ("torch", ""),
        "fastload, zarr cache": ("fastload", "zarr"),
        "fastload, pt cache": ("fastload", "pt"),
    }
    faults = Faults(latency=LATENCY, bandwidth=BANDWIDTH)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, objects_on("b2", n, volume, faults) as on:
        server, proxy, root = on
        work = Path(tmp)
        options = server.storage_options(proxy.endpoint)
        Manifest.build(root, storage_options=options).save(work / "manifest.npz")
        for label, (reader, fmt) in readers.items():
            progress(f"volumes: {label}")
            run = work / label.split(",")[0].replace(" ", "-")
            run.mkdir(exist_ok=True)
            spec = Spec(
                reader, "b2", root, options, str(work / "manifest.npz"), str(run), n, {},
                batch=1, epochs=epochs, preprocess=True, cache_format=fmt or "npy",
            )  # fmt: skip
            result = run_reader(spec)
            rows.append({"reader": label, "volumes": n, **summary([result])})
    return with_ratios(rows, "baseline")


def run_volumes(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return volume_rows(2, 2, progress) if quick else volume_rows(64, EPOCHS, progress)
