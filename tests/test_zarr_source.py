"""fastload.Zarr beyond the conformance suite (tests/sources/test_conformance.py): values exact
against zarr's own read, patches, compressed and sharded arrays, the fill value of a chunk the
store lacks, each chunk read once per epoch, a restart that reads no metadata, groups (an
array named in its group or by its own URL: the same samples and cache names, warmed by the
command line through one and trained on through the other, on S3)."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import (
    BloscCodec,
    BytesCodec,
    Crc32cCodec,
    GzipCodec,
    TransposeCodec,
    ZstdCodec,
)

import fastload
from fastload import Cache, ChunkConfig, ConfigError, Manifest, RemoteDataset, ShardError, Zarr
from fastload.testing import S3Server
from tests.conftest import BUCKET, assert_identities, write


def make(path: Path, data: np.ndarray, **options: Any) -> zarr.Array:
    """``data`` written by zarr at ``path`` (a local store), with ``options`` for create_array."""
    array = zarr.create_array(str(path), shape=data.shape, dtype=data.dtype, **options)
    array[:] = data
    return array


def url(path: Path) -> str:
    return f"file://{path}"


def chunk_keys(path: Path) -> list[str]:
    """The chunk objects zarr wrote (v3 keys: ``c/...``)."""
    return sorted(str(p.relative_to(path)) for p in (path / "c").rglob("*") if p.is_file())


def samples(dataset: RemoteDataset) -> list[Any]:
    """Every sample, read as a DataLoader reads them (a batch of indices at once)."""
    return list(dataset.__getitems__(list(range(len(dataset)))))  # type: ignore[arg-type]


def assert_same(mine: Any, theirs: Any) -> None:
    """The same dtype, shape and values (NaN equal to NaN, -0.0 apart from 0.0)."""
    assert isinstance(mine, np.ndarray)
    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
    assert mine.tobytes() == np.ascontiguousarray(theirs).tobytes()


RNG = np.random.default_rng(52)
EDGES = {  # the awkward values of each type, and random ones
    "uint16": np.array([0, 1, 255, 256, 32767, 32768, 65534, 65535], dtype=np.uint16),
    "int16": np.array([-32768, -1, 0, 1, 32767, -256, 255, 12345], dtype=np.int16),
    ">u2": np.array([0, 1, 256, 65535, 4660, 17185, 2, 3], dtype=">u2"),  # big-endian (v2 keeps)
    "float32": np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, 3.4e38, 0.1], np.float32),
    "float64": np.array([0.0, -0.0, np.nan, np.inf, 5e-324, 1.7e308, -0.1, 1 / 3]),
}


def awkward(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random values of ``dtype`` with its edge values first."""
    kind = np.dtype(dtype)
    if kind.kind == "f":
        data = RNG.standard_normal(shape).astype(kind) * 1000
    else:
        info = np.iinfo(kind)
        data = RNG.integers(info.min, info.max, shape, endpoint=True).astype(kind)
    data.reshape(-1)[: len(EDGES[dtype])] = EDGES[dtype]
    return data


@pytest.mark.parametrize(
    ("dtype", "zarr_format"),
    [("uint16", 3), ("int16", 3), ("float32", 3), ("float64", 3), (">u2", 2), ("float32", 2)],
)
def test_16_bit_and_float_arrays_come_out_exact(
    tmp_path: Path, dtype: str, zarr_format: int
) -> None:
    """Each sample is ``array[i]`` exactly as zarr reads it: its dtype (byte order too), its
    shape, every bit of every value (NaN, -0.0, infinities, subnormals), edge chunks too."""
    path = tmp_path / "volume.zarr"
    make(path, awkward(dtype, (11, 5, 7)), chunks=(4, 3, 7), zarr_format=zarr_format)
    theirs = zarr.open_array(str(path), mode="r")
    dataset = RemoteDataset(Zarr(url(path)))
    assert len(dataset) == 11
    for i, sample in enumerate(samples(dataset)):
        assert_same(sample, theirs[i])
    assert_identities(dataset, [0, 5, 10])


def test_a_1d_array_gives_0d_samples(tmp_path: Path) -> None:
    path = tmp_path / "ids.zarr"
    make(path, np.arange(10, dtype=np.int64) * 3, chunks=(4,))
    sample = RemoteDataset(Zarr(url(path)))[7]
    assert isinstance(sample, np.ndarray) and sample.shape == () and int(sample) == 21


def test_patches_tile_the_array_and_leave_out_its_edge(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Patches of (3, 4) over a (10, 9, 2) array in chunks of (4, 4, 2): 3 x 2 patches, the
    last row and column in none (a warning says so); patches that cross a chunk boundary read
    both chunks; each patch is zarr's read of its region, named by it; a block's samples read
    the same chunks, and the next block others."""
    path = tmp_path / "slide.zarr"
    data = np.arange(10 * 9 * 2, dtype=np.uint16).reshape(10, 9, 2)
    make(path, data, chunks=(4, 4, 2))
    theirs = zarr.open_array(str(path), mode="r")
    with caplog.at_level(logging.WARNING, logger="fastload"):
        dataset = RemoteDataset(Zarr(url(path), patch=(3, 4)))
    assert "the last 1 along axis 0, the last 1 along axis 1 are in no sample" in caplog.text
    assert len(dataset) == 6
    regions = []
    for i, sample in enumerate(samples(dataset)):
        name = dataset.source[i].name  # "[3:6,4:8]"
        region = tuple(slice(*map(int, bounds.split(":"))) for bounds in name[1:-1].split(","))
        assert_same(sample, theirs[region])
        regions.append((region[0].start, region[1].start))
    assert sorted(regions) == [(r, c) for r in (0, 3, 6) for c in (0, 4)]
    assert dataset.blocks is not None
    reads = [{p.key for p in dataset.source[i].parts} for i in range(len(dataset))]
    starts = dataset.blocks.tolist()
    for a, b in zip(starts, [*starts[1:], len(dataset)], strict=True):
        assert all(reads[i] == reads[a] for i in range(a, b))
        assert b == len(dataset) or reads[b] != reads[a]
    by_name = {dataset.source[i].name: reads[i] for i in range(len(dataset))}
    assert by_name["[0:3,0:4]"] == {"c/0/0/0"}
    assert by_name["[3:6,4:8]"] == {"c/0/1/0", "c/1/1/0"}  # rows 3-5 cross row 4


def test_a_patch_must_fit_the_array(tmp_path: Path) -> None:
    path = tmp_path / "small.zarr"
    make(path, np.zeros((4, 4), np.uint8), chunks=(2, 2))
    with pytest.raises(ConfigError, match=r"axis 1 is shorter than the patch"):
        RemoteDataset(Zarr(url(path), patch=(2, 5)))
    with pytest.raises(ConfigError, match=r"patch \(1, 1, 1\) has 3 sizes, .* has 2 axes"):
        RemoteDataset(Zarr(url(path), patch=(1, 1, 1)))
    with pytest.raises(ConfigError, match=r"patch sizes must be >= 1"):
        Zarr(url(path), patch=(0, 2))


@pytest.mark.parametrize(
    ("codec", "options"),
    [
        ("zstd (zarr's default)", {}),
        ("blosc", {"compressors": [BloscCodec(cname="lz4", clevel=5)]}),
        ("gzip", {"compressors": [GzipCodec(level=6)]}),
        ("v2 blosc", {"zarr_format": 2, "compressors": numcodecs.Blosc("zstd", 3)}),
        ("sharded", {"shards": (8, 8, 16)}),
    ],
)
def test_a_compressed_array_reads_as_zarr_reads_it(
    tmp_path: Path, codec: str, options: dict[str, Any]
) -> None:
    """Chunks compressed by each codec (their objects far smaller than the data), and chunks
    inside shard objects (the sharding codec: a shard object is read and decoded whole)."""
    path = tmp_path / "stack.zarr"
    data = (np.arange(16 * 8 * 16).reshape(16, 8, 16) // 7).astype(np.int32)
    make(path, data, chunks=(4, 8, 16), **options)
    metadata = ("zarr.json", ".zarray", ".zattrs")
    stored = sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name not in metadata
    )
    assert stored < data.nbytes / 4, (codec, stored)  # compressed indeed
    theirs = zarr.open_array(str(path), mode="r")
    dataset = RemoteDataset(Zarr(url(path)))
    for i, sample in enumerate(samples(dataset)):
        assert_same(sample, theirs[i])


def test_a_missing_chunk_reads_as_the_fill_value(tmp_path: Path) -> None:
    """zarr writes no chunk that holds only the fill value, and reads a chunk it lacks as the
    fill value: so does fastload, with no request for it; a sample that reads a stored chunk
    and a missing one holds both."""
    path = tmp_path / "sparse.zarr"
    data = np.full((8, 6), -7, np.int16)
    data[0:4, 0:3] = 1
    data[4:8, 3:6] = 2
    make(path, data, chunks=(4, 3), fill_value=-7)
    assert chunk_keys(path) == ["c/0/0", "c/1/1"]  # the two others are the fill value
    (path / "c/1/1").unlink()  # and one the store lost: zarr reads it as fill too
    theirs = zarr.open_array(str(path), mode="r")
    assert (theirs[4:8, 3:6] == -7).all()
    dataset = RemoteDataset(Zarr(url(path)))
    opened = dataset.counters.drain().fetch.requests
    assert opened == 1  # the metadata
    for i, sample in enumerate(samples(dataset)):
        assert_same(sample, theirs[i])
    assert dataset.counters.drain().fetch.requests == 1  # c/0/0, once; no request for the others
    assert [p.key for p in dataset.source[5].parts] == []


@pytest.mark.parametrize(
    ("workers", "kept"),
    [(0, 4), (0, 16), (2, 16)],
    ids=["0-workers-memory-for-4-of-16-chunks", "0-workers", "2-workers"],
)
def test_each_chunk_is_read_once_per_epoch_with_chunk_aware_shuffling(
    tmp_path: Path, workers: int, kept: int
) -> None:
    """16 chunk objects of 4 samples each, through a shuffled DataLoader (chunk-aware): the
    first epoch reads every chunk once (objects fetched, and bytes), every sample zarr's; the
    second reads them once again where memory holds 4 decoded chunks, and none where it holds
    all (the workers' chunks are in the scratch cache they share)."""
    path = tmp_path / "frames.zarr"
    data = np.stack([np.full((16, 16), n, np.float32) + RNG.random((16, 16)) for n in range(64)])
    make(path, data.astype(np.float32), chunks=(4, 16, 16))
    keys = chunk_keys(path)
    assert len(keys) == 16
    chunk_bytes = sum((path / key).stat().st_size for key in keys)
    theirs = zarr.open_array(str(path), mode="r")[:]
    memory = ChunkConfig(memory_bytes=kept * theirs[:4].nbytes)
    dataset = RemoteDataset(Zarr(url(path), chunks=memory))
    loader = fastload.DataLoader(
        dataset, batch_size=4, shuffle=True, num_workers=workers, persistent_workers=False
    )
    read = []
    for _ in range(2):
        before = reads(loader)
        seen = []
        for batch in loader:
            for sample in batch.numpy():
                n = int(sample[0, 0])
                np.testing.assert_array_equal(sample, theirs[n])
                seen.append(n)
        assert sorted(seen) == list(range(64))
        read.append(tuple(now - then for now, then in zip(reads(loader), before, strict=True)))
    again = (16, chunk_bytes) if kept < 16 else (0, 0)
    assert read == [(16, chunk_bytes), again]


def reads(loader: fastload.DataLoader) -> tuple[int, int]:
    """The objects (byte ranges) and bytes the loader's processes have fetched so far: the
    requests, but for the second requests that adaptive hedging may send for a slow one."""
    counters = loader.counters
    assert counters is not None
    return counters.fetch.objects, counters.fetch.bytes


def test_a_restart_reads_no_metadata_object(tmp_path: Path) -> None:
    """The metadata travels in the saved listing: a dataset made from it sends no request."""
    path = tmp_path / "scan.zarr"
    make(path, np.arange(24, dtype=np.uint16).reshape(6, 4), chunks=(2, 4))
    listing = tmp_path / "listing.npz"
    first = RemoteDataset(Zarr(url(path), manifest_path=listing))
    assert first.counters.drain().fetch.requests == 1
    again = RemoteDataset(Zarr(Manifest.load(listing)))
    assert again.counters.drain().fetch.requests == 0
    assert_same(again[5], np.arange(20, 24, dtype=np.uint16))


def test_a_group_names_its_arrays(tmp_path: Path) -> None:
    """``array=`` picks an array of a group; a group alone is a ConfigError naming them."""
    path = tmp_path / "study.zarr"
    group = zarr.open_group(str(path), mode="w")
    group.create_array("raw", shape=(4, 3), dtype="float32", chunks=(2, 3))[:] = 1.5
    group.create_array("mask", shape=(4, 3), dtype="bool", chunks=(4, 3))[:] = [[1, 0, 1]] * 4
    mask = RemoteDataset(Zarr(url(path), array="mask"))
    assert_same(mask[2], np.array([True, False, True]))
    assert mask.source[2].url == f"{url(path)}/mask#[2]"
    with pytest.raises(ConfigError, match=r"is a Zarr group: .* \['mask', 'raw'\]"):
        RemoteDataset(Zarr(url(path)))
    with pytest.raises(ConfigError, match=r"no Zarr array at .*/nothing"):
        RemoteDataset(Zarr(url(path), array="nothing"))


@pytest.fixture
def oct_group(seaweed: S3Server, tmp_path: Path) -> tuple[str, dict[str, Any], np.ndarray]:
    """A Zarr group on S3 (SeaweedFS) holding two arrays: ``scans`` (12 x 4 x 6 uint16 in
    chunks of 4 x 4 x 3) and ``mask``; its URL, the storage options and the scans."""
    path = tmp_path / "oct.zarr"
    group = zarr.open_group(str(path), mode="w")
    scans = awkward("uint16", (12, 4, 6))
    group.create_array("scans", shape=scans.shape, dtype=scans.dtype, chunks=(4, 4, 3))[:] = scans
    group.create_array("mask", shape=(12,), dtype="bool", chunks=(6,))[:] = True
    root, options = f"s3://{BUCKET}/zarr-{uuid.uuid4().hex[:8]}/oct.zarr", seaweed.storage_options()
    objects = {str(f.relative_to(path)): f.read_bytes() for f in path.rglob("*") if f.is_file()}
    write(root, options, objects)
    return root, options, scans


@pytest.mark.parametrize("patch", [None, (2, 2)])
def test_an_array_named_in_its_group_or_by_its_own_url_gives_the_same_samples(
    oct_group: tuple[str, dict[str, Any], np.ndarray], patch: tuple[int, ...] | None
) -> None:
    """``Zarr(group, array="scans")`` and ``Zarr(group + "/scans")`` name each sample alike:
    the same URL and version, so the same cache name (the versions differed: the group's form
    hashed the chunks' keys with the array's path in them, so a cache warmed through one form
    missed every sample through the other)."""
    root, options, _ = oct_group
    named = RemoteDataset(Zarr(root, array="scans", patch=patch), storage_options=options)
    own = RemoteDataset(Zarr(f"{root}/scans", patch=patch), storage_options=options)
    indices = list(range(len(own)))
    assert len(named) == len(own) == (12 if patch is None else 6 * 2)
    assert named.source.identities(indices) == own.source.identities(indices)
    assert named._cache_names(indices) == own._cache_names(indices)
    for mine, theirs in zip(samples(named), samples(own), strict=True):
        assert_same(mine, theirs)


@pytest.mark.parametrize(
    ("warmed", "trained"),
    [
        (["--array", "scans"], {}),  # warm the group's array, train on the array's URL
        ([], {"array": "scans"}),  # and the other way
        (["--array", "scans", "--patch", "2,2"], {"patch": (2, 2)}),
    ],
    ids=["group-then-array", "array-then-group", "patches"],
)
def test_the_command_line_warms_a_zarr_array_that_training_names_the_other_way(
    oct_group: tuple[str, dict[str, Any], np.ndarray],
    tmp_path: Path,
    warmed: list[str],
    trained: dict[str, Any],
) -> None:
    """`fastload warm-cache --shards zarr` takes Zarr's ``array=`` and ``patch=`` as
    ``--array`` and ``--patch`` (it had neither: a group could not be warmed, and patches
    needed --dataset); training through the other form of the array's name then reads every
    sample from the cache, no request for any, and the values are zarr's."""
    from tests.test_cli import fastload as cli
    from tests.test_cli import options_args

    root, options, scans = oct_group
    group_form = "--array" in warmed
    where = root if group_form else f"{root}/scans"
    cache = tmp_path / "cache"
    done = cli(
        "warm-cache", where, "--shards", "zarr", *warmed, "--cache-dir", str(cache),
        "--format", "npy", "--json", *options_args(options),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    total = 12 if "patch" not in trained else 12 // 2 * (4 // 2)
    assert summary["samples"] == total and summary["failures"] == {}
    source = Zarr(f"{root}/scans", **trained) if group_form else Zarr(root, **trained)
    dataset = RemoteDataset(source, cache=Cache(cache, format="npy"), storage_options=options)
    dataset.counters.drain()  # opening it read the array's metadata
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0, collate_fn=list)
    got = {dataset.source[i].name: sample for i, sample in enumerate(s for b in loader for s in b)}
    counted = dataset.counters.drain()
    assert counted.fetch.requests == 0
    assert (counted.cache.hits, counted.cache.misses) == (total, 0)
    assert len(got) == total
    for name, sample in got.items():  # "[5]", or a patch's region: "[2:4,0:2]"
        bounds = [tuple(map(int, b.split(":"))) for b in name[1:-1].split(",")]
        region = tuple(b[0] if len(b) == 1 else slice(*b) for b in bounds)
        assert_same(sample, scans[region])


def test_the_command_line_checks_the_zarr_options_before_any_request(tmp_path: Path) -> None:
    """A wrong ``--patch``, or ``--array`` for another source, is a usage error naming it."""
    from tests.test_cli import fastload as cli

    args = ["warm-cache", url(tmp_path / "none.zarr"), "--cache-dir", str(tmp_path / "c")]
    for wrong, said in (
        (["--shards", "tar", "--array", "scans"], "the tar source does not take array (array "),
        (["--shards", "zarr", "--patch", "2,x"], "--patch takes sizes, comma-separated"),
        (["--shards", "zarr", "--patch", "0,2"], "patch sizes must be >= 1, got (0, 2)"),
    ):
        done = cli(*args, *wrong)
        assert done.returncode == 2 and said in done.stderr, done.stderr


def test_a_damaged_zstd_chunk_is_named_and_skipped(tmp_path: Path) -> None:
    """A truncated chunk under zarr's default codecs: zstd fails on it. Under "raise" a
    ShardError names the sample and the chunk's URL; under "skip" its samples are replaced and
    the chunk is named, once."""
    path = tmp_path / "cut.zarr"
    make(path, RNG.integers(0, 9, (8, 64)).astype(np.uint8), chunks=(4, 64))
    chunk = path / "c/1/0"
    chunk.write_bytes(chunk.read_bytes()[:-9])
    with pytest.raises(
        ShardError, match=r"sample \[5\] of .*: cannot read chunk \(1, 0\) \(RuntimeError: Zstd"
    ) as raised:
        RemoteDataset(Zarr(url(path)))[5]
    assert raised.value.url == url(chunk)
    dataset = RemoteDataset(Zarr(url(path)), on_error="skip")
    assert len(samples(dataset)) == 8
    stats = dataset.stats()["dataset"]
    assert stats["skipped"] == 4 and stats["skipped_keys"] == [url(chunk)]


def test_decode_receives_the_array(tmp_path: Path) -> None:
    path = tmp_path / "a.zarr"
    make(path, np.arange(6, dtype=np.uint8).reshape(3, 2), chunks=(3, 2))
    dataset = RemoteDataset(Zarr(url(path)), decode=lambda a: (type(a), a.sum()))
    assert dataset[2] == (np.ndarray, 9)
    with pytest.raises(ConfigError, match="zarr samples are numpy arrays"):
        RemoteDataset(Zarr(url(path)), decode="npy")


@pytest.mark.parametrize(
    ("codec", "options"),
    [
        ("zstd", {}),
        (
            "big-endian bytes + crc32c",
            {"serializer": BytesCodec(endian="big"), "compressors": [ZstdCodec(), Crc32cCodec()]},
        ),
        ("transpose", {"filters": [TransposeCodec(order=(2, 1, 0))]}),
        ("none", {"compressors": None}),
        ("v2 F order", {"zarr_format": 2, "order": "F"}),
        (
            "v2 zlib + delta",
            {
                "zarr_format": 2,
                "compressors": numcodecs.Zlib(),
                "filters": [numcodecs.Delta(dtype="<i4")],
            },
        ),
        ("sharded", {"shards": (8, 10, 12)}),
    ],
)
def test_chunks_are_decoded_by_their_codecs_and_zarr_s_array_checks_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str, options: dict[str, Any]
) -> None:
    """A chunk is decoded by the array's codecs called in turn: zarr's array (0.4 ms a chunk
    in its async layer) decodes only the first, to check the codecs give what it reads; a
    sharded array (no synchronous decode) goes through zarr's array. Values exact either way,
    edge chunks too."""
    from fastload.sources import zarr as module

    through_zarr = 0
    original = module._Decoder._through_zarr

    def counted(self: Any, *args: Any) -> Any:
        nonlocal through_zarr
        through_zarr += 1
        return original(self, *args)

    monkeypatch.setattr(module._Decoder, "_through_zarr", counted)
    path = tmp_path / "stack.zarr"
    data = (
        awkward("float32", (37, 10, 12))
        if codec != "v2 zlib + delta"
        else (RNG.integers(-1000, 1000, (37, 10, 12)).astype("<i4"))
    )
    make(path, data, chunks=(4, 5, 12), **options)
    theirs = zarr.open_array(str(path), mode="r")
    dataset = RemoteDataset(Zarr(url(path)))
    for i, sample in enumerate(samples(dataset)):
        assert_same(sample, theirs[i])
    shard_objects = -(-37 // 8)  # each read and decoded whole by zarr's array
    assert through_zarr == (shard_objects if codec == "sharded" else 1), through_zarr


def reversing_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each chunk's codecs give its values reversed along its last axis: a chain that goes
    wrong (another zarr's internals), which only zarr's own reading can tell."""
    from fastload.sources import zarr as module

    real = module._codec_chain

    def chain(metadata: Any) -> Any:
        decode = real(metadata)
        return lambda body: decode(body)[..., ::-1]

    monkeypatch.setattr(module, "_codec_chain", chain)


def test_a_chunk_of_one_value_does_not_vouch_for_the_codecs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first chunk of a scan is background, one value (not the fill value: zarr writes no
    chunk of that): the codecs' reading of it equals zarr's even where the codecs put values in
    the wrong places. Chunks are compared until one
    of more than one value is (before, the first settled it, and every later chunk came out
    reversed)."""
    reversing_chain(monkeypatch)
    path = tmp_path / "scan.zarr"
    data = RNG.integers(1, 1000, (12, 6)).astype(np.uint16)
    data[:4] = 7
    make(path, data, chunks=(4, 6))
    theirs = zarr.open_array(str(path), mode="r")
    for i, sample in enumerate(samples(RemoteDataset(Zarr(url(path))))):
        assert_same(sample, theirs[i])


def test_chunks_decoded_while_the_first_is_checked_wait_for_its_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads decode chunks at once (the loader's lookahead). One decoding a chunk while
    another's chunk is being compared with zarr's reading waits for the verdict: before, it took
    the codecs' values unchecked, and where they were wrong a sample was wrong without an
    error."""
    from fastload.sources import zarr as module

    reversing_chain(monkeypatch)
    path = tmp_path / "scan.zarr"
    data = RNG.integers(1, 1000, (8, 6)).astype(np.uint16)
    make(path, data, chunks=(4, 6))
    decoder = RemoteDataset(Zarr(url(path))).source._zarr()  # type: ignore[attr-defined]
    entered, release = threading.Event(), threading.Event()
    original = module._Decoder._through_zarr

    def held(self: Any, *args: Any) -> Any:  # the first check, held until released
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return original(self, *args)

    monkeypatch.setattr(module._Decoder, "_through_zarr", held)
    got: dict[int, np.ndarray] = {}

    def decode(row: int) -> None:
        region = (slice(4 * row, 4 * row + 4), slice(0, 6))
        got[row] = decoder.decoded(f"c/{row}/0", region, (path / "c" / str(row) / "0").read_bytes())

    first = threading.Thread(target=decode, args=(0,))
    first.start()
    assert entered.wait(30)
    second = threading.Thread(target=decode, args=(1,))
    second.start()
    second.join(1.0)  # it waits for the first's verdict (before: done at once, unchecked)
    release.set()
    first.join(30)
    second.join(30)
    for row in (0, 1):
        assert_same(np.asarray(got[row]), data[4 * row : 4 * row + 4])
