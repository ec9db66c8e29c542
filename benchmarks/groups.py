r"""Samples made of several objects: cell-painting fields of 5 channel images.

``fields`` fields x 5 channels, each a 16-bit 256x256 TIFF (128 KB), on loopback SeaweedFS
behind the proxy adding 30 ms per request; one object is truncated. Readers, one after another
in this process, each over the same objects:

- plain torch: a ``Dataset`` whose ``__getitem__`` reads a field's 5 objects one after another
  (s3fs ``cat_file``) and decodes them with tifffile (a truncated one: the field is dropped),
  ``torch.utils.data.DataLoader`` with 4 workers (fork), batch 16. No cache: every epoch is
  the same, so one epoch is timed.
- fastload groups: ``RemoteDataset(Groups(url, by=...), decode="tiff", on_error="skip",
  cache=Cache(format="npy"))`` and ``fastload.DataLoader`` defaults (batch 16, shuffled): a cold
  epoch (cache filling), then a warm one.
- fastload single objects: the same objects as single samples (``decode="tiff"``), batch 80
  (the same objects per batch); its rate is given in fields/s (objects/s / 5), to show what
  grouping costs.

Rates are fields per second over the epoch, first batch included.

The ``dicom`` scenario: ``volumes`` DICOM series of 40-60 CT-like slices (16-bit 256x256, about
128 KB a file, file names not in slice order) on our B2 server behind the proxy adding 20 ms per
request and capping each response at 20 MB/s. Readers, batch 2, shuffled:

- sequential: a ``Dataset`` whose ``__getitem__`` reads a volume's slices one after another
  with the b2 filesystem (b2sdk underneath) and stacks them with pydicom by slice position,
  ``torch.utils.data.DataLoader`` with 2 workers; every epoch is the same, so one is timed.
- fastload: ``RemoteDataset(Groups(url, by=r"^(sub-\d+)/", incomplete="accept"),
  decode="dicom-series", cache=Cache(format="npy"))`` (series lengths differ by nature) and
  ``fastload.DataLoader`` defaults: a cold epoch, then a warm one.
"""

from __future__ import annotations

import io
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tifffile
import torch
from torch.utils.data import DataLoader, Dataset

import fastload
from fastload.stores import filesystem
from fastload.testing import B2Server, FaultProxy, Faults, SeaweedS3Server
from fastload.testing.dicom import ct_slice

BUCKET = "fastload-bench"
CHANNELS = 5
SHAPE = (256, 256)
LATENCY = 0.030
GROUP_BY = r"(.*)_ch\d\.tiff$"


def _tiff(field: int, channel: int) -> bytes:
    rng = np.random.default_rng(field * CHANNELS + channel)
    out = io.BytesIO()
    tifffile.imwrite(out, rng.integers(0, 65536, SHAPE, dtype=np.uint16))
    return out.getvalue()


def _keys(fields: int) -> list[str]:
    return [
        f"plate{f // 96}/{chr(65 + f % 96 // 12)}{f % 12:02d}/f{f}_ch{c}.tiff"
        for f in range(fields)
        for c in range(1, CHANNELS + 1)
    ]


class PlainFields(Dataset[Any]):
    """What users write today: a field's channels read one after another."""

    def __init__(self, root: str, keys: list[str], options: dict[str, Any]) -> None:
        self.root, self.keys, self.options = root, keys, options

    def __len__(self) -> int:
        return len(self.keys) // CHANNELS

    def __getitem__(self, index: int) -> Any:
        fs = filesystem(self.root, self.options)
        base = fs._strip_protocol(self.root)
        try:
            channels = [
                tifffile.imread(io.BytesIO(fs.cat_file(f"{base}/{key}")))
                for key in self.keys[index * CHANNELS : (index + 1) * CHANNELS]
            ]
        except Exception:  # the truncated object: drop the field
            return None
        return torch.from_numpy(np.stack(channels).astype(np.int32))


def _drop_none(batch: list[Any]) -> Any:
    return [item for item in batch if item is not None]


def _epoch(loader: Any) -> tuple[float, int]:
    started = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    return time.perf_counter() - started, count


def group_rows(
    fields: int, progress: Callable[[str], None], repeats: int = 1
) -> list[dict[str, Any]]:
    """Every reader ``repeats`` times, interleaved; the median rate of each (reader, epoch)."""
    keys = _keys(fields)
    runs: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp, SeaweedS3Server() as server:
        server.create_bucket(BUCKET)
        root = f"s3://{BUCKET}/fields"
        fs = filesystem(root, server.storage_options())
        bodies = {
            f"{BUCKET}/fields/{k}": _tiff(i // CHANNELS, i % CHANNELS) for i, k in enumerate(keys)
        }
        bodies[f"{BUCKET}/fields/{keys[7]}"] = bodies[f"{BUCKET}/fields/{keys[7]}"][:1000]
        progress(f"groups: uploading {len(keys)} objects")
        fs.pipe(bodies)
        with FaultProxy(server.endpoint, flavor="s3", faults=Faults(latency=LATENCY)) as proxy:
            options = server.storage_options(proxy.endpoint)
            manifest = fastload.Manifest.build(root, storage_options=options)
            for repeat in range(repeats):
                progress(f"groups: repeat {repeat + 1}/{repeats}")
                work = Path(tmp) / str(repeat)
                runs.append([_plain(root, keys, options), *_fastload(manifest, options, work)])
    return medians(runs, "fields/s", "x plain torch")


def _plain(root: str, keys: list[str], options: dict[str, Any]) -> dict[str, Any]:
    with warnings.catch_warnings():  # torch warns of 4 workers on 2 cores: asked for
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        plain = DataLoader(
            PlainFields(root, keys, options), batch_size=16, num_workers=4,
            collate_fn=_drop_none, multiprocessing_context="fork",
        )  # fmt: skip
        seconds, count = _epoch(plain)
    return {
        "reader": "plain torch, 5 serial GETs per field, 4 workers",
        "epoch": "every",
        "fields/s": count / seconds,
        "fields": count,
    }


def _fastload(
    manifest: fastload.Manifest, options: dict[str, Any], work: Path
) -> list[dict[str, Any]]:
    rows = []
    for name, source, batch, per in (
        ("fastload groups", fastload.Groups(manifest, GROUP_BY), 16, 1),
        (
            "fastload single objects (fields/s = objects/s / 5)",
            fastload.Objects(manifest),
            16 * CHANNELS,
            CHANNELS,
        ),
    ):
        cache = fastload.Cache(work / name.split()[1], format="npy")
        dataset = fastload.RemoteDataset(
            source, decode="tiff", on_error="skip", cache=cache, storage_options=options
        )
        loader = fastload.DataLoader(dataset, batch_size=batch, shuffle=True, collate_fn=_drop_none)
        grouped = isinstance(source, fastload.Groups)
        for epoch in ("cold", "warm") if grouped else ("cold",):  # singles: cold compares
            seconds, count = _epoch(loader)
            rows.append(
                {
                    "reader": name,
                    "epoch": epoch,
                    "fields/s": count / per / seconds,
                    "fields": count // per,
                }
            )
    return rows


def medians(runs: list[list[dict[str, Any]]], rate: str, ratio: str) -> list[dict[str, Any]]:
    """One row per reader and epoch: the median ``rate`` over the runs, and its ratio to the
    first row's (the baseline's) median."""
    rows = [
        {**same[0], rate: statistics.median(r[rate] for r in same), "runs": len(same)}
        for same in zip(*runs, strict=True)
    ]
    for row in rows:
        row[ratio] = row[rate] / rows[0][rate]
    return rows


DICOM_LATENCY = 0.020
DICOM_BANDWIDTH = 20e6  # bytes/s per response
DICOM_SHAPE = (256, 256)


def _series(volumes: int) -> dict[str, bytes]:
    objects = {}
    for v in range(volumes):
        rng = np.random.default_rng(v)
        slices = int(rng.integers(40, 61))
        for name, z in enumerate(rng.permutation(slices)):  # names not in slice order
            value = rng.integers(0, 4096, DICOM_SHAPE, dtype=np.uint16)
            objects[f"sub-{v:02d}/ses-1/IM{name:04d}.dcm"] = ct_slice(
                value, z=2.5 * z, instance=z + 1
            )
    return objects


class SequentialSeries(Dataset[Any]):
    """What users write today: a volume's slices read one after another, then stacked."""

    def __init__(self, root: str, series: list[list[str]], options: dict[str, Any]) -> None:
        self.root, self.series, self.options = root, series, options

    def __len__(self) -> int:
        return len(self.series)

    def __getitem__(self, index: int) -> Any:
        import pydicom  # noqa: PLC0415 (the dicom extra)

        fs = filesystem(self.root, self.options)
        base = fs._strip_protocol(self.root)
        slices = [
            pydicom.dcmread(io.BytesIO(fs.cat_file(f"{base}/{key}"))) for key in self.series[index]
        ]
        slices.sort(key=lambda ds: float(ds.ImagePositionPatient[2]))
        return torch.from_numpy(
            np.stack([ds.pixel_array for ds in slices]).astype(np.float32) - 1024
        )


def dicom_rows(
    volumes: int, progress: Callable[[str], None], repeats: int = 1
) -> list[dict[str, Any]]:
    """Both readers ``repeats`` times, interleaved; the median rate of each (reader, epoch)."""
    objects = _series(volumes)
    series: dict[str, list[str]] = {}
    for key in objects:
        series.setdefault(key.split("/")[0], []).append(key)
    runs: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp, B2Server() as server:
        server.create_bucket(BUCKET)
        root = f"b2://{BUCKET}/scans"
        progress(f"dicom: uploading {len(objects)} slices of {volumes} volumes")
        fs = filesystem(root, server.storage_options())
        fs.pipe({f"{BUCKET}/scans/{k}": body for k, body in objects.items()})
        faults = Faults(latency=DICOM_LATENCY, bandwidth=DICOM_BANDWIDTH)
        with FaultProxy(server.endpoint, flavor="b2", faults=faults) as proxy:
            options = server.storage_options(proxy.endpoint)
            for repeat in range(repeats):
                progress(f"dicom: repeat {repeat + 1}/{repeats}")
                plain = DataLoader(
                    SequentialSeries(root, [series[k] for k in sorted(series)], options),
                    batch_size=2, shuffle=True, num_workers=2, collate_fn=list,
                    multiprocessing_context="fork",
                )  # fmt: skip
                seconds, count = _epoch(plain)
                run = [
                    {"reader": "sequential slices, 2 workers", "epoch": "every",
                     "volumes/s": count / seconds, "volumes": count}
                ]  # fmt: skip
                dataset = fastload.RemoteDataset(
                    fastload.Groups(root, r"^(sub-\d+)/", incomplete="accept"),
                    decode="dicom-series",
                    cache=fastload.Cache(Path(tmp) / str(repeat), format="npy"),
                    storage_options=options,
                )
                loader = fastload.DataLoader(dataset, batch_size=2, shuffle=True, collate_fn=list)
                for epoch in ("cold", "warm"):
                    seconds, count = _epoch(loader)
                    run.append(
                        {"reader": "fastload Groups + dicom-series", "epoch": epoch,
                         "volumes/s": count / seconds, "volumes": count}
                    )  # fmt: skip
                runs.append(run)
    return medians(runs, "volumes/s", "x sequential")


def run_dicom(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return dicom_rows(4, progress) if quick else dicom_rows(24, progress, repeats=3)


def run_groups(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return group_rows(60, progress) if quick else group_rows(600, progress, repeats=3)
