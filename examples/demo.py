"""fastload demo: train a tiny model from an object store and show where the time goes.

By default it starts a local S3 server (SeaweedFS) behind the fault proxy with 20-50 ms of
latency per request, uploads a synthetic labelled image dataset, and trains a small CNN for a few
steps, once per loader configuration, printing samples/s, data-wait share and time to first batch.

    make demo                      # embedded default (local S3 + latency)
    make demo URL=s3://bucket/dir  # your own bucket: .npy arrays, label = parent directory

The fastload rows train through fastload.DataLoader + DeviceLoader over a RemoteDataset with a
preprocessed cache: cold (one epoch that fills the cache) and warm; each prints its stall verdict.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

import fastload

log = logging.getLogger("fastload.demo")

BUCKET = "fastload-demo"
CLASSES = 10
SHAPE = (3, 96, 96)  # uint8 "images", ~27 KB each as .npy


@dataclass(frozen=True)
class Result:
    name: str
    samples_per_s: float
    data_wait_share: float
    first_batch_s: float
    verdict: str = ""


class ObjectDataset(Dataset[tuple[torch.Tensor, int]]):
    """What users write today: one remote read per sample inside __getitem__."""

    def __init__(self, urls: list[str], labels: list[int], storage_options: dict[str, Any]):
        self.urls, self.labels, self.storage_options = urls, labels, storage_options
        self._fs: Any = None

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self._fs is None:  # one filesystem per worker process
            self._fs, _ = fsspec.core.url_to_fs(self.urls[0], **self.storage_options)
        array = np.load(io.BytesIO(self._fs.cat_file(self.urls[index])))
        return torch.from_numpy(array).float().div_(255), self.labels[index]


def tiny_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, CLASSES),
    )


def train(name: str, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps: int) -> Result:
    """Run ``steps`` optimisation steps, timing how long the loop waits for each batch."""
    torch.manual_seed(0)
    model = tiny_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    started = time.perf_counter()
    waited = first = 0.0
    seen = 0
    iterator: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(batches)
    for step in range(steps):
        t0 = time.perf_counter()
        try:
            x, y = next(iterator)
        except StopIteration:
            iterator = iter(batches)
            x, y = next(iterator)
        t1 = time.perf_counter()
        waited += t1 - t0
        if step == 0:
            first = t1 - started
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += len(y)
    total = time.perf_counter() - started
    log.info("%s: loss %.3f after %d steps", name, loss.item(), steps)
    return Result(name, seen / total, waited / total, first)


def synthetic_dataset(fs: Any, root: str, count: int) -> None:
    rng = np.random.default_rng(0)
    payloads = {}
    for i in range(count):
        label = i % CLASSES
        image = rng.integers(0, 256, SHAPE, dtype=np.uint8)
        image[label % 3] //= 2  # a learnable hint per class
        buffer = io.BytesIO()
        np.save(buffer, image)
        payloads[f"{root}/class{label}/{i:05d}.npy"] = buffer.getvalue()
    fs.pipe(payloads)


def list_samples(url: str, storage_options: dict[str, Any]) -> tuple[list[str], list[int]]:
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    keys = sorted(k for k in fs.find(root) if k.endswith(".npy"))
    if not keys:
        raise SystemExit(f"no .npy objects under {url}")
    protocol = url.split("://", 1)[0]
    parents = [k.rsplit("/", 2)[-2] for k in keys]
    class_of = {name: i % CLASSES for i, name in enumerate(sorted(set(parents)))}
    labels = [class_of[parent] for parent in parents]
    return [f"{protocol}://{k}" for k in keys], labels


def collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*samples, strict=True)
    return torch.stack(images), torch.tensor(labels)


def baseline(
    urls: list[str], labels: list[int], options: dict[str, Any], args: argparse.Namespace
) -> Result:
    dataset = ObjectDataset(urls, labels, options)
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(0)),
        num_workers=args.workers,
        collate_fn=collate,
        persistent_workers=args.workers > 0,
        # forkserver, as fastload's loaders (and Python 3.14's default): its workers end with
        # os._exit. Not spawn: a spawned worker ends by finalizing its interpreter, so one
        # stopped mid-epoch while its queue's thread still handed over a batch aborted
        # ("terminate called without an active exception"; torch: "DataLoader worker ...
        # killed by signal: Aborted"). Not fork: the workers would inherit this process's s3fs
        # clients, whose sessions then fail to close on their loop (tracebacks).
        multiprocessing_context="forkserver" if args.workers > 0 else None,
    )
    return train(f"torch DataLoader + RandomSampler ({args.workers} workers)", loader, args.steps)


@fastload.versioned(1)
def to_float(image: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(image).float().div_(255)


def fastload_rows(
    root: str,
    urls: list[str],
    labels: list[int],
    options: dict[str, Any],
    args: argparse.Namespace,
) -> list[Result]:
    """Cold (one epoch, filling the cache) then warm, through DataLoader + DeviceLoader."""
    options = {k: v for k, v in options.items() if k != "skip_instance_cache"}
    with tempfile.TemporaryDirectory() as cache_dir:
        dataset = fastload.RemoteDataset(
            root,
            decode="npy",
            transform=to_float,
            labels=dict(zip(urls, labels, strict=True)),
            cache=fastload.Cache(cache_dir, format="npy"),
            storage_options=options,
        )
        loader = fastload.DataLoader(
            dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers
        )
        results = []
        for name in ("cold (cache filling)", "warm"):  # one pass each: the report's window
            device = fastload.DeviceLoader(loader, "cpu")
            row = train(f"fastload {name}, {args.workers} workers", device, len(loader))
            results.append(dataclasses.replace(row, verdict=device.report().verdict))
    return results


def print_table(results: list[Result], wall: float) -> None:
    header = f"{'loader':<52} {'samples/s':>10} {'data wait':>10} {'1st batch':>10}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.name:<52} {r.samples_per_s:>10.1f} {r.data_wait_share:>9.0%} "
            f"{r.first_batch_s:>9.2f}s"
        )
    print(
        f"\n(data wait = share of wall time the training loop spent waiting for batches; "
        f"demo wall time {wall:.0f} s)"
    )
    for r in results:
        if r.verdict:
            print(f"\n{r.name}, fastload's own report:\n  {r.verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="train from this bucket/prefix instead of the local default")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--jitter-ms", type=float, default=30.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    started = time.perf_counter()
    with ExitStack() as stack:
        if args.url:
            options: dict[str, Any] = {}
            urls, labels = list_samples(args.url, options)
        else:
            urls, labels, options = local_bucket(stack, args)
        log.info("%d samples, %d classes", len(urls), len(set(labels)))
        root = args.url or f"s3://{BUCKET}/images"
        # fastload's rows run first: their loader starts the forkserver (the baseline's too)
        # with what it preloads (torch, fastload); the first loader to start it decides that.
        rows = fastload_rows(root, urls, labels, options, args)
        results = [baseline(urls, labels, options, args), *rows]
    print()
    print_table(results, time.perf_counter() - started)


def local_bucket(
    stack: ExitStack, args: argparse.Namespace
) -> tuple[list[str], list[int], dict[str, Any]]:
    from fastload.testing import FaultProxy, Faults, SeaweedS3Server

    server = stack.enter_context(SeaweedS3Server())
    server.create_bucket(BUCKET)
    faults = Faults(latency=args.latency_ms / 1000, jitter=args.jitter_ms / 1000)
    proxy = stack.enter_context(FaultProxy(server.endpoint, flavor="s3", faults=faults))
    log.info(
        "local S3 (SeaweedFS pid %s) behind a proxy adding %.0f-%.0f ms per request",
        server.pid,
        args.latency_ms,
        args.latency_ms + args.jitter_ms,
    )
    synthetic_dataset(
        fsspec.filesystem("s3", **server.storage_options()), f"{BUCKET}/images", args.samples
    )
    options = {**server.storage_options(proxy.endpoint), "skip_instance_cache": True}
    urls, labels = list_samples(f"s3://{BUCKET}/images", options)
    return urls, labels, options


if __name__ == "__main__":
    main()
