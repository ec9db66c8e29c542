"""fastload: drop-in PyTorch data loading for object storage."""

from __future__ import annotations

from fastload.errors import (
    AccessDeniedError,
    ConfigError,
    FastloadError,
    MissingExtraError,
    ObjectNotFoundError,
    StoreError,
    TransientStoreError,
)
from fastload.sampler import PermutationSampler, WeightedSampler

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "ConfigError",
    "FastloadError",
    "MissingExtraError",
    "ObjectNotFoundError",
    "PermutationSampler",
    "StoreError",
    "TransientStoreError",
    "WeightedSampler",
    "__version__",
]
