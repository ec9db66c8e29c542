"""A Backblaze B2 native-API (v4) HTTP server that keeps its state in b2sdk's ``RawSimulator``.

No B2 server exists to install, so this one speaks the wire protocol b2sdk uses (authorize,
buckets, list file names/versions, upload, large-file parts, download by name/id with Range,
hide/delete, copy) and delegates the semantics to b2sdk's own simulator. Every URL it hands
out is built from the request's Host header, so a proxy in front of it stays in the path.

Run: ``python -m fastload.testing._b2app --port P --key-id ID --key SECRET``.
"""

from __future__ import annotations

import argparse
import base64
import enum
import functools
import io
import itertools
import json
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from aiohttp import web
from b2sdk._internal.exception import (
    AccessDenied,
    B2Error,
    DuplicateBucketName,
    FileNotPresent,
    InvalidAuthToken,
    MissingPart,
    NonExistentBucket,
    PartSha1Mismatch,
    UnsatisfiableRange,
)
from b2sdk._internal.raw_api import MetadataDirectiveMode
from b2sdk._internal.raw_simulator import BucketSimulator, RawSimulator
from b2sdk._internal.utils import b2_url_decode

API = "/b2api/{version:v[34]}"
"""b2sdk.v2 speaks v3 and b2sdk.v3 speaks v4; both see the same (v4-shaped) answers."""
PART_SIZE = 5 * 1024 * 1024
logger = logging.getLogger("fastload.testing.b2")

# b2sdk exception -> (HTTP status, B2 error code), the inverse of b2sdk's interpret_b2_error.
_ERRORS: tuple[tuple[type[BaseException], int, str], ...] = (
    (InvalidAuthToken, 401, "bad_auth_token"),
    (AccessDenied, 403, "access_denied"),
    (NonExistentBucket, 400, "bad_bucket_id"),
    (FileNotPresent, 404, "not_found"),
    (KeyError, 404, "not_found"),
    (DuplicateBucketName, 400, "duplicate_bucket_name"),
    (MissingPart, 400, "missing_part"),
    (PartSha1Mismatch, 400, "part_sha1_mismatch"),
    (UnsatisfiableRange, 416, "range_not_satisfiable"),
    (B2Error, 400, "bad_request"),
    (AssertionError, 400, "bad_request"),
    (ValueError, 400, "bad_request"),
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _jsonable(value: Any) -> Any:
    """The simulator's answers hold sets, enums and setting objects; B2 sends plain JSON."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    for method in ("as_dict", "serialize_to_json_for_request", "to_server"):
        if hasattr(value, method):
            return getattr(value, method)()
    return str(value)


_dumps = functools.partial(json.dumps, default=_jsonable)


def reply(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=_dumps)


def error_response(status: int, code: str, message: str) -> web.Response:
    return reply({"status": status, "code": code, "message": message}, status)


class _Bucket(BucketSimulator):  # type: ignore[misc]  # b2sdk is untyped
    """The simulator's bucket, without its limit of ~5,000 uploads and 200 upload URLs, and
    with B2's limit on what one ``b2_copy_file`` makes (5 GB; the simulator's is 200 bytes)."""

    MAX_SIMPLE_COPY_SIZE = 5 * 10**9

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # ids count down (newest version sorts first) and keep one width for 9e14 uploads
        self.file_id_counter = itertools.count(10**15 - 1, -1)
        self.upload_timestamp_counter = itertools.count(5000)
        self.upload_url_counter = itertools.count()


class _Simulator(RawSimulator):  # type: ignore[misc]
    BUCKET_SIMULATOR_CLASS = _Bucket


class B2App:
    """The HTTP surface over one ``RawSimulator`` holding one account."""

    def __init__(self, key_id: str, key: str) -> None:
        self.sim = _Simulator()
        account_id, _ = self.sim.create_account()
        master = self.sim.key_id_to_key.pop(account_id)
        master.application_key_id = key_id
        master.key = key
        self.sim.key_id_to_key[key_id] = master
        self.account_id = account_id

    # -- plumbing ----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 31, middlewares=[self._errors])
        app.router.add_route("*", f"{API}/b2_authorize_account", self.authorize_account)
        app.router.add_post(f"{API}/_upload", self.upload_file)
        app.router.add_post(f"{API}/_upload_part", self.upload_part)
        app.router.add_get(f"{API}/b2_download_file_by_id", self.download)
        app.router.add_get("/file/{bucket}/{name:.+}", self.download)
        app.router.add_post(API + "/{op:b2_[a-z_]+}", self.api_call)
        app.router.add_get(API + "/{op:b2_[a-z_]+}", self.api_call)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as exc:
            for kind, status, default_code in _ERRORS:
                if isinstance(exc, kind):
                    code = getattr(exc, "code", None) or default_code
                    if status == 401 and code not in ("bad_auth_token", "expired_auth_token"):
                        code = "unauthorized"
                    return error_response(status, code, str(exc) or type(exc).__name__)
            logger.exception("unexpected error in %s", request.path)
            return error_response(500, "internal_error", repr(exc))

    @staticmethod
    def _base_url(request: web.Request) -> str:
        return f"http://{request.host}"

    def _token(self, request: web.Request) -> str:
        token = request.headers.get("Authorization", "")
        if token not in self.sim.auth_token_to_key:
            raise InvalidAuthToken("auth token not valid", "bad_auth_token")
        return token

    # -- JSON API ----------------------------------------------------------------------------
    async def authorize_account(self, request: web.Request) -> web.Response:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Basic "):
            return error_response(401, "unauthorized", "basic auth required")
        key_id, _, key = base64.b64decode(header[6:]).decode().partition(":")
        result = self.sim.authorize_account("", key_id, key)
        storage = result["apiInfo"]["storageApi"]
        storage["apiUrl"] = storage["downloadUrl"] = self._base_url(request)
        storage["s3ApiUrl"] = self._base_url(request)
        # The simulator advertises 200-byte parts; real B2 says 100 MB recommended, 5 MB minimum.
        storage["recommendedPartSize"] = storage["absoluteMinimumPartSize"] = PART_SIZE
        if request.match_info["version"] == "v3":  # v3 names one allowed bucket, flat
            buckets = storage["allowed"].get("buckets") or [{"id": None, "name": None}]
            storage["bucketId"], storage["bucketName"] = buckets[0]["id"], buckets[0]["name"]
        return reply(result)

    async def api_call(self, request: web.Request) -> web.Response:
        op = request.match_info["op"]
        handler = self._OPS.get(op)
        if handler is None:
            return error_response(400, "bad_request", f"unsupported operation {op}")
        token = self._token(request)
        params = await request.json() if request.can_read_body else dict(request.query)
        result = handler(self, token, params)
        if op in ("b2_get_upload_url", "b2_get_upload_part_url"):
            # The simulator's upload token is its own upload URL; route uploads back here.
            path = "_upload" if op == "b2_get_upload_url" else "_upload_part"
            version = request.match_info["version"]
            result["uploadUrl"] = f"{self._base_url(request)}/b2api/{version}/{path}"
        return reply(result)

    def _list_buckets(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.list_buckets(
            self.sim.API_URL, token, p["accountId"], p.get("bucketId"), p.get("bucketName")
        )

    def _create_bucket(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.create_bucket(
            self.sim.API_URL,
            token,
            p["accountId"],
            p["bucketName"],
            p["bucketType"],
            bucket_info=p.get("bucketInfo"),
        )

    def _delete_bucket(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.delete_bucket(self.sim.API_URL, token, p["accountId"], p["bucketId"])

    @staticmethod
    def _start(p: dict[str, Any]) -> Any:
        # The simulator stops at the first name outside the prefix, even one sorting before
        # it, so a listing must start at the prefix (B2 itself seeks there).
        start, prefix = p.get("startFileName"), p.get("prefix")
        return prefix if prefix and (start is None or start < prefix) else start

    def _list_file_names(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.list_file_names(
            self.sim.API_URL,
            token,
            p["bucketId"],
            self._start(p),
            p.get("maxFileCount"),
            p.get("prefix"),
        )

    def _list_file_versions(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.list_file_versions(
            self.sim.API_URL,
            token,
            p["bucketId"],
            self._start(p),
            p.get("startFileId"),
            p.get("maxFileCount"),
            p.get("prefix"),
        )

    def _get_file_info(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.get_file_info_by_id(self.sim.API_URL, token, p["fileId"])

    def _get_upload_url(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.get_upload_url(self.sim.API_URL, token, p["bucketId"])

    def _get_upload_part_url(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.get_upload_part_url(self.sim.API_URL, token, p["fileId"])

    def _start_large_file(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.start_large_file(
            self.sim.API_URL,
            token,
            p["bucketId"],
            p["fileName"],
            p["contentType"],
            p.get("fileInfo") or {},
        )

    def _finish_large_file(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.finish_large_file(self.sim.API_URL, token, p["fileId"], p["partSha1Array"])

    def _cancel_large_file(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.cancel_large_file(self.sim.API_URL, token, p["fileId"])

    def _list_unfinished_large_files(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.list_unfinished_large_files(
            self.sim.API_URL,
            token,
            p["bucketId"],
            p.get("startFileId"),
            p.get("maxFileCount"),
            p.get("namePrefix"),
        )

    def _list_parts(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.list_parts(
            self.sim.API_URL, token, p["fileId"], p.get("startPartNumber"), p.get("maxPartCount")
        )

    def _delete_file_version(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.delete_file_version(self.sim.API_URL, token, p["fileId"], p["fileName"])

    def _hide_file(self, token: str, p: dict[str, Any]) -> Any:
        return self.sim.hide_file(self.sim.API_URL, token, p["bucketId"], p["fileName"])

    def _copy_file(self, token: str, p: dict[str, Any]) -> Any:
        """b2_copy_file: a new file ``fileName`` in ``destinationBucketId`` (default: the
        source's bucket) from the file ``sourceFileId``, or from the bytes ``range`` of it,
        its metadata per ``metadataDirective``."""
        source_id = p["sourceFileId"]
        bucket_id = self.sim.file_id_to_bucket_id.get(source_id)
        if bucket_id is None:
            raise FileNotPresent(file_id_or_name=source_id)
        source = self.sim._get_bucket_by_id(bucket_id).file_id_to_file[source_id]
        if source.action != "upload":
            raise ValueError(f"file {source_id} is not an uploaded file ({source.action})")
        destination = self.sim._get_bucket_by_id(p.get("destinationBucketId") or bucket_id)
        directive, content_type, file_info = self._copy_metadata(p)
        span = self._copy_range(p.get("range"), len(source.data_bytes))
        result = self.sim.copy_file(
            self.sim.API_URL,
            token,
            source_id,
            p["fileName"],
            span,
            directive,
            content_type,
            file_info,
            destination.bucket_id,
        )
        # The simulator files the copy in its bucket but not in its account's index by file
        # id, so deleting it, or finding it by id, would say "not present".
        self.sim.file_id_to_bucket_id[result["fileId"]] = destination.bucket_id
        if directive is MetadataDirectiveMode.REPLACE:  # else the source's file info stays
            copied = destination.file_id_to_file[result["fileId"]]
            copied.file_info = result["fileInfo"] = file_info or {}
        return result

    @staticmethod
    def _copy_metadata(p: dict[str, Any]) -> tuple[MetadataDirectiveMode, str | None, Any]:
        """``COPY`` (the default) takes the source's content type and file info and refuses
        either in the request; ``REPLACE`` takes them from the request: ``contentType``
        required, ``fileInfo`` empty when left out."""
        name = p.get("metadataDirective", "COPY")
        if name not in MetadataDirectiveMode.__members__:
            raise ValueError(f"metadataDirective {name!r} is neither COPY nor REPLACE")
        directive = MetadataDirectiveMode[name]
        content_type, file_info = p.get("contentType"), p.get("fileInfo")
        if directive is MetadataDirectiveMode.COPY and (
            content_type is not None or file_info is not None
        ):
            raise ValueError("contentType and fileInfo are for metadataDirective REPLACE only")
        if directive is MetadataDirectiveMode.REPLACE and content_type is None:
            raise ValueError("metadataDirective REPLACE needs a contentType")
        return directive, content_type, file_info

    def _copy_range(self, header: str | None, size: int) -> tuple[int, int] | None:
        """A copy's ``range``, read as an HTTP Range: an end past the source's end stops
        there, a start past it (or after the end) is a 416."""
        if header is None:
            return None
        start, end = self._parse_range(header, size)
        if start >= size or start > end:
            raise UnsatisfiableRange()
        return start, end

    _OPS: ClassVar[dict[str, Callable[[B2App, str, dict[str, Any]], Any]]] = {
        "b2_list_buckets": _list_buckets,
        "b2_create_bucket": _create_bucket,
        "b2_delete_bucket": _delete_bucket,
        "b2_list_file_names": _list_file_names,
        "b2_list_file_versions": _list_file_versions,
        "b2_get_file_info": _get_file_info,
        "b2_get_upload_url": _get_upload_url,
        "b2_get_upload_part_url": _get_upload_part_url,
        "b2_start_large_file": _start_large_file,
        "b2_finish_large_file": _finish_large_file,
        "b2_cancel_large_file": _cancel_large_file,
        "b2_list_unfinished_large_files": _list_unfinished_large_files,
        "b2_list_parts": _list_parts,
        "b2_delete_file_version": _delete_file_version,
        "b2_hide_file": _hide_file,
        "b2_copy_file": _copy_file,
    }

    # -- uploads -----------------------------------------------------------------------------
    async def upload_file(self, request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "")
        body = await request.read()
        info = {
            key[len("X-Bz-Info-") :].lower(): b2_url_decode(value)
            for key, value in request.headers.items()
            if key.lower().startswith("x-bz-info-")
        }
        result = self.sim.upload_file(
            token,
            token,
            b2_url_decode(request.headers["X-Bz-File-Name"]),
            len(body),
            request.headers.get("Content-Type", "b2/x-auto"),
            request.headers["X-Bz-Content-Sha1"],
            info,
            io.BytesIO(body),
        )
        return reply(result)

    async def upload_part(self, request: web.Request) -> web.Response:
        token = request.headers.get("Authorization", "")
        body = await request.read()
        result = self.sim.upload_part(
            token,
            token,
            int(request.headers["X-Bz-Part-Number"]),
            len(body),
            request.headers["X-Bz-Content-Sha1"],
            io.BytesIO(body),
        )
        return reply(result)

    # -- downloads ---------------------------------------------------------------------------
    _RANGE = re.compile(r"bytes=(\d+)-(\d*)$")

    async def download(self, request: web.Request) -> web.StreamResponse:
        token = self._token(request)
        url = self.sim.DOWNLOAD_URL + str(request.rel_url)
        with self.sim.download_file_from_url(token, url) as response:
            headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
            data: bytes = response.data_bytes
        status = 200
        header = request.headers.get("Range")
        if header:
            start, end = self._parse_range(header, len(data))
            if start >= len(data) or start > end:
                return error_response(
                    416, "range_not_satisfiable", f"range {header} of {len(data)}"
                )
            data = data[start : end + 1]
            headers["Content-Range"] = (
                f"bytes {start}-{start + len(data) - 1}/{len(response.data_bytes)}"
            )
            status = 206
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(data))
            return web.Response(status=status, headers=headers)
        return web.Response(status=status, headers=headers, body=data)

    def _parse_range(self, header: str, size: int) -> tuple[int, int]:
        match = self._RANGE.match(header.strip())
        if match is None:
            raise ValueError(f"unsupported Range header {header!r}")
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) else size - 1
        return start, min(end, size - 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key-id", required=True)
    parser.add_argument("--key", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    app = B2App(args.key_id, args.key).app()
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
