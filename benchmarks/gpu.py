"""The GPU check's benchmark: what DeviceLoader's CUDA path buys, from local files.

``python -m benchmarks.gpu [--out FILE] [--device cuda|cpu] [--quick]`` (``make gpu-check``
runs it with the ``cuda`` tests on a GPU machine; ``--device cpu`` runs the same loops without
copies, as the test suite's smoke test does).

In one process, ``REPEATS`` interleaved runs of each, medians reported:

- host-to-device bandwidth of one batch from pageable and from pinned memory;
- a training loop of ``STEP_S`` steps (matmuls calibrated on the device, ending in ``.item()``
  as a loop that logs its loss does) over batches read from a warm fastload cache on local disk,
  the same DataLoader workers for every row, ``EPOCHS`` passes over one loader as a training
  script makes:
  torch's DataLoader + ``batch.to(device)`` (torch's defaults); torch's at its best documented
  configuration (``pin_memory=True``, ``persistent_workers=True``, ``non_blocking=True``);
  that same torch loader under DeviceLoader (what the side stream alone adds); fastload's
  DataLoader + DeviceLoader at their defaults, and the same with workers forked (what the
  default forkserver's start costs); and DeviceLoader from pageable memory.
  Rows give the first batch's wait, the first pass's samples/s (worker start-up included), the
  later passes' samples/s and wait share (medians), the stall report's verdict on them, the
  ratio of later passes to torch's best loop, and the first run's first batch apart (the
  process's first loader of a kind pays one-off starts that the medians leave out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
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
EPOCHS = 3
BEST_TORCH = "torch pin_memory + persistent + non_blocking"

FIRST_RUN = "first run's first batch s"
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
) -> dict[str, Callable[[], Iterable[Any]]]:
    """Each row's loader: an iterable of batches on ``device``, one pass per iteration."""

    def torch_loader(best: bool) -> TorchLoader[Any]:
        return TorchLoader(
            dataset,
            BATCH,
            shuffle=True,
            num_workers=workers,
            pin_memory=best,
            persistent_workers=best and workers > 0,
        )

    def plain(best: bool) -> Iterable[Any]:
        return _Moved(torch_loader(best), device, non_blocking=best)

    def ours(pin: bool, context: str | None = None) -> Iterable[Any]:
        loader = fastload.DataLoader(
            dataset,
            BATCH,
            shuffle=True,
            num_workers=workers,
            pin_memory=pin,
            multiprocessing_context=context,
        )
        return DeviceLoader(loader, device)

    loops: dict[str, Callable[[], Iterable[Any]]] = {"torch + .to(device)": lambda: plain(False)}
    if device.type == "cuda":
        loops[BEST_TORCH] = lambda: plain(True)
        loops["the same torch loader + DeviceLoader"] = lambda: DeviceLoader(
            torch_loader(True), device
        )
        loops["fastload DataLoader + DeviceLoader (defaults)"] = lambda: ours(True)
        if workers:  # what the forkserver's start costs, beside workers that fork
            loops["the same, workers forked"] = lambda: ours(True, "fork")
    loops["fastload DeviceLoader, pageable"] = lambda: ours(False)
    return loops


class _Moved:
    """A torch loader's passes, each batch moved with ``.to(device)`` as a plain loop does."""

    def __init__(self, loader: TorchLoader[Any], device: torch.device, non_blocking: bool) -> None:
        self.loader, self.device, self.non_blocking = loader, device, non_blocking

    def __iter__(self) -> Iterator[Any]:  # a generator: the loader's iter() (its workers
        for batch in self.loader:  # starting) is timed in the first wait, as DeviceLoader's is
            yield batch.to(self.device, non_blocking=self.non_blocking)


def _timed(loader: Iterable[Any], step: Step, epochs: int) -> dict[str, Any]:
    """``epochs`` passes over ``loader``: the first pass apart from the later ones."""
    passes = []
    for _ in range(epochs):
        meter = Meter()
        for batch in meter.timed(iter(loader)):
            step(batch)
        passes.append(stall_report(meter.stats))
    first, later = passes[0], passes[1:] or passes[:1]
    return {
        "first batch s": first.first_batch_s,
        "first pass samples/s": first.samples_per_s,
        "later samples/s": statistics.median(r.samples_per_s for r in later),
        "later wait share": statistics.median(r.wait_share for r in later),
        "verdict": later[-1].bound,
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
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in loops}
        epochs = 2 if quick else EPOCHS
        for _ in range(1 if quick else REPEATS):
            for name, make in loops.items():
                runs[name].append(_timed(make(), step, epochs))
    rows = [{"loop": name, **_median(measured)} for name, measured in runs.items()]
    best = next((r for r in rows if r["loop"] == BEST_TORCH), rows[0])
    for row in rows:
        row[f"later vs {best['loop']}"] = row["later samples/s"] / best["later samples/s"]
    result["loops"] = rows
    return result


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs; the verdict of the most runs; and the first run's
    first batch apart (a process's first loader of a kind pays one-off starts, such as the
    forkserver's, which the median leaves out)."""
    row: dict[str, Any] = {
        key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "verdict"
    }
    row["verdict"] = statistics.mode(r["verdict"] for r in runs)
    row[FIRST_RUN] = runs[0]["first batch s"]
    return row


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
        ratio = next(v for k, v in row.items() if k.startswith("later vs"))
        print(  # a benchmark's report, not the library's
            f"{row['loop']:<46} first {row['first batch s']:.2f} s"
            f" (first run {row[FIRST_RUN]:.2f} s)"
            f"  pass 1 {row['first pass samples/s']:>6.0f}/s"
            f"  later {row['later samples/s']:>6.0f}/s wait {row['later wait share']:.1%}"
            f"  {row['verdict']}-bound  x{ratio:.2f}"
        )
    return result


if __name__ == "__main__":
    main()
