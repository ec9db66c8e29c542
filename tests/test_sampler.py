"""PermutationSampler and WeightedSampler: bijection, sharding, resume, determinism, bad input."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fastload import ConfigError, PermutationSampler, WeightedSampler
from fastload.sampler import KeyedPermutation

sizes = st.one_of(st.integers(0, 300), st.sampled_from([1, 2, 3, 97, 257, 1021, 4099, 65537]))


@settings(max_examples=60, deadline=None)
@given(n=sizes, key=st.integers(0, 2**64 - 1))
def test_keyed_permutation_is_a_bijection(n: int, key: int) -> None:
    values = KeyedPermutation(n, key)(np.arange(n))
    assert np.array_equal(np.sort(values), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(
    n=sizes,
    world=st.integers(1, 9),
    seed=st.integers(0, 1000),
    drop_last=st.booleans(),
    block=st.one_of(st.none(), st.integers(1, 40)),
)
def test_shards_are_disjoint_cover_the_epoch_and_equal(
    n: int, world: int, seed: int, drop_last: bool, block: int | None
) -> None:
    shards = [
        list(
            PermutationSampler(
                n, seed=seed, rank=r, world_size=world, drop_last=drop_last, block_size=block
            )
        )
        for r in range(world)
    ]
    samplers = [
        PermutationSampler(
            n, seed=seed, rank=r, world_size=world, drop_last=drop_last, block_size=block
        )
        for r in range(world)
    ]
    assert len({len(s) for s in shards}) == 1  # every rank the same count
    assert all(len(s) == len(sampler) for s, sampler in zip(shards, samplers, strict=True))
    if n >= 1:
        assert all(len(s) >= 1 for s in shards)  # no rank ever gets zero
    real = [s[: sampler.num_real_samples] for s, sampler in zip(shards, samplers, strict=True)]
    flat_real = [i for shard in real for i in shard]
    assert len(flat_real) == len(set(flat_real))  # unique where not padding
    if not drop_last or n < world:
        assert sorted(flat_real) == list(range(n))  # covers the epoch exactly once
    else:
        assert len(flat_real) == n // world * world
    assert all(0 <= i < n for shard in shards for i in shard)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 400),
    old_world=st.integers(1, 6),
    new_world=st.integers(1, 6),
    fraction=st.floats(0, 1),
    block=st.one_of(st.none(), st.integers(1, 16)),
)
@example(n=13, old_world=6, new_world=1, fraction=0.5, block=1)  # a rank's first is a pad
def test_resume_equals_uninterrupted_even_across_world_size(
    n: int, old_world: int, new_world: int, fraction: float, block: int | None
) -> None:
    old = [
        PermutationSampler(n, seed=5, rank=r, world_size=old_world, block_size=block)
        for r in range(old_world)
    ]
    for sampler in old:
        sampler.set_epoch(3)
    consumed = int(len(old[0]) * fraction)
    seen = set()
    for sampler in old:
        it = iter(sampler)
        for step in range(consumed):
            index = next(it)
            if step < sampler.num_real_samples:  # a pad repeats a sample served for real
                seen.add(index)  # elsewhere in the epoch, before or after the resume
    state = old[0].state_dict()
    assert all(s.state_dict() == state for s in old)  # ranks in lockstep agree

    new = [
        PermutationSampler(n, seed=5, rank=r, world_size=new_world, block_size=block)
        for r in range(new_world)
    ]
    rest = []
    for sampler in new:
        sampler.load_state_dict(state)
        sampler.set_epoch(3)  # the usual loop calls set_epoch again: the resume point stays
        rest.extend(list(sampler)[: sampler.num_real_samples])
    assert len(rest) == len(set(rest))
    assert seen.isdisjoint(rest)
    assert seen | set(rest) == set(range(n))


def test_resume_yields_exactly_the_remaining_order() -> None:
    full = list(PermutationSampler(1000, seed=1))
    sampler = PermutationSampler(1000, seed=1)
    it = iter(sampler)
    head = [next(it) for _ in range(377)]
    resumed = PermutationSampler(1000, seed=1)
    resumed.load_state_dict(sampler.state_dict())
    assert head + list(resumed) == full
    resumed.set_epoch(1)
    assert len(resumed) == 1000  # a new epoch starts from the beginning


def test_epochs_and_seeds_change_the_order_deterministically() -> None:
    a, b = PermutationSampler(500, seed=0), PermutationSampler(500, seed=0)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == sorted(first)
    assert list(PermutationSampler(500, seed=1)) != first
    assert list(PermutationSampler(500, shuffle=False)) == list(range(500))


def test_same_order_in_another_process() -> None:
    code = (
        "from fastload import PermutationSampler as P; "
        "s = P(10007, seed=9); s.set_epoch(4); print(list(s)[:50])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    here = PermutationSampler(10007, seed=9)
    here.set_epoch(4)
    assert out.strip() == str(list(here)[:50])


def test_batched_path_matches_iteration() -> None:
    sampler = PermutationSampler(10_000, seed=2, rank=1, world_size=3)
    flat = list(sampler)
    batches = list(sampler.iter_batches(64))
    assert [i for b in batches for i in b] == flat
    assert all(len(b) == 64 for b in batches[:-1])
    assert all(len(b) == 64 for b in sampler.iter_batches(64, drop_last=True))
    assert np.array_equal(sampler.indices(), np.array(flat))


def test_works_as_a_dataloader_sampler() -> None:
    data = torch.arange(100)
    loader = torch.utils.data.DataLoader(
        data, batch_size=10, sampler=PermutationSampler(100, seed=3)
    )
    assert sorted(torch.cat(list(loader)).tolist()) == list(range(100))


def top2_shares(labels: np.ndarray, order: np.ndarray, batch: int = 256) -> np.ndarray:
    batches = labels[order[: order.size // batch * batch]].reshape(-1, batch)
    return np.array(
        [sum(c for _, c in Counter(b.tolist()).most_common(2)) / batch for b in batches]
    )


def test_full_shuffle_mixes_a_label_sorted_dataset_like_a_uniform_permutation() -> None:
    labels = np.repeat(np.arange(20), 5000)  # sorted by class, 20 classes
    ours = top2_shares(labels, PermutationSampler(labels.size, seed=0).indices())
    uniform = top2_shares(labels, np.random.default_rng(0).permutation(labels.size))
    assert ours.mean() <= 0.15  # the typical batch: ~0.148, as for a perfect shuffle
    # The worst of ~390 batches is ~0.18 even for a perfect shuffle; ours must not be worse.
    assert ours.max() <= uniform.max() + 0.03


def test_block_mode_keeps_batches_within_few_blocks() -> None:
    sampler = PermutationSampler(100_000, seed=0, block_size=1000, window=2)
    blocks_per_batch = [len({i // 1000 for i in batch}) for batch in sampler.iter_batches(256)]
    assert max(blocks_per_batch) <= 4  # a window spans 2 blocks; a batch may straddle two windows
    assert sorted(sampler.indices().tolist()) == list(range(100_000))


@pytest.mark.parametrize("blocks", [None, np.cumsum([0, 300, 17, 1, 400, 250, 90, 700, 33])])
def test_in_block_mode_each_block_is_read_by_one_rank(blocks: np.ndarray | None) -> None:
    # Ranks take contiguous shares of the epoch, which visits blocks one after another: a block
    # is read by one rank (two where a share ends inside its window), not by all of them.
    n, world, window = 2000, 4, 2
    sizes = np.diff(np.append(blocks, n)) if blocks is not None else np.full(20, 100)
    starts = np.append(0, np.cumsum(sizes)[:-1])
    readers: dict[int, set[int]] = {}
    for rank in range(world):
        sampler = PermutationSampler(
            n, seed=3, rank=rank, world_size=world, window=window,
            **({"blocks": blocks} if blocks is not None else {"block_size": 100}),
        )  # fmt: skip
        sampler.set_epoch(2)
        for index in sampler.indices()[: sampler.num_real_samples].tolist():
            block = int(np.searchsorted(starts, index, side="right")) - 1
            readers.setdefault(block, set()).add(rank)
    pairs = sum(len(ranks) for ranks in readers.values())
    assert len(readers) == len(sizes)  # every block read ...
    assert pairs <= len(sizes) + (world - 1) * window  # ... by one rank, but at share ends


def test_a_block_mode_state_saved_by_the_strided_version_resumes_as_a_prefix() -> None:
    # Before block mode shared contiguously, its state held only the position: the epoch's
    # positions before it were consumed (striding consumes a prefix).
    whole = PermutationSampler(500, seed=1, block_size=20)
    state = whole.state_dict()
    del state["remaining"]
    state["position"] = 123
    rest = []
    for rank in range(3):
        sampler = PermutationSampler(500, seed=1, block_size=20, rank=rank, world_size=3)
        sampler.load_state_dict(state)
        rest += sampler.indices()[: sampler.num_real_samples].tolist()
    assert sorted(rest) == sorted(whole.indices()[123:].tolist())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": -1}, "n"),
        ({"n": 10, "rank": 2, "world_size": 2}, "rank"),
        ({"n": 10, "world_size": 0}, "world_size"),
        ({"n": 10, "block_size": 0}, "block_size"),
        ({"n": 10, "window": 0}, "window"),
        ({"n": 10, "window": 2.5}, "window"),
        ({"n": 10, "seed": "a"}, "seed"),
        ({"n": 10, "seed": None}, "seed"),
        ({"n": 10, "seed": 1.5}, "seed"),
        ({"n": 10, "seed": 2**64}, "seed"),  # masked to 64 bits, it was seed 0's order
        ({"n": 10, "world_size": True}, "world_size"),
    ],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, object], field: str) -> None:
    """Each a ConfigError naming the argument when the sampler is made; a seed that is not an
    int failed with a bare TypeError at the first iteration, and one past 64 bits gave another
    seed's order without a word."""
    with pytest.raises(ConfigError, match=f"{field} must be an int"):
        PermutationSampler(**kwargs)  # type: ignore[arg-type]
    sampler = PermutationSampler(10, seed=np.int64(-3))  # numpy ints and negative seeds are fine
    assert sorted(sampler) == list(range(10)) and list(sampler) != list(PermutationSampler(10))
    with pytest.raises(ConfigError, match="epoch must be an int >= 0, got '2'"):
        sampler.set_epoch("2")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("other", "field"),
    [
        ({"n": 11}, "n"),
        ({"seed": 1}, "seed"),
        ({"shuffle": False}, "shuffle"),
        ({"block_size": 4}, "block_size"),
    ],
)
def test_state_from_another_sampler_config_is_refused(other: dict[str, int], field: str) -> None:
    state = PermutationSampler(10).state_dict()
    target = PermutationSampler(**{"n": 10, **other})
    with pytest.raises(ConfigError, match=field):
        target.load_state_dict(state)
    with pytest.raises(ConfigError, match="position"):
        PermutationSampler(10).load_state_dict({**state, "position": 11})


def test_drop_last_never_leaves_a_rank_empty(caplog: pytest.LogCaptureFixture) -> None:
    shards = [list(PermutationSampler(3, rank=r, world_size=4, drop_last=True)) for r in range(4)]
    assert all(len(s) == 1 for s in shards)
    assert "padding instead of dropping" in caplog.text


def test_weighted_sampler_balances_classes_deterministically() -> None:
    labels = np.array([0] * 900 + [1] * 90 + [2] * 10)
    sampler = WeightedSampler.balanced(labels, num_samples=30_000, seed=4)
    drawn = list(sampler)
    shares = np.bincount(labels[drawn], minlength=3) / len(drawn)
    assert np.allclose(shares, 1 / 3, atol=0.02)
    assert drawn == list(WeightedSampler.balanced(labels, num_samples=30_000, seed=4))
    sampler.set_epoch(1)
    assert list(sampler) != drawn
    with pytest.raises(ConfigError, match="weights"):
        WeightedSampler([0.0, 0.0], num_samples=3)


def test_weighted_sampler_takes_one_weight_or_label_per_sample() -> None:
    """One-hot labels (n, k) were read flat as n * k labels, and the sampler drew indices up
    to n * k for a dataset of n: refused, naming the shape. A column (pandas' df[["w"]]) or
    a row is one per sample and still taken."""
    one_hot = np.eye(3)[[0, 1, 1, 2]]
    with pytest.raises(ConfigError, match=r"labels must be one per sample.*\(4, 3\).*argmax"):
        WeightedSampler.balanced(one_hot)
    with pytest.raises(ConfigError, match=r"weights must be one per sample.*\(4, 3\)"):
        WeightedSampler(one_hot, num_samples=4)
    column = list(WeightedSampler(np.ones((5, 1)), num_samples=50))
    assert max(column) == 4 and column == list(WeightedSampler(np.ones((1, 5)), num_samples=50))
    assert max(WeightedSampler.balanced(one_hot.argmax(1)[:, None])) <= 3


def test_weighted_sampler_shards_and_resumes() -> None:
    weights = np.linspace(1, 2, 50)
    whole = list(WeightedSampler(weights, 100, seed=1))
    shards = [list(WeightedSampler(weights, 100, seed=1, rank=r, world_size=2)) for r in range(2)]
    assert [x for pair in zip(*shards, strict=True) for x in pair] == whole
    sampler = WeightedSampler(weights, 100, seed=1)
    it = iter(sampler)
    head = [next(it) for _ in range(40)]
    resumed = WeightedSampler(weights, 100, seed=1)
    resumed.load_state_dict(sampler.state_dict())
    assert head + list(resumed) == whole


def test_bad_sizes_and_states_are_config_errors() -> None:
    for n in (2**64, 2**62, -1, 1.5, True):
        with pytest.raises(ConfigError, match="n must be"):
            PermutationSampler(n)  # type: ignore[arg-type]
    big = PermutationSampler(2**62 - 1, seed=3)
    assert big.indices(0, 4).min() >= 0 and big.indices(0, 4).max() < 2**62 - 1
    sampler = PermutationSampler(100, seed=1)
    good = sampler.state_dict()
    with pytest.raises(ConfigError, match="expected the dict"):
        sampler.load_state_dict(None)  # type: ignore[arg-type]
    for field in ("epoch", "position", "n"):
        with pytest.raises(ConfigError, match=f"lacks {field!r}"):
            sampler.load_state_dict({k: v for k, v in good.items() if k != field})
    with pytest.raises(ConfigError, match="epoch must be an int"):
        sampler.load_state_dict({**good, "epoch": "3"})


def test_splitting_by_the_launcher_s_variables_without_a_group_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A process that inherited RANK and WORLD_SIZE (an eval subprocess, a pod's plain script)
    reads only its share: the log says so, once."""
    from fastload import ranks

    monkeypatch.setattr(ranks, "_said_env_sharding", [])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with caplog.at_level(logging.WARNING, logger="fastload.ranks"):
        assert ranks.sharding_rank_world() == (1, 4)
        assert ranks.sharding_rank_world() == (1, 4)
    said = [r for r in caplog.records if "RANK=1 and WORLD_SIZE=4" in r.getMessage()]
    assert len(said) == 1 and "this_rank_only" in said[0].getMessage()
