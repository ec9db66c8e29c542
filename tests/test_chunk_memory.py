"""Chunks of shards in memory once: DataLoader workers map one copy of each chunk (a file in
the reader's scratch folder in /dev/shm; a parquet row group decoded) instead of each holding
its own, let it go once its samples are served and cached, and leave nothing behind, a killed
worker included."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import uuid
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import fastload
from fastload import Cache, Parquet, RemoteDataset, Tar
from fastload.sources._scratch import Scratch
from fastload.testing import S3Server
from tests.conftest import BUCKET, write

SAMPLE = 256 << 10
PER_SHARD = 64
SHARDS = 4
CHUNK = SAMPLE * PER_SHARD  # a shard of 16 MiB is one chunk
REPO = Path(__file__).resolve().parents[1]


def body(n: int) -> bytes:
    return np.random.default_rng(n).bytes(SAMPLE)


def shard(s: int, per_shard: int = PER_SHARD) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for n in range(s * per_shard, (s + 1) * per_shard):
            info = tarfile.TarInfo(f"{n:05d}.bin")
            info.size = SAMPLE
            tar.addfile(info, io.BytesIO(body(n)))
    return out.getvalue()


def crc_of(sample: dict[str, bytes]) -> int:
    """A module-level decode (it pickles for forkserver workers): the member's CRC, no copy."""
    return zlib.crc32(sample["bin"])


def crc_of_row(row: dict[str, Any]) -> int:
    """``crc_of`` for a parquet row of a ``bin`` column."""
    return zlib.crc32(row["bin"])


def crc_or_die(sample: dict[str, bytes]) -> int:
    """``crc_of``, but the process that decodes sample 5 dies there, as by the OOM killer."""
    crc = crc_of(sample)
    if crc == zlib.crc32(body(5)):
        os.kill(os.getpid(), signal.SIGKILL)
    return crc


def record_worker(folder: str, _: int) -> None:
    """A worker_init_fn: the worker's pid, as a file name in ``folder``."""
    Path(folder, str(os.getpid())).touch()


def expected(shards: int, per_shard: int = PER_SHARD) -> list[int]:
    return sorted(zlib.crc32(body(n)) for n in range(shards * per_shard))


def anonymous_bytes(pid: int) -> int:
    """The private memory of process ``pid`` that no file backs (its copies), from smaps."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no Anonymous line in /proc/{pid}/smaps_rollup")


def mapped_bytes(pid: int, folder: Path) -> int:
    """The resident bytes of the mappings of files in ``folder`` in process ``pid``."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            inside = len(fields) >= 6 and fields[5].startswith(f"{folder}/")
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def stored_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def tar_root(server: S3Server, shards: int, per_shard: int = PER_SHARD) -> tuple[str, Any]:
    root = f"s3://{BUCKET}/chunk-memory-{uuid.uuid4().hex[:8]}"
    options = server.storage_options()
    write(root, options, {f"shard-{s:03d}.tar": shard(s, per_shard) for s in range(shards)})
    return root, options


def two_workers_epoch(
    dataset: RemoteDataset, tmp_path: Path
) -> tuple[dict[int, int], dict[int, int], Path]:
    """A shuffled epoch of ``dataset`` read by 2 workers (every sample once): each worker's
    growth of private memory from when both had begun, the bytes each maps from the scratch
    folder at the end (the workers live on, persistent, with the chunks they keep), and that
    folder."""
    folder: Path = dataset.source.reader.shared.root  # type: ignore[attr-defined]
    pids = tmp_path / "workers"
    pids.mkdir()
    loader = fastload.DataLoader(
        dataset,
        batch_size=8,
        shuffle=True,
        num_workers=2,
        worker_init_fn=partial(record_worker, str(pids)),
        collate_fn=list,
    )
    batches = iter(loader)
    seen = [*next(batches), *next(batches)]  # one batch from each worker: both have begun
    workers = sorted(int(path.name) for path in pids.iterdir())
    before = {pid: anonymous_bytes(pid) for pid in workers}
    seen += [crc for batch in batches for crc in batch]
    grown = {pid: anonymous_bytes(pid) - before[pid] for pid in workers}
    assert sorted(seen) == expected(SHARDS)
    assert len(workers) == 2
    return grown, {pid: mapped_bytes(pid, folder) for pid in workers}, folder


def test_workers_map_one_shared_copy_of_each_chunk(seaweed: S3Server, tmp_path: Path) -> None:
    """Two workers read every chunk between them (a chunk's batches go to each in turn): each
    maps the chunk's file in the scratch folder, and holds no private copy of it. Before, each
    worker kept its own copy of every chunk it read (457 MB each in issue 54's run)."""
    root, options = tar_root(seaweed, SHARDS)
    dataset = RemoteDataset(Tar(root), decode=crc_of, storage_options=options)
    grown, mapped, folder = two_workers_epoch(dataset, tmp_path)
    for pid in grown:
        assert grown[pid] < CHUNK // 2, (
            f"worker {pid} holds {grown[pid] >> 20} MiB more private memory after reading the "
            f"other chunks ({CHUNK >> 20} MiB each): a private copy"
        )
    assert sum(mapped.values()) >= CHUNK, f"chunk bytes mapped from {folder}: {mapped}"


def parquet_root(server: S3Server, files: int) -> tuple[str, Any]:
    """``files`` parquet files of one row group each: ``PER_SHARD`` rows of a ``bin`` column
    of ``SAMPLE`` bytes (a chunk of ``CHUNK`` bytes, decoded as undecoded) and their number."""
    root = f"s3://{BUCKET}/chunk-memory-{uuid.uuid4().hex[:8]}"
    objects = {}
    for s in range(files):
        numbers = range(s * PER_SHARD, (s + 1) * PER_SHARD)
        table = pa.table({"n": list(numbers), "bin": [body(n) for n in numbers]})
        out = io.BytesIO()
        pq.write_table(table, out, compression="none")
        objects[f"part-{s}.parquet"] = out.getvalue()
    options = server.storage_options()
    write(root, options, objects)
    return root, options


def test_parquet_workers_map_one_decoded_copy_of_each_row_group(
    seaweed: S3Server, tmp_path: Path
) -> None:
    """As for tar, but what parquet workers would hold is the row group decoded: the first
    worker that wants one decodes it into the scratch folder, and each maps that. Before, each
    worker decoded every row group it served into numpy columns of its own, and kept them: 1.54x
    the objects reader's memory at 2 workers, 2.01x at 4 (issue 54)."""
    root, options = parquet_root(seaweed, SHARDS)
    dataset = RemoteDataset(Parquet(root), decode=crc_of_row, storage_options=options)
    grown, mapped, folder = two_workers_epoch(dataset, tmp_path)
    for pid in grown:  # a copy of each would be 3 row groups more: 48 MiB (the decoding
        # worker's allocators keep some of what decoding freed: about a row group, 16.25 MiB
        # in one CI run of a loaded VM; at most one and a half here)
        assert grown[pid] < CHUNK * 3 // 2, (
            f"worker {pid} holds {grown[pid] >> 20} MiB more private memory after reading the "
            f"other row groups ({CHUNK >> 20} MiB each decoded): a private copy"
        )
    assert sum(mapped.values()) >= CHUNK, f"row groups mapped from {folder}: {mapped}"


BIG = 2**53 + 1


def every_kind() -> pa.Table:
    """A column of each kind of value a row holds (see docs/shapes.md), nulls among them."""
    floats = pa.list_(pa.float32())
    return pa.table(
        {
            "event_id": pa.array([1, 1, 2, 2, 2, 3, 4, 4, 5, 6], pa.int64()),
            "hit_id": pa.array([BIG, None, BIG + 2, 3, None, 5, 6, 7, 8, 9], pa.int64()),
            "small": pa.array([1, 2, None, 4, 5, 6, 7, 8, 9, 10], pa.int8()),
            "energy": pa.array([1.5, None, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5, 9.5], pa.float32()),
            "ok": pa.array([True, None, False, True, True, False, True, None, False, True]),
            "name": pa.array(["a", "b", None, "dé", "", "f", "g", "h", None, "j"]),
            "detector": pa.array(
                ["ecal", "hcal", None, "ecal"] * 2 + ["x", "y"]
            ).dictionary_encode(),
            "blob": pa.array([b"\0\1", None, b"", b"x" * 300] * 2 + [b"y", b"z"]),
            "pulses": pa.array(
                [
                    [1.0, 2.0],
                    None,
                    [],
                    [3.0],
                    [float("nan")],
                    [4.0, None],
                    [5.0],
                    [6.0, 7.0],
                    [8.0],
                    [9.0],
                ],
                floats,
            ),
            "channels": pa.array(
                [[BIG, None], [7], [], None, [8, 9], [BIG], [1], [2, 3], [4], [5]],
                pa.list_(pa.int64()),
            ),
            "flags": pa.array(
                [[True, None], [False], [], None, [True], [False], [True], [], [True], [False]]
            ),
            "pair": pa.array([[1.0, 2.0]] * 9 + [None], pa.list_(pa.float64(), 2)),
            "nested": pa.array([[[1, 2], [3]], [[4]], None, [], [[5, 6]]] * 2),
            "origin": pa.array([{"run": BIG}, {"run": None}, None, {"run": 4}, {"run": 5}] * 2),
            "tags": pa.array(
                [[("a", 1)], [], None, [("b", 2), ("c", None)], [("d", 4)]] * 2,
                pa.map_(pa.string(), pa.int64()),
            ),
            "when": pa.array([0, None, 2, 3, 4, 5, 6, 7, 8, 9], pa.timestamp("us", tz="UTC")),
            "day": pa.array([0, 1, None, 3, 4, 5, 6, 7, 8, 9], pa.date32()),
            "nothing": pa.nulls(10),
        }
    )


def same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are one value, of one type (arrays of one dtype), NaN as NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.generic):  # a numpy scalar: as an array of one (NaT as NaT)
        a, b = np.asarray(a)[None], np.asarray(b)[None]
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype == object:
            return all(same(x, y) for x, y in zip(a.tolist(), b.tolist(), strict=True))
        if a.dtype.kind in "mM":
            a, b = a.view(np.int64), b.view(np.int64)
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float | np.floating) and a != a:
        return bool(b != b)
    return bool(a == b)


@pytest.mark.parametrize(
    "options",
    [{}, {"row_key": "event_id", "columns": ["event_id", "hit_id", "pulses", "name", "ok"]}],
    ids=["rows", "runs-of-some-columns"],
)
def test_parquet_samples_from_the_shared_row_groups_are_those_read_in_place(
    seaweed: S3Server, options: dict[str, Any]
) -> None:
    """Workers take samples from the row groups decoded in the scratch folder: each sample is
    the one this process reads from the file (0 workers, and pyarrow's own values), value for
    value and type for type: nulls, exact integers among nulls, strings, bytes, list columns
    (with nulls in and of them), structs, maps, times, ``columns=`` and ``row_key``."""
    root = f"s3://{BUCKET}/chunk-memory-{uuid.uuid4().hex[:8]}"
    table = every_kind()
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=5)  # two row groups: two chunks
    storage = seaweed.storage_options()
    write(root, storage, {"part-0.parquet": out.getvalue()})
    dataset = RemoteDataset(Parquet(root, **options), storage_options=storage)
    here = [dataset[i] for i in range(len(dataset))]
    loader = fastload.DataLoader(
        dataset, batch_size=3, shuffle=False, num_workers=2, collate_fn=list
    )
    there = [sample for batch in loader for sample in batch]
    assert len(there) == len(here) == (6 if "row_key" in options else 10)
    for i, (mine, theirs) in enumerate(zip(here, there, strict=True)):
        assert list(mine) == list(theirs)
        for column in mine:
            assert same(mine[column], theirs[column]), (i, column, mine[column], theirs[column])
    if "row_key" not in options:  # and both as pyarrow reads the file, value for value
        direct = table.to_pylist()
        for name in ("hit_id", "name", "blob", "origin", "tags", "nothing"):
            assert [row[name] for row in there] == [row[name] for row in direct], name
        assert [None if r["pulses"] is None else r["pulses"].tolist() for r in there[:4]] == [
            [1.0, 2.0],
            None,
            [],
            [3.0],
        ]


def test_chunks_whose_samples_are_cached_leave_memory(seaweed: S3Server, tmp_path: Path) -> None:
    """With a cache, a chunk whose samples have all been served is needed no more this epoch,
    and the next reads the samples from the cache: its file goes, and with it its memory."""
    root, options = tar_root(seaweed, SHARDS, per_shard=16)
    cache = Cache(tmp_path / "cache", format="npy")
    dataset = RemoteDataset(Tar(root), decode=crc_of, cache=cache, storage_options=options)
    folder: Path = dataset.source.reader.shared.root  # type: ignore[attr-defined]
    loader = fastload.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2)
    first = sorted(int(crc) for batch in loader for crc in batch)
    assert first == expected(SHARDS, per_shard=16)
    assert stored_bytes(folder) == 0  # every chunk let go
    assert sorted(int(crc) for batch in loader for crc in batch) == first


def test_a_killed_worker_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    """A worker killed (SIGKILL: no clean-up of its own) in the middle of an epoch, with the
    chunks mapped (as a decoder that crashes, or the OOM killer, would): the loop says so, and
    when the process ends its scratch folder and every chunk in it are gone."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(SHARDS):
        (shards / f"shard-{s}.tar").write_bytes(shard(s, per_shard=8))
    script = (
        "import fastload\n"
        "from tests.test_chunk_memory import crc_or_die\n"
        "if __name__ == '__main__':\n"
        f"    shards = fastload.Tar('file://{shards}')\n"
        "    dataset = fastload.RemoteDataset(shards, decode=crc_or_die)\n"
        "    print(dataset.source.reader.shared.folder, flush=True)\n"
        "    loader = fastload.DataLoader(  # its workers end with the failed pass\n"
        "        dataset, batch_size=2, shuffle=True, num_workers=2, collate_fn=list,\n"
        "        persistent_workers=False,\n"
        "    )\n"
        "    try:\n"
        "        for _ in loader:\n"
        "            pass\n"
        "    except RuntimeError as exc:\n"
        "        print('the loop says:', exc, flush=True)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its workers and forkserver too: one group to stop
    )
    try:
        out, err = child.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # what outlived it (nothing, when it works)
    assert child.returncode == 0, err
    folder = Path(out.splitlines()[0])
    assert folder.name.startswith("fastload-chunks-")
    assert "exited unexpectedly" in out, out
    assert not folder.exists()


def test_scratch_keeps_chunks_within_its_budget_and_drops_them_once_served() -> None:
    """Past its budget the least recently used chunk goes (a mapping of it stays readable, and
    knows it is not current); a chunk whose samples have all been served goes at once."""
    scratch = Scratch(2000, np.array([3, 3, 3]), drop_served=True)
    reads: list[int] = []

    def get(index: int) -> tuple[memoryview, int]:
        def fetch(positions: list[int]) -> list[list[bytes]]:
            reads.append(index)
            return [[bytes([index]) * 600, bytes([index]) * 400]]  # a chunk of two ranges

        (found,) = scratch.get([index], fetch)
        assert not isinstance(found, BaseException)
        return found

    first, generation = get(0)
    get(1)
    assert get(0)[0] == first  # mapped from its file, not read again
    third, _ = get(2)
    assert reads == [0, 1, 2]
    assert sorted(os.listdir(scratch.root)) == ["0", "2"]  # 1: the least recently used
    assert bytes(first) == b"\x00" * 1000 and bytes(third) == b"\x02" * 1000
    assert scratch.current(0, generation)
    assert scratch.served({0: 2}) == [] and scratch.served({0: 1, 2: 1}) == [0]
    assert not scratch.current(0, generation) and bytes(first) == b"\x00" * 1000
    assert sorted(os.listdir(scratch.root)) == ["2"]


def test_scratch_goes_to_the_temporary_folder_with_a_warning_where_dev_shm_has_no_room(
    caplog: pytest.LogCaptureFixture,
) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    with caplog.at_level(logging.WARNING, logger="fastload.sources._scratch"):
        scratch = Scratch(1 << 62, np.array([1]), drop_served=False)
    assert scratch.folder.parent == Path(tempfile.gettempdir())
    assert "/dev/shm has no room for ChunkConfig.memory_bytes" in caplog.text
    assert "--shm-size" in caplog.text
