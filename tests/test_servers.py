"""The loopback servers behave like the real services, seen through the real clients.

s3fs against SeaweedFS and moto, gcsfs against fake-gcs-server, b2sdk against our B2 server:
list, read, range read, write, delete, missing objects and wrong credentials.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Callable
from typing import Any

import gcsfs
import pytest
import s3fs
from b2sdk.v2 import B2Api, InMemoryAccountInfo
from b2sdk.v2.exception import FileNotPresent, Unauthorized

from fastload.errors import ConfigError
from fastload.testing import B2Server, FakeGcsServer, S3Server
from tests.conftest import BUCKET

FsFactory = Callable[..., Any]


def s3_fs(server: S3Server, endpoint: str | None = None, **overrides: Any) -> s3fs.S3FileSystem:
    options = {**server.storage_options(endpoint), **overrides}
    return s3fs.S3FileSystem(skip_instance_cache=True, **options)


def gcs_fs(server: FakeGcsServer, endpoint: str | None = None) -> gcsfs.GCSFileSystem:
    return gcsfs.GCSFileSystem(skip_instance_cache=True, **server.storage_options(endpoint))


@pytest.fixture(params=["seaweedfs", "moto", "fake-gcs"])
def fs_and_root(request: pytest.FixtureRequest) -> tuple[Any, str]:
    if request.param == "fake-gcs":
        fs = gcs_fs(request.getfixturevalue("gcs"))
    else:
        fs = s3_fs(request.getfixturevalue("seaweed" if request.param == "seaweedfs" else "moto"))
    return fs, f"{BUCKET}/{uuid.uuid4().hex}"


def test_fsspec_write_list_read_range_delete(fs_and_root: tuple[Any, str]) -> None:
    fs, root = fs_and_root
    payloads = {
        f"{root}/part-{i}/sample-{j}.bin": os.urandom(1000 + i * 7 + j)
        for i in range(3)
        for j in range(4)
    }
    fs.pipe(payloads)
    found = sorted(fs.find(root))
    assert found == sorted(payloads)
    assert sorted(fs.ls(f"{root}/part-1", detail=False)) == sorted(
        k for k in payloads if "/part-1/" in k
    )
    key, data = next(iter(payloads.items()))
    assert fs.cat_file(key) == data
    assert fs.cat_file(key, start=10, end=50) == data[10:50]
    assert fs.info(key)["size"] == len(data)
    with fs.open(key, "rb") as handle:
        handle.seek(100)
        assert handle.read(25) == data[100:125]
    fs.rm(key)
    assert not fs.exists(key)
    with pytest.raises(FileNotFoundError):
        fs.cat_file(key)


def test_large_object_round_trip(fs_and_root: tuple[Any, str]) -> None:
    fs, root = fs_and_root
    data = os.urandom(12 * 1024 * 1024 + 3)  # above s3fs's multipart threshold
    with fs.open(f"{root}/big.bin", "wb") as handle:
        handle.write(data)
    assert fs.cat_file(f"{root}/big.bin") == data


def test_s3_rejects_wrong_credentials(seaweed: S3Server) -> None:
    # moto's server mode accepts any signature, so only SeaweedFS can say no.
    fs = s3_fs(seaweed, secret="not-the-secret")
    with pytest.raises(PermissionError):
        fs.ls(BUCKET, refresh=True)


def test_s3_missing_bucket_is_not_found(seaweed: S3Server) -> None:
    with pytest.raises(FileNotFoundError):
        s3_fs(seaweed).ls("fastload-no-such-bucket", refresh=True)


@pytest.mark.parametrize("server", ["seaweed", "moto"])
def test_an_invalid_bucket_name_is_named_not_a_server_that_failed_to_start(
    server: str, request: pytest.FixtureRequest
) -> None:
    """``create_bucket("b")``: the server's refusal of the name is a ConfigError naming it and
    why (it was a ServerStartError, as if the server had not come up); the server still runs."""
    s3: S3Server = request.getfixturevalue(server)
    with pytest.raises(ConfigError, match=r"'b' is not a valid S3 bucket name \(InvalidBucket"):
        s3.create_bucket("b")
    assert s3_fs(s3).ls(BUCKET, refresh=True) is not None


# -- B2 through b2sdk over real HTTP ---------------------------------------------------------
def test_b2_upload_list_download_range_delete(b2: B2Server) -> None:
    bucket = b2.api().get_bucket_by_name(BUCKET)
    prefix = uuid.uuid4().hex
    small = {
        f"{prefix}/d{i}/s{j}.bin": os.urandom(500 + 13 * i + j) for i in range(2) for j in range(3)
    }
    for name, data in small.items():
        bucket.upload_bytes(data, name)
    big = os.urandom(12 * 1024 * 1024 + 5)  # > the advertised 5 MB part size: a large file
    big_version = bucket.upload_bytes(big, f"{prefix}/big.bin")
    assert big_version.content_sha1 == "none"  # B2 marks files assembled from parts this way

    listed = {fv.file_name: fv.size for fv, _ in bucket.ls(prefix, recursive=True)}
    assert listed == {**{k: len(v) for k, v in small.items()}, f"{prefix}/big.bin": len(big)}

    def download(name: str, range_: tuple[int, int] | None = None) -> bytes:
        out = io.BytesIO()
        bucket.download_file_by_name(name, range_=range_).save(out)
        return out.getvalue()

    name, data = next(iter(small.items()))
    assert download(name) == data
    assert download(name, (7, 99)) == data[7:100]
    assert download(f"{prefix}/big.bin") == big
    assert download(f"{prefix}/big.bin", (5_000_000, 5_000_099)) == big[5_000_000:5_000_100]

    by_id = io.BytesIO()
    bucket.download_file_by_id(big_version.id_, range_=(3, 9)).save(by_id)
    assert by_id.getvalue() == big[3:10]

    version = bucket.get_file_info_by_name(name)
    bucket.delete_file_version(version.id_, name)
    with pytest.raises(FileNotPresent):
        download(name)


def test_b2_rejects_wrong_key(b2: B2Server) -> None:
    api = B2Api(InMemoryAccountInfo())
    with pytest.raises(Unauthorized):
        api.authorize_account(b2.endpoint, b2.key_id, "not-the-key")


@pytest.mark.parametrize("when", ["before it starts", "after it answers"])
def test_a_seaweedfs_that_loses_a_listeners_port_starts_again_on_fresh_ports(when: str) -> None:
    """weed mini checks its ports at start, and answers on S3 before all its listeners are
    bound: one that loses its port to another process then kills it (a CI run lost the Iceberg
    catalog's port so, and the first test's bucket could not be made). The start makes a
    bucket before it returns, so either loss is a lost port race there, retried on fresh
    ports. The second is simulated (a real one is a matter of timing): the server is killed as
    it answers, its log saying why."""
    import signal
    import socket

    from fastload.testing import SeaweedS3Server

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    commands: list[list[str]] = []

    class Raced(SeaweedS3Server):
        def command(self) -> list[str]:
            args = list(super().command())
            if not commands and when == "before it starts":
                at = next(i for i, a in enumerate(args) if a.startswith("-s3.port.iceberg="))
                args[at] = f"-s3.port.iceberg={port}"
            commands.append(args)
            return args

        def after_start(self) -> None:
            if len(commands) == 1 and when == "after it answers" and self.pid is not None:
                os.killpg(self.pid, signal.SIGKILL)
                assert self._proc is not None
                self._proc.wait()
                with self.log_path.open("a") as log:
                    log.write(f"Iceberg listener on 127.0.0.1:{port} error: listen tcp: bind: "
                              "address already in use\n")  # fmt: skip
            super().after_start()

    try:
        with Raced() as server:
            server.create_bucket("after-a-lost-race")
            assert server.client().list_objects_v2(Bucket="after-a-lost-race")["KeyCount"] == 0
    finally:
        taken.close()
    assert len(commands) == 2
