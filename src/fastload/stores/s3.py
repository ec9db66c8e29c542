"""``s3://`` through s3fs: reads as one GetObject on its client (the response's ETag names the
version served) and listing pages of ListObjectsV2. obstore, when it can, goes in front of this
(:mod:`fastload.stores._obstore`)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Any

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

__all__ = ["S3Pages", "S3Store"]


class S3Store(FsspecStore):
    """s3fs's client, called directly (not its ``cat_file``): one request, streamed when large,
    with the ETag it was served under; suffixes take fsspec's path (it knows the size)."""

    async def read(
        self, url: StoreURL, span: ByteRange, version: str | None, patience: Patience
    ) -> Body:
        if isinstance(span, Suffix):
            return await super().read(url, span, version, patience)
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
    async def page(
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
