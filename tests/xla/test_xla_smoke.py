"""Runs in the XLA environment (torch 2.9.0 + torch_xla 2.9.0, PJRT_DEVICE=CPU): make test-xla."""

from __future__ import annotations

import pytest

torch_xla = pytest.importorskip("torch_xla", reason="XLA tests run in .venv-xla (make test-xla)")

import torch  # noqa: E402
import torch_xla.distributed.parallel_loader as pl  # noqa: E402

import fastload  # noqa: E402

pytestmark = pytest.mark.xla


def test_fastload_imports_beside_torch_xla() -> None:
    assert fastload.__version__
    assert torch.__version__.startswith("2.9")


def test_training_steps_run_on_the_xla_device() -> None:
    device = torch_xla.device()
    assert device.type == "xla"
    torch.manual_seed(0)
    inputs = torch.randn(256, 8)
    targets = inputs @ torch.arange(1.0, 9.0).unsqueeze(1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, targets), batch_size=32
    )
    model = torch.nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _epoch in range(5):
        for x, y in pl.MpDeviceLoader(loader, device):
            assert x.device.type == "xla"
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
            losses.append(loss.detach())
    first, last = losses[0].cpu().item(), losses[-1].cpu().item()
    assert last < first / 10
