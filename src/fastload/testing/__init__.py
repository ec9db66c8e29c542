"""Real object-store servers on loopback and a fault-injecting proxy, for tests, benchmarks, demo.

Each server starts on free ports in its own child process with a bounded start-up wait (a
server that fails to start raises :class:`fastload.ServerStartError` with its log tail) and is
stopped by PID, on ``stop()``, on leaving its ``with`` block, or at interpreter exit.

Needs ``pip install 'fastload[testing]'``.
"""

from __future__ import annotations

from fastload.errors import ServerStartError
from fastload.testing._process import ServerProcess, free_port, tree_cpu_seconds, tree_pss_kib
from fastload.testing.b2 import B2Server
from fastload.testing.gcs import FakeGcsServer
from fastload.testing.proxy import FaultProxy, Faults
from fastload.testing.s3 import MotoS3Server, S3Server, SeaweedS3Server

__all__ = [
    "B2Server",
    "FakeGcsServer",
    "FaultProxy",
    "Faults",
    "MotoS3Server",
    "S3Server",
    "SeaweedS3Server",
    "ServerProcess",
    "ServerStartError",
    "free_port",
    "tree_cpu_seconds",
    "tree_pss_kib",
]
