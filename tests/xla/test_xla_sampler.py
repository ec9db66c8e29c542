"""PermutationSampler under a real 2-process torch_xla.launch on the CPU (CPU_NUM_DEVICES=2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_xla", reason="XLA tests run in .venv-xla (make test-xla)")

pytestmark = pytest.mark.xla


def test_each_ordinal_gets_its_own_disjoint_shard(tmp_path: Path) -> None:
    script = Path(__file__).with_name("_launch_sampler.py")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, check=True, timeout=240)
    shards = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("shard-*.json"))]
    assert [s["ordinal"] for s in shards] == [0, 1]
    for s in shards:
        assert (s["rank"], s["world_size"]) == (s["ordinal"], s["world"]) == (s["ordinal"], 2)
    assert shards[0]["length"] == shards[1]["length"] == 501
    first, second = (set(s["indices"]) for s in shards)
    assert first.isdisjoint(second)
    assert first | second == set(range(1001))
