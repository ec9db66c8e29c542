"""fsspec's own test suite for filesystem implementations, run on ``b2://`` against our
loopback B2 server (as s3fs runs it on moto and gcsfs on its fake GCS): copy, get, put, pipe
and open, 137 tests over the semantics every fsspec filesystem is expected to share."""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import Callable

import fsspec
import fsspec.tests.abstract as abstract
import pytest

from fastload.stores.b2 import B2FileSystem
from fastload.testing import B2Server
from tests.conftest import BUCKET


class B2Fixtures(abstract.AbstractFixtures):  # type: ignore[misc]  # fsspec is untyped
    """The fixtures fsspec's abstract tests ask of an implementation: the filesystem, a fresh
    folder for each test, how paths join, and that B2 has no empty folders (they are virtual:
    a folder exists while a name below it does)."""

    @pytest.fixture
    def fs(self, b2: B2Server) -> B2FileSystem:
        fs = fsspec.filesystem("b2", **b2.storage_options())  # as users get it: cached
        assert isinstance(fs, B2FileSystem)
        return fs

    @pytest.fixture
    def fs_path(self) -> str:
        return f"{BUCKET}/fsspec-abstract-{uuid.uuid4().hex[:8]}"

    @pytest.fixture
    def fs_join(self) -> Callable[..., str]:
        return posixpath.join

    @pytest.fixture
    def supports_empty_directories(self) -> bool:
        return False


class TestB2Copy(abstract.AbstractCopyTests, B2Fixtures):  # type: ignore[misc]
    pass


class TestB2Get(abstract.AbstractGetTests, B2Fixtures):  # type: ignore[misc]
    pass


class TestB2Put(abstract.AbstractPutTests, B2Fixtures):  # type: ignore[misc]
    pass


class TestB2Pipe(abstract.AbstractPipeTests, B2Fixtures):  # type: ignore[misc]
    pass


class TestB2Open(abstract.AbstractOpenTests, B2Fixtures):  # type: ignore[misc]
    pass
