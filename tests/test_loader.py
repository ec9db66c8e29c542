"""fastload.DataLoader: defaults, exact resume, background loading, worker counters, lookahead."""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, RandomSampler

import fastload
from fastload import Cache, ConfigError, DecodeError, PermutationSampler, RemoteDataset
from fastload._contract import BatchHead, Filled, opened
from fastload._lookahead import Plan, _Pass
from fastload._workers import fork_safe_context
from fastload.loader import default_workers
from fastload.stall import _first_batch_why
from fastload.stats import StageCounters
from fastload.stores import filesystem
from fastload.testing import FaultProxy, Faults, S3Server
from tests.conftest import BUCKET
from tests.test_dataset import upload


class Numbers(Dataset[tuple[torch.Tensor, int]]):
    """Sample i is (a tensor filled with i, i); ``bad`` indices raise."""

    def __init__(self, n: int, bad: frozenset[int] = frozenset()) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index in self.bad:
            raise ValueError(f"sample {index} is broken")
        return torch.full((3,), float(index)), index


def labels(loader: Any) -> list[int]:
    return [int(v) for _, y in loader for v in y]


def test_defaults_for_remote_data() -> None:
    loader = fastload.DataLoader(Numbers(10), batch_size=4, shuffle=True, num_workers=2)
    assert isinstance(loader.sampler, PermutationSampler) and loader.sampler.shuffle
    assert loader.persistent_workers and loader.prefetch_factor == 4
    assert loader.multiprocessing_context is multiprocessing.get_context("forkserver")
    assert loader.pin_memory == torch.cuda.is_available()
    assert fastload.DataLoader(Numbers(10)).num_workers == default_workers()
    plain = fastload.DataLoader(Numbers(10), batch_size=4, num_workers=0)
    assert isinstance(plain.sampler, PermutationSampler) and not plain.sampler.shuffle
    assert labels(plain) == list(range(10))
    # same seed, same order; another seed, another order; torch's arguments still work
    orders = [labels(fastload.DataLoader(Numbers(50), 5, True, seed=s)) for s in (1, 1, 2)]
    assert orders[0] == orders[1] != orders[2] and sorted(orders[0]) == list(range(50))
    custom = fastload.DataLoader(Numbers(8), batch_size=2, sampler=RandomSampler(Numbers(8)))
    assert sorted(labels(custom)) == list(range(8))


def test_iterable_datasets_pass_through() -> None:
    class Stream(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            return iter(range(7))

    assert [int(v) for b in fastload.DataLoader(Stream(), batch_size=3) for v in b] == list(
        range(7)
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_at_the_next_unseen_sample(workers: int) -> None:
    def loader() -> fastload.DataLoader:
        return fastload.DataLoader(Numbers(103), batch_size=10, shuffle=True, num_workers=workers)

    first = loader()
    first.set_epoch(3)
    seen: list[int] = []
    for step, (_, y) in enumerate(first):
        seen += y.tolist()
        if step == 3:  # workers (and the background thread) have prefetched further by now
            state = first.state_dict()
            break
    resumed = loader()
    resumed.load_state_dict(state)
    rest = labels(resumed)
    assert len(seen) == 40 and len(rest) == 63
    assert sorted(seen + rest) == list(range(103))  # every sample exactly once
    full = loader()
    full.set_epoch(3)
    assert seen + rest == labels(full)  # and in the epoch's own order


@pytest.mark.parametrize("workers", [0, 2])
def test_shuffle_reshuffles_every_pass_like_torch(workers: int) -> None:
    loader = fastload.DataLoader(Numbers(64), batch_size=8, shuffle=True, num_workers=workers)
    passes = [labels(loader) for _ in range(3)]
    assert all(sorted(p) == list(range(64)) for p in passes)
    assert len({tuple(p) for p in passes}) == 3  # a new order each pass, no set_epoch needed
    # the orders are the sampler's epochs 0, 1, 2: reproducible from the seed
    for epoch, order in enumerate(passes):
        again = fastload.DataLoader(Numbers(64), batch_size=8, shuffle=True, num_workers=0)
        again.set_epoch(epoch)
        assert labels(again) == order
    # an explicit set_epoch wins: the same epoch twice is the same order twice
    loader.set_epoch(7)
    first = labels(loader)
    loader.set_epoch(7)
    assert labels(loader) == first
    assert labels(loader) != first  # and without it, the next pass moves on
    plain = fastload.DataLoader(Numbers(20), batch_size=4, num_workers=0)
    assert labels(plain) == labels(plain) == list(range(20))  # no shuffle: one order


class Draws(Dataset[int]):
    """A sample is a draw of numpy's global generator: what a random augmentation uses."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return int(np.random.randint(0, 2**30))


def test_a_new_loader_each_epoch_reshuffles_like_torch(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's unseeded loader made anew draws a new order; ours took epoch 0's order (and its
    # workers numpy's draws) every time, so a loop that makes its loader each epoch trained on
    # one order. With seed= given, every new loader starts at epoch 0 (a seeded generator's way).
    def made() -> fastload.DataLoader:  # a new dataset too, as such loops often make
        return fastload.DataLoader(Numbers(64), batch_size=8, shuffle=True, num_workers=0)

    orders = [labels(made()) for _ in range(3)]
    assert len({tuple(order) for order in orders}) == 3
    reference = made()
    reference.set_epoch(0)
    assert [labels(reference) for _ in range(3)] == orders  # the epochs 0, 1, 2 in turn
    for _ in range(2):  # with seed= every new loader starts at epoch 0
        seeded = fastload.DataLoader(Numbers(64), 8, True, num_workers=0, seed=0)
        assert labels(seeded) == orders[0]
    draws = [
        [int(v) for batch in fastload.DataLoader(Draws(), 4, True, num_workers=2) for v in batch]
        for _ in range(2)
    ]
    assert set(draws[0]).isdisjoint(draws[1])  # the workers' generators moved on too

    # under several ranks a rank cannot move on alone (the ranks' shares would overlap)
    monkeypatch.setattr(fastload.loader, "rank_world", lambda: (0, 2))
    with caplog.at_level(logging.WARNING):
        again = labels(made())
    assert again == orders[0] and "starts at epoch 0 again" in caplog.text


def test_resume_then_reshuffle_continues_the_epochs() -> None:
    def make() -> fastload.DataLoader:  # seed= given: every new loader starts at epoch 0
        return fastload.DataLoader(Numbers(50), batch_size=5, shuffle=True, num_workers=0, seed=0)

    reference = make()
    epochs = [labels(reference) for _ in range(3)]
    first = make()
    labels(first)  # epoch 0
    seen = []
    for step, (_, y) in enumerate(first):  # epoch 1, stopped after 2 batches
        seen += y.tolist()
        if step == 1:
            state = first.state_dict()
            break
    resumed = make()
    resumed.load_state_dict(state)
    assert seen + labels(resumed) == epochs[1]  # the rest of epoch 1, exactly
    assert labels(resumed) == epochs[2]  # then epoch 2, as an uninterrupted run


class Slow(Numbers):
    """Each sample takes ``delay`` seconds and leaves a mark when it is done."""

    def __init__(self, n: int, delay: float, marks: Path | None = None) -> None:
        super().__init__(n)
        self.delay, self.marks = delay, marks

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.delay)
        if self.marks is not None:
            (self.marks / f"done-{index}").touch()
        return super().__getitem__(index)


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fastload-loader"]


@pytest.mark.parametrize("how", ["break", "exception"])
def test_leaving_the_loop_early_stops_and_joins_the_background_thread(how: str) -> None:
    loader = fastload.DataLoader(Slow(40, delay=0.05), batch_size=2, num_workers=0)
    assert loader.background

    def run() -> None:
        for step, _ in enumerate(loader):
            if step == 1:
                if how == "break":
                    break
                raise KeyError("the training step failed")

    if how == "break":
        run()
    else:
        with pytest.raises(KeyError):
            run()
    assert loader_threads() == []  # joined before control came back, not left running


def test_interpreter_exit_waits_for_a_loader_left_open(tmp_path: Path) -> None:
    script = tmp_path / "left_open.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from pathlib import Path
            sys.path.insert(0, {str(Path(__file__).parent.parent)!r})
            import fastload
            from tests.test_loader import Slow

            loader = fastload.DataLoader(Slow(40, 0.3, Path({str(tmp_path)!r})), batch_size=1,
                                         num_workers=0)
            batches = iter(loader)
            next(batches)  # the thread is now inside __getitem__ of a later sample
            print("leaving", flush=True)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    marks = sorted(tmp_path.glob("done-*"))
    started = len(marks)
    # the sample in hand at exit was finished, not cut off mid-call by interpreter teardown
    time.sleep(0.5)
    assert len(sorted(tmp_path.glob("done-*"))) == started >= 2


def test_resume_refuses_foreign_state_and_unresumable_samplers() -> None:
    loader = fastload.DataLoader(Numbers(10), batch_size=2, shuffle=True, seed=1)
    other = fastload.DataLoader(Numbers(10), batch_size=2, shuffle=True, seed=2)
    with pytest.raises(ConfigError, match="seed=1 but this sampler has seed=2"):
        other.load_state_dict(loader.state_dict())
    with pytest.raises(ConfigError, match="not a fastload DataLoader state"):
        loader.load_state_dict({"position": 3})
    random = fastload.DataLoader(Numbers(10), batch_size=2, sampler=RandomSampler(Numbers(10)))
    with pytest.raises(ConfigError, match="cannot resume with RandomSampler"):
        random.state_dict()
    with pytest.raises(ConfigError, match="consumed_batches must be in"):
        loader.state_dict(consumed_batches=1)
    with pytest.raises(ConfigError, match="num_workers"):
        fastload.DataLoader(Numbers(10), num_workers=-1)
    with pytest.raises(ConfigError, match="has no __len__"):
        fastload.DataLoader(Dataset())


def test_errors_from_the_background_thread_reach_the_loop() -> None:
    loader = fastload.DataLoader(Numbers(40, bad=frozenset({25})), batch_size=5, num_workers=0)
    got: list[int] = []
    with pytest.raises(ValueError, match="sample 25 is broken"):
        for _, y in loader:
            got += y.tolist()
    assert got == list(range(25))  # everything before the bad batch arrived, in order


def test_the_loading_thread_steps_aside_for_a_loop_with_nothing_to_overlap() -> None:
    """A loop whose steps are too short to overlap (a thread's hand-off of each batch would
    only cost it) goes on in its own thread after a few batches: the same batches in the same
    order, errors still reach it, and the next pass starts with a thread again."""
    # 400 batches: a quiet machine hands back by batch 9; a loaded one (a step preempted past
    # 0.1 ms starts the count of 8 quick steps again) needs more, and the last 50 must be handed
    plain = fastload.DataLoader(Numbers(2000), batch_size=5, shuffle=True, seed=3, background=False)
    loader = fastload.DataLoader(Numbers(2000), batch_size=5, shuffle=True, seed=3, num_workers=0)
    for _ in range(2):
        alive = []
        got = []
        for x, _ in loader:
            alive.append(bool(loader_threads()))
            got.append(x)
        expected = list(plain)
        assert len(got) == len(expected) == 400
        assert all(torch.equal(a, b[0]) for a, b in zip(got, expected, strict=True))
        assert alive[0] and not any(alive[-50:])  # handed back, not stopped
    bad = fastload.DataLoader(Numbers(300, bad=frozenset({250})), batch_size=5, num_workers=0)
    seen: list[int] = []
    with pytest.raises(ValueError, match="sample 250 is broken"):
        for _, y in bad:
            seen += y.tolist()
    assert seen == list(range(250)) and loader_threads() == []


def test_the_loading_thread_stays_while_the_steps_leave_it_work() -> None:
    loader = fastload.DataLoader(Numbers(150), batch_size=5, num_workers=0)
    alive = []
    for _ in loader:
        time.sleep(0.002)  # a training step that lets go of the GIL
        alive.append(bool(loader_threads()))
    assert len(alive) == 30 and all(alive[:25])


def test_forkserver_only_where_it_is_a_drop_in(tmp_path: Path) -> None:
    assert fork_safe_context(Numbers(3)) is multiprocessing.get_context("forkserver")
    assert fork_safe_context(lambda: 1) is None  # does not pickle: fork
    # a script without a __main__ guard would rerun itself in forkserver workers: fork instead
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, fastload
            data = [torch.tensor([i]) for i in range(12)]
            loader = fastload.DataLoader(data, batch_size=4, num_workers=2)
            print(sorted(int(v) for b in loader for v in b), loader.multiprocessing_context)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert done.stdout.strip() == f"{list(range(12))} None"


class ParentHasTorch(Dataset[int]):
    """Sample i: whether the worker's parent process (the forkserver) has torch's library mapped."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return int("libtorch" in Path(f"/proc/{os.getppid()}/maps").read_text())


def test_forkserver_workers_start_with_torch_imported() -> None:
    """Python's forkserver does not preload ``__main__`` (3.11, 3.12): without fastload's preload
    each worker imported torch itself, 5 s for 8 workers at every loader's start on a GPU host."""
    loader = fastload.DataLoader(ParentHasTorch(), batch_size=None, num_workers=1)
    assert loader.multiprocessing_context is multiprocessing.get_context("forkserver")
    assert [int(v) for v in loader] == [1, 1]


def test_the_forkserver_starts_with_the_loader_not_the_first_batch(tmp_path: Path) -> None:
    """Its imports (1.5 s here, 4 s on a GPU host) overlap the script's own set-up."""
    script = tmp_path / "construct_only.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time, fastload
            from pathlib import Path

            def forkserver_child() -> bool:
                me = os.getpid()
                children = Path(f"/proc/{me}/task/{me}/children").read_text().split()
                lines = [Path(f"/proc/{c}/cmdline").read_bytes() for c in children]
                return any(b"forkserver" in x for x in lines)

            if __name__ == "__main__":
                loader = fastload.DataLoader(list(range(8)), batch_size=4, num_workers=2)
                deadline = time.monotonic() + 30  # started; its exec may still be under way
                while not forkserver_child() and time.monotonic() < deadline:
                    time.sleep(0.05)
                print(loader.multiprocessing_context, forkserver_child())
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split()[-1] == "True", done.stdout


def test_workers_fork_for_datasets_of_tensors_or_large_arrays() -> None:
    """forkserver sends every tensor storage as a file descriptor ("too many fds" past ~250, the
    first GPU run's failure) and every worker its own copy of a large dataset: fork shares."""
    tensors = [torch.full((2,), float(i)) for i in range(300)]
    loader = fastload.DataLoader(tensors, batch_size=50, num_workers=2)
    assert loader.multiprocessing_context is None
    assert sorted(int(v) for batch in loader for v in batch[:, 0]) == list(range(300))
    big = [np.zeros(2**20, np.float64) for _ in range(9)]  # 72 MiB
    assert fork_safe_context(big) is None
    assert fork_safe_context(big[:1]) is multiprocessing.get_context("forkserver")


@pytest.fixture
def remote(seaweed: S3Server) -> tuple[str, dict[str, Any]]:
    options = seaweed.storage_options()
    return upload(f"s3://{BUCKET}/ld-{uuid.uuid4().hex[:8]}", options, 48), options


def test_worker_counters_reach_the_report(
    remote: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    root, options = remote
    dataset = RemoteDataset(
        root, decode="npy", cache=Cache(tmp_path, format="npy"), storage_options=options
    )
    loader = fastload.DataLoader(dataset, batch_size=8, num_workers=2, lookahead=0)
    assert len(torch.cat(list(loader))) == 48
    cold = loader.counters
    assert cold is not None
    assert cold.fetch.objects == 48 and cold.cache.misses == 48 and cold.dataset.samples == 48
    assert dataset.counters.fetch.objects == 0  # all of it happened in the workers
    list(loader)  # a warm epoch through the same (persistent) workers
    warm = loader.counters
    assert warm is not None and warm.cache.hits == 48 and warm.fetch.objects == 48
    # the report covers one window: this (warm) pass, or everything since the start
    epoch = loader.report()
    assert epoch.window == "pass 2" and epoch.samples == 48
    assert epoch.counters.cache.hits == 48 and epoch.counters.cache.misses == 0
    assert epoch.counters.fetch.requests == 0 and "cache misses" not in str(epoch.cause)
    total = loader.report("all")
    assert total.samples == 96 and total.passes == 2
    assert total.counters.cache.hits == 48 and total.counters.cache.misses == 48
    assert epoch.verdict.startswith("pass 2") and total.verdict.startswith("since start")


@pytest.mark.parametrize("workers", [1, 2])
def test_with_workers_the_workers_fetch_ahead_themselves(
    seaweed: S3Server, remote: tuple[str, dict[str, Any]], tmp_path: Path, workers: int
) -> None:
    """A cold epoch's fetching, decoding and preprocessing happen in the workers, the lookahead
    included: the main process fetches only its head start, the pass's first batches while
    the workers start (it once fetched 88% of an epoch for 2 workers, which waited on it)."""
    root, _ = remote
    with FaultProxy(seaweed.endpoint, flavor="s3", faults=Faults(latency=0.05)) as proxy:
        options = seaweed.storage_options(proxy.endpoint)
        dataset = RemoteDataset(root, decode="npy", cache=Cache(tmp_path), storage_options=options)
        loader = fastload.DataLoader(
            dataset, batch_size=4, shuffle=True, num_workers=workers, prefetch_factor=1
        )
        values = sorted(int(b[i, 0, 0]) for b in loader for i in range(len(b)))
    assert values == list(range(48))
    total = loader.counters
    assert total is not None
    head = (loader.lookahead + workers) * 4  # its batches: lookahead + those handed out first
    assert dataset.counters.fetch.objects == dataset.counters.cache.writes <= head
    assert len(Cache(tmp_path)) == 48
    # fetched once each; a worker's last lookahead may finish after its last batch carried its
    # counters back, so the report can come up short, never over
    assert dataset.counters.fetch.objects < total.fetch.objects <= 48
    made_ahead = total.cache.hits + total.cache.waits  # a batch read what a lookahead made
    assert made_ahead >= 4


def test_workers_fill_the_cache_and_the_loop_reads_it(
    remote: tuple[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a cache, workers make and cache a batch's missing samples and hand back only
    their positions; the loop's process reads the batch from the cache (a worker's batch
    would cross through fresh shared memory, which cost more than the read). Same batches,
    in the same order, as without workers; each sample counted once as a hit or a miss."""
    monkeypatch.setattr(fastload.loader, "_cores", lambda: 2)  # as CI: no head start
    root, options = remote

    def loader(workers: int, cache: Path, **kwargs: Any) -> fastload.DataLoader:
        dataset = RemoteDataset(
            root, decode="npy", cache=Cache(cache, format="npy"), storage_options=options
        )
        return fastload.DataLoader(
            dataset, batch_size=8, shuffle=True, num_workers=workers, seed=3, **kwargs
        )

    def batches(source: fastload.DataLoader) -> list[list[int]]:
        return [[int(v) for v in batch[:, 0, 0]] for batch in source]

    filling = loader(2, tmp_path / "filled")
    assert filling.fills and not loader(0, tmp_path / "plain").fills
    cold, warm = batches(filling), batches(filling)
    plain = loader(0, tmp_path / "plain")
    assert cold == batches(plain) and warm == batches(plain)
    assert sorted(v for batch in cold for v in batch) == list(range(48))
    main = filling.dataset.counters  # type: ignore[attr-defined]
    assert main.dataset.samples == 96  # read here, made there but for the head start's
    assert main.fetch.objects == main.cache.misses == main.cache.writes
    assert main.cache.hits == 48  # the cold pass's counted where found; the warm pass read here
    epoch = filling.report().counters
    assert epoch is not None and epoch.cache.hits == 48 and epoch.cache.misses == 0
    # each object fetched once in all; a worker's lookahead that ended after its last batch of
    # the cold pass reports with its first warm batch, so not "none in the warm pass"
    every = filling.report("all").counters
    assert every is not None and every.fetch.objects == 48
    # pin_memory on a machine without an accelerator: nothing to pin, as torch's loader does
    pinning = loader(2, tmp_path / "filled", pin_memory=True)
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="no accelerator is found"):
            assert batches(pinning) == cold


@pytest.mark.parametrize("cores", [2, 16])
def test_once_a_pass_leaves_every_sample_cached_the_next_is_read_without_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int
) -> None:
    """Workers filling the cache only look at its index for a warm batch and hand it back for
    this process to read: once a whole pass has left every sample cached, the next passes are
    read here, as without workers (same batches, same order, the workers left idle). Not
    after a pass cut short, nor on one of several ranks or over a sampler that may repeat
    samples (their pass leaves others uncached); a sample missing after all is made and
    cached here. With cores to spare the workers keep reading."""
    monkeypatch.setattr(fastload.loader, "_cores", lambda: cores)
    (tmp_path / "data").mkdir()
    for i in range(50):
        np.save(tmp_path / "data" / f"{i:02d}.npy", np.full((2, 3), i, np.int32))
    root = f"file://{tmp_path / 'data'}"

    def loader(cache: str, **kwargs: Any) -> fastload.DataLoader:
        dataset = RemoteDataset(root, decode="npy", cache=Cache(tmp_path / cache))
        return fastload.DataLoader(dataset, batch_size=8, num_workers=2, **kwargs)

    def passes(source: fastload.DataLoader, count: int) -> list[list[list[int]]]:
        return [[[int(v) for v in batch[:, 0, 0]] for batch in source] for _ in range(count)]

    filling = loader("c", shuffle=True, seed=5)
    plain = fastload.DataLoader(
        RemoteDataset(root, decode="npy"), batch_size=8, num_workers=0, shuffle=True, seed=5
    )
    assert filling.fills
    three = passes(filling, 3)
    assert three == passes(plain, 3)  # same batches, same order, each pass reshuffled
    looked_there = filling._returns.counters.cache.hits  # workers' lookups of cached samples
    if cores == 16:  # the warm passes went through the workers, which looked every sample up
        assert looked_there >= 100
        return
    assert looked_there < 50
    main = filling.dataset.counters  # type: ignore[attr-defined]
    assert main.cache.writes == 0  # the workers made every sample, in the cold pass
    assert main.cache.hits == 100  # passes 2 and 3 looked up and read here
    every = filling.report("all").counters
    assert every is not None and every.cache.misses == every.cache.writes == 50

    Cache(tmp_path / "c").clear()  # gone after all: made and cached here, right values
    assert passes(filling, 1) == passes(plain, 1)
    assert main.cache.writes == 50 and main.fetch.objects == 50
    assert filling._cached_whole  # that pass left every sample cached again
    before = main.cache.hits
    Cache(tmp_path / "c").clear()
    filling._cached_whole = False  # as after a pass that left samples uncached
    passes(filling, 1)
    assert main.cache.writes == 50 and main.cache.hits == before  # the workers made them

    cut = loader("cut", shuffle=True)
    for i, _ in enumerate(cut):  # a pass cut short: the next has workers
        if i == 2:
            break
    assert not cut._cached_whole
    repeating = loader("rand", sampler=torch.utils.data.RandomSampler(range(50), True))
    passes(repeating, 1)
    assert not repeating._cached_whole  # a sampler that repeats samples left some out
    sequential = loader("seq")
    passes(sequential, 1)
    assert sequential._cached_whole  # torch's order visits every sample too
    ranked = loader("ranked", sampler=PermutationSampler(50, rank=0, world_size=2))
    passes(ranked, 1)
    assert not ranked._cached_whole  # one rank's pass: the next epoch's share differs


@pytest.mark.parametrize(
    ("context", "cores"), [(None, 16), ("fork", 16), (None, 3)], ids=["16 cores", "fork", "3 cores"]
)
def test_while_workers_start_the_loop_caches_the_first_batches(
    remote: tuple[str, dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    context: str | None,
    cores: int,
) -> None:
    """A worker's start waits for the forkserver's imports: meanwhile this process makes and
    caches the pass's first batches, those the workers are handed first and ``lookahead``
    beyond (where the workers' own lookahead begins), and reads them without reading them
    back. Not when the workers fork (a fork would copy its fetches mid-request), nor without
    a core to spare beside the workers (it would compete with their start for the CPU)."""
    monkeypatch.setattr(fastload.loader, "_cores", lambda: cores)
    root, options = remote
    dataset = RemoteDataset(root, decode="npy", cache=Cache(tmp_path), storage_options=options)
    loader = fastload.DataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        lookahead=2,
        prefetch_factor=1,
        multiprocessing_context=context,
    )
    assert loader.fills

    def values() -> list[int]:
        return [int(x) for b in loader for x in b[:, 0, 0]]

    assert values() == list(range(48))
    here = copy.deepcopy(dataset.counters)
    made = 0 if context == "fork" or cores <= 3 else (2 + 2) * 4
    assert here.cache.writes == here.fetch.objects == here.cache.misses == made
    assert here.cache.hits == 0  # those held were taken, the rest read without a count
    assert len(Cache(tmp_path)) == 48
    epoch = loader.report().counters  # none twice (short if a worker's lookahead ends late)
    assert epoch is not None and here.fetch.objects < epoch.fetch.objects <= 48
    Cache(tmp_path).clear()
    loader._cached_whole = False  # as if the last pass had not left every sample cached
    assert values() == list(range(48))  # cold again, but the workers run on: no head start
    assert dataset.counters.cache.writes == made


def test_workers_fill_only_where_reading_back_gives_the_same_batch(
    remote: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    root, options = remote

    def fills(cache: Cache | None = None, **kwargs: Any) -> bool:
        loader_args = {k: kwargs.pop(k) for k in ("pin_memory", "collate_fn") if k in kwargs}
        dataset = RemoteDataset(
            root,
            decode="npy",
            cache=Cache(tmp_path / "c") if cache is None else cache,
            storage_options=options,
            **kwargs,
        )
        loader = fastload.DataLoader(dataset, batch_size=4, num_workers=2, **loader_args)
        return bool(loader.fills)

    assert fills()
    assert not fills(augment=lambda x: x + 1)  # done per read: stays in the workers
    assert not fills(on_change="refresh")  # reads bypass the cache
    assert fills(pin_memory=True)  # pinned by the loading thread where it can be
    assert not fills(collate_fn=torch.utils.data.default_collate)
    Cache(tmp_path / "ro").put("x", np.zeros(1))
    assert not fills(cache=Cache(tmp_path / "ro", read_only=True))  # keeps nothing made


def test_filled_batches_evicted_before_the_loop_reads_them_are_made_again_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache budget smaller than what the workers cache ahead evicts a filled batch before
    the loop's process reads it back: each such sample is made again there (right values,
    every sample once), and a warning names the budget, once (it cost twice, unsaid)."""
    (tmp_path / "data").mkdir()
    for i in range(96):
        np.save(tmp_path / "data" / f"{i:03d}.npy", np.full((150, 256), i, np.float32))
    cache = Cache(tmp_path / "cache", format="npy", max_bytes=3 * 2**20)  # 20 samples' worth
    dataset = RemoteDataset(f"file://{tmp_path / 'data'}", decode="npy", cache=cache)
    loader = fastload.DataLoader(dataset, batch_size=16, shuffle=True, num_workers=2)
    assert loader.fills
    with caplog.at_level(logging.WARNING, logger="fastload.dataset"):
        for _ in range(2):
            values = []
            for batch in loader:
                assert all(bool((row == row[0, 0]).all()) for row in batch)
                values += [int(row[0, 0]) for row in batch]
            assert sorted(values) == list(range(96))
    said = [r for r in caplog.records if "gone before the loop's process" in r.message]
    assert len(said) == 1 and "max_bytes (3 MiB)" in said[0].message


def test_filled_samples_removed_from_a_cache_without_budget_are_made_again_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With no budget, a filled batch's entries can only go by other means (a clear, a
    damaged entry dropped): they are made again with right values, and the warning says that,
    not that a budget (there is none) is too small."""
    (tmp_path / "data").mkdir()
    for i in range(8):
        np.save(tmp_path / "data" / f"{i}.npy", np.full(4, i, np.int16))
    cache = Cache(tmp_path / "cache")
    dataset = RemoteDataset(f"file://{tmp_path / 'data'}", decode="npy", cache=cache)
    filled = dataset.__getitems__([BatchHead(6, fill=True), 1, 3])  # as a worker gets it
    assert isinstance(filled, Filled)
    cache.clear()
    with caplog.at_level(logging.WARNING, logger="fastload.dataset"):
        assert [int(x[0]) for x in dataset.read_filled(filled)] == [6, 1, 3]
    said = [r.message for r in caplog.records if "gone before the loop's process" in r.message]
    assert len(said) == 1 and "no budget" in said[0] and "max_bytes" not in said[0]


def test_a_filling_worker_on_a_warm_streak_leaves_the_look_to_the_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a streak of batches found cached, a filling worker looks at one batch in
    ``_WARM_PROBE``; the loop's process counts the others' hits and makes a sample missing
    there (right values, counted as a miss, not said to be 'gone'); a probe that finds a miss
    turns looking on for every batch again."""
    from fastload import dataset as module

    (tmp_path / "data").mkdir()
    for i in range(8):
        np.save(tmp_path / "data" / f"{i}.npy", np.full(4, i, np.int16))
    cache = Cache(tmp_path / "cache")
    dataset = RemoteDataset(f"file://{tmp_path / 'data'}", decode="npy", cache=cache)
    dataset.warm(range(8))
    worker = pickle.loads(pickle.dumps(dataset))  # a worker's copy: counters of its own

    def fill(*indices: int) -> Any:  # a batch as a filling worker gets it
        return worker.__getitems__([BatchHead(indices[0], fill=True), *indices[1:]])

    for _ in range(module._WARM_STREAK):
        filled = fill(0, 1)
        assert isinstance(filled, Filled) and filled.looked
    assert worker.cache.counters.hits == 2 * module._WARM_STREAK
    cache.delete(dataset._cache_names([5])[0])
    hits, misses = cache.counters.hits, cache.counters.misses
    with caplog.at_level(logging.WARNING, logger="fastload.dataset"):
        for _ in range(module._WARM_PROBE - 1):
            filled = fill(5, 2)
            assert isinstance(filled, Filled) and not filled.looked
            assert [int(x[0]) for x in dataset.read_filled(filled)] == [5, 2]
    assert not [r for r in caplog.records if "gone before" in r.message]
    assert cache.counters.misses == misses + 1  # made by the first read; the later ones hit
    assert cache.counters.hits == hits + 2 * (module._WARM_PROBE - 1) - 1
    assert worker.cache.counters.hits == 2 * module._WARM_STREAK  # the worker did not look
    cache.delete(dataset._cache_names([6])[0])
    filled = fill(6)  # the probe
    assert isinstance(filled, Filled) and filled.looked
    assert dataset._cache_names([6])[0] in cache  # made by the worker
    cache.delete(dataset._cache_names([7])[0])
    assert fill(7).looked  # looking at every batch again
    assert dataset._cache_names([7])[0] in cache


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_filling_worker_settles_a_batch_with_a_failed_sample(
    seaweed: S3Server, tmp_path: Path, policy: str
) -> None:
    """A sample that fails in a filling worker: the worker settles the batch as without
    filling (skipped and named, or raised naming the object); nothing is fetched twice."""
    options = seaweed.storage_options()
    root = upload(f"s3://{BUCKET}/fillerr-{uuid.uuid4().hex[:8]}", options, 16)
    filesystem(root, options).pipe(f"{root.split('://')[1]}/0005.npy", b"garbage")
    dataset = RemoteDataset(
        root,
        decode="npy",
        cache=Cache(tmp_path),
        storage_options=options,
        on_error=policy,  # type: ignore[arg-type]
    )
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=2, lookahead=0)
    assert loader.fills
    if policy == "raise":
        with pytest.raises(DecodeError, match=r"0005\.npy"):
            list(loader)
        return
    values = [int(v) for batch in loader for v in batch[:, 0, 0]]
    assert len(values) == 16 and 5 not in values and set(values) == set(range(16)) - {5}
    counters = loader.counters
    assert counters is not None and counters.dataset.skipped == 1
    assert any("0005.npy" in key for key in counters.dataset.skipped_keys)
    assert counters.fetch.objects == 16


def test_each_workers_start_is_counted_and_named_for_a_slow_first_batch(tmp_path: Path) -> None:
    """How long each worker took to start (a forkserver's first start imports torch once
    more: 4-6 s on a GPU machine) is counted once, and names what a first batch waited for."""
    (tmp_path / "data").mkdir()
    for i in range(16):
        np.save(tmp_path / "data" / f"{i:02d}.npy", np.full(8, i, np.float32))
    dataset = RemoteDataset(
        f"file://{tmp_path / 'data'}", decode="npy", cache=Cache(tmp_path / "cache")
    )
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=2)
    list(loader)
    list(loader)  # persistent workers: no new start to count
    counters = loader.counters
    assert counters is not None and counters.dataset.worker_start.count == 2
    assert loader.stats()["dataset"]["worker_start_mean_s"] > 0
    assert "2 workers took" in _first_batch_why(counters)
    assert _first_batch_why(None) == "worker start-up, if any, and the first fetches"
    inline = fastload.DataLoader(dataset, batch_size=4, num_workers=0)
    list(inline)
    assert _first_batch_why(inline.counters) == "the first fetches"  # no worker started


class SlowToStart:
    """Batches (of indices, or of data) whose ``iter()`` takes 0.3 s, as a loader's does while
    its workers start."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        time.sleep(0.3)
        return iter(self.batches)


def test_the_time_iter_takes_counts_in_the_first_batch_wait() -> None:
    """Workers start inside ``iter(loader)``, before the first ``next()``: that time belongs
    to the first batch's wait, under a DeviceLoader too (it was not timed at all)."""
    data = list(range(8))
    order = SlowToStart([[0, 1, 2, 3], [4, 5, 6, 7]])
    loader = fastload.DataLoader(data, batch_sampler=order, num_workers=0)
    list(loader)
    assert loader.report().first_batch_s >= 0.3
    device_loader = fastload.DeviceLoader(SlowToStart([torch.zeros(2)] * 3), "cpu")
    list(device_loader)
    assert device_loader.report().first_batch_s >= 0.3


def test_the_shuffle_follows_seed_and_says_so_when_a_generator_is_given(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """torch's RandomSampler draws from the loader's generator; ours cannot (every rank must
    draw one order to split it), so a user who seeds a generator for another order is told."""
    data = list(range(64))

    def order(**kwargs: Any) -> list[int]:
        loader = fastload.DataLoader(data, batch_size=64, shuffle=True, num_workers=0, **kwargs)
        return [int(i) for i in next(iter(loader))]

    with caplog.at_level(logging.WARNING):
        seeded = order(generator=torch.Generator().manual_seed(7), seed=0)
    assert "follows seed=0, not generator=" in caplog.text
    assert seeded == order(seed=0) and order(seed=7) != order(seed=0)


class Prefetching(Dataset[int]):
    """A dataset that keeps the loader's contract (:class:`fastload._contract.LoaderDataset`)
    with a cache it only pretends to have, recording what was asked for and when."""

    cache = "a cache"
    blocks = None
    listing_check = None

    def __init__(self, n: int) -> None:
        self.n, self.events = n, []  # type: list[tuple[str, list[int]]]
        self.counters = StageCounters()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int | BatchHead) -> int:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int | BatchHead]) -> list[int]:
        plain, _ = opened(indices)
        self.events.append(("get", list(plain)))
        return list(plain)

    def fillable(self) -> bool:
        return False

    def workers_fill(self) -> None:
        raise AssertionError("nothing is filled here")

    def read_filled(self, filled: Filled) -> list[Any]:
        raise AssertionError(f"nothing is filled here: {filled.indices}")

    def prefetch(self, indices: Sequence[int]) -> Future[None]:
        self.events.append(("prefetch", list(indices)))
        done: Future[None] = Future()
        done.set_result(None)
        return done


@pytest.mark.parametrize("mode", ["sampler", "per-sample", "batch_sampler"])
def test_lookahead_rides_on_public_sampler_arguments(mode: str) -> None:
    """The lookahead wraps the sampler (or a user's batch sampler) passed to torch, no private
    hook: every batch is prefetched, ``depth`` batches before the loader reads it."""
    data = Prefetching(24)
    if mode == "batch_sampler":
        batches = [list(range(i, i + 4)) for i in range(0, 24, 4)]
        loader = fastload.DataLoader(data, batch_sampler=batches, num_workers=0, lookahead=2)
    else:
        size = 4 if mode == "sampler" else None
        loader = fastload.DataLoader(data, batch_size=size, num_workers=0, lookahead=2)
    assert sorted(torch.cat([torch.as_tensor(b).reshape(-1) for b in loader]).tolist()) == list(
        range(24)
    )
    group = 1 if mode == "per-sample" else 4
    asked = [tuple(i) for kind, i in data.events if kind == "prefetch"]
    assert asked == [tuple(range(i, i + group)) for i in range(0, 24, group)]
    first_get = next(n for n, (kind, _) in enumerate(data.events) if kind == "get")
    assert first_get >= 2  # two batches (the depth) were asked for before the first read


@pytest.mark.parametrize("mode", ["sampler", "batch_sampler"])
def test_with_workers_each_batch_names_one_further_on_to_cache(mode: str) -> None:
    """Every batch but the first few is named once, by a batch handed out before it and at
    least ``lookahead`` + the workers' share of batches earlier; indices stay the same."""
    group, depth, handed = (4, 2, 3)
    batches = [list(range(i, i + group)) for i in range(0, 48, group)]

    def handed_out(plan: Plan) -> list[list[Any]]:
        one = _Pass(plan, workers=True)
        if mode == "batch_sampler":
            return list(one.run(iter(batches), 0))
        flat = list(one.run(iter(range(48)), group))
        return [flat[i : i + group] for i in range(0, 48, group)]

    given = handed_out(Plan(Prefetching(48).prefetch, depth, handed))
    assert [list(opened(b)[0]) for b in given] == batches
    named = {
        n: batches.index(list(b[0].ahead))
        for n, b in enumerate(given)
        if isinstance(b[0], BatchHead)
    }
    assert sorted(named.values()) == list(range(min(named.values()), len(batches)))
    assert all(later - n >= depth + handed - 1 for n, later in named.items())
    assert not any(given[n][0].fill for n in named)  # the workers read these themselves
    assert all(not isinstance(i, BatchHead) for b in given for i in b[1:])
    assert pickle.loads(pickle.dumps(given[0][0])) == given[0][0]
    # workers that only fill the cache are told so by every batch, with a lookahead or not
    for plan in (Plan(None, 0, handed, fill=True), Plan(Prefetching(48).prefetch, 1, 2, True)):
        filling = handed_out(plan)
        assert [list(opened(b)[0]) for b in filling] == batches
        assert all(isinstance(b[0], BatchHead) and b[0].fill for b in filling)


def test_the_samplers_own_methods_pass_through_the_lookahead() -> None:
    data = Prefetching(16)
    loader = fastload.DataLoader(data, batch_size=4, shuffle=True, num_workers=0)
    loader.sampler.set_epoch(3)  # type: ignore[attr-defined]  # the DDP habit
    assert loader.sampler.epoch == 3  # type: ignore[attr-defined]
    first = [int(x) for b in loader for x in b]
    assert loader.state_dict()["sampler"]["epoch"] == 3
    assert sorted(first) == list(range(16)) and len(loader.sampler) == 16  # type: ignore[arg-type]


class Recording:
    """A batch sampler around another that records each batch it hands out, as Lightning's
    predict wraps a loader's (``_IndexBatchSamplerWrapper``) to name each prediction's samples."""

    def __init__(self, batches: torch.utils.data.BatchSampler) -> None:
        self.batches, self.seen = batches, []  # type: Any, list[list[Any]]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[Any]]:
        for batch in self.batches:
            self.seen.append(list(batch))
            yield batch


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_rebuilt_around_another_loaders_sampler_looks_ahead_once(workers: int) -> None:
    """Lightning's predict builds a new loader around the old one's sampler (a lookahead), in a
    batch sampler of its own that records each batch's indices: it records plain indices (not
    what the loader tells its workers), and each batch is prefetched once, not once by each
    loader's lookahead (the old loader's only passes the indices through)."""
    data = Prefetching(24)
    first = fastload.DataLoader(data, batch_size=4, num_workers=workers, lookahead=2)
    recorder = Recording(torch.utils.data.BatchSampler(first.sampler, 4, drop_last=False))
    rebuilt = fastload.DataLoader(data, batch_sampler=recorder, num_workers=workers, lookahead=2)
    assert sorted(int(x) for batch in rebuilt for x in batch) == list(range(24))
    assert recorder.seen == [list(range(i, i + 4)) for i in range(0, 24, 4)]
    assert all(type(i) is int for batch in recorder.seen for i in batch)
    if not workers:  # (a worker's prefetches are its copy's)
        asked = [tuple(i) for kind, i in data.events if kind == "prefetch"]
        assert asked == [tuple(range(i, i + 4)) for i in range(0, 24, 4)]


def test_a_dataset_with_only_part_of_the_contract_is_loaded_as_torch_loads_it() -> None:
    """Whether a dataset keeps the loader's side of the contract is checked once, when the
    loader is made: one with only some of its members (a cache and a prefetch here) is loaded
    as torch's loader would, its members left alone."""

    class Partial(Numbers):
        cache = "a cache"

        def prefetch(self, indices: Sequence[int]) -> Future[None]:
            raise AssertionError("not part of torch's protocol")

    loader = fastload.DataLoader(Partial(8), batch_size=4, num_workers=0)
    assert labels(loader) == list(range(8)) and loader.counters is None


class ReadsAtStart:
    """A ``worker_init_fn`` that reads two samples through the worker's dataset, as a user's
    may (to check a sample, to warm up), and writes what it got."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        got = info.dataset.__getitems__([0, 1])  # type: ignore[attr-defined]
        said = [int(x[0]) for x in got] if isinstance(got, list) else type(got).__name__
        (self.folder / f"worker-{worker_id}").write_text(repr(said))


def test_a_workers_copy_of_the_dataset_gives_its_samples_to_anyone_who_asks(
    tmp_path: Path,
) -> None:
    """Workers that only fill the cache answer the loader with markers, but the dataset in a
    worker is the user's too: read there (in a worker_init_fn), it gives samples. The loader
    set its worker's copy to fill, and a user's read in a worker got a marker, not samples."""
    (tmp_path / "data").mkdir()
    for i in range(8):
        np.save(tmp_path / "data" / f"{i}.npy", np.full(2, i, np.int16))
    dataset = RemoteDataset(
        f"file://{tmp_path / 'data'}", decode="npy", cache=Cache(tmp_path / "cache")
    )
    loader = fastload.DataLoader(
        dataset, batch_size=4, num_workers=2, worker_init_fn=ReadsAtStart(tmp_path)
    )
    assert loader.fills
    assert sorted(int(x[0]) for batch in loader for x in batch) == list(range(8))
    assert [(tmp_path / f"worker-{w}").read_text() for w in (0, 1)] == ["[0, 1]"] * 2


def test_forked_workers_wait_for_a_running_listing_check(tmp_path: Path) -> None:
    """A worker forked while the dataset's listing check talks to the store would copy its
    half-used connections (R3 hung so): fork waits for the check; forkserver need not."""
    (tmp_path / "data").mkdir()
    for i in range(8):
        np.save(tmp_path / "data" / f"{i}.npy", np.full(2, i, np.int16))
    data = RemoteDataset(f"file://{tmp_path / 'data'}", decode="npy")
    check: Future[Any] = Future()
    data.listing_check = check  # as a saved listing's check, still talking to the store
    threading.Timer(0.3, check.set_result, args=(None,)).start()
    loader = fastload.DataLoader(data, batch_size=4, num_workers=1, multiprocessing_context="fork")
    batches = iter(loader)  # the pass (and the workers' start) begins at the first batch
    first = next(batches)
    assert check.done()
    assert len(first) + sum(len(b) for b in batches) == 8


@pytest.mark.parametrize("workers", [0, 2])
def test_warm_batches_read_into_place_are_the_samples_while_earlier_ones_are_held(
    tmp_path: Path, workers: int
) -> None:
    """Warm epochs of a labelled npy cache hand out exactly the samples of each batch, with
    their labels, whether the loop keeps every batch of an epoch (no batch array may be reused
    under it) or drops each one (they are reused)."""
    expected = {}
    for i in range(96):
        image = np.random.default_rng(i).integers(0, 2**16, (3, 96, 128), dtype=np.uint16)
        folder = tmp_path / "data" / ("cat" if i % 3 else "dog")
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"{i:03d} a%20é.npy", image)  # odd keys, two classes
        expected[image.tobytes()] = int(i % 3 == 0)  # label index: classes sorted
    dataset = RemoteDataset(
        f"file://{tmp_path / 'data'}",
        decode="npy",
        labels="folders",
        cache=Cache(tmp_path / "cache", format="npy"),
    )
    loader = fastload.DataLoader(dataset, batch_size=16, shuffle=True, num_workers=workers)

    def check(batch: Any) -> int:
        images, labels = batch
        assert images.dtype == torch.uint16 and images.shape[1:] == (3, 96, 128)
        for image, label in zip(images.numpy(), labels.tolist(), strict=True):
            assert expected[image.tobytes()] == label
        return len(images)

    for _ in range(2):  # the first fills the cache
        held = list(loader)
        assert sum(check(batch) for batch in held) == 96
    filled = dataset.stats()["cache"]["misses"]
    for _ in range(2):
        assert sum(check(batch) for batch in loader) == 96
    # the names warm reads look for are those the lookahead checks: nothing is made twice
    assert all(dataset.cache.contains_many(dataset._cache_names(list(range(96)))))
    if workers == 0:
        assert dataset.stats()["cache"]["misses"] == filled


def test_a_workers_counters_lose_no_count_added_while_they_are_drained() -> None:
    """A worker drains its counters into each batch while its lookahead thread counts fetches.
    Draining copied the counters and then zeroed them, losing what was added in between: the
    four-process cache test saw 296 fetches for 300 objects. Under contention here the old
    drain lost about 40% of 300,000 counts."""
    from fastload.stats import StageCounters

    counters, adds, done = StageCounters(), 300_000, threading.Event()

    def count() -> None:
        for _ in range(adds):
            counters.fetch.objects += 1
        done.set()

    thread = threading.Thread(target=count)
    thread.start()
    drained = 0
    while not done.is_set():
        drained += counters.drain().fetch.objects
    thread.join()
    drained += counters.drain().fetch.objects
    assert drained == adds
    assert counters.drain().fetch.objects == 0  # nothing new: nothing twice


def test_a_drain_that_counted_nothing_is_empty_and_a_count_of_any_kind_is_not() -> None:
    """A worker's batch carries its drained counters only when they hold something (a warm
    batch it left unlooked counts nothing: 7 in 8 on a warm streak), so the empty check must
    see a count of every kind: an int, a float, a key skipped, a duration."""
    from fastload.stats import StageCounters

    counters = StageCounters()
    assert counters.drain().empty and counters.drain().empty
    counts: list[Callable[[StageCounters], None]] = [
        lambda c: setattr(c.cache, "hits", c.cache.hits + 1),
        lambda c: setattr(c.cache, "write_s", c.cache.write_s + 0.5),
        lambda c: c.dataset.skipped_keys.append(f"s3://b/{len(c.dataset.skipped_keys)}"),
        lambda c: c.dataset.prepare.add(0.002),
        lambda c: c.fetch.latency.add(0.02),
    ]
    for add in counts:
        add(counters)
        taken = counters.drain()
        assert not taken.empty, add
        assert counters.drain().empty  # and a drain copies: nothing counted twice
    assert taken.fetch.latency.count == 1 and counters.fetch.latency.count == 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_that_fails_to_decode_is_not_fetched_again_every_epoch(
    seaweed: S3Server, tmp_path: Path, workers: int
) -> None:
    """One corrupt object among 30 behind a cache: every warm epoch fetched it again (and
    failed again). Now each process remembers it for the run; it is still skipped and named."""
    root = upload(
        f"s3://{BUCKET}/undecodable-{uuid.uuid4().hex[:8]}", seaweed.storage_options(), 30
    )
    filesystem(root, seaweed.storage_options()).pipe_file(
        f"{root.split('://', 1)[1]}/0007.npy", b"\x93NUMPY but not really"
    )
    with FaultProxy(seaweed.endpoint, flavor="s3") as proxy:
        dataset = RemoteDataset(
            root,
            storage_options=seaweed.storage_options(proxy.endpoint),
            decode="npy",
            cache=Cache(tmp_path / "cache", format="npy"),
            on_error="skip",
        )
        loader = fastload.DataLoader(dataset, batch_size=5, shuffle=True, num_workers=workers)
        gets = []
        for epoch in range(4):
            loader.set_epoch(epoch)
            before = proxy.counters()["requests"]
            seen = [int(x.flatten()[0]) for batch in loader for x in batch]
            gets.append(proxy.counters()["requests"] - before)
            assert len(seen) == 30 and 7 not in seen and set(seen) == set(range(30)) - {7}
    assert gets[0] >= 30
    # a worker that has not met the corrupt object yet reads it once more, at most
    assert sum(gets[1:]) <= workers, gets
    if not workers:  # (with workers, each worker's counters are its own)
        assert dataset.stats()["dataset"]["skipped_keys"] == [f"{root}/0007.npy"]


def test_a_state_saved_at_the_end_of_a_resumed_epoch_with_a_short_last_batch_loads() -> None:
    """len() is the whole epoch now; the resumed pass had only what was left, and a
    checkpoint at its end (Lightning saves one) was refused: local_consumed out of range."""
    first = fastload.DataLoader(
        list(range(100)), batch_size=32, shuffle=True, seed=0, num_workers=0
    )
    batches = iter(first)
    seen = [int(x) for _ in range(2) for x in next(batches)]
    state = first.state_dict()
    resumed = fastload.DataLoader(
        list(range(100)), batch_size=32, shuffle=True, seed=0, num_workers=0
    )
    resumed.load_state_dict(state)
    rest = [int(x) for batch in resumed for x in batch]
    assert sorted(seen + rest) == list(range(100)) and len(rest) == 36
    end = resumed.state_dict()
    after = fastload.DataLoader(
        list(range(100)), batch_size=32, shuffle=True, seed=0, num_workers=0
    )
    after.load_state_dict(end)
    assert sorted(int(x) for batch in after for x in batch) == list(range(100))  # next epoch
