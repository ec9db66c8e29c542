"""Remote small objects: fastload against the peer loaders, one reader per fresh process.

N x 150 KB float32 arrays (.npy objects) on a loopback object store (SeaweedFS for S3,
fake-gcs-server for GCS, our B2 server) behind the proxy adding 20 ms per request. Each reader
runs in its own process (``python -m benchmarks.peers '<spec>'``), so no reader inherits another's
imports, clients or caches: it builds its dataset, reads a cold epoch (timing the first batch
from construction) and a warm epoch, and prints its rates. The parent samples the PSS of that
process tree every 50 ms for the peak. Readers run interleaved, ``repeats`` times; medians.

Readers (batch 32, shuffled; the peers with 2 DataLoader workers, what a user sets on 2 cores):
- torch DataLoader + RandomSampler over the store's fsspec filesystem (s3fs, gcsfs, b2);
- the same over fsspec's whole-file cache (``filecache``): warm epochs read local copies;
- AWS s3torchconnector ``S3MapDataset`` (S3 only);
- LitData ``StreamingDataset`` over chunks on the store (S3 only), conversion timed;
- Mosaic streaming ``StreamingDataset`` over MDS shards on the store (S3 only), conversion timed;
- fastload ``RemoteDataset`` + npy cache + ``fastload.DataLoader`` defaults;
- the same samples packed in ``TAR_SHARDS`` tar shards (WebDataset layout) on the store, read in
  place by ``RemoteDataset(shards="tar")`` (the ``shards`` scenario: the shards are the data a
  user already has, so fastload converts nothing; packing them is not timed as a conversion).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import numpy as np
import torch
from fsspec.implementations.cached import WholeFileCacheFileSystem
from torch.utils.data import DataLoader, Dataset, RandomSampler

import fastload
from benchmarks.cache import BATCH, BUCKET, LATENCY, SHAPE, npy_bytes, sample_array
from fastload import Cache, Manifest, RemoteDataset
from fastload.stores import filesystem
from fastload.testing import (
    B2Server,
    FakeGcsServer,
    FaultProxy,
    Faults,
    SeaweedS3Server,
    ServerProcess,
    tree_pss_kib,
)
from fastload.transforms import QuantileNormalize, Resize, compose

WORKERS = 2
REPO = Path(__file__).resolve().parents[1]
SCHEMES = {"s3": "s3", "gcs": "gs", "b2": "b2"}
S3_ONLY = ("s3torchconnector", "litdata", "mosaic")
TAR_SHARDS = 20
# The volumes scenario's preprocessing: robust intensity normalisation, then a resize.
PREPROCESS = compose(QuantileNormalize(), Resize((48, 256, 256)))


@dataclass(frozen=True)
class Spec:
    """What one reader process needs: where the objects are and where it may write."""

    reader: str
    store: str
    root: str  # e.g. s3://bench/peers
    options: dict[str, Any]  # storage options through the proxy
    manifest: str  # a saved fastload Manifest of root
    workdir: str  # this run's scratch directory (caches)
    n: int
    credentials: dict[str, str]  # env for the SDK-based peers (S3)
    batch: int = BATCH
    epochs: int = 2  # the first is cold
    preprocess: bool = False  # apply PREPROCESS (the volumes scenario)
    cache_format: str = "npy"  # fastload's
    workers: int = WORKERS  # the peers' DataLoader workers


def _load(body: bytes) -> torch.Tensor:
    return torch.from_numpy(np.load(io.BytesIO(body)))


# --- the readers (run in the child process) -----------------------------------------------------


class FsspecArrays(Dataset[torch.Tensor]):
    """The plain-PyTorch way: one ``cat_file`` per sample from an fsspec filesystem, opened
    lazily in each worker (fsspec's async filesystems are not fork-safe)."""

    def __init__(self, spec: Spec, *, cached: bool) -> None:
        self.spec, self.cached = spec, cached
        self.paths = [url.split("://", 1)[1] for url in Manifest.load(spec.manifest).urls()]
        self._fs: Any = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._fs is None:
            self._fs = filesystem(self.spec.root, self.spec.options)
            if self.cached:
                self._fs = WholeFileCacheFileSystem(
                    fs=self._fs, cache_storage=f"{self.spec.workdir}/fsspec"
                )
        array = np.load(io.BytesIO(self._fs.cat_file(self.paths[index])))
        return torch.from_numpy(PREPROCESS(array) if self.spec.preprocess else array)


def _torch_fsspec(spec: Spec, *, cached: bool) -> Iterable[Any]:
    dataset = FsspecArrays(spec, cached=cached)
    return DataLoader(
        dataset, batch_size=spec.batch, sampler=RandomSampler(dataset), num_workers=spec.workers
    )


def _s3torchconnector(spec: Spec) -> Iterable[Any]:
    from s3torchconnector import S3ClientConfig, S3MapDataset  # noqa: PLC0415 (only in its own reader process)

    dataset = S3MapDataset.from_prefix(
        spec.root + "/",
        region="us-east-1",
        endpoint=spec.options["endpoint_url"],
        s3client_config=S3ClientConfig(force_path_style=True),
        transform=lambda obj: _load(obj.read()),
    )
    return DataLoader(
        dataset, batch_size=BATCH, sampler=RandomSampler(dataset), num_workers=spec.workers
    )


def _litdata(spec: Spec) -> Iterable[Any]:
    import litdata  # noqa: PLC0415 (only in its own reader process)
    from litdata.streaming import downloader  # noqa: PLC0415

    # LitData GETs chunks with obstore, whose client refuses plain http unless told; LitData has
    # no option for it, so the benchmark adds allow_http to the client options it passes.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[typeddict-unknown-key]
    dataset = litdata.StreamingDataset(
        f"{spec.root}-litdata",
        cache_dir=f"{spec.workdir}/litdata",
        shuffle=True,
        storage_options={"endpoint_url": spec.options["endpoint_url"]},
    )
    return litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=spec.workers)


def _mosaic_modules() -> Any:
    """Import Mosaic streaming without its torchvision-based ``streaming.vision`` helpers.

    ``streaming/__init__`` imports its image datasets, which import torchvision; the torchvision
    wheel the registry serves for torch 2.13 is a CUDA build that cannot load beside the CPU torch
    here. ``StreamingDataset`` and ``MDSWriter`` do not use those helpers.
    """
    for name in ("streaming.vision", "streaming.multimodal"):
        sys.modules.setdefault(name, types.ModuleType(name))
    import streaming  # noqa: PLC0415 (only in its own reader process)

    return streaming


def _mosaic(spec: Spec) -> Iterable[Any]:
    streaming = _mosaic_modules()
    streaming.base.util.clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(
        remote=f"{spec.root}-mds",
        local=f"{spec.workdir}/mosaic",
        shuffle=True,
        batch_size=BATCH,
    )
    return DataLoader(
        dataset,
        batch_size=BATCH,
        num_workers=spec.workers,
        collate_fn=lambda rows: torch.from_numpy(np.stack([r["x"] for r in rows])),
    )


def _take_npy(sample: dict[str, np.ndarray]) -> np.ndarray:
    return sample["npy"]


def _fastload_tar(spec: Spec) -> Iterable[Any]:
    dataset = RemoteDataset(
        f"{spec.root}-tar",
        shards="tar",
        decode={"npy": "npy"},
        transform=_take_npy,
        cache=Cache(f"{spec.workdir}/fastload", format=spec.cache_format),  # type: ignore[arg-type]
        storage_options=spec.options,
    )
    return fastload.DataLoader(dataset, batch_size=spec.batch, shuffle=True)


def _fastload(spec: Spec) -> Iterable[Any]:
    dataset = RemoteDataset(
        Manifest.load(spec.manifest),
        decode="npy",
        transform=PREPROCESS if spec.preprocess else None,
        cache=Cache(f"{spec.workdir}/fastload", format=spec.cache_format),  # type: ignore[arg-type]
        storage_options=spec.options,
    )
    return fastload.DataLoader(dataset, batch_size=spec.batch, shuffle=True)


READERS: dict[str, tuple[str, Callable[[Spec], Iterable[Any]]]] = {
    "torch": (
        "torch DataLoader + RandomSampler + fsspec, 2 workers",
        partial(_torch_fsspec, cached=False),
    ),
    "filecache": ("the same over fsspec filecache, 2 workers", partial(_torch_fsspec, cached=True)),
    "s3torchconnector": ("s3torchconnector S3MapDataset, 2 workers", _s3torchconnector),
    "litdata": ("LitData StreamingDataset (chunks on the store), 2 workers", _litdata),
    "mosaic": ("Mosaic streaming StreamingDataset (MDS on the store), 2 workers", _mosaic),
    "fastload": ("fastload RemoteDataset + npy cache, fastload.DataLoader defaults", _fastload),
    "fastload-tar": (
        f"fastload RemoteDataset(shards='tar') over {TAR_SHARDS} tar shards, same defaults",
        _fastload_tar,
    ),
}


PEER_READERS = tuple(r for r in READERS if r != "fastload-tar")  # tar: the shards scenario


def _epochs(spec: Spec) -> dict[str, Any]:
    """In the child: construct, then read ``spec.epochs`` epochs (the first batch of the first,
    cold, one timed from construction); samples/s per epoch."""
    started = time.perf_counter()
    loader = READERS[spec.reader][1](spec)
    first = 0.0
    rates = []
    for epoch in range(spec.epochs):
        count = 0
        for batch in loader:
            if not first:
                first = time.perf_counter() - started
            count += len(batch)
        assert count == spec.n, f"{spec.reader}: epoch {epoch} gave {count} of {spec.n} samples"
        rates.append(spec.n / (time.perf_counter() - started))
        started = time.perf_counter()
    return {"epochs": rates, "first": first}


# --- the parent ---------------------------------------------------------------------------------


class ReaderFailed(RuntimeError):
    """A reader process exited non-zero; the message ends with its last stderr line."""


def run_reader(spec: Spec) -> dict[str, Any]:
    """One reader in a fresh process; its rates and the peak PSS of its process tree."""
    env = {**os.environ, **spec.credentials, "PYTHONPATH": str(REPO)}
    out, err = Path(spec.workdir) / "reader.out", Path(spec.workdir) / "reader.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.peers", json.dumps(asdict(spec))],
            env=env,
            cwd=REPO,
            stdout=stdout,
            stderr=stderr,
        )
        peak = 0
        while child.poll() is None:
            peak = max(peak, tree_pss_kib(child.pid))
            time.sleep(0.05)
    if child.returncode:
        lines = err.read_text(errors="replace").strip().splitlines() or ["(no output)"]
        raise ReaderFailed(f"benchmark reader {spec.reader} on {spec.store}: {lines[-1]}")
    return {**json.loads(out.read_text().strip().splitlines()[-1]), "pss": peak / 1024}


def _server(store: str) -> ServerProcess:
    return {"s3": SeaweedS3Server, "gcs": FakeGcsServer, "b2": B2Server}[store]()


@contextlib.contextmanager
def objects_on(
    store: str, n: int, make: Callable[[int], np.ndarray], faults: Faults
) -> Iterator[tuple[Any, FaultProxy, str]]:
    """``n`` arrays ``make(i)`` as .npy objects on a fresh ``store`` server, behind a proxy
    injecting ``faults``: the server, the proxy and the objects' root URL."""
    server = _server(store)
    with server:
        server.create_bucket(BUCKET)  # type: ignore[attr-defined]
        root = f"{SCHEMES[store]}://{BUCKET}/peers"
        fs = filesystem(root, server.storage_options())  # type: ignore[attr-defined]
        for i in range(n):  # one at a time: volumes are large
            fs.pipe_file(f"{BUCKET}/peers/{i:05d}.npy", npy_bytes(make(i)))
        with FaultProxy(
            server.endpoint,  # type: ignore[attr-defined]
            flavor=store,  # type: ignore[arg-type]
            faults=faults,
        ) as proxy:
            yield server, proxy, root


def _convert_litdata(root: str, options: dict[str, Any], n: int, work: Path) -> float:
    """LitData's conversion: read every object through the proxy, ``optimize`` into 64 MB
    chunks, upload the chunks beside the objects. Seconds."""
    import litdata  # noqa: PLC0415 (only in its own reader process)

    started = time.perf_counter()
    litdata.optimize(
        fn=partial(_fetch_array, root, json.dumps(options)),
        inputs=list(range(n)),
        output_dir=str(work / "litdata-out"),
        chunk_bytes="64MB",
        num_workers=1,
    )
    filesystem(root, options).put(str(work / "litdata-out"), f"{root}-litdata", recursive=True)
    return time.perf_counter() - started


def _convert_mosaic(root: str, options: dict[str, Any], n: int, work: Path) -> float:
    """Mosaic's conversion: read every object through the proxy, write MDS shards with
    ``MDSWriter``, upload them beside the objects. Seconds."""
    streaming = _mosaic_modules()
    started = time.perf_counter()
    out = work / "mds-out"
    columns = {"x": f"ndarray:float32:{SHAPE[0]},{SHAPE[1]}"}
    with streaming.MDSWriter(out=str(out), columns=columns, size_limit="64mb") as writer:
        for i in range(n):
            writer.write({"x": _fetch_array(root, json.dumps(options), i)})
    filesystem(root, options).put(str(out), f"{root}-mds", recursive=True)
    return time.perf_counter() - started


def _pack_tar(root: str, options: dict[str, Any], n: int) -> None:
    """The samples as ``TAR_SHARDS`` tar shards (``00042.npy`` members) beside the objects."""
    fs = filesystem(root, options)
    per = -(-n // TAR_SHARDS)
    for shard in range(TAR_SHARDS):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for i in range(shard * per, min(n, (shard + 1) * per)):
                body = npy_bytes(sample_array(i))
                info = tarfile.TarInfo(f"{i:05d}.npy")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
        fs.pipe_file(f"{fs._strip_protocol(root)}-tar/shard-{shard:03d}.tar", out.getvalue())


@functools.cache
def _source(root: str, options: str) -> Any:
    return filesystem(root, json.loads(options))


def _fetch_array(root: str, options: str, i: int) -> np.ndarray:
    fs = _source(root, options)
    return np.load(io.BytesIO(fs.cat_file(f"{fs._strip_protocol(root)}/{i:05d}.npy")))


def _credentials(server: Any, endpoint: str) -> dict[str, str]:
    if not isinstance(server, SeaweedS3Server):
        return {}
    return {
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_REGION": "us-east-1",
        "S3_ENDPOINT_URL": endpoint,  # Mosaic streaming
    }


def store_rows(
    store: str,
    n: int,
    repeats: int,
    progress: Callable[[str], None],
    only: Iterable[str] = PEER_READERS,
) -> list[dict[str, Any]]:
    readers = [r for r in only if store == "s3" or r not in S3_ONLY]
    results: dict[str, list[dict[str, Any]]] = {r: [] for r in readers}
    setup: dict[str, float] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        objects_on(store, n, sample_array, Faults(latency=LATENCY)) as (
            server,
            proxy,
            root,
        ),
    ):
        work = Path(tmp)
        options = server.storage_options(proxy.endpoint)
        started = time.perf_counter()
        manifest = Manifest.build(root, storage_options=options)
        manifest.save(work / "manifest.npz")
        setup["fastload"] = time.perf_counter() - started
        if "litdata" in readers:
            setup["litdata"] = _convert_litdata(root, options, n, work)
        if "mosaic" in readers:
            setup["mosaic"] = _convert_mosaic(root, options, n, work)
        if "fastload-tar" in readers:
            _pack_tar(root, server.storage_options(), n)
        for repeat in range(repeats):  # interleaved, so noise hits every reader alike
            for reader in readers:
                progress(f"peers/{store}: {reader} (repeat {repeat + 1}/{repeats})")
                run = work / f"{reader}-{repeat}"
                run.mkdir()
                spec = Spec(
                    reader,
                    store,
                    root,
                    options,
                    str(work / "manifest.npz"),
                    str(run),
                    n,
                    _credentials(server, proxy.endpoint),
                )
                try:
                    results[reader].append(run_reader(spec))
                except ReaderFailed as exc:
                    if reader == "fastload":
                        raise
                    progress(f"peers/{store}: {exc}")  # a peer's own bug: the others go on
                shutil.rmtree(run)
    return [
        _row(store, reader, runs, setup.get(reader), repeats - len(runs))
        for reader, runs in results.items()
    ]


def _row(
    store: str, reader: str, runs: list[dict[str, Any]], setup: float | None, failed: int
) -> dict[str, Any]:
    if not runs:
        raise ReaderFailed(f"benchmark reader {reader} on {store} failed in every repeat")
    return {
        "store": store,
        "reader": READERS[reader][0],
        **summary(runs),
        "setup s": "" if setup is None else setup,
        "failed runs": failed,
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over repeats: cold (first epoch) and warm (later epochs) rates, first batch, PSS."""
    return {
        "cold samples/s": statistics.median(run["epochs"][0] for run in runs),
        "warm samples/s": statistics.median(r for run in runs for r in run["epochs"][1:]),
        "first batch s": statistics.median(run["first"] for run in runs),
        "peak PSS MiB": statistics.median(run["pss"] for run in runs),
    }


def peer_rows(
    n: int,
    repeats: dict[str, int],
    progress: Callable[[str], None],
    only: Iterable[str] = PEER_READERS,
) -> list[dict[str, Any]]:
    """The table for each store in ``repeats`` (store -> repeats), for the readers ``only``."""
    rows = []
    for store, times in repeats.items():
        rows += with_ratios(store_rows(store, n, times, progress, only))
    return rows


def with_ratios(rows: list[dict[str, Any]], base: str = "torch") -> list[dict[str, Any]]:
    """Cold and warm rates against the first row (the plain torch + fsspec reader)."""
    for row in rows:
        for kind in ("cold", "warm"):
            row[f"{kind} vs {base}"] = row[f"{kind} samples/s"] / rows[0][f"{kind} samples/s"]
    return rows


def worker_rows(
    n: int, counts: tuple[int, ...], progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    """LitData and Mosaic at each DataLoader worker count in ``counts`` (S3, one run each): is
    2 workers, what the peers tables use on 2 cores, their best?"""
    rows = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        objects_on("s3", n, sample_array, Faults(latency=LATENCY)) as (server, proxy, root),
    ):
        work = Path(tmp)
        options = server.storage_options(proxy.endpoint)
        Manifest.build(root, storage_options=options).save(work / "manifest.npz")
        _convert_litdata(root, options, n, work)
        _convert_mosaic(root, options, n, work)
        for reader in ("litdata", "mosaic"):
            for workers in counts:
                progress(f"workers: {reader}, {workers} workers")
                run = work / f"{reader}-{workers}"
                run.mkdir()
                spec = Spec(
                    reader, "s3", root, options, str(work / "manifest.npz"), str(run), n,
                    _credentials(server, proxy.endpoint), workers=workers,
                )  # fmt: skip
                try:
                    rows.append(
                        {"reader": reader, "workers": workers, **summary([run_reader(spec)])}
                    )
                except ReaderFailed as exc:
                    rows.append({"reader": reader, "workers": workers, "failed": str(exc)[-120:]})
                shutil.rmtree(run)
    return rows


def run_peer_workers(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return worker_rows(64 if quick else 2000, (1, 2) if quick else (1, 2, 4), progress)


def run_shards(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The peers' samples packed in tar shards, read in place, beside the chunk-converting peers
    (S3 only: LitData and Mosaic read S3)."""
    readers = ("torch", "litdata", "mosaic", "fastload", "fastload-tar")
    if quick:
        return peer_rows(64, {"s3": 1}, progress, ("torch", "fastload-tar"))
    return peer_rows(2000, {"s3": 3}, progress, readers)


def run_peers(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    if quick:  # S3, no conversions: the smoke tests run every reader on every store
        return peer_rows(32, {"s3": 1}, progress, ("torch", "s3torchconnector", "fastload"))
    return peer_rows(2000, {"s3": 3, "gcs": 1, "b2": 1}, progress)


if __name__ == "__main__":
    fields = json.loads(sys.argv[1])
    print(json.dumps(_epochs(Spec(**fields))))
