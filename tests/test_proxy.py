"""The fault-injecting proxy: each fault kind on the wire, runtime control, and the real clients
(s3fs, gcsfs, b2sdk) surviving throttling and resets through it with every byte correct."""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.client
import io
import json
import os
import socket
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import NamedTuple

import pytest
from botocore.exceptions import ClientError

from fastload import ConfigError
from fastload.testing import B2Server, FakeGcsServer, FaultProxy, Faults, SeaweedS3Server
from tests.conftest import BUCKET
from tests.test_servers import gcs_fs, s3_fs


class Reply(NamedTuple):
    status: int
    headers: http.client.HTTPMessage
    body: bytes


def raw_request(endpoint: str, method: str, path: str, timeout: float = 10.0) -> Reply:
    """One plain HTTP request on a fresh connection, closed afterwards."""
    parsed = urllib.parse.urlparse(endpoint)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return Reply(response.status, response.headers, response.read())
    finally:
        conn.close()


@pytest.fixture(scope="module")
def gcs_object(gcs: FakeGcsServer) -> tuple[str, bytes]:
    """An object on fake-gcs-server readable by plain HTTP (no signatures to worry about)."""
    data = os.urandom(256 * 1024)
    name = f"proxy/{uuid.uuid4().hex}.bin"
    gcs_fs(gcs).pipe(f"{BUCKET}/{name}", data)
    quoted = urllib.parse.quote(name, safe="")
    return f"/download/storage/v1/b/{BUCKET}/o/{quoted}?alt=media", data


@pytest.fixture
def gcs_proxy(gcs: FakeGcsServer) -> Iterator[FaultProxy]:
    with FaultProxy(gcs.endpoint, flavor="gcs") as proxy:
        yield proxy


def test_clean_proxy_forwards_get_and_head_exactly(
    gcs_proxy: FaultProxy, gcs_object: tuple[str, bytes]
) -> None:
    path, data = gcs_object
    response = raw_request(gcs_proxy.endpoint, "GET", path)
    assert response.status == 200
    assert response.body == data
    head = raw_request(gcs_proxy.endpoint, "HEAD", path)
    assert int(head.headers["Content-Length"]) == len(data)
    counters = gcs_proxy.counters()
    assert counters["requests"] == counters["forwarded"] == 2
    assert counters["bytes_out"] == len(data)
    assert all(
        counters[kind] == 0 for kind in ("error_503", "error_500", "reset", "truncate", "stall")
    )


def test_latency_is_added_to_every_request(
    gcs_proxy: FaultProxy, gcs_object: tuple[str, bytes]
) -> None:
    path, _ = gcs_object
    gcs_proxy.set_faults(Faults(latency=0.2))
    started = time.monotonic()
    for _ in range(3):
        assert raw_request(gcs_proxy.endpoint, "GET", path).status == 200
    assert time.monotonic() - started >= 0.6  # a floor the proxy must honour, not a speed claim


def test_bandwidth_cap_spreads_the_body(
    gcs_proxy: FaultProxy, gcs_object: tuple[str, bytes]
) -> None:
    path, data = gcs_object
    gcs_proxy.set_faults(Faults(bandwidth=512 * 1024))  # 256 KiB at 512 KiB/s: >= 0.5 s
    started = time.monotonic()
    assert raw_request(gcs_proxy.endpoint, "GET", path).body == data
    assert time.monotonic() - started >= 0.45


def in_parallel(endpoint: str, path: str, n: int) -> list[Reply]:
    """``n`` GETs of ``path`` sent at once, each on its own connection."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: raw_request(endpoint, "GET", path), range(n)))


def test_a_total_bandwidth_cap_is_shared_by_the_responses_in_flight(
    gcs_proxy: FaultProxy, gcs_object: tuple[str, bytes]
) -> None:
    path, data = gcs_object
    gcs_proxy.set_faults(Faults(total_bandwidth=1024 * 1024))  # 3 x 256 KiB at 1 MiB/s: 0.75 s
    started = time.monotonic()
    assert [reply.body for reply in in_parallel(gcs_proxy.endpoint, path, 3)] == [data] * 3
    assert time.monotonic() - started >= 0.7  # each alone would take 0.25 s
    assert gcs_proxy.counters()["most_in_flight"] >= 2


def test_requests_above_the_throttle_limit_are_answered_503(
    gcs_proxy: FaultProxy, gcs_object: tuple[str, bytes]
) -> None:
    path, data = gcs_object
    gcs_proxy.set_faults(Faults(latency=1.0, throttle_above=1))  # the second arrives meanwhile
    replies = in_parallel(gcs_proxy.endpoint, path, 2)
    assert sorted(reply.status for reply in replies) == [200, 503]
    assert data in [reply.body for reply in replies]
    counters = gcs_proxy.counters()
    assert counters["throttled"] == 1 and counters["error_503"] == 0


@pytest.mark.parametrize(
    ("flavor", "status", "marker"),
    [
        ("s3", 503, b"<Code>SlowDown</Code>"),
        ("s3", 500, b"<Code>InternalError</Code>"),
        ("gcs", 503, b'"reason": "backendError"'),
        ("b2", 503, b'"code": "service_unavailable"'),
        ("b2", 500, b'"code": "internal_error"'),
    ],
)
def test_errors_are_shaped_like_the_provider(
    gcs: FakeGcsServer, gcs_object: tuple[str, bytes], flavor: str, status: int, marker: bytes
) -> None:
    rate = {"error_503": 1.0} if status == 503 else {"error_500": 1.0}
    with FaultProxy(gcs.endpoint, flavor=flavor, faults=Faults(**rate)) as proxy:  # type: ignore[arg-type]
        response = raw_request(proxy.endpoint, "GET", gcs_object[0])
        assert response.status == status
        assert marker in response.body
        assert proxy.counters()[f"error_{status}"] == 1


def test_reset_kills_the_connection(gcs_proxy: FaultProxy, gcs_object: tuple[str, bytes]) -> None:
    gcs_proxy.set_faults(Faults(reset=1.0))
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        raw_request(gcs_proxy.endpoint, "GET", gcs_object[0])
    assert gcs_proxy.counters()["reset"] == 1


def test_truncate_sends_full_length_and_half_the_body(
    gcs_proxy: FaultProxy, gcs_object: tuple[str, bytes]
) -> None:
    path, data = gcs_object
    gcs_proxy.set_faults(Faults(truncate=1.0))
    with pytest.raises(http.client.IncompleteRead) as info:
        raw_request(gcs_proxy.endpoint, "GET", path)
    assert info.value.partial == data[: len(data) // 2]
    assert info.value.expected == len(data) - len(data) // 2  # Content-Length promised it all


def test_stall_outlasts_a_short_client_timeout(
    gcs_proxy: FaultProxy, gcs_object: tuple[str, bytes]
) -> None:
    gcs_proxy.set_faults(Faults(stall=1.0, stall_seconds=5.0))
    with pytest.raises((TimeoutError, socket.timeout)):
        raw_request(gcs_proxy.endpoint, "GET", gcs_object[0], timeout=0.5)
    gcs_proxy.set_faults(Faults())
    path, data = gcs_object
    assert raw_request(gcs_proxy.endpoint, "GET", path).body == data


def test_method_filter_and_runtime_changes(
    gcs_proxy: FaultProxy, gcs_object: tuple[str, bytes]
) -> None:
    path, data = gcs_object
    gcs_proxy.set_faults(Faults(error_503=1.0, methods=("put",)))
    assert gcs_proxy.faults().methods == ("PUT",)
    assert raw_request(gcs_proxy.endpoint, "GET", path).body == data
    gcs_proxy.set_faults(Faults(error_503=1.0))
    assert raw_request(gcs_proxy.endpoint, "GET", path).status == 503
    gcs_proxy.reset_counters()
    assert set(gcs_proxy.counters().values()) == {0}


def test_same_seed_same_fault_sequence(gcs: FakeGcsServer, gcs_object: tuple[str, bytes]) -> None:
    def statuses() -> list[int]:
        with FaultProxy(gcs.endpoint, flavor="gcs", faults=Faults(error_503=0.5, seed=7)) as proxy:
            return [raw_request(proxy.endpoint, "GET", gcs_object[0]).status for _ in range(12)]

    first = statuses()
    assert first == statuses()
    assert set(first) == {200, 503}


@pytest.mark.parametrize(
    "bad",
    [
        {"latency": -1},
        {"error_503": 1.5},
        {"reset": 0.6, "truncate": 0.6},
        {"bandwidth": 0},
        {"total_bandwidth": -1},
        {"throttle_above": 0},
    ],
)
def test_bad_faults_are_config_errors(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="Faults"):
        Faults(**bad)  # type: ignore[arg-type]


def test_faults_round_trip_json() -> None:
    faults = Faults(latency=0.02, jitter=0.01, error_503=0.05, methods=("GET",), seed=3)
    assert Faults.from_json(faults.to_json()) == faults
    assert json.loads(faults.to_json())["error_503"] == 0.05


# -- the real clients through the proxy ------------------------------------------------------
FLAKY = Faults(latency=0.005, error_503=0.10, error_500=0.05, reset=0.05, seed=11)


def test_s3fs_survives_throttling_and_resets(seaweed: SeaweedS3Server) -> None:
    root = f"{BUCKET}/flaky-{uuid.uuid4().hex}"
    payloads = {f"{root}/{i}.bin": os.urandom(20_000 + i) for i in range(40)}
    s3_fs(seaweed).pipe(payloads)
    with FaultProxy(seaweed.endpoint, flavor="s3", faults=FLAKY) as proxy:
        fs = s3_fs(
            seaweed,
            proxy.endpoint,
            config_kwargs={"retries": {"max_attempts": 10, "mode": "standard"}},
        )
        assert sorted(fs.find(root)) == sorted(payloads)
        got = fs.cat(list(payloads))
        counters = proxy.counters()
    assert got == payloads
    assert counters["error_503"] + counters["error_500"] + counters["reset"] > 0


def test_s3_throttle_reaches_client_as_slowdown(seaweed: SeaweedS3Server) -> None:
    with (
        FaultProxy(seaweed.endpoint, flavor="s3", faults=Faults(error_503=1.0)) as proxy,
        pytest.raises(ClientError) as info,
    ):
        seaweed.client(proxy.endpoint).list_objects_v2(Bucket=BUCKET)
    assert info.value.response["Error"]["Code"] == "SlowDown"


def test_gcsfs_survives_throttling(gcs: FakeGcsServer) -> None:
    root = f"{BUCKET}/flaky-{uuid.uuid4().hex}"
    payloads = {f"{root}/{i}.bin": os.urandom(10_000 + i) for i in range(30)}
    gcs_fs(gcs).pipe(payloads)
    with FaultProxy(gcs.endpoint, flavor="gcs", faults=Faults(error_503=0.15, seed=5)) as proxy:
        fs = gcs_fs(gcs, proxy.endpoint)
        assert fs.cat(list(payloads)) == payloads
        assert proxy.counters()["error_503"] > 0


def test_b2sdk_survives_throttling_resets_and_truncation(b2: B2Server) -> None:
    bucket = b2.api().get_bucket_by_name(BUCKET)
    prefix = f"flaky-{uuid.uuid4().hex}"
    payloads = {f"{prefix}/{i}.bin": os.urandom(50_000 + i) for i in range(25)}
    for name, data in payloads.items():
        bucket.upload_bytes(data, name)
    faults = Faults(error_503=0.1, reset=0.05, truncate=0.05, methods=("GET",), seed=2)
    with FaultProxy(b2.endpoint, flavor="b2", faults=faults) as proxy:
        flaky = b2.api(proxy.endpoint).get_bucket_by_name(BUCKET)
        for name, data in payloads.items():
            out = io.BytesIO()
            flaky.download_file_by_name(name).save(out)
            assert hashlib.sha256(out.getvalue()).digest() == hashlib.sha256(data).digest(), name
        counters = proxy.counters()
    assert counters["error_503"] + counters["reset"] + counters["truncate"] > 0
