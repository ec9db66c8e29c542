"""Retry transient failures with full-jitter exponential backoff (one policy for every store)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastload.stores._errors import Kind, classify

T = TypeVar("T")

__all__ = ["retrying"]


async def retrying(
    attempt: Callable[[], Awaitable[T]],
    *,
    retries: int,
    backoff: float,
    max_backoff: float,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """``await attempt()``, again after each transient failure, at most ``retries`` more times.

    Not-found, access-denied and unclassified errors are raised at once; the last transient one
    is raised when the retries run out.
    """
    tries = 0
    while True:
        try:
            return await attempt()
        except Exception as exc:
            if classify(exc) is not Kind.TRANSIENT or tries >= retries:
                raise
            tries += 1
            if on_retry is not None:
                on_retry(exc)
            ceiling = min(max_backoff, backoff * 2 ** (tries - 1))
            await asyncio.sleep(random.uniform(0, ceiling))
