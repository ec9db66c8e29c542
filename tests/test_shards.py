"""Samples inside shards (tar in the WebDataset layout, parquet), read in place, against
SeaweedFS, fake-gcs-server and the B2 server."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import fastload
from fastload import (
    Cache,
    ChunkConfig,
    ConfigError,
    Manifest,
    ObjectChangedError,
    ObjectNotFoundError,
    Parquet,
    RemoteDataset,
    ShardError,
    Source,
    Tar,
)
from fastload.sampler import PermutationSampler, block_locality
from fastload.sources._chunks import _in_memory
from fastload.sources.registry import source_named
from fastload.testing import B2Server, FakeGcsServer, FaultProxy, Faults, S3Server
from tests.conftest import BUCKET, assert_identities, write

SHARDS, PER_SHARD = 4, 25
LONG = "x" * 120  # a name past ustar's 100 characters: a PAX header in front of the member


def key(n: int) -> str:
    """Directory-like keys with dots in folder names, as real datasets have them."""
    return f"class.{n % 3}/{LONG if n % 10 == 7 else 'img'}-{n:05d}"


def image(n: int) -> np.ndarray:
    return (np.arange(64 * 80, dtype=np.uint16).reshape(64, 80) * 7 + 40_000 + n).astype(np.uint16)


def npy(value: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, value)
    return out.getvalue()


def tar_shard(first: int, count: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        folder = tarfile.TarInfo("class.0")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)  # a folder entry, as `tar cf` writes them: not a sample
        for n in range(first, first + count):
            members = {
                "npy": npy(image(n)),
                "cls": str(n % 3).encode(),
                "meta.json": json.dumps({"n": n}).encode(),
            }
            for ext, body in members.items():
                info = tarfile.TarInfo(f"{key(n)}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def tar_dataset(root: str, options: dict[str, Any]) -> dict[str, bytes]:
    objects = {
        f"train/shard-{s:03d}.tar": tar_shard(s * PER_SHARD, PER_SHARD) for s in range(SHARDS)
    }
    objects["train/README.md"] = b"not a shard"
    write(root, options, objects)
    return objects


DECODE = {"npy": fastload.transforms.decode_npy, "cls": int, "meta.json": json.loads}


FORMAT_KEYS = {  # sample keys each tar format can hold, between short plain ones
    tarfile.USTAR_FORMAT: ["a/short", "b/" + "p" * 120 + "/x", "c/" + "\u00e9" * 30],
    tarfile.GNU_FORMAT: ["a/short", "d/" + "q" * 200, "c/" + "\u00e9" * 30],
    tarfile.PAX_FORMAT: ["a/short", "d/" + "q" * 200, "c/" + "\u00e9" * 30],
}


@pytest.mark.parametrize("form", list(FORMAT_KEYS))
def test_headers_of_every_tar_format_index_as_tarfile_lists_them(tmp_path: Path, form: int) -> None:
    """fastload parses plain headers itself and lets tarfile read from the first other one on
    (a GNU long-name record, a pax record): the index is what tarfile lists, in each format,
    with a name split into ustar's prefix, names too long for a header, names not ASCII and
    plain members after those, each sample's bytes read back from its place."""
    keys = [*FORMAT_KEYS[form], "e/after", "f/last"]
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w", format=form) as tar:
        for n, name in enumerate(keys):
            for ext, body in (("npy", npy(image(n))), ("cls", str(n).encode())):
                info = tarfile.TarInfo(f"{name}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "s.tar").write_bytes(packed.getvalue())
    packed.seek(0)
    with tarfile.open(fileobj=packed) as tar:
        assert tar.getnames() == [f"{name}.{ext}" for name in keys for ext in ("npy", "cls")]
    shards = f"file://{tmp_path / 'shards'}"
    dataset = RemoteDataset(Tar(shards), decode={"npy": "npy", "cls": int})
    assert [sample.url.split("#", 1)[1] for sample in dataset.source] == keys
    for n in range(len(keys)):
        assert np.array_equal(dataset[n]["npy"], image(n)) and dataset[n]["cls"] == n


def test_tar_shards_read_in_place_one_read_per_chunk(
    store: tuple[str, dict[str, Any]], tmp_path: Any
) -> None:
    root, options = store
    tar_dataset(root, options)
    chunks = ChunkConfig(chunk_bytes=150_000)  # a few chunks per shard
    dataset = RemoteDataset(
        Tar(f"{root}/train", chunks=chunks), decode=DECODE, storage_options=options
    )
    assert len(dataset) == SHARDS * PER_SHARD
    assert dataset.blocks is not None and 2 * SHARDS <= len(dataset.blocks) < len(dataset)
    before = dataset.fetcher.counters.requests  # those that read the headers
    sample = dataset[37]
    assert sample["meta.json"] == {"n": 37} and sample["cls"] == 37 % 3
    assert sample["npy"].dtype == np.uint16 and np.array_equal(sample["npy"], image(37))
    assert dataset.source[37].url.endswith(f"shard-001.tar#{key(37)}")
    assert_identities(dataset, [37, 0, 99])

    loader = fastload.DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=list)
    seen = [item["meta.json"]["n"] for batch in loader for item in batch]
    assert sorted(seen) == list(range(len(dataset)))  # every sample once
    assert seen != sorted(seen)  # and shuffled
    unseeded = len(dataset.blocks) - dataset.source.reader.seeded  # type: ignore[attr-defined]
    assert dataset.fetcher.counters.requests - before == unseeded  # one read a chunk, at most

    cache = Cache(tmp_path / "c", format="npy")
    first = RemoteDataset(Tar(f"{root}/train"), cache=cache, storage_options=options)
    again = RemoteDataset(Tar(f"{root}/train"), cache=cache, storage_options=options)
    assert first.fetcher.counters.requests >= SHARDS  # the headers were read once ...
    assert again.fetcher.counters.requests == 0  # ... and the index came from the cache
    assert again[5]["cls"] == b"2"


def test_a_webdataset_brace_url_reads_the_shards_it_names(
    store: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """``shard-{000..002}.tar``, as WebDataset users write their shard lists: those shards
    and no others (not the fourth, not the README), their samples once each; a saved listing
    keeps the pattern, so a restart and a refresh select the same shards; a shard the pattern
    names that is missing is an error naming it, never a smaller dataset."""
    root, options = store
    tar_dataset(root, options)
    url = f"{root}/train/shard-{{000..002}}.tar"
    cache = Cache(tmp_path / "c", format="npy")
    dataset = RemoteDataset(Tar(url), decode=DECODE, cache=cache, storage_options=options)
    assert len(dataset) == 3 * PER_SHARD
    assert dataset.manifest.root == f"{root}/train"
    assert dataset.manifest.keys() == [f"shard-{s:03d}.tar" for s in range(3)]
    loader = fastload.DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=list)
    seen = [item["meta.json"]["n"] for batch in loader for item in batch]
    assert sorted(seen) == list(range(3 * PER_SHARD))

    again = RemoteDataset(Tar(url), cache=cache, storage_options=options)
    assert again.fetcher.counters.requests == 0  # the saved listing and indexes
    assert again.listing_check is not None
    assert not again.listing_check.result(timeout=60).any  # listed with the pattern again
    assert len(again) == 3 * PER_SHARD
    assert dataset.manifest.refresh(storage_options=options).any is False

    with pytest.raises(ObjectNotFoundError, match="2 of the 6") as caught:
        RemoteDataset(Tar(f"{root}/train/shard-{{000..005}}.tar"), storage_options=options)
    assert "train/shard-004.tar" in str(caught.value) and "shard-003" not in str(caught.value)


def test_indexing_says_what_it_reads_and_a_start_with_the_index_says_nothing(
    seaweed: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> None:
    """A first start over small members reads every byte to index them (minutes on a large
    dataset, before the first batch): INFO lines say so, how far it is, and what it read; a
    start that finds the index in the cache reads nothing and says nothing."""
    root = f"s3://{BUCKET}/said-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    tar_dataset(root, options)
    monkeypatch.setattr("fastload.sources._shards._EVERY", 0.0)  # a progress line a shard
    cache = Cache(tmp_path / "c")
    with caplog.at_level(logging.INFO, logger="fastload.sources._shards"):
        RemoteDataset(Tar(f"{root}/train"), cache=cache, storage_options=options)
        said = [r.getMessage() for r in caplog.records]
        caplog.clear()
        RemoteDataset(Tar(f"{root}/train"), cache=cache, storage_options=options)
        again = [r.getMessage() for r in caplog.records if "indexe" in r.getMessage()]
    what = f"{SHARDS} tar shards under {root}/train"
    assert sum(line.startswith(f"indexing {what}: a shard of small") for line in said) == 1
    assert sum(f"of {what}, 0.0 GB read in" in line for line in said) == SHARDS
    assert any(line.startswith(f"indexed {what} in ") for line in said)
    assert again == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    chunks = ChunkConfig(memory_bytes=100_000)  # less than the shards: their reads read again
    with caplog.at_level(logging.INFO, logger="fastload.sources._shards"):
        RemoteDataset(Tar(f"{root}/train", chunks=chunks), storage_options=options)
    (warned,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned.startswith(f"indexing {what} read 0.00 GB, more than the chunk memory")


def test_tar_shards_through_workers_and_resume_mid_epoch(seaweed: S3Server) -> None:
    root = f"s3://{BUCKET}/shards-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    tar_dataset(root, options)

    def loader(workers: int) -> fastload.DataLoader:
        dataset = RemoteDataset(
            Tar(f"{root}/train"),
            decode={"npy": fastload.transforms.decode_npy, "*": bytes.decode},
            storage_options=options,
        )
        return fastload.DataLoader(
            dataset, batch_size=10, shuffle=True, num_workers=workers, collate_fn=list
        )

    def numbers(batches: Any) -> list[int]:
        return [json.loads(item["meta.json"])["n"] for batch in batches for item in batch]

    workers = loader(2)
    before = workers.dataset.fetcher.counters.requests  # type: ignore[attr-defined]
    assert sorted(numbers(workers)) == list(range(SHARDS * PER_SHARD))
    counters = workers.counters
    assert counters is not None  # each chunk read once: by indexing, or by one worker for all
    source = workers.dataset.source  # type: ignore[attr-defined]
    unseeded = len(source.blocks) - source.reader.seeded
    assert counters.fetch.requests - before == unseeded
    first = loader(0)
    seen: list[int] = []
    for step, batch in enumerate(first):
        seen += numbers([batch])
        if step == 3:
            state = first.state_dict()
            break
    resumed = loader(0)
    resumed.load_state_dict(state)
    rest = numbers(resumed)
    assert sorted(seen + rest) == list(range(SHARDS * PER_SHARD))


def npy_member(sample: dict[str, Any]) -> Any:
    """A module-level transform: it pickles for workers that start by forkserver or spawn."""
    return sample["npy"]


def npy_images(root: str, options: dict[str, Any], **kwargs: Any) -> RemoteDataset:
    """The tar dataset's images alone, in a few chunks per shard."""
    chunks = ChunkConfig(chunk_bytes=150_000)
    return RemoteDataset(
        Tar(f"{root}/train", chunks=chunks), decode=DECODE, transform=npy_member,
        storage_options=options, **kwargs,
    )  # fmt: skip


def image_numbers(loader: fastload.DataLoader) -> list[int]:
    """Which samples an epoch of ``npy_images`` batches held (``image(n)`` starts at n)."""
    return sorted(int(b[i, 0, 0]) - 40_000 for b in loader for i in range(len(b)))


@pytest.mark.parametrize("workers", [1, 2])
def test_tar_shards_with_workers_the_workers_cache_ahead_themselves(
    seaweed: S3Server, tmp_path: Any, workers: int
) -> None:
    """With a cache, a shard dataset's lookahead runs in the workers as it does for single
    objects: after indexing the main process writes only its head start's entries (the first
    batches, while the workers start); each chunk is read once and each sample written once,
    some of them ahead of their batch."""
    root = f"s3://{BUCKET}/shards-ahead-{uuid.uuid4().hex[:8]}"
    tar_dataset(root, seaweed.storage_options())
    with FaultProxy(seaweed.endpoint, flavor="s3", faults=Faults(latency=0.05)) as proxy:
        options = seaweed.storage_options(proxy.endpoint)
        dataset = npy_images(root, options, cache=Cache(tmp_path, format="npy"))
        indexed = dataset.counters.drain()
        assert indexed.fetch.requests >= SHARDS  # the headers, read here
        loader = fastload.DataLoader(
            dataset, batch_size=5, shuffle=True, num_workers=workers, prefetch_factor=1
        )
        values = image_numbers(loader)
    assert values == list(range(SHARDS * PER_SHARD))
    after = dataset.counters.drain()  # what this process counted since indexing
    assert after.cache.writes <= (loader.lookahead + workers) * 5
    assert len(Cache(tmp_path, format="npy")) == SHARDS * PER_SHARD + SHARDS  # and the indexes
    assert loader.counters is not None and dataset.blocks is not None
    total = loader.counters.since(indexed)
    # chunks the index pass read are not read again; a worker's last lookahead may report
    # after its last batch: short, never over
    unseeded = len(dataset.blocks) - dataset.source.reader.seeded  # type: ignore[attr-defined]
    assert total.fetch.requests <= unseeded
    assert 0 < total.cache.writes <= SHARDS * PER_SHARD
    assert total.cache.hits + total.cache.waits >= 5  # batches read what a lookahead made


def test_bad_tar_shards_are_named(b2: B2Server, caplog: pytest.LogCaptureFixture) -> None:
    root = f"b2://{BUCKET}/bad-tar-{uuid.uuid4().hex[:8]}"
    options = b2.storage_options()
    good = tar_shard(0, 10)
    objects = {"a.tar": good, "b.tar": tar_shard(10, 10)[:30_000]}  # b is cut mid-member
    write(root, options, objects)
    with pytest.raises(ShardError, match=r"truncated: member '.*' ends at byte \d+.*b\.tar"):
        RemoteDataset(Tar(root), storage_options=options)
    with caplog.at_level(logging.WARNING):
        dataset = RemoteDataset(Tar(root), on_error="skip", storage_options=options)
    assert len(dataset) == 10 and "b.tar" in caplog.text
    (left_out,) = dataset.stats()["dataset"]["left_out"]  # named where a script can see it too
    assert "b.tar" in left_out and "truncated" in left_out

    no_ext = io.BytesIO()
    with tarfile.open(fileobj=no_ext, mode="w") as tar:
        info = tarfile.TarInfo("LICENSE")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"MIT"))
    write(root, options, {"b.tar": no_ext.getvalue()})
    with pytest.raises(ShardError, match=r"member 'LICENSE' has no basename.extension.*b\.tar"):
        RemoteDataset(Tar(root), storage_options=options)

    apart = io.BytesIO()  # a sample whose members are not adjacent would be two samples
    with tarfile.open(fileobj=apart, mode="w") as tar:
        for name in ("a.jpg", "b.jpg", "a.cls"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    write(root, options, {"b.tar": apart.getvalue()})
    with pytest.raises(ShardError, match=r"sample 'a' comes twice .*b\.tar"):
        RemoteDataset(Tar(root), storage_options=options)

    sparse = io.BytesIO()  # GNU tar -S: the member's bytes in the shard are not the file's
    with tarfile.open(fileobj=sparse, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("a.bin")
        info.type, info.size = tarfile.GNUTYPE_SPARSE, 3
        tar.addfile(info, io.BytesIO(b"xyz"))
    write(root, options, {"b.tar": sparse.getvalue()})
    with pytest.raises(ShardError, match=r"'a\.bin' is a sparse file.*b\.tar"):
        RemoteDataset(Tar(root), storage_options=options)

    linked = io.BytesIO()  # tar stores a second name of one file (a hard link) as a link
    with tarfile.open(fileobj=linked, mode="w") as tar:
        kinds = {"a.jpg": tarfile.REGTYPE, "b.cls": tarfile.REGTYPE}
        for name, kind in [*kinds.items(), ("b.jpg", tarfile.LNKTYPE), ("c.jpg", tarfile.SYMTYPE)]:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, "" if kind == tarfile.REGTYPE else "a.jpg"
            info.size = 1 if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(b"x") if kind == tarfile.REGTYPE else None)
    write(root, options, {"b.tar": linked.getvalue()})
    with pytest.raises(ShardError, match=r"sample 'b': member 'b\.jpg' is a link.*b\.tar"):
        RemoteDataset(Tar(root), storage_options=options)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        # a.jpg alone is unlike a.tar's samples: accepted here
        dataset = RemoteDataset(
            Tar(root, incomplete="accept"), on_error="skip", storage_options=options
        )
    assert len(dataset) == 11  # a.tar's 10 and b.tar's a; b and c left out, and named
    assert "'b.jpg' is a link" in caplog.text and "'c.jpg' is a link" in caplog.text

    cased = io.BytesIO()  # extensions are lowercased, as WebDataset does
    with tarfile.open(fileobj=cased, mode="w") as tar:
        for name in ("a.JPG", "a.Cls", "b.JPG", "b.jpg"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    write(root, options, {"b.tar": cased.getvalue()})
    with pytest.raises(
        ShardError, match=r"sample 'b' has two members named alike: \['jpg', 'jpg'\]"
    ):
        RemoteDataset(Tar(root), storage_options=options)
    dataset = RemoteDataset(
        Tar(root, incomplete="accept"), on_error="skip", storage_options=options
    )
    assert dataset[10] == {"jpg": b"x", "cls": b"x"}

    write(root, options, {"b.tar": tar_shard(10, 10)})
    no_room = ChunkConfig(memory_bytes=1000)  # nothing kept from indexing: reads go to the store
    dataset = RemoteDataset(Tar(root, chunks=no_room), storage_options=options)
    shifted = tar_shard(0, 10)  # same size, other content: the members moved by one sample
    shifted = shifted[:512] + tar_shard(1, 10)[512 : len(good)]
    write(root, options, {"a.tar": shifted[: len(good)]})
    # the store names the version it served: the rewrite is caught before any header is parsed
    with pytest.raises(ObjectChangedError, match=r"'class.0/img-00003'.*a\.tar.*changed since"):
        dataset[3]
    with pytest.raises(ConfigError, match=r"no parquet shards .*keys look like .*a\.tar"):
        RemoteDataset(Parquet(root), storage_options=options)


def test_an_incomplete_tar_sample_is_named_as_for_groups(
    gcs: FakeGcsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer stopped mid-sample leaves a shard whose last sample has its image but no label;
    another sample carries a stray member. They were samples like any other: the missing
    label surfaced as a KeyError in the training loop, or not at all. Now, as for groups of
    objects, a sample whose extensions are not most samples' (or ``members=``) is named when
    the dataset is made; incomplete="skip" leaves it out, "accept" keeps it."""
    root = f"gs://{BUCKET}/incomplete-tar-{uuid.uuid4().hex[:8]}"
    options = gcs.storage_options()
    cut = io.BytesIO()
    with tarfile.open(fileobj=cut, mode="w") as tar:
        for n in range(20, 25):
            body = {"npy": npy(image(n)), "cls": str(n % 3).encode()}
            if n == 22:
                body["txt"] = b"a note"  # one sample with a member the others lack
            if n == 24:
                del body["cls"]  # the writer stopped before the label
            for ext, data in body.items():
                info = tarfile.TarInfo(f"{key(n)}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w") as tar:
        for n in range(20):
            for ext, data in {"npy": npy(image(n)), "cls": str(n % 3).encode()}.items():
                info = tarfile.TarInfo(f"{key(n)}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    write(root, options, {"shard-000.tar": whole.getvalue(), "shard-001.tar": cut.getvalue()})

    def made(**tar_options: Any) -> RemoteDataset:
        return RemoteDataset(Tar(root, **tar_options), storage_options=options)

    with pytest.raises(ConfigError, match=r"2 of 25 tar samples under .* are incomplete") as err:
        made()
    assert f"shard-001.tar#{key(24)}': missing ['cls']" in str(err.value)
    assert f"shard-001.tar#{key(22)}': extra ['txt']" in str(err.value)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        skipped = made(incomplete="skip")
    assert len(skipped) == 23 and "leaving out 2 incomplete tar samples" in caplog.text
    assert skipped.stats()["dataset"]["left_out"] == [  # where a script can see them too
        f"{root}/shard-001.tar#{key(22)}: incomplete sample, extra ['txt']",
        f"{root}/shard-001.tar#{key(24)}: incomplete sample, missing ['cls']",
    ]
    names = [skipped.source[i].name for i in range(len(skipped))]
    assert key(24) not in names and key(22) not in names and key(23) in names
    assert skipped[22]["cls"] == str(23 % 3).encode()  # the samples after them are in place
    accepted = made(incomplete="accept")
    assert len(accepted) == 25 and set(accepted[24]) == {"npy"}
    with pytest.raises(ConfigError, match=r"24 of 25 tar samples .* missing \['txt'\]"):
        made(members=["NPY", ".cls", "txt"])  # stated members win over the usual ones
    assert len(made(members=2, incomplete="skip")) == 23  # or their number
    with pytest.raises(ConfigError, match="members must be a count >= 1 or a list"):
        made(members="npy")  # a string would be taken letter by letter


def test_compressed_tar_shards_are_refused_not_left_out(
    seaweed: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """WebDataset reads .tar.gz shards; fastload reads tar in place by byte range, which a
    compressed stream has not. Such shards were left out with an INFO line: two thirds of this
    dataset gone, quietly. Now they are a ShardError naming them (on_error="skip": a warning);
    a shard named .TAR is read like .tar."""
    root = f"s3://{BUCKET}/gz-tar-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as tar:
        info = tarfile.TarInfo("z/000001.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"1"))
    objects = {
        "train/shard-000.tar": tar_shard(0, 5),
        "train/shard-001.TAR": tar_shard(5, 5),
        "train/shard-002.tar.gz": packed.getvalue(),
        "train/shard-003.tgz": packed.getvalue(),
        "train/_SUCCESS": b"",
    }
    write(root, options, objects)
    with pytest.raises(ShardError, match=r"compressed tar shard \(and 1 more.*gunzip.*\.tar\.gz"):
        RemoteDataset(Tar(f"{root}/train"), storage_options=options)
    with caplog.at_level(logging.WARNING):
        dataset = RemoteDataset(Tar(f"{root}/train"), on_error="skip", storage_options=options)
    assert len(dataset) == 10 and "shard-002.tar.gz" in caplog.text
    assert dataset[7]["cls"] == str(7 % 3).encode()


def test_macos_and_webdataset_metadata_members_are_not_samples(
    seaweed: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A shard made with macOS tar (``tar cf shard.tar .``) carries an AppleDouble companion
    ``._name`` before each file, a ``.DS_Store`` and names members ``./n01/...``; WebDataset
    writes ``__name__`` metadata members. WebDataset leaves them out; fastload raised a ShardError
    ("no basename.extension") for the whole dataset. Now they are left out and counted in an
    INFO line, and every real sample is read as before."""
    root = f"s3://{BUCKET}/macos-tar-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w", format=tarfile.PAX_FORMAT) as tar:
        members = [("./__index__", b"{}"), ("./n01/.DS_Store", b"Bud1")]
        for n in range(4):
            for ext, body in (("png", npy(image(n))), ("cls", str(n % 3).encode())):
                name = f"n01/{n:06d}.{ext}"
                members += [(f"./n01/._{n:06d}.{ext}", b"\x00\x05\x16\x07 attributes")]
                members += [(f"./{name}", body)]
        for name, body in members:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    write(root, options, {"train/shard-000.tar": packed.getvalue()})
    with caplog.at_level(logging.INFO, logger="fastload"):
        dataset = RemoteDataset(Tar(f"{root}/train"), storage_options=options)
    assert len(dataset) == 4
    assert dataset.source[2].url.endswith("shard-000.tar#./n01/000002")
    assert dataset[2]["cls"] == b"2"
    assert np.array_equal(fastload.transforms.decode_npy(dataset[3]["png"]), image(3))
    assert "leaving out 10 members that are not sample data" in caplog.text
    assert "./__index__" in caplog.text

    stray = io.BytesIO()  # a member with no extension that is not metadata stays an error
    with tarfile.open(fileobj=stray, mode="w") as tar:
        for name in ("._LICENSE", "LICENSE"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"MIT"))
    write(root, options, {"train/shard-001.tar": stray.getvalue()})
    with pytest.raises(ShardError, match=r"member 'LICENSE' has no basename.extension"):
        RemoteDataset(Tar(f"{root}/train"), storage_options=options)


def test_a_fixed_reader_makes_cached_samples_again(
    b2: B2Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reader that gives other samples for the same shard (a bug fixed, extensions
    # lowercased) changes its version; cached samples made by the old one are not served.
    root = f"b2://{BUCKET}/fixed-{uuid.uuid4().hex[:8]}"
    options = b2.storage_options()
    write(root, options, {"a.tar": tar_shard(0, 5)})
    cache = Cache(tmp_path / "c", format="npy")

    def read_one() -> tuple[int, int]:
        """Cache hits and writes of a new dataset reading sample 3 (its shard's index, then it)."""
        hits, writes = cache.counters.hits, cache.counters.writes
        dataset = RemoteDataset(Tar(root), decode=DECODE, cache=cache, storage_options=options)
        assert dataset[3]["meta.json"] == {"n": 3}
        return cache.counters.hits - hits, cache.counters.writes - writes

    assert read_one() == (0, 2)
    assert read_one() == (1, 0)  # the same reader: the sample from the cache (its index was
    # saved with the listing beside the cache)
    monkeypatch.setattr(fastload.sources.tar.TarShards, "index_version", "tar-index/next")
    assert read_one() == (0, 2)


def events(first: int, count: int) -> pa.Table:
    ids = np.arange(first, first + count)
    pulses = [np.full(3 + i % 5, i, np.float32) for i in ids]
    return pa.table({"event_id": ids, "pulses": pulses, "name": [f"ev{i}" for i in ids]})


def parquet(table: pa.Table, **kwargs: Any) -> bytes:
    out = io.BytesIO()
    pq.write_table(table, out, **kwargs)
    return out.getvalue()


def batches(
    make: Any, files: int, per_file: int, rows: int, folder: str = "events/"
) -> dict[str, bytes]:
    """``files`` parquet files of ``make(first, count)``'s events, in row groups of ``rows``."""
    return {
        f"{folder}batch_{f}.parquet": parquet(make(f * per_file, per_file), row_group_size=rows)
        for f in range(files)
    }


def test_parquet_rows_one_read_per_row_group(store: tuple[str, dict[str, Any]]) -> None:
    root, options = store
    write(root, options, batches(events, 3, 500, 200))
    dataset = RemoteDataset(Parquet(f"{root}/events"), storage_options=options)
    assert len(dataset) == 1500 and dataset.blocks is not None and len(dataset.blocks) == 9
    row = dataset[1234]
    assert int(row["event_id"]) == 1234 and row["name"] == "ev1234"
    assert np.array_equal(row["pulses"], np.full(3 + 1234 % 5, 1234, np.float32))
    assert dataset.source[1234].url.endswith("batch_2.parquet#row=234")
    with warnings.catch_warnings():  # torch warns of a read-only array, then shares it
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(row["pulses"]).add_(1)  # a transform changing its input in place
    assert np.array_equal(dataset[1234]["pulses"], np.full(3 + 1234 % 5, 1234, np.float32))

    before = dataset.fetcher.counters.requests
    sampler = PermutationSampler(len(dataset), blocks=dataset.blocks, window=2, seed=3)
    locality = block_locality(sampler, batch_size=64)
    assert locality["blocks_per_batch"] <= 3
    loader = fastload.DataLoader(dataset, batch_size=64, shuffle=True, collate_fn=list)
    seen = [int(r["event_id"]) for batch in loader for r in batch]
    assert sorted(seen) == list(range(1500))
    assert dataset.fetcher.counters.requests - before == 9 - 1  # row group 0 of batch_2 was read


def test_parquet_columns_read_only_those_columns(seaweed: S3Server, tmp_path: Path) -> None:
    """A wide file (an image column between an id and its labels) read for two columns: rows
    hold those alone, their bytes alone are fetched (two ranges a row group: the image column
    between them is not), and the cache keeps rows of other columns apart."""
    root = f"s3://{BUCKET}/columns-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    rng = np.random.default_rng(2)
    n = 120
    table = pa.table(
        {
            "id": pa.array([2**60 + i for i in range(n)], pa.int64()),
            "image": [rng.integers(0, 256, 30_000, dtype=np.uint8).tobytes() for _ in range(n)],
            "label": pa.array([None if i % 7 == 0 else i % 5 for i in range(n)], pa.int16()),
            "box": pa.array([{"x": i, "y": -i} for i in range(n)]),
        }
    )
    write(
        root,
        options,
        {f"laion/part-{p}.parquet": parquet(table, row_group_size=40) for p in range(2)},
    )
    whole = RemoteDataset(Parquet(f"{root}/laion"), storage_options=options)
    cache = Cache(tmp_path / "c")
    picked = RemoteDataset(
        Parquet(f"{root}/laion", columns=["id", "label"]), cache=cache, storage_options=options
    )
    for dataset in (whole, picked):
        before = dataset.fetcher.counters.bytes
        rows = [
            r
            for batch in fastload.DataLoader(dataset, batch_size=40, collate_fn=list)
            for r in batch
        ]
        dataset.read_bytes = dataset.fetcher.counters.bytes - before  # type: ignore[attr-defined]
        assert len(rows) == 2 * n
    assert set(rows[0]) == {"id", "label"}  # the last loop's rows: picked's
    assert rows[121]["id"] == 2**60 + 1 and rows[121]["label"] == 1 and rows[7]["label"] is None
    assert picked.read_bytes < whole.read_bytes / 20  # type: ignore[attr-defined]
    # through workers: they share the chunks of two ranges in their scratch cache
    apart = RemoteDataset(
        Parquet(f"{root}/laion", columns=["label", "id"]), storage_options=options
    )
    loader = fastload.DataLoader(apart, batch_size=40, num_workers=2, collate_fn=list)
    ids = sorted(int(r["id"]) - 2**60 for batch in loader for r in batch)
    assert ids == sorted(list(range(n)) * 2)
    assert whole[3]["box"] == {"x": 3, "y": -3}

    # other columns: not the rows cached for ["id", "label"]
    more = RemoteDataset(
        Parquet(f"{root}/laion", columns=["label", "box"]), cache=cache, storage_options=options
    )
    # the columns cached: its rows come from the cache
    same = RemoteDataset(
        Parquet(f"{root}/laion", columns=["id", "label"]), cache=cache, storage_options=options
    )
    hits = cache.counters.hits
    assert set(more[5]) == {"label", "box"} and cache.counters.hits == hits
    assert set(same[5]) == {"id", "label"} and cache.counters.hits == hits + 1

    with pytest.raises(ShardError, match=r"no column 'caption' to read .*'image'.*part-0"):
        RemoteDataset(Parquet(f"{root}/laion", columns=["id", "caption"]), storage_options=options)
    with pytest.raises(ConfigError, match="columns names a column twice"):
        RemoteDataset(Parquet(f"{root}/laion", columns=["id", "id"]), storage_options=options)
    with pytest.raises(
        ConfigError, match=r"objects source does not take columns \(columns applies to .*parquet"
    ):
        source_named("objects", f"{root}/laion", columns=["id"])


def test_bad_parquet_is_named(gcs: FakeGcsServer) -> None:
    root = f"gs://{BUCKET}/bad-parquet-{uuid.uuid4().hex[:8]}"
    options = gcs.storage_options()
    body = parquet(events(0, 100))
    write(root, options, {"a.parquet": body, "b.parquet": body[:-20] + b"\0" * 16 + b"PAR1"})
    with pytest.raises(ShardError, match=r"b\.parquet"):
        RemoteDataset(Parquet(root), storage_options=options)
    write(root, options, {"b.parquet": b"PK\x03\x04 a zip, not parquet"})
    with pytest.raises(ShardError, match=r"not parquet.*b\.parquet"):
        RemoteDataset(Parquet(root), storage_options=options)
    dataset = RemoteDataset(Parquet(root), on_error="skip", storage_options=options)
    assert len(dataset) == 100


def test_parquet_files_whose_columns_differ_are_named_not_mixed(
    b2: B2Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Files of one dataset written at different times and by different tools: a later export
    added a column, another wrote an id as int32. Rows of both in one batch lost the added
    column without a word (collate keeps the first row's keys) or changed a column's dtype from
    batch to batch. Files whose columns and types are most files' are read; the odd one is an
    error naming it and the difference, or left out under on_error="skip". Strings
    dictionary-encoded (pandas, Spark) or large (polars) are the same strings."""
    root = f"b2://{BUCKET}/drift-{uuid.uuid4().hex[:8]}"
    options = b2.storage_options()

    def table(first: int, ids: str = "int64", names: str = "string") -> pa.Table:
        return pa.table(
            {
                "event_id": pa.array(range(first, first + 4), ids),
                "name": pa.array([f"ev{i}" for i in range(first, first + 4)], names),
            }
        )

    files = {
        "2024/part-0.parquet": parquet(table(0)),
        "2024/part-1.parquet": parquet(
            table(4).cast(
                pa.schema({"event_id": pa.int64(), "name": pa.dictionary(pa.int32(), pa.string())})
            )
        ),
        "2025/part-2.parquet": parquet(table(8, names="large_string")),
        "2025/part-3.parquet": parquet(table(12)),
        "2025/part-9.parquet": parquet(pa.table({"event_id": pa.array([], "null")})),  # empty
    }
    write(root, options, files)
    alike = RemoteDataset(Parquet(root), storage_options=options)
    assert [alike[i]["name"] for i in range(len(alike))] == [f"ev{i}" for i in range(16)]

    later = table(16).append_column("energy", pa.array([1.5] * 4, pa.float32()))
    write(root, options, {"2025/part-4.parquet": parquet(later)})
    with pytest.raises(ShardError, match=r"a column 'energy' they lack.*part-4\.parquet"):
        RemoteDataset(Parquet(root), storage_options=options)
    shared = RemoteDataset(Parquet(root, columns=["event_id"]), storage_options=options)
    assert sorted(int(shared[i]["event_id"]) for i in range(len(shared))) == list(range(20))

    write(root, options, {"2025/part-5.parquet": parquet(table(20, ids="int32"))})
    with pytest.raises(ShardError, match=r"'event_id' is int32 here, int64 there.*part-5"):
        RemoteDataset(Parquet(root, columns=["event_id"]), storage_options=options)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        skipped = RemoteDataset(Parquet(root), on_error="skip", storage_options=options)
    assert "part-4.parquet" in caplog.text and "part-5.parquet" in caplog.text
    left_out = skipped.stats()["dataset"]["left_out"]
    assert [("part-4" in why, "part-5" in why) for why in left_out] == [
        (True, False),
        (False, True),
    ]
    rows = [row for batch in fastload.DataLoader(skipped, batch_size=6) for row in batch["name"]]
    assert sorted(rows) == sorted(f"ev{i}" for i in range(16))  # the four alike files


def test_sampler_blocks_every_index_once_and_local() -> None:
    starts = np.cumsum([0, 300, 17, 1, 400, 250, 90])
    n = 1200
    for world in (1, 3):
        seen: list[int] = []
        for rank in range(world):
            sampler = PermutationSampler(n, blocks=starts, window=2, rank=rank, world_size=world)
            seen += sampler.indices()[: sampler.num_real_samples].tolist()
        assert sorted(seen) == list(range(n))
    sampler = PermutationSampler(n, blocks=starts, window=1)
    assert block_locality(sampler, 32)["blocks_per_batch"] < 1.3
    first = sampler.indices().tolist()
    sampler.set_epoch(1)
    assert sampler.indices().tolist() != first
    for bad in ([1, 5], [0, 5, 5], [0, n], []):
        with pytest.raises(ConfigError, match="blocks must be"):
            PermutationSampler(n, blocks=bad)
    with pytest.raises(ConfigError, match="not both"):
        PermutationSampler(n, blocks=starts, block_size=4)


def training_reads_only(cache: Path, root: str, options: dict[str, Any]) -> None:
    """A training dataset over ``root/train`` with the warmed ``cache`` reads every sample
    once, and all of it (the index and every sample) from the cache."""
    dataset = RemoteDataset(
        Tar(f"{root}/train"), cache=Cache(cache, format="npy"), storage_options=options
    )
    loader = fastload.DataLoader(dataset, batch_size=7, collate_fn=list)
    seen = [json.loads(item["meta.json"])["n"] for batch in loader for item in batch]
    assert sorted(seen) == list(range(SHARDS * PER_SHARD))
    assert dataset.fetcher.counters.requests == 0


def test_warm_cache_cli_splits_tar_shards_by_shard_then_training_reads_only_the_cache(
    seaweed: S3Server, tmp_path: Any
) -> None:
    """Machines warming parts of a tar dataset each index and read their own shards only,
    once (each indexed every shard, reading the whole dataset, to warm its part), and report
    every byte they read, the indexing's too (its cost estimate left them out)."""
    from tests.test_cli import fastload as cli
    from tests.test_cli import options_args

    root = f"s3://{BUCKET}/cli-shards-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    shard_bytes = sum(len(b) for k, b in tar_dataset(root, options).items() if k.endswith(".tar"))
    args = ["warm-cache", f"{root}/train", "--format", "npy", "--shards", "tar", "--json"]
    args += [*options_args(options)]
    for shared in (False, True):  # a cache of its own on each machine, then one they share
        fetched = 0
        for part in ("0/2", "1/2"):
            cache = tmp_path / ("shared" if shared else f"machine{part[0]}")
            done = cli(*args, "--cache-dir", str(cache), "--shard", part)
            assert done.returncode == 0, done.stderr
            summary = json.loads(done.stdout)
            assert summary["failures"] == {} and summary["samples"] == SHARDS * PER_SHARD // 2
            assert summary["requests"] > 0
            fetched += summary["bytes_fetched"]
        assert shard_bytes <= fetched <= shard_bytes * 1.05  # each shard read once in all
    training_reads_only(tmp_path / "shared", root, options)
    three = cli(*args, "--cache-dir", str(tmp_path / "three"), "--shard", "2/3")
    assert json.loads(three.stdout)["samples"] == PER_SHARD  # every third shard from 2: one
    bad = cli("warm-cache", root, "--cache-dir", str(tmp_path / "d"), "--shards", "zip")
    said = "--shards must be one of parquet, tar, zarr, got 'zip'"
    assert bad.returncode != 0 and said in bad.stderr
    # an option the named source does not take is refused, naming the source that takes it
    foreign = cli(*args, "--cache-dir", str(tmp_path / "e"), "--row-key", "event_id")
    assert foreign.returncode != 0
    said = r"the tar source does not take row_key \(row_key applies to .*parquet"
    assert re.search(said, foreign.stderr), foreign.stderr
    both = cli(*args, "--cache-dir", str(tmp_path / "e"), "--group-by", r"(.*)\.tar$")
    assert both.returncode != 0 and "--group-by groups objects; --shards reads" in both.stderr


def test_warm_cache_cli_reads_a_tar_dataset_larger_than_chunk_memory_once(
    seaweed: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards of small members are read whole to be indexed; warm-cache indexes and warms them
    a group at a time, each group small enough to keep what indexing read, so a dataset larger
    than the chunk memory is read once, not twice (indexed whole, then read again to warm)."""
    from tests.test_cli import fastload as cli
    from tests.test_cli import options_args

    root = f"s3://{BUCKET}/cli-groups-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    shard_bytes = [len(b) for k, b in tar_dataset(root, options).items() if k.endswith(".tar")]
    monkeypatch.setenv("FASTLOAD_CHUNK_MEMORY_BYTES", str(int(2.5 * max(shard_bytes))))
    args = ["warm-cache", f"{root}/train", "--format", "npy", "--shards", "tar", "--json"]
    done = cli(*args, "--cache-dir", str(tmp_path / "c"), *options_args(options))
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["failures"] == {} and summary["samples"] == SHARDS * PER_SHARD
    assert sum(shard_bytes) <= summary["bytes_fetched"] <= 1.05 * sum(shard_bytes)
    assert summary["requests"] == SHARDS  # one a shard: its index, and the samples it warmed
    again = cli(*args, "--cache-dir", str(tmp_path / "c"), *options_args(options))
    rerun = json.loads(again.stdout)
    assert rerun["hits"] == SHARDS * PER_SHARD and rerun["requests"] == 0
    training_reads_only(tmp_path / "c", root, options)


def padded(events: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """A collate_fn for runs of pulses: each column padded to the longest run."""
    longest = max(len(event["time"]) for event in events)
    return {
        name: torch.stack(
            [
                torch.nn.functional.pad(torch.as_tensor(e[name]), (0, longest - len(e[name])))
                for e in events
            ]
        )
        for name in events[0]
    }


def test_bench_diagnose_reads_tar_and_parquet_shards(seaweed: S3Server, tmp_path: Path) -> None:
    """`fastload bench --diagnose` takes the sample shapes' options as warm-cache does: it
    timed objects alone, so a dataset of shards could not be diagnosed (each shard a sample);
    and batches of raw tar members (lists of bytes) count their samples (they counted 0)."""
    from tests.test_cli import fastload as cli
    from tests.test_cli import options_args

    root = f"s3://{BUCKET}/bench-shards-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    tar_dataset(root, options)
    write(root, options, {"events/a.parquet": parquet(pulses(0, 40))})
    pad = "tests.test_shards:padded"
    args = ["--batch-size", "8", "--steps", "3", "--workers", "0", "--step-ms", "200", "--json"]
    args += [*options_args(options)]
    for source, shape in (
        (f"{root}/train/shard-{{000..003}}.tar", ["--shards", "tar"]),
        (f"{root}/events", ["--shards", "parquet", "--columns", "event_id,time"]),
        (f"{root}/events", ["--shards", "parquet", "--row-key", "event_id"]),  # ragged:
        # collated by the user's function, as the 900K-event user pads pulses
        (f"{root}/events", ["--shards", "parquet", "--row-key", "event_id", "--collate", pad]),
    ):
        done = cli("bench", "--diagnose", source, *args, *shape, "-c", str(tmp_path / "c"))
        if shape[-1] == "event_id":  # ragged runs, no collate: a ConfigError names the fix
            assert done.returncode == 2, done.stderr
            assert "collate_fn" in done.stderr and "Ragged samples" in done.stderr
            continue
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["bound"] == "compute", result
        assert result["loader_samples_per_s"] == pytest.approx(8 * result["loader_batches_per_s"])
    wrong = cli("bench", "--diagnose", f"{root}/train", *args, "--shards", "zip")
    said = "--shards must be one of parquet, tar, zarr, got 'zip'"
    assert wrong.returncode == 2 and said in wrong.stderr


def test_tar_warm_rounds_keep_each_shard_whole_in_memory_and_a_short_last_shard_in_company() -> (
    None
):
    sizes = {"README.md": 5, "old.tar.gz": 3, **{f"s{i:02d}.tar": 10 for i in range(6)}}
    sizes["s06.tar"] = 1
    keys = sorted(sizes)
    listing = Manifest("file:///data", keys, [sizes[k] for k in keys], ["v"] * len(keys))
    groups = [g.keys() for g in Tar(listing).warm_rounds(listing, 30)]
    assert groups == [
        ["README.md", "old.tar.gz", "s00.tar"],  # what is not a tar shard: the first group
        ["s01.tar", "s02.tar", "s03.tar"],  # 3 x 10 bytes: each shard its share of 30, whole
        ["s04.tar", "s05.tar", "s06.tar"],  # the last shard (1 byte) is not a group alone
    ]
    assert [g.keys() for g in Tar(listing).warm_rounds(listing, 10**9)] == [keys]


def pulses(first: int, count: int) -> pa.Table:
    """IceCube-like pulses: one row per pulse, an event's pulses in consecutive rows."""
    ids = np.repeat(
        np.arange(first, first + count), [3 + e % 4 for e in range(first, first + count)]
    )
    return pa.table(
        {
            "event_id": ids,
            "time": np.arange(len(ids), dtype=np.float32),
            "sensor_id": (ids * 7 % 5160).astype(np.int16),
        }
    )


def test_parquet_runs_of_a_key_column_are_samples(b2: B2Server) -> None:
    root = f"b2://{BUCKET}/pulses-{uuid.uuid4().hex[:8]}"
    options = b2.storage_options()
    write(root, options, batches(pulses, 2, 100, 64, folder=""))  # events span row groups
    dataset = RemoteDataset(Parquet(root, row_key="event_id"), storage_options=options)
    assert len(dataset) == 200
    event = dataset[150]
    assert set(event["event_id"].tolist()) == {150} and len(event["time"]) == 3 + 150 % 4
    assert event["sensor_id"].dtype == np.int16
    assert dataset.source[150].url.endswith("batch_1.parquet#event_id=150")
    assert_identities(dataset, [150, 0, 63, 64, 199])
    loader = fastload.DataLoader(dataset, batch_size=16, shuffle=True, collate_fn=list)
    seen = [int(e["event_id"][0]) for batch in loader for e in batch]
    assert sorted(seen) == list(range(200))
    assert all(len(e["time"]) == 3 + int(e["event_id"][0]) % 4 for batch in loader for e in batch)

    unsorted = parquet(pa.table({"event_id": [1, 1, 2, 2, 1], "time": [0.0] * 5}))
    write(root, options, {"batch_9.parquet": unsorted})  # not sorted by event_id
    with pytest.raises(ShardError, match=r"event_id=1 has rows at 0 and again at 4.*batch_9"):
        RemoteDataset(Parquet(root, row_key="event_id"), storage_options=options)
    with pytest.raises(ShardError, match=r"row_key 'evt' is not a column .*'event_id'"):
        RemoteDataset(Parquet(root, row_key="evt"), storage_options=options)
    with pytest.raises(
        ConfigError, match=r"tar source does not take row_key \(row_key applies to .*parquet"
    ):
        source_named("tar", root, row_key="event_id")


def test_a_run_cut_between_two_files_is_an_error_not_two_half_samples(
    seaweed: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """pyarrow's ``write_dataset(max_rows_per_file=...)`` starts a new file every N rows, so it
    cuts events in two: each half was a sample of its own, silently."""
    import pyarrow.dataset as pads

    table = pulses(0, 60)  # 3-6 pulses an event: files of 70 rows cut some events
    pads.write_dataset(
        table, tmp_path / "out", format="parquet", max_rows_per_file=70, max_rows_per_group=35
    )
    files = sorted((tmp_path / "out").iterdir())
    root = f"s3://{BUCKET}/cut-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    write(root, options, {f"events/{f.name}": f.read_bytes() for f in files})
    ids = table.column("event_id").to_numpy()
    ends = np.cumsum([pq.read_metadata(f).num_rows for f in files])[:-1]
    cut = sorted({int(ids[e]) for e in ends if ids[e - 1] == ids[e]})
    assert cut, "the writer cut no event: the test proves nothing"
    first_cut = f"event_id={cut[0]} ends {root}/events/{files[0].name} and starts"
    with pytest.raises(ShardError, match=first_cut):
        RemoteDataset(Parquet(f"{root}/events", row_key="event_id"), storage_options=options)

    with caplog.at_level(logging.WARNING, logger="fastload"):
        dataset = RemoteDataset(
            Parquet(f"{root}/events", row_key="event_id"), on_error="skip", storage_options=options
        )
    assert first_cut in caplog.text
    whole = [e for e in range(60) if e not in cut]
    assert len(dataset) == len(whole)
    loader = fastload.DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=list)
    got = {int(e["event_id"][0]): len(e["time"]) for batch in loader for e in batch}
    assert sorted(got) == whole
    assert all(got[e] == 3 + e % 4 for e in whole)  # every event whole
    event = dataset[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(event["time"]).add_(1)
    assert np.array_equal(dataset[0]["time"], table.column("time").to_numpy()[: len(event["time"])])

    # a row group holding only a cut event's rows: left out, its chunk too
    head = pa.table({"event_id": [1, 1, 2, 2], "t": [0.0, 1.0, 2.0, 3.0]})
    tail = pa.table({"event_id": [2, 3, 3], "t": [4.0, 5.0, 6.0]})
    write(
        root,
        options,
        {"small/a.parquet": parquet(head), "small/b.parquet": parquet(tail, row_group_size=1)},
    )
    small = RemoteDataset(
        Parquet(f"{root}/small", row_key="event_id"), on_error="skip", storage_options=options
    )
    assert [list(small[i]["t"]) for i in range(len(small))] == [[0.0, 1.0], [5.0, 6.0]]
    assert len(list(fastload.DataLoader(small, batch_size=1, shuffle=True, collate_fn=list))) == 2

    # event numbers that restart in each file are other events, not cut ones
    write(root, options, {f"runs/run{r}.parquet": parquet(pulses(0, 5)) for r in range(3)})
    runs = RemoteDataset(Parquet(f"{root}/runs", row_key="event_id"), storage_options=options)
    assert [int(runs[i]["event_id"][0]) for i in range(len(runs))] == [0, 1, 2, 3, 4] * 3


def test_warm_cache_cli_caches_parquet_runs_as_training_names_them(
    seaweed: S3Server, tmp_path: Any
) -> None:
    """`warm-cache --shards parquet --row-key event_id` caches the samples a training dataset
    with row_key="event_id" reads: without --row-key the CLI cached rows, which training never
    asks for."""
    from tests.test_cli import fastload as cli
    from tests.test_cli import options_args

    root = f"s3://{BUCKET}/cli-runs-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    write(root, options, batches(pulses, 2, 50, 64))
    cache_dir = str(tmp_path / "c")
    done = cli(
        "warm-cache", f"{root}/events", "--cache-dir", cache_dir, "--shards", "parquet",
        "--row-key", "event_id", "--json", *options_args(options),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["samples"] == 100
    events = RemoteDataset(
        Parquet(f"{root}/events", row_key="event_id"),
        cache=Cache(cache_dir),
        storage_options=options,
    )
    assert sorted(int(events[i]["event_id"][0]) for i in range(len(events))) == list(range(100))
    assert events.fetcher.counters.requests == 0  # the indexes and every event: from the cache


def test_warm_cache_cli_leaves_out_parquet_files_whose_columns_differ_when_told(
    seaweed: S3Server, tmp_path: Any
) -> None:
    """A parquet file whose columns are not the others' stops `warm-cache`, naming it, as it
    stops a training dataset; `--on-error skip` warms the rest and names it in a warning, as
    RemoteDataset(on_error="skip") trains on the rest."""
    from tests.test_cli import fastload as cli
    from tests.test_cli import options_args

    root = f"s3://{BUCKET}/cli-drift-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    odd = events(100, 50).cast(
        pa.schema({"event_id": pa.int32(), "pulses": pa.list_(pa.float32()), "name": pa.string()})
    )
    write(root, options, {**batches(events, 2, 50, 25), "events/batch_9.parquet": parquet(odd)})
    cache_dir = str(tmp_path / "c")
    args = ("warm-cache", f"{root}/events", "--cache-dir", cache_dir, "--shards", "parquet")
    stopped = cli(*args, *options_args(options))
    assert stopped.returncode != 0
    assert "'event_id' is int32 here, int64 there" in stopped.stderr
    assert "batch_9.parquet" in stopped.stderr
    done = cli(*args, "--on-error", "skip", "--json", *options_args(options), real=True)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["samples"] == 100 and "batch_9.parquet" in done.stderr
    (left_out,) = summary["left_out"]  # in the summary too, not only in a warning
    assert "batch_9.parquet" in left_out and "int32 here" in left_out
    bad = cli(*args, "--on-error", "ignore", *options_args(options))
    assert bad.returncode != 0 and "--on-error must be raise or skip" in bad.stderr
    mine = cli("warm-cache", "--dataset", "tests.cli_helpers:double", "--on-error", "skip")
    assert mine.returncode != 0 and "so --on-error would be ignored" in mine.stderr


def test_a_saved_manifest_carries_the_shard_indexes_to_another_host(
    store: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    root, options = store
    tar_dataset(root, options)
    write(root, options, batches(pulses, 2, 50, 64))

    def made(source: Source, **kwargs: Any) -> tuple[RemoteDataset, int]:
        """A dataset (no cache) and the requests its construction sent."""
        dataset = RemoteDataset(source, storage_options=options, **kwargs)
        return dataset, dataset.fetcher.counters.requests

    first, indexing = made(Tar(f"{root}/train"), decode=DECODE)
    assert indexing >= SHARDS
    first.manifest.save(tmp_path / "train.npz")
    # another host: the saved manifest, no cache, no shard read to index it
    other, requests = made(Tar(Manifest.load(tmp_path / "train.npz")), decode=DECODE)
    assert requests == 0 and len(other) == len(first) == SHARDS * PER_SHARD
    assert np.array_equal(other.blocks, first.blocks)  # type: ignore[arg-type]
    for i in (0, 37, 99):
        assert other[i]["meta.json"] == {"n": i} and np.array_equal(other[i]["npy"], image(i))

    # with manifest_path, the listing is saved with the indexes: a restart reads no shard
    kept = tmp_path / "kept.npz"
    assert made(Tar(f"{root}/train", manifest_path=kept))[1] >= SHARDS
    assert made(Tar(f"{root}/train", manifest_path=kept))[1] == 0

    # a shard rewritten since: only it is indexed again, and its new samples are read
    write(root, options, {"train/shard-001.tar": tar_shard(500, PER_SHARD)})
    listed = Manifest.build(f"{root}/train", storage_options=options)
    saved = Manifest.load(tmp_path / "train.npz").kept["shards"]
    again, requests = made(Tar(listed.keeping("shards", saved)), decode=DECODE)
    assert 0 < requests < indexing
    assert again[PER_SHARD]["meta.json"] == {"n": 500} and again[0]["meta.json"] == {"n": 0}

    # parquet runs: indexes of runs of event_id serve only runs of event_id
    runs, requests = made(Parquet(f"{root}/events", row_key="event_id"))
    runs.manifest.save(tmp_path / "events.npz")
    again, requests = made(Parquet(Manifest.load(tmp_path / "events.npz"), row_key="event_id"))
    assert requests == 0 and len(again) == 100
    assert set(again[70]["event_id"].tolist()) == {70}
    rows, requests = made(Parquet(Manifest.load(tmp_path / "events.npz")))
    assert requests > 0 and len(rows) == sum(3 + e % 4 for e in range(100))


def test_ranks_read_each_chunk_once_between_them(seaweed: S3Server, tmp_path: Path) -> None:
    root = f"s3://{BUCKET}/ranks-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    tar_dataset(root, options)
    chunks = ChunkConfig(chunk_bytes=150_000)  # a few chunks per shard
    made = RemoteDataset(Tar(f"{root}/train", chunks=chunks), storage_options=options)
    made.manifest.save(tmp_path / "m.npz")  # the ranks index nothing: every read is a chunk
    assert made.blocks is not None
    world, seen, reads = 2, [], 0
    for rank in range(world):
        dataset = RemoteDataset(
            Tar(Manifest.load(tmp_path / "m.npz"), chunks=chunks),
            decode=DECODE,
            storage_options=options,
        )
        sampler = PermutationSampler(
            len(dataset), blocks=dataset.blocks, rank=rank, world_size=world, window=2
        )
        loader = fastload.DataLoader(
            dataset, batch_size=10, sampler=sampler, collate_fn=list, lookahead=0
        )
        seen += [item["meta.json"]["n"] for batch in loader for item in batch]
        reads += dataset.fetcher.counters.requests
    assert sorted(seen) == list(range(SHARDS * PER_SHARD))
    # each chunk by one rank, two where a share ends inside a window (striding: every rank)
    assert len(made.blocks) <= reads <= len(made.blocks) + 2 * (world - 1)


def test_indexing_hops_over_large_members_and_reads_small_ones_in_stride(
    moto: S3Server,
) -> None:
    root = f"s3://{BUCKET}/hops-{uuid.uuid4().hex[:8]}"
    options = moto.storage_options()
    large = io.BytesIO()
    with tarfile.open(fileobj=large, mode="w") as tar:
        for n in range(6):  # 4 MB videos: the headers are 512 bytes of 24 MB
            body = bytes([n]) * (4 << 20)
            info = tarfile.TarInfo(f"clip-{n}.mp4")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    medium = io.BytesIO()  # 40 members of 100 KB: 4 MB, one window at once (3 as they grew)
    with tarfile.open(fileobj=medium, mode="w") as tar:
        for n in range(40):
            info = tarfile.TarInfo(f"{n:03d}.bin")
            info.size = 100_000
            tar.addfile(info, io.BytesIO(bytes([n]) * info.size))
    shards = {"large.tar": large.getvalue(), "small.tar": tar_shard(0, 40)}
    write(root, options, {**shards, "medium.tar": medium.getvalue()})
    for name, most_requests, most_bytes, samples in (
        ("large", 8, 2 << 20, 6),
        ("small", 1, 4 << 20, 40),
        ("medium", 1, len(medium.getvalue()), 40),
    ):
        dataset = RemoteDataset(
            Tar(
                fastload.Manifest.build(root, storage_options=options).filter(pattern=f"{name}.tar")
            ),
            storage_options=options,
        )
        stats = dataset.fetcher.counters
        assert stats.requests <= most_requests and stats.bytes <= most_bytes, (name, stats)
        assert len(dataset) == samples


def test_a_cold_epoch_over_small_members_reads_each_byte_once(seaweed: S3Server) -> None:
    """Indexing reads a shard of small members whole; those bytes are the chunks' (#18)."""
    root = f"s3://{BUCKET}/once-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    objects = tar_dataset(root, options)
    shard_bytes = sum(len(body) for key, body in objects.items() if key.endswith(".tar"))
    dataset = RemoteDataset(Tar(f"{root}/train"), decode=DECODE, storage_options=options)
    loader = fastload.DataLoader(dataset, batch_size=8, shuffle=True, collate_fn=list)
    seen = sorted(item["meta.json"]["n"] for batch in loader for item in batch)
    assert seen == list(range(len(dataset)))
    assert dataset.source.reader.seeded == len(dataset.blocks)  # type: ignore[attr-defined]
    assert dataset.fetcher.counters.bytes <= shard_bytes * 1.05  # not twice
    # no memory to spare: indexing keeps nothing, chunks are read
    tight = RemoteDataset(
        Tar(f"{root}/train", chunks=ChunkConfig(memory_bytes=1000)),
        decode=DECODE,
        storage_options=options,
    )
    assert tight.source.reader.seeded == 0  # type: ignore[attr-defined]
    assert tight[17]["meta.json"] == {"n": 17}


def test_an_order_that_reads_a_chunk_per_sample_is_named_once(
    seaweed: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """torch's own DataLoader(shuffle=True) over shards larger than chunk memory reads a chunk
    for nearly every sample: here 145 chunk reads in two epochs against 32 (3.4 times the
    bytes, the index pass included), and nothing said so. Now one warning names the cause and
    the fixes; a shard-aware epoch over the same dataset and memory says nothing."""
    root = f"s3://{BUCKET}/thrash-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    tar_dataset(root, options)
    small = ChunkConfig(chunk_bytes=100_000, memory_bytes=250_000)  # ~8 samples a chunk, 2 kept

    def made() -> RemoteDataset:
        return RemoteDataset(
            Tar(f"{root}/train", chunks=small), decode=DECODE, storage_options=options
        )

    aware = made()
    assert aware.blocks is not None and len(aware.blocks) >= 12
    with caplog.at_level(logging.WARNING, logger="fastload"):
        # lookahead=0: with 2 chunks of 8 samples kept, the lookahead's 5 batches in flight
        # span more chunks than memory holds (the defaults keep 8 chunks of 64 MB)
        loader = fastload.DataLoader(
            aware, batch_size=8, shuffle=True, collate_fn=list, lookahead=0
        )
        for _ in range(2):  # the second epoch reads every chunk again, each once: no warning
            seen = sorted(item["meta.json"]["n"] for batch in loader for item in batch)
            assert seen == list(range(len(aware)))
    assert "read a chunk again" not in caplog.text
    aware_bytes = aware.fetcher.counters.bytes

    randomly = made()
    loader = torch.utils.data.DataLoader(randomly, batch_size=8, shuffle=True, collate_fn=list)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        for _ in range(2):
            seen = sorted(item["meta.json"]["n"] for batch in loader for item in batch)
            assert seen == list(range(len(randomly)))
    assert randomly.fetcher.counters.bytes > 3 * aware_bytes
    warned = [r.getMessage() for r in caplog.records if "read a chunk again" in r.getMessage()]
    assert len(warned) == 1, warned
    assert f"{root}/train" in warned[0] and "blocks=dataset.blocks" in warned[0]
    assert aware.counters.fetch.chunks_read_early == 0
    assert randomly.counters.fetch.chunks_read_early >= 32

    # the stall report names the cause too (a fastload.DataLoader given torch's sampler)
    again = made()
    sampler = torch.utils.data.RandomSampler(again)
    # lookahead=0: batches read one at a time, as a chunk-per-sample order thrashes at its
    # worst (the lookahead's 4 batches in flight share some chunk reads between them)
    loader = fastload.DataLoader(again, batch_size=8, sampler=sampler, collate_fn=list, lookahead=0)
    for _ in range(2):
        assert sum(len(batch) for batch in loader) == len(again)
    report = loader.report("all")
    assert report.cause is not None and report.cause.startswith("shard chunks read again"), report
    assert report.samples == 2 * len(again)  # lists of dict samples: not their arrays' rows


def test_a_rewritten_shard_on_a_store_that_names_no_version_fails_its_header_check() -> None:
    """memory:// serves no version, so the tar header check is what catches a rewrite."""
    root = f"memory://rewritten-{uuid.uuid4().hex[:8]}"
    good = tar_shard(0, 10)
    write(root, {}, {"a.tar": good})
    no_room = ChunkConfig(memory_bytes=1000)  # nothing kept from indexing: reads go to the store
    dataset = RemoteDataset(Tar(root, chunks=no_room))
    write(root, {}, {"a.tar": good[:512] + tar_shard(1, 10)[512 : len(good)]})
    with pytest.raises(ShardError, match=r"'class.0/img-00003'.*a\.tar.*changed since it"):
        dataset[3]


def test_workers_read_chunks_themselves_when_the_scratch_cache_cannot_be_written(
    seaweed: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """The scratch cache the workers share is an optimisation: when it cannot be written (here
    a file stands where its folder was; a full /dev/shm in a container is the real case),
    every sample still arrives once and each process says why it reads chunks itself."""
    root = f"s3://{BUCKET}/shards-noscratch-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    tar_dataset(root, options)
    dataset = npy_images(root, options)
    scratch: Path = dataset.source.reader.shared.root  # type: ignore[attr-defined]
    shutil.rmtree(scratch)
    scratch.write_text("in the way")
    try:
        with caplog.at_level(logging.WARNING):
            loader = fastload.DataLoader(dataset, batch_size=5, shuffle=True, num_workers=2)
            values = image_numbers(loader)
    finally:
        scratch.unlink()
    assert values == list(range(SHARDS * PER_SHARD))
    assert "reads chunks itself, not through the scratch cache" in caplog.text  # the seeds


def test_the_scratch_cache_is_in_memory_only_where_it_fits() -> None:
    assert _in_memory(1, "/dev/shm") == ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    assert _in_memory(1 << 62, "/dev/shm") is None  # no room: the temporary folder
    assert _in_memory(1, "/no/such/folder") is None


def test_a_scratch_cache_left_by_a_killed_process_is_removed_by_the_next(tmp_path: Path) -> None:
    """A job scheduler stops training with SIGTERM, which runs no exit handler: the scratch
    cache (in /dev/shm: memory) of the killed process stays. The next process that makes one
    removes it; one whose process still lives stays."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.tar").write_bytes(tar_shard(0, 3))
    script = (
        "import sys, time\n"
        "from fastload import RemoteDataset, Tar\n"
        f"dataset = RemoteDataset(Tar('file://{shards}'))\n"
        "print(dataset.source.reader.shared.root.parent, flush=True)\n"
        "time.sleep(120)\n"
    )
    killed = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    living = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert killed.stdout is not None and living.stdout is not None
    left, kept = Path(killed.stdout.readline().strip()), Path(living.stdout.readline().strip())
    try:
        killed.terminate()
        killed.wait(timeout=30)
        assert left.is_dir() and kept.is_dir()  # SIGTERM: no clean-up ran
        dataset = RemoteDataset(Tar(f"file://{shards}"))
        assert not left.exists() and kept.is_dir()
        assert dataset.source.reader.shared.root.is_dir()  # type: ignore[attr-defined]
    finally:
        for process in (killed, living):
            process.kill()
            process.wait(timeout=30)
            if process.stdout is not None:
                process.stdout.close()
        shutil.rmtree(kept, ignore_errors=True)  # killed too: not to wait for the next sweep


def test_parquet_nulls_stay_nulls_and_values_stay_exact(gcs: FakeGcsServer, tmp_path: Path) -> None:
    """Real tables have nulls: in an id column (ids above 2**53, as hashed ids are), in a
    dictionary-encoded category column (how pandas and Spark write repeated strings), in a
    sensor column of an event's pulses. pyarrow's to_numpy gave a null category another row's
    value and rounded every id of a row group with a null id (in a column, in a list column's
    items, in a struct's field)."""
    root = f"gs://{BUCKET}/nulls-{uuid.uuid4().hex[:8]}"
    options = gcs.storage_options()
    big = 2**53 + 1
    table = pa.table(
        {
            "event_id": pa.array([1, 1, 2, 2, 2, 3], pa.int64()),
            "hit_id": pa.array([big, None, big + 2, big + 3, None, big + 5], pa.int64()),
            "detector": pa.array(["ecal", "hcal", None, "ecal", "hcal", None]).dictionary_encode(),
            "energy": pa.array([1.5, None, 2.5, 3.5, 4.5, 5.5], pa.float32()),
            "channels": pa.array([[big, None], [7], [], None, [8, 9], [big]], pa.list_(pa.int64())),
            "origin": pa.array(
                [{"run": big}, {"run": None}, None, {"run": 4}, {"run": 5}, {"run": 6}]
            ),
        }
    )
    write(root, options, {"events/part-0.parquet": parquet(table)})

    rows = RemoteDataset(Parquet(f"{root}/events"), storage_options=options)
    got = [rows[i] for i in range(len(rows))]
    assert [r["hit_id"] for r in got] == [big, None, big + 2, big + 3, None, big + 5]
    assert all(isinstance(r["hit_id"], np.int64) for r in got if r["hit_id"] is not None)
    assert [r["detector"] for r in got] == ["ecal", "hcal", None, "ecal", "hcal", None]
    assert np.isnan(got[1]["energy"]) and got[0]["energy"] == np.float32(1.5)
    for workers in (0, 1):  # torch's collate refuses a None; the note says where they are
        loader = fastload.DataLoader(rows, batch_size=6, num_workers=workers, shuffle=False)
        with pytest.raises(RuntimeError) as failed:
            next(iter(loader))
        said = str(failed.value) + "".join(getattr(failed.value, "__notes__", []))
        assert "'hit_id' in 2 of 6" in said and "a null in a parquet column" in said
    assert [None if r["channels"] is None else list(r["channels"]) for r in got] == [
        [big, None],
        [7],
        [],
        None,
        [8, 9],
        [big],
    ]
    assert [r["origin"] for r in got[:3]] == [{"run": big}, {"run": None}, None]

    events = RemoteDataset(Parquet(f"{root}/events", row_key="event_id"), storage_options=options)
    second = events[1]  # event 2: three pulses, one without a hit id
    assert list(second["hit_id"]) == [big + 2, big + 3, None]
    assert list(second["detector"]) == [None, "ecal", "hcal"]
    for _ in range(2):  # cached, then read from the cache: the same values (it refused them)
        cache = Cache(tmp_path / "c", format="npy")
        cached = RemoteDataset(
            Parquet(f"{root}/events", row_key="event_id"), cache=cache, storage_options=options
        )
        again = cached[1]
        assert list(again["hit_id"]) == [big + 2, big + 3, None]
        assert [type(v) for v in again["hit_id"]] == [np.int64, np.int64, type(None)]
    assert cache.counters.hits >= 1

    keyed = pa.table(
        {"run": pa.array(["r1", "r1", None, "r2"]).dictionary_encode(), "t": [0.0] * 4}
    )
    # a row with no run: it was read as another run's row
    write(root, options, {"runs/part-0.parquet": parquet(keyed)})
    with pytest.raises(ShardError, match=r"row_key 'run' is null in 1 rows.*part-0\.parquet"):
        RemoteDataset(Parquet(f"{root}/runs", row_key="run"), storage_options=options)
