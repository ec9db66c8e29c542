"""Sampler scaling: torch's RandomSampler / DistributedSampler vs fastload's PermutationSampler.

Each measurement runs in a fresh spawned process so its RSS growth is its own. Reported: time to
the first index and the extra peak RSS at that moment; for a full epoch, the rate of iteration
alone and of the whole epoch including set-up; the batched path's rate (10M indices); and the
time to resume at position n/2. Repeats give medians.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DistributedSampler, RandomSampler, Sampler

from fastload import PermutationSampler


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


class _Range(torch.utils.data.Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _make(kind: str, n: int) -> Sampler[int]:
    if kind == "RandomSampler":
        return RandomSampler(_Range(n), generator=torch.Generator().manual_seed(0))
    if kind == "DistributedSampler":
        return DistributedSampler(_Range(n), num_replicas=8, rank=0, seed=0)
    return PermutationSampler(n, seed=0)


def _measure(kind: str, n: int, full_epoch: bool, queue: Any) -> None:
    torch.set_num_threads(1)
    before = _rss_kib("VmRSS")
    started = time.perf_counter()
    sampler = _make(kind, n)
    iterator = iter(sampler)
    next(iterator)
    first = time.perf_counter() - started
    result: dict[str, Any] = {
        "first_index_ms": first * 1e3,
        "extra_rss_mib": (_rss_kib("VmHWM") - before) / 1024,  # what it takes to start
    }
    if full_epoch:
        count, iter_started = 1, time.perf_counter()
        for _ in iterator:
            count += 1
        ended = time.perf_counter()
        result["iter_M_per_s"] = count / (ended - iter_started) / 1e6
        result["epoch_M_per_s"] = count / (ended - started) / 1e6  # set-up included
    if isinstance(sampler, PermutationSampler):
        stop = min(len(sampler), 10_000_000)
        started = time.perf_counter()
        sampler.indices(0, stop)
        result["batched_M_per_s"] = stop / (time.perf_counter() - started) / 1e6
        state = {**sampler.state_dict(), "position": n // 2}
        started = time.perf_counter()
        resumed = PermutationSampler(n, seed=0)
        resumed.load_state_dict(state)
        next(iter(resumed))
        result["resume_ms"] = (time.perf_counter() - started) * 1e3
    queue.put(result)


def measure(kind: str, n: int, *, full_epoch: bool, repeats: int) -> dict[str, Any]:
    """Median of ``repeats`` runs, each in a fresh process."""
    ctx = mp.get_context("spawn")
    runs = []
    for _ in range(repeats):
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure, args=(kind, n, full_epoch, queue))
        proc.start()
        runs.append(queue.get(timeout=900))
        proc.join()
    keys = runs[0].keys()
    return {"sampler": kind, "n": n, **{k: statistics.median(r[k] for r in runs) for k in keys}}


def run(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    repeats = 1 if quick else 3
    plan: list[tuple[str, int, bool]] = [
        ("RandomSampler", 10**6, True),
        ("DistributedSampler", 10**6, True),
        ("PermutationSampler", 10**6, True),
        ("RandomSampler", 10**7, True),
        ("PermutationSampler", 10**7, True),
    ]
    if not quick:
        plan += [
            ("RandomSampler", 10**8, False),
            ("DistributedSampler", 10**8, False),
            ("PermutationSampler", 10**8, False),
        ]
    plan.append(("PermutationSampler", 10**9, False))
    results = []
    for kind, n, full in plan:
        progress(f"sampler: {kind} n={n:.0e}")
        results.append(measure(kind, n, full_epoch=full, repeats=repeats))
    return results
