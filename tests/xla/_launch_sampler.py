"""Run by test_xla_sampler under torch_xla.launch: each ordinal writes its shard to a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch_xla
import torch_xla.runtime as xr

from fastload import PermutationSampler

N = 1001


def shard(index: int, out_dir: str) -> None:
    sampler = PermutationSampler(N, seed=7)  # rank and world size from torch_xla's runtime
    sampler.set_epoch(1)
    record = {
        "ordinal": xr.global_ordinal(),
        "world": xr.world_size(),
        "rank": sampler.rank,
        "world_size": sampler.world_size,
        "indices": list(sampler)[: sampler.num_real_samples],
        "length": len(sampler),
    }
    Path(out_dir, f"shard-{record['ordinal']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    torch_xla.launch(shard, args=(sys.argv[1],))
