"""fastload.DataLoader over tar shards under a real torch.distributed job: gloo, one spawned CPU
process a rank, a real SeaweedFS server, one cache shared by the ranks as on one host."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from fastload.testing import free_port
from tests.conftest import BUCKET
from tests.test_shards import PER_SHARD, SHARDS, tar_dataset

WORLD = 3  # 100 samples do not split evenly: the last rank is padded, as torch's sampler pads
BATCH = 8


def _rank(
    rank: int, world: int, port: int, root: str, options: dict[str, Any], cache: str, out: Any
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out[rank] = _epochs(root, options, cache)
    finally:
        dist.destroy_process_group()


def _epochs(root: str, options: dict[str, Any], cache: str) -> dict[str, Any]:
    import fastload
    from fastload import Cache, ChunkConfig, RemoteDataset
    from tests.test_shards import DECODE, image

    dataset = RemoteDataset(
        f"{root}/train",
        shards="tar",
        decode=DECODE,
        chunks=ChunkConfig(chunk_bytes=150_000),  # a few chunks a shard
        cache=Cache(cache, format="npy"),
        storage_options=options,
    )
    loader = fastload.DataLoader(dataset, batch_size=BATCH, shuffle=True, seed=11, collate_fn=list)
    epochs, requests, wrong = [], [], 0
    for _ in range(2):
        before = dataset.fetcher.counters.requests
        seen = []
        for batch in loader:
            for item in batch:
                n = item["meta.json"]["n"]
                wrong += not np.array_equal(item["npy"], image(n)) or item["cls"] != n % 3
                seen.append(n)
        epochs.append(seen)
        requests.append(dataset.fetcher.counters.requests - before)
        dist.barrier()  # the ranks end an epoch together, as DDP's steps keep them
    assert dataset.blocks is not None
    return {
        "epochs": epochs,
        "requests": requests,
        "wrong": wrong,
        "blocks": dataset.blocks.tolist(),
        "per_rank": len(loader.sampler),  # type: ignore[arg-type]
    }


def test_ranks_read_every_sample_once_from_their_own_chunks(seaweed: Any, tmp_path: Path) -> None:
    options = seaweed.storage_options()
    root = f"s3://{BUCKET}/loader-distributed-{uuid.uuid4().hex[:8]}"
    tar_dataset(root, options)
    manager = mp.get_context("spawn").Manager()
    try:
        out = manager.dict()
        mp.start_processes(
            _rank,
            args=(WORLD, free_port(), root, options, str(tmp_path / "cache"), out),
            nprocs=WORLD,
            start_method="spawn",
        )
        ranks = [out[rank] for rank in range(WORLD)]
    finally:
        manager.shutdown()

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
