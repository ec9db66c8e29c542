"""Smoke test: the benchmark code runs and reports every field (tiny sizes; figures unchecked)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks import (
    cache,
    gpu,
    groups,
    limit,
    parquet,
    peers,
    sampler,
    stall,
    stores,
    tails,
    volumes,
)

pytestmark = pytest.mark.bench  # about 5 minutes of test time: `-m "not bench"` for a quick loop


def test_sampler_benchmark_measures_every_field() -> None:
    ours = sampler.measure("PermutationSampler", 100_000, full_epoch=True, repeats=1)
    theirs = sampler.measure("RandomSampler", 100_000, full_epoch=True, repeats=1)
    assert {
        "first_index_ms",
        "extra_rss_mib",
        "iter_M_per_s",
        "epoch_M_per_s",
        "batched_M_per_s",
        "resume_ms",
    } <= ours.keys()
    assert {"first_index_ms", "extra_rss_mib", "iter_M_per_s", "epoch_M_per_s"} <= theirs.keys()
    assert all(value > 0 for key, value in ours.items() if key.endswith(("_ms", "_per_s")))


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 4 workers, 2 CPUs
def test_fetch_benchmark_compares_every_client() -> None:
    rows = stores.fetch_rows(40, 1, progress=lambda _: None)
    assert len(rows) == 5
    assert all(row["GETs/s (median)"] > 0 for row in rows)
    assert max(row["vs best s3fs"] for row in rows if row["client"].startswith("s3fs")) == 1


def test_tails_benchmark_reports_every_reader() -> None:
    rows = tails.tail_rows(40, 1, progress=lambda _: None)
    assert [row["reader"].split(",")[0] for row in rows] == ["no tails", "tails", "tails", "tails"]
    assert rows[0]["vs no tails"] == 1 and all(row["cold samples/s (median)"] > 0 for row in rows)


def test_manifest_benchmark_lists_and_persists() -> None:
    rows = stores.manifest_rows(1000, 300, 1, progress=lambda _: None, small=80)
    assert [row["seconds"] > 0 for row in rows] == [True] * 8  # save, load, 3 layouts x 2
    assert rows[-1]["speed-up"] > 0 and "directories" in rows[-1]["case"]
    assert "80 flat" in rows[3]["case"] and rows[3]["requests"] == 1  # one page


def test_groups_benchmark_compares_plain_torch_groups_and_single_objects() -> None:
    rows = groups.group_rows(10, progress=lambda _: None)
    readers = [(row["reader"], row["epoch"]) for row in rows]
    assert len(readers) == 4 and readers[1] == ("fastload groups", "cold")
    assert all(row["fields/s"] > 0 for row in rows)
    assert rows[0]["fields"] == 9 and rows[1]["fields"] == 10  # plain drops the broken field


def test_parquet_benchmark_compares_the_per_sample_reader_with_shards() -> None:
    rows = parquet.parquet_rows(3, progress=lambda _: None, events=300)
    assert [row["samples timed"] for row in rows] == [900, 900, 900]  # 4 batches > 900
    assert rows[0]["x per-sample shuffle=True"] == 1 and rows[0]["runs"] == 1
    assert rows[2]["requests"] == 3  # one row group per file, each read once
    assert 1 <= rows[2]["shards per batch"] <= 2.5
    assert all(row["samples/s"] > 0 for row in rows)


def test_epoch_benchmark_compares_every_reader() -> None:
    rows = cache.epoch_rows(64, 1, progress=lambda _: None)
    readers = [row["reader"] for row in rows]
    assert any("bare loop" in r for r in readers)
    assert any("cold" in r and "fastload DataLoader" in r for r in readers)  # the defaults' path
    assert all(row["samples/s (median)"] > 0 for row in rows)
    assert all(row["vs ceiling"] > 0 for row in rows if "cold" in row["reader"])


def test_small_sample_benchmark_fills_reads_and_weighs_the_cache() -> None:
    fill, read = cache.small_rows(1000, progress=lambda _: None)
    assert fill["events"] == read["events"] == 1000 and fill["events/s"] > 0
    assert fill["bytes on disk"] > fill["event bytes"] > 1000 * 80  # 20-80 float32 + an id
    assert fill["files"] <= 2 * 256 + 8  # lock and index shards: not a file per entry
    assert read["events/s"] > 0 and read["fill vs read"] > 0


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 4 workers, 2 CPUs
def test_limit_benchmark_compares_warm_epochs_with_a_memmap() -> None:
    rows = limit.limit_rows(300, 1, progress=lambda _: None)
    assert rows[1]["reader"].startswith("floor")
    assert [row["reader"].split(":")[0] for row in rows[2:4]] == ["mapped entries"] * 2
    assert [row["reader"].split(",")[-1] for row in rows[4:]] == [
        " 0 workers",
        " 2 workers",
        " 4 workers",
    ]
    assert rows[0]["vs limit"] == rows[0]["CPU vs limit"] == 1
    assert all(row["samples/s (median)"] > 0 for row in rows)
    # this process's CPU is read to the nanosecond (an epoch of 300 samples takes less than
    # /proc's 10 ms tick), so every reader's is more than nothing
    assert all(row["CPU us/sample"] > 0 for row in rows)


def test_crop_benchmark_reads_full_and_cropped() -> None:
    rows = cache.volume_rows(2, progress=lambda _: None)
    assert [row["ms (median)"] > 0 for row in rows] == [True] * 3


def test_warm_benchmark_compares_with_the_fetch_ceiling() -> None:
    rows = cache.warm_rows(64, 1, progress=lambda _: None)
    assert rows[1]["vs ceiling"] > 0 and rows[0]["samples/s (median)"] > 0


def test_stall_benchmark_reports_each_loop() -> None:
    rows = stall.stall_rows(64, 1, progress=lambda _: None)
    loops = {row["loop"]: row for row in rows}
    assert loops["fastload.DataLoader defaults, warm cache"]["wait share (median)"] >= 0
    assert "fetch latency" in loops["torch DataLoader + RemoteDataset, no cache"]["verdict"]
    assert all(row["vs ceiling"] > 0 for row in rows if "lookahead" in row["loop"])


def test_gpu_benchmark_runs_its_loops_on_the_cpu(tmp_path: Path) -> None:
    """The CUDA rows (pinned copies, the side stream) need a GPU: `make gpu-check` runs them;
    here the same loops run without copies, so the harness itself is exercised."""
    result = gpu.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "gpu.json")])
    assert json.loads((tmp_path / "gpu.json").read_text()) == result
    assert [row["loop"] for row in result["loops"]] == [
        "torch + .to(device)",
        "fastload DeviceLoader, pageable",
    ]
    for row in result["loops"]:
        assert row["first pass samples/s"] > 0 and row["later samples/s"] > 0, row
        assert 0 <= row["later wait share"] < 1 and row["verdict"] in {"data", "compute"}, row
        assert row[gpu.FIRST_RUN] >= 0, row  # the first run's first batch, kept apart


def test_the_gpu_rehearsal_refuses_what_the_gpu_image_lacks() -> None:
    """`make gpu-rehearse` is worth something only if an import of a package the GPU image
    lacks fails here as it would there (in a child: the refusal lasts for its process)."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_rehearse", "-m", "s3fs"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and "s3fs is not on the GPU image" in done.stderr, done.stderr


def test_peer_benchmark_runs_every_reader_on_every_store() -> None:
    rows = peers.peer_rows(32, {"s3": 1, "gcs": 1, "b2": 1}, lambda _: None, workers=(2,))
    per_store = {store: [r for r in rows if r["store"] == store] for store in ("s3", "gcs", "b2")}
    assert [len(per_store[s]) for s in ("s3", "gcs", "b2")] == [10, 3, 3]
    for row in rows:  # each reader process read every sample in both epochs (it asserts so)
        assert row["failed runs"] == 0, row
        assert row["cold samples/s"] > 0 and row["warm samples/s"] > 0
        assert row["cold CPU us/sample"] > 0 and row["warm CPU us/sample"] >= 0, row
        assert row["cores"] == peers.split_cores().note
        after = row["cold after first batch samples/s"]  # NaN: the first batch was all 32
        assert math.isnan(after) or after > 0
        assert row["peak PSS MiB"] > 50  # a python + torch process tree was sampled
    readers = [r["reader"].split()[0] for r in per_store["s3"]]
    assert readers[3:] == ["LitData"] * 2 + ["Mosaic", "WebDataset"] + ["fastload"] * 3
    assert [r["workers"] for r in per_store["s3"]] == [2] * 7 + ["defaults", 2, "defaults"]
    sweep = per_store["s3"][-2]  # fastload at a chosen worker count: not compared as a peer
    assert "vs best peer" not in " ".join(sweep) and sweep["warm samples/s"] > 0
    ours = per_store["s3"][-1]  # the tar shards, against the best peer
    assert ours["cold vs best peer"] > 0 and ours["best warm peer"].endswith(", 2 w")


BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
"""A python that spends 0.3 s of CPU."""


def test_a_peer_readers_cpu_counts_its_workers_running_and_ended() -> None:
    """A reader's CPU is its process tree's: a child that ended (a worker the reader reaped),
    one still running, and a grandchild that ended under it (a forkserver's worker) all count."""
    before = peers.tree_cpu_seconds(os.getpid())
    subprocess.run([sys.executable, "-c", BURN], check=True, timeout=60)
    grandchild = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BURN!r}])\n"
    wait = "print('burnt', flush=True); sys.stdin.read()"
    running = subprocess.Popen(
        [sys.executable, "-c", BURN + grandchild + wait],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert running.stdout is not None and running.stdout.readline() == "burnt\n"
        spent = peers.tree_cpu_seconds(os.getpid()) - before
    finally:
        running.communicate("", timeout=60)
    assert spent >= 0.85, spent  # three burns of 0.3 s (/proc counts 10 ms ticks)


def test_volume_benchmark_compares_the_caches_with_the_baseline() -> None:
    rows = volumes.volume_rows(2, 2, progress=lambda _: None)
    assert [row["reader"].split(",")[0] for row in rows] == [
        "baseline: download + preprocess every epoch",
        "fastload",
        "fastload",
    ]
    assert rows[0]["warm vs baseline"] == 1 and all(r["warm samples/s"] > 0 for r in rows)


def test_dicom_benchmark_compares_the_sequential_reader_with_groups() -> None:
    rows = groups.dicom_rows(2, progress=lambda _: None)
    assert [(row["epoch"], row["volumes"]) for row in rows] == [
        ("every", 2),
        ("cold", 2),
        ("warm", 2),
    ]
    assert all(row["volumes/s"] > 0 for row in rows)


def test_the_readme_says_what_the_latest_peers_results_say() -> None:
    """The README's table and claims are rendered from benchmarks/results/peers.json
    (python -m benchmarks.readme): none is typed by hand, so none can drift."""
    from benchmarks import readme

    text = readme.README.read_text()
    block = text[text.index(readme.START) : text.index(readme.END) + len(readme.END)]
    assert block == readme.render(json.loads((readme.RESULTS / "peers.json").read_text()))
    assert len(text.encode()) <= 10_240, len(text.encode())  # a first screen, not lab notes
