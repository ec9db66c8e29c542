"""B2 downloads as plain HTTP GETs on the event loop, not through b2sdk's threads.

b2sdk downloads through ``requests`` on a thread, at about 5 ms of CPU per object on the
development machine (docs/benchmarks.md, the DICOM scenario): on 2 cores, that is the ceiling of
a cold epoch of small objects. A download by name is one GET with the account's token, which
aiohttp does on fsspec's IO loop (the one gcsfs uses) for a fraction of that. Authorizing,
listing and writing stay with b2sdk; a token that expires is renewed once and the GET repeated.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import os
import re
from collections.abc import Callable
from typing import Any

import aiohttp

from fastload.errors import (
    AccessDeniedError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)
from fastload.stores._base import Body, Patience, Span, http_range, progressing

__all__ = ["Downloads"]

Authorize = Callable[[bool], tuple[str, str]]  # renew? -> (download URL, auth token)
_RENEW = {"expired_auth_token", "bad_auth_token"}
_NOT_FOUND = {"not_found", "no_such_file", "file_not_present", "bad_bucket_id"}


class Downloads:
    """GETs of ``/file/<bucket>/<name>`` for one B2 account (``authorize`` says where, as whom)."""

    def __init__(self, authorize: Authorize, quote: Callable[[str], str]) -> None:
        self._authorize = authorize
        self._quote = quote
        self._auth: tuple[int, str, str] | None = None  # (pid, download URL, token)
        self._sessions: dict[tuple[int, int], aiohttp.ClientSession] = {}

    async def get(self, bucket: str, key: str, span: Span, patience: Patience) -> Body:
        """The bytes ``span`` with the file id and SHA-1 B2 names for them. A range that starts
        at or past the end is B2's 416, a :class:`StoreError` saying so (the store's read edge
        answers it as no bytes)."""
        headers = http_range(span)
        url = f"b2://{bucket}/{key}"
        timeout = patience.timeout
        for renew in (False, True):
            base, token = await self._token(renew)
            target = f"{base}/file/{bucket}/{self._quote(key)}"
            session = self._session()
            request = session.get(target, headers={**headers, "Authorization": token})
            response = await asyncio.wait_for(request, timeout)
            try:
                if response.status in (200, 206):
                    data = await _body(response, patience)
                    return _checked(response, data, span if "Range" in headers else None, url)
                code, message = await _error(response)
            finally:
                response.release()
            if response.status == 401 and code in _RENEW and not renew:
                continue
            raise _failure(response.status, code, message, url)
        raise AccessDeniedError("the renewed authorization was refused", url=url)

    async def _token(self, renew: bool) -> tuple[str, str]:
        auth = self._auth
        if renew or auth is None or auth[0] != os.getpid():
            base, token = await asyncio.to_thread(self._authorize, renew)
            self._auth = auth = (os.getpid(), base.rstrip("/"), token)
        return auth[1], auth[2]

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        where = (os.getpid(), id(loop))
        session = self._sessions.get(where)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(limit=256, ttl_dns_cache=300)
            session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
            self._sessions[where] = session
            atexit.register(_close, loop, session)
        return session


async def _body(response: aiohttp.ClientResponse, patience: Patience) -> bytes:
    if patience.whole:
        return await asyncio.wait_for(response.read(), patience.timeout)

    async def chunk() -> bytes:
        data = await response.content.read(patience.chunk)
        if not data:
            raise EOFError
        return data

    return b"".join(await progressing(chunk, patience.timeout, EOFError))


def _checked(response: aiohttp.ClientResponse, data: bytes, span: Span | None, url: str) -> Body:
    """The body with what B2 says it is. A whole object (``span`` None) must match its SHA-1
    (b2sdk checked it too: a body damaged on the way is retried, never used); a range must be
    the one asked for, as its Content-Range says."""
    sha1 = response.headers.get("x-bz-content-sha1", "").removeprefix("unverified:")
    if span is None and sha1 not in ("", "none") and hashlib.sha1(data).hexdigest() != sha1:
        raise TransientStoreError("the body does not match its SHA-1", url=url)
    answered = response.headers.get("Content-Range")
    if span is not None and answered is not None:
        _check_range(answered, span, len(data), url)
    file_id = response.headers.get("x-bz-file-id", "")
    return Body(data, tuple(v for v in (file_id, sha1) if v and v != "none"))


def _check_range(answered: str, span: Span, received: int, url: str) -> None:
    """``Content-Range: bytes FIRST-LAST/SIZE`` names bytes from ``span.start`` and as many as
    arrived; anything else is a body of other bytes (retried, never used)."""
    match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", answered.strip())
    if (
        match is None
        or int(match[1]) != span.start
        or int(match[2]) - int(match[1]) + 1 != received
    ):
        raise TransientStoreError(
            f"Content-Range {answered!r} with {received} bytes does not answer "
            f"{http_range(span)['Range']}",
            url=url,
        )


async def _error(response: aiohttp.ClientResponse) -> tuple[str, str]:
    text = await response.text(errors="replace")
    try:
        payload: Any = json.loads(text)
    except ValueError:
        return "", text[:200]
    if not isinstance(payload, dict):
        return "", text[:200]
    return str(payload.get("code", "")), str(payload.get("message", ""))[:200]


def _failure(status: int, code: str, message: str, url: str) -> StoreError:
    detail = f"B2 said {status} {code}: {message}".rstrip(": ")
    if status == 404 or code in _NOT_FOUND:  # B2 names a missing bucket with a 400
        return ObjectNotFoundError(detail, url=url)
    if status in (401, 403):
        return AccessDeniedError(detail, url=url)
    if status in (408, 429) or status >= 500:
        return TransientStoreError(detail, url=url)
    return StoreError(detail, url=url)


def _close(loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession) -> None:
    if loop.is_running() and not session.closed:
        future = asyncio.run_coroutine_threadsafe(session.close(), loop)
        try:
            future.result(timeout=2)
        except Exception:
            future.cancel()
