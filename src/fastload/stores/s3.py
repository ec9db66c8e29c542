"""``s3://`` through s3fs: reads as one GetObject on its client (the response's ETag names the
version served) and listing pages of ListObjectsV2. obstore, when it can, goes in front of this
(:mod:`fastload.stores._obstore`), unless the store's options say otherwise
(:data:`FAST_PATH`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from fastload.config import s3_fast_path
from fastload.errors import ConfigError
from fastload.stores._base import (
    Body,
    BucketPages,
    ByteRange,
    Listed,
    PageLister,
    Patience,
    Suffix,
    http_range,
    next_chunk,
    progressing,
)
from fastload.stores._fsspec import FsspecStore

if TYPE_CHECKING:
    from fastload.stores import StoreURL

__all__ = ["FAST_PATH", "S3Pages", "S3Store", "fast_path"]

#: The S3 store's own ``storage_options`` key: False reads and lists through s3fs alone (no
#: obstore in front). fastload takes it out before the options reach a client. Its prefix
#: keeps it apart from every s3fs/fsspec keyword: s3fs passes unknown keywords on to fsspec,
#: which keeps them without a word, so a plain ``fast_path`` would reach the client unnoticed
#: if it were ever left in, and could one day mean something there.
FAST_PATH = "fastload_fast_path"


def fast_path(options: Mapping[str, Any]) -> bool:
    """Whether ``options`` (a store's ``storage_options``) let obstore serve: their
    :data:`FAST_PATH`, else :func:`fastload.config.s3_fast_path` (``FASTLOAD_FETCH_FAST_PATH``)."""
    value = options.get(FAST_PATH)
    if value is None:
        return s3_fast_path()
    if not isinstance(value, bool):
        raise ConfigError(
            f"storage_options[{FAST_PATH!r}] must be True or False, got {type(value).__name__}"
        )
    return value


class S3Store(FsspecStore):
    """s3fs's client, called directly (not its ``cat_file``): one request, streamed when large,
    with the ETag it was served under; suffixes take fsspec's path (it knows the size)."""

    async def _read(
        self, url: StoreURL, span: ByteRange, version: str | None, patience: Patience
    ) -> Body:
        if isinstance(span, Suffix):
            return await super()._read(url, span, version, patience)
        bucket, key, version_id = self.fs.split_path(self.path(url))
        extra = http_range(span)
        if version_id:
            extra["VersionId"] = version_id
        timeout = patience.timeout
        response = await asyncio.wait_for(
            self.fs._call_s3("get_object", Bucket=bucket, Key=key, **extra), timeout
        )
        body = response["Body"]
        try:
            if patience.whole:
                data = await asyncio.wait_for(body.read(), timeout)
            else:
                chunks = await progressing(
                    partial(next_chunk, body, patience.chunk), timeout, EOFError
                )
                data = b"".join(chunks)
        finally:
            body.close()
        etag = str(response.get("ETag") or "").strip('"')
        return Body(bytes(data), (etag,) if etag else ())

    def lister(self, bucket: str) -> PageLister | None:
        return S3Pages(self.fs, bucket)


class S3Pages(BucketPages):
    scheme = "s3"

    async def _page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        where: dict[str, str] = {}
        if token is not None:
            where["ContinuationToken"] = token
        elif start_after:
            where["StartAfter"] = start_after
        out = await self.fs._call_s3(
            "list_objects_v2", Bucket=self.bucket, Prefix=prefix, MaxKeys=limit, **where
        )
        entries = [
            Listed(item["Key"], int(item["Size"]), str(item.get("ETag", "")).strip('"'))
            for item in out.get("Contents", [])
        ]
        more = out.get("NextContinuationToken") if out.get("IsTruncated") else None
        return entries, more
