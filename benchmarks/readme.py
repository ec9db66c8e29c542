"""The README's benchmark table, rendered from the latest ``make bench`` results.

``python -m benchmarks.readme`` rewrites the block between ``<!-- bench:start -->`` and
``<!-- bench:end -->`` in README.md from ``benchmarks/results/peers.json``: each reader at its
best worker count, fastload at its defaults, ratios against the best peer, and a line for every
figure where fastload is behind. ``make bench`` runs it after the scenarios; a test checks that
the README says what the results say, so no figure there is typed by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
COLUMNS = (
    ("cold samples/s", "cold epoch", "{:,.0f}/s"),
    ("warm samples/s", "first warm epoch", "{:,.0f}/s"),
    ("later warm samples/s", "later warm epochs", "{:,.0f}/s"),
    ("first batch s", "first batch", "{:.1f} s"),
    ("peak PSS MiB", "peak PSS", "{:,.0f} MiB"),
)
CPU_COLUMNS = (
    ("cold CPU us/sample", "client CPU, construction + cold epoch", "{:,.0f} µs"),
    ("later warm CPU us/sample", "client CPU, later warm epochs", "{:,.0f} µs"),
)
"""Shown where the results have them (the peers scenario measures them since 2026-11-28)."""
HIGHER_IS_BETTER = {"cold samples/s", "warm samples/s", "later warm samples/s"}
FASTLOAD = "fastload"
SHORT = {
    "fastload RemoteDataset + npy cache, fastload.DataLoader defaults": "fastload from objects",
    "fastload RemoteDataset(Tar(url)) over the 20 tar shards, same defaults": (
        "fastload over tar shards"
    ),
}
RENAMED = {
    "fastload RemoteDataset(shards='tar') over the 20 tar shards, same defaults": (
        "fastload RemoteDataset(Tar(url)) over the 20 tar shards, same defaults"
    ),
}
"""Readers that results recorded before a rename name as they were: the README shows the
reader as a user writes it today (``shards="tar"`` became the ``Tar`` source object)."""


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _readers(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each reader's row at its best worker count (by its later warm rate, then cold), and
    fastload's rows at their defaults."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row.get("failed runs"):
            continue
        name = RENAMED.get(str(row["reader"]), str(row["reader"]))
        if name.startswith(FASTLOAD) and row.get("workers") != "defaults":
            continue
        score = (_number(row.get("later warm samples/s")) or 0, _number(row.get("cold samples/s")))
        kept = best.get(name)
        if kept is None or score > kept["_score"]:
            best[name] = {**row, "_score": score}
    return best


def _columns(rows: list[dict[str, Any]]) -> tuple[tuple[str, str, str], ...]:
    """The table's figures: ``COLUMNS``, and ``CPU_COLUMNS`` where the rows measured them."""
    measured = any(key in row for row in rows for key, _, _ in CPU_COLUMNS)
    return COLUMNS + CPU_COLUMNS if measured else COLUMNS


def _pinning(rows: list[dict[str, Any]]) -> str:
    """Where the store and the readers ran (the rows' ``cores`` note), for the heading."""
    notes = sorted({str(row["cores"]) for row in rows if "cores" in row})
    return "".join(f"; {note}" for note in notes)


def render(record: dict[str, Any]) -> str:
    readers = _readers(record["rows"])
    columns = _columns(record["rows"])
    lines = [
        f"{START}",
        f"`make bench`'s peers scenario, {record['date'][:10]} "
        f"(commit {record.get('commit', '?')}, a shared 2-vCPU VM, loopback SeaweedFS behind "
        "a proxy adding 20 ms per request, "
        "2,000 x 150 KB samples, batch 32; every peer at 0, 2 and 4 workers (those that make "
        "one request per sample at 2 and 4), shown at its best; fastload at its defaults; "
        f"medians of the repeats{_pinning(record['rows'])}). "
        "Method and every row: [docs/benchmarks.md](docs/benchmarks.md).",
        "",
        "| reader | workers | " + " | ".join(title for _, title, _ in columns) + " |",
        "| --- | --- |" + " --- |" * len(columns),
    ]
    for name, row in sorted(readers.items(), key=lambda item: item[0].startswith(FASTLOAD)):
        cells = [
            fmt.format(v) if (v := _number(row.get(key))) is not None else ""
            for key, _, fmt in columns
        ]
        label = f"**{name}**" if name.startswith(FASTLOAD) else name
        lines.append(f"| {label} | {row.get('workers')} | " + " | ".join(cells) + " |")
    every_peer = [r for r in record["rows"] if not str(r["reader"]).startswith(FASTLOAD)]
    lines += ["", *_claims(readers, every_peer, columns), END]
    return "\n".join(lines)


def _claims(
    readers: dict[str, dict[str, Any]],
    peers: list[dict[str, Any]],
    columns: tuple[tuple[str, str, str], ...],
) -> list[str]:
    """A line per fastload row: for each figure, its ratio to the best peer's at any worker
    count (above 1 is better for fastload: for CPU and memory, the peer's least over
    fastload's), the figures where it is behind first."""
    out = []
    for name, row in readers.items():
        if not name.startswith(FASTLOAD):
            continue
        ratios = []
        for key, title, _ in columns:
            ours = _number(row.get(key))
            theirs = [
                (v, f"{r['reader']}, {r['workers']} workers")
                for r in peers
                if not r.get("failed runs") and (v := _number(r.get(key))) is not None
            ]
            if not ours or not theirs:
                continue
            higher = key in HIGHER_IS_BETTER
            value, peer = max(theirs) if higher else min(theirs)
            ratios.append((ours / value if higher else value / ours, title, peer))
        behind = [f"{title} {r:.2f}x ({peer})" for r, title, peer in ratios if r < 1]
        ahead = [f"{title} {r:.2f}x" for r, title, _ in ratios if r >= 1]
        out.append(
            f"- **{SHORT.get(name, name)}** against the best peer: behind in "
            + ("; ".join(behind) or "nothing")
            + "; ahead in "
            + ("; ".join(ahead) or "nothing")
            + "."
        )
    return out


def update(readme: Path = README, results: Path = RESULTS) -> bool:
    """Rewrite the README's block; whether it changed."""
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} block")
    block = render(json.loads((results / "peers.json").read_text()))
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    new = head + block + tail
    readme.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = update()
    print("README.md: benchmark block " + ("updated" if changed else "unchanged"))
    sys.exit(0)
