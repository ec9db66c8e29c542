"""One object, one sample: the source behind a plain :class:`fastload.RemoteDataset`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastload.fetcher import Fetcher
from fastload.manifest import Manifest
from fastload.sources import Part, Sample, read_objects

__all__ = ["SingleObjects"]


class SingleObjects:
    """Each object of ``manifest`` is a sample; ``decode`` receives its bytes."""

    reader_version = ""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.root = manifest.root
        self.classes = manifest.classes

    def __len__(self) -> int:
        return len(self.manifest)

    def __getitem__(self, index: int) -> Sample:
        e = self.manifest[index]
        part = Part(e.key, e.url, e.size, e.version)
        return Sample(e.key, e.url, e.version, (part,), e.label, index)

    def identities(self, indices: Sequence[int]) -> list[tuple[str, str, int | None]]:
        return self.manifest.identities(indices)

    blocks = None

    def read(self, samples: Sequence[Sample], fetcher: Fetcher) -> list[Any]:
        return read_objects(samples, fetcher, lambda sample, bodies: bodies[0])
