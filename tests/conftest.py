"""Session-wide loopback servers. Each is started once, on free ports, and stopped by PID."""

from __future__ import annotations

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported

from collections.abc import Iterator

import pytest

from fastload.testing import B2Server, FakeGcsServer, MotoS3Server, SeaweedS3Server

BUCKET = "fastload-test"


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedS3Server]:
    with SeaweedS3Server() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="session")
def moto() -> Iterator[MotoS3Server]:
    with MotoS3Server() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="session")
def gcs() -> Iterator[FakeGcsServer]:
    with FakeGcsServer() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="session")
def b2() -> Iterator[B2Server]:
    with B2Server() as server:
        server.create_bucket(BUCKET)
        yield server
