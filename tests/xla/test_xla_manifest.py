"""Manifest.build under a real 4-ordinal torch_xla.launch on the CPU, with no torch.distributed
process group: rank 0 lists, the other ordinals receive its manifest (and its errors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastload.testing import free_port

pytest.importorskip("torch_xla", reason="XLA tests run in .venv-xla (make test-xla)")

pytestmark = pytest.mark.xla


def test_only_ordinal_zero_lists_and_every_ordinal_gets_the_same_manifest(tmp_path: Path) -> None:
    data = tmp_path / "data"
    for i in range(50):
        (data / f"day {i % 3}").mkdir(parents=True, exist_ok=True)
        (data / f"day {i % 3}" / f"{i:03d}.bin").write_bytes(b"x" * i)
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).with_name("_launch_manifest.py")
    port = str(free_port())  # rank 0 serves its result there
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "FASTLOAD_STORE_PORT": port}
    subprocess.run(
        [sys.executable, str(script), str(data), str(out)], env=env, check=True, timeout=300
    )
    records = [json.loads(p.read_text()) for p in sorted(out.glob("manifest-*.json"))]
    assert len(records) == 4
    assert sorted(p.name for p in out.glob("listed-*")) == ["listed-0"]  # twice, by ordinal 0
    assert all(r["fingerprint"] == records[0]["fingerprint"] for r in records)
    assert len(records[0]["keys"]) == 50
    assert {r["missing"] for r in records} == {"ObjectNotFoundError"}  # raised on every ordinal
