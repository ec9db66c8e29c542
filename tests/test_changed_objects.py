"""Objects replaced after the manifest was listed: never read under the old version (#19).

Each store names the version it served (S3's ETag, the GCS generation, B2's file id and
SHA-1, a local file's mtime), so a replaced object is reported as changed, by name, and
``on_change`` picks raise, skip or refresh. Through the real servers, same-size and
different-size replacements.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest

import fastload
from fastload import Cache, ObjectChangedError, Parquet, RemoteDataset, Tar
from fastload.manifest import Manifest
from tests.conftest import write

OBJECTS = {f"shots/day 1/img_{i:02d}.bin": bytes([i]) * 1000 for i in range(8)}
CHANGED = "shots/day 1/img_03.bin"


def _replace(root: str, options: dict[str, Any], body: bytes) -> None:
    write(root, options, {CHANGED: body})


def _listed_then_replaced(root: str, options: dict[str, Any], body: bytes) -> Manifest:
    """The objects listed, then ``CHANGED`` replaced by ``body``: a stale manifest."""
    write(root, options, OBJECTS)
    manifest = Manifest.build(root, storage_options=options)
    _replace(root, options, body)
    return manifest


@pytest.mark.parametrize("new_size", [1000, 1700], ids=["same-size", "other-size"])
def test_a_replaced_object_is_reported_as_changed_by_name(
    store: tuple[str, dict[str, Any]], new_size: int
) -> None:
    root, options = store
    manifest = _listed_then_replaced(root, options, b"\xee" * new_size)
    ds = RemoteDataset(manifest, storage_options=options)
    assert ds[2] == OBJECTS["shots/day 1/img_02.bin"]
    with pytest.raises(ObjectChangedError) as caught:
        ds[3]
    assert CHANGED in str(caught.value)
    assert caught.value.url is not None and caught.value.url.endswith(CHANGED)
    assert isinstance(caught.value, FileNotFoundError)  # the indexed version is gone


def test_skip_leaves_out_a_changed_object_and_names_it(
    store: tuple[str, dict[str, Any]],
) -> None:
    root, options = store
    manifest = _listed_then_replaced(root, options, b"\xee" * 1000)
    ds = RemoteDataset(manifest, storage_options=options, on_change="skip")
    batch = ds.__getitems__(list(range(8)))
    assert b"\xee" * 1000 not in batch
    assert ds.stats()["dataset"]["skipped_keys"] == [f"{root}/{CHANGED}"]


def test_refresh_reads_the_new_version_and_caches_it_under_that_version(
    store: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    root, options = store
    write(root, options, OBJECTS)
    manifest = Manifest.build(root, storage_options=options)
    cache = Cache(tmp_path / "cache")
    ds = RemoteDataset(manifest, storage_options=options, cache=cache, on_change="refresh")
    assert ds[3] == OBJECTS[CHANGED]  # cached under the version listed
    _replace(root, options, b"\xee" * 1000)
    # a fresh process with the same manifest and cache: the old entry must not be served as new
    cold = RemoteDataset(manifest, storage_options=options, cache=cache, on_change="refresh")
    cold.cache = Cache(tmp_path / "other-cache")
    assert cold[3] == b"\xee" * 1000
    assert cold.stats()["dataset"]["refreshed"] == 1
    requests = cold.fetcher.counters.requests
    assert cold[3] == b"\xee" * 1000  # now from the cache, under the new version
    assert cold.fetcher.counters.requests == requests
    assert cold.stats()["dataset"]["refreshed"] == 1


def test_the_same_cache_never_serves_new_bytes_under_the_old_version(
    store: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The bug #19 names: same size, new bytes, cached under the old version's name."""
    root, options = store
    manifest = _listed_then_replaced(root, options, b"\xee" * 1000)
    cache = Cache(tmp_path / "cache")
    ds = RemoteDataset(manifest, storage_options=options, cache=cache)
    with pytest.raises(ObjectChangedError):
        ds[3]
    assert len(cache) == 0


def test_local_files_changed_since_listing_are_caught(tmp_path: Path) -> None:
    root = tmp_path / "data"
    for key, body in OBJECTS.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(body)
    manifest = Manifest.build(str(root))
    (root / CHANGED).write_bytes(b"\xee" * 1000)
    ds = RemoteDataset(manifest, on_change="refresh")
    assert ds[3] == b"\xee" * 1000
    strict = RemoteDataset(manifest)
    with pytest.raises(ObjectChangedError, match="img_03"):
        strict[3]


def test_a_tar_shard_replaced_after_indexing_is_refused(seaweed: Any, tmp_path: Path) -> None:
    def shard(fill: int) -> bytes:
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for i in range(4):
                info = tarfile.TarInfo(f"{i:04d}.bin")
                info.size = 500
                tar.addfile(info, io.BytesIO(bytes([fill]) * 500))
        return out.getvalue()

    options = seaweed.storage_options()
    root = f"s3://fastload-test/changed-tar-{tmp_path.name}"
    write(root, options, {"shard-0.tar": shard(1)})
    manifest = Manifest.build(root, storage_options=options)
    cache = Cache(tmp_path / "cache")
    ds = RemoteDataset(Tar(manifest), storage_options=options, cache=cache)
    assert ds[0] == {"bin": b"\x01" * 500}
    write(root, options, {"shard-0.tar": shard(2)})  # same size, same layout, new bytes
    again = RemoteDataset(Tar(manifest), storage_options=options, cache=cache)
    with pytest.raises(ObjectChangedError, match=r"shard-0\.tar"):
        again[1]
    for source, name in ((Tar(manifest), "tar"), (Parquet(manifest), "parquet")):
        with pytest.raises(
            fastload.ConfigError, match=f"on_change='refresh' cannot apply to {name} samples"
        ):
            RemoteDataset(source, storage_options=options, on_change="refresh")
