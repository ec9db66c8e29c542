"""Session-wide loopback servers. Each is started once, on free ports, and stopped by PID."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import subprocess

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # before gcsfs is imported
# Hedging by observed latency is on by default; on a loaded 2-core test machine it sends a
# second request for a read the scheduler held, which the many tests that count requests would
# see as extra. Tests of hedging give their FetchConfig (test_fetch.py, benchmarks/tails.py);
# every other test (and its subprocesses) reads without it.
os.environ["FASTLOAD_FETCH_HEDGE_BUDGET"] = "0"

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload import RemoteDataset
from fastload.stores import filesystem
from fastload.testing import B2Server, FakeGcsServer, MotoS3Server, SeaweedS3Server

BUCKET = "fastload-test"


@pytest.fixture(autouse=True)
def _fresh_loader_epochs() -> Iterator[None]:
    """Each test starts as a fresh process does: no shuffled loader has taken an epoch yet."""
    from fastload.loader import _Epochs

    _Epochs._next.clear()
    yield


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


@pytest.fixture(params=["s3", "gcs", "b2"])
def store(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """A fresh root on SeaweedFS, fake-gcs-server and the B2 server in turn, and its options."""
    scheme, server = {
        "s3": ("s3", "seaweed"),
        "gcs": ("gs", "gcs"),
        "b2": ("b2", "b2"),
    }[request.param]
    options = request.getfixturevalue(server).storage_options()
    module = request.node.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    return f"{scheme}://{BUCKET}/{module}-{uuid.uuid4().hex[:8]}", options


def write(root: str, options: dict[str, Any], objects: dict[str, bytes]) -> None:
    """Put ``objects`` ({key relative to root: body}) under ``root``."""
    fs = filesystem(root, options)
    base = fs._strip_protocol(root)
    fs.pipe({f"{base}/{key}": body for key, body in objects.items()})


def assert_identities(dataset: RemoteDataset, indices: list[int]) -> None:
    """A source names its samples for the cache as its samples name themselves."""
    samples = [dataset.source[i] for i in indices]
    expected = [(s.url, s.version, s.label) for s in samples]
    assert dataset.source.identities(indices) == expected


@contextlib.contextmanager
def small_tmpfs(disk: Path, size: str) -> Iterator[Path]:
    """A real file system of ``size`` (tmpfs, e.g. "1m") at ``disk``: writes past it fail with
    ENOSPC, as on a full disk. Skips the test where it cannot be mounted (it needs root)."""
    disk.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]
    mounted = subprocess.run(command, check=False, capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def in_forked_child(call: Callable[[], Any]) -> Any:
    """What ``call()`` returns in a child forked from this process (state a fork must not
    carry over: clients, clocks, handles)."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=lambda: queue.put(call()))
    child.start()
    result = queue.get(timeout=60)
    child.join(60)
    return result
