"""fastload: drop-in PyTorch data loading for object storage."""

from __future__ import annotations

from fastload.config import FetchConfig
from fastload.errors import (
    AccessDeniedError,
    ConfigError,
    FastloadError,
    MissingExtraError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)
from fastload.fetch import Fetcher, Request, fetch
from fastload.manifest import Entry, Manifest, ManifestChanges
from fastload.sampler import PermutationSampler, WeightedSampler

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "ConfigError",
    "Entry",
    "FastloadError",
    "FetchConfig",
    "Fetcher",
    "Manifest",
    "ManifestChanges",
    "MissingExtraError",
    "ObjectNotFoundError",
    "PermutationSampler",
    "Request",
    "StoreError",
    "TransientStoreError",
    "WeightedSampler",
    "__version__",
    "fetch",
]
