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
    give_up: Callable[[int, BaseException], bool],
    backoff: float,
    max_backoff: float,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """``await attempt()``, again after each transient failure until ``give_up(failures, it)``.

    Not-found, access-denied and unclassified errors are raised at once; the last transient one
    is raised when ``give_up`` says so. The backoff ceiling doubles with each failure.
    """
    failures = 0
    while True:
        try:
            return await attempt()
        except Exception as exc:
            failures += 1
            if classify(exc) is not Kind.TRANSIENT or give_up(failures, exc):
                raise
            if on_retry is not None:
                on_retry(exc)
            ceiling = min(max_backoff, backoff * 2 ** min(failures - 1, 32))
            await asyncio.sleep(random.uniform(0, ceiling))
