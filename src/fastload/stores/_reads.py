"""Reading an object or a byte range of it, with the version the store served, timed out on
absence of progress.

A manifest records each object's version (S3's ETag, a GCS generation, a B2 file id or SHA-1,
a local file's mtime). Every read here also says which version its bytes are, so
:mod:`fastload.fetcher` can refuse bytes of an object replaced since it was indexed instead of
caching them under the old version's name (see :class:`fastload.errors.ObjectChangedError`).
GCS is asked for the indexed generation itself. A store that names no version (``memory://``)
serves ``()``, and nothing is checked.

A read times out when ``timeout`` seconds pass without a byte (before the first, then between
chunks), never on its total duration: a large object on a slow link arrives, a stalled one
fails fast (:class:`Patience`). Bodies that would arrive within ``timeout`` even at
``FLOOR_RATE`` are read in one piece (streaming cost 150 KB objects 17% more CPU); larger
ones, or of unknown size, are streamed with a watcher (S3 through obstore and s3fs, GCS and B2
through aiohttp); blocking readers (local files) write into a buffer whose growth is watched.
GCS reads go out on gcsfs's own session and credentials but not through its request helper,
which reads each body whole and retries on its own (fastload's retries apply instead).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from fsspec import AbstractFileSystem

from fastload.errors import ObjectChangedError

__all__ = ["FLOOR_RATE", "Body", "Patience", "progressing", "read"]

FLOOR_RATE = 256 << 10  # bytes/s: a body that arrives within the timeout at this rate is whole
_LOCAL_CHUNK = 1 << 20
T = TypeVar("T")


@dataclass(frozen=True)
class Patience:
    """How long a read may go without a byte, and the body's length when it is known."""

    timeout: float
    expected: int | None = None

    @property
    def whole(self) -> bool:
        """Read the body in one piece: it arrives within ``timeout`` even at ``FLOOR_RATE``."""
        return self.expected is not None and self.expected <= self.timeout * FLOOR_RATE

    @property
    def chunk(self) -> int:
        """Bytes per streamed chunk: a few per ``timeout`` at ``FLOOR_RATE`` (64 KiB-1 MiB)."""
        return int(min(1 << 20, max(64 << 10, self.timeout * FLOOR_RATE / 4)))


@dataclass(frozen=True)
class Body:
    """The bytes read, and the versions the store named for them (``()``: it named none)."""

    data: bytes
    served: tuple[str, ...] = ()


async def read(
    fs: AbstractFileSystem,
    path: str,
    span: tuple[int | None, int | None],
    *,
    version: str | None,
    executor: Executor,
    patience: Patience,
) -> Body:
    """``path``'s bytes ``span`` = ``[start, end)`` (a negative start counts from the end);
    ``TimeoutError`` after ``patience.timeout`` s without progress."""
    start, end = span
    timeout = patience.timeout
    protocols = set(_protocols(fs))
    if protocols & {"s3", "s3a"} and (start or 0) >= 0 and (end or 0) >= 0:
        return await _s3(fs, path, span, patience)
    if protocols & {"gs", "gcs"} and (end or 0) >= 0:
        return await _gcs(
            fs, path, span, version if version and version.isdigit() else None, patience
        )
    fast = getattr(fs, "read_async", None)  # a filesystem of fastload's own (b2://) that can
    if fast is not None:
        return await fast(path, span, patience)  # type: ignore[no-any-return]
    if fs.async_impl:
        data = await asyncio.wait_for(fs._cat_file(path, start=start, end=end), timeout)
        return Body(bytes(data))
    job = partial(_blocking, fs, path, start, end)
    return await _watched(job, executor, timeout)


async def progressing(
    next_chunk: Callable[[], Awaitable[T]], timeout: float, end: type[BaseException]
) -> list[T]:
    """Every chunk ``next_chunk()`` gives until it raises ``end``; ``TimeoutError`` when
    ``timeout`` seconds pass without one. (One watcher per read: a timer per chunk cost 16 MB
    bodies 47% more CPU in one measurement.)"""
    chunks: list[T] = []

    async def pump() -> None:
        with contextlib.suppress(end):
            while True:
                chunks.append(await next_chunk())

    await _watch(asyncio.ensure_future(pump()), lambda: len(chunks), timeout)
    return chunks


async def _watched(job: Callable[[io.BytesIO], Body], executor: Executor, timeout: float) -> Body:
    """``job(sink)`` on a thread, given up (``TimeoutError``) when ``sink`` stops growing."""
    sink = io.BytesIO()
    future = asyncio.get_running_loop().run_in_executor(executor, job, sink)
    return await _watch(future, sink.tell, timeout)


async def _watch(task: asyncio.Future[T], progress: Callable[[], int], timeout: float) -> T:
    """``task``'s result, or ``TimeoutError`` (``task`` cancelled) once ``progress()`` has stood
    still for ``timeout`` seconds."""
    seen = 0
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if done:
                return task.result()
            if progress() == seen:
                raise TimeoutError(f"nothing received for {timeout} s")
            seen = progress()
    finally:
        task.cancel()


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


async def _s3(fs: Any, path: str, span: tuple[int | None, int | None], patience: Patience) -> Body:
    """One GetObject through s3fs's client; the response's ETag names the version served."""
    start, end = span
    bucket, key, version_id = fs.split_path(path)
    extra = _range(start, end)
    if version_id:
        extra["VersionId"] = version_id
    timeout = patience.timeout
    response = await asyncio.wait_for(
        fs._call_s3("get_object", Bucket=bucket, Key=key, **extra), timeout
    )
    body = response["Body"]
    try:
        if patience.whole:
            data = await asyncio.wait_for(body.read(), timeout)
        else:
            data = b"".join(
                await progressing(partial(_next, body, patience.chunk), timeout, EOFError)
            )
    finally:
        body.close()
    etag = str(response.get("ETag") or "").strip('"')
    return Body(bytes(data), (etag,) if etag else ())


async def _gcs(
    fs: Any,
    path: str,
    span: tuple[int | None, int | None],
    generation: str | None,
    patience: Patience,
) -> Body:
    """One media GET of the indexed ``generation`` itself, when known (if it is gone, the
    object changed or was deleted), which is then the version served."""
    start, end = span
    if end is not None and end <= max(start or 0, 0):
        return Body(b"")
    headers = _range(start, end)
    timeout = patience.timeout
    await fs._set_session()
    response = await asyncio.wait_for(
        fs.session.get(fs.url(path, generation=generation), headers=fs._get_headers(headers)),
        timeout,
    )
    try:
        if response.status >= 400:
            content = await asyncio.wait_for(response.read(), timeout)
            if response.status == 404 and generation:
                raise ObjectChangedError(
                    f"generation {generation} is gone: the object was replaced or deleted since "
                    "the manifest was built",
                    url=f"gs://{path}",
                )
            from gcsfs.retry import validate_response  # noqa: PLC0415 (the 'gcs' extra)

            validate_response(response.status, content, path)  # raises gcsfs's own error
        if patience.whole:
            data = await asyncio.wait_for(response.read(), timeout)
        else:
            read = partial(_next, response.content, patience.chunk)
            data = b"".join(await progressing(read, timeout, EOFError))
    finally:
        response.release()
    return Body(bytes(data), (generation,) if generation else ())


def _range(start: int | None, end: int | None) -> dict[str, str]:
    """The HTTP ``Range`` header for ``[start, end)`` (a negative start: the last bytes), or
    none for the whole body."""
    if start is not None and start < 0:
        return {"Range": f"bytes={start}"}
    if end is not None:
        return {"Range": f"bytes={start or 0}-{end - 1}"}
    return {"Range": f"bytes={start}-"} if start else {}


async def _next(body: Any, size: int) -> bytes:
    chunk: bytes = await body.read(size)
    if not chunk:
        raise EOFError
    return chunk


def _blocking(
    fs: AbstractFileSystem, path: str, start: int | None, end: int | None, sink: io.BytesIO
) -> Body:
    if _protocols(fs)[0] == "file" and (start or 0) >= 0 and (end or 0) >= 0:
        return _local(path, start or 0, end, sink)
    sink.write(fs.cat_file(path, start=start, end=end))
    return Body(sink.getvalue())


def _local(path: str, start: int, end: int | None, sink: io.BytesIO) -> Body:
    """A local file's bytes, and its mtime (the version a manifest of ``file://`` records)."""
    with open(path, "rb") as f:
        mtime = os.fstat(f.fileno()).st_mtime
        f.seek(start)
        stop = None if end is None else max(start, end)
        while chunk := f.read(_LOCAL_CHUNK if stop is None else min(_LOCAL_CHUNK, stop - f.tell())):
            sink.write(chunk)
    return Body(sink.getvalue(), (str(mtime),))
