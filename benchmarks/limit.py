"""Warm epochs against the local limit: random batches out of one ``np.memmap``.

N pre-decoded 3x160x160 uint8 samples (an image after decode and resize). The limit reads
shuffled batches of ``BATCH`` straight out of one memory-mapped array of all of them (fancy
indexing, then ``torch.from_numpy``): no per-sample files, no checks, no loader. fastload reads
the same samples as .npy files (``file://``; the source does not matter once warm) through
``RemoteDataset(decode="npy", cache=Cache(format="npy"))`` and ``fastload.DataLoader(shuffle=
True)`` at 0, 2 and 4 workers (persistent), after one epoch that fills the cache. Both run in
this process, ``repeats`` times, interleaved; medians, and each ratio to the limit is the
median of the ratios within a repeat (noise on this shared machine comes in spells, which a
repeat's readers share). CPU per sample is the user + system time of this process (to the
nanosecond) and of its workers (``fastload.testing.tree_cpu_seconds``: /proc's 10 ms ticks)
over the epoch.

The floor is what any reader that keeps samples as checked entries read one at a time must do,
and nothing else: per sample, a hash of its name looked up in a dict, one ``preadv`` of the
entry's head, blob and tail into a row of a reused batch array, and its CRC32C checked (the
entries written side by side in one file). fastload's warm path is that plus its bookkeeping.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from crc32c import crc32c

import fastload
from fastload import Cache, RemoteDataset
from fastload.testing import tree_cpu_seconds

SHAPE = (3, 160, 160)
BATCH = 256
WORKERS = (0, 2, 4)
_HEAD, _TAIL = 64, 8  # about the bytes around a cache entry's blob: name check; CRC32C


def _name(i: int) -> bytes:
    return f"file:///data/objects/shard-{i % 16:02d}/{i:06d}.npy|v{i}|npy|fingerprint".encode()


def _sample(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SHAPE, dtype=np.uint8)


def _write(folder: Path, n: int) -> Path:
    """The samples as .npy files under ``folder/objects/shard-*/``, and all in one array."""
    limit = np.lib.format.open_memmap(folder / "all.npy", "w+", np.uint8, (n, *SHAPE))
    for i in range(n):
        sample = _sample(i)
        limit[i] = sample
        shard = folder / "objects" / f"shard-{i % 16:02d}"
        shard.mkdir(parents=True, exist_ok=True)
        np.save(shard / f"{i:06d}.npy", sample)
    limit.flush()
    return folder / "all.npy"


def _write_entries(path: Path, n: int) -> None:
    """The samples as checked entries side by side: head (the name's digest), blob, CRC32C."""
    with path.open("wb") as out:
        for i in range(n):
            head = hashlib.sha256(_name(i)).digest().ljust(_HEAD, b"\0")
            blob = _sample(i).tobytes()
            out.write(head + blob + crc32c(blob, crc32c(head)).to_bytes(_TAIL, "little"))


_SIZE = int(np.prod(SHAPE))
_ENTRY = _HEAD + _SIZE + _TAIL


def _offsets(n: int) -> dict[bytes, int]:
    """Where each sample's entry starts in the entries file, by its name's digest."""
    return {hashlib.sha256(_name(i)).digest(): i * _ENTRY for i in range(n)}


def _shuffled(batch: Callable[[list[int]], torch.Tensor], n: int) -> Callable[[], Iterable[Any]]:
    """An epoch of ``batch`` over a new shuffled order each time it is called."""
    rng = np.random.default_rng(0)

    def batches() -> Iterable[Any]:
        order = rng.permutation(n).tolist()
        return (batch(order[s : s + BATCH]) for s in range(0, n, BATCH))

    return batches


def _floor_epoch(path: Path, n: int) -> Callable[[], Iterable[Any]]:
    index = _offsets(n)
    fd = os.open(path, os.O_RDONLY)
    rows = np.empty((BATCH, _SIZE), np.uint8)
    heads, tails = memoryview(bytearray(BATCH * _HEAD)), memoryview(bytearray(BATCH * _TAIL))
    flat = rows.reshape(-1).data

    def batch(indices: list[int]) -> torch.Tensor:
        for r, i in enumerate(indices):
            key = hashlib.sha256(_name(i)).digest()
            head, tail = heads[r * _HEAD : (r + 1) * _HEAD], tails[r * _TAIL : (r + 1) * _TAIL]
            row = flat[r * _SIZE : (r + 1) * _SIZE]
            if os.preadv(fd, [head, row, tail], index[key]) != _ENTRY or head[:32] != key:
                raise AssertionError(f"floor: entry {i} is not its sample's")
            if crc32c(row, crc32c(head)) != int.from_bytes(tail, "little"):
                raise AssertionError(f"floor: entry {i} fails its checksum")
        return torch.from_numpy(rows[: len(indices)]).view(-1, *SHAPE)

    return _shuffled(batch, n)


def _mapped_epoch(path: Path, n: int, checked: bool) -> Callable[[], Iterable[Any]]:
    """The floor's entries copied out of a map of their file kept for the process (no
    ``preadv``), their CRC32C checked straight from the map or not at all: what a reader of
    mapped entries would reach with nothing else to do. Not fastload's guarantees: a map kept
    open adds the entries read to the process's PSS, a file cut short under it kills the
    process (SIGBUS), and unchecked bytes go unseen when they rot."""
    index = _offsets(n)
    with path.open("rb") as file:
        mapped = memoryview(mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ))
    rows = np.empty((BATCH, _SIZE), np.uint8)
    flat = rows.reshape(-1).data

    def batch(indices: list[int]) -> torch.Tensor:
        for r, i in enumerate(indices):
            key = hashlib.sha256(_name(i)).digest()
            at = index[key]
            entry = mapped[at : at + _ENTRY]
            if entry[:32] != key:
                raise AssertionError(f"mapped: entry {i} is not its sample's")
            crc = int.from_bytes(entry[_ENTRY - _TAIL :], "little")
            if checked and crc32c(entry[: _ENTRY - _TAIL]) != crc:
                raise AssertionError(f"mapped: entry {i} fails its checksum")
            flat[r * _SIZE : (r + 1) * _SIZE] = entry[_HEAD : _HEAD + _SIZE]
        return torch.from_numpy(rows[: len(indices)]).view(-1, *SHAPE)

    return _shuffled(batch, n)


def _memmap_epoch(path: Path, n: int) -> Callable[[], Iterable[Any]]:
    array = np.load(path, mmap_mode="r")
    rng = np.random.default_rng(0)

    def batches() -> Iterable[Any]:
        order = rng.permutation(n)
        return (torch.from_numpy(array[order[s : s + BATCH]]) for s in range(0, n, BATCH))

    return batches


def _cpu_seconds() -> float:
    """CPU seconds of this process (to the nanosecond; /proc counts 10 ms ticks, 0.5 µs a
    sample over 20,000) and of its live descendants (the workers)."""
    own = os.times()
    workers = tree_cpu_seconds(os.getpid()) - own.user - own.system  # both in ticks
    return time.process_time() + workers


def _measure(batches: Callable[[], Iterable[Any]], n: int) -> tuple[float, float]:
    """Samples/s and CPU µs per sample of one pass over ``batches()``."""
    cpu, started = _cpu_seconds(), time.perf_counter()
    count = sum(len(batch) for batch in batches())
    elapsed = time.perf_counter() - started
    if count != n:
        raise AssertionError(f"an epoch gave {count} of {n} samples")
    return n / elapsed, (_cpu_seconds() - cpu) / n * 1e6


def limit_rows(n: int, repeats: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        progress(f"limit: writing {n} samples")
        readers: dict[str, Callable[[], Iterable[Any]]] = {
            "limit: np.memmap of all samples, shuffled batches": _memmap_epoch(_write(folder, n), n)
        }
        _write_entries(folder / "entries", n)
        readers["floor: one preadv and CRC32C per entry, nothing else"] = _floor_epoch(
            folder / "entries", n
        )
        for checked, name in ((True, "CRC32C from the map"), (False, "no checks")):
            readers[f"mapped entries: copied out of a kept map, {name}"] = _mapped_epoch(
                folder / "entries", n, checked
            )
        dataset = RemoteDataset(
            f"file://{folder}/objects", decode="npy", cache=Cache(folder / "cache", format="npy")
        )
        for workers in WORKERS:
            loader = fastload.DataLoader(
                dataset,
                batch_size=BATCH,
                shuffle=True,
                num_workers=workers,
                persistent_workers=workers > 0,
            )
            progress(f"limit: fastload, {workers} workers, first epoch")
            _measure(lambda loader=loader: loader, n)  # fills the cache, starts the workers
            readers[f"fastload warm epoch, npy cache, {workers} workers"] = lambda loader=loader: (
                loader
            )
        measured: dict[str, list[tuple[float, float]]] = {name: [] for name in readers}
        for repeat in range(repeats):  # interleaved, so noise hits every reader alike
            for name, batches in readers.items():
                progress(f"limit: {name} ({repeat + 1}/{repeats})")
                measured[name].append(_measure(batches, n))
    limit = next(iter(measured.values()))
    return [
        {
            "reader": name,
            "samples/s (median)": statistics.median(rate for rate, _ in runs),
            "CPU us/sample": statistics.median(cpu for _, cpu in runs),
            "vs limit": _paired(runs, limit, 0),
            "CPU vs limit": _paired(runs, limit, 1),
        }
        for name, runs in measured.items()
    ]


def _paired(runs: list[tuple[float, float]], limit: list[tuple[float, float]], at: int) -> float:
    """The median over repeats of ``runs``' figure ``at`` over the limit's in the same repeat."""
    return statistics.median(run[at] / base[at] for run, base in zip(runs, limit, strict=True))


def run_limit(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return limit_rows(512, 1, progress) if quick else limit_rows(20_000, 5, progress)
