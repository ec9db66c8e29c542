"""Run pytest on a machine kept busy: ``python -m tests.under_load [--load N] [pytest args]``.

Starts enough busy-looping processes to hold the load average near ``--load`` (default 10) on
top of what runs already, runs pytest with the arguments given, samples the load average every
10 s, then stops the busy processes by PID. Prints the load it ran at (min / median / max of the
samples) and exits with pytest's exit code. What ``make test-load`` runs (see
docs/reliability.md, "The suite under load").
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading

_BUSY = "while True: pass"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--load", type=int, default=10, help="busy processes to add")
    args, pytest_args = parser.parse_known_args(argv)
    busy = [
        subprocess.Popen([sys.executable, "-c", _BUSY], start_new_session=True)
        for _ in range(args.load)
    ]
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(10):
            samples.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        code = subprocess.call([sys.executable, "-m", "pytest", *pytest_args])
    finally:
        done.set()
        for process in busy:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    if samples:
        print(
            f"under_load: {args.load} busy processes; 1-minute load average "
            f"min {min(samples):.1f}, median {statistics.median(samples):.1f}, "
            f"max {max(samples):.1f} over {len(samples)} samples"
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
