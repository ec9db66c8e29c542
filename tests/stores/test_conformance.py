"""Every store through the same conformance suite, directly and through the fault proxy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fastload.stores.s3 import FAST_PATH
from fastload.testing import B2Server, FakeGcsServer, FaultProxy, Faults, S3Server
from tests.conftest import BUCKET
from tests.stores.conformance import (
    BucketConformance,
    BucketErrorConformance,
    Case,
    CredentialConformance,
    DeniedErrorConformance,
    FaultErrorConformance,
    FetchConformance,
    ManifestConformance,
    StoreErrorConformance,
    fresh,
)

BAD_SECRET = "wrong-secret-0b7e"
# The fault mix: 5% 503, 2% resets, 2% truncated bodies (every byte must still match).
FAULTS = Faults(error_503=0.05, reset=0.02, truncate=0.02, seed=7)


def s3_case(server: S3Server, proxy: FaultProxy | None = None, *, obstore: bool = True) -> Case:
    """``obstore=False``: the S3 store's general path, s3fs alone (the store's own option)."""

    def via(endpoint: str | None) -> dict[str, Any]:
        return {**server.storage_options(endpoint), FAST_PATH: obstore}

    return Case(
        root=fresh(f"s3://{BUCKET}"),
        write_options=server.storage_options(),
        read_options=via(proxy.endpoint if proxy else None),
        proxy=proxy,
        bad_secret=BAD_SECRET,
        bad_options={**via(None), "secret": BAD_SECRET},
        upstream=server.endpoint,
        flavor="s3",
        via=via,
    )


def s3fs_case(server: S3Server, proxy: FaultProxy | None = None) -> Case:
    return s3_case(server, proxy, obstore=False)


def gcs_case(server: FakeGcsServer, proxy: FaultProxy | None = None) -> Case:
    return Case(
        root=fresh(f"gs://{BUCKET}"),
        write_options=server.storage_options(),
        read_options=server.storage_options(proxy.endpoint if proxy else None),
        proxy=proxy,
        upstream=server.endpoint,
        flavor="gcs",
        via=server.storage_options,
    )


def b2_case(server: B2Server, proxy: FaultProxy | None = None) -> Case:
    return Case(
        root=fresh(f"b2://{BUCKET}"),
        write_options=server.storage_options(),
        read_options=server.storage_options(proxy.endpoint if proxy else None),
        proxy=proxy,
        bad_secret=BAD_SECRET,
        bad_options={**server.storage_options(), "key": BAD_SECRET},
        upstream=server.endpoint,
        flavor="b2",
        via=server.storage_options,
    )


class TestSeaweedS3(
    FetchConformance,
    ManifestConformance,
    BucketConformance,
    CredentialConformance,
    StoreErrorConformance,
    BucketErrorConformance,
    DeniedErrorConformance,
    FaultErrorConformance,
):
    @pytest.fixture
    def case(self, seaweed: S3Server) -> Case:
        return s3_case(seaweed)


class TestSeaweedS3GeneralPath(
    FetchConformance,
    StoreErrorConformance,
    BucketErrorConformance,
    DeniedErrorConformance,
    FaultErrorConformance,
):
    """The s3fs path, with the obstore fast path off (the S3 store's own option)."""

    @pytest.fixture
    def case(self, seaweed: S3Server) -> Case:
        return s3fs_case(seaweed)


class TestMotoS3(FetchConformance, ManifestConformance, BucketConformance):
    # moto's server does not check signatures, so the credential test cannot apply.
    @pytest.fixture
    def case(self, moto: S3Server) -> Case:
        return s3_case(moto)


class TestFakeGcs(
    FetchConformance,
    ManifestConformance,
    BucketConformance,
    StoreErrorConformance,
    BucketErrorConformance,
    FaultErrorConformance,
):
    # fake-gcs-server accepts any credentials, so the credential tests cannot apply.
    listing_faults = False  # gcsfs retries pages and stats itself, for about 30 s

    @pytest.fixture
    def case(self, gcs: FakeGcsServer) -> Case:
        return gcs_case(gcs)


class TestB2(
    FetchConformance,
    ManifestConformance,
    BucketConformance,
    CredentialConformance,
    StoreErrorConformance,
    BucketErrorConformance,
    DeniedErrorConformance,
    FaultErrorConformance,
):
    @pytest.fixture
    def case(self, b2: B2Server) -> Case:
        return b2_case(b2)


class TestLocalFiles(FetchConformance, ManifestConformance, StoreErrorConformance):
    @pytest.fixture
    def case(self, tmp_path: Path) -> Case:
        return Case(root=f"file://{tmp_path}", write_options={}, read_options={})


class TestMemory(FetchConformance, ManifestConformance, StoreErrorConformance):
    @pytest.fixture
    def case(self) -> Case:
        return Case(root=fresh("memory://conformance"), write_options={}, read_options={})


# -- the same suites through the fault proxy ---------------------------------------------------


def through_faults(
    server: Any, flavor: str, make_case: Callable[[Any, FaultProxy], Case]
) -> Iterator[Case]:
    with FaultProxy(server.endpoint, flavor=flavor, faults=FAULTS) as proxy:
        yield make_case(server, proxy)


class TestSeaweedS3Faults(FetchConformance, ManifestConformance):
    objects = 120

    @pytest.fixture
    def case(self, seaweed: S3Server) -> Iterator[Case]:
        yield from through_faults(seaweed, "s3", s3_case)


class TestSeaweedS3FaultsGeneralPath(FetchConformance):
    """The s3fs path (obstore fast path off) through the same faults."""

    objects = 120

    @pytest.fixture
    def case(self, seaweed: S3Server) -> Iterator[Case]:
        yield from through_faults(seaweed, "s3", s3fs_case)


class TestFakeGcsFaults(FetchConformance, ManifestConformance):
    objects = 120

    @pytest.fixture
    def case(self, gcs: FakeGcsServer) -> Iterator[Case]:
        yield from through_faults(gcs, "gcs", gcs_case)


# Under injected faults a socket of b2sdk's HTTP session is sometimes (2 of ~5 runs) left for
# the garbage collector to close. fastload closes every download response it receives; the
# socket's origin inside b2sdk/requests is not traced yet. Only that warning is tolerated here.
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning",
    "ignore:unclosed <socket.socket:ResourceWarning",
)
class TestB2Faults(FetchConformance, ManifestConformance):
    objects = 120

    @pytest.fixture
    def case(self, b2: B2Server) -> Iterator[Case]:
        yield from through_faults(b2, "b2", b2_case)
