"""The shards' indexes as a manifest keeps them (its ``"shards"`` slot, see
:meth:`fastload.Manifest.keeping`), so that a saved manifest starts a dataset without reading
its shards again, on another host too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fastload.manifest import Entry, Kept, Manifest, Strings

__all__ = ["SLOT", "ShardIndexes"]

SLOT = "shards"


@dataclass(frozen=True)
class ShardIndexes:
    """The indexes' version, each indexed shard's key and version, and per array name the
    arrays of all shards end to end (shard ``i``'s are ``values[ends[i-1]:ends[i]]``)."""

    version: str
    keys: Strings
    versions: Strings
    values: dict[str, np.ndarray]
    ends: dict[str, np.ndarray]

    @classmethod
    def of(
        cls, version: str, indexes: Sequence[tuple[Entry, dict[str, np.ndarray]]]
    ) -> ShardIndexes:
        names = sorted(indexes[0][1]) if indexes else []  # every index of a version has these
        values = {n: np.concatenate([index[n] for _, index in indexes]) for n in names}
        ends = {n: np.cumsum([len(i[n]) for _, i in indexes], dtype=np.int64) for n in names}
        keys = Strings.of([entry.key for entry, _ in indexes])
        versions = Strings.of([entry.version for entry, _ in indexes])
        return cls(version, keys, versions, values, ends)

    @classmethod
    def kept_by(cls, manifest: Manifest) -> ShardIndexes | None:
        """The indexes ``manifest`` keeps, if any."""
        kept = manifest.kept.get(SLOT)
        if kept is None:
            return None
        a = kept.arrays
        names = [k.removeprefix("values.") for k in a if k.startswith("values.")]
        return cls(
            kept.tag,
            Strings(a["key_blob"], a["key_ends"]),
            Strings(a["version_blob"], a["version_ends"]),
            {n: a[f"values.{n}"] for n in names},
            {n: a[f"ends.{n}"] for n in names},
        )

    def kept(self) -> Kept:
        """These indexes as a manifest keeps them (each names its shard: kept by key)."""
        arrays = {
            "key_blob": self.keys.blob,
            "key_ends": self.keys.ends,
            "version_blob": self.versions.blob,
            "version_ends": self.versions.ends,
        }
        for name, values in self.values.items():
            arrays[f"values.{name}"] = values
            arrays[f"ends.{name}"] = self.ends[name]
        return Kept(self.version, arrays, by_key=True)

    def lookup(self, version: str) -> dict[tuple[str, str], dict[str, np.ndarray]]:
        """Each shard's index by (key, version), when they are of ``version`` (else none)."""
        if version != self.version:
            return {}
        out: dict[tuple[str, str], dict[str, np.ndarray]] = {}
        for i, shard in enumerate(zip(self.keys.tolist(), self.versions.tolist(), strict=True)):
            out[shard] = {
                n: values[(int(self.ends[n][i - 1]) if i else 0) : int(self.ends[n][i])]
                for n, values in self.values.items()
            }
        return out
