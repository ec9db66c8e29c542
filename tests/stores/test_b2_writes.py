"""Writes to ``b2://`` beyond fsspec's abstract suite: append, exclusive create against other
writers, server-side copy; and the loopback B2 server's ``b2_copy_file`` on the wire."""

from __future__ import annotations

import io
import threading
import uuid
from typing import Any

import fsspec
import pytest
import requests
from b2sdk.v2 import B2Api

from fastload.errors import ConfigError, ObjectChangedError, ObjectExistsError, ObjectNotFoundError
from fastload.stores.b2 import B2FileSystem
from fastload.testing import B2Server
from tests.conftest import BUCKET


@pytest.fixture
def fs(b2: B2Server) -> B2FileSystem:
    fs = fsspec.filesystem("b2", **b2.storage_options())  # as users get it: cached
    assert isinstance(fs, B2FileSystem)
    return fs


@pytest.fixture
def root() -> str:
    return f"{BUCKET}/writes-{uuid.uuid4().hex[:8]}"


def versions(b2: B2Server, path: str) -> list[str]:
    """The actions of every version of ``path`` (bucket/key), newest first."""
    bucket_name, key = path.split("/", 1)
    bucket = b2.api().get_bucket_by_name(bucket_name)
    return [v.action for v in bucket.list_file_versions(key)]


# -- append -------------------------------------------------------------------------------


def test_append_keeps_the_bytes_already_there(fs: B2FileSystem, root: str) -> None:
    path = f"{root}/log.txt"
    fs.pipe_file(path, b"hello ")
    with fs.open(path, "ab") as f:
        assert f.tell() == 6  # as a local file opened for append
        f.write(b"world")
    assert fs.cat_file(path) == b"hello world"


def test_append_past_the_block_size_and_to_nothing(fs: B2FileSystem, root: str) -> None:
    path = f"{root}/new.bin"
    with fs.open(path, "ab") as f:  # no object yet: append creates it
        f.write(b"0123")
    with fs.open(path, "ab", block_size=8) as f:  # flushes before close
        for i in range(5):
            f.write(bytes([65 + i]) * 7)
    assert fs.cat_file(path) == b"0123" + b"".join(bytes([65 + i]) * 7 for i in range(5))


def test_append_to_a_large_file(fs: B2FileSystem, root: str, b2: B2Server) -> None:
    """Over the 5 MB part size both the object and its new version are B2 large files."""
    path = f"{root}/big.bin"
    big = bytes(range(256)) * (24 * 1024)  # 6 MiB
    fs.pipe_file(path, big)
    with fs.open(path, "ab") as f:
        f.write(b"tail")
    assert fs.info(path)["size"] == len(big) + 4
    assert fs.cat_file(path, len(big) - 4) == big[-4:] + b"tail"
    assert versions(b2, path) == ["upload", "upload"]


def test_an_append_that_writes_nothing_makes_no_new_version(
    fs: B2FileSystem, root: str, b2: B2Server
) -> None:
    path = f"{root}/same.bin"
    fs.pipe_file(path, b"abc")
    before = fs.info(path)["version"]
    with fs.open(path, "ab"):
        pass
    assert fs.info(path)["version"] == before
    assert versions(b2, path) == ["upload"]


def test_an_append_raced_by_another_writer_raises_and_writes_nothing(
    fs: B2FileSystem, root: str, b2: B2Server
) -> None:
    path = f"{root}/raced.txt"
    fs.pipe_file(path, b"base ")
    f = fs.open(path, "ab")
    f.write(b"appended")
    fs.pipe_file(path, b"theirs")  # another writer, after this append read the object
    with pytest.raises(ObjectChangedError, match=f"b2://{path}"):
        f.close()
    assert fs.cat_file(path) == b"theirs"  # theirs stays; "base appended" would have lost it
    assert versions(b2, path) == ["upload", "upload"]  # the append's version was deleted


# -- exclusive create ------------------------------------------------------------------------


def test_exclusive_create_refuses_an_existing_object(
    fs: B2FileSystem, root: str, b2: B2Server
) -> None:
    path = f"{root}/x.bin"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(ObjectExistsError, match=f"b2://{path}") as info:
        fs.pipe_file(path, b"second", mode="create")
    assert isinstance(info.value, FileExistsError)
    with pytest.raises(FileExistsError):
        fs.open(path, "xb")
    assert fs.cat_file(path) == b"first"
    b2.api().get_bucket_by_name(BUCKET).hide_file(path.split("/", 1)[1])
    fs.pipe_file(path, b"third", mode="create")  # a hidden object is no object
    assert fs.cat_file(path) == b"third"


def test_exclusive_create_loses_to_a_writer_that_landed_first(
    fs: B2FileSystem, root: str, b2: B2Server
) -> None:
    """The check at open passed; another writer's object landed before this one's upload."""
    path = f"{root}/late.bin"
    f = fs.open(path, "xb")
    f.write(b"mine")
    fs.pipe_file(path, b"theirs", mode="create")
    with pytest.raises(ObjectExistsError, match=f"b2://{path}"):
        f.close()
    assert fs.cat_file(path) == b"theirs"
    assert versions(b2, path) == ["upload"]


def test_of_racing_exclusive_creates_exactly_one_wins(fs: B2FileSystem, root: str) -> None:
    path = f"{root}/race.bin"
    barrier = threading.Barrier(6)
    outcome: dict[int, str] = {}

    def create(i: int) -> None:
        barrier.wait()
        try:
            fs.pipe_file(path, f"writer {i}".encode(), mode="create")
            outcome[i] = "won"
        except ObjectExistsError:
            outcome[i] = "exists"

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    winners = [i for i, result in outcome.items() if result == "won"]
    assert len(outcome) == 6 and len(winners) == 1, outcome
    assert fs.cat_file(path) == f"writer {winners[0]}".encode()


def test_pipe_file_refuses_an_unknown_mode(fs: B2FileSystem, root: str) -> None:
    with pytest.raises(ConfigError, match=f"'append' for b2://{root}/m.bin"):
        fs.pipe_file(f"{root}/m.bin", b"x", mode="append")


WRITES_TO = {
    "pipe_file": lambda fs, path: fs.pipe_file(path, b""),
    "pipe_file b2://": lambda fs, path: fs.pipe_file(f"b2://{path}", b""),
    "pipe": lambda fs, path: fs.pipe({path: b""}),
    "open": lambda fs, path: fs.open(path, "wb").close(),
    "touch": lambda fs, path: fs.touch(path),
    "cp_file": lambda fs, path: fs.cp_file(path.removesuffix("dir/") + "a.bin", path),
}


@pytest.mark.parametrize("write", sorted(WRITES_TO))
def test_a_name_ending_in_a_slash_is_refused_and_nothing_is_written(
    fs: B2FileSystem, root: str, write: str
) -> None:
    """B2's file names cannot end in "/" (S3 and GCS keep such a key, a folder marker): a
    write to one is a ConfigError naming it, and nothing is written. fsspec took the "/" off
    first, so ``pipe_file("bkt/dir/", b"")`` made an object ``dir`` that later failed as a
    sample."""
    fs.pipe_file(f"{root}/a.bin", b"a")
    said = rf"b2://{root}/dir/: B2 file names cannot end in '/' .*'{root}/dir/\.bzEmpty'"
    with pytest.raises(ConfigError, match=said):
        WRITES_TO[write](fs, f"{root}/dir/")
    fs.invalidate_cache()
    assert fs.find(root) == [f"{root}/a.bin"]


# -- copy ----------------------------------------------------------------------------------


def test_copy_is_on_the_server_and_keeps_the_metadata(
    fs: B2FileSystem, root: str, b2: B2Server
) -> None:
    api = b2.api()
    source = api.get_bucket_by_name(BUCKET).upload_bytes(
        b"payload", f"{root.split('/', 1)[1]}/src.json", "application/json", {"origin": "test"}
    )
    other = f"fastload-copy-{uuid.uuid4().hex[:6]}"
    b2.create_bucket(other)
    fs.cp_file(f"b2://{root}/src.json", f"b2://{other}/dst.json")  # to another bucket
    copied = api.get_bucket_by_name(other).get_file_info_by_name("dst.json")
    assert fs.cat_file(f"{other}/dst.json") == b"payload"
    assert (copied.content_type, copied.file_info) == ("application/json", {"origin": "test"})
    assert copied.id_ != source.id_
    fs.rm(f"{other}/dst.json")


def test_copy_of_a_missing_object_names_it(fs: B2FileSystem, root: str) -> None:
    with pytest.raises(ObjectNotFoundError, match=f"b2://{root}/nothing"):
        fs.cp_file(f"{root}/nothing", f"{root}/copy")


def test_move_leaves_one_object(fs: B2FileSystem, root: str) -> None:
    fs.pipe_file(f"{root}/a/one", b"1")
    fs.mv(f"{root}/a", f"{root}/b", recursive=True)
    assert fs.find(root) == [f"{root}/b/one"]
    assert fs.cat_file(f"{root}/b/one") == b"1"


# -- b2_copy_file on the loopback server -------------------------------------------------------


def _upload(api: B2Api, name: str, data: bytes = b"0123456789") -> Any:
    return api.get_bucket_by_name(BUCKET).upload_bytes(data, name, "text/plain", {"k": "v"})


def _copy(b2: B2Server, api: B2Api, **params: Any) -> requests.Response:
    """POST b2_copy_file as B2's wire protocol has it (b2sdk refuses some requests itself)."""
    return requests.post(
        f"{b2.endpoint}/b2api/v3/b2_copy_file",
        json=params,
        headers={"Authorization": api.account_info.get_account_auth_token()},
        timeout=30,
    )


def _read(api: B2Api, file_id: str) -> bytes:
    out = io.BytesIO()
    api.download_file_by_id(file_id).save(out)
    return out.getvalue()


def test_b2_copy_file_copies_a_range_and_the_metadata(b2: B2Server) -> None:
    api = b2.api()
    name = f"route-{uuid.uuid4().hex[:8]}"
    source = _upload(api, f"{name}/src")
    whole = _copy(b2, api, sourceFileId=source.id_, fileName=f"{name}/whole")
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert (body["action"], body["fileName"], body["contentLength"]) == (
        "copy",
        f"{name}/whole",
        10,
    )
    assert (body["contentType"], body["fileInfo"]) == ("text/plain", {"k": "v"})
    assert _read(api, body["fileId"]) == b"0123456789"

    part = _copy(b2, api, sourceFileId=source.id_, fileName=f"{name}/part", range="bytes=3-6")
    assert _read(api, part.json()["fileId"]) == b"3456"
    tail = _copy(b2, api, sourceFileId=source.id_, fileName=f"{name}/tail", range="bytes=7-99")
    assert _read(api, tail.json()["fileId"]) == b"789"  # as an HTTP Range: to the end

    api.delete_file_version(body["fileId"], f"{name}/whole")  # the copy is an ordinary file


def test_b2_copy_file_replaces_the_metadata(b2: B2Server) -> None:
    api = b2.api()
    source = _upload(api, f"route-{uuid.uuid4().hex[:8]}")
    replaced = _copy(
        b2,
        api,
        sourceFileId=source.id_,
        fileName="r1",
        metadataDirective="REPLACE",
        contentType="application/octet-stream",
    ).json()
    assert (replaced["contentType"], replaced["fileInfo"]) == ("application/octet-stream", {})
    stored = api.get_file_info(replaced["fileId"])
    assert (stored.content_type, stored.file_info) == ("application/octet-stream", {})
    with_info = _copy(
        b2,
        api,
        sourceFileId=source.id_,
        fileName="r2",
        metadataDirective="REPLACE",
        contentType="text/csv",
        fileInfo={"a": "b"},
    ).json()
    assert (with_info["contentType"], with_info["fileInfo"]) == ("text/csv", {"a": "b"})


def test_b2_copy_file_to_another_bucket(b2: B2Server) -> None:
    api = b2.api()
    source = _upload(api, f"route-{uuid.uuid4().hex[:8]}")
    other = f"fastload-route-{uuid.uuid4().hex[:6]}"
    bucket = api.create_bucket(other, "allPrivate")
    copied = _copy(b2, api, sourceFileId=source.id_, fileName="x", destinationBucketId=bucket.id_)
    assert copied.json()["bucketId"] == bucket.id_
    assert [fv.file_name for fv, _ in bucket.ls()] == ["x"]


@pytest.mark.parametrize(
    ("params", "status", "code", "message"),
    [
        ({"metadataDirective": "COPY", "contentType": "text/csv"}, 400, "bad_request", "REPLACE"),
        ({"fileInfo": {"a": "b"}}, 400, "bad_request", "REPLACE only"),
        ({"metadataDirective": "REPLACE"}, 400, "bad_request", "needs a contentType"),
        ({"metadataDirective": "MERGE"}, 400, "bad_request", "'MERGE' is neither"),
        ({"range": "bytes=10-12"}, 416, "range_not_satisfiable", "outside the size"),
        ({"range": "bytes=5-2"}, 416, "range_not_satisfiable", "outside the size"),
        ({"sourceFileId": "4_zno_such_file"}, 404, "not_found", "4_zno_such_file"),
        ({"destinationBucketId": "no-such-bucket"}, 400, "bad_bucket_id", "no-such-bucket"),
    ],
)
def test_b2_copy_file_refuses_as_b2_does(
    b2: B2Server, params: dict[str, Any], status: int, code: str, message: str
) -> None:
    api = b2.api()
    source = _upload(api, f"route-{uuid.uuid4().hex[:8]}")
    answer = _copy(b2, api, **{"sourceFileId": source.id_, "fileName": "refused", **params})
    assert (answer.status_code, answer.json()["code"]) == (status, code), answer.text
    assert message in answer.json()["message"]
    assert "refused" not in {fv.file_name for fv, _ in api.get_bucket_by_name(BUCKET).ls()}
