"""Run by test_xla_manifest under torch_xla.launch (no torch.distributed process group): each
ordinal builds the same manifest and records whether it listed the folder itself, then indexes
tar shards (its share of them) and records the bytes it read and the samples it holds."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch_xla
import torch_xla.runtime as xr

from fastload import Manifest, ObjectNotFoundError, RemoteDataset, Tar

_list = Manifest._list.__func__  # type: ignore[attr-defined]


def counting_list(cls: type[Manifest], url: str, **kwargs: Any) -> Manifest:
    Path(sys.argv[2], f"listed-{xr.global_ordinal()}").touch()
    return _list(cls, url, **kwargs)  # type: ignore[no-any-return]


def build(index: int, data: str, out_dir: str, tars: str) -> None:
    Manifest._list = classmethod(counting_list)  # type: ignore[method-assign,assignment]
    manifest = Manifest.build(data)
    try:
        Manifest.build(data + "/no-such-prefix")
        missing = "no error"
    except ObjectNotFoundError as exc:
        missing = type(exc).__name__
    shards = RemoteDataset(Tar(f"file://{tars}"))
    record = {
        "keys": manifest.keys(),
        "fingerprint": manifest.fingerprint,
        "missing": missing,
        "index_bytes": shards.fetcher.counters.bytes,
        "samples": [shards.source.identities([i])[0][0] for i in range(len(shards))],
    }
    Path(out_dir, f"manifest-{xr.global_ordinal()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    torch_xla.launch(build, args=(sys.argv[1], sys.argv[2], sys.argv[3]))
