"""One object, one sample: the source behind a plain :class:`fastload.RemoteDataset`."""

from __future__ import annotations

from collections.abc import Sequence

from fastload.manifest import Manifest
from fastload.sources import Part, Sample

__all__ = ["SingleObjects"]


class SingleObjects:
    """Each object of ``manifest`` is a sample; ``decode`` receives its bytes."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.root = manifest.root
        self.classes = manifest.classes

    def __len__(self) -> int:
        return len(self.manifest)

    def __getitem__(self, index: int) -> Sample:
        e = self.manifest[index]
        return Sample(e.key, e.url, e.version, (Part(e.key, e.url, e.size),), e.label)

    def payload(self, sample: Sample, bodies: Sequence[bytes]) -> bytes:
        return bodies[0]
