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

__version__ = "0.1.0"

__all__ = [
    "AccessDeniedError",
    "ConfigError",
    "FastloadError",
    "MissingExtraError",
    "ObjectNotFoundError",
    "StoreError",
    "TransientStoreError",
    "__version__",
]
