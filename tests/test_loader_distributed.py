"""Tar shards under a real torch.distributed job: gloo, one spawned CPU process a rank, a real
SeaweedFS server."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from fastload.testing import free_port
from tests.conftest import BUCKET
from tests.test_shards import PER_SHARD, SHARDS, tar_dataset

WORLD = 3  # 100 samples do not split evenly: the last rank is padded, as torch's sampler pads
BATCH = 8


def _rank(
    rank: int, world: int, port: int, job: Callable[..., Any], args: tuple[Any, ...], out: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    try:
        out[rank] = job(*args)
    finally:
        dist.destroy_process_group()


def _on_ranks(job: Callable[..., Any], *args: Any) -> list[Any]:
    """``job(*args)`` on each of ``WORLD`` ranks; their results in rank order."""
    manager = mp.get_context("spawn").Manager()
    try:
        out = manager.dict()
        mp.start_processes(
            _rank, args=(WORLD, free_port(), job, args, out), nprocs=WORLD, start_method="spawn"
        )
        return [out[rank] for rank in range(WORLD)]
    finally:
        manager.shutdown()


def _epochs(root: str, options: dict[str, Any], cache: str, workers: int = 0) -> dict[str, Any]:
    import fastload
    from fastload import Cache, ChunkConfig, RemoteDataset
    from tests.test_shards import DECODE, image

    dataset = RemoteDataset(
        fastload.Tar(f"{root}/train", chunks=ChunkConfig(chunk_bytes=150_000)),  # a few a shard
        decode=DECODE,
        cache=Cache(cache, format="npy"),
        storage_options=options,
    )
    loader = fastload.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, seed=11, collate_fn=list, num_workers=workers
    )
    epochs, requests, wrong = [], [], 0
    for _ in range(2):
        before = _requests(loader)
        seen = []
        for batch in loader:
            for item in batch:
                n = item["meta.json"]["n"]
                wrong += not np.array_equal(item["npy"], image(n)) or item["cls"] != n % 3
                seen.append(n)
        epochs.append(seen)
        requests.append(_requests(loader) - before)
        dist.barrier()  # the ranks end an epoch together, as DDP's steps keep them
    assert dataset.blocks is not None
    return {
        "epochs": epochs,
        "requests": requests,
        "wrong": wrong,
        "blocks": dataset.blocks.tolist(),
        "per_rank": len(loader.sampler),  # type: ignore[arg-type]
    }


def _requests(loader: Any) -> int:
    """Requests of this rank's process and its workers so far."""
    counters = loader.counters
    return 0 if counters is None else int(counters.fetch.requests)


@pytest.mark.parametrize("workers", [0, 2])
def test_ranks_read_every_sample_once_from_their_own_chunks(
    seaweed: Any, tmp_path: Path, workers: int
) -> None:
    """With workers too: each rank's share is split again among its workers, and nothing is
    read twice or left out across ranks and workers."""
    options = seaweed.storage_options()
    root = f"s3://{BUCKET}/loader-distributed-{uuid.uuid4().hex[:8]}"
    tar_dataset(root, options)
    # one cache shared by the ranks, as on one host
    ranks = _on_ranks(_epochs, root, options, str(tmp_path / "cache"), workers)

    total = SHARDS * PER_SHARD
    per_rank = -(-total // WORLD)
    starts = np.asarray(ranks[0]["blocks"])
    assert all(r["wrong"] == 0 for r in ranks)  # every sample's bytes are its own
    assert all(r["per_rank"] == per_rank for r in ranks)
    for epoch in range(2):
        seen = [n for r in ranks for n in r["epochs"][epoch]]
        assert len(seen) == WORLD * per_rank  # every rank as many (DDP steps in lockstep)
        assert sorted(set(seen)) == list(range(total))  # every sample, ...
        assert len(seen) - len(set(seen)) == WORLD * per_rank - total  # ... once, but the pad
    for r in ranks:
        first, second = r["epochs"]
        assert first != second  # reshuffled every epoch, as torch's sampler with set_epoch
        assert first != sorted(first)
        chunks = set(np.searchsorted(starts, first, side="right").tolist())
        # a contiguous share: this rank's third of the chunks and at most one more at each end
        assert len(chunks) <= -(-len(starts) // WORLD) + 2
        assert r["requests"][0] <= len(chunks)  # each chunk read once at most, by its rank
        assert r["requests"][1] == 0  # the second epoch comes from the shared cache


def _indexed(root: str, options: dict[str, Any]) -> dict[str, Any]:
    from fastload import RemoteDataset, Tar

    dataset = RemoteDataset(Tar(f"{root}/train"), storage_options=options)
    return {
        "bytes": dataset.fetcher.counters.bytes,
        "names": [dataset.source.identities([i])[0][0] for i in range(len(dataset))],
        "blocks": dataset.blocks.tolist() if dataset.blocks is not None else None,
    }


def test_ranks_index_a_share_of_the_shards_each_and_agree(seaweed: Any) -> None:
    """Every rank indexed every shard: for shards of small members that is reading them whole,
    so a job on N hosts read the whole dataset N times before its first batch. Now each rank
    indexes a share and all get every index (no cache here: as on hosts that share none)."""
    options = seaweed.storage_options()
    root = f"s3://{BUCKET}/index-distributed-{uuid.uuid4().hex[:8]}"
    objects = tar_dataset(root, options)
    shard_bytes = sum(len(body) for key, body in objects.items() if key.endswith(".tar"))
    ranks = _on_ranks(_indexed, root, options)
    assert all(r["names"] == ranks[0]["names"] for r in ranks)  # the same samples, in order
    assert all(r["blocks"] == ranks[0]["blocks"] for r in ranks)
    assert len(set(ranks[0]["names"])) == SHARDS * PER_SHARD
    read = [r["bytes"] for r in ranks]
    assert sum(read) <= 1.1 * shard_bytes, (read, shard_bytes)  # the shards read once in all
    most = -(-SHARDS // WORLD) / SHARDS  # a rank's share: 2 of the 4 shards at most
    assert max(read) <= 1.1 * most * shard_bytes, (read, shard_bytes)


def _evaluate_on_rank_zero(root: str, options: dict[str, Any]) -> list[int]:
    import fastload
    from fastload import RemoteDataset
    from tests.test_shards import DECODE

    seen = []
    if dist.get_rank() == 0:  # the others never make it: nothing may wait on them
        with fastload.this_rank_only():
            dataset = RemoteDataset(
                fastload.Tar(f"{root}/train"), decode=DECODE, storage_options=options
            )
            loader = fastload.DataLoader(dataset, batch_size=BATCH, collate_fn=list)
        seen = [item["meta.json"]["n"] for batch in loader for item in batch]
    dist.barrier()
    return seen


def test_a_dataset_made_on_rank_zero_alone_reads_everything_without_waiting(
    seaweed: Any,
) -> None:
    """An evaluation on rank 0 only: without this_rank_only, its dataset waits for the other
    ranks to share a listing, and its loader would give rank 0 only its share."""
    options = seaweed.storage_options()
    root = f"s3://{BUCKET}/rank-zero-{uuid.uuid4().hex[:8]}"
    tar_dataset(root, options)
    seen = _on_ranks(_evaluate_on_rank_zero, root, options)
    assert sorted(seen[0]) == list(range(SHARDS * PER_SHARD)) and seen[1:] == [[], []]


def _objects_beside_nccl() -> dict[str, Any]:
    import fastload.ranks as ranks

    ranks.dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment,misc]
    parts = ranks.on_every_rank(lambda rank, world: (rank, world))
    listed = ranks.on_rank_zero(lambda: f"listed on rank {dist.get_rank()}")
    group = ranks._gloo[1]
    again = ranks.on_every_rank(lambda rank, world: rank * 10)
    return {
        "parts": parts,
        "listed": listed,
        "again": again,
        "side group": group is not None and group is not dist.group.WORLD,
        "made once": ranks._gloo[1] is group,
    }


def test_under_nccl_objects_go_through_a_gloo_group_of_the_same_ranks() -> None:
    """A unit detail, with real processes: under an NCCL default group, fastload's object
    collectives (listing on rank 0, indexing split across ranks) would carry the pickled
    objects on ``torch.cuda.current_device()`` (the same GPU on every rank unless the program
    set one per rank first). They go through a gloo group of the same ranks, made once. The
    backend's name is the only thing faked: this machine has no GPU (the collectives are gloo's)."""
    ranks = _on_ranks(_objects_beside_nccl)
    for result in ranks:
        assert result["parts"] == [(rank, WORLD) for rank in range(WORLD)]
        assert result["listed"] == "listed on rank 0"
        assert result["again"] == [rank * 10 for rank in range(WORLD)]
        assert result["side group"] and result["made once"]
