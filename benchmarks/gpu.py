"""The GPU check's benchmark: what DeviceLoader's CUDA path buys, from local files.

``python -m benchmarks.gpu [--out FILE] [--device cuda|cpu] [--quick]`` (``make gpu-check``
runs it with the ``cuda`` tests on a GPU machine; ``--device cpu`` runs the same loops without
copies, as the test suite's smoke test does).

In one process, ``REPEATS`` interleaved runs of each, medians reported:

- host-to-device bandwidth of one batch from pageable and from pinned memory;
- a training loop of ``STEP_S`` steps (matmuls calibrated on the device, ending in ``.item()``
  as a loop that logs its loss does) over batches read from a warm fastload cache on local disk,
  the same DataLoader workers for every row:
  torch's DataLoader + ``batch.to(device)``; torch's with ``pin_memory=True`` +
  ``non_blocking=True``; fastload's DataLoader + DeviceLoader (pinned, side stream); and
  DeviceLoader from pageable memory. Each run starts its own loader, as a training script does.
  Rows give samples/s, the data-wait share (one Meter times every row from the loop's side),
  the first batch's wait, the wait share without it, and the ratio to the plain
  ``.to(device)`` loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader as TorchLoader

import fastload
from fastload import Cache, DeviceLoader, RemoteDataset
from fastload.loader import default_workers
from fastload.stall import Meter, stall_report

STEP_S = 0.020
REPEATS = 3
BATCH = 64

Step = Callable[[torch.Tensor], float]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrated_step(device: torch.device, seconds: float = STEP_S) -> Step:
    """A step of about ``seconds`` on ``device``: matmuls, then the loss read back."""
    n = 4096 if device.type == "cuda" else 256
    weights = torch.randn(n, n, device=device) / n**0.5
    out = weights @ weights  # the first product pays for the BLAS library's start-up
    _sync(device)
    started = time.perf_counter()
    for _ in range(5):
        out = weights @ weights
    _sync(device)
    each = (time.perf_counter() - started) / 5
    reps = max(1, round(seconds / each))

    def step(batch: torch.Tensor) -> float:
        y = weights
        for _ in range(reps):
            y = y @ weights
        return float((y.sum() + batch.float().mean()).item())  # reads the batch: it must be there

    del out
    return step


def _step_ms(step: Step, device: torch.device, shape: tuple[int, ...]) -> float:
    """The calibrated step's median time on one batch already on the device."""
    batch = torch.rand(shape, device=device)
    times = []
    for _ in range(5):
        started = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def h2d_bandwidth(device: torch.device, shape: tuple[int, ...]) -> dict[str, float]:
    """GB/s of one batch copied to ``device`` from pageable and from pinned memory."""
    if device.type != "cuda":
        return {}
    pageable = torch.rand(shape)
    pinned = pageable.pin_memory()
    out: dict[str, float] = {}
    for name, source, non_blocking in (("pageable", pageable, False), ("pinned", pinned, True)):
        times = []
        for _ in range(10):
            _sync(device)
            started = time.perf_counter()
            source.to(device, non_blocking=non_blocking)
            _sync(device)
            times.append(time.perf_counter() - started)
        out[f"h2d {name} GB/s"] = pageable.nbytes / statistics.median(times) / 1e9
    out["pinned vs pageable"] = out["h2d pinned GB/s"] / out["h2d pageable GB/s"]
    return out


def _files(root: Path, n: int, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        np.save(root / f"train/{i:05d}.npy", rng.random(shape, dtype=np.float32))


def _loops(
    dataset: RemoteDataset, device: torch.device, workers: int
) -> dict[str, Callable[[], Iterator[Any]]]:
    """Each row's batches on ``device``, as the training loop sees them."""

    def plain(pin: bool) -> Iterator[Any]:
        loader = TorchLoader(dataset, BATCH, shuffle=True, num_workers=workers, pin_memory=pin)
        return (batch.to(device, non_blocking=pin) for batch in loader)

    def ours(pin: bool) -> Iterator[Any]:
        loader = fastload.DataLoader(
            dataset, BATCH, shuffle=True, num_workers=workers, pin_memory=pin
        )
        return iter(DeviceLoader(loader, device))

    loops: dict[str, Callable[[], Iterator[Any]]] = {"torch + .to(device)": lambda: plain(False)}
    if device.type == "cuda":
        loops["torch pin_memory + non_blocking"] = lambda: plain(True)
        loops["fastload DeviceLoader (pinned, side stream)"] = lambda: ours(True)
    loops["fastload DeviceLoader, pageable"] = lambda: ours(False)
    return loops


def _timed(batches: Iterator[Any], step: Step) -> dict[str, float]:
    meter = Meter()
    for batch in meter.timed(batches):
        step(batch)
    report = stall_report(meter.stats)
    return {
        "samples/s": report.samples_per_s,
        "wait share": report.wait_share,
        "first batch s": report.first_batch_s,
        "steady wait share": report.steady_wait_share,
    }


def gpu_rows(device_name: str, quick: bool) -> dict[str, Any]:
    device = torch.device(device_name)
    n, shape = (4 * BATCH, (3, 32, 32)) if quick else (64 * BATCH, (3, 224, 224))
    workers = min(default_workers(), 4) if quick else default_workers()
    step = calibrated_step(device)
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "samples": n,
        "sample shape": list(shape),
        "batch": BATCH,
        "workers": workers,
        "step ms": STEP_S * 1e3,
        "step ms measured": _step_ms(step, device, (BATCH, *shape)),
        **h2d_bandwidth(device, (BATCH, *shape)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "train").mkdir()
        _files(root, n, shape)
        dataset = RemoteDataset(
            str(root / "train"), decode="npy", cache=Cache(root / "cache", format="npy")
        )
        for _ in TorchLoader(dataset, BATCH, num_workers=workers):  # warm the cache
            pass
        loops = _loops(dataset, device, workers)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in loops}
        for _ in range(1 if quick else REPEATS):
            for name, make in loops.items():
                runs[name].append(_timed(make(), step))
    plain = statistics.median(r["samples/s"] for r in runs["torch + .to(device)"])
    rows = []
    for name, measured in runs.items():
        row = {key: statistics.median(r[key] for r in measured) for key in measured[0]}
        rows.append({"loop": name, **row, "vs .to(device)": row["samples/s"] / plain})
    result["loops"] = rows
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu.json"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here (torch.cuda.is_available() is False); --device cpu")
    result = gpu_rows(args.device, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in result["loops"]:
        print(  # a benchmark's report, not the library's
            f"{row['loop']:<46} {row['samples/s']:>9.0f} samples/s  wait {row['wait share']:.1%}"
            f"  first {row['first batch s']:.2f} s  steady wait {row['steady wait share']:.1%}"
            f"  x{row['vs .to(device)']:.2f}"
        )
    return result


if __name__ == "__main__":
    main()
