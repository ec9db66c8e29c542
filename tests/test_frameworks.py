"""fastload where users train: Lightning (DDP, 2 CPU ranks over gloo), Accelerate and plain DDP
under torchrun, each run as a real job (tests/_framework_jobs.py) over 200 samples on the
SeaweedFS loopback server, counting every sample of every epoch across the ranks and resuming
from a mid-epoch and an end-of-epoch checkpoint through the framework's own checkpointing; and
the StatefulDataLoader protocol of torchdata."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler
from torchdata.stateful_dataloader import Stateful, StatefulDataLoader

import fastload
from fastload import ConfigError, PermutationSampler, WeightedSampler
from fastload._lookahead import Lookahead
from fastload.testing import free_port
from tests.conftest import BUCKET, write

SAMPLES = 200
RANKS = 2
PER_RANK = SAMPLES // RANKS
BATCH = 10  # tests/_framework_jobs.py's
ROOT = Path(__file__).resolve().parent.parent


def npy(value: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, value)
    return out.getvalue()


@pytest.fixture(scope="module")
def data(seaweed: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """200 one-number samples (sample i holds i) and a cache the ranks share, as on one host."""
    options = seaweed.storage_options()
    root = f"s3://{BUCKET}/frameworks-{uuid.uuid4().hex[:8]}"
    write(root, options, {f"{i:04d}.npy": npy(np.full((1,), i, np.float32)) for i in range(200)})
    return {"root": root, "options": options, "cache": str(tmp_path_factory.mktemp("cache"))}


def run(job: str, spec: dict[str, Any], out: Path, launcher: list[str]) -> list[dict[str, Any]]:
    """Run ``job`` with ``spec`` under ``launcher``; what each rank wrote, in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(out)}
    (out / "spec.json").write_text(json.dumps(spec))
    command = [*launcher, "-m", "tests._framework_jobs", job, str(out / "spec.json")]
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [json.loads((out / f"{spec['phase']}-rank-{r}.json").read_text()) for r in range(RANKS)]


def torchrun() -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={RANKS}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
    ]


def every_sample_once(ranks: list[list[int]]) -> None:
    """An epoch's ids, one list per rank: each rank its share, every sample exactly once."""
    assert [len(seen) for seen in ranks] == [PER_RANK] * RANKS
    assert sorted(i for seen in ranks for i in seen) == list(range(SAMPLES))


def test_lightning_ddp_sees_every_sample_once_and_resumes_from_its_checkpoints(
    data: dict[str, Any], tmp_path: Path
) -> None:
    """Lightning replaced fastload's sampler by its DistributedSamplerWrapper around it, which
    sharded the shard (100 of 200 samples never seen) and whose first checkpoint failed; with
    use_distributed_sampler=False a resume mid-epoch ended the epoch early (len() was what was
    left, and Lightning adds the batches done) and capped later ones, and a resume at an
    epoch's end replayed epoch 0's order (the iterator read the sampler before Lightning set
    the epoch). Lightning now leaves fastload's sampler in place (it is a DistributedSampler),
    len() is the whole epoch, and a pass begins at its first batch."""
    launcher = [sys.executable]
    # the defaults, the loader made before fit (so before the process group)
    ran = run("lightning", {**data, "phase": "made"}, tmp_path / "ran", launcher)
    epochs = [[rank["epochs"][str(epoch)] for rank in ran] for epoch in range(3)]
    for ranks in epochs:
        every_sample_once(ranks)
    assert len({tuple(ranks[0]) for ranks in epochs}) == 3  # a new order each epoch
    checkpoints = tmp_path / "ran" / "checkpoints"

    # resumed 2 batches into epoch 1 (step 12), the loader made in train_dataloader()
    mid = run(
        "lightning",
        {**data, "phase": "hook", "ckpt": str(checkpoints / "step-12.ckpt")},
        tmp_path / "mid",
        launcher,
    )
    # resumed after epoch 0, with use_distributed_sampler=False
    end = run(
        "lightning",
        {**data, "phase": "off", "ckpt": str(checkpoints / "end-0.ckpt")},
        tmp_path / "end",
        launcher,
    )
    for rank in range(RANKS):
        assert mid[rank]["epochs"]["1"] == epochs[1][rank][2 * BATCH :]  # the rest, in order
        assert mid[rank]["epochs"]["2"] == epochs[2][rank]  # the next epoch whole
        assert sorted(end[rank]["epochs"]) == ["1", "2"]
        assert end[rank]["epochs"]["1"] == epochs[1][rank]  # epoch 1's order, not epoch 0's
        assert end[rank]["epochs"]["2"] == epochs[2][rank]


def test_accelerate_refuses_to_reshard_and_its_save_state_resumes_exactly(
    data: dict[str, Any], tmp_path: Path
) -> None:
    """accelerator.prepare(loader) rebuilt the loader with a BatchSamplerShard that sharded
    fastload's shard again: 100 of 200 samples an epoch, silently. It now raises, saying what
    to do: the setup docs/frameworks.md gives (the loader as it is, registered for
    checkpointing), whose save_state/load_state resume mid-epoch and after an epoch exactly."""
    ranks = run("accelerate", {**data, "phase": "accelerate"}, tmp_path, torchrun())
    for rank in ranks:
        assert "prepared" not in rank  # no epoch of a quarter of the samples
        assert (
            "do not pass the fastload.DataLoader to accelerator.prepare()"
            in (rank["prepared error"])
        )
        assert "register_for_checkpointing" in rank["prepared error"]
    epochs = [[rank["epochs"][str(epoch)] for rank in ranks] for epoch in range(3)]
    for epoch in epochs:
        every_sample_once(epoch)
    for r, rank in enumerate(ranks):
        # saved after 3 batches of epoch 1: its rest, then epoch 2 by itself
        assert rank["resumed mid"]["1"] == epochs[1][r][3 * BATCH :]
        assert rank["resumed mid"]["2"] == epochs[2][r]
        # saved at the end of epoch 0: epoch 1 whole, by itself, in its own order
        assert rank["resumed end"]["1"] == epochs[1][r]
        assert rank["resumed end"]["2"] == epochs[2][r]


def test_torchrun_ranks_split_the_epoch_before_and_without_a_process_group(
    data: dict[str, Any], tmp_path: Path
) -> None:
    """A loader made before init_process_group, or iterated with only the launcher's RANK and
    WORLD_SIZE, gave each rank all 200 samples (every sample twice an epoch). The ranks are now
    looked up when the loader is iterated, the launcher's variables until a group is up. Its
    states resume a fresh loader that is never told an epoch: after one saved mid-epoch, the
    rest and then the next epoch; after one saved at an epoch's end, the next epoch; len() the
    whole epoch's batches throughout. A mid-epoch state of the 2 ranks resumes on 1 as well."""
    ranks = run("torchrun", {**data, "phase": "torchrun"}, tmp_path, torchrun())
    every_sample_once([rank["no group"] for rank in ranks])
    epochs = [[rank["epochs"][str(epoch)] for rank in ranks] for epoch in range(3)]
    for epoch in epochs:
        every_sample_once(epoch)
    for r, rank in enumerate(ranks):
        assert rank["length"] == PER_RANK // BATCH
        mid, end = rank["resumed mid"], rank["resumed end"]
        assert mid["passes"] == [epochs[1][r][3 * BATCH :], epochs[2][r]]
        assert end["passes"] == [epochs[1][r], epochs[2][r]]
        assert mid["length"] == end["length"] == PER_RANK // BATCH

    # the state of the 2 ranks 3 batches into epoch 1, resumed by one process
    one = fastload.DataLoader(list(range(SAMPLES)), batch_size=BATCH, shuffle=True, seed=3)
    one.load_state_dict(ranks[0]["states"]["mid"])
    rest = [int(i) for batch in one for i in batch]
    seen = [i for rank in epochs[1] for i in rank[: 3 * BATCH]]
    assert sorted(seen + rest) == list(range(SAMPLES))
    assert len(one) == SAMPLES // BATCH


class Numbers(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> int:
        return index


def test_fastload_samplers_say_they_shard_themselves(tmp_path: Path) -> None:
    """Lightning, Fabric and Ray Train wrap a loader's sampler in their own DistributedSampler
    unless it is one: fastload's are (through the lookahead around one, too). A sampler of the
    user's that Lightning wrapped cannot resume, and the error says what to leave out."""
    assert isinstance(PermutationSampler(10), DistributedSampler)
    assert isinstance(WeightedSampler(np.ones(4), 8), DistributedSampler)
    sampler = PermutationSampler(10, rank=1, world_size=2)
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (2, 1, 5)
    plain = fastload.DataLoader(Numbers(), batch_size=10, num_workers=0)
    assert isinstance(plain.sampler, DistributedSampler)
    cached = fastload.CachedDataset(Numbers(), fastload.Cache(tmp_path))
    ahead = fastload.DataLoader(cached, batch_size=10, num_workers=0)
    assert isinstance(ahead.sampler, Lookahead)  # it caches ahead
    assert isinstance(ahead.sampler, DistributedSampler)
    ahead.sampler.set_epoch(3)
    assert ahead.sampler.lookahead_source.epoch == 3
    theirs = fastload.DataLoader(Numbers(), 10, sampler=RandomSampler(Numbers()), num_workers=0)
    assert not isinstance(theirs.sampler, DistributedSampler)  # not sharded: theirs to shard
    wrapped = DistributedSampler(Numbers(), num_replicas=2, rank=0)  # as Lightning wraps it
    with pytest.raises(ConfigError, match="leave sampler= out"):
        fastload.DataLoader(Numbers(), 10, sampler=wrapped, num_workers=0).state_dict()


def test_set_epoch_between_iter_and_the_first_batch_chooses_the_order() -> None:
    """Lightning makes the iterator, then sets the epoch: the pass took the order before (its
    workers were handed the first batches' indices inside iter())."""
    loader = fastload.DataLoader(
        Numbers(), 10, True, seed=1, num_workers=1, multiprocessing_context="fork"
    )
    batches = iter(loader)
    loader.set_epoch(2)
    first = [int(i) for batch in batches for i in batch]
    reference = fastload.DataLoader(Numbers(), 10, True, seed=1, num_workers=0)
    reference.set_epoch(2)
    assert first == [int(i) for batch in reference for i in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_statefuldataloader_state_over_fastloads_sampler_resumes_a_fastload_loader(
    workers: int,
) -> None:
    """torchdata's StatefulDataLoader given fastload's sampler keeps its state inside its own;
    fastload.DataLoader loads that state and continues where it stopped (with workers, from
    its last snapshot and the batches taken since). And the other way round through the
    sampler; a state of another sampler's order is refused, saying what to do."""
    theirs = StatefulDataLoader(
        Numbers(), batch_size=10, sampler=PermutationSampler(100, seed=4), num_workers=workers
    )
    batches = iter(theirs)
    head = [int(i) for _, batch in zip(range(3), batches, strict=False) for i in batch]
    state = theirs.state_dict()
    ours = fastload.DataLoader(Numbers(), batch_size=10, shuffle=True, seed=4, num_workers=0)
    assert isinstance(ours, Stateful)  # what torchdata and torch.distributed.checkpoint check
    ours.load_state_dict(state)
    rest = [int(i) for batch in ours for i in batch]
    whole = PermutationSampler(100, seed=4)
    assert head + rest == list(whole)
    assert len(ours) == 10

    # fastload's state, 3 batches in, into a StatefulDataLoader over fastload's sampler
    ours = fastload.DataLoader(Numbers(), batch_size=10, shuffle=True, seed=4, num_workers=0)
    for step, _ in enumerate(ours):
        if step == 2:
            saved = ours.state_dict()
            break
    sampler = PermutationSampler(100, seed=4)
    again = StatefulDataLoader(Numbers(), batch_size=10, sampler=sampler, num_workers=workers)
    sampler.load_state_dict(saved["sampler"])
    assert head + [int(i) for batch in again for i in batch] == list(whole)

    shuffled = StatefulDataLoader(Numbers(), batch_size=10, shuffle=True, num_workers=workers)
    next(iter(shuffled))
    with pytest.raises(ConfigError, match=r"whose sampler was not a fastload\.PermutationSampler"):
        ours.load_state_dict(shuffled.state_dict())


def test_a_state_saved_at_an_epochs_end_starts_the_next_epoch_by_itself() -> None:
    """It loaded with len() 0 and gave an empty pass unless set_epoch(e + 1) was called.
    Setting the finished epoch itself still gives its (empty) rest, as before."""
    loader = fastload.DataLoader(Numbers(), batch_size=10, shuffle=True, seed=5, num_workers=0)
    loader.set_epoch(4)
    epoch_4 = [int(i) for batch in loader for i in batch]
    state = loader.state_dict()
    epoch_5 = [int(i) for batch in loader for i in batch]
    resumed = fastload.DataLoader(Numbers(), batch_size=10, shuffle=True, seed=5, num_workers=0)
    resumed.load_state_dict(state)
    assert len(resumed) == 10
    assert [int(i) for batch in resumed for i in batch] == epoch_5 != epoch_4
    resumed.load_state_dict(state)
    resumed.set_epoch(4)  # the loop that sets the saved epoch again: nothing of it is left
    assert list(resumed) == []
    resumed.set_epoch(5)
    assert [int(i) for batch in resumed for i in batch] == epoch_5
