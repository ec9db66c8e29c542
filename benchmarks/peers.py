"""Remote small objects: fastload against the peer loaders, one reader per fresh process.

N x 150 KB float32 arrays (.npy objects) on a loopback object store (SeaweedFS for S3,
fake-gcs-server for GCS, our B2 server) behind the proxy adding 20 ms per request. Each reader
runs in its own process (``python -m benchmarks.peers '<spec>'``), so no reader inherits another's
imports, clients or caches: it imports its library (untimed, as fastload's own import is),
builds its dataset, reads a cold epoch (timing the first batch from construction) and a warm
epoch, and prints its rates and the CPU time its process tree (the reader and its DataLoader
workers, user + system) spent on each epoch, construction counted in the cold one. The parent
samples the PSS of that process tree every 50 ms for the peak. Readers run interleaved,
``repeats`` times; medians.

While readers run, the store and the proxy are pinned to half the cores and each reader to the
rest (``split_cores``: core 0 and core 1 on a 2-core machine), so a reader's CPU per sample is
its own, not the loopback store's: the store and proxy cost about 1 ms of CPU a request, which
caps a one-GET-per-sample reader near 1,000 samples/s on one core while a chunk reader is not
capped. Where affinity cannot be set (no ``os.sched_setaffinity``, one core) nothing is pinned
and every row says so.

Readers (batch 32, shuffled). Every peer runs at each DataLoader worker count in
``PEER_WORKERS`` and at its own best documented settings, with persistent workers (torch's
``persistent_workers``, as fastload's loader has by default: without it every epoch starts its
workers again, and each worker its store client); fastload runs at its defaults:
- torch DataLoader + RandomSampler over the store's fsspec filesystem (s3fs, gcsfs, b2);
- the same over fsspec's whole-file cache (``filecache``): warm epochs read local copies;
- AWS s3torchconnector ``S3MapDataset`` (S3 only);
- LitData ``StreamingDataset`` over ``LITDATA_CHUNK`` chunks on the store (S3 only), twice:
  chunks of the objects' ``.npy`` bytes (decoded by its ``transform``) and, its documented way
  for arrays, chunks of the arrays themselves (``optimize`` serialises them);
- Mosaic streaming ``StreamingDataset`` over MDS shards on the store (S3 only), with the
  ``worker_init_fn`` that drops the boto3 client a forked worker inherits (its known fork issue);
- WebDataset over ``TAR_SHARDS`` tar shards on the store, with its shard cache (S3 only);
- fastload ``RemoteDataset`` + npy cache + ``fastload.DataLoader`` defaults;
- fastload ``RemoteDataset(Tar(url))`` over the same tar shards, read in place;
- fastload as above at each worker count (S3 only): how its rates scale, not compared as a peer.

Conversions (LitData chunks, MDS shards, tar shards) are done the fast way a user would: every
object read concurrently straight from the store (not through the latency proxy), written
locally, uploaded; each is timed and reported as the reader's "setup s".
"""

from __future__ import annotations

import contextlib
import functools
import importlib
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
from concurrent.futures import ThreadPoolExecutor
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
from fastload import Cache, Manifest, RemoteDataset, Tar
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

PEER_WORKERS = (0, 2, 4)
REPO = Path(__file__).resolve().parents[1]
SCHEMES = {"s3": "s3", "gcs": "gs", "b2": "b2"}
S3_ONLY = (
    "s3torchconnector",
    "litdata",
    "litdata-arrays",
    "mosaic",
    "webdataset",
    "fastload-tar",
    "fastload-workers",
)
TAR_SHARDS = 20
# litdata 0.2.76 decodes a window of ~107 rows of a chunk and keeps one window: a shuffled epoch
# over 64 MB chunks (427 rows here) refills it for almost every sample (~100 samples/s warm);
# chunks of about one window (16 MB) read at 1,850-2,190/s warm in the same probe.
LITDATA_CHUNK = "16MB"
CONVERT_THREADS = 16
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
    epochs: int = 4  # the first is cold, the second a process's first warm one
    preprocess: bool = False  # apply PREPROCESS (the volumes scenario)
    cache_format: str = "npy"  # fastload's
    workers: int = 2  # the peers' DataLoader workers (fastload runs at its defaults)


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
        dataset,
        batch_size=spec.batch,
        sampler=RandomSampler(dataset),
        num_workers=spec.workers,
        persistent_workers=spec.workers > 0,
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
        dataset,
        batch_size=BATCH,
        sampler=RandomSampler(dataset),
        num_workers=spec.workers,
        persistent_workers=spec.workers > 0,
    )


def _npy_array(body: bytes) -> np.ndarray:
    array: np.ndarray = np.load(io.BytesIO(body))
    return array


def _litdata(spec: Spec, *, arrays: bool) -> Iterable[Any]:
    """LitData over chunks of the arrays (``arrays``) or of the objects' ``.npy`` bytes, which
    its ``transform`` decodes as the other readers decode an object."""
    import litdata  # noqa: PLC0415 (only in its own reader process)
    from litdata.streaming import downloader  # noqa: PLC0415

    # LitData GETs chunks with obstore, whose client refuses plain http unless told; LitData has
    # no option for it, so the benchmark adds allow_http to the client options it passes.
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True  # type: ignore[typeddict-unknown-key]
    dataset = litdata.StreamingDataset(
        f"{spec.root}-{_litdata_suffix(arrays=arrays)}",
        cache_dir=f"{spec.workdir}/litdata",
        shuffle=True,
        storage_options={"endpoint_url": spec.options["endpoint_url"]},
        transform=None if arrays else _npy_array,
    )
    return litdata.StreamingDataLoader(
        dataset, batch_size=BATCH, num_workers=spec.workers, persistent_workers=spec.workers > 0
    )


def _fresh_mosaic_clients(worker: int) -> None:
    """Mosaic's known fork issue: a worker inherits the parent's boto3 client (made while
    reading index.json) and shares its connections; each worker makes its own instead."""
    info = torch.utils.data.get_worker_info()
    for stream in info.dataset.streams if info else ():
        stream._downloader.clean_up()


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
        worker_init_fn=_fresh_mosaic_clients,
        persistent_workers=spec.workers > 0,
    )


@functools.cache
def _filesystem(root: str, options: str, pid: int) -> Any:
    return filesystem(root, json.loads(options))


def _open_in_process(root: str, options: str, url: str, mode: str = "rb", *_: Any) -> Any:
    """``fsspec.open`` on a filesystem of this process (s3fs's is not fork-safe)."""
    return _filesystem(root, options, os.getpid()).open(url, mode)


def _webdataset(spec: Spec) -> Iterable[Any]:
    """WebDataset as its docs set it up: shard shuffle, a sample shuffle buffer, batching in the
    pipeline, shards cached locally (``cache_dir``) for later epochs. Its s3:// opener is fsspec
    (``gopen_schemes`` is its extension point; the alternative is ``pipe:aws s3 cp``)."""
    import webdataset as wds  # noqa: PLC0415 (only in its own reader process)

    os.makedirs(f"{spec.workdir}/wds")
    wds.gopen_schemes["s3"] = partial(_open_in_process, spec.root, json.dumps(spec.options))
    shards, _ = _tar_layout(spec.n)
    urls = [f"{spec.root}-tar/shard-{shard:03d}.tar" for shard in range(shards)]
    dataset = (
        wds.WebDataset(
            urls, shardshuffle=shards, cache_dir=f"{spec.workdir}/wds", empty_check=False
        )
        .shuffle(1000)
        .decode()
        .to_tuple("npy")
        .map_tuple(torch.from_numpy)
        .batched(spec.batch, partial=True)
    )
    return wds.WebLoader(
        dataset, batch_size=None, num_workers=spec.workers, persistent_workers=spec.workers > 0
    )


def _take_npy(sample: dict[str, np.ndarray]) -> np.ndarray:
    return sample["npy"]


def _fastload_tar(spec: Spec) -> Iterable[Any]:
    dataset = RemoteDataset(
        Tar(f"{spec.root}-tar"),
        decode={"npy": "npy"},
        transform=_take_npy,
        cache=Cache(f"{spec.workdir}/fastload", format=spec.cache_format),  # type: ignore[arg-type]
        storage_options=spec.options,
    )
    return fastload.DataLoader(dataset, batch_size=spec.batch, shuffle=True)


def _fastload(spec: Spec, *, chosen_workers: bool = False) -> Iterable[Any]:
    dataset = RemoteDataset(
        Manifest.load(spec.manifest),
        decode="npy",
        transform=PREPROCESS if spec.preprocess else None,
        cache=Cache(f"{spec.workdir}/fastload", format=spec.cache_format),  # type: ignore[arg-type]
        storage_options=spec.options,
    )
    workers = spec.workers if chosen_workers else None
    return fastload.DataLoader(dataset, batch_size=spec.batch, shuffle=True, num_workers=workers)


READERS: dict[str, tuple[str, Callable[[Spec], Iterable[Any]]]] = {
    "torch": ("torch DataLoader + RandomSampler + fsspec", partial(_torch_fsspec, cached=False)),
    "filecache": ("the same over fsspec filecache", partial(_torch_fsspec, cached=True)),
    "s3torchconnector": ("s3torchconnector S3MapDataset", _s3torchconnector),
    "litdata": (
        f"LitData StreamingDataset storing .npy bytes ({LITDATA_CHUNK} chunks on the store)",
        partial(_litdata, arrays=False),
    ),
    "litdata-arrays": (
        f"LitData StreamingDataset storing the arrays ({LITDATA_CHUNK} chunks on the store)",
        partial(_litdata, arrays=True),
    ),
    "mosaic": ("Mosaic streaming StreamingDataset (MDS on the store)", _mosaic),
    "webdataset": (f"WebDataset ({TAR_SHARDS} tar shards, shard cache)", _webdataset),
    "fastload": ("fastload RemoteDataset + npy cache, fastload.DataLoader defaults", _fastload),
    "fastload-workers": (
        "fastload RemoteDataset + npy cache at a chosen worker count",
        partial(_fastload, chosen_workers=True),
    ),
    "fastload-tar": (
        f"fastload RemoteDataset(Tar(url)) over the {TAR_SHARDS} tar shards, same defaults",
        _fastload_tar,
    ),
}
OURS = ("fastload", "fastload-tar")
SWEEPS = ("fastload-workers",)  # fastload at each worker count: how it scales, not a peer
PER_OBJECT = ("torch", "filecache", "s3torchconnector")


# What a peer's reader imports, imported before its clock starts as fastload is (this module
# imports it): a library's import (litdata's is 0.23 s here) is not data loading. It was timed
# in the peers' cold epochs and not in fastload's until 2026-11-28.
PEER_IMPORTS: dict[str, tuple[str, ...]] = {
    "s3torchconnector": ("s3torchconnector",),
    "litdata": ("litdata", "litdata.streaming.downloader"),
    "litdata-arrays": ("litdata", "litdata.streaming.downloader"),
    "webdataset": ("webdataset",),
}
# The clients of a store, imported before every reader's clock as its library is: fastload's
# listing imports s3fs (and with it aiobotocore and aiohttp, 0.16 s of CPU here), which was
# timed in its cold epoch over tar while the peers' own clients (LitData's downloader's) were
# imported before theirs, until 2026-11-28 (evening).
STORE_CLIENTS: dict[str, tuple[str, ...]] = {
    "s3": ("s3fs", "obstore"),
    "gcs": ("gcsfs",),
    "b2": ("b2sdk.v2",),
}


def import_reader(reader: str, store: str) -> None:
    """Import ``reader``'s library (see ``PEER_IMPORTS``) and ``store``'s clients (see
    ``STORE_CLIENTS``; one not installed is one no reader uses)."""
    if reader == "mosaic":
        _mosaic_modules()
    for module in PEER_IMPORTS.get(reader, ()):
        importlib.import_module(module)
    for module in STORE_CLIENTS[store]:
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(module)


def _descendants(pid: int) -> Iterator[int]:
    """The live children of process ``pid`` (each thread's), their children, ... (Linux)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # the thread ended
            for child in (task / "children").read_text().split():
                yield int(child)
                yield from _descendants(int(child))


def _cpu_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of ``pid``: its own CPU and its reaped children's."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(field) for field in fields[11:15])


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and every descendant, live or ended: a
    DataLoader worker that ended is in the cutime of the parent that reaped it (the reader, or
    a forkserver that is itself a live descendant). Linux; /proc's 10 ms ticks."""
    ticks = 0
    for process in (pid, *_descendants(pid)):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it just ended
            ticks += _cpu_ticks(process)
    return ticks / os.sysconf("SC_CLK_TCK")


def _epochs(spec: Spec) -> dict[str, Any]:
    """In the child: construct, then read ``spec.epochs`` epochs (the first batch of the first,
    cold, one timed from construction, after the reader's imports); samples/s per epoch, and of
    the cold epoch after its first batch (what is left once workers, listing and indexing are
    done); the process tree's CPU microseconds per sample of each epoch, construction in the
    first."""
    import_reader(spec.reader, spec.store)
    cpu = tree_cpu_seconds(os.getpid())
    started = time.perf_counter()
    loader = READERS[spec.reader][1](spec)
    first = 0.0
    rates, cpu_us = [], []
    after_first = 0.0
    for epoch in range(spec.epochs):
        count = 0
        for batch in loader:
            size = len(batch[0] if isinstance(batch, list | tuple) else batch)
            if not first:
                first, first_size = time.perf_counter() - started, size
            count += size
        assert count == spec.n, f"{spec.reader}: epoch {epoch} gave {count} of {spec.n} samples"
        ended = time.perf_counter()
        rates.append(spec.n / (ended - started))
        cpu, spent = tree_cpu_seconds(os.getpid()), cpu
        cpu_us.append((cpu - spent) / spec.n * 1e6)
        if epoch == 0:  # nothing after a first batch that was the whole epoch
            after = spec.n - first_size
            after_first = after / (ended - started - first) if after else float("nan")
        started = time.perf_counter()
    return {"epochs": rates, "first": first, "after first": after_first, "cpu us": cpu_us}


# --- the parent ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cores:
    """Where the store and proxy run and where each reader runs while readers are timed
    (empty: not pinned), and a note saying so for the rows."""

    store: frozenset[int]
    readers: frozenset[int]
    note: str


def split_cores() -> Cores:
    """The store and proxy on the first half of this process's cores, the readers on the rest
    (core 0 and core 1 on 2 cores); nothing pinned where affinity cannot be set."""
    if not hasattr(os, "sched_setaffinity"):
        return Cores(frozenset(), frozenset(), "not pinned: no os.sched_setaffinity here")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return Cores(frozenset(), frozenset(), "not pinned: one core")
    store, readers = cores[: len(cores) // 2], cores[len(cores) // 2 :]
    note = f"store + proxy on {_named(store)}, each reader on {_named(readers)}"
    return Cores(frozenset(store), frozenset(readers), note)


def _named(cores: list[int]) -> str:
    """``core 1`` or ``cores 8-15`` (``cores`` sorted and consecutive, as ``split_cores``'s)."""
    return f"core {cores[0]}" if len(cores) == 1 else f"cores {cores[0]}-{cores[-1]}"


def _pin_threads(pid: int, cores: frozenset[int] | set[int]) -> None:
    """Every thread of process ``pid`` on ``cores`` (threads it starts later inherit them)."""
    with contextlib.suppress(FileNotFoundError):  # the process ended
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):  # the thread ended
                os.sched_setaffinity(int(task.name), cores)


@contextlib.contextmanager
def servers_pinned(cores: Cores, servers: Iterable[int | None]) -> Iterator[None]:
    """The process trees ``servers`` (the store and the proxy: their PIDs, None for one not
    running) and this process's threads (the PSS sampling) on ``cores.store`` while the block
    runs; this process's cores restored after (the servers stop after it)."""
    if not cores.store:
        yield
        return
    own = os.sched_getaffinity(0)
    for pid in filter(None, servers):
        for process in (pid, *_descendants(pid)):
            _pin_threads(process, cores.store)
    _pin_threads(os.getpid(), cores.store)
    try:
        yield
    finally:
        _pin_threads(os.getpid(), own)


class ReaderFailed(RuntimeError):
    """A reader process exited non-zero; the message ends with its last stderr line."""


def _reader_command(cores: frozenset[int]) -> list[str]:
    """``python -m benchmarks.peers``, on ``cores`` from its first instruction where given:
    every thread and worker the reader starts inherits them."""
    if not cores:
        return [sys.executable, "-m", "benchmarks.peers"]
    pin = f"import os, runpy; os.sched_setaffinity(0, {sorted(cores)})"
    run = "runpy.run_module('benchmarks.peers', run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", f"{pin}; {run}"]


def run_reader(spec: Spec, cores: frozenset[int] = frozenset()) -> dict[str, Any]:
    """One reader in a fresh process on ``cores`` (empty: where the OS puts it); its rates, CPU
    and the peak PSS of its process tree."""
    path = os.pathsep.join([str(REPO / "src"), str(REPO)])  # this checkout's fastload
    env = {**os.environ, **spec.credentials, "PYTHONPATH": path}
    out, err = Path(spec.workdir) / "reader.out", Path(spec.workdir) / "reader.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        child = subprocess.Popen(
            [*_reader_command(cores), json.dumps(asdict(spec))],
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


class _Objects:
    """The source objects, read the way a converting user would: concurrently, straight from
    the store (``options`` without the latency proxy)."""

    def __init__(self, root: str, options: dict[str, Any]) -> None:
        self.fs = filesystem(root, options)
        self.prefix = self.fs._strip_protocol(root)

    def body(self, i: int) -> bytes:
        return bytes(self.fs.cat_file(f"{self.prefix}/{i:05d}.npy"))

    def array(self, i: int) -> np.ndarray:
        return np.load(io.BytesIO(self.body(i)))

    def all(self, n: int, read: Callable[[int], Any]) -> Iterator[Any]:
        with ThreadPoolExecutor(CONVERT_THREADS) as pool:
            yield from pool.map(read, range(n))


def _upload(objects: _Objects, local: Path, remote: str) -> None:
    objects.fs.put(str(local), remote, recursive=True)


def _litdata_suffix(*, arrays: bool) -> str:
    return "litdata-arrays" if arrays else "litdata"


def _convert_litdata(objects: _Objects, root: str, n: int, work: Path, *, arrays: bool) -> None:
    """``litdata.optimize`` into ``LITDATA_CHUNK`` chunks of the arrays (``arrays``: LitData
    serialises them) or of the objects' bytes, with a worker per core, uploaded."""
    import litdata  # noqa: PLC0415 (only where LitData runs)

    items = list(objects.all(n, objects.array if arrays else objects.body))
    out = work / f"{_litdata_suffix(arrays=arrays)}-out"
    litdata.optimize(
        fn=items.__getitem__,
        inputs=list(range(n)),
        output_dir=str(out),
        chunk_bytes=LITDATA_CHUNK,
        num_workers=os.cpu_count() or 1,
    )
    _upload(objects, out, f"{root}-{_litdata_suffix(arrays=arrays)}")


def _convert_mosaic(objects: _Objects, root: str, n: int, work: Path) -> None:
    """``MDSWriter`` (its default 64 MB shards) fed by concurrent reads, uploaded."""
    streaming = _mosaic_modules()
    out = work / "mds-out"
    columns = {"x": f"ndarray:float32:{SHAPE[0]},{SHAPE[1]}"}
    with streaming.MDSWriter(out=str(out), columns=columns) as writer:
        for array in objects.all(n, objects.array):
            writer.write({"x": array})
    _upload(objects, out, f"{root}-mds")


def _tar_layout(n: int) -> tuple[int, int]:
    """How ``n`` samples go into tar shards: (shards, samples per shard), none empty."""
    per = -(-n // TAR_SHARDS)
    return -(-n // per), per


def _pack_tar(objects: _Objects, root: str, n: int, work: Path) -> None:
    """``TAR_SHARDS`` tar shards (``00042.npy`` members, the WebDataset layout), uploaded."""
    out = work / "tar-out"
    out.mkdir()
    shards, per = _tar_layout(n)
    bodies = objects.all(n, objects.body)
    for shard in range(shards):
        with tarfile.open(out / f"shard-{shard:03d}.tar", mode="w") as tar:
            for i in range(shard * per, min(n, (shard + 1) * per)):
                body = next(bodies)
                info = tarfile.TarInfo(f"{i:05d}.npy")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    _upload(objects, out, f"{root}-tar")


CONVERSIONS: dict[str, Callable[[_Objects, str, int, Path], None]] = {
    "litdata": partial(_convert_litdata, arrays=False),
    "litdata-arrays": partial(_convert_litdata, arrays=True),
    "mosaic": _convert_mosaic,
    "webdataset": _pack_tar,  # fastload-tar reads the same shards: a user's own data
}


def _credentials(server: Any, endpoint: str) -> dict[str, str]:
    if not isinstance(server, SeaweedS3Server):
        return {}
    return {
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_REGION": "us-east-1",
        "S3_ENDPOINT_URL": endpoint,  # Mosaic streaming
    }


def _runs(readers: list[str], workers: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """(reader, DataLoader workers): fastload at its defaults, each peer at every count but the
    one-GET-per-sample readers at 0 (one GET at a time: always their slowest)."""
    runs: list[tuple[str, int | None]] = []
    for reader in readers:
        counts = [w for w in workers if w or reader not in PER_OBJECT] or list(workers)
        runs += [(reader, None)] if reader in OURS else [(reader, w) for w in counts]
    return runs


def store_rows(
    store: str,
    n: int,
    repeats: int,
    progress: Callable[[str], None],
    only: Iterable[str] = tuple(READERS),
    workers: tuple[int, ...] = PEER_WORKERS,
) -> list[dict[str, Any]]:
    readers = [r for r in only if store == "s3" or r not in S3_ONLY]
    runs = _runs(readers, workers)
    results: dict[tuple[str, int | None], list[dict[str, Any]]] = {run: [] for run in runs}
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
        objects = _Objects(root, server.storage_options())
        for reader, convert in CONVERSIONS.items():
            if reader in readers or (reader == "webdataset" and "fastload-tar" in readers):
                progress(f"peers/{store}: converting for {reader}")
                started = time.perf_counter()
                convert(objects, root, n, work)
                setup[reader] = time.perf_counter() - started
        cores = split_cores()
        progress(f"peers/{store}: {cores.note}")
        with servers_pinned(cores, (server.pid, proxy.pid)):
            for repeat in range(repeats):  # interleaved, so noise hits every reader alike
                for reader, count in runs:
                    progress(f"peers/{store}: {reader}, workers {count} ({repeat + 1}/{repeats})")
                    run = work / f"{reader}-{count}-{repeat}"
                    run.mkdir()
                    spec = Spec(
                        reader, store, root, options, str(work / "manifest.npz"), str(run), n,
                        _credentials(server, proxy.endpoint), workers=count or 0,
                        epochs=2 if reader in PER_OBJECT else Spec.epochs,  # nothing kept
                    )  # fmt: skip
                    try:
                        results[reader, count].append(run_reader(spec, cores.readers))
                    except ReaderFailed as exc:
                        if reader in OURS:
                            raise
                        progress(f"peers/{store}: {exc}")  # a peer's own bug: the others go on
                    shutil.rmtree(run)
    return [
        {
            **_row(store, reader, count, found, setup.get(reader), repeats - len(found)),
            "cores": cores.note,
        }
        for (reader, count), found in results.items()
    ]


def _row(
    store: str,
    reader: str,
    workers: int | None,
    runs: list[dict[str, Any]],
    setup: float | None,
    failed: int,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "store": store,
        "reader": READERS[reader][0],
        "workers": "defaults" if workers is None else workers,
    }
    if not runs:
        return {**row, "failed runs": failed}
    setup_s = "" if setup is None else setup
    return {**row, **summary(runs), "setup s": setup_s, "failed runs": failed}


def _later(runs: list[dict[str, Any]], key: str) -> list[float]:
    """Each run's ``key`` figures of its epochs after the second (the second's where none)."""
    return [x for run in runs for x in run[key][2:]] or [run[key][1] for run in runs]


def summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over repeats: cold (first epoch), warm (the second: a process's first warm
    epoch) and later warm (the rest; the second's where there is none) rates and the reader's
    CPU per sample in each (construction counted in the cold one), first batch, PSS."""
    return {
        "cold samples/s": statistics.median(run["epochs"][0] for run in runs),
        "cold after first batch samples/s": statistics.median(run["after first"] for run in runs),
        "warm samples/s": statistics.median(run["epochs"][1] for run in runs),
        "later warm samples/s": statistics.median(_later(runs, "epochs")),
        "cold CPU us/sample": statistics.median(run["cpu us"][0] for run in runs),
        "warm CPU us/sample": statistics.median(run["cpu us"][1] for run in runs),
        "later warm CPU us/sample": statistics.median(_later(runs, "cpu us")),
        "first batch s": statistics.median(run["first"] for run in runs),
        "peak PSS MiB": statistics.median(run["pss"] for run in runs),
    }


def with_ratios(rows: list[dict[str, Any]], base: str) -> list[dict[str, Any]]:
    """Cold and warm rates against the first row (the ``base`` reader)."""
    for row in rows:
        for kind in ("cold", "warm"):
            row[f"{kind} vs {base}"] = row[f"{kind} samples/s"] / rows[0][f"{kind} samples/s"]
    return rows


def with_best(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each fastload row's cold and warm rates against the best peer of its store, each peer
    at its best worker count (named), and its CPU per sample against the least a peer spent
    (above 1: fastload spent more), appended to the rows."""
    ours = {READERS[r][0] for r in OURS + SWEEPS}
    for row in rows:
        if row["reader"] not in ours or row["workers"] != "defaults" or "cold samples/s" not in row:
            continue
        peers = [p for p in rows if p["store"] == row["store"] and p["reader"] not in ours]
        for kind in ("cold", "warm", "later warm"):
            rate, cpu = f"{kind} samples/s", f"{kind} CPU us/sample"
            _against(row, peers, rate, (f"{kind} vs best peer", f"best {kind} peer"), max)
            _against(row, peers, cpu, (f"{kind} CPU vs least peer", f"least {kind} CPU peer"), min)
    return rows


def _against(
    row: dict[str, Any], peers: list[dict[str, Any]], column: str, keys: tuple[str, str], pick: Any
) -> None:
    """``row[column]`` over that of the peer ``pick`` (max or min) chooses, and that peer, as
    ``keys`` (the ratio's, the peer's); none where that peer's is 0 (CPU under a 10 ms tick)."""
    best = pick((p for p in peers if column in p), key=lambda p: p[column], default=None)
    if best is not None and best[column]:
        row[keys[0]] = row[column] / best[column]
        row[keys[1]] = f"{best['reader'].split(' (')[0]}, {best['workers']} w"


def peer_rows(
    n: int,
    repeats: dict[str, int],
    progress: Callable[[str], None],
    only: Iterable[str] = tuple(READERS),
    workers: tuple[int, ...] = PEER_WORKERS,
) -> list[dict[str, Any]]:
    """The table for each store in ``repeats`` (store -> repeats), for the readers ``only``."""
    rows = []
    for store, times in repeats.items():
        rows += with_best(store_rows(store, n, times, progress, only, workers))
    return rows


def run_peers(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    if quick:  # S3; the smoke tests run every reader on every store
        readers = ("torch", "s3torchconnector", "litdata", "litdata-arrays", *OURS, *SWEEPS)
        return peer_rows(32, {"s3": 1}, progress, readers, (2,))
    return peer_rows(2000, {"s3": 3, "gcs": 1, "b2": 1}, progress)


if __name__ == "__main__":
    fields = json.loads(sys.argv[1])
    print(json.dumps(_epochs(Spec(**fields))))
