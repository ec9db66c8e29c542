"""Stall: a training loop with a simulated 20 ms step, and where its time goes.

N x 150 KB float32 .npy objects on a loopback SeaweedFS behind the proxy adding 20 ms per
request; batch 32; every loader feeds ``fastload.DeviceLoader(..., "cpu")``, whose report gives
the share of the loop's time spent waiting for data and the verdict.
- plain: torch's DataLoader over RemoteDataset without a cache (re-fetches every epoch);
- fastload.DataLoader defaults, cold (cache filling) and warm (served from the cache);
- cold epochs with no step at all (the loader's own rate), lookahead 4 (the default) vs 0,
  against the raw concurrent-fetch ceiling measured in the same run.
Medians over ``repeats``; cold runs use a fresh cache each time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

import fastload
from benchmarks.cache import BATCH, fetch_ceiling, remote_arrays
from fastload import Cache, DeviceLoader, RemoteDataset

STEP = 0.020


def _loop(loader: Any, step: float) -> dict[str, Any]:
    device = DeviceLoader(loader, "cpu")
    for _ in device:
        time.sleep(step)
    return device.report().to_dict()


def _row(name: str, reports: list[dict[str, Any]]) -> dict[str, Any]:
    middle = sorted(reports, key=lambda r: r["wait_share"])[len(reports) // 2]
    return {
        "loop": name,
        "wait share (median)": middle["wait_share"],
        "samples/s": middle["samples_per_s"],
        "first batch s": middle["first_batch_s"],
        "verdict": middle["verdict"],
    }


def stall_rows(n: int, repeats: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with remote_arrays("stall", n) as (workdir, options, manifest):

        def dataset(cache: Cache | None) -> RemoteDataset:
            return RemoteDataset(manifest, decode="npy", cache=cache, storage_options=options)

        plain, cold, warm = [], [], []
        for repeat in range(repeats):
            progress(f"stall: plain, cold and warm loops ({repeat + 1}/{repeats})")
            plain.append(_loop(DataLoader(dataset(None), batch_size=BATCH), STEP))
            loader = fastload.DataLoader(
                dataset(Cache(workdir / f"c{repeat}", format="npy")), batch_size=BATCH
            )
            cold.append(_loop(loader, STEP))
            warm.append(_loop(loader, STEP))
        rows.append(_row("torch DataLoader + RemoteDataset, no cache", plain))
        rows.append(_row("fastload.DataLoader defaults, cold cache", cold))
        rows.append(_row("fastload.DataLoader defaults, warm cache", warm))
        ceiling = fetch_ceiling(options, manifest.urls(), repeats)
        rows.append({"loop": "raw concurrent fetch (ceiling), no step", "samples/s": ceiling})
        for lookahead in (4, 0):
            rates = []
            for repeat in range(repeats):
                progress(f"stall: cold loader alone, lookahead {lookahead} ({repeat + 1})")
                cache = Cache(workdir / f"l{lookahead}-{repeat}", format="npy")
                loader = fastload.DataLoader(dataset(cache), batch_size=BATCH, lookahead=lookahead)
                rates.append(_loop(loader, 0.0)["samples_per_s"])
            rate = statistics.median(rates)
            rows.append(
                {
                    "loop": f"fastload.DataLoader cold, no step, lookahead {lookahead}",
                    "samples/s": rate,
                    "vs ceiling": rate / ceiling,
                }
            )
    return rows


def run_stall(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return stall_rows(256 if quick else 2000, 1 if quick else 3, progress)
