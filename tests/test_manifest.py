"""Manifest: persistence, derived manifests, labels, bad input, and rank-0 listing."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import re
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from fastload import Groups, Objects, RemoteDataset, Tar
from fastload import manifest as manifest_module
from fastload._select import expand_braces, literal_prefixes
from fastload.config import FetchConfig
from fastload.errors import ConfigError, ObjectNotFoundError, StoreError, TransientStoreError
from fastload.manifest import Kept, Manifest, Strings
from fastload.sources._indexes import ShardIndexes
from fastload.sources.groups import _rule
from fastload.stores.s3 import FAST_PATH
from fastload.testing import FaultProxy, Faults, free_port
from tests.conftest import BUCKET, write
from tests.misbehaving import misbehaving_s3


def synthetic(n: int, root: str = "s3://bucket/data") -> Manifest:
    keys = [f"class{i % 3}/img_{i:07d}.jpg" for i in range(n)]
    return Manifest(root, keys, [i * 7 for i in range(n)], [f"etag{i:x}" for i in range(n)])


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    manifest = synthetic(10_000).with_labels(
        {f"class{i % 3}/img_{i:07d}.jpg": i % 3 for i in range(10_000)}
    )
    manifest.save(tmp_path / "m.npz")
    loaded = Manifest.load(tmp_path / "m.npz", url="s3://bucket/data/")
    assert loaded.fingerprint == manifest.fingerprint
    assert loaded.keys() == manifest.keys()
    assert loaded[1234] == manifest[1234]
    assert loaded[-1].url == "s3://bucket/data/class0/img_0009999.jpg"
    assert loaded.labels is not None and loaded.labels.tolist() == manifest.labels.tolist()  # type: ignore[union-attr]
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was renamed away
    with pytest.raises(ConfigError, match="needs a file path, got a folder"):
        manifest.save(tmp_path)  # an IsADirectoryError naming a temporary file in its parent
    assert not list(tmp_path.parent.glob(".*.tmp"))


def test_entries_and_slices() -> None:
    manifest = synthetic(10)
    entry = manifest[3]
    assert (entry.key, entry.size, entry.version, entry.label) == (
        "class0/img_0000003.jpg",
        21,
        "etag3",
        None,
    )
    assert len(manifest[2:5]) == 3
    assert manifest[2:5][0] == manifest[2]
    assert manifest.total_bytes == sum(i * 7 for i in range(10))
    with pytest.raises(IndexError, match="index 10 out of range for 10"):
        manifest[10]


def test_fingerprint_changes_with_any_listed_field() -> None:
    base = synthetic(5)
    assert base.fingerprint == synthetic(5).fingerprint
    keys, sizes, versions = base.keys(), base.sizes.tolist(), [e.version for e in base]
    assert Manifest(base.root, keys, [*sizes[:-1], 1], versions).fingerprint != base.fingerprint
    assert Manifest(base.root, keys, sizes, [*versions[:-1], "x"]).fingerprint != base.fingerprint
    assert Manifest("s3://other/data", keys, sizes, versions).fingerprint != base.fingerprint


def test_subset_is_deterministic_and_ordered() -> None:
    manifest = synthetic(1000)
    a, b = manifest.subset(100, seed=5), manifest.subset(100, seed=5)
    assert a.keys() == b.keys()
    position = {key: i for i, key in enumerate(manifest.keys())}
    chosen = [position[k] for k in a.keys()]  # noqa: SIM118  (a list, not a dict)
    assert chosen == sorted(chosen)
    assert manifest.subset(100, seed=6).keys() != a.keys()
    with pytest.raises(ConfigError, match=r"subset n must be an int in \[0, 1000\]"):
        manifest.subset(1001)


def test_filter_by_pattern_and_predicate() -> None:
    manifest = synthetic(30)
    assert len(manifest.filter(pattern="class1/*")) == 10
    assert len(manifest.filter(lambda e: e.size > 100, pattern="class1/*")) == 5


def test_labels_from_csv_json_and_full_urls(tmp_path: Path) -> None:
    manifest = synthetic(6)
    csv_path = tmp_path / "labels.csv"
    csv_path.write_text(
        "key,label\n" + "".join(f"{k},{k.split('/')[0]}\n" for k in manifest.keys())  # noqa: SIM118
    )
    by_csv = manifest.with_labels(csv_path)
    assert by_csv.classes == ("class0", "class1", "class2")
    assert [e.label for e in by_csv] == [0, 1, 2, 0, 1, 2]
    json_path = tmp_path / "labels.json"
    json_path.write_text(json.dumps({manifest.url(k): i for i, k in enumerate(manifest.keys())}))
    by_json = manifest.with_labels(json_path)
    assert by_json.classes is None
    assert [e.label for e in by_json] == list(range(6))


def test_missing_labels(tmp_path: Path) -> None:
    manifest = synthetic(4)
    partial = {manifest[0].key: 1, manifest[2].key: 0}
    with pytest.raises(ConfigError, match="2 of 4 objects under s3://bucket/data have no label"):
        manifest.with_labels(partial)
    assert manifest.with_labels(partial, missing="drop").keys() == [
        manifest[0].key,
        manifest[2].key,
    ]
    bad = tmp_path / "bad.csv"
    bad.write_text("name,cls\na,1\n")
    with pytest.raises(
        ConfigError, match="has no column 'key'; its columns are \\['name', 'cls'\\]"
    ) as caught:
        manifest.with_labels(bad)
    assert "fastload.Labels(..., key='name', field='cls')" in str(caught.value)  # the fix


def test_a_spreadsheet_csv_and_a_key_labelled_twice(tmp_path: Path) -> None:
    manifest = synthetic(4)
    rows = "".join(f"{k},{i % 2}\n" for i, k in enumerate(manifest.keys()))
    excel = tmp_path / "excel.csv"  # "CSV UTF-8" from a spreadsheet starts with a BOM
    excel.write_bytes(b"\xef\xbb\xbf" + f"key,label\n{rows}".encode())
    assert [e.label for e in manifest.with_labels(excel)] == [0, 1, 0, 1]
    again = tmp_path / "again.csv"  # one key twice with one label: harmless
    again.write_text(f"key,label\n{rows}{manifest[0].key},0\n")
    assert [e.label for e in manifest.with_labels(again)] == [0, 1, 0, 1]
    clash = tmp_path / "clash.csv"  # two labels for one key: the last one won, silently
    clash.write_text(f"key,label\n{rows}{manifest[0].key},1\n")
    with pytest.raises(ConfigError, match=rf"gives 1 keys two different labels.*{manifest[0].key}"):
        manifest.with_labels(clash)


def test_labels_that_mix_numbers_and_names_are_refused(tmp_path: Path) -> None:
    """A CSV of numeric labels with one stray name ("unknown"): sorted as text, 10 would come
    before 2 and every code from there on would move, silently."""
    manifest = synthetic(12)
    labels = tmp_path / "labels.csv"
    rows = [f"{k},{'unknown' if i == 5 else i}" for i, k in enumerate(manifest.keys())]
    labels.write_text("key,label\n" + "\n".join(rows) + "\n")
    with pytest.raises(ConfigError, match=r"mix 11 integers and 1 names \(such as \['unknown'\]"):
        manifest.with_labels(labels)
    numbers = manifest.with_labels({k: i for i, k in enumerate(manifest.keys())})
    assert [e.label for e in numbers] == list(range(12)) and numbers.classes is None
    floats = tmp_path / "floats.csv"  # pandas writes an int column with a gap as floats
    floats.write_text("key,label\n" + "".join(f"{e.key},{i}.0\n" for i, e in enumerate(manifest)))
    assert [e.label for e in manifest.with_labels(floats)] == list(range(12))


def test_labels_from_pandas_and_missing_ones_are_never_coded_as_names(tmp_path: Path) -> None:
    """A table built from a pandas column, ``dict(zip(df.key, df.label))``, holds numpy
    integers: they were taken as names and sorted as text, so 10 came before 2 and every code
    moved; booleans became the classes "False"/"True" (a subset of positives coded 0); a
    missing label (NaN, None, an empty CSV cell) became a class of its own."""
    manifest = synthetic(12)
    keys = manifest.keys()
    pandas_like = manifest.with_labels({k: np.int64(11 - i) for i, k in enumerate(keys)})
    assert [e.label for e in pandas_like] == list(range(11, -1, -1))
    assert pandas_like.classes is None
    positives = manifest.with_labels({k: np.bool_(True) for k in keys})
    assert [e.label for e in positives] == [1] * 12
    for missing in (float("nan"), None, "", " nan "):
        table: dict[str, object] = {k: i for i, k in enumerate(keys)}
        table[keys[3]] = missing
        with pytest.raises(ConfigError, match=f"{keys[3]}: a missing label"):
            manifest.with_labels(table)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"neither an integer nor a class name: 2\.5"):
        manifest.with_labels({k: 2.5 for k in keys})  # type: ignore[misc]
    gap = tmp_path / "gap.csv"  # an empty cell, as pandas writes NaN
    gap.write_text(
        "key,label\n" + "".join(f"{k},{'' if i == 7 else i}\n" for i, k in enumerate(keys))
    )
    with pytest.raises(ConfigError, match=f"{keys[7]}: a missing label ''"):
        manifest.with_labels(gap)
    nulls = tmp_path / "nulls.json"
    nulls.write_text(json.dumps({k: (None if i == 2 else i) for i, k in enumerate(keys)}))
    with pytest.raises(ConfigError, match=f"{keys[2]}: a missing label None"):
        manifest.with_labels(nulls)


def test_loading_something_else_is_a_config_error(tmp_path: Path) -> None:
    other = tmp_path / "other.npz"
    np.savez(other, meta=np.frombuffer(b'{"format": "x"}', dtype=np.uint8))
    with pytest.raises(ConfigError, match="not a fastload-manifest/1 file"):
        Manifest.load(other)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="not a readable fastload manifest"):
        Manifest.load(junk)
    with pytest.raises(FileNotFoundError):
        Manifest.load(tmp_path / "absent.npz")


def test_a_manifest_of_another_dataset_is_refused(tmp_path: Path) -> None:
    synthetic(3).save(tmp_path / "m.npz")
    with pytest.raises(ConfigError, match="lists s3://bucket/data, not s3://bucket/other"):
        Manifest.load(tmp_path / "m.npz", url="s3://bucket/other")


def test_corruption_is_detected(tmp_path: Path) -> None:
    manifest = synthetic(100)
    manifest.save(tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz") as data:
        arrays = dict(data)
    arrays["sizes"] = arrays["sizes"] + 1
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ConfigError, match="manifest is corrupt"):
        Manifest.load(tmp_path / "bad.npz")


def test_build_on_local_files_with_a_pattern(tmp_path: Path) -> None:
    for name in ["a.npy", "b.npy", "sub/c.npy", "notes.txt"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * len(name))
    manifest = Manifest.build(str(tmp_path), pattern="*.npy")
    assert manifest.keys() == ["a.npy", "b.npy", "sub/c.npy"]
    assert manifest.sizes.tolist() == [5, 5, 9]
    with pytest.raises(ObjectNotFoundError, match=r"matching '\*.csv'"):
        Manifest.build(str(tmp_path), pattern="*.csv")


def test_a_glob_in_a_url_that_lists_nothing_says_how_to_match_keys(tmp_path: Path) -> None:
    """Without a brace list, '*' in a URL is a key's own character (a key may hold one): a
    URL written as a glob lists nothing, and the error says what to write instead."""
    for name in ["s-0.npy", "s-1.npy", "s-*/x.npy"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    with pytest.raises(ObjectNotFoundError) as caught:
        Manifest.build(f"file://{tmp_path}/s-?.npy")
    said = str(caught.value)
    assert f"RemoteDataset(Objects('file://{tmp_path}', pattern='s-?.npy'))" in said
    assert f"Manifest.build('file://{tmp_path}', pattern='s-?.npy')" in said
    assert f"on the command line, file://{tmp_path} --pattern 's-?.npy'" in said
    assert Manifest.build(f"file://{tmp_path}", pattern="s-?.npy").keys() == ["s-0.npy", "s-1.npy"]
    assert Manifest.build(f"file://{tmp_path}/s-{{0,1}}.npy").keys() == ["s-0.npy", "s-1.npy"]
    assert Manifest.build(f"file://{tmp_path}/s-*").keys() == ["x.npy"]  # a folder's own name
    with pytest.raises(ObjectNotFoundError) as caught:
        Manifest.build(f"file://{tmp_path}/t-0")
    assert "pattern=" not in str(caught.value)


@pytest.mark.parametrize(
    ("pattern", "names"),
    [
        (
            "shard-{000..003}.tar",
            ["shard-000.tar", "shard-001.tar", "shard-002.tar", "shard-003.tar"],
        ),
        ("{08..11}", ["08", "09", "10", "11"]),  # zero-padded to the widest bound
        ("{9..11}", ["9", "10", "11"]),  # not padded
        ("{3..1}", ["3", "2", "1"]),
        ("{0..10..5}", ["0", "5", "10"]),
        ("{a..c}", ["a", "b", "c"]),
        ("{train,val}/{1..2}", ["train/1", "train/2", "val/1", "val/2"]),
        ("x{a,{b,c}}", ["xa", "xb", "xc"]),  # nested
        ("x{,y}", ["x", "xy"]),
        ("{x}/a{b/[c]", ["{x}/a{b/[c]"]),  # not brace lists: literal
    ],
)
def test_brace_lists_expand_as_webdataset_and_the_shell_do(pattern: str, names: list[str]) -> None:
    assert expand_braces(pattern) == names


@pytest.mark.parametrize(
    ("pattern", "starts"),
    [
        ("shard-{000000..001281}.tar", ["shard-00"]),
        ("train-{a,b}/x-*.tar", ["train-a/x-", "train-b/x-"]),  # a folder each
        ("{train,val}/shard-{00..99}.tar", ["train/shard-", "val/shard-"]),
        ("{train,val}/*.tar", ["train/", "val/"]),
        ("{a,a/b}.tar", ["a"]),  # a name beside a folder: their shared start
        ("{x*,xy}/a.tar", ["x"]),  # a folder with a wildcard in its name
        ("{0000..0099}/x.tar", ["00"]),  # more folders than _FOLDERS
        ("{train,val}-*.tar", [""]),  # one folder: the whole of it
        ("img[0-9]*.png", ["img"]),
        ("a?c{1,2}", ["a"]),
        ("exact.tar", ["exact.tar"]),
        (None, [""]),
    ],
)
def test_a_listing_asks_for_the_starts_the_names_share(
    pattern: str | None, starts: list[str]
) -> None:
    assert literal_prefixes(pattern) == starts


def test_a_brace_list_that_names_too_much_or_in_the_bucket_is_refused() -> None:
    with pytest.raises(ConfigError, match="more than 10,000,000"):
        expand_braces("{0..9999}{0..9999}")
    with pytest.raises(ConfigError, match="step of 0"):
        expand_braces("{1..9..0}")
    with pytest.raises(ConfigError, match="after the bucket"):
        Manifest.build("s3://bucket-{a,b}/x")
    pipe = "pipe:aws s3 cp s3://b/shard-{0..9}.tar -"  # WebDataset's: named whole
    with pytest.raises(ConfigError, match=re.escape(f"{pipe!r} is a WebDataset pipe")):
        Manifest.build(pipe)
    with pytest.raises(ConfigError, match="not both"):
        Manifest.build("file:///data/{a,b}.npy", pattern="*.npy")


def test_a_pattern_stays_with_its_manifest_through_refresh_save_and_load(tmp_path: Path) -> None:
    """A manifest listed with a pattern is refreshed with it (it listed every object under
    the root before: a README counted as added, and in the new manifest), saved and loaded
    with it, and a load for another pattern of the same folder is refused."""
    for name in ["a.jpg", "b.jpg", "c.jpg", "notes.txt", "sub/d.jpg"]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    for manifest in (
        Manifest.build(str(tmp_path), pattern="*.jpg"),
        Manifest.build(f"{tmp_path}/{{a,b,c}}.jpg"),
    ):
        assert manifest.root == f"file://{tmp_path}"
        changes = manifest.refresh()
        assert not changes.any and changes.manifest.keys() == manifest.keys()
        manifest.save(tmp_path / "m.npz")
        loaded = Manifest.load(tmp_path / "m.npz", url=str(tmp_path))
        assert loaded.pattern == manifest.pattern and loaded.keys() == manifest.keys()
        assert loaded[:2].pattern == manifest.pattern
    with pytest.raises(ConfigError, match=r"lists .*\{a,b,c\}.jpg, not"):
        Manifest.load(tmp_path / "m.npz", url=f"{tmp_path}/{{a,b}}.jpg")
    assert Manifest.build(str(tmp_path)).filter(pattern="{a,sub/d}.jpg").keys() == [
        "a.jpg",
        "sub/d.jpg",
    ]


def _rank(rank: int, world: int, port: int, root: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if rank != 0:  # a rank other than 0 that tried to list would fail loudly
            import fastload.manifest as module

            def no_listing(*args: Any, **kwargs: Any) -> Any:
                raise AssertionError(f"rank {rank} listed the store")

            module.filesystem = no_listing  # type: ignore[assignment]
        manifest = Manifest.build(root)
        out[rank] = manifest.fingerprint
        try:
            Manifest.build(root + "/missing")
        except ObjectNotFoundError as exc:
            out[f"error{rank}"] = str(exc)
    finally:
        dist.destroy_process_group()


def test_rank_zero_lists_and_broadcasts(tmp_path: Path) -> None:
    for i in range(20):
        (tmp_path / f"{i}.bin").write_bytes(b"x" * i)
    expected = Manifest.build(str(tmp_path)).fingerprint
    manager = mp.get_context("spawn").Manager()
    try:
        out = manager.dict()
        mp.start_processes(
            _rank, args=(2, free_port(), str(tmp_path), out), nprocs=2, start_method="spawn"
        )
        result = dict(out)
    finally:
        manager.shutdown()
    assert result[0] == result[1] == expected
    # the listing error reached every rank (no rank is left waiting for a broadcast)
    assert result["error0"] == result["error1"]
    assert "missing" in result["error1"]


def test_damaged_or_foreign_manifest_files_are_config_errors_naming_the_file(
    tmp_path: Path,
) -> None:
    good = tmp_path / "good.npz"
    synthetic(100).save(good)
    body = good.read_bytes()
    no_root = tmp_path / "no-root.npz"
    np.savez(
        no_root,
        meta=np.frombuffer(json.dumps({"format": "fastload-manifest/1"}).encode(), np.uint8),
    )
    cases = {
        "empty.npz": b"",
        "truncated.npz": body[: len(body) // 2],
        "noise.npz": os.urandom(4096),
        "text.npz": b"key,label\na,1\n",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    np.savez(tmp_path / "foreign.npz", weights=np.ones(3))
    np.save(tmp_path / "array.npy", np.ones(3))
    paths = [tmp_path / n for n in cases] + [tmp_path / "foreign.npz", tmp_path / "array.npy"]
    for path in [*paths, no_root]:
        with pytest.raises(ConfigError) as info:
            Manifest.load(path)
        assert str(path) in str(info.value), info.value
    with pytest.raises(FileNotFoundError):
        Manifest.load(tmp_path / "absent.npz")


@pytest.mark.parametrize("store", ["s3", "gcs", "b2"])
def test_listing_requests_time_out_and_retry_as_fetches_do(
    store: str, request: pytest.FixtureRequest
) -> None:
    """#19: `fastload ls` against a stalled server ran past 100 s (no timeout on the fast path)."""
    server = request.getfixturevalue({"s3": "seaweed", "gcs": "gcs", "b2": "b2"}[store])
    root = f"{'gs' if store == 'gcs' else store}://{BUCKET}/listing-{uuid.uuid4().hex[:8]}"
    write(
        root,
        server.storage_options(),
        {f"day {d}/{i:03d}.bin": b"x" for d in range(2) for i in range(30)},
    )
    config = FetchConfig(timeout=0.5, retries=8, outage_budget=0, backoff=0.01, max_backoff=0.05)
    with FaultProxy(server.endpoint, flavor=store) as proxy:  # type: ignore[arg-type]
        options = server.storage_options(proxy.endpoint)
        Manifest.build(root, storage_options=options, fetch_config=config)  # sign in, say
        listing = ("POST",) if store == "b2" else ("GET",)  # b2_list_file_names is a POST
        proxy.set_faults(Faults(error_503=0.3, seed=4, methods=listing))
        listed = Manifest.build(root, storage_options=options, fetch_config=config)
        assert len(listed) == 60 and proxy.counters()["error_503"] > 0
        proxy.set_faults(Faults(stall=1.0, stall_seconds=4.0, methods=listing))
        started = time.monotonic()
        with pytest.raises(TransientStoreError):
            Manifest.build(
                root,
                storage_options=options,
                fetch_config=FetchConfig(timeout=0.5, retries=1, outage_budget=0),
            )
        assert time.monotonic() - started < 4.0  # timed out, not waited out


def test_a_b2_listing_sends_no_more_calls_than_b2sdk(b2: Any) -> None:
    """#21: B2 bills list calls; Manifest.build sent 66 where b2sdk's ls sends 3 (10,000 names
    per call). 2,100 names, in directory-like keys: one call, as b2sdk's ls."""
    root = f"b2://{BUCKET}/calls-{uuid.uuid4().hex[:8]}"
    names = {f"plate {p}/well-{w:02d}/field {f}.tiff": b"x" for p in range(3) for w in range(70)
             for f in range(10)}  # fmt: skip
    write(root, b2.storage_options(), names)
    with FaultProxy(b2.endpoint, flavor="b2") as proxy:
        options = b2.storage_options(proxy.endpoint)
        with pytest.raises(ObjectNotFoundError):  # signs in
            Manifest.build(f"b2://{BUCKET}/calls-none", storage_options=options)
        before = proxy.counters()["requests"]
        listed = Manifest.build(root, storage_options=options)
        calls = proxy.counters()["requests"] - before
    assert sorted(url.removeprefix(root + "/") for url in listed.urls()) == sorted(names)
    assert calls == 1


@pytest.mark.parametrize("store", ["s3", "moto", "gcs"])
def test_a_listing_of_a_few_pages_is_one_chain_of_requests(
    store: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#21: splitting a listing into concurrent ranges after its first page sent 58 requests
    for 2,000 keys where a chain of pages sends 2 (2-3x slower on moto and fake-gcs-server
    through +20 ms). A listing of two full pages is one chain; a longer one still splits,
    complete."""
    from fastload.stores import _listing, _obstore

    monkeypatch.setattr(_listing, "PAGE", 37)
    monkeypatch.setattr(_obstore, "PAGE", 37)
    server = request.getfixturevalue({"s3": "seaweed", "moto": "moto", "gcs": "gcs"}[store])
    root = f"{'gs' if store == 'gcs' else 's3'}://{BUCKET}/chain-{uuid.uuid4().hex[:8]}"
    few = {f"class{i % 3}/{i:05d}.jpg": b"x" for i in range(74)}  # two full pages
    many = {f"class{i % 9}/{i:05d}.jpg": b"x" for i in range(600)}
    write(f"{root}/few", server.storage_options(), few)
    write(f"{root}/many", server.storage_options(), many)
    with FaultProxy(server.endpoint, flavor="gcs" if store == "gcs" else "s3") as proxy:
        options = server.storage_options(proxy.endpoint)
        Manifest.build(f"{root}/few/class0", storage_options=options)  # the client's set-up
        before = proxy.counters()["requests"]
        assert Manifest.build(f"{root}/few", storage_options=options).keys() == sorted(few)
        assert proxy.counters()["requests"] - before <= 2  # (obstore asks for 1,000 at once)
        assert Manifest.build(f"{root}/many", storage_options=options).keys() == sorted(many)


def test_an_obstore_listing_cut_off_by_timeouts_loses_no_key(seaweed: Any) -> None:
    """A stream that times out midway cannot resume; the range goes on through botocore
    after the last key the stream returned. 1 in 4 list requests stalls past the timeout
    here, and every key must come back, once (moving that key a page too early loses the
    page: 1,000 keys, without an error)."""
    root = f"s3://{BUCKET}/ahead-{uuid.uuid4().hex[:8]}"
    keys = {f"img_{i:05d}.jpg": b"x" for i in range(2_600)}  # three pages of 1,000
    write(root, seaweed.storage_options(), keys)
    config = FetchConfig(timeout=0.5, retries=20, outage_budget=0, backoff=0.01, max_backoff=0.05)
    with FaultProxy(seaweed.endpoint, flavor="s3") as proxy:
        options = seaweed.storage_options(proxy.endpoint)
        Manifest.build(root, storage_options=options)  # the client's set-up
        for seed in range(3):
            proxy.set_faults(Faults(stall=0.25, stall_seconds=1.5, methods=("GET",), seed=seed))
            listed = Manifest.build(root, storage_options=options, fetch_config=config)
            assert listed.keys() == sorted(keys)
        assert proxy.counters()["stall"] > 0


@pytest.mark.parametrize("store", ["s3", "gcs", "b2"])
def test_a_saved_listing_starts_a_dataset_without_listing_and_is_checked_behind(
    store: str, request: pytest.FixtureRequest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """#21: RemoteDataset listed the bucket at every start. The listing is saved beside the
    cache; the next start uses it even while listing stalls, and a listing in the background
    reports what changed (the start after that uses the new listing)."""
    from fastload import Cache, RemoteDataset

    server = request.getfixturevalue({"s3": "seaweed", "gcs": "gcs", "b2": "b2"}[store])
    root = f"{'gs' if store == 'gcs' else store}://{BUCKET}/saved-{uuid.uuid4().hex[:8]}"
    write(root, server.storage_options(), {f"day 1/{i:03d}.bin": b"x" for i in range(30)})
    # 2 s of silence (0.5 s timed out the first request of a new client on a loaded machine)
    config = FetchConfig(timeout=2.0, retries=0, outage_budget=0)
    cache = Cache(tmp_path / "cache")
    with FaultProxy(server.endpoint, flavor=store) as proxy:  # type: ignore[arg-type]
        options = server.storage_options(proxy.endpoint)

        def dataset(reuse_listing: bool = True) -> RemoteDataset:
            return RemoteDataset(
                Objects(root, reuse_listing=reuse_listing),
                cache=cache,
                storage_options=options,
                fetch_config=config,
            )

        first = dataset()
        assert first.listing_check is None and len(first) == 30
        assert list((tmp_path / "cache" / "manifests").glob("*.npz"))
        listing = ("POST",) if store == "b2" else ("GET",)
        proxy.set_faults(Faults(stall=1.0, stall_seconds=8.0, methods=listing))
        stalled = dataset()  # a listing now would time out and raise
        assert len(stalled) == 30 and stalled.listing_check is not None
        with pytest.raises(TransientStoreError):
            stalled.listing_check.result(timeout=60)
        proxy.set_faults(Faults())
        write(root, server.storage_options(), {"day 2/000.bin": b"y"})
        with caplog.at_level(logging.WARNING, logger="fastload.manifest"):
            behind = dataset()
            assert len(behind) == 30  # this run keeps the listing it started with
            changes = behind.listing_check.result(timeout=60)  # type: ignore[union-attr]
        copy = pickle.loads(pickle.dumps(behind))  # as DataLoader workers get it (forkserver)
        assert copy.listing_check is None and len(copy) == 30
        assert (changes.added, changes.removed, changes.changed) == (1, 0, 0)
        assert "1 added, 0 removed, 0 changed" in caplog.text
        assert len(dataset()) == 31  # the next start uses the new listing
        assert (
            len(dataset(reuse_listing=False)) == 31
            and dataset(reuse_listing=False).listing_check is None
        )


def test_an_unusable_saved_listing_is_listed_again(
    seaweed: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from fastload import RemoteDataset

    root = f"s3://{BUCKET}/unusable-{uuid.uuid4().hex[:8]}"
    write(root, seaweed.storage_options(), {f"{i}.bin": b"x" for i in range(3)})
    path = tmp_path / "listing.npz"
    path.write_bytes(b"not a manifest")
    with caplog.at_level(logging.WARNING, logger="fastload.manifest"):
        dataset = RemoteDataset(
            Objects(root, manifest_path=path), storage_options=seaweed.storage_options()
        )
    assert len(dataset) == 3 and "saved manifest is unusable" in caplog.text
    assert len(Manifest.load(path, url=root)) == 3  # saved over the bad file
    other = f"s3://{BUCKET}/other-{uuid.uuid4().hex[:8]}"
    write(other, seaweed.storage_options(), {"a.bin": b"x"})
    assert (
        len(
            RemoteDataset(
                Objects(other, manifest_path=path), storage_options=seaweed.storage_options()
            )
        )
        == 1
    )


def test_a_saved_listing_of_some_keys_is_not_used_for_all(
    seaweed: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One ``manifest_path`` for a brace URL and then for its folder: the folder's dataset
    lists again rather than start with the brace list's keys alone (it used to, with a
    warning that the listing had changed), and the other way round."""
    from fastload import RemoteDataset

    root = f"s3://{BUCKET}/some-{uuid.uuid4().hex[:8]}/train"
    options = seaweed.storage_options()
    write(root, options, {f"part-{i}.bin": b"x" for i in range(4)})
    path = tmp_path / "listing.npz"
    assert (
        len(
            RemoteDataset(
                Objects(f"{root}/part-{{0..1}}.bin", manifest_path=path), storage_options=options
            )
        )
        == 2
    )
    with caplog.at_level(logging.WARNING, logger="fastload.manifest"):
        assert len(RemoteDataset(Objects(root, manifest_path=path), storage_options=options)) == 4
    assert "keeps only the keys matching 'part-{0..1}.bin'" in caplog.text
    assert (
        len(
            RemoteDataset(
                Objects(f"{root}/part-{{0..1}}.bin", manifest_path=path), storage_options=options
            )
        )
        == 2
    )


def test_a_dataset_keeps_the_keys_its_pattern_matches(seaweed: Any, tmp_path: Path) -> None:
    """``RemoteDataset(Objects(folder, pattern=...))``: a glob needs no Manifest of the user's. Its
    saved listing is its own (a cache's folder holds one per URL and pattern), reused at the
    next start; over a Manifest the pattern filters it; with a brace list in the URL too it is
    an error."""
    from fastload import Cache, RemoteDataset

    root = f"s3://{BUCKET}/pattern-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    names = ["train/a.npy", "train/b.npy", "train/sub/c.npy", "train/notes.txt", "val/d.npy"]
    write(root, options, dict.fromkeys(names, b"x") | {"train/": b""})  # a folder marker

    def keys(pattern: str | None = None) -> list[str]:
        source = Objects(root, pattern=pattern)
        dataset = RemoteDataset(source, cache=Cache(tmp_path), storage_options=options)
        return [dataset.manifest[i].key for i in range(len(dataset))]

    assert keys(pattern="train/*.npy") == ["train/a.npy", "train/b.npy", "train/sub/c.npy"]
    assert keys() == sorted(names)  # not the pattern's saved listing
    assert keys(pattern="{train,val}/?.npy") == ["train/a.npy", "train/b.npy", "val/d.npy"]
    assert len(list(tmp_path.rglob("*.npz"))) == 3  # a listing saved for each
    write(root, options, {"train/e.npy": b"x"})
    assert "train/e.npy" not in keys(pattern="train/*.npy")  # the saved one, checked behind
    whole = Manifest.build(root, storage_options=options)
    assert RemoteDataset(Objects(whole, pattern="val/*")).manifest.keys() == ["val/d.npy"]
    with pytest.raises(ConfigError, match="not both"):
        RemoteDataset(
            Objects(f"{root}/train/{{a,b}}.npy", pattern="*.npy"), storage_options=options
        )


def test_a_batch_of_keys_and_versions_is_picked_as_one_by_one() -> None:
    """``Strings.pick`` (a warm batch's cache names) gives what indexing one by one gives, for
    keys with folders, spaces, non-ASCII, an undecodable byte, an empty version; the first
    entry, repeats and an empty batch included."""
    items = ["a/b c.npy", "", "dir/é/ü.png", "bad\udcff.bin", "x" * 300, "0"]
    strings = Strings.of(items)
    for indices in ([5, 0, 3, 3, 1, 4, 2], [0], [], np.arange(6)[::-1].tolist()):
        assert strings.pick(indices) == [strings[i] for i in indices] == [items[i] for i in indices]


# -- a server that would be listed forever -------------------------------------------------


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("fast_path", [True, False])
def test_a_listing_whose_token_repeats_forever_ends_with_a_store_error(
    parallel: bool, fast_path: bool
) -> None:
    """IsTruncated=true with the same token on every page: before, 9,000 pages in 15 s and
    memory growing, on both the parallel and the one-chain path."""
    config = FetchConfig(timeout=5, retries=1)
    with misbehaving_s3("same-page") as server:
        with pytest.raises(StoreError, match=r"after 2 pages.*never end.*: data/"):
            Manifest.build(
                "s3://bkt/data",
                storage_options={**server.storage_options(), FAST_PATH: fast_path},
                parallel=parallel,
                fetch_config=config,
            )
        assert server.requests <= 4


CLI = "import sys, fastload._cli as c; sys.exit(c.main())"


def test_fastload_ls_of_a_store_that_never_answers_ends_within_the_listing_policy() -> None:
    """Every page request gets FASTLOAD_FETCH_TIMEOUT, and a store that never answered is
    given up after FASTLOAD_FETCH_RETRIES: `fastload ls` ends, naming the URL."""
    env = {**os.environ, "FASTLOAD_FETCH_TIMEOUT": "2", "FASTLOAD_FETCH_RETRIES": "1"}
    with misbehaving_s3("stall") as server:
        options = [f"-o{k}={json.dumps(v)}" for k, v in server.storage_options().items()]
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", CLI, "ls", "s3://bkt/data", *options],
            capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip
        took = time.monotonic() - started
    assert done.returncode != 0
    assert "s3://bkt/data" in done.stderr and "Traceback" not in done.stderr
    # two attempts of 2 s each, plus the process's start: far from the 7 minutes of the defaults
    assert took < 60, took


# -- keys outside the root, and edited manifest files ---------------------------------------


@pytest.mark.parametrize("key", ["../secret.npy", "a/../../secret.npy", "/etc/passwd", ".."])
@pytest.mark.parametrize("before", ["ok.npy", ".", "a.", "x/."])
def test_a_key_that_leads_outside_the_root_is_refused(key: str, before: str) -> None:
    """Also after a key ending in '.': a scan for '..' that did not overlap matches missed
    '../secret.npy' after '.' (their bytes run '...')."""
    with pytest.raises(ConfigError, match=re.escape(repr(key))):
        Manifest("file:///data/train", sorted([before, key]), [1, 1], ["v", "v"])


def test_keys_that_only_look_like_climbing_are_kept() -> None:
    keys = ["a..b.npy", "..x/y.npy", "x/..y", "./c", "x/./y", "...", "a//b"]
    assert Manifest("s3://b/data", keys, [1] * 7, ["v"] * 7).keys() == keys


def _crafted(path: Path, root: str, keys: list[str], sizes: list[int], versions: list[str]) -> None:
    """A manifest file written by hand, with a checksum that matches (as an attacker can)."""
    honest = Manifest(root, ["x"] * len(keys), sizes, versions)
    honest.save(path)
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    crafted = Strings.of(keys)
    arrays["key_blob"], arrays["key_ends"] = crafted.blob, crafted.ends
    meta = json.loads(arrays.pop("meta").tobytes())
    probe = object.__new__(Manifest)  # the constructor would refuse the key: its fingerprint
    probe.root, probe._keys, probe._sizes = root, crafted, np.asarray(sizes, dtype=np.int64)
    probe._versions = Strings.of(versions)
    meta["fingerprint"] = Manifest.fingerprint.fget(probe)  # type: ignore[attr-defined]
    meta["checksum"] = manifest_module._checksum(meta, arrays)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **arrays)


def test_a_crafted_manifest_cannot_read_outside_its_root(tmp_path: Path) -> None:
    """On file://, a saved manifest whose key is ../secret.npy (with the secret's own size and
    mtime as version) was read: the secret's bytes came back as a sample."""
    root = tmp_path / "data"
    root.mkdir()
    np.save(root / "ok.npy", np.arange(3))
    np.save(tmp_path / "secret.npy", np.full(3, 7))
    listed = Manifest.build(f"file://{root}")
    secret = Manifest.build(f"file://{tmp_path}", pattern="secret.npy")
    path = tmp_path / "crafted.npz"
    _crafted(
        path,
        listed.root,
        ["ok.npy", "../secret.npy"],
        [listed[0].size, secret[0].size],
        [listed[0].version, secret[0].version],
    )
    with pytest.raises(ConfigError, match=r"'\.\./secret\.npy'.*outside the dataset root"):
        Manifest.load(path)


def test_a_saved_manifest_with_a_flipped_bit_or_edited_labels_is_refused(tmp_path: Path) -> None:
    manifest = synthetic(50).with_labels(
        {f"class{i % 3}/img_{i:07d}.jpg": i % 3 for i in range(50)}
    )
    path = tmp_path / "m.npz"
    manifest.save(path)
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    arrays["labels"] = arrays["labels"].copy()
    arrays["labels"][7] = (arrays["labels"][7] + 1) % 3  # one label edited, the rest as saved
    np.savez(tmp_path / "edited.npz", **arrays)
    with pytest.raises(ConfigError, match=r"checksum.*edited\.npz"):
        Manifest.load(tmp_path / "edited.npz")
    # one bit of the labels' bytes flipped in the file itself (npz members are stored as is)
    raw = bytearray(path.read_bytes())
    labels = manifest.labels.tobytes()  # type: ignore[union-attr]
    at = raw.index(labels) + 8 * 7
    raw[at] ^= 0x01
    (tmp_path / "flipped.npz").write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"flipped\.npz"):
        Manifest.load(tmp_path / "flipped.npz")


def test_a_bucket_key_with_a_dot_dot_segment_is_refused_at_build_naming_it(moto: Any) -> None:
    prefix = f"climb-{uuid.uuid4().hex[:8]}/"
    client = moto.client()
    for key in ("a.bin", "x/../../escape.bin"):
        client.put_object(Bucket=BUCKET, Key=prefix + key, Body=b"1")
    with pytest.raises(ConfigError, match=r"'x/\.\./\.\./escape\.bin'.*pattern="):
        Manifest.build(f"s3://{BUCKET}/{prefix}", storage_options=moto.storage_options())


# -- what sample sources keep with a manifest (its slots) ------------------------------------


def test_what_a_source_keeps_is_saved_and_loaded_with_its_manifest_and_dropped_by_derived_ones(
    tmp_path: Path,
) -> None:
    """A manifest carries what sources keep (a grouping, shard indexes) in slots it never
    looks inside: each comes back from a file and from bytes as it went in (tag, arrays with
    their types, whether it names objects by key), a slot kept again is replaced, any manifest
    derived from it (other entries) has none, and a slot's arrays are under the checksum."""
    by_key = Kept(
        "index/3", {"values": np.arange(6), "names": np.frombuffer(b"ab", np.uint8)}, True
    )
    by_position = Kept("rule|x", {"members": np.array([2, 0, 1]), "none": np.zeros(0, np.float32)})
    manifest = synthetic(10).keeping("shards", by_key).keeping("groups", by_position)
    manifest.save(tmp_path / "m.npz")
    for loaded in (Manifest.load(tmp_path / "m.npz"), Manifest.from_bytes(manifest.to_bytes())):
        assert loaded.fingerprint == manifest.fingerprint
        assert sorted(loaded.kept) == ["groups", "shards"]
        for slot, kept in manifest.kept.items():
            got = loaded.kept[slot]
            assert (got.tag, got.by_key) == (kept.tag, kept.by_key)
            assert sorted(got.arrays) == sorted(kept.arrays)
            for name, values in kept.arrays.items():
                assert got.arrays[name].dtype == values.dtype
                assert np.array_equal(got.arrays[name], values)
    again = manifest.keeping("groups", Kept("other", {}))
    assert again.kept["groups"].tag == "other" and again.kept["shards"] is by_key
    assert Manifest.from_bytes(again.to_bytes()).kept["groups"].arrays == {}
    for derived in (
        manifest[:5],
        manifest.filter(pattern="class1/*"),
        manifest.subset(4),
        manifest.with_labels(dict.fromkeys(manifest.keys(), 1)),
    ):
        assert derived.kept == {}
    with np.load(tmp_path / "m.npz") as data:
        arrays = {name: data[name] for name in data.files}
    arrays["kept.groups.members"] = np.array([2, 1, 0])  # one slot's array edited
    np.savez(tmp_path / "edited.npz", **arrays)
    with pytest.raises(ConfigError, match=r"checksum.*edited\.npz"):
        Manifest.load(tmp_path / "edited.npz")


def test_a_listing_checked_behind_keeps_only_what_names_objects_by_key(tmp_path: Path) -> None:
    """When the background check of a saved listing finds the objects changed, it saves the
    new listing with the slots that name objects by key and version (shard indexes: each
    applies to its own shard) and without those that name them by position (a grouping: the
    positions moved). An unchanged listing is not saved again."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3):
        (data / f"{i}.bin").write_bytes(b"x")
    url, path = f"file://{data}", tmp_path / "listing.npz"
    by_key = Kept("index/1", {"a": np.arange(3)}, by_key=True)
    by_position = Kept("rule", {"members": np.array([0, 1, 2])})
    Manifest.build(url).keeping("shards", by_key).keeping("groups", by_position).save(path)
    same = RemoteDataset(Objects(url, manifest_path=path))
    assert same.listing_check is not None and not same.listing_check.result(timeout=60).any
    assert sorted(Manifest.load(path).kept) == ["groups", "shards"]
    (data / "3.bin").write_bytes(b"x")
    behind = RemoteDataset(Objects(url, manifest_path=path))
    assert len(behind) == 3 and sorted(behind.manifest.kept) == ["groups", "shards"]
    assert behind.listing_check is not None
    assert behind.listing_check.result(timeout=60).added == 1
    saved = Manifest.load(path)
    assert len(saved) == 4 and list(saved.kept) == ["shards"]
    assert saved.kept["shards"].tag == "index/1" and saved.kept["shards"].by_key
    assert np.array_equal(saved.kept["shards"].arrays["a"], np.arange(3))


def _saved_before_slots(
    path: Path, manifest: Manifest, fields: dict[str, str], arrays: dict[str, np.ndarray]
) -> None:
    """``manifest`` saved as fastload saved it before slots: what a source kept in a field of
    its own (``grouping``, ``shard_index``) and arrays of its own prefix (``group_``,
    ``shard_index.``), with a checksum that matches."""
    manifest.save(path)
    with np.load(path) as data:
        saved = {n: data[n] for n in data.files if n != "meta" and not n.startswith("kept.")}
    meta = {
        "format": manifest_module.FORMAT,
        "root": manifest.root,
        "pattern": manifest.pattern,
        "count": len(manifest),
        "fingerprint": manifest.fingerprint,
        "classes": manifest.classes,
        "grouping": None,
        "shard_index": None,
        **fields,
    }
    saved.update(arrays)
    meta["checksum"] = manifest_module._checksum(meta, saved)
    saved["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(path, **saved)


def test_a_manifest_saved_before_slots_still_gives_its_grouping_and_shard_indexes(
    tmp_path: Path,
) -> None:
    """Listings saved by the fastload before sources kept their part in slots (in the cache's
    folder, or a user's manifest_path) start a dataset as they did: the grouping they keep is
    used, not made again (here it left out a group that is complete today: only the saved one
    can say so), and the shard indexes they keep spare every read of the shards."""
    channels = tmp_path / "channels"
    channels.mkdir()
    for field in (1, 2, 3):
        for c in (1, 2):
            (channels / f"f{field}_ch{c}.bin").write_bytes(bytes([field, c]))
    url, rule = f"file://{channels}", r"(.*)_ch\d\.bin$"
    listed = Manifest.build(url)
    names = Strings.of(["f1", "f3"])
    gone = Strings.of([f"{listed.root}/f2: incomplete group, missing ['_ch2.bin']"])
    tag = _rule(rule, "skip", None)
    assert tag is not None
    _saved_before_slots(
        tmp_path / "groups.npz",
        listed,
        {"grouping": tag},
        {
            "group_name_blob": names.blob,
            "group_name_ends": names.ends,
            "group_members": np.array([0, 1, 4, 5], np.int64),  # f1's channels, f3's
            "group_ends": np.array([2, 4], np.int64),
            "group_left_out_blob": gone.blob,
            "group_left_out_ends": gone.ends,
        },
    )
    loaded = Manifest.load(tmp_path / "groups.npz", url=url)
    assert list(loaded.kept) == ["groups"] and not loaded.kept["groups"].by_key
    groups = RemoteDataset(Groups(loaded, rule, incomplete="skip"))
    assert [groups.source[i].name for i in range(len(groups))] == ["f1", "f3"]
    assert groups.stats()["dataset"]["left_out"] == gone.tolist()
    assert groups[1] == {"f3_ch1.bin": bytes([3, 1]), "f3_ch2.bin": bytes([3, 2])}

    shards = tmp_path / "shards"
    shards.mkdir()
    with tarfile.open(shards / "a.tar", mode="w") as tar:
        for n in range(3):
            info = tarfile.TarInfo(f"{n:03d}.txt")
            info.size = 1
            tar.addfile(info, io.BytesIO(str(n).encode()))
    url = f"file://{shards}"
    indexes = ShardIndexes.kept_by(RemoteDataset(Tar(url)).manifest)
    assert indexes is not None
    kept = indexes.kept()
    _saved_before_slots(
        tmp_path / "shards.npz",
        Manifest.build(url),
        {"shard_index": kept.tag},
        {f"shard_index.{name}": values for name, values in kept.arrays.items()},
    )
    loaded = Manifest.load(tmp_path / "shards.npz", url=url)
    assert list(loaded.kept) == ["shards"] and loaded.kept["shards"].by_key
    tars = RemoteDataset(Tar(loaded))
    assert tars.fetcher.counters.requests == 0  # indexed as saved: no shard read
    assert [tars[n] for n in range(3)] == [{"txt": str(n).encode()} for n in range(3)]
