"""DeviceLoader on the XLA device (PJRT_DEVICE=CPU), alone and under a 2-process launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

torch_xla = pytest.importorskip("torch_xla", reason="XLA tests run in .venv-xla (make test-xla)")

import torch  # noqa: E402

import fastload  # noqa: E402
from fastload import ConfigError, DeviceLoader, PermutationSampler  # noqa: E402
from fastload._lookahead import Lookahead  # noqa: E402

pytestmark = pytest.mark.xla


def test_a_training_loop_through_the_device_loader() -> None:
    torch.manual_seed(0)
    inputs = torch.randn(256, 8)
    targets = inputs @ torch.arange(1.0, 9.0).unsqueeze(1)
    data = torch.utils.data.TensorDataset(inputs, targets)
    loader = DeviceLoader(fastload.DataLoader(data, batch_size=32, shuffle=True), "xla")
    model = torch.nn.Linear(8, 1).to(loader.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for epoch in range(5):
        loader.loader.set_epoch(epoch)  # type: ignore[attr-defined]
        for x, y in loader:
            assert x.device.type == "xla" and x.shape == (32, 8)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
        losses.append(float(loss.detach().cpu()))
    assert losses[-1] < losses[0] / 4
    # one meter for the loop, though torch_xla's loader iterates fastload's in a thread
    assert loader.meter is loader.loader.meter  # type: ignore[attr-defined]
    total = loader.report("all")
    assert total.steps == 40 and total.samples == 40 * 32 and total.passes == 5
    last = loader.report()
    assert last.steps == 8 and last.window == "pass 5 (epoch 4)"
    assert last.bound in {"data", "compute"}


def test_a_failing_loader_raises_instead_of_ending_the_epoch() -> None:
    def batches() -> Iterator[torch.Tensor]:
        yield torch.ones(2)
        raise ValueError("object 7 is corrupt")

    got = []
    with pytest.raises(ValueError, match="object 7 is corrupt"):
        for batch in DeviceLoader(batches(), "xla"):
            got.append(batch)
    assert len(got) == 1  # torch_xla alone would have ended the epoch here, silently


@pytest.mark.parametrize("cached", [False, True])
def test_a_sampler_sharded_for_another_world_is_refused(cached: bool, tmp_path: Path) -> None:
    """Also behind the lookahead, which wraps the sampler of a caching dataset."""
    data: torch.utils.data.Dataset[int] = range(10)  # type: ignore[assignment]
    if cached:
        data = fastload.CachedDataset(data, fastload.Cache(tmp_path))
    loader = fastload.DataLoader(data, sampler=PermutationSampler(10, rank=1, world_size=2))
    assert isinstance(loader.sampler, Lookahead) is cached
    with pytest.raises(ConfigError, match="shard 1/2 but this is XLA ordinal 0 of 1"):
        DeviceLoader(loader, "xla")


def test_each_ordinal_receives_its_own_disjoint_shard(tmp_path: Path) -> None:
    script = Path(__file__).with_name("_launch_device.py")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, check=True, timeout=240)
    shards = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("ordinal-*.json"))]
    assert [s["ordinal"] for s in shards] == [0, 1]
    assert all(s["device"].startswith("xla") and s["steps"] == 13 for s in shards)
    first, second = (set(s["labels"]) for s in shards)
    assert len(first) == len(second) == 100
    assert first.isdisjoint(second) and first | second == set(range(200))
