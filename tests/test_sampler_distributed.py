"""PermutationSampler under a real torch.distributed job (gloo, CPU processes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastload import PermutationSampler
from fastload.testing import free_port

N = 1001


def _worker(rank: int, world: int, port: int, out: dict[int, list[int]]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sampler = PermutationSampler(N, seed=3)  # rank and world size from torch.distributed
        assert (sampler.rank, sampler.world_size) == (rank, world)
        sampler.set_epoch(2)
        mine = list(sampler)[: sampler.num_real_samples]
        gathered: list[list[int] | None] = [None] * world
        dist.all_gather_object(gathered, mine)
        # every rank has the same count (no hang in collective ops over the epoch)
        count = torch.tensor([len(sampler)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        assert int(count) == len(sampler)
        if rank == 0:
            out[0] = [i for shard in gathered if shard for i in shard]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_cover_the_epoch_exactly_once(world: int) -> None:
    manager = mp.get_context("spawn").Manager()
    try:
        out = manager.dict()
        mp.start_processes(
            _worker, args=(world, free_port(), out), nprocs=world, start_method="spawn"
        )
        union = out[0]
    finally:
        manager.shutdown()
    assert sorted(union) == list(range(N))
