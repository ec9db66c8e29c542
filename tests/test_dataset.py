"""RemoteDataset and CachedDataset against real loopback stores, torch's DataLoader, the cache."""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import tracemalloc
import uuid
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fastload import (
    Cache,
    CachedDataset,
    ConfigError,
    DecodeError,
    Labels,
    Manifest,
    ObjectNotFoundError,
    Objects,
    Parquet,
    RemoteDataset,
    Tar,
    UnsupportedSampleError,
    versioned,
)
from fastload.sources.registry import source_named
from fastload.stores import filesystem
from fastload.testing import B2Server, FakeGcsServer, S3Server
from tests.conftest import BUCKET, assert_identities, write


def npy(value: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, value)
    return out.getvalue()


def upload(
    url_root: str, options: dict[str, Any], n: int, *, shape: tuple[int, ...] = (4, 5)
) -> str:
    fs = filesystem(url_root, options)
    base = url_root.split("://", 1)[1].rstrip("/")
    fs.pipe({f"{base}/{i:04d}.npy": npy(np.full(shape, i, np.float32)) for i in range(n)})
    return url_root


@pytest.fixture
def s3_root(seaweed: S3Server) -> tuple[str, dict[str, Any]]:
    options = seaweed.storage_options()
    return upload(f"s3://{BUCKET}/ds-{uuid.uuid4().hex[:8]}", options, 40), options


def value_of(item: Any) -> int:
    sample = item[0] if isinstance(item, tuple) else item
    return int(np.asarray(sample).flat[0])


def test_a_dataloader_epoch_over_s3_fetches_each_batch_concurrently(
    s3_root: tuple[str, dict[str, Any]],
) -> None:
    root, options = s3_root
    dataset = RemoteDataset(root, decode="npy", storage_options=options)
    loader = DataLoader(
        dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    seen = [int(v) for batch in loader for v in batch[:, 0, 0]]
    assert sorted(seen) == list(range(40))
    stats = dataset.stats()
    assert stats["fetch"]["objects"] == 40 and stats["dataset"]["samples"] == 40
    assert stats["fetch"]["requests"] == 40  # one GET per object, five batched calls


@pytest.mark.parametrize("store", ["gcs", "b2"])
def test_gcs_and_b2_sources(store: str, gcs: FakeGcsServer, b2: B2Server) -> None:
    server = gcs if store == "gcs" else b2
    scheme = "gs" if store == "gcs" else "b2"
    options = server.storage_options()
    root = upload(f"{scheme}://{BUCKET}/ds-{uuid.uuid4().hex[:8]}", options, 12)
    dataset = RemoteDataset(root, decode="npy", storage_options=options)
    assert sorted(value_of(dataset[i]) for i in range(len(dataset))) == list(range(12))


def test_a_warm_epoch_reads_only_the_cache(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Any
) -> None:
    root, options = s3_root
    cache = Cache(tmp_path, format="npy")
    dataset = RemoteDataset(root, decode="npy", cache=cache, storage_options=options)
    loader = DataLoader(dataset, batch_size=8, num_workers=2)
    first = torch.cat([b for b in loader])
    assert len(cache) == 40
    dataset.fetcher.counters.requests = 0
    second = torch.cat([b for b in DataLoader(dataset, batch_size=8)])
    assert torch.equal(first, second)
    assert dataset.stats()["fetch"]["requests"] == 0 and cache.counters.hits == 40


def test_changing_the_transform_invalidates_and_changing_it_back_hits(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Any
) -> None:
    root, options = s3_root
    manifest = Manifest.build(root, storage_options=options)
    cache = Cache(tmp_path, format="pt")

    @versioned(1)
    def double(x: np.ndarray) -> np.ndarray:
        return x * 2

    @versioned(1)
    def triple(x: np.ndarray) -> np.ndarray:
        return x * 3

    for transform, factor, misses in [(double, 2, 40), (triple, 3, 40), (double, 2, 0)]:
        dataset = RemoteDataset(
            manifest, decode="npy", transform=transform, cache=cache, storage_options=options
        )
        before = cache.counters.misses
        assert [value_of(dataset[i]) for i in range(40)] == [i * factor for i in range(40)]
        assert cache.counters.misses - before == misses


def test_an_object_changed_remotely_is_fetched_again_after_refresh(
    seaweed: S3Server, tmp_path: Any
) -> None:
    options = seaweed.storage_options()
    root = upload(f"s3://{BUCKET}/chg-{uuid.uuid4().hex[:8]}", options, 3)
    cache = Cache(tmp_path, format="npy")
    manifest = Manifest.build(root, storage_options=options)
    assert (
        value_of(RemoteDataset(manifest, decode="npy", cache=cache, storage_options=options)[1])
        == 1
    )
    filesystem(root, options).pipe(
        f"{root.split('://')[1]}/0001.npy", npy(np.full((4, 5), 99, np.float32))
    )
    refreshed = manifest.refresh(storage_options=options)
    assert refreshed.changed == 1
    fresh = RemoteDataset(refreshed.manifest, decode="npy", cache=cache, storage_options=options)
    assert value_of(fresh[1]) == 99


def test_skip_keeps_batches_whole_and_names_each_bad_key_once(
    seaweed: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    options = seaweed.storage_options()
    root = upload(f"s3://{BUCKET}/bad-{uuid.uuid4().hex[:8]}", options, 6)
    fs, base = filesystem(root, options), root.split("://")[1]
    fs.pipe({f"{base}/0002.npy": b"not an array", f"{base}/0004.npy": b""})
    manifest = Manifest.build(root, storage_options=options)
    fs.rm(f"{base}/0005.npy")  # deleted between listing and reading
    dataset = RemoteDataset(manifest, decode="npy", on_error="skip", storage_options=options)
    caplog.set_level(logging.WARNING, logger="fastload.dataset")
    for _ in range(2):
        batch = next(iter(DataLoader(dataset, batch_size=6)))
        assert batch.shape == (6, 4, 5)
        assert set(batch[:, 0, 0].tolist()) <= {0.0, 1.0, 3.0}
    stats = dataset.stats()["dataset"]
    assert stats["skipped"] == 6 and len(stats["skipped_keys"]) == 3
    assert {k.rsplit("/", 1)[1] for k in stats["skipped_keys"]} == {
        "0002.npy",
        "0004.npy",
        "0005.npy",
    }
    assert len([r for r in caplog.records if "skipping" in r.message]) == 3  # once per key


def test_raise_names_the_object_and_its_type_of_failure(seaweed: S3Server) -> None:
    options = seaweed.storage_options()
    root = upload(f"s3://{BUCKET}/raise-{uuid.uuid4().hex[:8]}", options, 2)
    fs, base = filesystem(root, options), root.split("://")[1]
    fs.pipe(f"{base}/0001.npy", b"garbage")
    manifest = Manifest.build(root, storage_options=options)
    dataset = RemoteDataset(manifest, decode="npy", storage_options=options)
    with pytest.raises(DecodeError, match=r"cannot decode.*ValueError.*0001\.npy") as info:
        dataset[1]
    assert info.value.url.endswith("0001.npy")
    fs.rm(f"{base}/0000.npy")
    with pytest.raises(ObjectNotFoundError, match=r"0000\.npy"):
        dataset[0]


@pytest.mark.parametrize("fmt", ["npy", "zarr"])
def test_a_sample_the_cache_cannot_hold_is_named_and_keeps_its_batch_cached(
    seaweed: S3Server, tmp_path: Path, fmt: str
) -> None:
    """One object decodes to a structured array (a record per row), which no cache format
    holds. It was an UnsupportedSampleError naming no object, under on_error="skip" too, and
    no sample of its batch was cached. Now its error names it, skip leaves it out by name, and
    the rest of its batch is cached; warm-cache reports it by URL."""
    options = seaweed.storage_options()
    root = upload(f"s3://{BUCKET}/records-{uuid.uuid4().hex[:8]}", options, 6)
    records = np.array([(1, 2.0), (3, 4.0)], dtype=[("id", "<i4"), ("x", "<f8")])
    filesystem(root, options).pipe(f"{root.split('://')[1]}/0003.npy", npy(records))
    manifest = Manifest.build(root, storage_options=options)

    def dataset(on_error: str) -> RemoteDataset:
        cache = Cache(tmp_path / on_error, format=fmt)  # type: ignore[arg-type]
        return RemoteDataset(
            manifest, decode="npy", cache=cache, on_error=on_error, storage_options=options
        )

    raising = dataset("raise")
    with pytest.raises(UnsupportedSampleError, match=r"structured array.*not cached: s3://.*0003"):
        list(DataLoader(raising, batch_size=6, collate_fn=list))
    assert raising.stats()["cache"]["writes"] == 5  # the other five of its batch
    assert [value_of(raising[i]) for i in (0, 5)] == [0, 5]
    assert raising.stats()["cache"]["hits"] == 2

    skipping = dataset("skip")
    for _ in range(2):
        (batch,) = list(DataLoader(skipping, batch_size=6, collate_fn=list))
        assert len(batch) == 6 and all(item.dtype == np.float32 for item in batch)
    stats = skipping.stats()
    assert stats["dataset"]["skipped"] == 2
    assert stats["dataset"]["skipped_keys"] == [f"{root}/0003.npy"]  # by URL, as other failures
    assert stats["cache"]["writes"] == 5 and stats["cache"]["hits"] == 5  # the second epoch
    failures = skipping.warm(range(6))
    assert [(url.rsplit("/", 1)[1], type(error)) for url, error in failures] == [
        ("0003.npy", UnsupportedSampleError)
    ]


def test_errors_inside_dataloader_workers_name_the_object(seaweed: S3Server) -> None:
    options = seaweed.storage_options()
    root = upload(f"s3://{BUCKET}/werr-{uuid.uuid4().hex[:8]}", options, 4)
    filesystem(root, options).pipe(f"{root.split('://')[1]}/0003.npy", b"garbage")
    dataset = RemoteDataset(root, decode="npy", storage_options=options)
    with pytest.raises(DecodeError, match=r"0003\.npy"):
        list(DataLoader(dataset, batch_size=2, num_workers=2))


def test_labels_limit_and_bad_arguments(s3_root: tuple[str, dict[str, Any]]) -> None:
    root, options = s3_root
    manifest = Manifest.build(root, storage_options=options)
    labels = {f"{i:04d}.npy": "odd" if i % 2 else "even" for i in range(40)}
    dataset = RemoteDataset(manifest, decode="npy", labels=labels, limit=5, storage_options=options)
    assert len(dataset) == 5
    sample, label = dataset[3]
    assert value_of(sample) == 3 and dataset.manifest.classes is not None
    assert dataset.manifest.classes[label] == "odd"
    assert_identities(dataset, [3, 0, 4])
    _, targets = next(iter(DataLoader(dataset, batch_size=5)))
    assert targets.tolist() == [0, 1, 0, 1, 0]
    with pytest.raises(IndexError, match="out of range for 5"):
        dataset[5]
    assert value_of(dataset[np.int64(-1)][0]) == 4 and value_of(dataset[torch.tensor(2)][0]) == 2
    for index in (2.7, "2"):  # int() took 2.7 as 2, silently
        with pytest.raises(TypeError, match=r"indices must be integers, got (float 2\.7|str '2')"):
            dataset[index]  # type: ignore[index]
    for bad in [{"on_error": "ignore"}, {"limit": 0}, {"cache": "/tmp/x"}]:
        with pytest.raises(ConfigError):
            RemoteDataset(manifest, decode="npy", **bad)
    with pytest.raises(ConfigError, match="unknown decoder 'jpeg2000'"):
        RemoteDataset(manifest, decode="jpeg2000")
    # named before the listing, which on a large bucket takes minutes (it came after it)
    never = "memory://never-listed/prefix"  # listing it would raise ObjectNotFoundError
    with pytest.raises(ConfigError, match="unknown decoder 'jpeg2000'"):
        RemoteDataset(Tar(never), decode={"jpg": "jpeg2000"})
    with pytest.raises(ConfigError, match=r"no sample source named 'zip': one of \[") as unknown:
        source_named("zip", never)
    names = ("groups", "objects", "parquet", "tar")  # the registry's, and any added since
    assert all(f"'{name}'" in str(unknown.value) for name in names)
    with pytest.raises(ConfigError, match="source must be a URL, a Manifest or a source object"):
        RemoteDataset(42, decode="npy")  # type: ignore[arg-type]


def test_what_a_source_cannot_take_is_refused_before_any_listing() -> None:
    """Labels for samples that carry their own (a tar sample's ``cls`` member, a parquet
    column), ``on_change="refresh"`` for samples that move when their shard changes, and
    decoders by member for whole objects are refused naming the source, before the listing
    (minutes on a large bucket), never ignored."""
    never = "memory://never-listed/prefix"  # listing it would raise ObjectNotFoundError
    for source in (Tar(never), Parquet(never)):
        with pytest.raises(ConfigError, match=rf"^{source.name} samples take no labels="):
            RemoteDataset(source, labels="folders")
        with pytest.raises(
            ConfigError, match=rf"on_change='refresh' cannot apply to {source.name} samples"
        ):
            RemoteDataset(source, on_change="refresh")
    with pytest.raises(ConfigError, match="decodes the members of a sample: Objects samples"):
        RemoteDataset(Objects(never), decode={"*.jpg": "image"})
    with pytest.raises(ConfigError, match="Tar reads a URL or a Manifest, got 42"):
        Tar(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="reuse_listing must be a bool, got 'no'"):
        Objects(never, reuse_listing="no")  # type: ignore[arg-type]


def test_folder_labels_are_image_folder_s(
    seaweed: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """labels="folders" gives the class as torchvision's ImageFolder does: the folder right
    under the root, however deep the object sits below it (frames under a subject's folder, a
    view's subfolder); an object in no folder (a README) is left out and named."""
    root = f"s3://{BUCKET}/classes-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    keys = {
        "cat/0001.npy": 0,
        "cat/indoor/0002.npy": 0,
        "dog/subject 7/frames/0003.npy": 1,
        "dog/0004.npy": 1,
        "dog.v2/0005.npy": 2,  # a dot in the class folder's name
    }
    objects = {key: npy(np.full((2, 2), i, np.float32)) for i, key in enumerate(keys)}
    objects["README.md"] = b"cats and dogs"
    write(root, options, objects)
    with caplog.at_level(logging.WARNING):
        dataset = RemoteDataset(root, decode="npy", labels="folders", storage_options=options)
    assert "leaving out 1 objects" in caplog.text and "README.md" in caplog.text
    assert dataset.manifest.classes == ("cat", "dog", "dog.v2") and len(dataset) == len(keys)
    by_value = {value_of(dataset[i]): dataset[i][1] for i in range(len(dataset))}
    assert by_value == {i: label for i, label in enumerate(keys.values())}
    flat = f"s3://{BUCKET}/flat-{uuid.uuid4().hex[:8]}"
    write(flat, options, {"0001.npy": npy(np.zeros(2, np.float32))})
    with pytest.raises(ConfigError, match=r"no object under .*flat-.* is in a folder"):
        RemoteDataset(flat, decode="npy", labels="folders", storage_options=options)


def test_the_listing_a_labelled_dataset_saves_serves_a_dataset_without_labels(
    seaweed: S3Server, tmp_path: Path
) -> None:
    """The listing saved beside a cache serves every dataset of its URL. One with
    labels="folders" (which leaves out an object in no folder) saved its labelled view of it:
    the next dataset of that URL without labels gave (sample, label) pairs and lacked that
    object, and its listing check found an object added."""
    root = f"s3://{BUCKET}/listed-labels-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    write(root, options, {"README.md": b"cats and dogs", "cat/0.bin": b"c", "dog/1.bin": b"d"})
    cache = Cache(tmp_path / "c")
    labelled = RemoteDataset(root, labels="folders", cache=cache, storage_options=options)
    assert [labelled[i] for i in range(len(labelled))] == [(b"c", 0), (b"d", 1)]
    plain = RemoteDataset(root, cache=cache, storage_options=options)
    assert plain.manifest.labels is None and plain.manifest.classes is None
    assert [plain[i] for i in range(len(plain))] == [b"cats and dogs", b"c", b"d"]
    assert plain.listing_check is not None and not plain.listing_check.result(timeout=60).any


def test_a_split_without_a_class_codes_its_labels_by_the_classes_given(seaweed: S3Server) -> None:
    """A validation split built apart from its training split, as ImageFolder users build it,
    lacks a rare class: its own sorted classes coded every class after the missing one one
    lower than training did, so evaluation scored 'fox' images against the 'dog' output
    without a word. ``classes=train.classes`` codes them as training does; a label not among
    them is an error naming it."""
    root = f"s3://{BUCKET}/splits-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    layout = {
        "train/cat/0001.npy": 0,
        "train/dog/0002.npy": 1,
        "train/fox/x/0003.npy": 2,
        "val/cat/0004.npy": 0,
        "val/fox/0005.npy": 2,  # no dog in this split
        "test/wolf/0006.npy": 3,
    }
    write(root, options, {key: npy(np.full(2, code, np.float32)) for key, code in layout.items()})
    train = RemoteDataset(f"{root}/train", decode="npy", labels="folders", storage_options=options)
    assert train.classes == ("cat", "dog", "fox")
    alone = RemoteDataset(f"{root}/val", decode="npy", labels="folders", storage_options=options)
    assert alone.classes == ("cat", "fox")  # ImageFolder's way, kept as the default
    val = RemoteDataset(
        f"{root}/val",
        decode="npy",
        labels=Labels("folders", classes=train.classes),
        storage_options=options,
    )
    assert val.classes == train.classes
    for batch, codes in DataLoader(val, batch_size=2):
        assert codes.tolist() == batch[:, 0].int().tolist() == [0, 2]
    table = {"cat/0004.npy": "fox", "fox/0005.npy": 1}  # a name, and an integer: its place
    mixed = RemoteDataset(
        f"{root}/val",
        decode="npy",
        labels=Labels(table, classes=["cat", "dog", "fox"]),
        storage_options=options,
    )
    assert [mixed[i][1] for i in range(len(mixed))] == [2, 1]
    with pytest.raises(ConfigError, match=r"not among the 3 classes given: 'wolf' \(.*0006"):
        RemoteDataset(
            f"{root}/test", labels=Labels("folders", classes=train.classes), storage_options=options
        )
    with pytest.raises(ConfigError, match=r"not among the 3 classes given: '7'"):
        RemoteDataset(
            f"{root}/val",
            labels=Labels({"cat/0004.npy": 7, "fox/0005.npy": 0}, classes=train.classes),
            storage_options=options,
        )
    # checked when the Labels is made, before any listing
    for bad, message in [
        ("cat", "non-empty list of class names"),
        (["cat", "cat"], r"names \['cat'\] twice"),
        ([], "non-empty list"),
        ({"cat", "dog"}, "in code order"),  # a set: no order to code classes by
    ]:
        with pytest.raises(ConfigError, match=message):
            Labels("folders", classes=bad)  # type: ignore[arg-type]
    names = np.array(["cat", "dog", "fox"])  # an ordered sequence that is no list will do
    from_array = RemoteDataset(
        f"{root}/val",
        labels=Labels("folders", classes=names),  # type: ignore[arg-type]
        storage_options=options,
    )
    assert from_array.classes == ("cat", "dog", "fox")
    assert all(type(name) is str for name in from_array.classes)
    with pytest.raises(ConfigError, match=r"labels must be a mapping .* got None"):
        Labels(None, classes=["cat"])  # type: ignore[arg-type]  # class names, no labels


def test_prefetch_fills_the_cache_ahead(s3_root: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    root, options = s3_root
    cache = Cache(tmp_path, format="npy")
    dataset = RemoteDataset(root, decode="npy", cache=cache, storage_options=options)
    dataset.prefetch(range(10, 20)).result(timeout=60)
    requests = dataset.fetcher.counters.requests
    assert [value_of(dataset[i]) for i in range(10, 20)] == list(range(10, 20))
    assert dataset.fetcher.counters.requests == requests  # all hits


def test_without_a_cache_the_lookahead_holds_what_it_made_for_the_read(
    s3_root: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No cache: a batch made ahead is held for its read (fetched once, not again); a
    DataLoader without workers makes the batches behind a slow one meanwhile (a request in a
    store's tail held up the whole loop); a lookahead whose samples cannot be held stops."""
    import fastload
    from fastload import _handoff

    root, options = s3_root
    dataset = RemoteDataset(root, decode="npy", storage_options=options)
    dataset.prefetch(range(10, 20)).result(timeout=60)
    assert dataset.fetcher.counters.requests == 10
    assert [value_of(s) for s in dataset.__getitems__(list(range(10, 20)))] == list(range(10, 20))
    assert dataset.fetcher.counters.requests == 10  # taken, not fetched again
    assert value_of(dataset[10]) == 10 and dataset.fetcher.counters.requests == 11  # held once

    made: set[int] = set()
    slow_one = threading.Event()

    @versioned(1)
    def slow(array: np.ndarray) -> np.ndarray:
        made.add(value_of(array))
        if value_of(array) == 0:  # the first batch waits on its member 0
            slow_one.wait(30)
        return array

    dataset = RemoteDataset(root, decode="npy", transform=slow, storage_options=options)
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0, collate_fn=list)
    batches, first = iter(loader), []
    reader = threading.Thread(target=lambda: first.append(next(batches)))
    reader.start()
    behind = set(range(4, 20))  # the 4 batches of the lookahead behind the first
    for _ in range(1000):
        if behind <= made:
            break
        slow_one.wait(0.01)
    assert behind <= made, sorted(made)  # made while the first batch waits
    slow_one.set()
    reader.join(60)
    assert [value_of(s) for batch in [*first, *batches] for s in batch] == list(range(40))
    assert dataset.fetcher.counters.requests == 40  # each fetched once

    monkeypatch.setattr(_handoff, "HANDOFF_BYTES", 1)  # nothing can be held
    tight = RemoteDataset(root, decode="npy", storage_options=options)
    tight.prefetch(range(4)).result(timeout=60)
    assert tight.prefetch(range(4, 8)).done() and tight.fetcher.counters.requests == 4  # stopped
    assert [value_of(s) for s in tight.__getitems__([0, 1, 2, 3])] == [0, 1, 2, 3]


def test_a_read_takes_what_the_lookahead_made_instead_of_reading_it_back(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookahead's samples are held for the read of their batch (no copy and checksum
    back out of the cache); a read of a batch the lookahead is making waits for it, not for
    the cache's locks; what is held stays within HANDOFF_BYTES; a pickled dataset holds none."""
    from fastload import _handoff as module

    root, options = s3_root
    cache = Cache(tmp_path, format="npy")
    entered, gate = threading.Event(), threading.Event()

    @versioned(1)
    def slow(array: np.ndarray) -> np.ndarray:
        if value_of(array) >= 20:
            entered.set()
            gate.wait(30)
        return array

    dataset = RemoteDataset(
        root, decode="npy", transform=slow, cache=cache, storage_options=options
    )
    dataset.prefetch(range(10, 20)).result(timeout=60)
    assert cache.counters.misses == 10 and cache.counters.writes == 10
    assert [value_of(s) for s in dataset.__getitems__(list(range(10, 20)))] == list(range(10, 20))
    assert (cache.counters.hits, cache.counters.waits) == (0, 0)  # taken, not read back
    assert [value_of(dataset[i]) for i in (10, 11)] == [10, 11]
    assert cache.counters.hits == 2  # handed once: now read from the cache

    making = dataset.prefetch(range(20, 24))
    assert entered.wait(30)  # the lookahead is making them
    read: list[Any] = []
    reader = threading.Thread(target=lambda: read.extend(dataset.__getitems__([20, 21, 22, 23])))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive()  # waiting for the lookahead
    gate.set()
    making.result(timeout=60)
    reader.join(60)
    assert [value_of(s) for s in read] == [20, 21, 22, 23]
    assert cache.counters.misses == 14 and cache.counters.writes == 14  # made once each
    assert (cache.counters.hits, cache.counters.waits) == (2, 0)

    size = dataset[0].nbytes
    monkeypatch.setattr(module, "HANDOFF_BYTES", 3 * size)
    dataset.prefetch(range(30, 40)).result(timeout=60)
    assert dataset._handoff._bytes <= 3 * size
    assert [value_of(s) for s in dataset.__getitems__(list(range(30, 40)))] == list(range(30, 40))
    assert cache.counters.hits == 2 + 7  # the 7 dropped were read back
    plain = RemoteDataset(root, decode="npy", cache=Cache(tmp_path / "p"), storage_options=options)
    plain.prefetch(range(3)).result(timeout=60)
    assert plain._handoff._bytes > 0
    assert pickle.loads(pickle.dumps(plain))._handoff._bytes == 0  # a worker's copy holds none


def test_prefetch_probes_a_warm_cache_and_resumes_at_a_miss(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Any
) -> None:
    """A warm cache costs the lookahead a stat per sample in one batch of 8, not in all; a miss
    that a probe finds turns checking on for every batch again."""
    from fastload import dataset as module

    root, options = s3_root
    cache = Cache(tmp_path, format="npy")
    dataset = RemoteDataset(root, decode="npy", cache=cache, storage_options=options)
    dataset.warm(range(4))
    for _ in range(module._WARM_STREAK):  # found warm
        dataset.prefetch(range(4)).result(timeout=60)
    cache.delete(dataset._cache_names([5])[0])
    for _ in range(module._WARM_PROBE - 1):
        dataset.prefetch([5]).result(timeout=60)
    assert dataset._cache_names([5])[0] not in cache  # not checked
    dataset.prefetch([5]).result(timeout=60)
    assert dataset._cache_names([5])[0] in cache  # the probe found the miss and made it
    assert dataset._warm_batches < module._WARM_STREAK  # checking every batch again
    cache.delete(dataset._cache_names([6])[0])
    dataset.prefetch([6]).result(timeout=60)
    assert dataset._cache_names([6])[0] in cache


class Expensive(Dataset[Any]):
    """A user's own dataset: counts how often it really computes."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> Any:
        with open(self.log, "a") as f:
            f.write(f"{index}\n")
        return {"x": torch.full((3,), float(index)), "label": index % 4}


class Resized(Dataset[Any]):
    """A user's dataset configured by its constructor, as most are."""

    def __init__(self, size: int, table: Any = None) -> None:
        self.size, self.table = size, table

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> Any:
        return np.full((self.size,), index, np.float32)


def test_a_cached_dataset_s_name_follows_its_configuration(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Resized(224) and Resized(256) make different samples: the cache must not hand one's
    to the other (it did: only the class and its __getitem__ code named them)."""
    cache = Cache(tmp_path / "c", format="npy")
    small, large = CachedDataset(Resized(224), cache), CachedDataset(Resized(256), cache)
    assert small[1].shape == (224,) and large[1].shape == (256,)
    assert CachedDataset(Resized(224), cache)._cache_names([1]) == small._cache_names([1])
    assert caplog.text == ""  # constants only: nothing it cannot follow
    with caplog.at_level(logging.WARNING):
        CachedDataset(Resized(224, table=object()), cache)
    assert "cannot tell when the attributes ['table'] change" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        CachedDataset(Resized(224, table=object()), cache, version="tables-2")
    assert caplog.text == ""


def test_cached_dataset_computes_once_across_workers_and_epochs(tmp_path: Any) -> None:
    log = str(tmp_path / "calls")
    dataset = CachedDataset(Expensive(log), Cache(tmp_path / "c", format="npy"))
    for _ in range(3):
        batches = list(DataLoader(dataset, batch_size=4, num_workers=2, shuffle=True))
        assert sorted(int(v) for b in batches for v in b["x"][:, 0]) == list(range(16))
    with open(log) as f:
        calls = sorted(int(line) for line in f)
    # each sample computed once; one more call (worker 0's first sample, computed a second
    # time) checks that the wrapped dataset is deterministic
    assert len(calls) == 17 and sorted(set(calls)) == list(range(16))
    other = CachedDataset(Expensive(log), Cache(tmp_path / "c", format="npy"), version="v2")
    other[0]  # a new version: computed again (and checked: two calls)
    with open(log) as f:
        assert len(f.readlines()) == 19


def test_cached_dataset_rejects_what_it_cannot_wrap(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="map-style"):
        CachedDataset(iter([1, 2]), Cache(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"fastload\.Cache"):
        CachedDataset(Expensive(os.devnull), str(tmp_path))  # type: ignore[arg-type]


class Flaky(Expensive):
    """Fails on index 5; optionally random (a crop drawn per call)."""

    def __init__(self, log: str, random: bool = False) -> None:
        super().__init__(log)
        self.random = random

    def __getitem__(self, index: int) -> Any:
        if index == 5:
            raise OSError("sample 5 is unreadable")
        item = super().__getitem__(index)
        if self.random:
            item["x"] = item["x"] + torch.rand(3)
        return item


def test_cached_dataset_skips_by_key_limits_and_augments_after_the_cache(tmp_path: Any) -> None:
    log = str(tmp_path / "calls")
    strict = CachedDataset(Flaky(log), Cache(tmp_path / "a"), key=lambda i: f"img-{i}")
    with pytest.raises(DecodeError, match="img-5"):
        strict.__getitems__([4, 5, 6])
    lenient = CachedDataset(
        Flaky(log),
        Cache(tmp_path / "b"),
        key=lambda i: f"img-{i}",
        on_error="skip",
        limit=8,
        augment=lambda s: {**s, "x": s["x"] + torch.rand(3)},
    )
    assert len(lenient) == 8
    batch = lenient.__getitems__([4, 5, 6])
    assert len(batch) == 3 and lenient.stats()["dataset"]["skipped_keys"] == ["img-5"]
    assert len(lenient.cache) == 2  # nothing cached for img-5
    first, second = lenient[4]["x"], lenient[4]["x"]
    assert not torch.equal(first, second)  # augmented on every read
    assert torch.equal(first.floor(), torch.full((3,), 4.0))  # around the cached sample
    with pytest.raises(IndexError):
        lenient[8]


def test_a_random_wrapped_dataset_is_warned_about(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        CachedDataset(Flaky(os.devnull, random=True), Cache(tmp_path / "r"))[0]
    assert "output is random" in caplog.text and "augment=" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        CachedDataset(Flaky(os.devnull), Cache(tmp_path / "d"))[0]
    assert "random" not in caplog.text


def test_lookahead_and_warm_work_for_a_cached_dataset(tmp_path: Any) -> None:
    import fastload
    from fastload.warm import warm_cache

    log = str(tmp_path / "calls")
    dataset = CachedDataset(Expensive(log), Cache(tmp_path / "c"))
    loader = fastload.DataLoader(dataset, batch_size=4, num_workers=0, lookahead=2)
    assert len(list(loader)) == 4
    assert dataset.stats()["cache"]["writes"] == 16  # computed ahead or in the loop, once each
    other = CachedDataset(Expensive(log), Cache(tmp_path / "w"))
    report = warm_cache(other, list(range(16)), batch_size=5)
    assert report.samples == 16 and report.failures == {} and len(other.cache) == 16


def test_remote_dataset_augments_after_the_cache(
    s3_root: tuple[str, dict[str, Any]], tmp_path: Any
) -> None:
    root, options = s3_root
    dataset = RemoteDataset(
        root,
        decode="npy",
        transform=versioned(1)(lambda a: a * 2),
        augment=lambda a: a + np.random.default_rng().random(a.shape, dtype=np.float32),
        cache=Cache(tmp_path, format="npy"),
        storage_options=options,
    )
    a, b = dataset[3], dataset[3]
    assert not np.array_equal(a, b) and np.array_equal(np.floor(a), np.full((4, 5), 6.0))
    assert dataset.fetcher.counters.objects == 1  # the second read came from the cache


@pytest.mark.parametrize("fmt", ["pt", "npy", "zarr"])
def test_local_file_names_that_are_not_utf8_are_read_and_cached(tmp_path: Path, fmt: str) -> None:
    """#19: a file:// dataset with a Latin-1 name crashed every cached read (UnicodeEncodeError)."""
    data = tmp_path / "data"
    bodies = {b"caf\xe9.bin": b"a" * 10, b"sub \xff/x\xfe.bin": b"b" * 10, b"ok.bin": b"c" * 10}
    for name, body in bodies.items():
        path = os.path.join(os.fsencode(data), name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(body)
    cache = Cache(tmp_path / "cache", format=fmt)  # type: ignore[arg-type]
    dataset = RemoteDataset(str(data), cache=cache)
    expected = {os.fsdecode(name): body for name, body in bodies.items()}
    for _ in range(2):  # computed, then from the cache
        got = {dataset.manifest[i].key: dataset[i] for i in range(len(dataset))}
        assert got == expected
    assert cache.counters.hits == 3 and cache.verify().corrupt == []
    dataset.manifest.save(tmp_path / "m.npz")
    assert Manifest.load(tmp_path / "m.npz").keys() == dataset.manifest.keys()


def _npz_bomb(expanded: int) -> bytes:
    """A .npz whose one float64 member is ``expanded`` bytes of zeros, deflated to ~1/1000."""
    out = io.BytesIO()
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": (expanded // 8,)}
    )
    zeros = bytes(64 << 20)
    with (
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive,
        archive.open("x.npy", "w", force_zip64=True) as member,
    ):
        member.write(header.getvalue())
        for _ in range(expanded // len(zeros)):
            member.write(zeros)
    return out.getvalue()


def test_an_npz_that_expands_past_the_bound_is_refused_before_it_is_inflated(
    s3_root: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 5 MB .npz expanding to 1.1 GB added its whole size to peak memory."""
    root, options = s3_root
    bomb = _npz_bomb(1088 << 20)
    assert len(bomb) < 8 << 20
    ok = io.BytesIO()
    np.savez_compressed(ok, x=np.arange(1000.0))
    write(root, options, {"bomb/a.npz": bomb, "fine/b.npz": ok.getvalue()})
    dataset = RemoteDataset(f"{root}/bomb", storage_options=options, decode="npz")
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError, match=r"expand to 1,140,850,816 bytes.*_DECODE_MAX_BYTES"):
            dataset[0]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak  # the fetched 5 MB and bookkeeping, not the 1.1 GB
    fine = RemoteDataset(f"{root}/fine", storage_options=options, decode="npz")
    assert fine[0]["x"].tolist() == list(np.arange(1000.0))
    monkeypatch.setenv("FASTLOAD_DECODE_MAX_BYTES", "4000")  # 8,000 bytes of float64: over
    with pytest.raises(DecodeError, match=r"over the 4,000"):
        RemoteDataset(f"{root}/fine", storage_options=options, decode="npz")[0]
