"""Samples made of several objects (group_by) against SeaweedFS, fake-gcs-server and B2."""

from __future__ import annotations

import io
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tifffile
import torch

import fastload
from fastload import (
    Cache,
    ConfigError,
    DecodeError,
    Groups,
    Labels,
    Manifest,
    ObjectNotFoundError,
    RemoteDataset,
)
from fastload.sources.registry import source_named
from fastload.stores import filesystem
from fastload.testing import B2Server, FakeGcsServer, FaultProxy, Faults, S3Server
from fastload.testing.dicom import ct_slice
from tests.conftest import BUCKET, assert_identities, write

CHANNELS = 5
FIELDS = [f"plate1/{well}/f{f}" for well in ("A01", "A02", "B01") for f in range(1, 5)]
CHANNEL_RE = r"(.*)_ch\d\.tiff$"


def tiff(value: np.ndarray) -> bytes:
    out = io.BytesIO()
    tifffile.imwrite(out, value)
    return out.getvalue()


def channel(field: str, c: int) -> np.ndarray:
    """A 16-bit channel image whose pixels say which field and channel it is."""
    base = FIELDS.index(field) * 1000 + c * 100 + 40_000  # above 8 bits on purpose
    return np.full((24, 20), base, np.uint16) + np.arange(20, dtype=np.uint16)


def cell_painting(root: str, options: dict[str, Any]) -> dict[str, bytes]:
    objects = {
        f"{field}_ch{c}.tiff": tiff(channel(field, c))
        for field in FIELDS
        for c in range(1, CHANNELS + 1)
    }
    objects["plate1/metadata.csv"] = b"plate,wells\nplate1,3\n"  # not a sample
    write(root, options, objects)
    return objects


def test_channels_of_a_field_are_one_sample(
    store: tuple[str, dict[str, Any]], tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    root, options = store
    cell_painting(root, options)
    with caplog.at_level(logging.WARNING):
        dataset = RemoteDataset(
            Groups(root, CHANNEL_RE),
            decode="tiff",
            labels="folders",  # the well, as ImageFolder would
            cache=Cache(tmp_path, format="npy"),
            storage_options=options,
        )
    assert "metadata.csv" in caplog.text  # left out, and said so
    assert len(dataset) == len(FIELDS) and dataset.classes == ("A01", "A02", "B01")
    sample, label = dataset[5]
    field = FIELDS[5]
    assert list(sample) == [f"{field}_ch{c}.tiff" for c in range(1, CHANNELS + 1)]
    for c in range(1, CHANNELS + 1):
        got = sample[f"{field}_ch{c}.tiff"]
        assert got.dtype == np.uint16 and np.array_equal(got[..., 0], channel(field, c))
    assert label == 1  # A02
    assert_identities(dataset, [5, 0, len(FIELDS) - 1])
    # a batch fetches all members of all its samples at once, then never again
    before = dataset.fetcher.counters.objects
    batch = dataset.__getitems__([0, 1, 2, 3])
    assert len(batch) == 4 and dataset.fetcher.counters.objects - before == 4 * CHANNELS
    loader = fastload.DataLoader(
        dataset, batch_size=4, shuffle=True, num_workers=0, collate_fn=lambda b: b
    )
    labels = sorted(label for batch in loader for _, label in batch)
    assert labels == sorted(FIELDS.index(f) // 4 for f in FIELDS)  # each field once
    requests = dataset.fetcher.counters.requests
    assert sum(len(b) for b in loader) == len(FIELDS)  # a warm epoch: all from the cache
    assert dataset.fetcher.counters.requests == requests


def stacked(sample: dict[str, np.ndarray]) -> np.ndarray:
    """A field's channels as one array, channel first (a module-level transform: it pickles)."""
    return np.stack([sample[name][..., 0] for name in sorted(sample)])


def test_groups_with_workers_the_workers_cache_ahead_themselves(
    seaweed: S3Server, tmp_path: Any
) -> None:
    """With a cache and workers, the lookahead of grouped samples runs in the workers: the main
    process fetches only its head start's members (the first batches, while the workers
    start), every field is cached once, and batches read fields made ahead."""
    root = f"s3://{BUCKET}/groups-ahead-{uuid.uuid4().hex[:8]}"
    cell_painting(root, seaweed.storage_options())
    with FaultProxy(seaweed.endpoint, flavor="s3", faults=Faults(latency=0.05)) as proxy:
        dataset = RemoteDataset(
            Groups(root, CHANNEL_RE),
            decode="tiff",
            transform=stacked,
            cache=Cache(tmp_path, format="npy"),
            storage_options=seaweed.storage_options(proxy.endpoint),
        )
        loader = fastload.DataLoader(
            dataset, batch_size=2, shuffle=True, num_workers=2, prefetch_factor=1
        )
        firsts = sorted(int(b[i, 0, 0, 0]) for b in loader for i in range(len(b)))
    assert firsts == sorted(int(channel(field, 1)[0, 0]) for field in FIELDS)
    head = (loader.lookahead + 2) * 2  # fields: the lookahead and the batches handed out first
    assert dataset.counters.cache.writes <= head
    assert dataset.counters.fetch.objects == dataset.counters.cache.writes * CHANNELS
    assert len(Cache(tmp_path, format="npy")) == len(FIELDS)
    total = loader.counters
    assert total is not None  # short, never over: see the single-object test in test_loader
    assert 0 < total.fetch.objects <= len(FIELDS) * CHANNELS
    assert total.cache.hits + total.cache.waits >= 2


def test_members_come_in_numbered_order(seaweed: S3Server) -> None:
    """Channels and slices are often numbered without padding (ch1 ... ch12, 1.dcm ...
    120.dcm): a transform that stacks a group's members in order must get ch2 before ch10."""
    root = f"s3://{BUCKET}/numbered-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    fields = ("plate1/A01/f1", "plate1/A01/f2")
    objects = {
        f"{field}_ch{c}.tiff": tiff(np.full((4, 5), 40_000 + c, np.uint16))
        for field in fields
        for c in range(1, 13)
    }
    write(root, options, objects)
    rule = r"(.*)_ch\d+\.tiff$"
    dataset = RemoteDataset(Groups(root, rule), decode="tiff", storage_options=options)
    sample = dataset[1]
    assert list(sample) == [f"{fields[1]}_ch{c}.tiff" for c in range(1, 13)]
    stacked = np.stack([member[0, 0, 0] for member in sample.values()])
    assert stacked.tolist() == [40_000 + c for c in range(1, 13)]


def test_a_missing_channel_is_named_and_the_user_chooses(seaweed: S3Server, tmp_path: Path) -> None:
    root = f"s3://{BUCKET}/incomplete-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    cell_painting(root, options)
    fs = filesystem(root, options)
    fs.rm_file(f"{fs._strip_protocol(root)}/{FIELDS[2]}_ch3.tiff")
    with pytest.raises(ConfigError, match=r"1 of 12 groups .* incomplete.*A01/f3.*_ch3\.tiff"):
        RemoteDataset(Groups(root, CHANNEL_RE), decode="tiff", storage_options=options)
    skipped = RemoteDataset(
        Groups(root, CHANNEL_RE, incomplete="skip"), decode="tiff", storage_options=options
    )
    assert len(skipped) == len(FIELDS) - 1
    named = [f"{root}/{FIELDS[2]}: incomplete group, missing ['_ch3.tiff']"]
    assert skipped.stats()["dataset"]["left_out"] == named  # where a script can see it too
    skipped.manifest.save(tmp_path / "m.npz")  # a restart from it groups nothing again
    again = RemoteDataset(
        Groups(Manifest.load(tmp_path / "m.npz"), CHANNEL_RE, incomplete="skip"),
        decode="tiff",
        storage_options=options,
    )
    assert len(again) == len(FIELDS) - 1 and again.stats()["dataset"]["left_out"] == named
    kept = RemoteDataset(
        Groups(root, CHANNEL_RE, incomplete="accept"), decode="tiff", storage_options=options
    )
    assert len(kept) == len(FIELDS) and len(kept[2]) == CHANNELS - 1
    with pytest.raises(ConfigError, match="4 members, not 5"):
        RemoteDataset(Groups(root, CHANNEL_RE, members=5), decode="tiff", storage_options=options)


def test_a_broken_member_skips_its_whole_group_by_name(b2: B2Server, tmp_path: Any) -> None:
    root = f"b2://{BUCKET}/broken-{uuid.uuid4().hex[:8]}"
    options = b2.storage_options()
    cell_painting(root, options)
    write(root, options, {f"{FIELDS[7]}_ch2.tiff": b"II*\x00 truncated"})
    strict = RemoteDataset(Groups(root, CHANNEL_RE), decode="tiff", storage_options=options)
    with pytest.raises(fastload.DecodeError, match=r"A02/f4_ch2\.tiff") as info:
        strict[7]
    assert info.value.url == f"{root}/{FIELDS[7]}"  # the group, named by its URL
    lenient = RemoteDataset(
        Groups(root, CHANNEL_RE),
        decode="tiff",
        on_error="skip",
        cache=Cache(tmp_path),
        storage_options=options,
    )
    batch = lenient.__getitems__(list(range(len(FIELDS))))
    assert len(batch) == len(FIELDS)  # the batch keeps its size
    assert lenient.stats()["dataset"]["skipped_keys"] == [f"{root}/{FIELDS[7]}"]
    # a member that disappears after listing: the group fails as not found, naming both
    fs = filesystem(root, options)
    fs.rm_file(f"{fs._strip_protocol(root)}/{FIELDS[0]}_ch1.tiff")
    fresh = RemoteDataset(
        Groups(strict.manifest, CHANNEL_RE), decode="tiff", storage_options=options
    )
    with pytest.raises(ObjectNotFoundError, match=r"group 'plate1/A01/f1': member .*_ch1\.tiff"):
        fresh[0]


def test_dicom_like_series_with_labels_per_participant(gcs: FakeGcsServer, tmp_path: Any) -> None:
    root = f"gs://{BUCKET}/oct-{uuid.uuid4().hex[:8]}"
    options = gcs.storage_options()
    slices = {"sub-01": 7, "sub-02": 5, "sub-03": 9}  # series differ in length by nature
    write(
        root,
        options,
        {
            f"{sub}/ses-1/slice_{i:03d}.npy": np.full(3, i, np.int16).tobytes()
            for sub, n in slices.items()
            for i in range(n)
        },
    )
    table = tmp_path / "participants.csv"
    table.write_text("participant_id,diagnosis\nsub-01,AMD\nsub-02,healthy\nsub-03,AMD\n")

    def volume(members: dict[str, bytes]) -> torch.Tensor:
        return torch.stack(
            [torch.frombuffer(bytearray(b), dtype=torch.int16) for b in members.values()]
        )

    def by_participant(key: str) -> str:
        return key.split("/", maxsplit=1)[0]

    with pytest.raises(ConfigError, match=r"no column 'key'.*participant_id"):
        RemoteDataset(
            Groups(root, by_participant), decode=volume, labels=str(table), storage_options=options
        )

    def participants(classes: list[str] | None = None) -> RemoteDataset:
        return RemoteDataset(
            Groups(root, by_participant),
            decode=volume,
            labels=Labels(str(table), key="participant_id", field="diagnosis", classes=classes),
            storage_options=options,
        )

    dataset = participants()
    assert dataset.classes == ("AMD", "healthy")
    pinned = participants(classes=["healthy", "DME", "AMD"])  # DME, which none has, keeps 1
    assert [pinned[i][1] for i in range(3)] == [2, 0, 2] and pinned.classes[1] == "DME"
    shapes = [tuple(dataset[i][0].shape) for i in range(3)]
    assert shapes == [(7, 3), (5, 3), (9, 3)] and [dataset[i][1] for i in range(3)] == [0, 1, 0]
    assert dataset[2][0][:, 0].tolist() == list(range(9))  # slices in key order
    with pytest.raises(ConfigError, match="labels match none of the 3 groups"):
        RemoteDataset(
            Groups(root, by_participant),
            decode=volume,
            labels={"patient-9": 1},
            storage_options=options,
        )


def test_bad_group_rules_are_named(seaweed: S3Server) -> None:
    root = f"s3://{BUCKET}/rules-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    cell_painting(root, options)
    with pytest.raises(ConfigError, match="matches none of the 61 objects"):
        RemoteDataset(Groups(root, r"(.*)\.png$"), decode="tiff", storage_options=options)
    with pytest.raises(ConfigError, match=r"puts all 61 objects .* in one group, 'plate1'"):
        RemoteDataset(Groups(root, r"^(plate1)"), decode="tiff", storage_options=options)
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        RemoteDataset(Groups(root, r"(unclosed"), decode="tiff", storage_options=options)
    with pytest.raises(ConfigError, match="empty group name"):
        RemoteDataset(Groups(root, lambda k: ""), decode="tiff", storage_options=options)
    with pytest.raises(ConfigError, match="a group name that is not a str, 5 for"):
        RemoteDataset(Groups(root, lambda k: 5), decode="tiff", storage_options=options)
    # what only groups (or shards) use is refused by a source that does not, not ignored
    # (the CLI's --incomplete, --row-key... are given to a source by its name)
    with pytest.raises(
        ConfigError,
        match=r"the objects source does not take members \(members applies to .*groups.*tar",
    ):
        source_named("objects", root, members=5)
    with pytest.raises(
        ConfigError,
        match=r"the parquet source does not take incomplete \(incomplete applies to .*groups.*tar",
    ):
        source_named("parquet", root, incomplete="skip")
    with pytest.raises(
        ConfigError,
        match=r"the objects source does not take chunks \(chunks applies to .*parquet.*tar",
    ):
        source_named("objects", root, chunks=fastload.ChunkConfig())
    # wrong types are named (a TypeError or ValueError from dict() or open() they were), and
    # storage options given as pairs are not echoed: they hold the credentials
    pairs = list(options.items())
    with pytest.raises(ConfigError, match=r"storage_options must be a mapping.*got a list") as bad:
        RemoteDataset(Groups(root, r"(.*)_ch\d"), decode="tiff", storage_options=pairs)
    assert all(str(value) not in str(bad.value) for _, value in pairs)
    with pytest.raises(ConfigError, match="storage_options must be a mapping"):
        fastload.Manifest.build(root, storage_options="endpoint_url=x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"labels must be a mapping .* got 5"):
        RemoteDataset(root, labels=5, storage_options=options)  # type: ignore[arg-type]


def test_warm_cache_cli_with_groups_then_training_reads_only_the_cache(
    seaweed: S3Server, tmp_path: Any
) -> None:
    from tests.test_cli import fastload as cli
    from tests.test_cli import options_args

    root = f"s3://{BUCKET}/cli-groups-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    cell_painting(root, options)
    args = ["warm-cache", root, "--cache-dir", str(tmp_path / "c"), "--format", "npy"]
    args += ["--group-by", CHANNEL_RE, "--decode", "tiff", "--json", *options_args(options)]
    for shard in ("0/2", "1/2"):
        done = cli(*args, "--shard", shard)
        assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["failures"] == {} and summary["samples"] == len(FIELDS) // 2
    table = tmp_path / "wells.csv"  # labels are checked before any fetch
    table.write_text("field,well\n" + "".join(f"{f},{f.split('/')[1]}\n" for f in FIELDS[1:]))
    bad = cli(*args, "--labels", str(table))
    assert bad.returncode == 2 and "has no column 'key'" in bad.stderr, bad.stderr
    short = cli(*args, "--labels", str(table), "--label-key", "field", "--label-field", "well")
    assert short.returncode == 2 and f"1 of {len(FIELDS)} groups" in short.stderr, short.stderr
    again = cli(*args)
    assert json.loads(again.stdout)["hits"] == len(FIELDS)  # both shards cached everything
    dataset = RemoteDataset(
        Groups(root, CHANNEL_RE),
        decode="tiff",
        cache=Cache(tmp_path / "c", format="npy"),
        storage_options=options,
    )
    assert len(list(fastload.DataLoader(dataset, batch_size=3, collate_fn=list))) == 4
    assert dataset.fetcher.counters.requests == 0


def test_warm_cache_cli_warms_a_cached_dataset_from_a_module_beside_the_user(
    tmp_path: Any,
) -> None:
    import subprocess

    (tmp_path / "my_data.py").write_text(
        "import torch, fastload\n"
        "class Squares(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 30\n"
        "    def __getitem__(self, i): return torch.full((3,), float(i * i))\n"
        "def make():\n"
        f"    return fastload.CachedDataset(Squares(), fastload.Cache({str(tmp_path / 'c')!r}))\n"
    )
    from tests.test_cli import SCRIPT

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [SCRIPT, "warm-cache", "--dataset", "my_data:make", "--json"],
        cwd=tmp_path,  # the module lies here, and is not on PYTHONPATH
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["samples"] == 30
    assert len(Cache(tmp_path / "c")) == 30


def test_a_dicom_series_per_volume_on_b2(b2: B2Server, tmp_path: Any) -> None:
    root = f"b2://{BUCKET}/dicom-{uuid.uuid4().hex[:8]}"
    options = b2.storage_options()
    rng = np.random.default_rng(3)
    objects, truth = {}, {}
    for sub, n in (("sub-01", 6), ("sub-02", 4)):
        order = rng.permutation(n)  # file names do not follow the slice position
        stored = rng.integers(0, 4096, (n, 8, 9))
        for name_index, z_index in enumerate(order):
            objects[f"{sub}/series/IM{name_index:04d}.dcm"] = ct_slice(
                stored[z_index], z=-50.0 + 2.5 * z_index, instance=int(z_index) + 1, slope=2
            )
        truth[sub] = stored * 2.0 - 1024  # Hounsfield units
    write(root, options, objects)
    dataset = RemoteDataset(
        Groups(root, r"^(sub-\d+)/"),
        decode="dicom-series",
        labels={"sub-01": 1, "sub-02": 0},
        cache=Cache(tmp_path, format="npy"),
        storage_options=options,
    )
    for i, sub in enumerate(("sub-01", "sub-02")):
        volume, label = dataset[i]
        assert volume.dtype == np.float32 and volume.shape == truth[sub].shape
        np.testing.assert_array_equal(volume, truth[sub])  # sorted by position, rescaled
        assert label == 1 - i
    single = RemoteDataset(root, decode="dicom", storage_options=options, limit=1)
    assert single[0].shape == (8, 9)


def enhanced_ct(stored: np.ndarray, per_frame: list[tuple[float, float]] | None) -> bytes:
    """An Enhanced CT file (multi-frame): its rescale is in the functional groups, per frame
    when ``per_frame`` is given, else shared by every frame (slope 1, intercept -1024)."""
    from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
    from pydicom.uid import EnhancedCTImageStorage, ExplicitVRLittleEndian, generate_uid

    def group(slope: float, intercept: float) -> Dataset:
        item, transformation = Dataset(), Dataset()
        transformation.RescaleSlope, transformation.RescaleIntercept = slope, intercept
        transformation.RescaleType = "HU"
        item.PixelValueTransformationSequence = [transformation]
        return item

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = EnhancedCTImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset("volume", {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = EnhancedCTImageStorage, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.NumberOfFrames = "CT", len(stored)
    ds.Rows, ds.Columns = stored.shape[1:]
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.SharedFunctionalGroupsSequence = [group(1, -1024)]
    if per_frame is not None:
        ds.PerFrameFunctionalGroupsSequence = [group(*pair) for pair in per_frame]
    ds.PixelData = stored.astype(np.uint16).tobytes()
    out = io.BytesIO()
    ds.save_as(out, enforce_file_format=True)
    return out.getvalue()


def test_an_enhanced_multiframe_ct_comes_out_in_hounsfield_units(gcs: FakeGcsServer) -> None:
    """An Enhanced CT file keeps RescaleSlope and RescaleIntercept in its functional groups
    (shared, or one per frame), not at the top level: decode="dicom" gave the stored values
    (0..4095) for Hounsfield units (-1024..3071), with no error."""
    root = f"gs://{BUCKET}/enhanced-ct-{uuid.uuid4().hex[:8]}"
    options = gcs.storage_options()
    stored = np.random.default_rng(5).integers(0, 4096, (4, 6, 7))
    per_frame = [(1.0, -1024.0), (2.0, -1024.0), (1.0, -1000.0), (0.5, 0.0)]
    write(
        root,
        options,
        {
            "a-shared.dcm": enhanced_ct(stored, None),
            "b-per-frame.dcm": enhanced_ct(stored, per_frame),
            "c-wrong-count.dcm": enhanced_ct(stored, per_frame[:3]),
        },
    )
    dataset = RemoteDataset(root, decode="dicom", storage_options=options)
    shared, each = dataset[0], dataset[1]
    assert shared.dtype == np.float32 and shared.shape == (4, 6, 7)
    np.testing.assert_array_equal(shared, stored - 1024.0)
    expected = np.stack([stored[i] * s + b for i, (s, b) in enumerate(per_frame)])
    np.testing.assert_array_equal(each, expected.astype(np.float32))
    with pytest.raises(DecodeError, match=r"a rescale for each of 3 frames .*c-wrong-count"):
        dataset[2]


def test_a_group_that_is_not_one_volume_is_named(seaweed: S3Server) -> None:
    """A subject folder holding a T1 and a T2 series, one series of two echoes at each
    position, or a series with its localizer: sorted by position, their slices interleaved into
    a volume that is none of them."""
    root = f"s3://{BUCKET}/not-one-volume-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    value = np.arange(8 * 9, dtype=np.uint16).reshape(8, 9)
    objects = {}
    for s, series in enumerate(("1.2.826.0.1.1", "1.2.826.0.1.2")):
        for z in range(3):
            objects[f"sub-01/s{s}-IM{z}.dcm"] = ct_slice(
                value, z=2.5 * z, instance=z + 1, series=series
            )
        for echo in range(2):  # two echoes at each position, one series
            objects[f"sub-02/e{echo}-s{s}.dcm"] = ct_slice(
                value, z=2.5 * s, instance=2 * s + echo + 1, series="1.2.826.0.1.9"
            )
    for z in range(3):  # one series: stacks as before
        objects[f"sub-03/IM{z}.dcm"] = ct_slice(value, z=2.5 * z, instance=z + 1, series="1.2.3")
    for z in range(3):  # and a localizer of the same size, facing sideways
        objects[f"sub-04/IM{z}.dcm"] = ct_slice(value, z=2.5 * z, instance=z + 1, series="1.2.4")
    objects["sub-04/scout.dcm"] = ct_slice(
        value, z=0.0, instance=9, series="1.2.4", orientation=(0, 1, 0, 0, 0, -1)
    )
    for z in (-2, -1, 1):  # a slice that lost its position was put at 0 mm: between the others
        objects[f"sub-05/IM{z + 2}.dcm"] = ct_slice(value, z=10.0 * z, instance=z + 2)
    objects["sub-05/IM1.dcm"] = without_position(objects["sub-05/IM1.dcm"])
    write(root, options, objects)
    dataset = RemoteDataset(
        Groups(root, r"^(sub-\d+)/"), decode="dicom-series", storage_options=options
    )
    with pytest.raises(DecodeError, match=r"holds 2 DICOM series .*group the files by series"):
        dataset[0]
    with pytest.raises(DecodeError, match=r"e0-s0\.dcm and .*e1-s0\.dcm are at one position"):
        dataset[1]
    assert dataset[2].shape == (3, 8, 9)
    with pytest.raises(DecodeError, match=r"scout\.dcm faces another way .*a localizer"):
        dataset[3]
    with pytest.raises(DecodeError, match=r"IM1\.dcm gives no slice position .*IM0\.dcm does"):
        dataset[4]


def without_position(data: bytes) -> bytes:
    """A DICOM file without its ImagePositionPatient."""
    import pydicom

    ds = pydicom.dcmread(io.BytesIO(data))
    del ds.ImagePositionPatient
    out = io.BytesIO()
    ds.save_as(out, enforce_file_format=True)
    return out.getvalue()


def test_a_saved_manifest_keeps_the_grouping(
    seaweed: S3Server, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = f"s3://{BUCKET}/saved-groups-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    cell_painting(root, options)
    first = RemoteDataset(Groups(root, CHANNEL_RE), decode="tiff", storage_options=options)
    first.manifest.save(tmp_path / "m.npz")
    loaded = fastload.Manifest.load(tmp_path / "m.npz", url=root)
    grouping = loaded.kept["groups"]  # the rule that made it, and the groups
    assert grouping.tag.startswith("re:") and len(grouping.arrays["ends"]) == len(FIELDS)

    def no_grouping(*args: Any) -> None:
        raise AssertionError("grouped again")

    with monkeypatch.context() as patch:
        patch.setattr("fastload.sources.groups._group", no_grouping)
        again = RemoteDataset(Groups(loaded, CHANNEL_RE), decode="tiff", storage_options=options)
        assert [again.source[i] for i in range(len(again))] == [
            first.source[i] for i in range(len(first))
        ]
        with pytest.raises(AssertionError, match="grouped again"):  # another rule: grouped anew
            RemoteDataset(Groups(loaded, r"(.*)_ch\d"), decode="tiff", storage_options=options)
    other = RemoteDataset(Groups(loaded, r"(.*)_ch\d"), decode="tiff", storage_options=options)
    assert len(other) == len(FIELDS)
    assert loaded[:3].kept == {}  # a derived manifest has other entries: no grouping


def test_the_listing_a_dataset_saves_keeps_its_grouping_until_the_objects_change(
    seaweed: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing a Groups dataset saves beside its cache keeps the grouping, as a tar
    dataset's keeps its shards' indexes: the next start groups nothing. When the objects change,
    the listing checked behind that start is saved without it (a grouping names entries by
    position, which moved), and the start after groups the new listing."""
    root = f"s3://{BUCKET}/listed-groups-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    cell_painting(root, options)
    cache = Cache(tmp_path / "c", format="npy")

    def dataset() -> RemoteDataset:
        return RemoteDataset(
            Groups(root, CHANNEL_RE), decode="tiff", cache=cache, storage_options=options
        )

    first = dataset()
    (listing,) = (tmp_path / "c" / "manifests").glob("*.npz")
    assert Manifest.load(listing).kept["groups"].tag == first.manifest.kept["groups"].tag

    def no_grouping(*args: Any) -> None:
        raise AssertionError("grouped again")

    with monkeypatch.context() as patch:
        patch.setattr("fastload.sources.groups._group", no_grouping)
        again = dataset()
        assert [again.source[i] for i in range(len(again))] == [
            first.source[i] for i in range(len(first))
        ]
        assert again.listing_check is not None
        assert not again.listing_check.result(timeout=60).any

    new_field = {
        f"plate1/A01/f0_ch{c}.tiff": tiff(channel(FIELDS[0], c)) for c in range(1, CHANNELS + 1)
    }
    write(root, options, new_field)
    behind = dataset()  # this start keeps its saved listing and grouping ...
    assert len(behind) == len(FIELDS) and behind.listing_check is not None
    assert behind.listing_check.result(timeout=60).added == CHANNELS
    assert "groups" not in Manifest.load(listing).kept  # ... the new listing is saved without
    after = dataset()
    assert len(after) == len(FIELDS) + 1 and after.source[0].name == "plate1/A01/f0"
    assert [p.key for p in after.source[0].parts] == [
        f"plate1/A01/f0_ch{c}.tiff" for c in range(1, CHANNELS + 1)
    ]


def test_a_multiframe_file_and_a_folder_of_slices_give_one_shape(seaweed: S3Server) -> None:
    """A group of one Enhanced CT file came out of decode="dicom-series" as
    (1, frames, H, W), a folder of slices as (slices, H, W): a bucket holding both could not
    be batched. Both are (slices, H, W) now."""
    root = f"s3://{BUCKET}/mixed-dicom-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    stored = np.random.default_rng(9).integers(0, 4096, (4, 6, 7))
    objects = {"vol-a/enhanced.dcm": enhanced_ct(stored, None)}
    for z in range(4):
        objects[f"vol-b/IM{z}.dcm"] = ct_slice(stored[z], z=2.5 * z, instance=z + 1, slope=1)
    write(root, options, objects)
    dataset = RemoteDataset(
        Groups(root, r"^(vol-\w)/"), decode="dicom-series", storage_options=options
    )
    a, b = dataset[0], dataset[1]
    assert a.shape == b.shape == (4, 6, 7)
    np.testing.assert_array_equal(a, stored - 1024.0)
    (batch,) = list(fastload.DataLoader(dataset, batch_size=2, num_workers=0))
    assert tuple(batch.shape) == (2, 4, 6, 7)


def test_a_group_by_without_a_capture_group_that_names_channels_is_refused(
    seaweed: S3Server,
) -> None:
    """r"_ch\\d\\.tiff$" (no capture group) made 5 "samples" of 12 fields' channels each."""
    root = f"s3://{BUCKET}/no-capture-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    cell_painting(root, options)
    with pytest.raises(ConfigError, match=r"no capture group.*'_ch1\.tiff'.*\^\(\.\*\)"):
        RemoteDataset(Groups(root, r"_ch\d\.tiff$"), decode="tiff", storage_options=options)
    # a whole match that names the sample (no capture group) is still a group name
    dicom = {f"sub-{s:02d}/IM{i}.dcm": b"x" for s in range(3) for i in range(2)}
    write(f"{root}/dicom", options, dicom)
    by_prefix = RemoteDataset(Groups(f"{root}/dicom", r"^sub-\d+"), storage_options=options)
    assert [s.url.rsplit("/", 1)[-1] for s in map(by_prefix.source.__getitem__, range(3))] == [
        "sub-00",
        "sub-01",
        "sub-02",
    ]


def test_groups_without_a_label_are_left_out_and_named_under_incomplete_skip(
    seaweed: S3Server,
) -> None:
    """18 participants, 2 without a row in the label table: only a group_by callable could
    load them before."""
    root = f"s3://{BUCKET}/unlabelled-{uuid.uuid4().hex[:8]}"
    options = seaweed.storage_options()
    write(root, options, {f"sub-{s:02d}/IM{i}.dcm": b"x" for s in range(18) for i in range(2)})
    labels = {f"sub-{s:02d}": s % 2 for s in range(18) if s not in (4, 11)}
    with pytest.raises(ConfigError, match=r"2 of 18 groups .* no label .*incomplete='skip'"):
        RemoteDataset(Groups(root, r"^(sub-\d+)/"), labels=labels, storage_options=options)
    dataset = RemoteDataset(
        Groups(root, r"^(sub-\d+)/", incomplete="skip"),
        labels=labels,
        decode=len,
        storage_options=options,
    )
    assert len(dataset) == 16
    assert [dataset[i][1] for i in range(16)] == [labels[n] for n in sorted(labels)]
    assert dataset.stats()["dataset"]["left_out"] == [
        f"{root}/sub-04: incomplete group, no label",
        f"{root}/sub-11: incomplete group, no label",
    ]
