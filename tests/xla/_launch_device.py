"""Run by test_xla_device under torch_xla.launch: each ordinal records what its loader delivered."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch_xla
import torch_xla.runtime as xr

import fastload

N = 200


def train(index: int, out_dir: str) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(N, 4), torch.arange(N))
    # the sampler's rank and world size come from torch_xla's runtime
    loader = fastload.DeviceLoader(fastload.DataLoader(data, batch_size=8, shuffle=True), "xla")
    labels: list[int] = []
    device = ""
    for x, y in loader:
        device = str(x.device)
        labels += y.cpu().tolist()
    record = {
        "ordinal": xr.global_ordinal(),
        "device": device,
        "labels": labels,
        "steps": loader.report().steps,
    }
    Path(out_dir, f"ordinal-{record['ordinal']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    torch_xla.launch(train, args=(sys.argv[1],))
