"""Reading an object or a byte range of it, with the version the store served.

A manifest records each object's version (S3's ETag, a GCS generation, a B2 file id or SHA-1,
a local file's mtime). Every read here also says which version its bytes are, so
:mod:`fastload.fetch` can refuse bytes of an object replaced since it was indexed instead of
caching them under the old version's name (see :class:`fastload.errors.ObjectChangedError`).
GCS is asked for the indexed generation itself. A store that names no version (``memory://``)
serves ``()``, and nothing is checked.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any

from fsspec import AbstractFileSystem

from fastload.errors import ObjectChangedError

__all__ = ["Body", "read"]


@dataclass(frozen=True)
class Body:
    """The bytes read, and the versions the store named for them (``()``: it named none)."""

    data: bytes
    served: tuple[str, ...] = ()


async def read(
    fs: AbstractFileSystem,
    path: str,
    span: tuple[int | None, int | None],
    version: str | None,
    executor: Executor,
) -> Body:
    """``path``'s bytes ``span`` = ``[start, end)`` (a negative start counts from the end)."""
    start, end = span
    protocols = set(_protocols(fs))
    if protocols & {"s3", "s3a"} and (start or 0) >= 0 and (end or 0) >= 0:
        return await _s3(fs, path, start, end)
    if protocols & {"gs", "gcs"} and version and version.isdigit():
        return await _gcs(fs, path, start, end, version)
    if fs.async_impl:
        return Body(bytes(await fs._cat_file(path, start=start, end=end)))
    own = getattr(fs, "read_body", None)  # a filesystem of fastload's own (b2://) says itself
    job: Callable[[], Body] = (
        partial(own, path, start, end) if own else partial(_blocking, fs, path, start, end)
    )
    return await asyncio.get_running_loop().run_in_executor(executor, job)


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


async def _s3(fs: Any, path: str, start: int | None, end: int | None) -> Body:
    """One GetObject through s3fs's client; the response's ETag names the version served."""
    bucket, key, version_id = fs.split_path(path)
    extra: dict[str, str] = {}
    if end is not None:
        extra["Range"] = f"bytes={start or 0}-{end - 1}"
    elif start:
        extra["Range"] = f"bytes={start}-"
    if version_id:
        extra["VersionId"] = version_id
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
    try:
        data = await response["Body"].read()
    finally:
        response["Body"].close()
    etag = str(response.get("ETag") or "").strip('"')
    return Body(bytes(data), (etag,) if etag else ())


async def _gcs(fs: Any, path: str, start: int | None, end: int | None, generation: str) -> Body:
    """The indexed generation itself: if it is gone, the object changed (or was deleted)."""
    try:
        data = await fs._cat_file(path, start=start, end=end, generation=generation)
    except FileNotFoundError as exc:
        raise ObjectChangedError(
            f"generation {generation} is gone: the object was replaced or deleted since the "
            "manifest was built",
            url=f"gs://{path}",
        ) from exc
    return Body(bytes(data), (generation,))


def _blocking(fs: AbstractFileSystem, path: str, start: int | None, end: int | None) -> Body:
    if _protocols(fs)[0] == "file" and (start or 0) >= 0 and (end or 0) >= 0:
        return _local(path, start or 0, end)
    return Body(bytes(fs.cat_file(path, start=start, end=end)))


def _local(path: str, start: int, end: int | None) -> Body:
    """A local file's bytes, and its mtime (the version a manifest of ``file://`` records)."""
    with open(path, "rb") as f:
        mtime = os.fstat(f.fileno()).st_mtime
        f.seek(start)
        data = f.read(-1 if end is None else max(0, end - start))
    return Body(data, (str(mtime),))
