"""The data behind the URLs that the docs' examples read (tests/test_docs.py).

Each URL a ```python block of README.md or docs/*.md names has an entry in :data:`DATA`: the
objects the store holds under it (small, shaped as the example expects) and the local files
the example names beside it (``labels.csv``, ``participants.csv``). A block that names a URL
missing here fails, saying to add it, so a new example cannot run against nothing.
"""

from __future__ import annotations

import csv
import io
import tarfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Objects = dict[str, bytes]


@dataclass(frozen=True)
class Data:
    """What lies under one URL: ``objects()`` (keys relative to the URL) and ``files``, the
    local files (name -> text) an example reads beside it."""

    objects: Callable[[], Objects]
    files: Mapping[str, str] = field(default_factory=dict)


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def _jpeg(array: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(array).save(out, format="JPEG")
    return out.getvalue()


def _tiff(array: np.ndarray) -> bytes:
    import tifffile

    out = io.BytesIO()
    tifffile.imwrite(out, array)
    return out.getvalue()


def _csv(header: list[str], rows: list[list[object]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


# s3://bucket/train: 64 arrays of 3 x 32 x 32 float32, labels 0-3 in labels.csv
TRAIN = 64


def npy_train() -> Objects:
    rng = _rng(0)
    return {f"{i:05d}.npy": _npy(rng.random((3, 32, 32), dtype=np.float32)) for i in range(TRAIN)}


TRAIN_LABELS = _csv(["key", "label"], [[f"{i:05d}.npy", i % 4] for i in range(TRAIN)])


def images(size: int, count: int, classes: tuple[str, ...] = ()) -> Callable[[], Objects]:
    """``count`` RGB JPEGs of ``size`` x ``size`` per class folder (or at the root)."""

    def make() -> Objects:
        rng = _rng(size)
        folders = [f"{name}/" for name in classes] or [""]
        return {
            f"{folder}{i:04d}.jpg": _jpeg(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
            for folder in folders
            for i in range(count)
        }

    return make


def fields() -> Objects:
    """Cell painting: wells A01 and A02, two fields each, five 16-bit channels a field."""
    rng = _rng(5)
    return {
        f"{well}/f{f}_ch{c}.tiff": _tiff(rng.integers(0, 65536, (256, 256), dtype=np.uint16))
        for well in ("A01", "A02")
        for f in (1, 2)
        for c in range(1, 6)
    }


PARTICIPANTS = ("sub-01", "sub-02", "sub-03", "sub-04")


def dicom_series() -> Objects:
    """A CT series of 16 x 16 slices per participant, 3 or 4 slices (volumes differ)."""
    from fastload.testing.dicom import ct_slice

    rng = _rng(7)
    objects: Objects = {}
    for p, participant in enumerate(PARTICIPANTS):
        for s in range(3 + p % 2):
            value = rng.integers(0, 2000, (16, 16), dtype=np.uint16)
            key = f"{participant}/ses-1/IM{s + 1:04d}.dcm"
            objects[key] = ct_slice(value, z=2.5 * s, instance=s + 1, series=f"1.2.3.{p}")
    return objects


DIAGNOSES = _csv(
    ["participant_id", "diagnosis"],
    [
        [participant, "glaucoma" if i % 2 else "control"]
        for i, participant in enumerate(PARTICIPANTS)
    ],
)


def tar_shards(names: list[str], per_shard: int) -> Callable[[], Objects]:
    """WebDataset shards: ``per_shard`` samples of a 16 x 16 JPEG and its class each."""

    def make() -> Objects:
        rng = _rng(len(names))
        objects: Objects = {}
        for s, name in enumerate(names):
            out = io.BytesIO()
            with tarfile.open(fileobj=out, mode="w") as tar:
                for i in range(per_shard):
                    sample = f"{s * per_shard + i:08d}"
                    image = _jpeg(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))
                    for ext, body in (("jpg", image), ("cls", str(i % 3).encode())):
                        info = tarfile.TarInfo(f"{sample}.{ext}")
                        info.size = len(body)
                        tar.addfile(info, io.BytesIO(body))
            objects[name] = out.getvalue()
        return objects

    return make


def events() -> Objects:
    """IceCube-like events: one row per pulse, 3 files of 12 events of 2-9 pulses each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = _rng(9)
    objects: Objects = {}
    for f in range(3):
        ids, times, sensors = [], [], []
        for e in range(12):
            pulses = int(rng.integers(2, 10))
            ids += [f * 1000 + e] * pulses
            times += sorted(rng.random(pulses).tolist())
            sensors += rng.integers(0, 5160, pulses).tolist()
        table = pa.table(
            {
                "event_id": pa.array(ids, pa.int64()),
                "time": pa.array(times, pa.float32()),
                "sensor_id": pa.array(sensors, pa.int16()),
            }
        )
        out = io.BytesIO()
        pq.write_table(table, out, row_group_size=20)
        objects[f"batch_{f + 1}.parquet"] = out.getvalue()
    return objects


def oct_volumes() -> Objects:
    """A Zarr v3 group holding ``scans``: 6 B-scans of 64 x 88, uint16, in chunks of 2 x 64 x 44
    (88 is no multiple of the examples' 32: the last 24 columns are in no patch)."""
    import zarr

    stored: dict[str, Any] = {}
    group = zarr.open_group(zarr.storage.MemoryStore(stored), mode="w")
    scans = group.create_array("scans", shape=(6, 64, 88), chunks=(2, 64, 44), dtype="uint16")
    scans[:] = _rng(52).integers(0, 4096, (6, 64, 88), dtype=np.uint16)
    return {key: buffer.to_bytes() for key, buffer in stored.items()}


IMAGENET_CLASSES = ("n01440764", "n01443537", "n01484850")

DATA: dict[str, Data] = {
    "s3://bucket/train": Data(npy_train, {"labels.csv": TRAIN_LABELS}),
    "s3://bucket/val": Data(images(32, 6)),
    "s3://bucket/imagenet/train": Data(images(64, 4, IMAGENET_CLASSES)),
    # the validation split lacks the middle class: its codes follow train.classes only if told
    "s3://bucket/imagenet/val": Data(images(64, 2, IMAGENET_CLASSES[::2])),
    "s3://bucket/imagenet-wds/train/shard-{000000..000146}.tar": Data(
        tar_shards([f"shard-{i:06d}.tar" for i in range(147)], 2)
    ),
    # a training and a validation split of shards side by side: pattern= picks one
    "s3://bucket/wds": Data(tar_shards(["train-0.tar", "train-1.tar", "val-0.tar"], 2)),
    "gs://bucket/shard-{000..099}.tar": Data(
        tar_shards([f"shard-{i:03d}.tar" for i in range(100)], 1)
    ),
    "s3://lab/plate1": Data(fields),
    "s3://lab/cellpainting/plate1": Data(fields),
    "b2://study/scans": Data(dicom_series),
    "b2://oct-study/scans": Data(dicom_series, {"participants.csv": DIAGNOSES}),
    "s3://bucket/events": Data(events),
    "s3://icecube/train": Data(events),
    "s3://lab/oct.zarr": Data(oct_volumes),
}
"""Every URL the examples read, exactly as they write it (a trailing ``/`` aside)."""


def root_of(url: str) -> str:
    """Where ``url``'s objects lie: a brace list names keys under the folder before it."""
    url = url.rstrip("/")
    return url.rsplit("/", 1)[0] if "{" in url else url
