"""``gs://`` through gcsfs's session and credentials: reads as one media GET of the indexed
generation itself (if it is gone, the object changed or was deleted), not through gcsfs's
request helper, which reads each body whole and retries on its own (fastload's retries apply
instead); listing pages of the JSON API."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Any

from fastload.errors import ObjectChangedError
from fastload.stores._base import (
    Body,
    BucketPages,
    ByteRange,
    Listed,
    PageLister,
    Patience,
    http_range,
    next_chunk,
    progressing,
)
from fastload.stores._fsspec import FsspecStore

if TYPE_CHECKING:
    from fastload.stores import StoreURL

__all__ = ["GcsPages", "GcsStore"]


class GcsStore(FsspecStore):
    async def _read(
        self, url: StoreURL, span: ByteRange, version: str | None, patience: Patience
    ) -> Body:
        if span.empty:
            return Body(b"")
        path = self.path(url)
        generation = version if version and version.isdigit() else None
        fs: Any = self.fs
        timeout = patience.timeout
        await fs._set_session()
        response = await asyncio.wait_for(
            fs.session.get(
                fs.url(path, generation=generation), headers=fs._get_headers(http_range(span))
            ),
            timeout,
        )
        try:
            if response.status >= 400:
                content = await asyncio.wait_for(response.read(), timeout)
                if response.status == 404 and generation:
                    raise ObjectChangedError(
                        f"generation {generation} is gone: the object was replaced or deleted "
                        "since the manifest was built",
                        url=f"gs://{path}",
                    )
                from gcsfs.retry import validate_response  # noqa: PLC0415 (the 'gcs' extra)

                validate_response(response.status, content, path)  # raises gcsfs's own error
            if patience.whole:
                data = await asyncio.wait_for(response.read(), timeout)
            else:
                read = partial(next_chunk, response.content, patience.chunk)
                data = b"".join(await progressing(read, timeout, EOFError))
        finally:
            response.release()
        return Body(bytes(data), (generation,) if generation else ())

    def lister(self, bucket: str) -> PageLister | None:
        return GcsPages(self.fs, bucket)


class GcsPages(BucketPages):  # file-tree order: real GCS lists in byte order, emulators may not
    scheme = "gs"

    async def _page(
        self, prefix: str, start_after: str | None, token: Any, limit: int
    ) -> tuple[list[Listed], Any]:
        where: dict[str, str] = {}
        if token is not None:
            where["pageToken"] = token
        elif start_after:
            where["startOffset"] = start_after  # inclusive: start_after itself is dropped
        out = await self.fs._call(
            "GET", "b/{}/o", self.bucket, prefix=prefix, maxResults=limit, json_out=True, **where
        )
        entries = [
            Listed(item["name"], int(item["size"]), str(item.get("generation", "")))
            for item in out.get("items", [])
            if token is not None or item["name"] != start_after
        ]
        return entries, out.get("nextPageToken")
