"""DeviceLoader (CPU here; CUDA tests marked ``cuda``), the stall report and diagnose()."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import tarfile
import threading
import time
import uuid
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastload
from fastload import (
    Cache,
    ConfigError,
    DeviceLoader,
    MissingExtraError,
    RemoteDataset,
    Tar,
    UnsupportedSampleError,
)
from fastload.stall import DATA_BOUND_ABOVE, StallReport, _write_time, batch_size_of
from fastload.stats import QUEUE_KNOWN, CacheStats, thread_times
from fastload.testing import FaultProxy, Faults, S3Server, free_port
from tests.conftest import BUCKET, in_forked_child
from tests.test_dataset import upload

Pair = namedtuple("Pair", ["x", "y"])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


class Batches:
    """``count`` batches of ``size`` samples, each taking ``delay`` seconds to produce."""

    def __init__(self, count: int = 12, size: int = 4, delay: float = 0.0) -> None:
        self.count, self.size, self.delay = count, size, delay

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(self.count):
            time.sleep(self.delay)
            yield {"x": torch.full((self.size, 3, 4, 4), float(i)), "y": torch.arange(self.size)}


def run(loader: DeviceLoader, step: float) -> StallReport:
    for _ in loader:
        time.sleep(step)
    return loader.report()


def test_cpu_passes_batches_through_with_conversions() -> None:
    batch = {
        "img": torch.rand(2, 3, 4, 4),
        "label": torch.tensor([1, 2]),
        "pair": Pair(np.ones((2, 2), np.float32), "id"),
        "names": ["a", "b"],
        "none": None,
    }
    (same,) = list(DeviceLoader([batch], "cpu"))
    assert same["img"] is batch["img"] and same["names"] == ["a", "b"] and same["none"] is None
    assert isinstance(same["pair"], Pair) and torch.equal(same["pair"].x, torch.ones(2, 2))
    (half,) = list(DeviceLoader([batch], "cpu", dtype=torch.bfloat16, channels_last=True))
    assert half["img"].dtype == torch.bfloat16 and half["label"].dtype == torch.int64
    assert half["img"].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(half["img"].float(), batch["img"].bfloat16().float())


def test_batches_count_their_samples_whatever_the_collation() -> None:
    """The report's samples/s counts samples: a list of samples as they are (collate_fn=list
    over dict or (sample, label) samples) was counted by its first array's rows (64 per batch
    of 8 here), and so was a detection-style tuple(zip(*samples))."""
    image = np.zeros((64, 80), np.uint16)
    samples = [({"npy": image, "cls": 1}, 3)] * 8
    collated = torch.utils.data.default_collate([(torch.zeros(3, 64, 80), 1)] * 8)
    assert batch_size_of(collated) == 8  # torch's: [images (8 x ...), labels (8)]
    assert batch_size_of(torch.utils.data.default_collate([{"x": image}] * 8)) == 8
    assert batch_size_of([sample for sample, _ in samples]) == 8  # dict samples, as they are
    assert batch_size_of(samples) == 8  # (sample, label) pairs
    assert batch_size_of(tuple(zip(*samples, strict=True))) == 8  # ((samples...), (labels...))
    assert batch_size_of([image] * 8) == 8  # numpy samples, as they are
    raw = torch.utils.data.default_collate([{"cls": b"3", "txt": "a cat"}] * 8)  # tar members
    assert batch_size_of(raw) == 8  # lists of bytes and str: 0 samples before
    assert batch_size_of([torch.zeros(8, 3), torch.zeros(8)]) == 8  # tensors: batched fields
    # collate_fn=list over images of different sizes: 8 tensors of 3 x H x W were counted as 3
    ragged = [torch.zeros(3, 60 + i, 80) for i in range(8)]
    assert batch_size_of(ragged) == 3  # alone, a list of tensors reads as batched fields
    assert batch_size_of(ragged, batch_size=8) == 8  # the loader's batch size settles it
    assert batch_size_of([torch.zeros(8, 3), torch.zeros(8)], batch_size=8) == 8
    loader = fastload.DataLoader(
        [torch.zeros(3, 60 + i, 80) for i in range(24)], batch_size=8, collate_fn=list
    )
    assert sum(len(batch) for batch in loader) == 24
    assert loader.meter.epoch.samples == 24  # 3 + 3 + 3 = 9 before: each batch's first image


def test_bad_input_is_named() -> None:
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        DeviceLoader([], "gpu")
    with pytest.raises(ConfigError, match="iterable of batches"):
        DeviceLoader(3, "cpu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="prefetch"):
        DeviceLoader([], "cpu", prefetch=-1)
    with pytest.raises(ConfigError, match="input_sharding is for XLA"):
        DeviceLoader([], "cpu", input_sharding=object())
    with pytest.raises(ConfigError, match="non_blocking must be a bool, got 'x'"):
        DeviceLoader([], "cpu", non_blocking="x")  # type: ignore[arg-type]
    with pytest.raises(UnsupportedSampleError, match=r"batch\['meta'\]\[1\] is a builtins.set"):
        list(DeviceLoader([{"meta": [1, {2}]}], "cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            DeviceLoader([], "cuda")
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        with pytest.raises(MissingExtraError, match=r"fastload\[xla\]"):
            DeviceLoader([], "xla")


def test_the_verdict_flips_between_a_slow_loader_and_a_slow_step() -> None:
    slow_loader = run(DeviceLoader(Batches(delay=0.03), "cpu"), step=0.0)
    assert slow_loader.bound == "data" and slow_loader.wait_share > 0.8
    assert "no stage counters" in slow_loader.cause
    slow_step = run(DeviceLoader(Batches(delay=0.0), "cpu"), step=0.03)
    assert slow_step.bound == "compute" and slow_step.wait_share < 0.1
    assert slow_step.samples == 48 and slow_step.steps == 12
    assert 0.025 < slow_step.step_p50_ms / 1e3 < 0.1
    assert "compute-bound" in slow_step.verdict
    assert run(DeviceLoader([], "cpu"), step=0).bound == "unknown"


def test_hooks_get_metrics_every_n_steps_and_cannot_break_training() -> None:
    calls: list[tuple[int, dict[str, float]]] = []

    def broken(metrics: dict[str, float], step: int) -> None:
        raise RuntimeError("logging backend down")

    loader = DeviceLoader(
        Batches(count=10), "cpu", hooks=[lambda m, s: calls.append((s, m)), broken], log_every=4
    )
    assert len(list(loader)) == 10
    assert [s for s, _ in calls] == [4, 8]
    assert set(calls[0][1]) == {
        "data/wait_ms",
        "data/step_ms",
        "data/wait_share",
        "data/samples_per_s",
    }
    with pytest.raises(ConfigError, match="hooks must be callables"):
        DeviceLoader([], "cpu", hooks=["wandb"])  # type: ignore[list-item]


def test_a_device_loader_per_epoch_calls_its_hooks_at_its_own_log_every_once() -> None:
    """Over a fastload.DataLoader the hooks of a DeviceLoader made each epoch (migration.md's
    pattern) are called every ``log_every`` of its steps, while it iterates: not at the
    loader's ``log_every``, and not once more for each DeviceLoader made before."""
    data = [(torch.full((2,), float(i)), i) for i in range(24)]
    loader = fastload.DataLoader(data, batch_size=3)  # 8 steps a pass; its log_every is 50
    calls: list[tuple[int, int]] = []
    for epoch in range(3):
        hook = functools.partial(lambda e, m, s: calls.append((e, s)), epoch)
        assert len(list(DeviceLoader(loader, "cpu", hooks=[hook], log_every=4))) == 8
    assert calls == [(0, 4), (0, 8), (1, 12), (1, 16), (2, 20), (2, 24)]
    with pytest.raises(ConfigError, match="log_every must be an int >= 1"):
        DeviceLoader(loader, "cpu", log_every=0)


def test_diagnose_says_which_side_limits() -> None:
    def step(seconds: float) -> Any:
        return lambda batch: time.sleep(seconds)

    data = fastload.diagnose(Batches(delay=0.02), step(0.002), steps=8)
    assert data["bound"] == "data" and data["loader_batches_per_s"] < data["step_per_s"]
    compute = fastload.diagnose(Batches(delay=0.0), step(0.02), steps=8)
    assert compute["bound"] == "compute" and "compute-bound" in compute["verdict"]
    alone = fastload.diagnose(Batches(), steps=4)
    assert alone["bound"] == "unknown" and alone["loader_batches_per_s"] > 0
    with pytest.raises(ConfigError, match="yielded no batches"):
        fastload.diagnose([], steps=2)
    with pytest.raises(ConfigError, match="needs an iterable of batches"):
        fastload.diagnose(5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="step must be a callable"):
        fastload.diagnose(Batches(), step="train")  # type: ignore[arg-type]


def test_state_dict_through_the_device_loader_skips_nothing() -> None:
    data = [(torch.full((2,), float(i)), i) for i in range(30)]

    def device_loader() -> DeviceLoader:
        return DeviceLoader(fastload.DataLoader(data, batch_size=3, shuffle=True), "cpu")

    first = device_loader()
    seen: list[int] = []
    for step, (_, y) in enumerate(first):
        seen += y.tolist()
        if step == 2:
            state = first.state_dict()
            break
    resumed = device_loader()
    resumed.load_state_dict(state)
    rest = [int(v) for _, y in resumed for v in y]
    assert sorted(seen + rest) == list(range(30)) and len(seen) == 9
    with pytest.raises(ConfigError, match="no state_dict"):
        DeviceLoader([], "cpu").state_dict()


def test_set_epoch_through_the_device_loader_picks_the_loaders_order() -> None:
    data = list(range(20))

    def order(epoch: int) -> list[int]:
        loader = DeviceLoader(fastload.DataLoader(data, batch_size=4, shuffle=True), "cpu")
        loader.set_epoch(epoch)
        return [int(v) for batch in loader for v in batch]

    assert order(3) == order(3) != order(4) and sorted(order(4)) == data
    with pytest.raises(ConfigError, match="no set_epoch"):
        DeviceLoader([], "cpu").set_epoch(1)


@contextlib.contextmanager
def _behind_latency(seaweed: S3Server, tmp_path: Path) -> Iterator[RemoteDataset]:
    """64 objects on S3 through +60 ms, read into an npy cache in ``tmp_path``."""
    root = upload(f"s3://{BUCKET}/dv-{uuid.uuid4().hex[:8]}", seaweed.storage_options(), 64)
    with FaultProxy(seaweed.endpoint, flavor="s3", faults=Faults(latency=0.06)) as proxy:
        options = seaweed.storage_options(proxy.endpoint)
        yield RemoteDataset(
            root, decode="npy", cache=Cache(tmp_path, format="npy"), storage_options=options
        )


def test_report_names_fetch_latency_cold_and_is_compute_bound_warm(
    seaweed: S3Server, tmp_path: Path
) -> None:
    with _behind_latency(seaweed, tmp_path) as dataset:
        loader = fastload.DataLoader(dataset, batch_size=8, num_workers=0, lookahead=0)
        cold = run(DeviceLoader(loader, "cpu"), step=0.005)
        warm = run(DeviceLoader(loader, "cpu"), step=0.1)  # 4 steps: a wide margin under load
    assert cold.bound == "data", cold.verdict
    assert "cache misses: 100%" in cold.cause and "fetch latency p50" in cold.cause
    assert cold.counters.fetch.objects == 64
    assert warm.bound == "compute", warm.verdict
    assert warm.counters.cache.hits == 64


def test_report_says_the_store_throttled_the_reads(seaweed: S3Server) -> None:
    """A store answering 503 SlowDown to more than 4 requests at once: the cause says so, and
    how the requests in flight were cut, not only the fetch latency."""
    root = upload(f"s3://{BUCKET}/thr-{uuid.uuid4().hex[:8]}", seaweed.storage_options(), 64)
    faults = Faults(latency=0.05, throttle_above=4)
    with FaultProxy(seaweed.endpoint, flavor="s3", faults=faults) as proxy:
        options = seaweed.storage_options(proxy.endpoint)
        dataset = RemoteDataset(root, decode="npy", storage_options=options)
        loader = fastload.DataLoader(dataset, batch_size=16, num_workers=0)
        report = run(DeviceLoader(loader, "cpu"), step=0)
    fetch = report.counters.fetch if report.counters is not None else None
    assert fetch is not None and fetch.throttled > 0 and fetch.objects == 64
    assert report.bound == "data", report.verdict
    assert f"the store throttled {fetch.throttled} requests" in report.cause, report.cause


def test_a_cold_epoch_with_workers_reports_every_sample_fetched(
    seaweed: S3Server, tmp_path: Path
) -> None:
    """With workers, a sample their lookahead made counts as a miss there and again as a hit
    where its batch is filled: the report's share of samples fetched is against the samples
    handed out, so a cold epoch reads 100%, not misses over hits + misses."""
    with _behind_latency(seaweed, tmp_path) as dataset:
        loader = fastload.DataLoader(dataset, batch_size=4, num_workers=2, lookahead=2)
        cold = run(DeviceLoader(loader, "cpu"), step=0.005)
    cache = cold.counters.cache  # a miss that waited for another process's make counts twice
    assert cold.counters.fetch.objects == 64 and cache.misses - cache.waits == 64
    assert cold.counters.dataset.samples == 64
    assert cold.bound == "data", cold.verdict
    assert "cache misses: 100%" in cold.cause, (cold.cause, cold.counters.cache)


def test_a_pass_reports_the_requests_in_flight_as_they_are_not_their_change(
    seaweed: S3Server,
) -> None:
    """``limit`` and ``limit_peak`` are levels: every pass's report gives them as ``stats()``
    does, with workers too, where a later pass read 0 (a count's change)."""
    options = seaweed.storage_options()
    root = upload(f"s3://{BUCKET}/levels-{uuid.uuid4().hex[:8]}", options, 40)
    dataset = RemoteDataset(root, decode="npy", storage_options=options)
    for workers in (0, 2):
        loader = fastload.DataLoader(dataset, batch_size=8, num_workers=workers)
        for _ in range(2):
            window = run(DeviceLoader(loader, "cpu"), step=0).counters
            assert window is not None
            now = loader.counters.fetch
            assert (window.fetch.limit, window.fetch.limit_peak) == (now.limit, now.limit_peak)
            assert window.fetch.limit >= 16


@pytest.mark.skipif(not QUEUE_KNOWN, reason="the kernel gives no run-queue time (not Linux)")
@pytest.mark.parametrize(
    ("cpu", "queued", "part", "advice"),
    [
        (0.2, 0.7, "its largest part waiting for a CPU", "fewer workers or threads"),
        (0.2, 0.1, "its largest part blocked", "faster storage"),
        (0.7, 0.2, "its largest part on a CPU", "warm-cache"),
    ],
)
def test_the_cache_write_time_is_split_into_cpu_queue_and_blocked(
    cpu: float, queued: float, part: str, advice: str
) -> None:
    """On a busy 2-core machine a cold epoch's writes waited for a CPU, and the report said to
    put the cache on faster storage. The write time is split by the thread's own clocks (Linux
    schedstat): the advice follows the largest part. (Counters set by hand: a unit detail.)"""
    cache = CacheStats(writes=10, write_s=1.0, write_cpu_s=cpu, write_queued_s=queued)
    said = _write_time(cache)
    assert said.startswith(part) and advice in said, said
    assert ("faster storage" in said) == (part == "its largest part blocked")
    start = thread_times()
    sum(i * i for i in range(200_000))  # CPU work: the thread's on-CPU clock moves
    assert thread_times()[0] > start[0]


def test_thread_times_are_the_calling_threads_own_in_another_thread_and_after_a_fork() -> None:
    """The write-time split reads the thread's schedstat at every write batch; opening it each
    time cost 10 µs, a quarter of a small ``Cache.put``, so each thread keeps it open. Kept
    open, it must still be the caller's: another thread's, and a forked child's own."""
    sum(i * i for i in range(300_000))  # this thread has run a while
    mine = thread_times()[0]
    assert mine > 0.005
    found: list[float] = []
    other = threading.Thread(target=lambda: found.append(thread_times()[0]))
    other.start()
    other.join()
    assert found[0] < mine  # a new thread's clock, not this one's
    theirs = in_forked_child(lambda: thread_times()[0])
    assert theirs < mine  # the child's own thread, which has just started


def _tar_shards(folder: Path, shards: int, per: int, shape: tuple[int, ...]) -> None:
    """``shards`` tar shards of ``per`` float32 ``.npy`` members each, WebDataset-style keys."""
    folder.mkdir()
    for s in range(shards):
        with tarfile.open(folder / f"train-{s:04d}.tar", "w") as tar:
            for i in range(s * per, (s + 1) * per):
                body = io.BytesIO()
                np.save(body, np.full(shape, i, np.float32))
                info = tarfile.TarInfo(f"part-{s}/{i:06d}.npy")
                info.size = body.tell()
                body.seek(0)
                tar.addfile(info, body)


def _npy_view(sample: dict[str, bytes]) -> np.ndarray:
    """A tar sample's .npy member as a view of its bytes: decoding that costs next to nothing
    (decode="npy" copies 256 KB a sample, which on a loaded machine took as long as writing it
    to the cache and made the report's cause a coin toss)."""
    body = sample["npy"]
    start = 10 + int.from_bytes(body[8:10], "little")
    return np.frombuffer(body, np.float32, offset=start)


def _slow_copy(x: np.ndarray) -> np.ndarray:
    time.sleep(0.008)  # preprocessing of 8 ms a sample
    return x.copy()


def test_report_names_filling_the_cache_not_decoding_when_writes_are_the_wait(
    tmp_path: Path,
) -> None:
    """A cold epoch over tar shards read whole by indexing fetches nothing more: its time is
    the cache's writes. The report said "decode/transform: p50 0.0 ms per sample; cache the
    preprocessed samples", for a dataset that was caching them. It names the writes now, and
    a slow transform, as such, with advice that fits whether a cache is there."""
    _tar_shards(tmp_path / "tar", 4, 50, (64, 1024))  # 200 samples of 256 KB
    dataset = RemoteDataset(
        Tar(f"file://{tmp_path / 'tar'}"), decode=_npy_view, cache=Cache(tmp_path / "c")
    )
    loader = fastload.DataLoader(dataset, batch_size=10, num_workers=0)
    cold = run(DeviceLoader(loader, "cpu"), step=0.0)
    assert cold.counters is not None and cold.counters.fetch.objects == 0  # seeded
    assert cold.counters.cache.write_s > 0 and cold.counters.cache.writes == 200
    assert cold.cause is not None and cold.cause.startswith("filling the cache: 200 samples")
    assert "warm-cache" in cold.cause, cold.cause
    if QUEUE_KNOWN:  # where the write time went: on a CPU, queued for one, blocked
        cache = cold.counters.cache
        assert cache.write_cpu_s > 0 and cache.write_queued_s >= 0
        assert cache.write_cpu_s + cache.write_queued_s <= cache.write_s * 1.05 + 0.01
        assert "s on a CPU, " in cold.cause and " s waiting for one, " in cold.cause
    with_cache = RemoteDataset(
        Tar(f"file://{tmp_path / 'tar'}"),
        decode="npy",
        transform=_slow_copy,
        cache=Cache(tmp_path / "c2"),
    )
    slow_loader = fastload.DataLoader(with_cache, batch_size=10, num_workers=0)
    slow = run(DeviceLoader(slow_loader, "cpu"), step=0.0)
    assert slow.cause is not None and slow.cause.startswith("decode/transform"), slow.cause
    assert "the cache keeps them" in slow.cause
    uncached = RemoteDataset(Tar(f"file://{tmp_path / 'tar'}"), decode="npy", transform=_slow_copy)
    plain_loader = fastload.DataLoader(uncached, batch_size=10, num_workers=0)
    plain = run(DeviceLoader(plain_loader, "cpu"), step=0.0)
    assert plain.cause is not None and "cache=fastload.Cache" in plain.cause, plain.cause


class SlowStart(Batches):
    """The first batch takes ``first`` seconds (worker start-up, a cold listing), then none."""

    def __init__(self, first: float, count: int = 20) -> None:
        super().__init__(count=count)
        self.first = first

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        time.sleep(self.first)
        yield from super().__iter__()


def test_a_loop_that_waited_for_its_first_batch_is_data_bound_and_says_so() -> None:
    loader = DeviceLoader(SlowStart(first=1.0), "cpu")
    started = time.perf_counter()
    waited, asked = 0.0, started
    for _ in loader:
        waited += time.perf_counter() - asked
        time.sleep(0.01)
        asked = time.perf_counter()
    wall_share = waited / (time.perf_counter() - started)
    report = loader.report()
    assert report.bound == "data", report.verdict
    assert "the first batch" in report.cause and report.first_batch_s >= 1.0
    # the figure agrees with the loop's own wall-clock measure (what make demo prints)
    assert abs(report.wait_share - wall_share) < 0.05, (report.wait_share, wall_share)
    assert report.steady_wait_share < 0.1


def test_one_meter_for_a_device_loader_over_a_fastload_loader() -> None:
    data = [(torch.full((2,), float(i)), i) for i in range(40)]
    loader = fastload.DataLoader(data, batch_size=4, num_workers=0)
    device = DeviceLoader(loader, "cpu")
    assert device.meter is loader.meter
    run(device, step=0.002)
    assert device.report().to_dict() == loader.report().to_dict()
    assert loader.meter.stats.samples == 40  # counted once, not by both loaders
    run(device, step=0.002)
    assert device.report("all").passes == 2 and device.report().window == "pass 2"


class SerialReads(torch.utils.data.Dataset[bytes]):
    """A user's dataset reading its sample's five objects one after another (no fastload)."""

    def __init__(self, urls: list[str], options: dict[str, Any]) -> None:
        self.urls, self.options = urls, options

    def __len__(self) -> int:
        return len(self.urls) // 5

    def __getitem__(self, index: int) -> torch.Tensor:
        from fastload.stores import filesystem

        fs = filesystem(self.urls[0], self.options)
        parts = [fs.cat_file(u) for u in self.urls[index * 5 : index * 5 + 5]]
        return torch.tensor([len(p) for p in parts])


def test_cached_dataset_time_is_blamed_on_the_wrapped_dataset_not_decoding(
    seaweed: S3Server, tmp_path: Path
) -> None:
    root = upload(f"s3://{BUCKET}/cd-{uuid.uuid4().hex[:8]}", seaweed.storage_options(), 40)
    urls = sorted(
        e.url for e in fastload.Manifest.build(root, storage_options=seaweed.storage_options())
    )
    with FaultProxy(seaweed.endpoint, flavor="s3", faults=Faults(latency=0.03)) as proxy:
        options = seaweed.storage_options(proxy.endpoint)
        dataset = fastload.CachedDataset(SerialReads(urls, options), Cache(tmp_path), version="1")
        loader = fastload.DataLoader(dataset, batch_size=2, num_workers=0, lookahead=0)
        cold = run(DeviceLoader(loader, "cpu"), step=0.001)
        warm = run(DeviceLoader(loader, "cpu"), step=0.1)  # 4 steps: a wide margin under load
    assert cold.bound == "data", cold.verdict
    assert "wrapped dataset" in cold.cause and "decode" not in cold.cause, cold.cause
    assert warm.bound == "compute", warm.verdict
    assert warm.counters.cache.misses == 0 and warm.counters.cache.hits == 8


# --- CUDA (run on a GPU machine; skipped elsewhere) --------------------------------------------


@pytest.mark.cuda
@needs_cuda
def test_cuda_batches_arrive_intact_under_a_busy_compute_stream() -> None:
    loader = DeviceLoader(Batches(count=40, size=64), "cuda", prefetch=3, dtype=torch.float16)
    for i, batch in enumerate(loader):
        torch.cuda._sleep(2_000_000)  # keep the compute stream busy while copies run
        assert batch["x"].device.type == "cuda" and batch["x"].dtype == torch.float16
        assert batch["y"].dtype == torch.int64
        assert bool((batch["x"] == i).all())  # never read before its copy finished
    assert loader.report().steps == 40


@pytest.mark.cuda
@needs_cuda
def test_cuda_loader_of_many_tensors_with_workers_delivers_every_batch() -> None:
    """1,024 in-memory tensors through fastload's default workers and pinning (the first GPU
    run failed here: forkserver passed each tensor as a file descriptor, "too many fds")."""
    data = [torch.full((3, 224, 224), float(i)) for i in range(1024)]
    loader = DeviceLoader(fastload.DataLoader(data, batch_size=32, pin_memory=True), "cuda")
    seen = torch.cat([batch[:, 0, 0, 0] for batch in loader]).cpu()
    assert seen.tolist() == [float(i) for i in range(1024)]
    assert loader.report().steps == 32


@pytest.mark.cuda
@needs_cuda
def test_cuda_copies_from_pinned_memory_overlap_compute() -> None:
    """128 MB pinned batches (~2.5 ms to copy) under a ~10 ms step: copied ahead on the side
    stream the loop barely waits; copied blocking (``non_blocking=False``) it waits for each."""
    batches = [torch.full((32, 1024, 1024), float(i)).pin_memory() for i in range(12)]

    def steady_wait(non_blocking: bool) -> float:
        loader = DeviceLoader(batches, "cuda", non_blocking=non_blocking)
        for i, batch in enumerate(loader):
            torch.cuda._sleep(20_000_000)  # about 10 ms of the compute stream
            assert float(batch[-1, -1, -1]) == i  # never read before its copy finished
        return loader.report().steady_wait_share

    ahead, blocking = steady_wait(True), steady_wait(False)
    assert ahead < DATA_BOUND_ABOVE and ahead < blocking / 2, (ahead, blocking)


@pytest.mark.cuda
@needs_cuda
def test_cuda_channels_last_and_dtype_keep_values_and_integer_labels() -> None:
    """``channels_last`` and ``dtype`` applied on the device give what the same conversion gives
    on the CPU; 16-bit integer masks keep every value (dtype converts floating point only)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.rand((4, 3, 17, 23), generator=generator)
    masks = torch.randint(0, 65536, (4, 1, 17, 23), generator=generator).to(torch.uint16)
    loader = DeviceLoader(
        [{"image": images, "mask": masks, "name": ["a", "b", "c", "d"]}],
        "cuda",
        channels_last=True,
        dtype=torch.bfloat16,
    )
    (batch,) = list(loader)
    assert batch["image"].dtype == torch.bfloat16 and batch["mask"].dtype == torch.uint16
    for key in ("image", "mask"):
        assert batch[key].is_contiguous(memory_format=torch.channels_last), key
    assert torch.equal(batch["image"].cpu(), images.to(torch.bfloat16))
    assert torch.equal(batch["mask"].cpu().int(), masks.int())
    assert batch["name"] == ["a", "b", "c", "d"]


@pytest.mark.cuda
@needs_cuda
def test_cuda_workers_fill_the_cache_and_the_loading_thread_pins_the_batch(
    tmp_path: Path,
) -> None:
    """With a cache, workers fill it and the loop's process reads each batch back; with
    ``pin_memory`` (the default on CUDA) the loading thread pins it, as torch's pinning thread
    pins a worker's batch, so DeviceLoader's copies stay asynchronous."""
    (tmp_path / "data").mkdir()
    for i in range(40):
        np.save(tmp_path / "data" / f"{i:03d}.npy", np.full((3, 8, 8), i, np.float32))
    dataset = RemoteDataset(
        f"file://{tmp_path / 'data'}", decode="npy", cache=Cache(tmp_path / "cache")
    )
    loader = fastload.DataLoader(dataset, batch_size=8, num_workers=2)
    assert loader.fills and loader.pin_memory
    for _ in range(2):  # cold, then warm
        host = list(loader)
        assert all(batch.is_pinned() for batch in host)
        on_device = [batch[:, 0, 0, 0].cpu() for batch in DeviceLoader(loader, "cuda")]
        assert sorted(int(v) for batch in on_device for v in batch) == list(range(40))


def _nccl_rank(rank: int, world: int, port: int, root: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        dataset = RemoteDataset(root, decode="npy")  # rank 0 lists; the others receive it
        out[rank] = (len(dataset), float(dataset[rank].sum()))
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@needs_cuda
def test_nccl_ranks_that_never_set_a_device_still_share_a_listing(tmp_path: Path) -> None:
    """Two NCCL ranks, neither calling ``torch.cuda.set_device``, so both on cuda:0: the
    listing rank 0 hands the others went through NCCL on that one GPU and failed. It goes
    through a gloo group of the same ranks (fastload.ranks)."""
    for i in range(5):
        np.save(tmp_path / f"{i}.npy", np.full(3, i))
    manager = mp.get_context("spawn").Manager()
    try:
        out = manager.dict()
        mp.start_processes(
            _nccl_rank,
            args=(2, free_port(), f"file://{tmp_path}", out),
            nprocs=2,
            start_method="spawn",
        )
        assert [out[rank] for rank in range(2)] == [(5, 0.0), (5, 3.0)]
    finally:
        manager.shutdown()


def test_a_slow_first_batch_and_a_compute_bound_steady_state_each_get_their_verdict() -> None:
    """A 0.45 s first batch, then steps that never wait: the report called the whole loop
    data-bound without saying the steady state was compute-bound."""
    report = run(DeviceLoader(SlowStart(first=0.45, count=40), "cpu"), step=0.02)
    assert report.bound == "data" and report.steady_bound == "compute", report.verdict
    assert report.steady_wait_share < DATA_BOUND_ABOVE
    assert "the first batch waited 0.4" in report.verdict
    assert "after it the loop is compute-bound" in report.verdict, report.verdict


def test_an_augment_that_limits_the_loop_is_named_with_advice_for_the_cores_at_hand(
    seaweed: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm loop limited by its random crops was told "the loader itself ... try more
    workers", on 2 cores where the docs' default is 0 workers."""
    root = upload(f"s3://{BUCKET}/augment-{uuid.uuid4().hex[:8]}", seaweed.storage_options(), 48)

    def crop(sample: np.ndarray) -> np.ndarray:
        time.sleep(0.004)  # a random crop of a large image, say
        return sample[:2]

    dataset = fastload.RemoteDataset(
        root, storage_options=seaweed.storage_options(), cache=Cache(tmp_path), augment=crop
    )
    loader = fastload.DataLoader(dataset, batch_size=8, num_workers=0, lookahead=0)
    run(DeviceLoader(loader, "cpu"), step=0.0)  # fills the cache
    warm = run(DeviceLoader(loader, "cpu"), step=0.0)
    assert warm.bound == "data" and warm.cause is not None, warm.verdict
    assert warm.cause.startswith("augment=") and "4." in warm.cause, warm.cause
    assert warm.counters.dataset.augment.count == 48
    assert warm.to_dict()["dataset"]["augment_total_s"] >= 48 * 0.004
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert "cores to spare" in fastload.stall._workers_advice()
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    assert "more DataLoader workers (16 cores" in fastload.stall._workers_advice()
