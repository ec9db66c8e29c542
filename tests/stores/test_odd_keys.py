"""Folder markers and keys the fast path cannot parse, on real S3 servers (and B2's marker).

Web consoles make "folders" with a zero-byte ``sub/`` object (B2's writes ``sub/.bzEmpty``);
those are not samples. Keys such as ``a//b``, ``./c``, a control character, URL characters
(``#``, ``?``, ``+``) or non-ASCII ones are legal on S3
(moto keeps them; SeaweedFS refuses or rewrites some on upload): they must be listed and read
byte for byte, never lose the rest of the prefix.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from fastload.fetcher import Fetcher
from fastload.manifest import Manifest
from fastload.stores import _listing, _obstore, filesystem
from fastload.stores.s3 import S3Pages
from fastload.testing import B2Server, S3Server
from tests.conftest import BUCKET

# ("../d" and "/lead" lead outside the root: refused, see test_manifest.py)
ODD = [
    "a//b",
    "./c",
    "ctl\x01x",
    "x/./y",
    "sp ace",
    "%41",
    "tab\tkey",
    "h#1",
    "q?x=1",
    "a+b",
    "ü é",
    "br[1]*",
]
PLAIN = [f"img_{i:03d}.npy" for i in range(30)]


def _put_all(server: S3Server, prefix: str, keys: list[str]) -> list[str]:
    client = server.client()
    stored = []
    for key in keys:
        try:
            client.put_object(Bucket=BUCKET, Key=prefix + key, Body=key.encode())
        except Exception:  # SeaweedFS refuses ./ and ../ segments: not keys it can hold
            continue
        stored.append(key)
    client.put_object(Bucket=BUCKET, Key=prefix + "sub/", Body=b"")  # a console's folder
    client.put_object(Bucket=BUCKET, Key=prefix + "empty-dir/", Body=b"")
    return stored


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("server_name", ["moto", "seaweed"])
def test_markers_are_not_samples_and_odd_keys_are_read_as_they_are(
    server_name: str,
    parallel: bool,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_listing, "PAGE", 7)
    monkeypatch.setattr(_obstore, "PAGE", 7)  # obstore's pages too
    monkeypatch.setattr(_listing, "PROBE", 3)
    server: S3Server = request.getfixturevalue(server_name)
    prefix = f"odd-{uuid.uuid4().hex[:8]}/"
    stored = _put_all(server, prefix, ODD + PLAIN)
    listed = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]
    expected = sorted(o["Key"][len(prefix) :] for o in listed if not o["Key"].endswith("/"))
    assert set(PLAIN) <= set(expected) and len(stored) >= len(PLAIN) + 3  # odd keys held

    options = server.storage_options()
    manifest = Manifest.build(f"s3://{BUCKET}/{prefix}", storage_options=options, parallel=parallel)
    assert manifest.keys() == expected  # no marker, no key lost or renamed
    bodies = Fetcher(options).fetch([entry.url for entry in manifest])
    # SeaweedFS rewrites some keys on upload ("a//b" is stored as "a/b"): compare with what
    # the server lists, and the body with what was written under the original key
    written = {key.replace("//", "/").lstrip("/"): key for key in stored}
    for entry, body in zip(manifest, bodies, strict=True):
        assert body == written.get(entry.key, entry.key).encode(), entry.key


def test_empty_objects_cost_the_listing_few_requests(
    seaweed: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A page holding an empty object (a marker, Spark's _SUCCESS, a .keep) is listed through
    # botocore from there on. Listing each such range again from its start cascaded through
    # the split ranges: 2,000 keys with 20 empty files took 7,657 list requests, not 61.
    monkeypatch.setattr(_listing, "PAGE", 37)
    monkeypatch.setattr(_obstore, "PAGE", 37)
    monkeypatch.setattr(_listing, "PROBE", 6)
    options = seaweed.storage_options()
    calls = 0
    botocore_page = S3Pages.page

    async def counted(self: S3Pages, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        return await botocore_page(self, *args)

    monkeypatch.setattr(S3Pages, "page", counted)
    root = f"{BUCKET}/empty-{uuid.uuid4().hex[:8]}"
    keys = {f"img_{i:05d}.npy": b"x" for i in range(2000)}
    empties = {f"img_{i:05d}.txt": b"" for i in range(100, 2000, 97)}
    filesystem(f"s3://{BUCKET}", options).pipe(
        {f"{root}/{k}": v for k, v in (keys | empties).items()}
    )
    manifest = Manifest.build(f"s3://{root}", storage_options=options)
    assert manifest.keys() == sorted(keys | empties)
    assert calls <= 10 * len(empties), calls  # a few requests an empty object, at most


def test_b2_console_folder_markers_are_not_samples(b2: B2Server) -> None:
    root = f"b2://{BUCKET}/markers-{uuid.uuid4().hex[:8]}"
    fs = filesystem(root, b2.storage_options())
    base = fs._strip_protocol(root)
    fs.pipe({f"{base}/a.bin": b"a", f"{base}/sub/.bzEmpty": b"", f"{base}/sub/b.bin": b"b"})
    manifest = Manifest.build(root, storage_options=b2.storage_options())
    assert manifest.keys() == ["a.bin", "sub/b.bin"]
