"""URL parsing, per-process filesystems, error translation, and the b2:// fsspec filesystem."""

from __future__ import annotations

import asyncio
import inspect
import json
import pickle
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import fsspec
import pytest

from fastload.config import FetchConfig
from fastload.errors import (
    AccessDeniedError,
    ConfigError,
    MissingExtraError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)
from fastload.fetcher import Fetcher, Request
from fastload.stores import SCHEMES, Kind, _Backend, classify, filesystem, parse_url, translate
from fastload.testing import B2Server, FaultProxy, Faults
from tests.conftest import BUCKET, in_forked_child


@pytest.mark.parametrize(
    ("url", "scheme", "path"),
    [
        ("s3://bucket/key/x.npy", "s3", "bucket/key/x.npy"),
        ("S3://bucket", "s3", "bucket"),
        ("gs://b/k", "gs", "b/k"),
        ("b2://b/k", "b2", "b/k"),
        ("memory://a/b", "memory", "/a/b"),
        ("file:///tmp/x", "file", "/tmp/x"),
    ],
)
def test_parse_url(url: str, scheme: str, path: str) -> None:
    parsed = parse_url(url)
    assert (parsed.scheme, parsed.path) == (scheme, path)


def test_bare_paths_are_local_files(tmp_path: Any) -> None:
    assert parse_url(str(tmp_path)).scheme == "file"
    assert str(parse_url(tmp_path)) == f"file://{tmp_path}"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("ftp://host/x", "unknown URL scheme 'ftp'"),
        ("pipe:aws s3 cp s3://b/x.tar -", "'pipe:aws s3 cp s3://b/x.tar -' is a WebDataset pipe"),
        ("pipe:cat /data/x.tar", "'pipe:cat /data/x.tar' is a WebDataset pipe"),
        ("s3://", "malformed URL"),
        ("s3:///key", "malformed URL"),
        ("c:thing", "malformed URL"),
        ("", "non-empty URL"),
    ],
)
def test_bad_urls_are_config_errors_naming_the_url(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_url(url)


def test_missing_extra_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SCHEMES, "s3", _Backend("fastload_no_such_module", "s3", "X"))
    with pytest.raises(MissingExtraError, match=r"pip install 'fastload\[s3\]'"):
        filesystem("s3://bucket/key", {"anon": True, "uncached": 1})


def test_filesystems_are_cached_per_scheme_and_options() -> None:
    assert filesystem("s3://a", {"anon": True}) is filesystem("s3://b", {"anon": True})
    assert filesystem("s3://a", {"anon": True}) is not filesystem("s3://a", {"anon": False})


def test_a_forked_child_gets_its_own_filesystem() -> None:
    parent = filesystem("s3://bucket", {"anon": True})
    child_id = in_forked_child(lambda: id(filesystem("s3://bucket", {"anon": True})))
    # The parent's object is inherited at the same address; the child must build a new one.
    assert child_id != id(parent)


_OBSTORE_OPTIONS = {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"}


def test_an_obstore_client_made_in_the_parent_is_not_used_in_a_forked_child() -> None:
    pytest.importorskip("obstore")
    from fastload.stores import open_store

    store = open_store(parse_url("s3://bucket/x"), _OBSTORE_OPTIONS)
    assert store._store("bucket") is not None  # type: ignore[attr-defined]
    # its runtime does not survive the fork: the child takes the s3fs path, not this client
    assert in_forked_child(lambda: store._store("bucket") is None) is True  # type: ignore[attr-defined]


def test_the_obstore_fast_path_is_the_s3_store_s_own_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """obstore in front of s3fs is set in the S3 store's options (``fastload_fast_path``),
    taken out before any client sees them; FASTLOAD_FETCH_FAST_PATH is its default; the
    deprecated ``FetchConfig(fast_path=)`` still applies to a Fetcher's reads, with a
    warning that names the option."""
    pytest.importorskip("obstore")
    from fastload.config import FetchConfig
    from fastload.fetcher import Fetcher, Request
    from fastload.stores import open_store
    from fastload.stores._obstore import ObstoreStore
    from fastload.stores.s3 import FAST_PATH, S3Store

    url = parse_url("s3://bucket/x")
    off = {**_OBSTORE_OPTIONS, FAST_PATH: False}
    assert type(open_store(url, _OBSTORE_OPTIONS)) is ObstoreStore
    assert type(open_store(url, off)) is S3Store
    assert filesystem(url, off) is filesystem(url, _OBSTORE_OPTIONS)  # s3fs never sees it
    with pytest.raises(ConfigError, match=r"storage_options\['fastload_fast_path'\]"):
        open_store(url, {**_OBSTORE_OPTIONS, FAST_PATH: "no"})
    monkeypatch.setenv("FASTLOAD_FETCH_FAST_PATH", "false")
    assert type(open_store(url, _OBSTORE_OPTIONS)) is S3Store
    assert type(open_store(url, {**_OBSTORE_OPTIONS, FAST_PATH: True})) is ObstoreStore
    monkeypatch.delenv("FASTLOAD_FETCH_FAST_PATH")
    with pytest.warns(DeprecationWarning, match=r"storage_options=\{'fastload_fast_path': False\}"):
        deprecated = FetchConfig(fast_path=False)

    def store_of(fetcher: Fetcher) -> object:
        return fetcher._target(Request("s3://bucket/x"), {}).store

    assert type(store_of(Fetcher(_OBSTORE_OPTIONS, deprecated))) is S3Store
    assert (
        type(store_of(Fetcher({**_OBSTORE_OPTIONS, FAST_PATH: True}, deprecated))) is ObstoreStore
    )


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (FileNotFoundError("x"), Kind.NOT_FOUND),
        (PermissionError("x"), Kind.DENIED),
        (ConnectionResetError("x"), Kind.TRANSIENT),
        (TimeoutError("x"), Kind.TRANSIENT),
        (ValueError("x"), Kind.OTHER),
    ],
)
def test_classify_builtins(error: Exception, kind: Kind) -> None:
    assert classify(error) is kind


def test_classify_follows_the_cause_chain() -> None:
    try:
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as inner:
            raise OSError(5, "wrapped") from inner
    except OSError as outer:
        assert classify(outer) is Kind.TRANSIENT


def test_classify_botocore_and_obstore_shapes() -> None:
    from botocore.exceptions import ClientError

    slow = ClientError({"Error": {"Code": "SlowDown"}, "ResponseMetadata": {}}, "GetObject")
    denied = ClientError({"Error": {"Code": "AccessDenied"}}, "GetObject")
    assert classify(slow) is Kind.TRANSIENT
    assert classify(denied) is Kind.DENIED
    generic = type("GenericError", (Exception,), {})
    assert classify(generic("non-2xx status code: 503 Service Unavailable")) is Kind.TRANSIENT
    assert classify(generic("HTTP error: error sending request")) is Kind.TRANSIENT
    assert classify(generic("something else")) is Kind.OTHER


def test_only_a_416_that_decides_is_no_bytes_at_a_read_s_edge() -> None:
    """A read's edge answers b"" for a range the server refused as past the end (a 416), and
    for nothing else: not a 416 to a whole-object read (no range was sent), not an error
    raised after a 416 (a missing object found while handling it), not another status."""
    from botocore.exceptions import ClientError

    from fastload.stores._base import Body, Patience, Span, Suffix, read_edge

    generic = type("GenericError", (Exception,), {})
    refused = generic("Server returned non-2xx status code: 416 Range Not Satisfiable: ...")
    invalid = ClientError(
        {"Error": {"Code": "InvalidRange"}, "ResponseMetadata": {"HTTPStatusCode": 416}},
        "GetObject",
    )

    past = Span(20)

    def edge(error: Exception, span: Span | Suffix = past) -> bytes | StoreError:
        async def failing() -> Body:
            raise error

        try:
            body = asyncio.run(read_edge(parse_url("s3://b/k"), span, Patience(5), failing()))
        except StoreError as exc:
            return exc
        return bytes(body.data)

    assert edge(refused) == b""
    assert edge(refused, Suffix(5)) == b""  # (a suffix of an empty object)
    try:
        raise OSError(22, "The requested range is not satisfiable") from invalid  # s3fs's
    except OSError as wrapped:
        assert edge(wrapped) == b""
    assert type(edge(refused, Span())) is StoreError
    try:
        try:
            raise refused
        except Exception:
            raise FileNotFoundError("k") from None  # (its context is the 416)
    except FileNotFoundError as missing:
        assert isinstance(edge(missing), ObjectNotFoundError)
    assert isinstance(edge(generic("non-2xx status code: 503")), TransientStoreError)
    assert type(edge(generic("non-2xx status code: 400"))) is StoreError


def test_translated_errors_are_builtins_and_pickle() -> None:
    error = translate(ConnectionResetError("boom"), "s3://b/k")
    assert isinstance(error, TransientStoreError)
    assert isinstance(error, ConnectionError)
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is TransientStoreError
    assert clone.url == "s3://b/k"
    assert isinstance(translate(FileNotFoundError(), "u"), ObjectNotFoundError)
    assert isinstance(translate(PermissionError(), "u"), AccessDeniedError)
    assert type(translate(ValueError(), "u")) is StoreError


# -- the b2:// fsspec filesystem ----------------------------------------------------------


def test_b2_through_plain_fsspec(b2: B2Server) -> None:
    options = b2.storage_options()
    base = f"b2://{BUCKET}/fsspec-plain"
    with fsspec.open(f"{base}/dir/hello.txt", "wb", **options) as out:
        out.write(b"hello b2")
    big = bytes(range(256)) * (24 * 1024)  # 6 MiB: more than one 5 MB part
    with fsspec.open(f"{base}/big.bin", "wb", **options) as out:
        out.write(big)
    fs, path = fsspec.core.url_to_fs(base, **options)
    assert type(fs).__name__ == "B2FileSystem"
    assert fs.find(path) == [f"{path}/big.bin", f"{path}/dir/hello.txt"]
    assert fs.ls(path, detail=False) == [f"{path}/big.bin", f"{path}/dir"]
    assert fs.info(f"{path}/dir")["type"] == "directory"
    info = fs.info(f"{path}/big.bin")
    assert (info["size"], info["type"]) == (len(big), "file")
    assert info["version"]
    assert fs.cat_file(f"{path}/big.bin", 100, 200) == big[100:200]
    with fsspec.open(f"{base}/big.bin", "rb", **options) as f:
        f.seek(5 * 2**20)
        assert f.read(10) == big[5 * 2**20 : 5 * 2**20 + 10]
    fs.rm(path, recursive=True)
    assert fs.find(path) == []
    with pytest.raises(FileNotFoundError):
        fs.info(f"{path}/big.bin")


def test_b2sdk_retries_stay_off(b2: B2Server) -> None:
    """fastload overrides b2sdk's private ``B2Http._translate_and_retry`` to make one try per
    call (its own retries are counted and bounded). If b2sdk renames or stops calling it, its
    sleeping retries come back silently: this fails instead."""
    from b2sdk.v2 import B2Http

    from fastload.stores.b2 import _OneTryHttp

    hook = inspect.getattr_static(B2Http, "_translate_and_retry")
    assert isinstance(hook, classmethod)
    assert list(inspect.signature(B2Http._translate_and_retry).parameters)[:2] == [
        "fcn",
        "try_count",
    ]
    with FaultProxy(b2.endpoint, flavor="b2") as proxy:
        fs = fsspec.filesystem("b2", skip_instance_cache=True, **b2.storage_options(proxy.endpoint))
        with fs.open(f"{BUCKET}/one-try/x.bin", "wb") as out:
            out.write(b"x" * 100)
        assert isinstance(fs._api.session.raw_api.b2_http, _OneTryHttp)
        proxy.set_faults(Faults(error_503=1.0))
        proxy.reset_counters()
        started = time.monotonic()
        with pytest.raises(OSError):
            fs.ls(f"{BUCKET}/one-try", refresh=True)  # a b2sdk API call (downloads are ours)
        assert proxy.counters()["requests"] == 1  # b2sdk would try 5 times, sleeping 1 s, 1.5 s...
        assert time.monotonic() - started < 5


def test_b2_credentials_from_environment(b2: B2Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("B2_APPLICATION_KEY_ID", b2.key_id)
    monkeypatch.setenv("B2_APPLICATION_KEY", b2.key)
    fs = fsspec.filesystem("b2", realm=b2.endpoint, skip_instance_cache=True)
    assert BUCKET in fs.ls("", detail=False)
    assert b2.key not in repr(fs)


def test_b2_without_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("B2_APPLICATION_KEY_ID", raising=False)
    monkeypatch.delenv("B2_APPLICATION_KEY", raising=False)
    with pytest.raises(AccessDeniedError, match="B2_APPLICATION_KEY_ID"):
        fsspec.filesystem("b2", skip_instance_cache=True)


def test_redaction_of_credentials_in_messages() -> None:
    from fastload.stores._errors import redact, secret_values

    secrets = secret_values(
        {"key": "AKIAEXAMPLE", "token": {"refresh_token": "r3fresh"}, "endpoint_url": "http://h"}
    )
    assert secrets == {"AKIAEXAMPLE", "r3fresh"}  # endpoint_url is not a credential
    text = (
        "GET https://bucket.s3.amazonaws.com/k?X-Amz-Credential=AKIAEXAMPLE%2F2026&"
        "X-Amz-Signature=abcdef&partNumber=2 failed; url: /tokeninfo?access_token=ya29.x; "
        "proxy http://user:hunter2@proxy:3128; refresh r3fresh"
    )
    clean = redact(text, secrets)
    for leaked in ("AKIAEXAMPLE", "abcdef", "ya29.x", "hunter2", "r3fresh"):
        assert leaked not in clean, clean
    assert "partNumber=2" in clean and "proxy:3128" in clean  # the rest stays readable


def test_a_listing_splits_a_digits_place_by_digits() -> None:
    """Split points after a page of numbered keys: digits at a digit's place (the page's other
    characters, ``.jpg``'s letters, there started ranges past every key: an empty request or
    two each, 54 of 114 requests for 5,000 keys on SeaweedFS), the page's characters above."""
    from fastload.stores._base import Listed
    from fastload.stores._listing import _split_points

    page = [Listed(f"img_{i:07d}.jpg", 1, "v") for i in range(3000)]
    points = _split_points(page, "", page[-1].key, None)
    places = [[f"img_000{d}" for d in "3456789"]]
    places += [[f"img_{'0' * zeros}{d}" for d in "123456789"] for zeros in (2, 1, 0)]
    assert points == [p for place in places for p in place] + ["imgg", "imgj", "imgp", "img~"]
    assert _split_points(page, "", page[-1].key, "img_0005") == places[0][:2]  # below hi only


EXITING_READER = """
import json, sys, threading
from fastload.fetcher import Fetcher, Request
options, urls = json.loads(sys.argv[1]), json.loads(sys.argv[2])
fetcher = Fetcher(options)
for _ in range(2):
    fetcher.fetch([Request(url) for url in urls], buffers=True)
# reads in flight at exit, as a loop's lookahead leaves them when a script stops early
threading.Thread(target=fetcher.fetch, args=([Request(url) for url in urls],), daemon=True).start()
"""


def test_a_process_that_read_through_obstore_exits_cleanly(seaweed: Any) -> None:
    """obstore's runtime answers a read from a thread of its own, which takes the interpreter's
    lock; one that takes it while the interpreter finalizes is ended by it, and the process
    aborts (status 134): about one exit in four here after 20 concurrent 1.5 MB reads, every
    one answered, and with reads still in flight. At exit fastload starts no more reads,
    cancels those unanswered and lets the runtime's threads finish with the lock."""
    pytest.importorskip("obstore")
    prefix = f"exit-{uuid.uuid4().hex[:8]}"
    fs = filesystem(f"s3://{BUCKET}", seaweed.storage_options())
    urls = []
    for i in range(20):
        fs.pipe_file(f"{BUCKET}/{prefix}/{i:02d}.bin", bytes([i]) * 1_500_000)
        urls.append(f"s3://{BUCKET}/{prefix}/{i:02d}.bin")
    with FaultProxy(seaweed.endpoint, flavor="s3", faults=Faults(latency=0.02)) as proxy:
        options = json.dumps(seaweed.storage_options(proxy.endpoint))
        codes = [
            subprocess.run(
                [sys.executable, "-c", EXITING_READER, options, json.dumps(urls)],
                capture_output=True,
                timeout=120,
                check=False,
            )
            for _ in range(10)
        ]
    assert [done.returncode for done in codes] == [0] * 10, [done.stderr[-2000:] for done in codes]


def test_a_read_given_up_closes_its_connection() -> None:
    """A read that timed out is cancelled, not left running: obstore aborts the request and
    closes its connection (a request left running would hold a socket for the client's own
    timeout, an hour, outside the fetcher's limit on requests in flight). Against a server of
    the test's own that reads the request and never answers."""
    pytest.importorskip("obstore")

    closed = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))

    def silent() -> None:
        connection, _ = server.accept()
        with connection:
            connection.recv(65536)  # the request, never answered
            connection.settimeout(30)
            if connection.recv(1) == b"":  # the client closed it
                closed.set()

    threading.Thread(target=silent, daemon=True).start()
    options = {
        "key": "a",
        "secret": "b",
        "endpoint_url": f"http://127.0.0.1:{server.getsockname()[1]}",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    config = FetchConfig(timeout=0.5, retries=0, outage_budget=0, hedge_budget=0)
    with server, pytest.raises(TransientStoreError, match=r"nothing received for 0\.5 s"):
        Fetcher(options, config=config).fetch([Request("s3://b/k")])
    assert closed.wait(20), "the request given up still holds its connection"
