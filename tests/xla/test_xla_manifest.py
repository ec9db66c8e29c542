"""Manifest.build under a real 4-ordinal torch_xla.launch on the CPU, with no torch.distributed
process group: rank 0 lists, the other ordinals receive its manifest (and its errors); tar
shards are indexed a share by each ordinal, and every ordinal gets every index."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
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
    tars = tmp_path / "tars"
    tars.mkdir()
    for shard in range(4):
        with tarfile.open(tars / f"shard-{shard}.tar", "w") as tar:
            for n in range(shard * 10, shard * 10 + 10):
                info = tarfile.TarInfo(f"s/{n:04d}.bin")
                info.size = 5000
                tar.addfile(info, io.BytesIO(bytes([n]) * 5000))
    shard_bytes = sum(p.stat().st_size for p in tars.iterdir())
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).with_name("_launch_manifest.py")
    port = str(free_port())  # rank 0 serves its result there
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "FASTLOAD_STORE_PORT": port}
    subprocess.run(
        [sys.executable, str(script), str(data), str(out), str(tars)],
        env=env,
        check=True,
        timeout=300,
    )
    records = [json.loads(p.read_text()) for p in sorted(out.glob("manifest-*.json"))]
    assert len(records) == 4
    assert sorted(p.name for p in out.glob("listed-*")) == ["listed-0"]  # twice, by ordinal 0
    assert all(r["fingerprint"] == records[0]["fingerprint"] for r in records)
    assert len(records[0]["keys"]) == 50
    assert {r["missing"] for r in records} == {"ObjectNotFoundError"}  # raised on every ordinal
    assert all(r["samples"] == records[0]["samples"] for r in records)  # the same, in order
    assert len(set(records[0]["samples"])) == 40
    read = [r["index_bytes"] for r in records]  # a shard each: read once in all
    assert sum(read) <= 1.1 * shard_bytes and max(read) <= 1.1 * shard_bytes / 4, read
