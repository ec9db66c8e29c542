"""The persistent cache of preprocessed samples (see :class:`Cache`)."""

from __future__ import annotations

from fastload.cache.formats import ZarrArray
from fastload.cache.store import Cache, CacheFormat, VerifyReport

__all__ = ["Cache", "CacheFormat", "VerifyReport", "ZarrArray"]
