"""Smoke test: the benchmark code runs and reports every field (tiny sizes; figures unchecked)."""

from __future__ import annotations

from benchmarks import sampler


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
