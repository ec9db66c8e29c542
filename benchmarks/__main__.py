"""Run the benchmark scenarios: ``python -m benchmarks [--quick] [--only NAME ...]``.

Each scenario writes ``benchmarks/results/<name>.json`` (machine, date, method, rows) and its
table is printed; ``docs/benchmarks.md`` records the tables that README claims are taken from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from benchmarks import (
    cache,
    concurrency,
    groups,
    limit,
    parquet,
    peers,
    plots,
    readme,
    sampler,
    stall,
    stores,
    tails,
    volumes,
)

SCENARIOS = {
    "sampler": sampler.run,
    "fetch": stores.run_fetch,
    "manifest": stores.run_manifest,
    "peers": peers.run_peers,
    "volumes": volumes.run_volumes,
    "epochs": cache.run_epochs,
    "crops": cache.run_crops,
    "warm": cache.run_warm,
    "small": cache.run_small,
    "limit": limit.run_limit,
    "stall": stall.run_stall,
    "groups": groups.run_groups,
    "dicom": groups.run_dicom,
    "parquet": parquet.run_parquet,
    "tails": tails.run_tails,
    "concurrency": concurrency.run_concurrency,
}
RESULTS = Path(__file__).with_name("results")


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(key, "")) for key in columns) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (< 3 min)")
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), default=sorted(SCENARIOS))
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    for name in args.only:
        rows = SCENARIOS[name](args.quick)
        record = {
            "scenario": name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "quick": args.quick,
            "machine": machine(),
            "rows": rows,
        }
        (args.results / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"\n## {name} ({'quick' if args.quick else 'full'}, {record['date']})\n")
        print(table(rows))
    for image in plots.render(args.results):
        print(f"plot: {image}")
    if "peers" in args.only and not args.quick and args.results == RESULTS:
        changed = readme.update()
        print("README.md: benchmark block " + ("updated" if changed else "unchanged"))


if __name__ == "__main__":
    main()
