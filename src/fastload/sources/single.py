"""One object, one sample: :class:`Objects`, what a URL or a Manifest alone reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastload.fetcher import Fetcher
from fastload.manifest import Manifest
from fastload.sources import Opening, Part, Sample, Source, read_objects
from fastload.sources.labels import labelled

__all__ = ["Objects", "SingleObjects"]


@dataclass(frozen=True, eq=False)
class Objects(Source):
    """Each object is a sample; ``decode`` receives its bytes (see :class:`Source` for the
    arguments). ``RemoteDataset("s3://b/train/")`` is ``RemoteDataset(Objects("s3://b/train/"))``."""

    name = "objects"
    refreshable = True
    takes_labels = True
    default_decode = "npy"

    def open(self, manifest: Manifest, opening: Opening) -> SingleObjects:
        if opening.labels is not None:
            manifest = labelled(manifest, opening.labels)
        return SingleObjects(manifest)


class SingleObjects:
    """Each object of ``manifest`` is a sample; ``decode`` receives its bytes."""

    reader_version = ""
    blocks = None

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.root = manifest.root
        self.classes = manifest.classes
        self.left_out: list[str] = []

    def __len__(self) -> int:
        return len(self.manifest)

    def __getitem__(self, index: int) -> Sample:
        e = self.manifest[index]
        part = Part(e.key, e.url, e.size, e.version)
        return Sample(e.key, e.url, e.version, (part,), e.label, index)

    def identities(self, indices: Sequence[int]) -> list[tuple[str, str, int | None]]:
        return self.manifest.identities(indices)

    def read(self, samples: Sequence[Sample], fetcher: Fetcher) -> list[Any]:
        return read_objects(samples, fetcher, lambda sample, bodies: bodies[0])

    def nbytes(self, indices: Sequence[int] | np.ndarray) -> int:
        return int(self.manifest.sizes[np.asarray(indices, dtype=np.int64)].sum())

    def uncached(self) -> None:
        pass  # nothing it reads is let go for the cache
