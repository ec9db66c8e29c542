"""Samples made of several objects: cell-painting fields of 5 channel images.

``fields`` fields x 5 channels, each a 16-bit 256x256 TIFF (128 KB), on loopback SeaweedFS
behind the proxy adding 30 ms per request; one object is truncated. Readers, one after another
in this process, each over the same objects:

- plain torch: a ``Dataset`` whose ``__getitem__`` reads a field's 5 objects one after another
  (s3fs ``cat_file``) and decodes them with tifffile (a truncated one: the field is dropped),
  ``torch.utils.data.DataLoader`` with 4 workers (fork), batch 16. No cache: every epoch is
  the same, so one epoch is timed.
- fastload groups: ``RemoteDataset(group_by=..., decode="tiff", on_error="skip",
  cache=Cache(format="npy"))`` and ``fastload.DataLoader`` defaults (batch 16, shuffled): a cold
  epoch (cache filling), then a warm one.
- fastload single objects: the same objects as single samples (``decode="tiff"``), batch 80
  (the same objects per batch); its rate is given in fields/s (objects/s / 5), to show what
  grouping costs.

Rates are fields per second over the epoch, first batch included.
"""

from __future__ import annotations

import io
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
from fastload.testing import FaultProxy, Faults, SeaweedS3Server

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


def group_rows(fields: int, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    keys = _keys(fields)
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
            progress("groups: plain torch, 4 workers")
            with warnings.catch_warnings():  # torch warns of 4 workers on 2 cores: asked for
                warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
                plain = DataLoader(
                    PlainFields(root, keys, options), batch_size=16, num_workers=4,
                    collate_fn=_drop_none, multiprocessing_context="fork",
                )  # fmt: skip
                seconds, count = _epoch(plain)
            rows.append(
                {
                    "reader": "plain torch, 5 serial GETs per field, 4 workers",
                    "epoch": "every",
                    "fields/s": count / seconds,
                    "fields": count,
                }
            )
            for name, group_by, batch, per in (
                ("fastload groups", GROUP_BY, 16, 1),
                (
                    "fastload single objects (fields/s = objects/s / 5)",
                    None,
                    16 * CHANNELS,
                    CHANNELS,
                ),
            ):
                cache = fastload.Cache(Path(tmp) / name.split()[1], format="npy")
                dataset = fastload.RemoteDataset(
                    manifest, group_by=group_by, decode="tiff", on_error="skip", cache=cache,
                    storage_options=options,
                )  # fmt: skip
                loader = fastload.DataLoader(
                    dataset, batch_size=batch, shuffle=True, collate_fn=_drop_none
                )
                for epoch in ("cold", "warm"):
                    progress(f"groups: {name}, {epoch}")
                    seconds, count = _epoch(loader)
                    rows.append(
                        {
                            "reader": name,
                            "epoch": epoch,
                            "fields/s": count / per / seconds,
                            "fields": count // per,
                        }
                    )
                    if group_by is None:
                        break  # single objects: the cold epoch is the comparison
    base = rows[0]["fields/s"]
    for row in rows:
        row["x plain torch"] = row["fields/s"] / base
    return rows


def run_groups(quick: bool, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    return group_rows(60 if quick else 600, progress)
