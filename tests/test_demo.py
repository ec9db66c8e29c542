"""`make demo`, a newcomer's first run, prints its table and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.py"


def test_the_demo_prints_its_table_and_no_traceback() -> None:
    """Small, but as the torch baseline's crash needed: its workers still fetching when the
    loop stops mid-epoch (3 steps of 8 batches), with big batches to hand over (128 images).
    Its spawned workers then aborted at exit in 3 of 3 such baselines."""
    args = ["--samples", "1024", "--steps", "3", "--batch-size", "128"]
    args += ["--latency-ms", "1", "--jitter-ms", "0"]
    done = subprocess.run(
        [sys.executable, str(DEMO), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for crash in ("Traceback", "terminate called", "killed by signal", "Exception ignored"):
        assert crash not in output, output
    table = done.stdout.split("-----\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [line.split("  ")[0] for line in table] == [
        "torch DataLoader + RandomSampler (2 workers)",
        "fastload cold (cache filling), 2 workers",
        "fastload warm, 2 workers",
    ], done.stdout
    assert done.stdout.count("fastload's own report:") == 2, done.stdout
